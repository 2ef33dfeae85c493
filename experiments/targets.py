"""The two seed commands against their plain-PyTorch baselines, in one run.

    python experiments/targets.py [--duration 10] [--warmup 3] [--json out.json]
        [--variants "input_shapes=true;batching=fixed"]

Runs, in this order and in this process tree: plain 3 x 32, simpledbi 128 workers / max batch 32 /
3 model processes / wait 0.01; plain 2 x 4, simpledbi 8 / 4 / 2 / 0.003. simpledbi runs with the
README's configuration (nothing else set: no input_shapes, adaptive batching, CUDA graphs "auto",
MPS managed by the runtime). Plain PyTorch gets its best setting: a private MPS daemon started by
this script (``--plain-mps off`` for none). ``--variants`` adds simpledbi runs with other
BenchSpec fields. Prints each report and the ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402


def pairs(model_path: str, duration: float, warmup: float, device: str):
    common = dict(model_path=model_path, duration=duration, warmup=warmup, device=device)
    big_plain = benchmark.BenchSpec(worker_num=3, worker_batch=32, dynamic_batch=False, **common)
    big_dyn = benchmark.BenchSpec(worker_num=128, worker_batch=1, max_batch_size=32, model_num=3,
                                  wait_time=0.01, **common)
    small_plain = benchmark.BenchSpec(worker_num=2, worker_batch=4, dynamic_batch=False, **common)
    small_dyn = benchmark.BenchSpec(worker_num=8, worker_batch=1, max_batch_size=4, model_num=2,
                                    wait_time=0.003, **common)
    return [("128 workers x 1 -> max batch 32, 3 model procs", big_plain, big_dyn),
            ("8 workers x 1 -> max batch 4, 2 model procs", small_plain, small_dyn)]


def _parse(current, text: str):
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes", "on")
    return type(current)(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    benchmark.add_experiment_args(ap, duration=10.0, warmup=3.0)
    ap.add_argument("--plain-mps", choices=("on", "off"), default="on")
    ap.add_argument("--variants", default="",
                    help="extra simpledbi runs: ';'-separated, each a ','-separated list of field=value")
    ap.add_argument("--only", default="", help="run only the pairs whose title contains this")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    path = benchmark.ensure_model(a.model_path, a.tiny)
    out = []
    for title, plain, dyn in pairs(path, a.duration, a.warmup, a.device):
        if a.only and a.only not in title:
            continue
        print(f"== {title}", flush=True)
        with benchmark.mps_daemon(a.plain_mps == "on"):
            base = benchmark.run_config(plain, quiet=True)
        print(f"(plain PyTorch, MPS {a.plain_mps})\n" + benchmark.format_report(base), flush=True)
        runs = [dyn] + [
            dataclasses.replace(dyn, **{k: _parse(getattr(dyn, k), v)
                                        for k, v in (kv.split("=") for kv in variant.split(","))})
            for variant in a.variants.split(";") if variant]
        for spec in runs:
            r = benchmark.run_config(spec, quiet=True)
            rs = r.get("runtime_stats", {})
            print(f"(simpledbi: mps={rs.get('mps', '?')}, cuda graphs captured={rs.get('cuda_graphs')})\n"
                  + benchmark.format_report(r, base), flush=True)
            lat = r["latency_ms"]
            out.append({"title": title, "plain_mps": a.plain_mps, "plain": base, "dynamic": r,
                        "ratio": r["throughput"] / base["throughput"],
                        "p99_over_p50": lat["p99"] / lat["p50"]})
            print(f"  => {out[-1]['ratio']:.2f}x plain; p99/p50 = {out[-1]['p99_over_p50']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
