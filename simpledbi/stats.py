"""Reading the runtime's own counters out of a model's control block.

Model processes write per-instance counters and a ring of per-batch records (layout.B_FIELDS);
this module turns them into the figures ``SharedModel.stats()`` and ``benchmark.py`` report.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .layout import B_FIELDS, RING

STAGES = ("queue_wait", "gather", "h2d", "forward", "d2h", "scatter", "runtime")


def batch_records(ctl, since: Optional[float] = None) -> np.ndarray:
    """Per-batch records of all instances (the last ``RING`` of each), as a (n, len(B_FIELDS))
    array; with ``since``, of the batches that closed since then (``time.monotonic()``)."""
    out = []
    for inst in range(ctl.rows):
        head = int(ctl.counters["ring_head"][inst])
        n = min(head, RING)
        if n == 0:
            continue
        out.append(ctl.ring[inst, :n] if head <= RING else np.roll(ctl.ring[inst], -(head % RING), axis=0))
    if not out:
        return np.zeros((0, len(B_FIELDS)))
    recs = np.concatenate(out)   # a copy: the ring goes on
    return recs if since is None else recs[recs[:, B_FIELDS.index("t_close")] >= since]


def summarize(ctl) -> dict:
    """Counters since start plus mean per-batch stage times (seconds) over the recent batches."""
    c = ctl.counters
    requests = int(c["requests"].sum())
    batches = int(c["batches"].sum())
    rows = int(c["rows"].sum())
    out = {
        "requests": requests,
        "batches": batches,
        "rows": rows,
        "errors": int(c["errors"].sum()),
        "isolated_batches": int(c["isolated"].sum()),
        "bad_requests": int(c["bad_requests"].sum()),
        # requests whose caller took them back (timeout, close, a cancelled task) before any
        # model process got to them: they never reached the model
        "withdrawn": int(c["withdrawn"].sum()),
        # requests whose caller's deadline had passed when their batch closed: never run
        "expired": int(c["expired"].sum()),
        # refused at once with Overloaded (NOTE [overload]), by reason: it could not be answered
        # within its deadline, or max_queue requests were waiting; never run
        "rejected": {"deadline": int(c["shed_deadline"].sum()), "queue": int(c["shed_queue"].sum())},
        # answered later than ModelConfig.latency_target (0 when no target is set)
        "over_target": int(c["over_target"].sum()),
        "restarts": int(ctl.all_instances["restarts"].sum()),
        "cuda_graphs": int(ctl.instances["graphs"].sum()),   # captured (item shape, batch size) pairs
        "mean_batch_size": rows / batches if batches else 0.0,
        "mean_requests_per_batch": requests / batches if batches else 0.0,
    }
    recs = batch_records(ctl)
    for stage in STAGES:
        out[f"mean_{stage}_s"] = float(recs[:, B_FIELDS.index(stage)].mean()) if len(recs) else 0.0
    return out
