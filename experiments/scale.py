"""Scaling: the seed's large command on every GPU of the host, and 128-512 workers on one GPU.

    python experiments/scale.py --model_path models/resnet50.pt [--duration 5] [--warmup 4]
        [--json out.json] [--only gpus|workers] [--workers 128,256,384,512]

"gpus": with N visible GPUs, in one process tree and this order --
  plain 3 x 32 on GPU 0; simpledbi 128 workers / max 32 / 3 processes / 10 ms on GPU 0
  (CUDA_VISIBLE_DEVICES=0); plain 3N x 32 on all GPUs (3 per GPU); simpledbi 128N workers /
  3N processes with device "cuda" (the README config: instances spread over every GPU, MPS managed
  by the runtime). Prints N-GPU / one-GPU and simpledbi / plain ratios.
"workers": simpledbi on GPU 0 with the README config, 128 -> 512 closed-loop workers (max 32,
  3 processes, 10 ms): throughput, p50, p99 and p99/p50 for each.
Plain PyTorch runs under a private MPS daemon started by this script (its best setting).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402
from simpledbi.mps import visible_gpu_count  # noqa: E402


@contextlib.contextmanager
def visible(devices: str):
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _line(tag: str, r: dict) -> str:
    lat = r["latency_ms"]
    return (f"{tag:<44} {r['throughput']:9.0f} img/s   p50 {lat['p50']:7.1f} ms   p99 {lat['p99']:7.1f} ms"
            f"   p99/p50 {lat['p99'] / lat['p50']:4.2f}")


def gpus(path: str, a) -> dict:
    n = max(1, visible_gpu_count())
    common = dict(model_path=path, duration=a.duration, warmup=a.warmup, device=a.device)
    plain = lambda k: benchmark.BenchSpec(worker_num=3 * k, worker_batch=32, dynamic_batch=False, **common)
    dyn = lambda k: benchmark.BenchSpec(worker_num=128 * k, worker_batch=1, max_batch_size=32,
                                        model_num=3 * k, wait_time=0.01, **common)
    out = {"gpus": n}
    with visible("0"):
        with benchmark.mps_daemon(a.device != "cpu"):
            out["plain_1"] = benchmark.run_config(plain(1), quiet=True)
        print(_line("plain 3 x 32, 1 GPU", out["plain_1"]), flush=True)
        out["simpledbi_1"] = benchmark.run_config(dyn(1), quiet=True)
        print(_line("simpledbi 128 w / 3 procs, 1 GPU", out["simpledbi_1"]), flush=True)
    with benchmark.mps_daemon(a.device != "cpu"):
        out["plain_n"] = benchmark.run_config(plain(n), quiet=True)
    print(_line(f"plain {3 * n} x 32, {n} GPUs", out["plain_n"]), flush=True)
    out["simpledbi_n"] = benchmark.run_config(dyn(n), quiet=True)
    print(_line(f"simpledbi {128 * n} w / {3 * n} procs, {n} GPUs", out["simpledbi_n"]), flush=True)
    t = {k: v["throughput"] for k, v in out.items() if isinstance(v, dict)}
    out["scaling"] = t["simpledbi_n"] / (n * t["simpledbi_1"])
    out["vs_plain_n"] = t["simpledbi_n"] / t["plain_n"]
    out["vs_plain_1"] = t["simpledbi_1"] / t["plain_1"]
    out["plain_scaling"] = t["plain_n"] / (n * t["plain_1"])
    print(f"=> simpledbi {n} GPUs = {out['scaling']:.3f} x N x one GPU; {out['vs_plain_n']:.3f}x plain "
          f"on {n} GPUs; one GPU {out['vs_plain_1']:.3f}x plain; plain scales {out['plain_scaling']:.3f}",
          flush=True)
    return out


def workers(path: str, a) -> dict:
    out = {}
    with visible("0"):
        for w in [int(x) for x in a.workers.split(",")]:
            spec = benchmark.BenchSpec(worker_num=w, worker_batch=1, max_batch_size=32, model_num=3,
                                       wait_time=0.01, model_path=path, duration=a.duration,
                                       warmup=a.warmup, device=a.device)
            out[w] = benchmark.run_config(spec, quiet=True)
            print(_line(f"simpledbi {w} workers, 1 GPU", out[w]), flush=True)
    peak = max(r["throughput"] for r in out.values())
    for w, r in out.items():
        print(f"  {w} workers: {r['throughput'] / peak:.3f} of peak", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_experiment_args(ap, duration=5.0, warmup=4.0)
    ap.add_argument("--only", default="", choices=("", "gpus", "workers"))
    ap.add_argument("--workers", default="128,256,384,512")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    out = {}
    if a.only in ("", "workers"):
        out["workers"] = workers(path, a)
    if a.only in ("", "gpus"):
        out["gpus"] = gpus(path, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()
