"""What ``forward_async`` costs the event loop: calls in flight against the loop's lag.

    python experiments/async_lag.py [--inflight 200 2000] [--seconds 5] [--repeats 3] [--json out.json]

One asyncio client process keeps ``--inflight`` calls of a (1, 16) float32 echo (identity model on
the CPU, one model process, max batch 64) in flight for ``--seconds``, beside a task that sleeps
1 ms at a time and records how late each wake-up comes (the loop's lag: what every other coroutine
of a web server waits). Printed per mode: calls/s, call latency p50/p99, lag p50/p99/max.
``--batch-ms 20`` makes each batch take 20 ms (a GPU model's share of the time): the loop is then
mostly idle, and its lag is what waiting costs it, not its own saturation.

Modes, interleaved, each run in a runtime and client process of its own (on 16 cores, runs that
followed a 2000-call ``threads`` run in the same processes were up to 25x slower, in both modes):
``waiter`` (the default path: calls wait in the loop, their answers watched by a watcher thread
per 127 calls, their requests sent by a sender thread while the model's queue is full) and
``threads`` (each call waits in a thread of a pool: the path kept for kernels without futex_waitv).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simpledbi import ModelConfig, Run, SharedModel, client  # noqa: E402

WIDTH = 16


def identity():
    import torch
    return torch.nn.Identity()


def slow_identity():
    """The identity, each batch taking SDBI_BATCH_MS milliseconds (a stand-in for a GPU model)."""
    import torch

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(float(os.environ["SDBI_BATCH_MS"]) / 1e3)
            return x
    return Slow()


async def _drive(model: SharedModel, inflight: int, seconds: float) -> dict:
    x = np.ones((1, WIDTH), np.float32)
    stop = time.monotonic() + 1.0 + seconds   # the first second warms up (slots made, threads started)
    t0 = time.monotonic() + 1.0
    latencies, lags = [], []

    async def caller():
        while True:
            t = time.monotonic()
            if t >= stop:
                return
            await model.forward_async(x)
            if t >= t0:
                latencies.append(time.monotonic() - t)

    cpu = {}

    async def ticker():
        while time.monotonic() < t0:
            await asyncio.sleep(0.001)
        cpu["loop"], cpu["process"] = time.thread_time(), time.process_time()
        while time.monotonic() < stop:
            t = time.monotonic()
            await asyncio.sleep(0.001)
            if t >= t0:
                lags.append(time.monotonic() - t - 0.001)

    await asyncio.gather(ticker(), *[caller() for _ in range(inflight)])
    loop_cpu, process_cpu = time.thread_time() - cpu["loop"], time.process_time() - cpu["process"]
    lat, lag = np.array(latencies) * 1e3, np.array(lags) * 1e3
    return {"calls_per_s": round(len(lat) / seconds),
            "call_p50_ms": round(float(np.percentile(lat, 50)), 2),
            "call_p99_ms": round(float(np.percentile(lat, 99)), 2),
            "lag_p50_ms": round(float(np.percentile(lag, 50)), 2),
            "lag_p99_ms": round(float(np.percentile(lag, 99)), 2),
            "lag_max_ms": round(float(lag.max()), 2),
            "loop_cpu_us": round(loop_cpu / len(lat) * 1e6, 1),      # per call: the loop thread's
            "client_cpu_us": round(process_cpu / len(lat) * 1e6, 1)}  # and the client process's


def _worker(rank: int, mode: str, inflight: int, seconds: float) -> dict:
    client._ASYNC_WATCHERS = mode == "waiter"
    model = SharedModel("echo", max_shape=(1, WIDTH))
    before = model.stats()
    row = asyncio.run(_drive(model, inflight, seconds))
    after = model.stats()
    row["mean_batch"] = round((after["requests"] - before["requests"]) /
                              max(after["batches"] - before["batches"], 1), 1)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inflight", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--modes", nargs="+", default=["waiter", "threads"], choices=["waiter", "threads"])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-ms", type=float, default=0.0,
                    help="each batch takes this long (0: the identity, as fast as it goes)")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ["SDBI_BATCH_MS"] = str(a.batch_ms)
    cfg = ModelConfig(name="echo", factory=slow_identity if a.batch_ms else identity, max_batch_size=64, device="cpu",
                      max_clients=max(a.inflight) + 64)
    rows = []
    for rep in range(a.repeats):   # each in a runtime and client process of its own
        for inflight in a.inflight:
            for mode in a.modes:
                row = Run(target=_worker, worker_num=1, args=(mode, inflight, a.seconds), models=[cfg])[0]
                row.update(mode=mode, inflight=inflight, repeat=rep)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\n{os.cpu_count()} cores; medians of {a.repeats} interleaved repeats")
    print(f"{'mode':8} {'inflight':>8} {'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'lag p50':>8} "
          f"{'lag p99':>8} {'lag max':>8}")
    summary = []
    for inflight in a.inflight:
        for mode in a.modes:
            sel = [r for r in rows if r["mode"] == mode and r["inflight"] == inflight]
            med = {k: float(np.median([r[k] for r in sel])) for k in sel[0] if k not in ("mode", "repeat")}
            med["mode"] = mode
            summary.append(med)
            print(f"{mode:8} {inflight:8d} {med['calls_per_s']:8.0f} {med['call_p50_ms']:7.2f} "
                  f"{med['call_p99_ms']:7.2f} {med['lag_p50_ms']:8.2f} {med['lag_p99_ms']:8.2f} "
                  f"{med['lag_max_ms']:8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "medians": summary, "cores": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
