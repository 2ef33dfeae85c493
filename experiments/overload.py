"""Past capacity (issue 22, NOTE [overload]): goodput and p99 against offered load with and without
shedding, priorities at 2x, and a fair share per client -- all against capacity measured in the
same run.

    python experiments/overload.py --model echo --out docs/results/overload_cpu
    python experiments/overload.py --model resnet50 --out docs/results/overload_gpu   # a GPU

``echo``: an identity model on the CPU that takes ``--batch_ms`` per batch (it sleeps, as a device
would, so the clients keep the CPU), max batch 16, one model process. ``resnet50``: the README's
configuration (fake ResNet-50, max batch 32, 3 model processes, MPS managed by the runtime).

1. **Capacity**: ``--closed`` closed-loop callers without a timeout, throughput in the window.
2. **Load curve**: Poisson arrivals at ``--loads`` x capacity, from ``--procs`` client processes
   of ``--threads`` threads each; latency counts from the scheduled arrival. "shed": every call
   has ``timeout=--timeout``; "queue": no timeout (today's default, an unbounded queue). Goodput:
   answers within the timeout, per second. A refusal's latency is from the call to Overloaded.
3. **Priorities**: 10% of calls at priority 1, at 0.5x and at 2x.
4. **Fairness**: one client process with 64 threads beside 7 with one thread each, closed loop,
   no timeout; and the 8 single-thread clients alone.
Writes ``<out>.json`` and, with matplotlib, ``<out>.png``.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simpledbi import ModelConfig, Runtime, RuntimeOptions, SharedModel  # noqa: E402

try:
    from simpledbi import Overloaded
except ImportError:   # a simpledbi from before overload handling (--parts capacity,fairness)
    class Overloaded(Exception):
        reason = "queue"

OK, SHED_DEADLINE, SHED_QUEUE, TIMEOUT, ERROR = range(5)
#: The priority of the "high" share of calls (--parts priority): SIMPLEDBI_HIGH=0 runs the same
#: traffic with no priorities at all, the baseline that shows what priorities cost.
HIGH = int(os.environ.get("SIMPLEDBI_HIGH", "1"))


class SlowEcho:
    """x -> x, taking ``seconds`` per batch whatever its size (a sleep: the CPU stays free) --
    ``cold_seconds`` per batch for the first ``cold_for`` seconds (a device warming up)."""

    def __init__(self, seconds: float, cold_seconds: float = 0.0, cold_for: float = 0.0):
        self.seconds, self.cold_seconds = seconds, cold_seconds
        self.cold_until = time.monotonic() + cold_for

    def __call__(self, x):
        time.sleep(self.cold_seconds if time.monotonic() < self.cold_until else self.seconds)
        return x


def slow_echo(seconds: float, cold_seconds: float = 0.0, cold_for: float = 0.0):
    return SlowEcho(seconds, cold_seconds, cold_for)


def model_config(a) -> ModelConfig:
    if a.model == "echo":
        return ModelConfig(name="m", factory=functools.partial(slow_echo, a.batch_ms / 1e3, a.cold_ms / 1e3,
                                                               a.cold_s), device="cpu",
                           max_batch_size=16, num_threads=1, max_clients=4096, model_num=a.model_num or 1)
    import benchmark
    path = benchmark.ensure_model(a.model_path, model="resnet50")
    return ModelConfig(name="m", path=path, max_batch_size=32, model_num=a.model_num or 3, max_clients=4096)


def item_shape(a) -> tuple:
    return (16,) if a.model == "echo" else (3, 224, 224)


# ---------------------------------------------------------------- a client process
def client_main(ns: str, shape: tuple, rate: float, t0: float, duration: float, threads: int,
                timeout, high_frac: float, seed: int, conn) -> None:
    """Open loop (``rate`` > 0: Poisson arrivals, handed to ``threads`` callers) or closed loop
    (``rate`` 0: each thread calls again as soon as answered), from ``t0`` for ``duration`` s.
    Sends back (t_sched, t_call, t_end, outcome, priority, published, batch_closed, done) rows
    (the last three from last_timing() for answered calls, else 0)."""
    model = SharedModel("m", max_shape=(1, *shape), namespace=ns)
    x = np.random.default_rng(seed).standard_normal((1, *shape)).astype(np.float32)
    model.forward(x)   # attach and warm, outside the window
    rows, lock = [], threading.Lock()
    todo: "queue.Queue" = queue.Queue()
    end = t0 + duration
    rng = np.random.default_rng(seed)

    def call(t_sched, prio):
        t_call = time.monotonic()
        stages = (0.0, 0.0, 0.0)
        try:
            if prio:
                model.forward(x, timeout=timeout, priority=prio)
            else:   # (runs against a simpledbi without priorities too: --parts capacity,fairness)
                model.forward(x, timeout=timeout)
            out = OK
            tm = model.last_timing()
            stages = (tm["published"], tm["batch_closed"], tm["done"])
        except Overloaded as e:
            out = SHED_DEADLINE if e.reason == "deadline" else SHED_QUEUE
        except TimeoutError:
            out = TIMEOUT
        except Exception:  # noqa: BLE001 - counted
            out = ERROR
        with lock:
            rows.append((t_sched, t_call, time.monotonic(), out, prio, *stages))

    def worker():
        if rate <= 0:
            while time.monotonic() < t0:
                time.sleep(min(t0 - time.monotonic(), 0.01) if t0 > time.monotonic() else 0)
            while time.monotonic() < end:
                call(time.monotonic(), 0)
            return
        while True:
            item = todo.get()
            if item is None:
                return
            call(*item)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    if rate > 0:
        t = t0 + rng.exponential(1 / rate)
        while t < end:
            delay = t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            todo.put((t, HIGH if rng.random() < high_frac else 0))
            t += rng.exponential(1 / rate)
        # what is still queued here at the end was never served within the window
        while True:
            try:
                todo.get_nowait()
            except queue.Empty:
                break
        for _ in pool:
            todo.put(None)
    for t in pool:
        t.join(120)
    conn.send(np.array(rows, dtype=np.float64).reshape(-1, 8))
    model.close()


def run_clients(ns, a, rate, threads_per_proc, procs, timeout, high_frac=0.0, duration=None):
    """One measurement: ``procs`` client processes (a list of thread counts, or one count for all)."""
    ctx = mp.get_context("spawn")
    duration = duration or a.duration
    counts = threads_per_proc if isinstance(threads_per_proc, list) else [threads_per_proc] * procs
    t0 = time.monotonic() + a.start_s   # every process attached by then
    pipes, ps = [], []
    for i, n in enumerate(counts):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=client_main, args=(ns, item_shape(a), rate / len(counts) if rate else 0.0,
                                                   t0, duration, n, timeout, high_frac, 1000 + i, w))
        p.start()
        pipes.append(r)
        ps.append(p)
    out = [r.recv() for r in pipes]
    for p in ps:
        p.join(60)
    return out, duration


def _stages(rows, sel):
    r = rows[sel & (rows[:, 5] > 0)]
    return {"publish": r[:, 5] - r[:, 1], "queued": r[:, 6] - r[:, 5], "batch": r[:, 7] - r[:, 6],
            "wake": r[:, 2] - r[:, 7]}


def summarize(parts, duration, timeout_s):
    rows = np.concatenate(parts) if parts else np.zeros((0, 8))
    lat = rows[:, 2] - rows[:, 0]
    ok = rows[:, 3] == OK
    shed = (rows[:, 3] == SHED_DEADLINE) | (rows[:, 3] == SHED_QUEUE)
    good = ok & (lat <= timeout_s)
    shed_lat = rows[shed, 2] - rows[shed, 1]
    pct = lambda v, q: float(np.percentile(v, q) * 1e3) if len(v) else None  # noqa: E731
    return {
        "calls": int(len(rows)), "answered": int(ok.sum()), "goodput": float(good.sum() / duration),
        "throughput": float(ok.sum() / duration),
        "shed_deadline": int((rows[:, 3] == SHED_DEADLINE).sum()),
        "shed_queue": int((rows[:, 3] == SHED_QUEUE).sum()),
        "timeouts": int((rows[:, 3] == TIMEOUT).sum()), "errors": int((rows[:, 3] == ERROR).sum()),
        "p50_ms": pct(lat[ok], 50), "p99_ms": pct(lat[ok], 99),
        "shed_p50_ms": pct(shed_lat, 50), "shed_p99_ms": pct(shed_lat, 99),
        "shed_max_ms": float(shed_lat.max() * 1e3) if len(shed_lat) else None,
        "shed_within_1ms": float((shed_lat <= 1e-3).mean()) if len(shed_lat) else None,
        "late_answers": int((ok & (lat > timeout_s)).sum()),
        "high_p99_ms": pct(lat[ok & (rows[:, 4] == 1)], 99),
        "call_lag_p99_ms": pct(rows[:, 1] - rows[:, 0], 99),   # the harness's own wait for a thread
        # where answered high-priority calls spent their time: call to publish, publish to their
        # batch's close (the socket's queue, then the process's backlog), the batch itself
        **{f"high_{name}_p{q}_ms": pct(v, q) for name, v in _stages(rows, ok & (rows[:, 4] == 1)).items()
           for q in (50, 99)},
        "low_p99_ms": pct(lat[ok & (rows[:, 4] == 0)], 99),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("echo", "resnet50"), default="echo")
    ap.add_argument("--model_path", default="")
    ap.add_argument("--batch_ms", type=float, default=10.0, help="echo: milliseconds per batch")
    ap.add_argument("--timeout", type=float, default=0.1)
    ap.add_argument("--loads", default="0.5,1,1.5,2,3")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--start_s", type=float, default=2.0, help="seconds for client processes to attach")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--closed", type=int, default=0, help="closed-loop callers for capacity (0: auto)")
    ap.add_argument("--parts", default="capacity,curve,priority,fairness")
    ap.add_argument("--capacity", type=float, default=0.0,
                    help="req/s to take as capacity instead of measuring it (0: measure)")
    ap.add_argument("--cold_ms", type=float, default=0.0, help="echo: milliseconds per batch while cold")
    ap.add_argument("--cold_s", type=float, default=0.0, help="echo: seconds it stays cold after loading")
    ap.add_argument("--model_num", type=int, default=0, help="model processes (0: 1 for echo, 3 for resnet50)")
    ap.add_argument("--out", default="overload")
    a = ap.parse_args()
    parts = a.parts.split(",")
    closed = a.closed or (64 if a.model == "echo" else 128)
    result = {"args": vars(a)}
    with Runtime([model_config(a)], RuntimeOptions()) as rt:
        ns = rt.namespace
        if a.capacity:   # taken as given; a closed loop still runs first, unmeasured, so that
            cap = a.capacity   # what is measured is not the first batch of each size (cold)
            run_clients(ns, a, 0.0, closed // a.procs, a.procs, None, duration=3.0)
        else:
            got, d = run_clients(ns, a, 0.0, closed // a.procs, a.procs, None)
            cap = summarize(got, d, float("inf"))["throughput"]
        result["capacity"] = cap
        probe = SharedModel("m", max_shape=(1, *item_shape(a)), namespace=ns)
        print(f"capacity: {cap:.0f} req/s ({closed} closed-loop callers)", flush=True)
        if "curve" in parts:
            result["curve"] = []
            for load in [float(x) for x in a.loads.split(",")]:
                for mode in ("shed", "queue"):
                    before = probe.stats()
                    got, d = run_clients(ns, a, load * cap, a.threads, a.procs,
                                         a.timeout if mode == "shed" else None)
                    s = summarize(got, d, a.timeout)
                    after = probe.stats()   # the model's own counts over the phase (and its margins)
                    batches = after["batches"] - before["batches"]
                    s.update(mode=mode, load=load, offered=load * cap, batches=batches,
                             mean_batch=(after["rows"] - before["rows"]) / max(batches, 1),
                             expired=after["expired"] - before["expired"])
                    result["curve"].append(s)
                    print(f"{mode:5} {load:.1f}x: goodput {s['goodput']:.0f}/s "
                          f"({s['goodput'] / cap:.0%} of capacity)  p50 {s['p50_ms']} p99 {s['p99_ms']} ms  "
                          f"shed {s['shed_deadline']}+{s['shed_queue']} (p50 {s['shed_p50_ms']}, p99 "
                          f"{s['shed_p99_ms']}, max {s['shed_max_ms']} ms, {s['shed_within_1ms']} within 1 ms)  timeouts {s['timeouts']}  "
                          f"late {s['late_answers']}  errors {s['errors']}  harness lag p99 {s['call_lag_p99_ms']} ms  "
                          f"model: {s['batches']} batches of {s['mean_batch']:.1f} rows, {s['expired']} expired", flush=True)
        if "priority" in parts:
            result["priority"] = {}
            for load in (0.5, 2.0):
                got, d = run_clients(ns, a, load * cap, a.threads, a.procs, a.timeout, high_frac=0.1)
                s = summarize(got, d, a.timeout)
                result["priority"][str(load)] = s
                print(f"priority {load}x: high p99 {s['high_p99_ms']} ms, low p99 {s['low_p99_ms']} ms, "
                      f"goodput {s['goodput']:.0f}/s, shed {s['shed_deadline']}+{s['shed_queue']} "
                      f"({s['shed_within_1ms']} within 1 ms), timeouts {s['timeouts']}, "
                      f"harness lag p99 {s['call_lag_p99_ms']} ms", flush=True)
                print(f"priority {load}x, high, p50/p99 ms: " + "  ".join(
                    f"{k} {s[f'high_{k}_p50_ms']}/{s[f'high_{k}_p99_ms']}" for k in ("publish", "queued", "batch", "wake")),
                    flush=True)
        if "fairness" in parts:
            result["fairness"] = {}
            for name, counts in (("alone", [1] * 8), ("flood", [64] + [1] * 7)):
                got, d = run_clients(ns, a, 0.0, counts, len(counts), None)
                per = [float((g[:, 3] == OK).sum() / d) for g in got]
                result["fairness"][name] = per
                print(f"fairness {name}: " + " ".join(f"{x:.0f}" for x in per)
                      + f"  (capacity / 8 = {cap / 8:.0f})", flush=True)
        result["stats"] = probe.stats()
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.out + ".png")


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    curve, cap = result.get("curve"), result["capacity"]
    if not curve:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("shed", "o-"), ("queue", "s--")):
        pts = [c for c in curve if c["mode"] == mode]
        label = "timeout 100 ms, shedding" if mode == "shed" else "no timeout (unbounded queue)"
        ax1.plot([c["load"] for c in pts], [c["goodput"] / cap for c in pts], style, label=label)
        ax2.plot([c["load"] for c in pts], [c["p99_ms"] or np.nan for c in pts], style, label=label)
    ax1.set_xlabel("offered load / capacity")
    ax1.set_ylabel("goodput / capacity (answers within 100 ms)")
    ax2.set_xlabel("offered load / capacity")
    ax2.set_ylabel("p99 of answered requests (ms)")
    ax2.set_yscale("log")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"simpledbi past capacity ({result['args']['model']}; capacity {cap:.0f} req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
