"""p99 latency against offered load with ``ModelConfig(latency_target=...)``, and without.

    python experiments/latency_target.py --target 0.02 --rates 1000,2000,4000,6000,8000

simpledbi (128 workers, max batch 32, 3 model processes, wait_time 0.01, MPS managed by the
runtime), open-loop Poisson arrivals. Reports served load, p50/p99 and the runtime's
``over_target`` count per rate; writes JSON and, with matplotlib, a PNG.
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
    ap.add_argument("--out", default="latency_target")
    ap.add_argument("--target", type=float, default=0.02, help="seconds")
    ap.add_argument("--rates", default="1000,2000,4000,6000,8000")
    ap.add_argument("--workers", type=int, default=128)
    benchmark.add_experiment_args(ap, duration=4.0, warmup=2.0)
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    common = dict(model_path=path, duration=a.duration, warmup=a.warmup, device=a.device,
                  image_size=64 if a.tiny else 224, worker_num=a.workers, max_batch_size=32,
                  model_num=3, wait_time=0.01)
    rows = []
    for rate in [float(r) for r in a.rates.split(",")]:
        for target in (a.target, 0.0):
            r = benchmark.run_config(benchmark.BenchSpec(arrival_rate=rate, latency_target=target, **common),
                                     quiet=True)
            rs = r.get("runtime_stats", {})
            rows.append({"target": target, "offered": rate, "throughput": r["throughput"],
                         "latency_ms": r["latency_ms"], "mean_batch_size": r.get("mean_batch_size"),
                         "over_target": rs.get("over_target"), "requests": rs.get("requests")})
            print(f"target {target * 1e3:5.1f} ms  offered {rate:7.0f}/s  served {r['throughput']:7.0f}/s  "
                  f"p50 {r['latency_ms']['p50']:7.2f}  p99 {r['latency_ms']['p99']:7.2f} ms  "
                  f"batch {r.get('mean_batch_size') or 0:5.2f}  over target {rs.get('over_target')}"
                  f"/{rs.get('requests')}", flush=True)
            with open(a.out + ".json", "w") as f:  # after every point: a cut-short run keeps them
                json.dump({"target_s": a.target, "rows": rows}, f, indent=2)
    benchmark.plot_latency(
        [(f"latency_target={a.target * 1e3:.0f} ms", [r for r in rows if r["target"] == a.target]),
         ("no target", [r for r in rows if r["target"] == 0.0])], a.out + ".png", hline_ms=a.target * 1e3)


if __name__ == "__main__":
    main()
