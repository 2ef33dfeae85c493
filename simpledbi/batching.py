"""The batching policy: when to close a batch, as pure functions of (the batch so far, now, learned
costs, limits), so its decisions are unit-tested directly.

NOTE [adaptive batching]
------------------------
A fixed "wait up to ``wait_time`` for more" doubles latency at low load and buys nothing when the device
would otherwise idle. Instead each model process learns, per item shape, what a batch of ``n`` rows costs
(``CostModel``: ``fixed + per_row * n``), how fast rows arrive (``RateMeter``) and how soon an answered
client sends again (its ``turnaround``), and asks :func:`decide` whenever something changes:

* close at once when the batch is full, when rows of its kind wait that did not fit, when no attached
  client could send another request, when its oldest request has waited ``wait_time`` (an upper bound,
  not the usual delay), or when waiting longer would break ``latency_target``;
* while the device still runs the previous batch, keep collecting: it could not start earlier;
* otherwise wait only if it pays. For clients just answered (a closed loop): up to ``_TURNAROUND_FACTOR``
  turnarounds after the newest arrival (an open-loop client thinks between requests: its turnaround is
  long, so nobody waits). For the arrival ``rate``: running the ``b`` rows now and the ``k = rate * w``
  arriving during a wait ``w`` in a batch of their own costs one more ``fixed``; waiting delays the ``b``
  rows by ``w`` (and their batch by ``per_row`` per newcomer). The latency saved, ``k * (fixed - w) - b *
  (w + per_row * k)``, is positive only if ``fixed > b / rate + b * per_row`` and largest at ``w* = (fixed
  - b / rate - b * per_row) / 2``. So at low load a request runs at once, and under load with a large
  fixed cost (launch-bound models) the batch waits a fraction of that cost.

A ``latency_target`` also caps a batch (:func:`row_limit`) at what fits in half the target (a request may
wait for the batch ahead and then run in its own), unless batches that small could not keep up with the
arrivals. Which requests a batch takes, in which order, is holding.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

#: Waits shorter than this are not worth a sleep (the sleep costs about as much).
MIN_WAIT = 20e-6
#: How many turnarounds after the newest arrival a batch still waits for clients that may send.
#: 2, 4 and 8 measured the same on the 8-worker command (docs/BENCHMARKS.md, run 16).
_TURNAROUND_FACTOR = 2.0
#: With a latency target, a batch closes once waiting longer would leave less than this many
#: times its estimated compute time before the oldest request's target: the estimate is an
#: average, and a batch 25% slower than it must still land within the target.
_COST_MARGIN = 1.25


@dataclass(frozen=True)
class Policy:
    """The limits a model process batches under (from ``ModelConfig``)."""

    max_batch: int
    wait_time: float                         # upper bound on how long any request waits to batch
    latency_target: Optional[float] = None   # seconds: keep p99 latency under this if possible
    adaptive: bool = True                    # False: wait up to wait_time whenever more may come


class Snapshot(NamedTuple):
    """The batch a model process is collecting (a NamedTuple: made once per decision, a frozen
    dataclass costs several times as much)."""

    rows: int            # rows in the batch so far (>= 1)
    oldest: float        # publish time of its oldest request (time.monotonic)
    waiting: int = 0     # rows of the batch's shape published and not taken (they did not fit)
    may_send: int = 0    # attached clients that could send a request now
    device_busy: bool = False   # the previous batch is still running on the device
    newest: float = 0.0  # publish time of its newest request (0: same as oldest)
    returning: int = 1 << 30   # clients my last batch answered that have not sent since


def decide(s: Snapshot, now: float, cost: Optional[Tuple[float, float]], rate: float,
           p: Policy, limit: Optional[int] = None, turnaround: Optional[float] = None) -> Tuple[bool, float]:
    """Close the batch now (``(True, 0)``), or ``(False, w)``: ask again after at most ``w``
    seconds (or as soon as something changes). ``cost`` is ``(fixed, per_row)`` seconds or None
    while unknown; ``rate`` is rows/s arriving; ``limit`` the batch's row cap (:func:`row_limit`);
    ``turnaround`` how long a client typically takes from being answered to its next request."""
    limit = p.max_batch if limit is None else limit
    if must_close(s.rows, limit, s.waiting, s.may_send):
        return True, 0.0
    budget = s.oldest + p.wait_time - now
    if p.latency_target is not None and cost is not None:
        budget = min(budget, s.oldest + p.latency_target - now - _COST_MARGIN * (cost[0] + cost[1] * limit))
    if budget <= MIN_WAIT:
        return True, 0.0
    if not p.adaptive or s.device_busy:
        return False, budget
    if cost is None:
        return True, 0.0   # nothing learned yet: run, and learn
    fixed, per_row = cost
    room = limit - s.rows
    wait, gain = 0.0, 0.0
    if turnaround is not None:
        # (an attached client that went quiet costs a batch at most _TURNAROUND_FACTOR turnarounds)
        w = max(s.newest, s.oldest) + _TURNAROUND_FACTOR * turnaround - now
        if MIN_WAIT < w <= budget:
            # (only those just answered: an attached client idle for long is not coming -- one idle
            # process's 16 kept slots cost a closed-loop client beside it 30% of its calls/s, helper-48)
            wait, gain = w, _saved(min(s.may_send, s.returning, room), w, s.rows, fixed, per_row)
    if rate > 0.0:
        w = min((fixed - s.rows / rate - s.rows * per_row) / 2.0,
                min(room, s.may_send) / rate, budget)   # no gain past a full batch
        g = _saved(rate * w, w, s.rows, fixed, per_row) if w > 0 else 0.0
        if g > gain:
            wait, gain = w, g
    if gain <= 0.0 or wait <= MIN_WAIT:
        return True, 0.0
    return False, min(wait, budget)


def must_close(rows: int, limit: int, waiting: int, may_send: int) -> bool:
    """:func:`decide`'s first rule, which needs no clock and no learned cost."""
    return rows >= limit or waiting > 0 or may_send <= 0


def _saved(k: float, w: float, b: int, fixed: float, per_row: float) -> float:
    """Latency saved (summed over requests) by waiting ``w`` for ``k`` more rows rather than
    running the ``b`` rows here now and the newcomers in a batch of their own."""
    return k * (fixed - w) - b * (w + per_row * k)


def row_limit(p: Policy, cost: Optional[Tuple[float, float]], rate: float = 0.0) -> int:
    """The most rows a batch may take: ``max_batch``, or fewer when ``latency_target`` needs it --
    but never so few that batches can no longer keep up with ``rate`` rows/s: then queues would
    grow and every request would miss the target, so throughput comes first."""
    if p.latency_target is None or cost is None:
        return p.max_batch
    fixed, per_row = cost
    if per_row <= 0.0:
        n = p.max_batch if fixed <= p.latency_target / 2 else 1
    else:
        n = max(1, min(p.max_batch, int((p.latency_target / 2 - fixed) / per_row)))
    if n < p.max_batch and rate * (fixed + per_row * n) / n > 0.8:
        return p.max_batch
    return n


class CostModel:
    """What a batch costs, learned online per item shape (``key``): an exponentially weighted
    least-squares fit of ``seconds = fixed + per_row * rows``. Recent batches weigh most
    (``memory`` batches), so a model warming up or a device shared with others is tracked."""

    def __init__(self, memory: float = 200.0, max_keys: int = 64):
        self.decay = 1.0 - 1.0 / memory
        self.max_keys = max_keys
        self._sums: Dict[int, List[float]] = {}   # key -> [w, w*n, w*t, w*n*n, w*n*t]
        self._fits: Dict[int, Optional[Tuple[float, float]]] = {}

    def observe(self, key: int, rows: int, seconds: float) -> None:
        if not (seconds >= 0.0 and math.isfinite(seconds)) or rows < 1:
            return
        s = self._sums.get(key)
        if s is None:
            if len(self._sums) >= self.max_keys:
                self._sums.clear()
                self._fits.clear()
            s = self._sums[key] = [0.0] * 5
        for i, x in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            s[i] = s[i] * self.decay + x
        self._fits.pop(key, None)

    def fit(self, key: int) -> Optional[Tuple[float, float]]:
        """``(fixed, per_row)`` seconds, both >= 0; None before the first batch of ``key``."""
        if key in self._fits:
            return self._fits[key]
        s = self._sums.get(key)
        if s is None:
            return None
        w, n, t, nn, nt = s
        mean_n, mean_t = n / w, t / w
        var = nn / w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):   # one batch size seen: all of it is fixed
            fit = (mean_t, 0.0)
        else:
            per_row = max(0.0, (nt / w - mean_n * mean_t) / var)
            fixed = mean_t - per_row * mean_n
            # fixed < 0: a proportional cost, no fixed part worth waiting for
            fit = (0.0, mean_t / mean_n) if fixed < 0.0 else (fixed, per_row)
        self._fits[key] = fit
        return fit


class RateMeter:
    """Rows per second arriving, as an exponentially decayed count over ``tau`` seconds."""

    def __init__(self, tau: float = 0.25):
        self.tau = tau
        self._count = 0.0
        self._t = -math.inf   # (the first decay leaves the count at 0)

    def add(self, rows: int, now: float) -> None:
        self._decay(now)
        self._count += rows

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._count / self.tau

    def _decay(self, now: float) -> None:
        if now > self._t:
            self._count *= math.exp((self._t - now) / self.tau)
            self._t = now
