"""The runtime's own counters, read out of a model's control block: the per-instance counters and
per-batch records (layout.B_FIELDS) model processes write, as ``SharedModel.stats()`` reports them."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .layout import B_FIELDS, COUNTERS, RING

STAGES = ("queue_wait", "gather", "h2d", "forward", "d2h", "scatter", "runtime")


def batch_records(ctl, since: Optional[float] = None) -> np.ndarray:
    """Per-batch records of all instances (the last ``RING`` of each), as a (n, len(B_FIELDS))
    array; with ``since``, of the batches that closed since then (``time.monotonic()``)."""
    out = []
    for inst in range(ctl.rows):
        if head := int(ctl.counters["ring_head"][inst]):
            out.append(ctl.ring[inst, :head] if head <= RING
                       else np.roll(ctl.ring[inst], -(head % RING), axis=0))
    if not out:
        return np.zeros((0, len(B_FIELDS)))
    recs = np.concatenate(out)   # a copy: the ring goes on
    return recs if since is None else recs[recs[:, B_FIELDS.index("t_close")] >= since]


def summarize(ctl, since: Optional[float] = None) -> dict:
    """Counters since start (README: ``stats()``; ``inspect()`` reads them here too) plus mean
    per-batch stage times (seconds) over the recent batches (that closed since ``since``)."""
    n = {name: int(ctl.counters[name].sum()) for name in COUNTERS.names if name != "reserved"}
    batches = n["batches"]
    out = {
        "requests": n["requests"],
        "batches": batches,
        "rows": n["rows"],
        "errors": n["errors"],
        "died": n["died"],             # held by a model process that died: ModelProcessDied
        "isolated_batches": n["isolated"],
        "bad_requests": n["bad_requests"],
        "withdrawn": n["withdrawn"],   # taken back before a model process got to them: never run
        "expired": n["expired"],       # its caller's timeout passed before its batch ran: never run
        "rejected": {"deadline": n["shed_deadline"], "queue": n["shed_queue"]},   # NOTE [overload]
        "over_target": n["over_target"],   # answered later than ModelConfig.latency_target
        "restarts": int(ctl.all_instances["restarts"].sum()),
        "cuda_graphs": int(ctl.instances["graphs"].sum()),   # captured (item shape, batch size) pairs
        "mean_batch_size": n["rows"] / batches if batches else 0.0,
        "mean_requests_per_batch": n["requests"] / batches if batches else 0.0,
    }
    recs = batch_records(ctl, since)
    for stage in STAGES:
        out[f"mean_{stage}_s"] = float(recs[:, B_FIELDS.index(stage)].mean()) if len(recs) else 0.0
    return out
