"""The overload policy's decisions, one at a time (simpledbi/overload.py: pure functions)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from simpledbi.overload import (Backlog, Limits, PriorityArrivals, Refusal, ServiceRate, admit, late_at_close,
                               queue_full, refused_at_close)


@dataclass
class Req:
    pid: int
    t_seen: float
    rows: int = 1
    priority: int = 0
    deadline: float = 0.0
    turn: int = 0


def names(items):
    return [(r.pid, r.t_seen) for r in items]


def service_order(items):
    """The order a backlog that received ``items`` in arrival order lets them go."""
    b = Backlog()
    for r in sorted(items, key=lambda r: r.t_seen):
        b.add(r)
    return b.take_all()


def test_one_request_per_client_runs_in_arrival_order():
    items = [Req(3, 2.0), Req(1, 0.0), Req(2, 1.0)]
    assert names(service_order(items)) == [(1, 0.0), (2, 1.0), (3, 2.0)]


def test_a_client_with_many_waiting_takes_turns_with_the_others():
    flood = [Req(9, t * 0.1) for t in range(6)]          # client 9 sent six first
    light = [Req(1, 1.0), Req(2, 1.1)]                   # then two others one each
    order = names(service_order(flood + light))
    # round 0: everyone's first (by arrival); then client 9's others
    assert order[:3] == [(9, 0.0), (1, 1.0), (2, 1.1)]
    assert [p for p, _ in order[3:]] == [9] * 5


def test_turns_are_counted_in_rows():
    big = [Req(1, 0.0, rows=4), Req(1, 0.1, rows=4)]
    small = [Req(2, 0.2 + 0.01 * k) for k in range(6)]
    order = service_order(big + small)
    # client 1's second request starts at row 4: after client 2's rows 0..3
    assert [(r.pid, r.rows) for r in order][:6] == [(1, 4), (2, 1), (2, 1), (2, 1), (2, 1), (1, 4)]


def test_higher_priority_goes_first_whatever_its_age():
    items = [Req(1, 0.0), Req(2, 0.5, priority=5), Req(3, 0.2, priority=-1), Req(4, 0.9, priority=5)]
    assert [r.pid for r in service_order(items)] == [2, 4, 1, 3]


def test_service_rate_learns_only_from_backlogged_batches():
    rate = ServiceRate(memory=1.0)   # no averaging: the last sample
    assert rate.wait(100) == 0.0     # nothing learned: no refusals
    rate.batch_done(8, t_close=1.00, t_end=3.00, backlogged=True)   # the first: cold, not learned
    assert rate.rows_per_s == 0.0 and rate.latency == 0.0
    rate.batch_done(8, t_close=1.01, t_end=1.02, backlogged=True)
    assert rate.rows_per_s == pytest.approx(800.0) and rate.latency == pytest.approx(0.01)
    rate.batch_done(8, t_close=1.40, t_end=1.41, backlogged=False)  # idle before it: no sample
    assert rate.rows_per_s == pytest.approx(800.0)
    rate.batch_done(8, t_close=3.00, t_end=3.01, backlogged=True)   # a gap longer than _IDLE_GAP
    assert rate.rows_per_s == pytest.approx(800.0)
    assert rate.wait(80) == pytest.approx(0.1 + 0.01)


def test_one_stalled_batch_moves_the_latency_a_bounded_step():
    rate = ServiceRate(memory=20.0)
    for k in range(3):
        rate.batch_done(8, t_close=k * 0.01, t_end=k * 0.01 + 0.01, backlogged=False)
    assert rate.latency == pytest.approx(0.01)
    rate.batch_done(8, t_close=1.0, t_end=3.0, backlogged=False)    # a 2 s stall
    assert rate.latency == pytest.approx(0.01 + (0.04 - 0.01) / 20)   # counted as 4 x 10 ms
    assert rate.latency_bound < 0.02


def test_a_process_that_sped_up_is_believed_at_once():
    """An estimate too high sustains itself (its refusals stop the batches that would correct
    it): a batch in under half the learned latency moves it halfway there, and any batch's rows
    over its time lift a rate learned too low."""
    rate = ServiceRate(memory=20.0)
    rate.batch_done(16, t_close=0.0, t_end=1.0, backlogged=True)            # cold: not learned
    for k in range(1, 6):                                                    # warming: 150 ms
        rate.batch_done(16, t_close=k * 0.15, t_end=k * 0.15 + 0.15, backlogged=True)
    assert rate.latency == pytest.approx(0.15) and rate.rows_per_s == pytest.approx(16 / 0.15)
    rate.batch_done(16, t_close=2.0, t_end=2.01, backlogged=False)           # warm: 10 ms
    assert rate.latency == pytest.approx(0.08)
    assert rate.rows_per_s == pytest.approx((16 / 0.15 + 16 / 0.01) / 2)
    rate.batch_done(1, t_close=2.5, t_end=2.51, backlogged=False)   # 100 rows/s: no news
    assert rate.rows_per_s == pytest.approx((16 / 0.15 + 16 / 0.01) / 2)
    for k in range(4):
        rate.batch_done(1, t_close=3.0 + k, t_end=3.01 + k, backlogged=False)
    assert rate.latency_bound < 0.02


def test_jitter_moves_the_estimate_by_the_average():
    rate = ServiceRate(memory=20.0)
    rate.batch_done(8, t_close=0.0, t_end=1.0, backlogged=False)
    rate.batch_done(8, t_close=1.0, t_end=1.01, backlogged=False)
    rate.batch_done(8, t_close=2.0, t_end=2.006, backlogged=False)   # 0.6x: jitter, not a new pace
    assert rate.latency == pytest.approx(0.01 - 0.004 / 20)


def test_admit_refuses_what_cannot_make_its_deadline():
    rate = ServiceRate(memory=1.0)
    rate.rows_per_s, rate.latency = 1000.0, 0.005
    assert admit(10.0, 0.0, 10 ** 6, rate) is None                # no deadline: never refused
    assert admit(10.0, 10.1, 50, rate) is None                    # 55 ms < 100 ms
    why = admit(10.0, 10.1, 200, rate)                            # 205 ms > 100 ms
    assert why == Refusal("deadline", pytest.approx(0.205))
    assert Refusal.parse(why.text()) == Refusal("deadline", pytest.approx(0.205))


def test_higher_priorities_arriving_meanwhile_lengthen_the_wait():
    rate = ServiceRate(memory=1.0)
    rate.rows_per_s, rate.latency = 1000.0, 0.005
    # 80 rows ahead drain at 1000 - 200 rows/s while 200 rows/s of higher priorities overtake
    assert rate.wait(80, overtaking=200.0) == pytest.approx(0.1 + 0.005)
    assert admit(10.0, 10.1, 80, rate) is None                    # alone: 85 ms, taken
    assert admit(10.0, 10.1, 80, rate, overtaking=200.0).reason == "deadline"   # 105 ms
    assert rate.wait(1, overtaking=1000.0) == float("inf")        # it would never run
    assert rate.wait(0, overtaking=1000.0) == pytest.approx(0.005)


def test_priority_arrivals_counts_only_what_is_above():
    a = PriorityArrivals(tau=1.0)
    for i in range(100):
        a.add(1, 2, 5.0)   # 200 rows at priority 1, all at t = 5
        a.add(0, 1, 5.0)
    assert a.above(0, 5.0) == pytest.approx(200.0)
    assert a.above(1, 5.0) == 0.0
    assert a.above(-3, 5.0) == pytest.approx(300.0)
    assert a.above(0, 6.0) == pytest.approx(200.0 / 2.718281828, rel=1e-3)   # decays over tau


def test_late_at_close_counts_the_batch_own_time():
    rate = ServiceRate()
    rate.latency = 0.02
    assert late_at_close(1.0, 1.01, rate) and not late_at_close(1.0, 1.05, rate)
    assert not late_at_close(1.0, 0.0, rate)   # no deadline


def test_a_batch_is_never_emptied_on_the_estimate_alone():
    rate = ServiceRate()
    rate.latency = 0.5                     # learned from a slow batch: longer than any timeout here
    a, b, c = Req(1, 0.0, deadline=10.1), Req(2, 0.0, deadline=10.3), Req(3, 0.0, deadline=9.9)
    expired, doomed = refused_at_close(10.0, [a, b, c], rate)
    assert expired == [c]                  # its caller's deadline passed: never runs
    assert doomed == [a]                   # b, the latest deadline, runs: the estimate gets a sample
    fine = Req(4, 0.0, deadline=20.0)
    assert refused_at_close(10.0, [a, b, fine], rate) == ([], [a, b])   # someone runs anyway
    assert refused_at_close(10.0, [c], rate) == ([c], [])
    assert refused_at_close(10.0, [Req(5, 0.0)], rate) == ([], [])      # no deadline
    rate.last_done = 9.8   # a batch finished 0.2 s ago, sooner than the estimate's 0.5 s:
    assert refused_at_close(10.0, [a, b], rate) == ([], [a, b])         # it holds; nothing runs


def test_queue_bound():
    assert not queue_full(Limits(), 10 ** 9)
    assert not queue_full(Limits(max_queue=3), 2) and queue_full(Limits(max_queue=3), 3)
    assert queue_full(Limits(max_queue=0), 0)


def test_backlog_tallies_and_rows_ahead():
    b = Backlog()
    flood = [Req(9, k * 0.01) for k in range(10)]
    for r in flood:
        b.add(r)
    assert b.rows == 10 and b.repeats == 1
    # a newcomer from another client goes after client 9's first: one row ahead at most
    assert b.rows_ahead(pid=1, priority=0, rows=1) == 1
    # client 9's next goes after all of its own
    assert b.rows_ahead(pid=9, priority=0, rows=1) == 10
    high = Req(2, 1.0, priority=3)
    b.add(high)
    assert b.rows_ahead(pid=1, priority=0, rows=1) == 2          # the high one, then 9's first
    assert b.rows_ahead(pid=5, priority=3, rows=1) == 1          # only the other high one
    assert b.rows_ahead(pid=5, priority=4, rows=1) == 0
    assert b.lowest() is flood[-1]                               # newest of the lowest priority
    b.remove(flood[-1])
    assert b.rows == 10
    assert [r.pid for r in b.take_all()][:2] == [2, 9]
    assert len(b) == 0 and b.rows == 0 and b.repeats == 0
    assert b.rows_ahead(pid=1, priority=0, rows=1) == 0


def test_a_client_arriving_later_takes_its_turn_from_the_virtual_time():
    b = Backlog()
    flood = [Req(9, k * 0.01) for k in range(5)]
    for r in flood:
        b.add(r)
    assert [b.pop() for _ in range(3)] == flood[:3]        # virtual time is now at 9's third
    late = Req(1, 1.0)
    b.add(late)
    assert late.turn == 0 and b.take_all() == [late, flood[3], flood[4]]


def test_a_request_set_aside_keeps_its_place():
    b = Backlog()
    rs = [Req(k, k * 0.1) for k in range(3)]
    for r in rs:
        b.add(r)
    entry = b.pop_entry()
    assert entry[3] is rs[0] and len(b) == 2
    b.restore(entry)
    assert len(b) == 3 and b.rows == 3 and b.take_all() == rs


def test_retry_after_is_the_wait_past_the_timeout_for_a_deadline_and_the_whole_wait_for_a_full_queue():
    from simpledbi import Overloaded
    assert Overloaded("", "deadline", 0.25, timeout=0.1).retry_after == pytest.approx(0.15)
    assert Overloaded("", "queue", 0.055, timeout=5.0).retry_after == pytest.approx(0.055)   # was 1 ms
    assert Overloaded("", "queue", 0.0).retry_after == 0.001
    assert Overloaded("", "deadline", float("inf"), timeout=1.0).retry_after == 60.0
