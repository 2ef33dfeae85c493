"""The batching policy is pure: its decisions are tested here without processes."""
import pytest

from simpledbi.batching import CostModel, Policy, RateMeter, Snapshot, decide, row_limit

P = Policy(max_batch=8, wait_time=0.010)
LAUNCH_BOUND = (0.004, 0.0001)      # 4 ms per batch + 0.1 ms per row
PROPORTIONAL = (0.0, 0.001)         # no fixed cost at all


def snap(rows=1, oldest=100.0, **kw):
    kw.setdefault("may_send", 8)
    return Snapshot(rows=rows, oldest=oldest, **kw)




@pytest.mark.parametrize("adaptive", [True, False])
def test_closes_when_full_when_its_shape_waits_or_when_nobody_can_send(adaptive):
    p = Policy(8, 0.010, adaptive=adaptive)
    assert decide(snap(rows=8), 100.0, LAUNCH_BOUND, 5000, p) == (True, 0.0)
    assert decide(snap(rows=3, waiting=1), 100.0, LAUNCH_BOUND, 5000, p) == (True, 0.0)
    assert decide(snap(rows=3, may_send=0), 100.0, LAUNCH_BOUND, 5000, p) == (True, 0.0)


def test_wait_time_is_an_upper_bound_counted_from_the_oldest_request():
    fixed = Policy(8, 0.010, adaptive=False)
    close, wait = decide(snap(oldest=100.0), 100.004, None, 0.0, fixed)
    assert not close and wait == pytest.approx(0.006)
    assert decide(snap(oldest=100.0), 100.011, None, 0.0, fixed)[0]
    # the adaptive policy never waits past it either, however much waiting would pay
    close, wait = decide(snap(oldest=100.0), 100.009, (1.0, 0.0), 1000.0, P)
    assert not close and wait <= 0.001 + 1e-12
    assert decide(snap(oldest=100.0), 100.0101, (1.0, 0.0), 1000.0, P)[0]


def test_low_load_runs_at_once():
    # 100 rows/s: the next request is ~10 ms away, far more than the 4 ms a batch costs
    assert decide(snap(), 100.0, LAUNCH_BOUND, 100.0, P) == (True, 0.0)


def test_nothing_learned_or_nothing_arriving_runs_at_once():
    assert decide(snap(), 100.0, None, 5000.0, P) == (True, 0.0)
    assert decide(snap(), 100.0, LAUNCH_BOUND, 0.0, P) == (True, 0.0)


def test_under_load_a_launch_bound_model_waits_a_fraction_of_its_fixed_cost():
    p = Policy(32, 0.010)
    close, wait = decide(snap(rows=1, may_send=100), 100.0, LAUNCH_BOUND, 4000.0, p)
    # w* = (fixed - b/rate - b*per_row) / 2 = (4 - 0.25 - 0.1) / 2 ms
    assert not close and wait == pytest.approx((0.004 - 0.00025 - 0.0001) / 2)
    # the more rows already here, the less waiting pays
    _, wait3 = decide(snap(rows=3, may_send=100), 100.0, LAUNCH_BOUND, 4000.0, p)
    assert 0 < wait3 < wait
    # never longer than it takes to fill the batch, or to hear from every client that may send
    _, wait_fill = decide(snap(rows=1, may_send=2), 100.0, LAUNCH_BOUND, 4000.0, p)
    assert wait_fill == pytest.approx(2 / 4000.0)


def test_a_proportional_cost_never_waits():
    assert decide(snap(), 100.0, PROPORTIONAL, 1e6, P) == (True, 0.0)


def test_a_busy_device_makes_waiting_free_until_wait_time():
    close, wait = decide(snap(device_busy=True), 100.0, PROPORTIONAL, 10.0, P)
    assert not close and wait == pytest.approx(0.010)


def test_latency_target_bounds_the_wait_and_the_batch():
    p = Policy(32, 0.050, latency_target=0.020)
    cost = (0.002, 0.0005)              # 32 rows: 18 ms
    limit = row_limit(p, cost)
    assert limit == 16                  # (10 ms - 2 ms) / 0.5 ms
    close, wait = decide(snap(rows=2, device_busy=True), 100.0, cost, 4000.0, p, limit)
    assert not close and wait == pytest.approx(0.020 - 1.25 * (0.002 + 0.0005 * 16))
    assert decide(snap(rows=2, device_busy=True), 100.0 + 0.0101, cost, 4000.0, p, limit)[0]
    assert decide(snap(rows=16), 100.0, cost, 4000.0, p, limit)[0]
    # an impossible target still serves: one row at a time
    assert row_limit(Policy(32, 0.05, latency_target=0.001), cost) == 1
    assert row_limit(p, None) == 32 and row_limit(P, cost) == 8
    # ... unless batches that small cannot keep up with the arrivals: throughput first
    assert row_limit(p, cost, rate=100.0) == 16          # 16 rows per 10 ms: 1600 rows/s
    assert row_limit(p, cost, rate=3000.0) == 32


def test_cost_model_recovers_an_affine_cost_and_forgets_old_batches():
    m = CostModel(memory=50)
    assert m.fit(1) is None
    for n in (1, 2, 4, 8, 16, 32) * 20:
        m.observe(1, n, 0.003 + 0.0002 * n)
    fixed, per_row = m.fit(1)
    assert fixed == pytest.approx(0.003, rel=1e-6) and per_row == pytest.approx(0.0002, rel=1e-6)
    assert fixed + per_row * 10 == pytest.approx(0.005, rel=1e-6)
    for n in (1, 2, 4, 8, 16, 32) * 100:    # the device got twice as slow
        m.observe(1, n, 0.006 + 0.0004 * n)
    assert m.fit(1)[0] == pytest.approx(0.006, rel=0.01)
    assert m.fit(2) is None                 # keys are learned separately


def test_cost_model_with_one_batch_size_calls_it_all_fixed_and_clamps_negatives():
    m = CostModel()
    for _ in range(5):
        m.observe(7, 1, 0.002)
    assert m.fit(7) == pytest.approx((0.002, 0.0))
    for n in (1, 8) * 10:                   # cost falls with rows (noise): no negative fit
        m.observe(9, n, 0.002 if n == 1 else 0.001)
    fixed, per_row = m.fit(9)
    assert fixed >= 0 and per_row >= 0
    m.observe(3, 4, float("nan"))
    m.observe(3, 0, 1.0)
    assert m.fit(3) is None


def test_rate_meter_tracks_a_steady_stream_and_decays_when_it_stops():
    r = RateMeter(tau=0.1)
    t = 0.0
    for _ in range(5000):                   # 1000 rows/s for 5 s
        t += 0.001
        r.add(1, t)
    assert r.rate(t) == pytest.approx(1000, rel=0.02)
    assert r.rate(t + 1.0) < 1.0            # ten time constants later
    assert r.rate(t - 5) >= 0               # a clock that went backwards is ignored


def test_clients_about_to_send_again_are_waited_for_when_it_pays():
    """A closed loop: 3 clients were just answered and take ~0.2 ms to send again; one request is
    here (it just arrived). A 4 ms fixed cost makes waiting for them pay; a 0.1 ms one does not."""
    s = snap(rows=1, oldest=100.0, may_send=3)
    close, wait = decide(s, 100.0, LAUNCH_BOUND, 0.0, P, turnaround=0.0002)
    assert not close and wait == pytest.approx(0.0004)
    assert decide(s, 100.0, (0.0001, 0.0001), 0.0, P, turnaround=0.0002) == (True, 0.0)
    # not past wait_time, and not for clients whose turnaround is unknown or too long
    assert decide(s, 100.0, LAUNCH_BOUND, 0.0, P, turnaround=None) == (True, 0.0)
    assert decide(s, 100.0, LAUNCH_BOUND, 0.0, P, turnaround=0.5) == (True, 0.0)
    assert decide(snap(rows=1, oldest=99.9902, may_send=3), 100.0, LAUNCH_BOUND, 0.0, P,
                  turnaround=0.0002) == (True, 0.0)


def test_only_clients_just_answered_are_waited_for_by_their_turnaround():
    """A closed-loop client alone in its batch, beside another process's idle slots (attached, so they
    'may send'): none of those was just answered, so nobody is waited for (each such batch waited two
    turnarounds: 30% fewer calls/s for the closed-loop client, helper-48)."""
    s = snap(rows=1, oldest=100.0, newest=100.0, may_send=16)
    assert not decide(s, 100.0, LAUNCH_BOUND, 0.0, P, turnaround=0.0002)[0]
    assert decide(s._replace(returning=0), 100.0, LAUNCH_BOUND, 0.0, P, turnaround=0.0002) == (True, 0.0)
    assert not decide(s._replace(returning=2), 100.0, LAUNCH_BOUND, 0.0, P, turnaround=0.0002)[0]


def test_a_client_that_does_not_come_back_is_given_up_on_after_twice_the_turnaround():
    """An attached client that went quiet still counts as 'may send': the batch waits for it only
    until 2 x turnaround after its newest arrival, never up to wait_time."""
    s = snap(rows=1, oldest=100.0, newest=100.0, may_send=1)
    assert not decide(s, 100.0001, LAUNCH_BOUND, 0.0, P, turnaround=0.0002)[0]
    assert decide(s, 100.0004, LAUNCH_BOUND, 0.0, P, turnaround=0.0002) == (True, 0.0)
    # a newcomer extends the window
    s2 = snap(rows=2, oldest=100.0, newest=100.0004, may_send=1)
    assert not decide(s2, 100.0005, LAUNCH_BOUND, 0.0, P, turnaround=0.0002)[0]
