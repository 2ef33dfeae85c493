"""What a model process holds and has not answered, in order (the batch loop's side of NOTE [overload]):
filling a batch, handing back to an idle peer, holding room for clients just answered, and taking
requests in while a batch runs. A mixin of :class:`~simpledbi.model_process.ModelServer`."""
from __future__ import annotations

import os
import select
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional

from . import batching
from .intake import WAKE
from .slots import Request

#: While the device runs the previous batch, how often the collecting loop looks whether it
#: finished: halved, the loop costs twice the CPU while a batch runs; doubled, a finished batch
#: waits up to that long to be answered when nothing else arrives.
_BUSY_POLL = 0.0002
#: Python's thread switch interval while a CPU forward pass runs on a helper thread (_compute_while_taking):
#: how long the helper may wait for the GIL while this thread runs Python between requests. The default,
#: 5 ms, could hold the forward pass up that long; shorter costs more thread switches.
_GIL_HANDOFF = 0.0002
#: While a CPU forward pass runs and this process holds requests for its next batch, how often it
#: looks whether a peer went idle, to hand them to it (a peer's going idle wakes no one here): a
#: request waits at most this long beyond that moment instead of the rest of this batch (helper-49:
#: 1 s batches, a request held 1 s beside two idle peers). Each look is one wake-up (~10 us).
_PEER_LOOK = 0.005
#: A CPU forward pass at least this long (learned) runs on the helper thread whenever refusals are
#: made early, so that a burst arriving during it is refused at once, not when it ends (helper-49:
#: 0.2-0.35 s late with 0.5 s batches). Shorter ones keep that delay under a batch of a few ms; the
#: helper's hand-off costs some 0.1 ms a batch.
_TAKE_WHILE_COMPUTING = 0.002


@dataclass(slots=True)
class _Collecting:
    """The batch being collected: its kind, rows, row cap and oldest request."""

    key: Optional[int] = None
    kind: tuple = ()      # its requests' Layout.kind (exact; key is only its CRC)
    rows: int = 0
    limit: int = 0
    oldest: float = float("inf")
    newest: float = 0.0
    waiting: int = 0      # rows of its kind held that did not fit
    holding: bool = False  # clients' second turns wait in the backlog until it closes (_fill)


class Holding:
    def _await_device(self, flight) -> None:
        """While the device finishes ``flight``, take requests off the socket when refusals are made early
        (as far ahead as Admission.takes_more says; NOTE [overload]). Else the engine waits (synchronize)."""
        launched = flight.launched   # (None only with an error: _stage)
        if flight.error is not None or not launched.started or not self.admission.refuses_early:
            return
        intake, backlog, admission = self.intake, self.backlog, self.admission
        while not launched.ready() and not intake.full and not self.retiring and (
                backlog.rows < self.max_batch or admission.takes_more(self.max_batch)):
            if self._peer_free():   # it takes newcomers at once, and what I hold (sooner than I would)
                self._hand_back(0)
                break
            got = intake.next(_BUSY_POLL, precise=True)
            if isinstance(got, Request) and self._took(got):
                backlog.add(got)
        admission.publish()

    def _compute_while_taking(self, launched) -> None:
        """_await_device for a CPU model past capacity: its forward pass runs on a helper thread
        while this one takes requests (in select() until one comes, or the helper's byte)."""
        from concurrent.futures import ThreadPoolExecutor, wait
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="simpledbi-forward")
        interval = sys.getswitchinterval()
        sys.setswitchinterval(_GIL_HANDOFF)
        job = self._helper.submit(self._start_in_helper, launched)
        byte_read = False
        try:
            intake, watch = self.intake, [self.intake.sock, self._done_r]
            while True:   # until the helper's byte: exactly one per job, always read
                # (not while a peer is idle: it takes newcomers at once, unrefused; nor beyond takes_more)
                free = self._peer_free()
                if free and self.backlog:
                    self._hand_back(0)   # it runs them now, not after this batch
                take = not intake.full and not self.retiring and not free and (
                    self.backlog.rows < self.max_batch or self.admission.takes_more(self.max_batch))
                look = _PEER_LOOK if self.backlog and self.ctl.model_num > 1 else self.poll
                ready = select.select(watch if take else watch[1:], (), (), look)[0]
                if self._done_r in ready:
                    os.read(self._done_r, 1)
                    byte_read = True
                    break
                if ready and not self._peer_free():   # (a peer that went idle meanwhile takes it)
                    got = intake.next(0)
                    if isinstance(got, Request) and self._took(got):
                        self.backlog.add(got)
        finally:
            if not byte_read:   # something went wrong here: the helper must be done with the
                wait([job])     # engine before anything else touches it, and its byte read
                os.read(self._done_r, 1)
            sys.setswitchinterval(interval)
        job.result()   # the forward pass's own error, if any, is raised here
        self.admission.publish()

    def _start_in_helper(self, launched) -> None:
        import torch
        try:
            with torch.inference_mode():   # thread-local, like the serving loop's
                self.engine.start(launched)
        finally:
            os.write(self._done_w, b"d")

    def _take(self, batch: List[Request], c: _Collecting, req: Request) -> None:
        if c.key is None:
            c.key, c.kind = req.layout.key, req.layout.kind
            if self.policy.latency_target is not None:  # else row_limit is max_batch
                c.limit = batching.row_limit(self.policy, self.costs.fit(c.key),
                                             self.arrivals.rate(time.monotonic()))
        batch.append(req)
        c.rows += req.rows
        self.admission.in_progress += req.rows
        c.oldest, c.newest = min(c.oldest, req.t_publish), max(c.newest, req.t_publish)

    def _fill(self, batch: List[Request], c: _Collecting) -> None:
        """Add requests to ``batch``: those I hold (in overload.Backlog's order), then what is queued on
        the socket now. Once the batch is full, what is queued is still taken, up to one more batch
        (beyond that, as Admission.takes_more says), unless a peer is idle: the socket's queue is short
        (net.unix.max_dgram_qlen, 10 by default), and each request taken from a full one wakes a client
        blocked in send (at 128 clients, they spent 40% of their time there, and the model processes
        a wake-up per request)."""
        c.waiting = 0
        backlog, intake = self.backlog, self.intake
        if backlog.rows > c.limit and self._peer_free():
            self._hand_back(c.limit)
        direct: List[Request] = []
        if not self.retiring:   # (what comes to a retiring process is for its successors)
            admission = self.admission
            # (a CPU model's peers: what I hold beyond this batch waits for all of it, while a
            # peer that ends its own batch sooner would take it from the socket)
            beyond = 0 if not self.engine.cuda and self.ctl.model_num > 1 else c.limit
            while not intake.full:
                held = c.rows + backlog.rows
                if held >= c.limit and (self._peer_free() or held >= c.limit + beyond and
                                        not admission.takes_more(c.limit)):
                    break
                got = intake.next(0)
                if got is None:
                    break
                if got is WAKE:
                    continue
                admission.room = 0 if c.holding else max(c.limit - c.rows, 0)   # for max_queue
                if not self._took(got):
                    continue
                if backlog or c.holding or admission.priorities_seen or c.key is not None and (
                        got.layout.kind != c.kind or got.rows > c.limit - c.rows):
                    backlog.add(got)   # it takes its place in the backlog's order
                else:
                    self._take(batch, c, got)   # nothing waits before it: the common case
                    direct.append(got)
        if direct and backlog and backlog.peek().priority > min(r.priority for r in direct):
            # a higher priority came after them: back to the backlog, ahead of what came after them
            for r in reversed(direct):
                batch.remove(r)
                c.rows -= r.rows
                self.admission.in_progress -= r.rows
                backlog.add_first(r)
            if not batch:
                c.key, c.kind, c.limit = None, (), self.max_batch
                c.oldest, c.newest = float("inf"), 0.0
        if backlog and not c.holding:
            self._from_backlog(batch, c)
        self.admission.publish()

    def _hand_back(self, keep: int) -> None:
        """A peer is idle while I hold more than my next batch (``keep`` rows): the rest goes back to
        the model's socket, for it (Intake.hand_back): what I took must not leave it without work."""
        backlog, kept, rows = self.backlog, [], 0
        while backlog and rows < keep:
            kept.append(backlog.pop_entry())
            rows += kept[-1][3].rows
        while backlog:
            entry = backlog.pop_entry()
            if self.intake.hand_back(entry[3]):
                self._open.pop(id(entry[3]), None)
            else:
                kept.append(entry)   # the socket's queue is full: keep the rest
                break
        for entry in kept:
            backlog.restore(entry)
        self.admission.publish()   # (clients refuse by what waits here)

    def _from_backlog(self, batch: List[Request], c: _Collecting) -> None:
        """Fill ``batch`` from the backlog in its order while it has room; requests of another kind keep
        their places, and second turns while clients just answered may still send (_expect_returns)."""
        backlog = self.backlog
        hold = backlog.repeats > 0 and bool(self._returning) and time.monotonic() < self._hold_until
        aside = []
        while backlog:
            r = backlog.peek()
            if hold and r.turn > 0:
                c.holding = True
                break
            if c.key is not None and r.layout.kind != c.kind:
                aside.append(backlog.pop_entry())
                continue
            if c.key is not None and r.rows > c.limit - c.rows:
                c.waiting += r.rows   # its kind, and it does not fit: the batch is full
                break
            self._take(batch, c, backlog.pop())
        for entry in aside:
            backlog.restore(entry)

    def _expect_returns(self, batch: List[Request]) -> None:
        """Some client has several requests waiting: the next batch holds the turn of clients with one call
        in this one and none waiting (NOTE [overload], Order). CPU models only: on a GPU the next batch is
        collected while this one runs; holding it halved 256 callers' throughput (the device waited)."""
        counts = Counter(r.pid for r in batch)
        waiting = self.backlog.clients()
        self._returning = {pid for pid, n in counts.items() if n == 1 and pid not in waiting}
        # Not the learned turnaround: it is mostly the busy clients' own (measured: holding for
        # twice it, the one-thread clients beside a 64-thread one got 70% of what they got
        # alone; for wait_time, 87%). The hold ends as soon as they are all back.
        self._hold_until = time.monotonic() + self.policy.wait_time

    def _close(self, batch: List[Request], c: _Collecting) -> List[Request]:
        """The batch as it runs: without what would be answered after its caller's deadline
        (Admission.at_close), its room given to what waits next -- a batch that ran short of
        the late ones cost the on-time ones a whole batch's worth of capacity (measured: with
        priorities at 2x, batches of 7.5 rows of 16, half the goodput)."""
        kept = self.admission.at_close(batch)
        while len(kept) < len(batch) and self.backlog:
            batch = kept
            c.rows = sum(r.rows for r in batch)
            if not batch:
                c.key, c.kind = None, ()
            self._from_backlog(batch, c)
            kept = self.admission.at_close(batch)
        return kept

    def _top_up(self, batch: List[Request], c: _Collecting) -> None:
        """The batch closes: the second turns held back fill what room is left."""
        c.holding = False
        self._returning = set()
        self._from_backlog(batch, c)
