"""simpledbi in one screen: several worker processes share one model with dynamic batching.

    python sample.py                      # CPU, a small CNN built here, nothing downloaded
    python sample.py --workers 8 --device cuda --model_num 2

Each worker holds single images, calls ``model.forward`` like it would call a PyTorch module, and
checks every answer against its own local copy of the model; the runtime batches the requests of
all workers together in the model processes. At the end the sample prints, per worker, whether
every answer matched ("matches: True"), then how the requests were batched.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from simpledbi import ModelConfig, Run, SharedModel

IMAGE = (3, 32, 32)
TOLERANCE = 1e-4   # a batched forward pass may round differently from a single one


def build_model():
    """A small CNN classifier with fixed random weights (every process builds the same one)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10)).eval()


def worker(rank: int, requests: int) -> dict:
    import torch
    torch.set_num_threads(1)
    local = build_model()  # only to check the served answers in this demo
    model = SharedModel("classifier", max_shape=(1, *IMAGE))
    rng = np.random.default_rng(rank)
    worst, latencies = 0.0, []
    for _ in range(requests):
        image = rng.standard_normal((1, *IMAGE), dtype=np.float32)
        t = time.perf_counter()
        logits = model.forward(image)                # numpy in -> numpy out, batched with others
        latencies.append(time.perf_counter() - t)
        with torch.no_grad():
            expected = local(torch.from_numpy(image)).numpy()
        worst = max(worst, float(np.abs(logits - expected).max()))
    return {"rank": rank, "requests": requests, "matches": worst < TOLERANCE, "max_abs_err": worst,
            "p50_ms": 1e3 * float(np.median(latencies)), "stats": model.stats()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=50, help="requests per worker")
    ap.add_argument("--max_batch_size", type=int, default=8)
    ap.add_argument("--model_num", type=int, default=1)
    ap.add_argument("--wait_time", type=float, default=0.005)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    t = time.perf_counter()
    print(f"starting {args.model_num} model process(es) on {args.device}, then {args.workers} "
          f"workers (a few seconds: each process imports torch)...", flush=True)
    results = Run(target=worker, worker_num=args.workers, args=(args.requests,),
                  models=[ModelConfig(name="classifier", factory=build_model,
                                      max_batch_size=args.max_batch_size, model_num=args.model_num,
                                      wait_time=args.wait_time, device=args.device,
                                      input_shapes=[IMAGE])])
    elapsed = time.perf_counter() - t
    print("every answer checked against the worker's own copy of the model, run on the same image:")
    for r in results:
        print(f"  worker {r['rank']}: {r['requests']} answers, matches: {r['matches']}  (max "
              f"difference {r['max_abs_err']:.1e}; p50 latency {r['p50_ms']:.2f} ms)")
    stats = max((r["stats"] for r in results), key=lambda s: s["requests"])
    print(f"{args.workers} workers x {args.requests} requests in {elapsed:.1f} s, start-up included")
    print(f"batching: {stats['batches']} batches, {stats['mean_batch_size']:.2f} requests each on "
          f"average (max {args.max_batch_size})")
    ok = all(r["matches"] for r in results)
    print("OK: every answer matched the local model" if ok else "MISMATCH: see the workers above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
