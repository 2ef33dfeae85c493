"""Throughput and latency of simpledbi against plain PyTorch, in one harness.

    python benchmark.py --worker_num 128 --worker_batch 1 --max_batch_size 32 --model_num 3 --wait_time 0.01
    python benchmark.py --no_dynamic_batch --worker_num 8 --worker_batch 1     # plain PyTorch
    python benchmark.py --tiny --device cpu --duration 3 --warmup 1            # CPU smoke run
    python benchmark.py --model resnet18 --worker_num 128 --max_batch_size 32 --model_num 3 --wait_time 0.01
    python benchmark.py --model resnet18 --no_dynamic_batch --worker_num 3 --worker_batch 32 --mps

Both modes use the same workers and the same clock: every worker holds ``worker_batch`` images,
sends them in a closed loop and timestamps each call; all workers start together after warm-up,
and only calls inside the measurement window count. ``--dynamic_batch`` (default): the workers call
a ``SharedModel`` served by ``model_num`` model processes. ``--no_dynamic_batch``: each worker loads
the model itself and loops numpy -> device -> forward -> numpy (plain PyTorch).

``--model`` picks the served model, built in code with random weights on first use into
models/<name>.pt (fake_models.py): resnet50 (default, 224 x 224), resnet18 (112 x 112, the fast
model: a batch-32 forward is meant to take about 1 ms on an H100/H200, so the runtime's own cost
per request shows), tiny, or encoder (4 transformer layers, d=256, 64 tokens). The image size
follows the model unless ``--image_size`` is given; ``--model_path`` serves a file of that
model's input shape instead.

Besides throughput and latency it reports CPU time (user + system) per request served inside the
measurement window: the worker processes (clients), the model processes, and the supervisor --
the main process (os.times) and the runtime's janitor -- from /proc/<pid>/stat read at the
window's start and end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import numpy as np
import posix_ipc

import fake_models

from simpledbi import ModelConfig, RuntimeOptions, SharedModel
from simpledbi.shm import SHM_DIR, new_namespace, sweep_namespace
from simpledbi.layout import B_FIELDS
from simpledbi.mps import CONTROL, MpsUnavailable, PrivateDaemon
from simpledbi.stats import STAGES



@dataclass(frozen=True)
class BenchSpec:
    worker_num: int = 8
    worker_batch: int = 1
    max_batch_size: int = 32
    model_num: int = 1
    wait_time: float = 0.003
    dynamic_batch: bool = True
    duration: float = 10.0
    warmup: float = 3.0
    model_path: str = ""
    device: str = "auto"
    dtype: str = "float32"
    model: str = "resnet50"     # fake_models.MODELS: what model_path holds (its input shape)
    image_size: int = 0         # side of the image input; 0: the model's own (224, resnet18 112)
    gather: str = "auto"
    cuda_graphs: str = "auto"   # auto | on | off (ModelConfig.cuda_graphs)
    arrival_rate: float = 0.0   # requests/s over all workers, Poisson; 0 = closed loop
    seed: int = 0
    # The README's configuration leaves these at their defaults; the variants set them.
    input_shapes: bool = False  # declare the input (warm-up and graph capture at load time)
    batching: str = "adaptive"  # ModelConfig.batching: adaptive | fixed
    latency_target: float = 0.0  # ModelConfig.latency_target in seconds; 0 = none
    mps: str = "auto"           # RuntimeOptions.mps: the runtime manages CUDA MPS itself

    def __post_init__(self):
        if not self.image_size:
            object.__setattr__(self, "image_size", fake_models.default_image_size(self.model))

    @property
    def item_shape(self) -> tuple:
        """One image's (or sequence's) shape: what a request of ``worker_batch`` rows stacks."""
        return fake_models.item_shape(self.model, self.image_size)


# ---------------------------------------------------------------- start line for all workers
class StartLine:
    """Workers announce readiness; the main process releases them together and records when."""

    def __init__(self, prefix: Optional[str] = None):
        self.owner = prefix is None
        self.prefix = prefix or new_namespace()
        flags = posix_ipc.O_CREX if self.owner else 0
        self.ready = posix_ipc.Semaphore(f"/{self.prefix}.ready", flags)
        self.go = posix_ipc.Semaphore(f"/{self.prefix}.go", flags)
        path = os.path.join(SHM_DIR, self.prefix, "t")   # when they were released, for all
        self.t = np.memmap(path, np.float64, "w+" if self.owner else "r+", shape=(1,))

    def arrive_and_wait(self, timeout: float = 600) -> float:
        self.ready.release()
        self.go.acquire(timeout)
        return float(self.t[0])

    def release_all(self, n: int, timeout: float = 600) -> float:
        for _ in range(n):
            self.ready.acquire(timeout)
        self.t[0] = time.monotonic()
        for _ in range(n):
            self.go.release()
        return float(self.t[0])

    def close(self):
        self.t = None
        for sem in (self.ready, self.go):
            if self.owner:
                sem.unlink()
            sem.close()
        if self.owner:
            sweep_namespace(self.prefix)  # its directory and what is in it


def _inputs(spec: BenchSpec, rank: int) -> List[np.ndarray]:
    rng = np.random.default_rng(spec.seed * 100003 + rank)
    shape = (spec.worker_batch, *spec.item_shape)
    return [rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype) for _ in range(4)]


def _loop(call, xs, start: StartLine, spec: BenchSpec, timing=None, rank: int = 0):
    """Closed loop (next call as soon as the last returns) or, with ``arrival_rate``, open loop:
    Poisson arrivals per worker, latency counted from the scheduled arrival (queueing included)."""
    call(xs[0])  # first call outside the clock
    t_go = start.arrive_and_wait()
    end = t_go + spec.warmup + spec.duration
    starts, ends, wakes, lates = [], [], [], []
    rng = np.random.default_rng(spec.seed * 7919 + rank)
    rate = spec.arrival_rate / spec.worker_num
    i = 0
    now = time.monotonic()
    arrival = now + (rng.exponential(1 / rate) if rate else 0.0)
    while now < end:
        if rate:
            if arrival > now:
                time.sleep(arrival - now)  # the load generator idles until the next arrival
            t0 = arrival
            arrival += rng.exponential(1 / rate)
        else:
            t0 = now
        t_called = time.monotonic()
        call(xs[i & 3])
        t1 = time.monotonic()
        starts.append(t0)
        ends.append(t1)
        lates.append(t_called - t0)   # the load generator's own lateness (a sleep that overslept)
        if timing is not None:
            tm = timing()
            # where this request's time went: to waking up, to the batch closing, in the batch,
            # to being published, and its batch's rows
            wakes.append((tm["woken"] - tm["done"], tm["batch_closed"] - tm["published"],
                          tm["done"] - tm["batch_closed"], tm["published"] - t_called, tm["batch_rows"]))
        now = t1
        i += 1
    return np.array(starts), np.array(ends), np.array(wakes), np.array(lates)


# ---------------------------------------------------------------- the two kinds of worker
def dynamic_worker(rank: int, spec: BenchSpec, start_prefix: str):
    start = StartLine(start_prefix)
    try:
        model = SharedModel("model", max_shape=(spec.worker_batch, *spec.item_shape), dtype=spec.dtype)
        return _loop(model.forward, _inputs(spec, rank), start, spec, model.last_timing, rank)
    finally:
        start.close()


def plain_worker(rank: int, spec: BenchSpec, start_prefix: str, conn) -> None:
    import torch
    from simpledbi.engine import load_model, resolve_device
    start = StartLine(start_prefix)
    try:
        device = resolve_device(spec.device, rank)   # "cuda": workers spread over every GPU
        torch.set_num_threads(1)
        cfg = _model_config(spec)
        model = load_model(cfg, device)
        cast = {"float16": torch.float16}.get(spec.dtype)

        def call(x):
            t = torch.from_numpy(x).to(device)
            if cast is not None:
                t = t.to(cast)
            return model(t).float().cpu().numpy()

        with torch.inference_mode():
            xs = _inputs(spec, rank)
            for _ in range(3):
                call(xs[0])
            conn.send(_loop(call, xs, start, spec, None, rank))
    except BaseException as e:  # noqa: BLE001
        conn.send(e)
        raise
    finally:
        start.close()
        conn.close()


def _model_config(spec: BenchSpec) -> ModelConfig:
    declared = dict(input_shapes=[spec.item_shape], input_dtypes=[spec.dtype]) if spec.input_shapes else {}
    return ModelConfig(name="model", path=spec.model_path, max_batch_size=spec.max_batch_size,
                       model_num=spec.model_num, wait_time=spec.wait_time, device=spec.device,
                       precision=spec.dtype, gather=spec.gather,
                       cuda_graphs={"on": True, "off": False}.get(spec.cuda_graphs, "auto"),
                       batching=spec.batching, latency_target=spec.latency_target or None,
                       max_clients=max(64, spec.worker_num + 8), **declared)


# ---------------------------------------------------------------- CPU time per request
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of process ``pid``, all its threads (utime and stime of
    /proc/<pid>/stat, in clock ticks: 10 ms resolution, summed over many processes and seconds);
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()   # the name may hold spaces and ')'
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


class CpuWindow:
    """CPU time each group of processes spends inside the measurement window.

    ``pids()`` returns {group: [pid, ...]} and is asked at both ends of the window (a process
    restarted in between counts only if present at both). The main process is the group
    "supervisor" (os.times: user + system of all its threads -- the runtime's supervision threads
    and this script's, which sleep), plus whatever pids ``pids()`` puts there. A thread samples
    at t_go + warmup and t_go + warmup + duration.
    """

    def __init__(self):
        self.pids = lambda: {}   # set once the processes exist
        self.samples: list = []   # (monotonic time, {group: {pid: seconds or None}})

    def sample(self) -> None:
        t = time.monotonic()
        snap = {g: {p: proc_cpu_seconds(p) for p in ps} for g, ps in self.pids().items()}
        own = os.times()
        snap.setdefault("supervisor", {})[os.getpid()] = own.user + own.system
        self.samples.append((t, snap))

    def watch(self, t_go_box: list, go: threading.Event, done: threading.Event, spec: "BenchSpec"):
        """Thread body: sample when the window opens and when it closes (unless ``done`` first:
        run_config sets both events when it ends, so this never outlives it)."""
        go.wait()
        if done.is_set():
            return
        for at in (t_go_box[0] + spec.warmup, t_go_box[0] + spec.warmup + spec.duration):
            if done.wait(max(0.0, at - time.monotonic())):
                return
            self.sample()

    def result(self, requests: int, items_per_request: int) -> Optional[dict]:
        """{"seconds", "processes", "per_request_us", ...} or None if the window was not seen."""
        if len(self.samples) < 2:
            return None
        (t0, a), (t1, b) = self.samples[:2]
        seconds, counted, unread = {}, {}, 0
        for g in a:
            both = [p for p in a[g] if a[g][p] is not None and b.get(g, {}).get(p) is not None]
            unread += len(set(a[g]) | set(b.get(g, {}))) - len(both)
            seconds[g] = sum(b[g][p] - a[g][p] for p in both)
            counted[g] = len(both)
        seconds["total"] = sum(seconds.values())
        n = max(1, requests)
        return {"window_s": t1 - t0, "requests": requests, "processes": counted, "unread_processes": unread,
                "seconds": seconds,
                "per_request_us": {g: v / n * 1e6 for g, v in seconds.items()},
                "per_item_us": {g: v / (n * items_per_request) * 1e6 for g, v in seconds.items()}}


def _runtime_pids(rt) -> dict:
    """The runtime's processes by group, read through its attributes (tolerant: a group the
    runtime does not expose is left out rather than failing the benchmark)."""
    out = {"clients": [p.pid for p in getattr(rt, "worker_procs", {}).values()],
           "model": [m.proc.pid for m in getattr(rt, "model_procs", [])]}
    janitor = getattr(rt, "_janitor", None)
    if janitor is not None and janitor.pid:
        out["supervisor"] = [janitor.pid]
    return out


# ---------------------------------------------------------------- running one configuration
def _progress(t_go_box, spec: BenchSpec, done: threading.Event, quiet: bool):
    while not done.wait(1.0):
        if quiet:
            continue
        if not t_go_box:
            sys.stderr.write("\r  starting: loading models and workers ...        ")
        else:
            el = time.monotonic() - t_go_box[0]
            if el < spec.warmup:
                sys.stderr.write(f"\r  warm-up: {spec.warmup - el:5.1f} s left                  ")
            else:
                sys.stderr.write(f"\r  measuring: {max(0.0, spec.warmup + spec.duration - el):5.1f} s left          ")
        sys.stderr.flush()
    if not quiet:
        sys.stderr.write("\r" + " " * 60 + "\r")


def run_config(spec: BenchSpec, quiet: bool = False) -> dict:
    """Run one configuration; returns its figures (see :func:`analyse`)."""
    start = StartLine()
    t_go_box: list = []
    done, go = threading.Event(), threading.Event()
    threading.Thread(target=_progress, args=(t_go_box, spec, done, quiet), daemon=True).start()

    def release():
        t_go_box.append(start.release_all(spec.worker_num))
        go.set()

    releaser = threading.Thread(target=release, daemon=True)
    cpu = CpuWindow()
    watcher = threading.Thread(target=cpu.watch, args=(t_go_box, go, done, spec), daemon=True)
    records = runtime_stats = None
    try:
        if spec.dynamic_batch:
            from simpledbi.runtime import Runtime
            # The runtime manages MPS as a user gets it (spec.mps="auto"); inside mps_daemon()
            # it finds that daemon in the environment and uses it instead.
            with Runtime([_model_config(spec)], RuntimeOptions(mps=spec.mps)) as rt:
                cpu.pids = lambda: _runtime_pids(rt)
                releaser.start()
                watcher.start()
                results = rt.run_workers(dynamic_worker, spec.worker_num, (spec, start.prefix))
                watcher.join(5)   # the window closed before the last worker returned
                from simpledbi.stats import batch_records, summarize
                records = batch_records(rt.ctls["model"])
                runtime_stats = dict(summarize(rt.ctls["model"]), mps=rt.mps.state, mps_reason=rt.mps.reason)
        else:
            procs: list = []
            cpu.pids = lambda: {"clients": [p.pid for p in procs]}
            releaser.start()
            watcher.start()
            results = _run_plain(spec, start.prefix, procs)
            watcher.join(5)
    finally:
        done.set()
        go.set()
        start.close()
    releaser.join(5)
    out = analyse(spec, t_go_box[0], results, records)
    cpu_out = cpu.result(out["requests"], spec.worker_batch)
    if cpu_out is not None:
        out["cpu"] = cpu_out
    if runtime_stats is not None:
        out["runtime_stats"] = runtime_stats
    return out


def _run_plain(spec: BenchSpec, prefix: str, procs: Optional[list] = None):
    ctx = mp.get_context("spawn")
    procs = [] if procs is None else procs   # the caller's list: CpuWindow reads the pids
    conns = []
    for rank in range(spec.worker_num):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=plain_worker, args=(rank, spec, prefix, b))
        p.start()
        b.close()
        procs.append(p)
        conns.append(a)
    results = []
    try:
        for c in conns:
            r = c.recv()
            if isinstance(r, BaseException):
                raise RuntimeError(f"a plain PyTorch worker failed: {r!r}")
            results.append(r)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _pct(a, q):
    return float(np.percentile(a, q)) if len(a) else float("nan")


def analyse(spec: BenchSpec, t_go: float, results, records) -> dict:
    w0, w1 = t_go + spec.warmup, t_go + spec.warmup + spec.duration
    starts = np.concatenate([r[0] for r in results])
    ends = np.concatenate([r[1] for r in results])
    parts = [r[2] for r in results if len(r) > 2 and len(r[2])]
    parts = np.concatenate(parts).reshape(-1, 5) if parts else np.zeros((0, 5))
    wakes = parts[:, 0]
    finished = (ends >= w0) & (ends <= w1)
    inside = (starts >= w0) & (ends <= w1)
    lat = (ends - starts)[inside] * 1e3
    out = {
        "config": asdict(spec),
        "mode": "dynamic" if spec.dynamic_batch else "plain",
        "throughput": float(finished.sum()) * spec.worker_batch / spec.duration,
        "requests": int(finished.sum()),
        "latency_ms": {"mean": float(lat.mean()) if lat.size else float("nan"), "p50": _pct(lat, 50),
                       "p90": _pct(lat, 90), "p99": _pct(lat, 99)},
    }
    if records is not None and len(records):
        t = records[:, B_FIELDS.index("t_close")]
        rec = records[(t >= w0) & (t <= w1)]
        rows = rec[:, B_FIELDS.index("rows")].astype(int)
        out["batches"] = int(len(rec))
        out["mean_batch_size"] = float(rows.mean()) if len(rows) else 0.0
        hist = np.bincount(rows, minlength=spec.max_batch_size + 1)[1:]
        out["batch_size_histogram"] = {str(i + 1): int(n) for i, n in enumerate(hist) if n}
        out["per_batch_ms"] = {s: {"mean": float(rec[:, B_FIELDS.index(s)].mean() * 1e3) if len(rec) else 0.0,
                                   "p50": _pct(rec[:, B_FIELDS.index(s)] * 1e3, 50),
                                   "p99": _pct(rec[:, B_FIELDS.index(s)] * 1e3, 99)} for s in STAGES}
        wk = wakes[np.isfinite(wakes) & (wakes >= 0)] * 1e3
        out["wake_ms"] = {"mean": float(wk.mean()) if wk.size else 0.0, "p50": _pct(wk, 50),
                          "p99": _pct(wk, 99)}
        # per request: publish -> its batch closed, batch closed -> answer written
        for j, name in ((1, "to_batch_ms"), (2, "in_batch_ms")):
            col = parts[:, j] * 1e3
            out[name] = {"p50": _pct(col, 50), "p90": _pct(col, 90), "p99": _pct(col, 99)}
    lates = np.concatenate([r[3] for r in results]) if all(len(r) > 3 for r in results) else None
    if lat.size >= 100 and lates is not None:
        out["tail"] = _tail(lat, lates[inside], parts[inside] if len(parts) == len(starts) else None)
    return out


def _tail(lat: np.ndarray, lates: np.ndarray, parts: Optional[np.ndarray]) -> dict:
    """Where the slowest 1% of requests spent their time, beside the median request (ms, medians
    over each group): the load generator's lateness, then (simpledbi) call -> published, published
    -> batch closed, in the batch, result written -> caller running, and the batch's rows."""
    slow = lat >= np.percentile(lat, 99)
    out = {}
    for group, rows in (("slowest_1pct", slow), ("all", np.ones_like(slow))):
        g = {"n": int(rows.sum()), "latency": float(np.median(lat[rows])),
             "generator_late": float(np.median(lates[rows])) * 1e3}
        if parts is not None:
            for j, name in ((3, "to_published"), (1, "to_batch"), (2, "in_batch"), (0, "wake")):
                g[name] = float(np.median(parts[rows, j])) * 1e3
            g["batch_rows"] = float(np.mean(parts[rows, 4]))
        out[group] = g
    return out


# ---------------------------------------------------------------- CUDA MPS
@contextlib.contextmanager
def mps_daemon(enabled: bool):
    """Run the block under a private CUDA MPS daemon, plain PyTorch workers and model processes
    alike (the variables go into this script's os.environ, which both inherit); always stop it."""
    if not enabled:
        yield None
        return
    daemon = PrivateDaemon.create(mps_control())
    saved = {k: os.environ.get(k) for k in daemon.env}
    try:
        try:
            daemon.start(timeout=30)
        except MpsUnavailable as e:
            raise SystemExit(f"--mps: the MPS daemon did not start: {e}") from None
        os.environ.update(daemon.env)
        yield daemon.directory
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        daemon.stop(timeout=60)


def mps_control() -> str:
    """The MPS control program; where there is none (a host without an NVIDIA driver), a one-line
    exit rather than a traceback."""
    control = shutil.which(CONTROL)
    if control is None:
        raise SystemExit(f"--mps: {CONTROL} is not on PATH: CUDA MPS needs an NVIDIA GPU and its driver "
                         f"(run without --mps)")
    return control


# ---------------------------------------------------------------- report
def item_name(model: str) -> str:
    """What one row of ``model``'s input is, for figures per row: an image or (encoder) a sequence."""
    return "image" if fake_models.default_image_size(model) else "sequence"


def format_report(r: dict, baseline: Optional[dict] = None) -> str:
    c = r["config"]
    model = c.get("model", "resnet50")
    item = item_name(model)
    model += f"@{c['image_size']}" if fake_models.default_image_size(model) else ""
    lines = [f"{r['mode']:8s} {model} workers={c['worker_num']} x batch {c['worker_batch']}"
             + (f", max_batch={c['max_batch_size']} model_num={c['model_num']} wait={c['wait_time']}"
                if r["mode"] == "dynamic" else "") + f", device={c['device']} dtype={c['dtype']}"
             + (f" gather={c['gather']} cuda_graphs={c['cuda_graphs']}" if r["mode"] == "dynamic" else ""),
             f"  throughput   {r['throughput']:10.1f} {item}s/s   ({r['requests']} requests in {c['duration']} s)",
             "  latency ms   mean {mean:.2f}  p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}".format(**r["latency_ms"])]
    if baseline:
        lines.append(f"  vs plain     {r['throughput'] / baseline['throughput']:.2f}x throughput")
    if "cpu" in r:
        lines.append("  " + format_cpu(r["cpu"], item))
    if "batches" in r:
        lines.append(f"  batches      {r['batches']}  mean size {r['mean_batch_size']:.2f}  "
                     f"histogram {r['batch_size_histogram']}")
        lines.append("  per batch    " + "  ".join(f"{s} {v['p50']:.3f}" for s, v in r["per_batch_ms"].items())
                     + "   (ms, p50)")
        lines.append(f"  wake-up      p50 {r['wake_ms']['p50']:.3f} ms (result written -> caller running)")
        if "to_batch_ms" in r:
            lines.append("  per request  " + "   ".join(
                f"{k[:-3].replace('_', ' ')} p50 {r[k]['p50']:.2f} p99 {r[k]['p99']:.2f}"
                for k in ("to_batch_ms", "in_batch_ms")) + f"   wake p99 {r['wake_ms']['p99']:.2f} (ms)")
    return "\n".join(lines)


def format_cpu(cpu: dict, item: str = "image") -> str:
    """One line: CPU microseconds per request served in the window, by group of processes (and per
    ``item``, a row, where a request holds several)."""
    us, n = cpu["per_request_us"], cpu["processes"]
    groups = [g for g in ("clients", "model", "supervisor") if g in us]
    line = ("CPU/request  " + "  ".join(f"{g} {us[g]:.1f}" for g in groups)
            + f"  total {us['total']:.1f} us   ({' + '.join(str(n[g]) for g in groups)} processes")
    if cpu["per_item_us"]["total"] != us["total"]:
        line += f"; per {item} {cpu['per_item_us']['total']:.1f} us"
    if cpu["unread_processes"]:
        line += f"; {cpu['unread_processes']} not read at both ends"
    return line + ")"


def plot_latency(series, path: str, hline_ms: Optional[float] = None) -> None:
    """Latency (p50 and p99, log scale) against offered load, one pair of lines per series:
    ``series`` is [(label, rows)] with each row holding "offered" and "latency_ms". Needs
    matplotlib (the ``bench`` extra): without it, says so and draws nothing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[bench])")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in series:
        if not rows:
            continue
        for q, style in (("p50", "-o"), ("p99", "--x")):
            ax.plot([r["offered"] for r in rows], [r["latency_ms"][q] for r in rows], style,
                    label=f"{label}, {q}")
    if hline_ms is not None:
        ax.axhline(hline_ms, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("offered load, images/s (Poisson)")
    ax.set_ylabel("latency, ms (from arrival)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ensure_model(path: str, tiny: bool = False, model: str = "resnet50") -> str:
    """``path`` if given, else models/<model>.pt, written on first use (fake_models.py)."""
    if path:
        return path
    model = "tiny" if tiny else model
    name = {"tiny": "tiny_resnet"}.get(model, model)
    path = os.path.join("models", f"{name}.pt")
    if not os.path.exists(path):
        print(f"building {path} (first use) ...", file=sys.stderr)
        fake_models.export(model, "models", "torchscript", name)
    return path


def add_experiment_args(ap: argparse.ArgumentParser, duration: float, warmup: float) -> None:
    """The flags every script in experiments/ shares."""
    ap.add_argument("--duration", type=float, default=duration, help="measurement window, seconds")
    ap.add_argument("--warmup", type=float, default=warmup, help="seconds before the window")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model_path", default="", help="TorchScript/.pt2 file (default: fake ResNet-50)")
    ap.add_argument("--tiny", action="store_true", help="use the small test ResNet (CPU smoke runs)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker_num", type=int, default=8)
    ap.add_argument("--worker_batch", type=int, default=1)
    ap.add_argument("--max_batch_size", type=int, default=32)
    ap.add_argument("--model_num", type=int, default=1)
    ap.add_argument("--wait_time", type=float, default=0.003, help="seconds")
    ap.add_argument("--dynamic_batch", dest="dynamic_batch", action="store_true", default=True,
                    help="serve through simpledbi (default)")
    ap.add_argument("--no_dynamic_batch", dest="dynamic_batch", action="store_false",
                    help="plain PyTorch: every worker runs its own model")
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window, seconds")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    ap.add_argument("--model_path", default="", help="TorchScript/.pt2 file (default: --model's, built)")
    ap.add_argument("--tiny", action="store_true", help="use the small test ResNet (CPU smoke runs)")
    ap.add_argument("--model", choices=tuple(fake_models.MODELS), default="resnet50",
                    help="the model served, built in code with random weights into models/<name>.pt "
                         "(default: resnet50; resnet18 at 112 x 112 is the fast model; encoder: 4 "
                         "transformer layers, d=256, 64 tokens); with --model_path, the input shape "
                         "of that file")
    ap.add_argument("--image_size", type=int, default=0,
                    help="side of the square input image (default: the model's: 224, resnet18 112)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    ap.add_argument("--gather", choices=("auto", "host", "device"), default="auto")
    ap.add_argument("--cuda_graphs", choices=("auto", "on", "off"), default="auto",
                    help="CUDA graphs per bucket of batch sizes (ModelConfig.cuda_graphs; auto: on CUDA)")
    ap.add_argument("--arrival_rate", type=float, default=0.0,
                    help="open loop: Poisson requests/s over all workers (default: closed loop)")
    ap.add_argument("--mps", action="store_true", help="run under a private CUDA MPS daemon")
    ap.add_argument("--json", default="", help="write all figures to this file")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def spec_from_args(a) -> BenchSpec:
    if a.tiny and a.model != "resnet50":
        raise SystemExit(f"--tiny is the tiny ResNet: it does not combine with --model {a.model}")
    model = "tiny" if a.tiny else a.model
    return BenchSpec(worker_num=a.worker_num, worker_batch=a.worker_batch, max_batch_size=a.max_batch_size,
                     model_num=a.model_num, wait_time=a.wait_time, dynamic_batch=a.dynamic_batch,
                     duration=a.duration, warmup=a.warmup, model_path=ensure_model(a.model_path, model=model),
                     device=a.device, dtype=a.dtype, model=model, image_size=a.image_size, gather=a.gather,
                     cuda_graphs=a.cuda_graphs, arrival_rate=a.arrival_rate, seed=a.seed)


def main(argv=None):
    a = parse_args(argv)
    if a.mps:
        mps_control()   # before a model is built
    spec = spec_from_args(a)
    with mps_daemon(a.mps):
        result = run_config(spec)
    result["mps"] = a.mps
    print(format_report(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
