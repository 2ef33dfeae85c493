"""The overload policy: in which order waiting requests run, and which are refused at once. Pure (no
processes, no shared memory), so each decision is unit-tested directly.

NOTE [overload]
---------------
Past capacity a queue only grows: every caller waits longer, and work whose caller gave up still runs. So
for each request it takes from the socket, a model process decides:

* **Deadline.** A request with a deadline (its call's ``timeout``, or the model's ``default_timeout``) that
  cannot be answered in time -- given the rows that would run before it and what a row costs this process
  under load (:class:`ServiceRate`) -- is refused at once with ``Overloaded``, before it costs anything. At
  batch close, one that would finish after its deadline is refused too: nothing runs for a caller that will
  not read it.
* **Queue bound.** ``max_queue`` requests waiting across the model's processes: a newcomer is refused,
  unless it outranks a waiting one, which is refused in its place.
* **Order.** Higher ``priority`` first. Within a priority, clients (kernel pids: a process's threads and
  handles are one client) take turns by rows: a request's place is the rows its own client has waiting
  ahead of it (start-time fair queueing, equal weights), ties by arrival. And since a client with one call
  in flight sends its next only once answered, the batch after it holds room for it (up to ``wait_time``;
  ModelServer._expect_returns): else a busier client's second turn would take its place every other batch.

A request still in the kernel's queue gets no turn and no refusal, but what one process takes off the socket
its peers cannot: how far ahead it takes, and why, is Admission.takes_more's. With deadlines, or ``max_queue``
set, it keeps taking while the device runs a batch (a CPU model's forward pass then runs on a helper thread)
unless a peer is idle: with one model process most refusals come within a fraction of a millisecond of the
call (with several, what waits in the socket's queue is refused only once taken: README, Known limits).

**The client refuses first when it can.** Each model process publishes in its instance row how many requests
wait there, their lowest priority and how long a newcomer at default priority would wait (``newcomer_wait``).
While every serving process has requests waiting, a call at priority <= 0 whose timeout is shorter than the
least of those waits, or one that finds ``max_queue`` waiting, none below its priority, is refused by its
client, never sent (ControlBlock.backlog): else a request left in the kernel's queue, or its client blocked
sending to a full one, would learn its fate only once a process took it. Its handle's next datagram carries
the count, added to ``rejected`` (stats, status, Prometheus). A call of higher priority, or one a process
could start in its next batch, is always sent."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Dict, List, Optional, Tuple

from .batching import RateMeter

#: Learned rates follow this many batches (an exponential average): fewer, and one slow batch makes a
#: process refuse work it could do; more, and a slowdown (a neighbour on the GPU) takes that long to show.
_MEMORY = 20.0
#: A service-rate sample needs a batch closed this soon after the previous one: a longer gap means the
#: process was idle, and idle time is not a cost of rows.
_IDLE_GAP = 0.5
#: A batch's latency counts at most this many times the learned one: one stall (a new batch size, a
#: pause) must not make a process refuse for seconds what it answers in milliseconds (H100: a cold start
#: refused 73% of a half load); a real slowdown still moves the estimate up to (4 - 1) / _MEMORY a batch.
_OUTLIER = 4.0
#: A batch answered in under this fraction of the learned latency (or over its inverse times the learned
#: rate) means the pace changed (a device warmed up, a neighbour left): the estimate moves halfway there at
#: once. An estimate too high sustains itself, its refusals stopping the batches that would correct it (CPU
#: echo warmed up at 150 ms a batch, then 10 ms: 0% of a 2x load answered over the next 4 s); one too low is
#: corrected by the batches it lets run.
_CHANGED_PACE = 0.5

REASONS = ("deadline", "queue")


@dataclass(frozen=True)
class Limits:
    """What a model's overload policy is configured with (``ModelConfig``)."""

    max_queue: Optional[int] = None   # requests waiting across the model's processes


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused (one of REASONS) and its expected wait (seconds; 0: unknown)."""

    reason: str
    expected_wait: float = 0.0

    def text(self) -> str:
        """As a model process answers it (the client's ``Overloaded`` parses it back)."""
        return f"{self.reason}\n{self.expected_wait:.6f}"

    @classmethod
    def parse(cls, text: str) -> "Refusal":
        reason, _, wait = text.partition("\n")
        reason = reason if reason in REASONS else "queue"
        try:
            return cls(reason, max(float(wait), 0.0))
        except ValueError:
            return cls(reason)


class ServiceRate:
    """What this process learned about itself under load: rows/s it gets through when requests
    wait, and seconds from a batch's close to its answers (its latency)."""

    def __init__(self, memory: float = _MEMORY):
        self.alpha = 1.0 / memory
        self.rows_per_s = 0.0      # 0: not learned yet
        self.latency = 0.0
        self.latency_dev = 0.0     # mean absolute deviation of the latency
        self._last_close, self._last_backlogged = 0.0, False
        self._batches = 0
        self.last_done = 0.0      # when the last batch was answered (monotonic seconds)

    @property
    def latency_bound(self) -> float:
        """A batch's latency, with room for its usual spread: what deadlines are checked against at close."""
        return self.latency + 2.0 * self.latency_dev

    def batch_done(self, rows: int, t_close: float, t_end: float, backlogged: bool) -> None:
        """A batch of ``rows`` closed at ``t_close`` and was answered at ``t_end``; ``backlogged``:
        it closed full, with requests waiting. A rate sample needs this batch and the one before
        to be so: then the gap between their closes was all work (at low load it would measure
        the arrivals, and refuse what the process could do)."""
        a = self.alpha
        took = max(t_end - t_close, 0.0)
        self._batches += 1
        self.last_done = max(self.last_done, t_end)
        if self._batches == 1:
            pass   # a process's first batch runs cold (lazy initialisation): not a cost of rows
        elif self.latency == 0.0:
            self.latency = took
        elif took < _CHANGED_PACE * self.latency:
            self.latency = (self.latency + took) / 2
            self.latency_dev /= 2
        else:
            took = min(took, _OUTLIER * self.latency)
            self.latency_dev = (1 - a) * self.latency_dev + a * abs(took - self.latency)
            self.latency = (1 - a) * self.latency + a * took
        gap = t_close - self._last_close
        if backlogged and self._last_backlogged and 0.0 < gap < _IDLE_GAP:
            rate = rows / gap
            self.rows_per_s = rate if self.rows_per_s == 0.0 else (1 - a) * self.rows_per_s + a * rate
        if self._batches > 1 and took > 0.0 and rows / took * _CHANGED_PACE > self.rows_per_s > 0.0:
            # any batch shows the process gets through at least its rows in the time it took:
            # the evidence a rate learned too low needs, when its refusals leave no backlog
            self.rows_per_s = (self.rows_per_s + rows / took) / 2
        self._last_close, self._last_backlogged = t_close, backlogged

    def wait(self, rows_ahead: float, overtaking: float = 0.0) -> float:
        """Seconds until a request with ``rows_ahead`` rows before it is answered (0: unknown):
        those rows at the learned rate, then its own batch (checked as at its close). While it
        waits, ``overtaking`` rows per second of higher priorities arrive and go first: the rows
        ahead drain at the rate less that (measured: ignoring it, with 10% of a 2x load at a
        higher priority, half the admitted low-priority requests outlived their deadline)."""
        if self.rows_per_s <= 0.0:
            return self.latency_bound
        drain = self.rows_per_s - overtaking
        if drain <= 0.1 * self.rows_per_s:   # higher priorities take (nearly) everything
            return float("inf") if rows_ahead else self.latency_bound
        return rows_ahead / drain + self.latency_bound


class PriorityArrivals:
    """Rows per second taken at each priority (decayed over ``tau`` seconds): what overtakes a
    waiting request of a lower priority (ServiceRate.wait). ``tau``: long enough to average a
    few hundred Poisson arrivals at the loads where it matters, short enough to follow a burst."""

    def __init__(self, tau: float = 1.0):
        self._meters: Dict[int, RateMeter] = defaultdict(lambda: RateMeter(tau))

    def add(self, priority: int, rows: int, now: float) -> None:
        self._meters[priority].add(rows, now)

    def above(self, priority: int, now: float) -> float:
        """Rows per second arriving at priorities higher than ``priority``."""
        return sum(m.rate(now) for p, m in self._meters.items() if p > priority)


class Backlog:
    """The requests a model process holds and has not batched: a start-time fair queue. Each request
    gets a tag when it arrives -- its client's finish tag (the rows of its requests still ahead) or,
    for a client with nothing waiting, the queue's virtual time (the tag of the last request taken)
    -- and requests leave by (higher priority, lower tag, arrival). O(log n) a request. Tallies read
    in O(1): rows per priority, rows per (priority, client), clients with several requests waiting."""

    def __init__(self):
        self._heap: List = []                         # (-priority, tag, arrival, request)
        self._arrivals = 0
        self._vtime: Dict[int, int] = {}              # priority -> tag of the last request taken
        self._finish: Dict[Tuple[int, int], int] = {}  # (priority, pid) -> its next free tag
        self._gone: set = set()                       # ids removed from the middle (lazily)
        self.rows = 0
        self.repeats = 0                              # clients with 2+ requests waiting
        self._prio_rows: Dict[int, int] = {}
        self._prio_clients: Dict[int, int] = {}       # priority -> clients with requests waiting
        self._client: Dict[Tuple[int, int], List[int]] = {}   # (priority, pid) -> [rows, requests]

    def __len__(self) -> int:
        return len(self._heap) - len(self._gone)

    @property
    def items(self) -> List:
        return [e[3] for e in self._heap if id(e[3]) not in self._gone]

    def add(self, r) -> None:
        """A request arrives (sets its ``turn``: its client's rows ahead of it, 0 if none)."""
        p, key = r.priority, (r.priority, r.pid)
        v = self._vtime.get(p, 0)
        start = max(v, self._finish.get(key, 0))
        r.turn = start - v
        self._finish[key] = start + r.rows
        heappush(self._heap, (-p, start, self._arrivals, r))
        self._arrivals += 1
        self._count(r, 1)

    def add_first(self, r) -> None:
        """Put back a request that went into a batch before the backlog's own (it came first):
        it goes before everything of its priority that arrived after it."""
        p = r.priority
        r.turn = 0
        self._arrivals += 1
        heappush(self._heap, (-p, self._vtime.get(p, 0), -self._arrivals, r))
        self._count(r, 1)

    def peek(self):
        """The request that goes next (None if empty)."""
        self._skip_gone()
        return self._heap[0][3] if self._heap else None

    def pop(self):
        """Take the request that goes next (the virtual time moves on)."""
        return self.pop_entry()[3]

    def pop_entry(self) -> tuple:
        """:meth:`pop`, keeping its place: :meth:`restore` puts it back where it was."""
        self._skip_gone()
        entry = heappop(self._heap)
        neg_p, start, _, r = entry
        if start > self._vtime.get(-neg_p, 0):
            self._vtime[-neg_p] = start
        self._count(r, -1)
        return entry

    def restore(self, entry: tuple) -> None:
        """Put back a request taken with :meth:`pop_entry` (another kind than the batch's)."""
        heappush(self._heap, entry)
        self._count(entry[3], 1)

    def take_all(self) -> List:
        """Every request, in the order they go; the backlog is left empty."""
        return [self.pop() for _ in range(len(self))]

    def remove(self, r) -> None:
        """Take ``r`` out from anywhere (a refused request)."""
        self._gone.add(id(r))
        self._count(r, -1)

    def _skip_gone(self) -> None:
        heap, gone = self._heap, self._gone
        while heap and gone and id(heap[0][3]) in gone:
            gone.discard(id(heappop(heap)[3]))

    def _count(self, r, sign: int) -> None:
        p = r.priority
        self.rows += sign * r.rows
        self._prio_rows[p] = self._prio_rows.get(p, 0) + sign * r.rows
        key = (p, r.pid)
        c = self._client.get(key)
        if c is None:
            c = self._client[key] = [0, 0]
            self._prio_clients[p] = self._prio_clients.get(p, 0) + 1
        before = c[1]
        c[0] += sign * r.rows
        c[1] += sign
        self.repeats += (c[1] >= 2) - (before >= 2)
        if c[1] == 0:
            del self._client[key]
            self._finish.pop(key, None)   # an idle client starts again at the virtual time
            self._prio_clients[p] -= 1
            if not self._prio_clients[p]:
                del self._prio_clients[p]
        if not self._prio_rows[p]:
            del self._prio_rows[p]

    def rows_ahead(self, pid: int, priority: int, rows: int) -> int:
        """Rows that may run before a new request (``pid``, ``priority``, ``rows``): all of a
        higher priority; of its own, its client's waiting rows, and that many plus its own rows
        from each other client waiting -- what they have, or may still send that takes its turn
        before it. So a client with many waiting is refused first."""
        higher = sum(n for p, n in self._prio_rows.items() if p > priority)
        mine = self._client.get((priority, pid), (0, 0))[0]
        others = self._prio_clients.get(priority, 0) - (1 if mine else 0)
        return higher + mine + others * (mine + rows)

    @property
    def lowest_priority(self) -> int:
        """The lowest priority waiting (0 when nothing waits)."""
        return min(self._prio_rows, default=0)

    def clients(self) -> set:
        """The pids with a request waiting."""
        return {pid for _, pid in self._client}

    def lowest(self):
        """The request a higher-priority newcomer displaces: the newest of the lowest priority."""
        live = (e for e in self._heap if id(e[3]) not in self._gone)
        return max(live, key=lambda e: (e[0], e[2]))[3]   # (-priority, arrival)


def admit(now: float, deadline: float, rows_ahead: int, rate: ServiceRate,
          overtaking: float = 0.0) -> Optional[Refusal]:
    """None to take the request, or why not: it has a deadline (> 0) and would be answered after it,
    given ``rows_ahead``, the learned rate and the rows/s of higher priorities (``overtaking``)."""
    if deadline > 0.0:
        wait = rate.wait(rows_ahead, overtaking)
        if now + wait > deadline:
            return Refusal("deadline", wait)
    return None


def late_at_close(now: float, deadline: float, rate: ServiceRate) -> bool:
    """At batch close: would this request (deadline > 0) be answered after its deadline?"""
    return deadline > 0.0 and now + rate.latency_bound > deadline


def refused_at_close(now: float, batch: List, rate: ServiceRate) -> Tuple[List, List]:
    """At batch close: (expired, doomed), the requests of ``batch`` whose deadline has passed and those the
    learned latency says would be answered after it. Once no batch has finished for as long as the estimate
    says one takes, a batch that would be emptied keeps its doomed request with the latest deadline: only a
    batch that runs corrects the estimate (measured: after a slow first batch, a model refused every call of
    a half load, for good, once its latency estimate exceeded their 100 ms timeout)."""
    late = [r for r in batch if late_at_close(now, r.deadline, rate)]
    expired = [r for r in late if r.deadline <= now]
    doomed = [r for r in late if r.deadline > now]
    if doomed and len(expired) + len(doomed) == len(batch) and now - rate.last_done >= rate.latency_bound:
        doomed.remove(max(doomed, key=lambda r: r.deadline))
    return expired, doomed


def queue_full(limits: Limits, waiting: int) -> bool:
    """``waiting`` requests across the model: is there room for one more?"""
    return limits.max_queue is not None and waiting >= limits.max_queue
