"""The batching policy is pure: tested here without processes."""
import numpy as np
import pytest

from simpledbi.batching import close_decision, more_can_arrive, oldest_group, take_fitting


def test_oldest_group_picks_the_key_of_the_oldest_request_in_arrival_order():
    keys = np.array([5, 7, 5, 7, 5])
    t = np.array([3.0, 1.0, 2.0, 4.0, 0.5])
    key, order = oldest_group(np.array([0, 1, 2, 3]), keys, t)
    assert key == 7 and order.tolist() == [1, 3]
    key, order = oldest_group(np.array([0, 2, 4]), keys, t)
    assert key == 5 and order.tolist() == [4, 2, 0]


def test_oldest_group_of_nothing_and_of_one():
    assert oldest_group(np.array([], dtype=np.int64), np.zeros(3), np.zeros(3))[1].size == 0
    key, order = oldest_group(np.array([2]), np.array([0, 0, 9]), np.zeros(3))
    assert key == 9 and order.tolist() == [2]


def test_take_fitting_keeps_arrival_order_and_stops_at_the_first_misfit():
    rows = np.array([3, 2, 4, 1])
    assert take_fitting(np.array([0, 1, 2, 3]), rows, 5) == [0, 1]
    assert take_fitting(np.array([0, 1, 2, 3]), rows, 10) == [0, 1, 2, 3]
    assert take_fitting(np.array([3, 2, 0]), rows, 5) == [3, 2]
    assert take_fitting(np.array([2]), rows, 3) == []
    assert take_fitting(np.array([2]), rows, 4) == [2]
    assert take_fitting(np.array([0, 1]), rows, 0) == []


def test_close_decision_closes_when_full_or_when_nobody_else_can_send():
    assert close_decision(8, 8, oldest_publish=0.0, now=0.0, wait_time=1.0, more_can_arrive=True) == (True, 0.0)
    assert close_decision(3, 8, oldest_publish=0.0, now=0.0, wait_time=1.0, more_can_arrive=False) == (True, 0.0)
    assert close_decision(3, 8, oldest_publish=0.0, now=0.0, wait_time=1.0, more_can_arrive=True)[0] is False


def test_close_decision_waits_from_the_oldest_request_not_from_now():
    close, wait = close_decision(2, 8, oldest_publish=100.0, now=100.004, wait_time=0.010, more_can_arrive=True)
    assert not close and wait == pytest.approx(0.006)
    close, wait = close_decision(2, 8, oldest_publish=100.0, now=100.011, wait_time=0.010, more_can_arrive=True)
    assert close


def test_zero_wait_time_closes_at_once():
    assert close_decision(1, 8, 5.0, 5.0, 0.0, True) == (True, 0.0)


def test_more_can_arrive_counts_idle_and_done_slots_only():
    IDLE, PUB, CLAIMED, DONE, FREE = 1, 2, 3, 4, 0
    assert not more_can_arrive(np.array([PUB, CLAIMED, FREE]), (IDLE, DONE))
    assert more_can_arrive(np.array([PUB, IDLE, FREE]), (IDLE, DONE))
    assert more_can_arrive(np.array([DONE, CLAIMED]), (IDLE, DONE))
