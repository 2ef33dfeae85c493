"""Overload decisions in a model process (NOTE [overload] in overload.py has the policy): the requests it
holds and has not batched yet, what it learned about its own speed, what it publishes for the model's
other processes and ``status``, and the requests it refuses."""
from __future__ import annotations

import time
from typing import Callable, List, Sequence

from .layout import INST_READY, INSTANCE, ST_EXPIRED, ST_OVERLOADED, ControlBlock, words
from .overload import (Backlog, Limits, PriorityArrivals, Refusal, ServiceRate, admit, queue_full,
                       refused_at_close)
from .slots import Request

_QUEUED, _STATE, _NEWCOMER, _LOWEST = (INSTANCE.fields[n][1] // 8
                                        for n in ("queued", "state", "newcomer_wait", "lowest"))
_ROW_WORDS = INSTANCE.itemsize // 8


class Admission:
    """One model process's backlog and the refusals it makes (answered ``Overloaded``)."""

    def __init__(self, ctl: ControlBlock, row: int, limits: Limits,
                 fail: Callable[[Sequence[Request], int, str], None], count: Callable[..., None]):
        self.ctl, self.row, self.limits = ctl, row, limits
        self.backlog, self.rate = Backlog(), ServiceRate()
        self.arrivals = PriorityArrivals()   # kept once callers send priorities
        self._fail, self._count = fail, count
        self._all, self._floats = words(ctl.all_instances), words(ctl.all_instances, "d")
        self._mine = row * _ROW_WORDS
        self.deadlines_seen = self.priorities_seen = False
        self.alone = ctl.model_num == 1
        self._published = -1   # the queued count last written (-1: none yet)
        self.in_progress = 0   # rows in batches collected or running, not answered: they go first
        self.room = 0          # requests of the backlog the batch being collected will take

    @property
    def refuses_early(self) -> bool:
        """Callers send deadlines, or the queue is bounded: take requests during a batch (NOTE [overload])."""
        return self.deadlines_seen or self.limits.max_queue is not None

    def takes_more(self, limit: int) -> bool:
        """Take requests off the socket beyond the next batch and one more (``limit`` rows)? Always for the
        model's only process, when callers send priorities, or the queue is bounded. Not with several
        processes for fair turns or deadlines alone: what one takes, the others cannot (H200: 256 callers got
        half the throughput, and with deadlines the p99 at capacity tripled; Intake.hand_back evens it out
        only a few requests at a time). With deadlines, while within a batch of the least loaded peer's
        backlog: past capacity every backlog then grows, so more is refused when taken and every process
        publishes a queue for clients to refuse by; below capacity none holds more than a batch beyond what
        an idle peer would take (ResNet-50 at 2x on an H100, run 35: refusals within 1 ms went from 0.4-2.7%
        to 4-10%; most still come tens of ms later, from requests that waited in or to enter the socket)."""
        return self.alone or self.priorities_seen or self.limits.max_queue is not None or (
            self.deadlines_seen and len(self.backlog) < min(self._peer_queues(), default=0) + limit)

    def take(self, req: Request) -> bool:
        """A request arrived: True to keep it (to batch or hold), False if it was refused (answered)."""
        if req.deadline > 0.0:
            self.deadlines_seen = True
            if req.deadline <= req.t_seen:   # its caller timed out already: late, not refused
                self._count("expired")   # (counted first: its caller may read stats() once answered)
                self._fail([req], ST_EXPIRED, "the call's timeout passed before a model process took it")
                return False
        if req.priority:
            self.priorities_seen = True
        if req.deadline > 0.0 and self.backlog:   # (nothing waits: it goes in the next batch)
            why = admit(req.t_seen, req.deadline, self.in_progress
                        + self.backlog.rows_ahead(req.pid, req.priority, req.rows), self.rate,
                        self.arrivals.above(req.priority, req.t_seen) if self.priorities_seen else 0.0)
            if why is not None:   # (first: a request that cannot make it displaces no one)
                self.refuse([req], why)
                return False
        if self._full() and not self._drop_abandoned():
            # its expected wait, what the queue ahead would take: Overloaded.retry_after (0 gave
            # callers that retry after it 1 ms, 25 refusals an answer: helper-55)
            full = Refusal("queue", self.rate.wait(self.in_progress + self.backlog.rows))
            victim = self.backlog.lowest() if self.backlog else None
            if victim is None or victim.priority >= req.priority:
                self.refuse([req], full)
                return False
            self.backlog.remove(victim)
            self.refuse([victim], full)
        if self.priorities_seen:
            self.arrivals.add(req.priority, req.rows, req.t_seen)
        return True

    def _full(self) -> bool:
        """``max_queue`` reached across the model's serving processes: mine beyond the room of the batch being
        collected (what it takes goes at once, whatever waits elsewhere), the others' as last published."""
        return self.limits.max_queue is not None and len(self.backlog) >= self.room and \
            queue_full(self.limits, len(self.backlog) - self.room + sum(self._peer_queues()))

    def _peer_queues(self) -> List[int]:
        """Requests waiting at each of the model's other serving processes, as they published."""
        w = self._all
        return [w[r * _ROW_WORDS + _QUEUED] for r in self.ctl.active_rows()
                if r != self.row and w[r * _ROW_WORDS + _STATE] == INST_READY]

    def at_close(self, batch: List[Request]) -> List[Request]:
        """The batch about to run, less what its callers will not read: requests whose caller stopped
        waiting (cancelled or closed: ``withdrawn``; timed out: ``expired``), and those answered after their
        deadline -- past already (``expired``) or by the time this batch is answered (``Overloaded``)."""
        gone = [r for r in batch if r.peer.abandoned(r.seq)]   # (read once: a caller may
        if gone:                                                # abandon meanwhile)
            self._answer_gone(gone)
            batch = self._without(batch, gone)
        if not self.deadlines_seen:
            return batch
        expired, doomed = refused_at_close(time.monotonic(), batch, self.rate)
        if not expired and not doomed:
            return batch
        self._count("expired", len(expired))
        self._fail(expired, ST_EXPIRED, "the call's timeout passed before its batch ran")
        self.refuse(doomed, Refusal("deadline", self.rate.latency_bound))
        return self._without(batch, expired + doomed)

    def _answer_gone(self, gone: List[Request]) -> None:
        """Answer requests whose callers stopped waiting: expired if timed out, else withdrawn."""
        timed_out = sum(0.0 < r.deadline <= time.monotonic() for r in gone)
        self._count("expired", timed_out)
        self._count("withdrawn", len(gone) - timed_out)
        self._fail(gone, ST_EXPIRED, "its caller stopped waiting before its batch ran")

    def _drop_abandoned(self) -> bool:
        """At max_queue: the waiting requests whose callers stopped waiting hold no place (they
        would be dropped at their batch's close anyway). True if dropping them made room."""
        gone = [r for r in self.backlog.items if r.peer.abandoned(r.seq)]
        for r in gone:
            self.backlog.remove(r)
        if gone:
            self._answer_gone(gone)
        return bool(gone) and not self._full()

    def _without(self, batch: List[Request], dropped: List[Request]) -> List[Request]:
        """``batch`` less ``dropped`` (answered already), whose rows are no longer in progress."""
        self.in_progress -= sum(r.rows for r in dropped)
        ids = {id(r) for r in dropped}
        return [r for r in batch if id(r) not in ids]

    def refuse(self, requests: Sequence[Request], why: Refusal) -> None:
        self._count("shed_" + why.reason, len(requests))   # before the answers: see take
        self._fail(requests, ST_OVERLOADED, why.text())

    def publish(self) -> None:
        """My row of the control block: requests waiting here, the lowest priority among them
        and a newcomer's expected wait (not rewritten while nothing waits and nothing did: the
        common case costs a compare). Written before ``queued``, which clients look at first."""
        queued = max(len(self.backlog) - self.room, 0)
        if queued or self._published:
            self._all[self._mine + _LOWEST] = self.backlog.lowest_priority
            over = self.arrivals.above(0, time.monotonic()) if self.priorities_seen else 0.0
            self._floats[self._mine + _NEWCOMER] = self.rate.wait(
                self.in_progress + self.backlog.rows_ahead(-1, 0, 1), over)
            self._all[self._mine + _QUEUED] = self._published = queued

    def close(self) -> None:
        self._all[self._mine + _QUEUED] = 0
        for view in (self._all, self._floats):
            view.release()
