"""The seed commands and the fast-model command against their plain-PyTorch baselines, in one run.

    python experiments/targets.py [--commands seed|fast|all] [--duration 10] [--warmup 3]
        [--json out.json] [--fast_model resnet18[,encoder]] [--variants "input_shapes=true;batching=fixed"]

"seed" (default) runs, in this order and in this process tree: plain 3 x 32, simpledbi 128
workers / max batch 32 / 3 model processes / wait 0.01; plain 2 x 4, simpledbi 8 / 4 / 2 / 0.003
(ResNet-50 at 224, or --model_path). "fast" runs plain 3 x 32 and simpledbi 128 / 32 / 3 / 0.01
with a fast model built in code (--fast_model, default resnet18 at 112 x 112, whose batch-32
forward is meant to take about 1 ms on an H100/H200, so the runtime's own cost shows); "all" runs
both. simpledbi runs
with the README's configuration (nothing else set: no input_shapes, adaptive batching, CUDA
graphs "auto", MPS managed by the runtime, the device given). Plain PyTorch gets its best
setting: a private MPS daemon started by this script (``--plain-mps off`` for none).
``--variants`` adds simpledbi runs with other BenchSpec fields.

Prints one line per run (img/s, latency, CPU time per request: clients, model processes,
supervisor) and the ratio; ``--full`` prints benchmark.py's whole report instead. ``--json``
gets every figure, rewritten after each pair so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402
import fake_models  # noqa: E402

# (title, plain (processes, batch), simpledbi (workers, max_batch_size, model_num, wait_time))
SEED = [("128 workers x 1 -> max batch 32, 3 model procs", (3, 32), (128, 32, 3, 0.01)),
        ("8 workers x 1 -> max batch 4, 2 model procs", (2, 4), (8, 4, 2, 0.003))]
FAST = [("128 workers x 1 -> max batch 32, 3 model procs", (3, 32), (128, 32, 3, 0.01))]


def _pairs(table, model: str, model_path: str, duration: float, warmup: float, device: str):
    common = dict(model=model, model_path=model_path, duration=duration, warmup=warmup, device=device)
    for title, (procs, batch), (workers, max_batch, model_num, wait) in table:
        yield (title,
               benchmark.BenchSpec(worker_num=procs, worker_batch=batch, dynamic_batch=False, **common),
               benchmark.BenchSpec(worker_num=workers, worker_batch=1, max_batch_size=max_batch,
                                   model_num=model_num, wait_time=wait, **common))


def pairs(model_path: str, duration: float, warmup: float, device: str, model: str = "resnet50"):
    """The seed commands: [(title, plain spec, simpledbi spec)]."""
    return list(_pairs(SEED, model, model_path, duration, warmup, device))


def _parse(current, text: str):
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes", "on")
    return type(current)(text)


def _line(tag: str, r: dict) -> str:
    lat, c = r["latency_ms"], r["config"]
    item = benchmark.item_name(c["model"])
    out = (f"  {tag:<26} {r['throughput']:8.0f} {item}s/s  p50 {lat['p50']:6.2f}  p99 {lat['p99']:6.2f} ms"
           + (f"  mean batch {r['mean_batch_size']:5.2f}" if "mean_batch_size" in r else ""))
    cpu = r.get("cpu")
    if cpu:
        us, per = cpu["per_request_us"], cpu["per_item_us"]["total"]
        parts = " + ".join(f"{g} {us[g]:.0f}" for g in ("clients", "model", "supervisor") if g in us)
        out += (f"\n  {'':<26} CPU/request {parts} = {us['total']:.0f} us"
                + (f" (per {item} {per:.1f} us)" if c["worker_batch"] > 1 else ""))
        if cpu["unread_processes"]:
            out += f", {cpu['unread_processes']} processes not read at both ends"
    return out


def _run(spec, full: bool, tag: str, base=None):
    t = time.monotonic()
    r = benchmark.run_config(spec, quiet=True)
    r["wall_s"] = time.monotonic() - t   # start-up, warm-up, window and shutdown
    print(benchmark.format_report(r, base) if full else _line(tag, r) + f"   [{r['wall_s']:.0f} s]", flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_experiment_args(ap, duration=10.0, warmup=3.0)
    ap.add_argument("--commands", choices=("seed", "fast", "all"), default="seed",
                    help="the seed commands (ResNet-50), the fast-model command, or both (seed first)")
    ap.add_argument("--fast_model", default="resnet18",
                    help=f"model(s) of the fast command, ','-separated, of {', '.join(fake_models.MODELS)} "
                         "(default: resnet18, at 112 x 112)")
    ap.add_argument("--plain-mps", choices=("on", "off"), default="on")
    ap.add_argument("--variants", default="",
                    help="extra simpledbi runs: ';'-separated, each a ','-separated list of field=value")
    ap.add_argument("--only", default="", help="run only the pairs whose title contains this")
    ap.add_argument("--full", action="store_true", help="print benchmark.py's whole report of each run")
    ap.add_argument("--json", default="", help="write every figure of every run to this file")
    a = ap.parse_args(argv)
    fast_models = [m for m in a.fast_model.split(",") if m]
    for m in fast_models:
        fake_models.item_shape(m)   # an unknown name fails here, before anything runs
    todo = []
    if a.commands in ("seed", "all"):
        path = benchmark.ensure_model(a.model_path, a.tiny)
        todo += [("seed", t, p, d) for t, p, d in
                 _pairs(SEED, "tiny" if a.tiny else "resnet50", path, a.duration, a.warmup, a.device)]
    if a.commands in ("fast", "all"):
        for m in fast_models:
            path = benchmark.ensure_model("", model=m)
            todo += [("fast", t, p, d) for t, p, d in _pairs(FAST, m, path, a.duration, a.warmup, a.device)]
    out = []
    for command, title, plain, dyn in todo:
        if a.only and a.only not in title:
            continue
        model = plain.model + (f"@{plain.image_size}" if fake_models.default_image_size(plain.model) else "")
        print(f"== {command}: {model}, {title}", flush=True)
        with benchmark.mps_daemon(a.plain_mps == "on"):
            base = _run(plain, a.full, f"plain {plain.worker_num} x {plain.worker_batch} (MPS {a.plain_mps})")
        runs = [dyn] + [
            dataclasses.replace(dyn, **{k: _parse(getattr(dyn, k), v)
                                        for k, v in (kv.split("=") for kv in variant.split(","))})
            for variant in a.variants.split(";") if variant]
        for i, spec in enumerate(runs):
            r = _run(spec, a.full, "simpledbi" + (f" variant {i}" if i else ""), base)
            rs, lat = r.get("runtime_stats", {}), r["latency_ms"]
            out.append({"command": command, "model": spec.model, "image_size": spec.image_size,
                        "title": title, "plain_mps": a.plain_mps, "plain": base, "dynamic": r,
                        "ratio": r["throughput"] / base["throughput"],
                        "p99_over_p50": lat["p99"] / lat["p50"]})
            cpu = r.get("cpu", {}).get("per_request_us", {})
            plain_cpu = base.get("cpu", {}).get("per_item_us", {})
            item = benchmark.item_name(spec.model)
            print(f"  => {out[-1]['ratio']:.2f}x plain ({r['throughput']:.0f} vs {base['throughput']:.0f} {item}s/s);"
                  f" p99/p50 {out[-1]['p99_over_p50']:.2f}; mps={rs.get('mps', '?')},"
                  f" graphs captured={rs.get('cuda_graphs')}"
                  + (f"; CPU per image {cpu['total']:.0f} vs plain {plain_cpu['total']:.0f} us"
                     if "total" in cpu and "total" in plain_cpu else ""), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
