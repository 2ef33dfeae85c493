"""Accounting: the counters, histograms and per-batch records a model process keeps in its rows of the control
block (read by ``stats()``, ``simpledbi status`` and Prometheus). Bookkeeping: it never fails a batch."""
from __future__ import annotations

import struct
from bisect import bisect_left

from .layout import (B_FIELDS, BATCH_HIST_MAX, COUNTERS, H_COMPUTE, H_LATENCY, H_QUEUE, H_SUM,
                     LAT_BOUNDS, RING, ControlBlock, words)

assert B_FIELDS == ("t_close", "rows", "requests", "queue_wait", "gather", "h2d", "forward", "d2h",
                    "scatter", "runtime", "t_end")  # the order record() writes a record in
_C = {n: COUNTERS.fields[n][1] // 8 for n in COUNTERS.names if n != "reserved"}
_RECORD = struct.Struct(f"<{len(B_FIELDS)}d")   # one batch record of the ring
_I64_MAX = 2**63 - 1


class Accounting:
    """One model process's counters (row ``row`` of the control block)."""

    def __init__(self, ctl: ControlBlock, row: int, latency_target):
        self.count_words = words(ctl.counters[row:row + 1])
        self._ring = words(ctl.ring[row], "B")
        hist = ctl.hist[row]
        # int64 memoryviews: an element += 1 costs a fraction of a numpy scalar's
        self.h_latency, self.h_queue, self.h_compute = (words(hist[k]) for k in (H_LATENCY, H_QUEUE, H_COMPUTE))
        self.h_batch = words(ctl.batch_hist[row])
        self._late_after = latency_target or float("inf")   # over_target counts these

    def add(self, name: str, n: int = 1) -> None:
        self.count_words[_C[name]] += n

    def count(self, batch, total) -> None:
        """Count one answered batch (before its callers are woken: see ModelServer._complete)."""
        c = self.count_words
        c[_C["requests"]] += len(batch)
        c[_C["batches"]] += 1
        c[_C["rows"]] += total

    def record(self, batch, total, t_close, t_scatter, t_end, result) -> None:
        """Record one answered batch's stage times in the ring and its histograms (after its
        callers are woken: they do not wait for this)."""
        c = self.count_words
        head = c[_C["ring_head"]]
        gather = h2d = forward = d2h = 0.0   # (a batch that failed)
        if result is not None:
            tm = result.times
            gather, h2d, forward, d2h = tm.gather, tm.h2d, tm.forward, tm.d2h
        # The runtime's own work on this batch: copy in (issue and DMA overlap), copy out, scatter
        # and wake. Not wall time minus forward: with pipelining, a batch also waits for the one
        # ahead of it on the device, which is neither its forward nor the runtime's cost.
        own = max(gather, h2d) + d2h
        queue_wait = t_close - sum([r.t_publish for r in batch]) / len(batch)
        _RECORD.pack_into(self._ring, head % RING * _RECORD.size,  # in the order of layout.B_FIELDS
                          t_close, total, len(batch), queue_wait, gather, h2d, forward, d2h,
                          t_end - t_scatter, own + (t_end - t_scatter), t_end)
        c[_C["ring_head"]] = head + 1
        self.h_batch[total if total <= BATCH_HIST_MAX else 0] += 1
        h_lat, h_queue, h_compute = self.h_latency, self.h_queue, self.h_compute
        h_compute[bisect_left(LAT_BOUNDS, t_end - t_close)] += 1
        lat_ns = queue_ns = 0
        late, target = 0, self._late_after
        for r in batch:
            # t_publish is the client's word (clamped to the last hour at intake)
            t_pub = min(r.t_publish, t_close)
            h_lat[bisect_left(LAT_BOUNDS, t_end - t_pub)] += 1
            lat_ns += int((t_end - t_pub) * 1e9)
            h_queue[bisect_left(LAT_BOUNDS, t_close - t_pub)] += 1
            queue_ns += int((t_close - t_pub) * 1e9)
            late += t_end - t_pub > target
        # The sums saturate: forged publish times (up to an hour each) must not overflow them,
        # nor make this accounting raise for every batch after.
        for h, ns in ((h_compute, int((t_end - t_close) * 1e9)), (h_lat, lat_ns), (h_queue, queue_ns)):
            total_ns = h[H_SUM] + ns
            h[H_SUM] = total_ns if total_ns < _I64_MAX else _I64_MAX
        c[_C["over_target"]] += late

    def close(self) -> None:
        for view in (self.h_latency, self.h_queue, self.h_compute, self.h_batch, self.count_words,
                     self._ring):
            view.release()
