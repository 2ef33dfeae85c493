"""The runtime's own cost per request: echo-model round trip vs a bare semaphore ping-pong.

    python experiments/roundtrip.py [--n 5000] [--workers 8 --seconds 5]

(a) two processes pass a token back and forth through two posix_ipc semaphores (the floor);
(b) one worker sends a (1, 4) float32 tensor through simpledbi to an identity model on the CPU.
Both run in this process tree, on this machine, one after the other; p50/p90/p99 in microseconds.
(c) ``--workers`` processes send (b)'s request in a closed loop: requests per second.
(b) also prints where its time goes (``SharedModel.last_timing``), p50 of each stage.
"""
from __future__ import annotations

import argparse
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


def _echo_worker(rank: int, n: int) -> tuple:
    model = SharedModel("echo", max_shape=(1, 4))
    x = np.ones((1, 4), np.float32)
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
    model = SharedModel("echo", max_shape=(1, 4))
    x = np.ones((1, 4), np.float32)
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
    cfg = ModelConfig(name="echo", factory=identity, max_batch_size=workers, device="cpu",
                      num_threads=1)
    start = time.monotonic() + 3.0 + 0.3 * workers
    out = Run(target=_throughput_worker, worker_num=workers, args=(seconds, start), models=[cfg])
    n = sum(o[0] for o in out)
    return {"workers": workers, "requests_per_s": n / seconds,
            "mean_batch_size": out[0][1]["mean_batch_size"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=8, help="closed-loop echo workers for the "
                    "throughput figure (0: skip it)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    sem = semaphore_pingpong(a.n)
    echo, stages = echo_roundtrip(a.n)
    out = {}
    for name, ts in (("posix_ipc semaphore ping-pong", sem), ("simpledbi echo round trip", echo)):
        p50, p90, p99 = np.percentile(ts, [50, 90, 99])
        out[name] = {"p50_us": p50, "p90_us": p90, "p99_us": p99}
        print(f"{name:32s} p50 {p50:7.1f} us   p90 {p90:7.1f} us   p99 {p99:7.1f} us")
    print(f"ratio (p50): {out['simpledbi echo round trip']['p50_us'] / out['posix_ipc semaphore ping-pong']['p50_us']:.1f}x")
    out["echo stages p50_us"] = {k: float(v) for k, v in zip(STAGES, np.median(stages, axis=0))}
    print("  echo, p50 of each stage: " + ", ".join(f"{k} {v:.1f} us" for k, v in out["echo stages p50_us"].items()))
    if a.workers:
        out["throughput"] = tp = echo_throughput(a.workers, a.seconds)
        print(f"{a.workers} echo workers, closed loop: {tp['requests_per_s']:.0f} requests/s "
              f"(mean batch {tp['mean_batch_size']:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
