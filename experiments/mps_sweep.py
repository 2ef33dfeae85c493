"""The classic tables in one command: plain PyTorch processes x batch, with and without CUDA MPS,
then the two dynamic-batching seed commands. Writes a markdown table and a PNG plot.

    python experiments/mps_sweep.py --out docs/sweep [--duration 4] [--warmup 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402

PLAIN = [(1, 1), (4, 1), (8, 1), (16, 1), (1, 4), (1, 8), (1, 32), (2, 32), (3, 32), (4, 32)]
DYNAMIC = [(128, 32, 3, 0.01), (8, 4, 2, 0.003)]


def configs(path, duration, warmup, device, tiny):
    common = dict(model_path=path, duration=duration, warmup=warmup, device=device)
    if tiny:
        common["image_size"] = 64
    for procs, batch in PLAIN:
        yield f"plain {procs} x {batch}", benchmark.BenchSpec(worker_num=procs, worker_batch=batch,
                                                               dynamic_batch=False, **common)
    for workers, mb, mn, wt in DYNAMIC:
        yield (f"dynamic {workers} x 1 -> {mb}, {mn} procs, wait {wt}",
               benchmark.BenchSpec(worker_num=workers, max_batch_size=mb, model_num=mn, wait_time=wt, **common))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    width = 0.4
    for i, mps in enumerate((False, True)):
        sel = {r["name"]: r for r in rows if r["mps"] == mps}
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        axes[0].bar(xs, [sel[n]["throughput"] if n in sel else 0 for n in names], width,
                    label=f"MPS {'on' if mps else 'off'}")
        axes[1].bar(xs, [sel[n]["latency_ms"]["p50"] if n in sel else 0 for n in names], width,
                    label=f"MPS {'on' if mps else 'off'}")
    axes[0].set_ylabel("images / s")
    axes[1].set_ylabel("latency p50, ms")
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    for ax in axes:
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("ResNet-50: plain PyTorch (processes x batch) vs simpledbi dynamic batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="sweep")
    benchmark.add_experiment_args(ap, duration=4.0, warmup=2.0)
    ap.add_argument("--mps", default="off,on", help="which of off,on to run")
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    rows = []
    for mps in [m == "on" for m in a.mps.split(",")]:
        with benchmark.mps_daemon(mps):
            for name, spec in configs(path, a.duration, a.warmup, a.device, a.tiny):
                r = benchmark.run_config(spec, quiet=True)
                r.update(name=name, mps=mps)
                rows.append(r)
                print(f"MPS {'on ' if mps else 'off'} {name:42s} {r['throughput']:8.1f} img/s  "
                      f"p50 {r['latency_ms']['p50']:7.2f} ms  mean {r['latency_ms']['mean']:7.2f} ms", flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=2)
    lines = ["| configuration | MPS off img/s | MPS off p50 ms | MPS on img/s | MPS on p50 ms |",
             "|---|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["name"] for r in rows):
        cells = []
        for mps in (False, True):
            r = next((r for r in rows if r["name"] == name and r["mps"] == mps), None)
            cells += [f"{r['throughput']:.0f}", f"{r['latency_ms']['p50']:.2f}"] if r else ["", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, a.out + ".png")


if __name__ == "__main__":
    main()
