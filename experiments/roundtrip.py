"""The runtime's own cost per request: the echo table (issue 20), floors measured in the same run.

    python experiments/roundtrip.py [--n 5000] [--workers 8 --seconds 5] [--repeats 3] [--json out.json]

(a) two processes pass a token back and forth through two posix_ipc semaphores (ping-pong);
(b) the protocol-free floor (experiments/roundtrip_floor.py): a request through shared memory
    and two semaphores, no slot protocol, no validation, no batching policy, no bookkeeping;
(c) one worker sends a (1, 16) float32 tensor through simpledbi to an identity model on the CPU
    (max_batch_size 8, one model process); p50/p90/p99 in microseconds;
(d) ``--workers`` closed-loop echo workers through simpledbi, and (e) the batching floor with as
    many clients: requests per second.
With ``--repeats N`` the whole set runs N times, interleaved, and medians are printed. (c) also
prints where its time goes (``SharedModel.last_timing``), p50 of each stage.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import posix_ipc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simpledbi import ModelConfig, Run, RuntimeOptions, SharedModel  # noqa: E402
from simpledbi.shm import new_namespace, sweep_namespace  # noqa: E402


def _pong(prefix: str, n: int) -> None:
    ping, pong = posix_ipc.Semaphore(prefix + ".ping"), posix_ipc.Semaphore(prefix + ".pong")
    for _ in range(n):
        ping.acquire()
        pong.release()


def semaphore_pingpong(n: int) -> np.ndarray:
    prefix = "/" + new_namespace()
    ping = posix_ipc.Semaphore(prefix + ".ping", posix_ipc.O_CREX)
    pong = posix_ipc.Semaphore(prefix + ".pong", posix_ipc.O_CREX)
    p = mp.get_context("spawn").Process(target=_pong, args=(prefix, n + 500))
    p.start()
    try:
        ts = []
        for i in range(n + 500):
            t = time.perf_counter()
            ping.release()
            pong.acquire()
            if i >= 500:
                ts.append(time.perf_counter() - t)
        return np.array(ts) * 1e6
    finally:
        p.join(30)
        for s in (ping, pong):
            s.unlink()
            s.close()
        sweep_namespace(prefix[1:])  # the namespace directory new_namespace made


def identity():
    import torch
    return torch.nn.Identity()


STAGES = ("call -> published", "published -> batch closed", "batch closed -> answer written",
          "answer written -> caller running", "caller running -> returned")


WIDTH = 16   # the echo request: (1, WIDTH) float32


def _echo_worker(rank: int, n: int) -> tuple:
    model = SharedModel("echo", max_shape=(1, WIDTH))
    x = np.ones((1, WIDTH), np.float32)
    for _ in range(500):
        model.forward(x)
    ts, stages = [], []
    for _ in range(n):
        t0, t = time.monotonic(), time.perf_counter()
        model.forward(x)
        ts.append(time.perf_counter() - t)
        t1 = time.monotonic()
        tm = model.last_timing()   # where it went (time.monotonic stamps of both processes)
        stages.append((tm["published"] - t0, tm["batch_closed"] - tm["published"],
                       tm["done"] - tm["batch_closed"], tm["woken"] - tm["done"], t1 - tm["woken"]))
    return np.array(ts) * 1e6, np.array(stages) * 1e6


def echo_roundtrip(n: int) -> tuple:
    cfg = ModelConfig(name="echo", factory=identity, max_batch_size=8, wait_time=0.001, device="cpu",
                      num_threads=1)
    return Run(target=_echo_worker, worker_num=1, args=(n,), models=[cfg], options=RuntimeOptions())[0]


def _throughput_worker(rank: int, seconds: float, start: float) -> tuple:
    model = SharedModel("echo", max_shape=(1, WIDTH))
    x = np.ones((1, WIDTH), np.float32)
    for _ in range(200):
        model.forward(x)
    while time.monotonic() < start:  # every worker starts measuring at the same moment
        time.sleep(0.001)
    n, end = 0, start + seconds
    while time.monotonic() < end:
        model.forward(x)
        n += 1
    return n, model.stats()


def echo_throughput(workers: int, seconds: float) -> dict:
    """``workers`` processes send the echo request in a closed loop for ``seconds``."""
    cfg = ModelConfig(name="echo", factory=identity, max_batch_size=8, device="cpu",
                      num_threads=1)
    start = time.monotonic() + 3.0 + 0.3 * workers
    out = Run(target=_throughput_worker, worker_num=workers, args=(seconds, start), models=[cfg])
    n = sum(o[0] for o in out)
    return {"workers": workers, "requests_per_s": n / seconds,
            "mean_batch_size": out[0][1]["mean_batch_size"]}


def once(a) -> dict:
    from roundtrip_floor import floor_roundtrip, floor_throughput
    out = {}
    for name, ts in (("semaphore ping-pong", semaphore_pingpong(a.n)),
                     ("protocol-free floor", floor_roundtrip(a.n)),
                     ("simpledbi echo", None)):
        if ts is None:
            ts, stages = echo_roundtrip(a.n)
            out["echo stages p50_us"] = {k: float(v) for k, v in zip(STAGES, np.median(stages, axis=0))}
        p50, p90, p99 = np.percentile(ts, [50, 90, 99])
        out[name] = {"p50_us": float(p50), "p90_us": float(p90), "p99_us": float(p99)}
    if a.workers:
        out["simpledbi echo workers"] = echo_throughput(a.workers, a.seconds)
        out["batching floor workers"] = {"workers": a.workers,
                                         "requests_per_s": floor_throughput(a.workers, a.seconds)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=8, help="closed-loop echo workers for the "
                    "throughput figures (0: skip them)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    runs = []
    for r in range(a.repeats):
        runs.append(once(a))
        print(f"run {r + 1}: " + json.dumps({k: v for k, v in runs[-1].items() if "stages" not in k}), flush=True)
    med = lambda path: float(np.median([functools.reduce(dict.__getitem__, path, run) for run in runs]))  # noqa: E731
    print(f"\nmedians of {a.repeats} interleaved run(s):")
    for name in ("semaphore ping-pong", "protocol-free floor", "simpledbi echo"):
        print(f"  {name:22s} p50 {med((name, 'p50_us')):7.1f} us   p90 {med((name, 'p90_us')):7.1f} us   "
              f"p99 {med((name, 'p99_us')):7.1f} us")
    print("  simpledbi echo, p50 of each stage: " + ", ".join(
        f"{k} {med(('echo stages p50_us', k)):.1f} us" for k in STAGES))
    if a.workers:
        print(f"  {a.workers} closed-loop clients: simpledbi {med(('simpledbi echo workers', 'requests_per_s')):.0f} "
              f"requests/s (mean batch {med(('simpledbi echo workers', 'mean_batch_size')):.2f}), batching floor "
              f"{med(('batching floor workers', 'requests_per_s')):.0f} requests/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
