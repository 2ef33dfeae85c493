"""Latency against offered load (open loop, Poisson arrivals of single images).

    python experiments/latency_curve.py --out docs/results/curve --fractions 0.05,0.25,0.5,0.75,0.9,1.2

First measures plain PyTorch's batch-1 saturation (closed loop, ``--plain_workers`` processes,
under a private MPS daemon), then offers loads at those fractions of it to: plain PyTorch batch 1
with ``--plain_workers`` and with ``--plain_workers_b`` processes (under MPS), and simpledbi (128
workers, max batch 32, 3 model processes, wait_time 0.01, MPS managed by the runtime) with the
old fixed-wait policy and with the adaptive one (``one_proc``: adaptive, one model process). Each
point prints where its slowest 1% of requests spent their time beside the median request. Writes
JSON and, with matplotlib, a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="curve")
    ap.add_argument("--fractions", default="0.05,0.25,0.5,0.75,0.9,1.2")
    benchmark.add_experiment_args(ap, duration=4.0, warmup=2.0)
    ap.add_argument("--dynamic_workers", type=int, default=128)
    ap.add_argument("--plain_workers", type=int, default=16)
    ap.add_argument("--plain_workers_b", type=int, default=4)
    ap.add_argument("--modes", default="plain,plain_b,fixed,adaptive")
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    common = dict(model_path=path, duration=a.duration, warmup=a.warmup, device=a.device,
                  image_size=64 if a.tiny else 224)
    mps = a.device != "cpu"   # (a CPU run: plain workers without a daemon)
    with benchmark.mps_daemon(mps):
        sat = benchmark.run_config(benchmark.BenchSpec(worker_num=a.plain_workers, dynamic_batch=False,
                                                       **common), quiet=True)
    saturation = sat["throughput"]
    print(f"plain PyTorch batch 1 x {a.plain_workers} processes saturates at {saturation:.0f} img/s "
          f"(p50 {sat['latency_ms']['p50']:.2f} ms)", flush=True)
    specs = {
        "plain": lambda rate: benchmark.BenchSpec(worker_num=a.plain_workers, dynamic_batch=False,
                                                  arrival_rate=rate, **common),
        "plain_b": lambda rate: benchmark.BenchSpec(worker_num=a.plain_workers_b, dynamic_batch=False,
                                                    arrival_rate=rate, **common),
        "fixed": lambda rate: benchmark.BenchSpec(worker_num=a.dynamic_workers, max_batch_size=32, model_num=3,
                                                  wait_time=0.01, batching="fixed", arrival_rate=rate, **common),
        "adaptive": lambda rate: benchmark.BenchSpec(worker_num=a.dynamic_workers, max_batch_size=32,
                                                     model_num=3, wait_time=0.01, arrival_rate=rate, **common),
        # (the same with one model process: no two batches share the device)
        "one_proc": lambda rate: benchmark.BenchSpec(worker_num=a.dynamic_workers, max_batch_size=32,
                                                     model_num=1, wait_time=0.01, arrival_rate=rate, **common),
    }
    rows = [{"mode": "saturation", "throughput": saturation, "latency_ms": sat["latency_ms"]}]
    for frac in [float(f) for f in a.fractions.split(",")]:
        rate = frac * saturation
        for mode in a.modes.split(","):
            spec = specs[mode](rate)
            with benchmark.mps_daemon(mps and mode.startswith("plain")):
                r = benchmark.run_config(spec, quiet=True)
            rows.append({"mode": mode, "fraction": frac, "offered": rate, "throughput": r["throughput"],
                         "latency_ms": r["latency_ms"], "mean_batch_size": r.get("mean_batch_size"),
                         "tail": r.get("tail")})
            print(f"{mode:9s} {frac:4.2f} x sat = {rate:7.0f}/s  served {r['throughput']:7.0f}/s  "
                  f"p50 {r['latency_ms']['p50']:8.2f} ms  p99 {r['latency_ms']['p99']:8.2f} ms  "
                  f"batch {r.get('mean_batch_size') or 1:.2f}", flush=True)
            for group, g in (r.get("tail") or {}).items():
                print(f"    {group:12s} " + "  ".join(f"{k} {v:.2f}" for k, v in g.items() if k != "n")
                      + f"  (n {g['n']})", flush=True)
            with open(a.out + ".json", "w") as f:  # after every point: a cut-short run keeps them
                json.dump({"plain_workers": a.plain_workers, "plain_workers_b": a.plain_workers_b,
                           "dynamic_workers": a.dynamic_workers, "rows": rows}, f, indent=2)
    labels = {"plain": f"plain PyTorch, batch 1, {a.plain_workers} processes",
              "plain_b": f"plain PyTorch, batch 1, {a.plain_workers_b} processes",
              "fixed": "simpledbi, fixed wait (0.1 policy)", "adaptive": "simpledbi, adaptive (default)",
              "one_proc": "simpledbi, adaptive, 1 model process"}
    benchmark.plot_latency([(label, [r for r in rows if r["mode"] == mode])
                            for mode, label in labels.items()], a.out + ".png")


if __name__ == "__main__":
    main()
