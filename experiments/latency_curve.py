"""Latency against offered load: open-loop Poisson arrivals of single images, for dynamic batching
and for plain PyTorch (one process per worker, batch 1), under CUDA MPS. Writes JSON and a PNG.

    python experiments/latency_curve.py --out docs/curve --rates 500,1000,2000,4000,6000
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
    ap.add_argument("--rates", default="500,1000,2000,3000,4000,5000,6000")
    benchmark.add_experiment_args(ap, duration=4.0, warmup=1.5)
    ap.add_argument("--dynamic_workers", type=int, default=128)
    ap.add_argument("--plain_workers", type=int, default=16)
    ap.add_argument("--no-mps", dest="mps", action="store_false")
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    common = dict(model_path=path, duration=a.duration, warmup=a.warmup, device=a.device,
                  image_size=64 if a.tiny else 224)
    rows = []
    with benchmark.mps_daemon(a.mps):
        for rate in [float(r) for r in a.rates.split(",")]:
            for mode, spec in (
                    ("dynamic", benchmark.BenchSpec(worker_num=a.dynamic_workers, max_batch_size=32,
                                                    model_num=3, wait_time=0.005, arrival_rate=rate, **common)),
                    ("plain", benchmark.BenchSpec(worker_num=a.plain_workers, dynamic_batch=False,
                                                  arrival_rate=rate, **common))):
                r = benchmark.run_config(spec, quiet=True)
                rows.append({"mode": mode, "offered": rate, "throughput": r["throughput"],
                             "latency_ms": r["latency_ms"], "mean_batch_size": r.get("mean_batch_size")})
                print(f"{mode:8s} offered {rate:7.0f}/s  served {r['throughput']:7.0f}/s  "
                      f"p50 {r['latency_ms']['p50']:8.2f} ms  p99 {r['latency_ms']['p99']:8.2f} ms", flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, label in (("dynamic", f"simpledbi, {a.dynamic_workers} workers, max batch 32, 3 procs"),
                        ("plain", f"plain PyTorch, {a.plain_workers} processes, batch 1")):
        sel = [r for r in rows if r["mode"] == mode]
        for q, style in (("p50", "-o"), ("p99", "--x")):
            ax.plot([r["offered"] for r in sel], [r["latency_ms"][q] for r in sel], style, label=f"{label} {q}")
    ax.set_yscale("log")
    ax.set_xlabel("offered load, images/s (Poisson)")
    ax.set_ylabel("latency, ms (from arrival)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
