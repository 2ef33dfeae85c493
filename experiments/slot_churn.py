"""What closing idle slots costs when load swings (client._IDLE_KEPT).

    python experiments/slot_churn.py [--device cpu|cuda] [--high 64 --low 4] [--phase 0.5] [--repeats 3]

One asyncio client process alternates ``--high`` and ``--low`` calls in flight (``--phases`` phases
of ``--phase`` seconds) of a (1, 3, 112, 112) float32 image through a small conv net (2 model
processes, max batch 64). A swing up makes ``high - low`` slots unless the handle kept them. Modes,
interleaved, each in processes of its own: ``close`` (as shipped: beyond _IDLE_KEPT idle slots, 16,
they are closed as they come back) and ``keep`` (every slot kept). Prints calls/s and p99 per run,
then medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simpledbi import ModelConfig, Runtime, SharedModel, client  # noqa: E402

SHAPE = (1, 3, 112, 112)


def conv():
    import torch
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


async def _drive(m: SharedModel, high: int, low: int, phase: float, phases: int):
    x = np.ones(SHAPE, np.float32)
    latencies, t0 = [], time.monotonic()
    for p in range(phases):
        stop = time.monotonic() + phase

        async def caller():
            while time.monotonic() < stop:
                t = time.monotonic()
                await m.forward_async(x)
                latencies.append(time.monotonic() - t)
        await asyncio.gather(*[caller() for _ in range(high if p % 2 == 0 else low)])
    return len(latencies) / (time.monotonic() - t0), float(np.percentile(latencies, 99)) * 1e3


def _run(mode: str, a, q) -> None:
    if mode == "keep":
        client._IDLE_KEPT = 1 << 30
    cfg = ModelConfig(name="m", factory=conv, max_batch_size=64, device=a.device, model_num=2,
                      max_clients=4096)
    with Runtime([cfg]) as rt:
        with SharedModel("m", max_shape=SHAPE, namespace=rt.namespace) as m:
            asyncio.run(_drive(m, a.high, a.low, 1.0, 2))   # warm-up: every process has run
            q.put(asyncio.run(_drive(m, a.high, a.low, a.phase, a.phases)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--high", type=int, default=64)
    ap.add_argument("--low", type=int, default=4)
    ap.add_argument("--phase", type=float, default=0.5)
    ap.add_argument("--phases", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    ctx, runs = mp.get_context("spawn"), []
    for r in range(a.repeats):
        for mode in ("keep", "close"):
            q = ctx.Queue()
            p = ctx.Process(target=_run, args=(mode, a, q))
            p.start()
            rate, p99 = q.get(timeout=600)
            p.join(60)
            runs.append(dict(mode=mode, repeat=r, calls_per_s=rate, p99_ms=p99))
            print(json.dumps(runs[-1]), flush=True)
    for mode in ("keep", "close"):
        mine = [x for x in runs if x["mode"] == mode]
        print(f"{mode:5s}: {np.median([x['calls_per_s'] for x in mine]):7.0f} calls/s, "
              f"p99 {np.median([x['p99_ms'] for x in mine]):6.1f} ms (medians of {len(mine)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), runs=runs), f, indent=2)


if __name__ == "__main__":
    main()
