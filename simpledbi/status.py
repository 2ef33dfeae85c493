"""Looking inside a running runtime without taking part in it: ``simpledbi.inspect(name)``, read from the
models' control blocks (mapped read-only): no request, no slot, no cost (README, ``simpledbi status``)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import naming
from .layout import (H_COMPUTE, H_LATENCY, H_QUEUE, H_SUM, INST_RETIRING, INST_STATE_NAMES, LAT_BOUNDS,
                     STATE_NAMES, ControlBlock)
from .shm import SHM_DIR, pid_alive
from .stats import STAGES, summarize

__all__ = ["inspect", "RuntimeInfo", "ModelInfo", "InstanceInfo", "Histogram"]


@dataclass
class Histogram:
    """Counts in buckets with upper ``bounds`` (seconds, or rows); the last bucket is +inf."""

    bounds: Sequence[float]
    counts: List[int]
    sum: float = 0.0

    @property
    def count(self) -> int:
        return int(sum(self.counts))

    def quantile(self, q: float) -> Optional[float]:
        """The q-quantile, interpolated inside its bucket (None when empty)."""
        total = self.count
        if not total:
            return None
        rank, seen = q * total, 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                lo = self.bounds[i - 1] if i > 0 else 0.0
                hi = self.bounds[i] if i < len(self.bounds) else lo * 2
                return lo + (hi - lo) * (rank - seen) / n
            seen += n
        return float(self.bounds[-1])


@dataclass
class InstanceInfo:
    index: int
    pid: int
    device: str
    state: str
    alive: bool
    restarts: int
    cuda_graphs: int
    requests: int
    batches: int
    started: float        # wall clock (time.time) of this incarnation's start


@dataclass
class ModelInfo:
    name: str
    state: str
    message: str
    max_batch_size: int
    max_clients: int
    attached_clients: int     # client slots mapped (the max over the model processes; README: max_clients)
    queued: int               # requests model processes took and have not answered yet
    requests: int
    batches: int
    rows: int
    errors: int
    died: int                 # answered ModelProcessDied: held by a process that died (or queued when broken)
    bad_requests: int
    over_target: int
    rejected: Dict[str, int]               # refused with Overloaded, by reason (overload.py)
    withdrawn: int                         # callers stopped waiting (cancelled, closed) before a batch ran them
    expired: int                           # callers' timeouts passed before a batch ran them
    newcomer_wait: float                   # a new request's expected wait now (s; shortest
                                           # over the serving processes, 0 while unlearned)
    restarts: int
    instances: List[InstanceInfo]
    batch_sizes: Dict[int, int]            # rows -> batches (0: more than layout.BATCH_HIST_MAX)
    latency: Histogram                     # per request, publish to answer
    queue: Histogram                       # per request, publish to batch close
    compute: Histogram                     # per batch, close to answered
    stage_means: Dict[str, float] = field(default_factory=dict)   # recent batches, seconds

    @property
    def ready(self) -> bool:
        """Serving: running, and at least one model process ready and alive."""
        return self.state == "running" and any(i.alive and i.state == "ready" for i in self.instances)

    @property
    def mean_batch_size(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


@dataclass
class RuntimeInfo:
    name: Optional[str]
    namespace: str
    pid: int
    alive: bool
    models: List[ModelInfo]

    @property
    def ready(self) -> bool:
        return self.alive and bool(self.models) and all(m.ready for m in self.models)


def inspect(runtime: Optional[str] = None, *, namespace: Optional[str] = None) -> RuntimeInfo:
    """What the runtime named ``runtime`` (or at ``namespace``) is doing right now. Without
    arguments: ``$SIMPLEDBI_RUNTIME``, else the only named runtime of this user. Raises
    LookupError when there is no such runtime."""
    if namespace is None:
        if runtime is None:
            runtime = os.environ.get(naming.ENV_RUNTIME) or _only_runtime()
        reg = naming.resolve(runtime)
        if reg is None:
            raise LookupError(f"no simpledbi runtime named {runtime!r} is running (a `simpledbi serve` "
                              f"registers its name once its models start loading, after importing "
                              f"their modules: if one is starting, try again in a few seconds)")
        namespace, pid, model_names = reg.namespace, reg.pid, list(reg.models)
    else:
        try:
            entries = os.listdir(os.path.join(SHM_DIR, namespace))
        except OSError:
            raise LookupError(f"no simpledbi runtime at namespace {namespace!r}") from None
        pid, model_names = 0, sorted(e[:-4] for e in entries if e.endswith(".ctl"))
    models = []
    for m in model_names:
        try:
            ctl = ControlBlock.attach(namespace, m, readonly=True)
        except (OSError, RuntimeError):
            continue  # being created, or the runtime just went away
        try:
            models.append(_model_info(m, ctl))
            pid = pid or int(ctl.hdr["supervisor_pid"])
        finally:
            ctl.close()
    return RuntimeInfo(runtime, namespace, pid, pid_alive(pid), models)


def _only_runtime() -> str:
    regs = [r for r in naming.list_registrations() if pid_alive(r.pid)]
    if len(regs) == 1:
        return regs[0].name
    if not regs:
        raise LookupError("no named simpledbi runtime is running (start one with `simpledbi serve "
                          "--name NAME ...`)")
    raise LookupError(f"several simpledbi runtimes are running ({', '.join(r.name for r in regs)}): name one")


def _model_info(name: str, ctl: ControlBlock) -> ModelInfo:
    inst, c = ctl.all_instances.copy(), ctl.counters.copy()
    instances = []
    active = set(ctl.active_rows())
    for i in range(ctl.rows):   # the serving bank, and old processes still finishing (a reload)
        row = inst[i]
        pid, dev = int(row["pid"]), int(row["device"])
        if i not in active and not (row["state"] == INST_RETIRING and pid_alive(pid)):
            continue
        instances.append(InstanceInfo(   # device "-": not started
            index=i, pid=pid, device="-" if not pid else "cpu" if dev < 0 else f"cuda:{dev}",
            state=INST_STATE_NAMES.get(int(row["state"]), str(int(row["state"]))),
            alive=pid_alive(pid), restarts=int(row["restarts"]), cuda_graphs=int(row["graphs"]),
            requests=int(c["requests"][i]), batches=int(c["batches"][i]), started=float(row["t_start"])))
    serving = inst[list(active)]
    hist, bh = ctl.hist.sum(axis=0), ctl.batch_hist.sum(axis=0)
    n = summarize(ctl, since=time.monotonic() - 60.0)   # the counters, and the last minute's batches
    return ModelInfo(
        name=name, state=STATE_NAMES.get(ctl.state, str(ctl.state)), message=ctl.message(),
        max_batch_size=int(ctl.hdr["max_batch"]), max_clients=ctl.max_slots,
        attached_clients=int(serving["clients"].max()) if len(serving) else 0,
        queued=int(inst["held"].sum()),
        **{k: n[k] for k in ("requests", "batches", "rows", "errors", "died", "bad_requests", "over_target",
                             "restarts", "rejected", "withdrawn", "expired")},
        newcomer_wait=float(serving["newcomer_wait"].min()) if len(serving) else 0.0,
        instances=instances,
        batch_sizes={int(k): int(bh[k]) for k in np.nonzero(bh)[0]},
        latency=_histogram(hist[H_LATENCY]), queue=_histogram(hist[H_QUEUE]),
        compute=_histogram(hist[H_COMPUTE]),
        stage_means={s: n[f"mean_{s}_s"] for s in STAGES})


def _histogram(row: np.ndarray) -> Histogram:
    return Histogram(LAT_BOUNDS, row[:H_SUM].tolist(), float(row[H_SUM]) / 1e9)


# ---------------------------------------------------------------- text, for `simpledbi status`
def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def format_status(info: RuntimeInfo) -> str:
    lines = [f"runtime {info.name or info.namespace}  pid {info.pid}  "
             f"{'alive' if info.alive else 'DEAD'}  {'ready' if info.ready else 'NOT READY'}"]
    for m in info.models:
        lines += ["", f"model {m.name}: {m.state}{' (' + m.message + ')' if m.message else ''}  "
                     f"max_batch_size {m.max_batch_size}  clients {m.attached_clients}/"
                     f"{m.max_clients}  queued {m.queued}"]
        lines.append(f"  requests {m.requests}  batches {m.batches}  mean batch "
                     f"{m.mean_batch_size:.2f}  errors {m.errors}  died {m.died}  bad requests {m.bad_requests}  "
                     f"over target {m.over_target}  restarts {m.restarts}")
        # (what was last published stays while nothing is held: a newcomer then waits for nothing)
        lines.append(f"  overload: rejected (deadline) {m.rejected['deadline']}  rejected (queue) "
                     f"{m.rejected['queue']}  expired {m.expired}  withdrawn {m.withdrawn}  a newcomer's "
                     f"expected wait {_ms(m.newcomer_wait if m.queued else 0.0)} ms")
        lines.append("  " + "   ".join(
            f"{what} p50 {_ms(h.quantile(0.5))}  p99 {_ms(h.quantile(0.99))}"
            for what, h in (("latency ms ", m.latency), ("queue", m.queue), ("compute/batch", m.compute))))
        if any(m.stage_means.values()):
            lines.append("  last minute, mean per batch (ms): " + "  ".join(
                f"{k} {v * 1e3:.2f}" for k, v in m.stage_means.items()))
        if m.batch_sizes:
            sizes = sorted(m.batch_sizes.items(), key=lambda kv: kv[0] or 1 << 30)
            lines.append("  batch sizes: " + "  ".join(f"{'>128' if k == 0 else k}:{v}" for k, v in sizes))
        table = [("inst", "pid", "device", "state", "restarts", "requests", "batches", "graphs")] + [
            (i.index, i.pid, i.device, i.state if i.alive or i.state != "ready" else "dead", i.restarts,
             i.requests, i.batches, i.cuda_graphs) for i in m.instances]
        lines += ["  {:>4} {:>8} {:<7} {:<10} {:>8} {:>9} {:>8} {:>6}".format(*row) for row in table]
    return "\n".join(lines)
