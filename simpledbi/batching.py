"""The batching policy, as pure functions of (ready requests, now, limits).

Kept free of processes and shared memory so it is unit-tested directly (like Ray Serve's
``_BatchQueue.wait_for_batch``). The model process feeds it numpy views of the slot table.

Rules (see README, "Batching"):
  * only requests with equal item shapes and dtypes (equal ``key``) share a batch; the group of
    the *oldest* pending request goes first, and requests join in arrival order;
  * a batch closes when it holds ``max_batch_size`` rows, when ``wait_time`` has passed since its
    oldest request was published (the timer starts at the first request, never at a clock tick),
    or at once when no further request can arrive (every attached client has one pending).
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np


def oldest_group(pending: np.ndarray, keys: np.ndarray, t_publish: np.ndarray) -> Tuple[int, np.ndarray]:
    """Among slot indices ``pending``, the key of the oldest request and that key's slots, oldest first.

    Returns ``(0, empty)`` when nothing is pending.
    """
    if pending.size <= 1:
        return (int(keys[pending[0]]) if pending.size else 0), pending
    times = t_publish[pending]
    key = int(keys[pending[int(np.argmin(times))]])
    same = pending[keys[pending] == key]
    return key, same[np.argsort(t_publish[same], kind="stable")]


def take_fitting(order: np.ndarray, rows: np.ndarray, room: int, indexed: bool = True) -> List[int]:
    """The longest prefix of ``order`` whose rows fit in ``room`` (arrival order is kept: a request
    that does not fit waits for the next batch rather than being overtaken indefinitely).
    ``rows`` is indexed by slot, or (``indexed=False``) already in the order of ``order``."""
    if room <= 0 or order.size == 0:
        return []
    if order.size == 1:
        return [int(order[0])] if (rows[order[0]] if indexed else rows[0]) <= room else []
    cum = np.cumsum(rows[order] if indexed else rows)
    n = int(np.searchsorted(cum, room, side="right"))
    return [int(s) for s in order[:n]]


def close_decision(batch_rows: int, max_batch: int, oldest_publish: float, now: float,
                   wait_time: float, more_can_arrive: bool) -> Tuple[bool, float]:
    """Whether to run the batch now; if not, how long at most to wait for more requests."""
    if batch_rows >= max_batch or not more_can_arrive:
        return True, 0.0
    left = oldest_publish + wait_time - now
    if left <= 0:
        return True, 0.0
    return False, left


def more_can_arrive(states: np.ndarray, idle_states: Tuple[int, ...]) -> bool:
    """True if some attached client could still send a request (it has none pending now).

    ``states`` holds one entry per slot; detached slots are in a state outside ``idle_states``.
    """
    can = states == idle_states[0]
    for s in idle_states[1:]:
        can |= states == s
    return bool(can.any())
