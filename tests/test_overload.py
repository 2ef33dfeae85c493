"""Past capacity, across real processes (NOTE [overload]): refusals by deadline and by queue
bound, priority order, a fair share per client process, and what stats() counts."""
from __future__ import annotations

import asyncio
import functools
import os
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from simpledbi import Overloaded, SharedModel, SimpleDBIError

from . import models, workers
from .conftest import cpu_model, wait_queued

X = np.ones((1, 4), np.float32)


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        threading.Event().wait(0.01)  # bounded wait on a shared-memory condition


def _call_in_thread(m, x, **kw):
    """Start ``m.forward(x, **kw)`` on a thread; returns (thread, outcome dict)."""
    out = {}

    def run():
        try:
            out["y"] = m.forward(x, **kw)
            out["timing"] = m.last_timing()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_sent(m, n: int) -> None:
    """Until ``n`` calls of ``m`` in flight have sent their request (taken or not)."""
    _wait_for(lambda: sum(s.sent_seq == s.seq > 0 for s in list(m._h.busy)) >= n)


def _held(m) -> int:
    return int(m.ctl.all_instances["held"].sum())


@pytest.mark.timeout(120)
def test_a_call_that_cannot_make_its_deadline_is_refused_at_once(start_runtime):
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.2), max_batch_size=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    calls = [_call_in_thread(m, X * k) for k in range(10)]   # no timeout: 2 s of work queued
    _wait_for(lambda: m.stats()["batches"] >= 3 and _held(m) >= 4)   # its speed is learned
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as info:
        m.forward(X, timeout=0.5)
    took = time.monotonic() - t0
    e = info.value
    assert e.reason == "deadline" and e.expected_wait > 0.5 and e.timeout == 0.5
    assert isinstance(e, SimpleDBIError) and isinstance(e, TimeoutError)
    assert "overloaded" in str(e) and "500.0 ms" in str(e)
    assert took < 0.5, "refused only after its deadline"
    assert took < 0.05, "the client refuses on the wait the model process published, unsent"
    for k, (t, out) in enumerate(calls):     # nothing else lost or crossed
        t.join(60)
        np.testing.assert_array_equal(out["y"], X * k * 2 + 1)
    s = m.stats()
    assert s["rejected"] == {"deadline": 0, "queue": 0} and s["requests"] == 10   # it never ran
    np.testing.assert_array_equal(m.forward(X, timeout=30), X * 2 + 1)   # healthy after
    # the client's own refusal is counted once its next request reaches a model process
    assert m.stats()["rejected"] == {"deadline": 1, "queue": 0}


@pytest.mark.timeout(120)
def test_one_slow_batch_does_not_refuse_every_later_call(start_runtime):
    """A batch that took far longer than the calls' timeouts (a cold start, a stall) must not
    make the model refuse every later call with a timeout: only a batch that runs can correct
    what it learned, so one always does."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.01), max_batch_size=4))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    np.testing.assert_array_equal(m.forward(X * models.SLOW), X * models.SLOW * 2 + 1)   # 1 s
    answered = 0
    for k in range(20):   # one at a time, well below capacity, each with 0.3 s to spare
        try:
            np.testing.assert_array_equal(m.forward(X * k, timeout=0.3), X * k * 2 + 1)
            answered += 1
        except Overloaded:
            pass
    assert answered >= 15, f"only {answered} of 20 calls at low load answered after one slow batch"


@pytest.mark.timeout(120)
def test_a_model_that_sped_up_answers_again_within_a_few_of_its_old_batches(start_runtime):
    """Learned slow (a device warming up: here one batch of 1 s after the cold first one), then
    fast again: calls whose timeout is shorter than the old latency are refused only until a
    batch shows the new pace -- not for the ~20 batches an average would take to forget."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.01), max_batch_size=4))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    m.forward(X)                                  # the cold first batch teaches nothing
    m.forward(X * models.SLOW)                    # this one does: about 1 s a batch
    t_fast = time.monotonic()
    streak, k = 0, 0
    while streak < 8:                             # one call every 20 ms, each with 0.3 s
        assert time.monotonic() - t_fast < 5.0, f"still refusing after 5 s (streak {streak})"
        k += 1
        try:
            np.testing.assert_array_equal(m.forward(X * k, timeout=0.3), X * k * 2 + 1)
            streak += 1
        except Overloaded:
            streak = 0
            threading.Event().wait(0.02)          # pacing the calls, not synchronisation
    assert m.stats()["rejected"]["queue"] == 0


@pytest.mark.timeout(120)
def test_a_model_process_refuses_what_its_client_could_not_judge(start_runtime):
    """The wait a model process publishes is a newcomer's at default priority; a lower priority
    waits behind every default one, which only the model process sees: it refuses it."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.2), max_batch_size=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    calls = [_call_in_thread(m, X * k) for k in range(10)]
    _wait_for(lambda: m.stats()["batches"] >= 3 and _held(m) >= 4)
    newcomer = float(m.ctl.instances["newcomer_wait"][0])
    assert 0 < newcomer < 1.0    # a newcomer at priority 0 would be answered within 1 s ...
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as info:
        m.forward(X, timeout=1.0, priority=-1)   # ... one at -1 would wait for all of them
    assert info.value.reason == "deadline" and info.value.expected_wait > 1.0
    assert time.monotonic() - t0 < 1.0
    assert m.stats()["rejected"] == {"deadline": 1, "queue": 0}   # the model process refused it
    for k, (t, out) in enumerate(calls):
        t.join(60)
        np.testing.assert_array_equal(out["y"], X * k * 2 + 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("newcomer_priority", [0, 1])
def test_max_queue_refuses_the_newcomer_or_the_lowest_it_outranks(start_runtime, gate, newcomer_priority):
    """A gated request holds the model; B, C, D, E are sent in that order. With max_queue=2, B
    goes in the next batch and C, D wait: E is refused -- or, with a higher priority, D (the
    newest of the lowest) is refused in its place and E runs first."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1,
                                 max_queue=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    first = _call_in_thread(m, np.full((1, 4), models.GATE, np.float32))
    gate.wait_entered()
    calls = {}
    for n, name in enumerate("BCDE", start=1):
        calls[name] = _call_in_thread(m, X * n, priority=newcomer_priority if name == "E" else 0)
        wait_queued(m, n=n)   # on the socket in this order
    gate.open()
    for t, _ in [first, *calls.values()]:
        t.join(60)
    refused = "E" if newcomer_priority == 0 else "D"
    for n, name in enumerate("BCDE", start=1):
        out = calls[name][1]
        if name == refused:
            assert isinstance(out.get("error"), Overloaded) and out["error"].reason == "queue"
            assert "ModelConfig.max_queue is 2" in str(out["error"])   # (was "max_queue (2) requests are waiting")
        else:
            np.testing.assert_array_equal(out["y"], X * n * 2 + 1)
    if newcomer_priority:
        closed = {k: calls[k][1]["timing"]["batch_closed"] for k in "BCE"}
        assert closed["E"] < closed["B"] < closed["C"]
    assert m.stats()["rejected"] == {"deadline": 0, "queue": 1}


@pytest.mark.timeout(120)
def test_a_model_process_refusing_on_a_full_queue_says_how_long_it_would_wait(start_runtime, gate,
                                                                               monkeypatch):
    """Overloaded.expected_wait of a refusal by max_queue made in a model process is what the queue
    ahead would take (it was 0: callers retrying after retry_after came back within 1 ms, 25
    refusals an answer, helper-55). The client's own check is switched off so that the model
    process decides."""
    from simpledbi import client
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.05, gate.name), max_batch_size=1,
                                 max_queue=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    for _ in range(3):
        m.forward(X)   # it learns how long a batch takes
    monkeypatch.setattr(client._Handles, "refuse", lambda self, slot, deadline: None)
    first = _call_in_thread(m, np.full((1, 4), models.GATE, np.float32))
    gate.wait_entered()
    calls = []
    for k in range(3):   # the next batch's, one waiting (the queue is full), one refused
        calls.append(_call_in_thread(m, X * k, timeout=30))
        # taken (held counts the gated one too) or refused
        _wait_for(lambda: _held(m) - 1 + sum("error" in out for _, out in calls) == len(calls))
    gate.open()
    for t, out in (first, *calls):
        t.join(60)
    refused = [out["error"] for _, out in calls if "error" in out]
    assert len(refused) == 1 and isinstance(refused[0], Overloaded), calls
    e = refused[0]
    assert e.reason == "queue" and e.expected_wait >= 0.05 and e.retry_after >= 0.05, e.expected_wait

@pytest.mark.timeout(120)
def test_an_async_call_refused_names_its_own_timeout(start_runtime, gate):
    # forward_async passed what was left of its timeout when a pool thread took the call: the
    # error said "past its timeout of 17.5 ms" for timeout=0.02, and Overloaded.timeout was that
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1,
                                 max_queue=0))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    first = _call_in_thread(m, np.full((1, 4), models.GATE, np.float32))
    gate.wait_entered()
    second = _call_in_thread(m, X)        # the next batch's
    wait_queued(m, n=1)
    out = {}

    def third():   # refused once the process takes it, after the gate opens
        try:
            asyncio.run(m.forward_async(X, timeout=30.0))
        except Exception as e:  # noqa: BLE001
            out["e"] = e
    t = threading.Thread(target=third)
    t.start()
    wait_queued(m, n=2)
    gate.open()
    for thread in (first[0], second[0], t):
        thread.join(60)
    e = out.get("e")
    assert isinstance(e, Overloaded) and e.reason == "queue", out
    assert e.timeout == 30.0 and "ModelConfig.max_queue is 0" in str(e), (e, e.timeout)



@pytest.mark.timeout(120)
def test_higher_priority_runs_first(start_runtime, gate):
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    first = _call_in_thread(m, np.full((1, 4), models.GATE, np.float32))
    gate.wait_entered()
    order = [("low1", 0), ("low2", 0), ("high", 5), ("lowest", -3), ("high2", 5)]
    calls = {}
    for n, (name, prio) in enumerate(order, start=1):
        calls[name] = _call_in_thread(m, X * n, priority=prio)
        wait_queued(m, n=n)
    gate.open()
    for t, _ in [first, *calls.values()]:
        t.join(60)
    closed = sorted(calls, key=lambda k: calls[k][1]["timing"]["batch_closed"])
    assert closed == ["high", "high2", "low1", "low2", "lowest"]
    for n, (name, _) in enumerate(order, start=1):
        np.testing.assert_array_equal(calls[name][1]["y"], X * n * 2 + 1)


def test_priority_and_timeouts_are_checked_in_the_caller(start_runtime):
    rt = start_runtime(cpu_model("m", models.affine, default_timeout=5.0))
    m = SharedModel("m", max_shape=(1, 6, 5), namespace=rt.namespace)
    x = np.ones((1, 6, 5), np.float32)
    with pytest.raises(TypeError, match="priority: expected an int, got str"):
        m.forward(x, priority="high")
    with pytest.raises(ValueError, match=r"priority: expected -1000..1000, got 5000"):
        m.forward(x, priority=5000)
    with pytest.raises(TypeError, match="priority"):
        SharedModel("m", max_shape=(1, 6, 5), namespace=rt.namespace, priority=1.5)
    assert m._h.default_timeout == 5.0   # what a call without a timeout gets
    np.testing.assert_array_equal(m.forward(x, priority=7), x * 2 + 1)
    for timeout in (np.float32(5), np.int64(5), 10 ** 400, float("inf")):   # any real seconds
        np.testing.assert_array_equal(m.forward(x, timeout=timeout, priority=np.int32(1)), x * 2 + 1)
    for timeout in (-1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout: expected None or seconds >= 0"):
            m.forward(x, timeout=timeout)


@pytest.mark.timeout(180)
def test_a_client_with_many_threads_does_not_crowd_out_the_others(start_runtime):
    """16 threads of this process flood the model; 3 other processes make one call at a time.
    Taken in arrival order, this process would get 16 of every 19 answers; with fair turns by
    process, a one-thread client gets about as many answers as the flood in the same time."""
    # (20 ms a batch: a one-thread client's turnaround between its calls, a few ms on a loaded
    # 2-core machine, stays well inside one batch, as fair turns assume)
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.02), max_batch_size=4))
    ctx = mp.get_context("spawn")
    lights, pipes = [], []
    for _ in range(3):
        here, there = ctx.Pipe()
        p = ctx.Process(target=workers.light_client, args=(rt.namespace, "m", 40, there))
        p.start()
        lights.append(p)
        pipes.append(here)
    for p in pipes:
        assert p.poll(60) and p.recv() == "ready"
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    stop, flood_done, errors = threading.Event(), [0], []

    def flood():
        try:
            while not stop.is_set():
                m.forward(X, timeout=60)
                flood_done[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=flood) for _ in range(16)]
    for t in threads:
        t.start()
    _wait_for(lambda: flood_done[0] >= 32)   # the flood is on
    start = flood_done[0]
    for p in pipes:
        p.send("go")
    for p in pipes:
        assert p.poll(120)
        p.recv()
    during = flood_done[0] - start
    stop.set()
    for t in threads:
        t.join(60)
    for p in lights:
        p.join(60)
        assert p.exitcode == 0
    assert errors == []
    # 40 calls each: arrival order would let the flood finish ~16 x 40 = 640 meanwhile; fair turns
    # give it about 40 (once 160, with two other test runs loading this 2-core machine: a one-thread
    # client's turnaround then outlasts the turn held for it), so 6 x 40 leaves room for load alone
    assert during < 6 * 40, f"the 16-thread client got {during} answers while each other got 40"



@pytest.mark.timeout(180)
@pytest.mark.parametrize("handles", [1, 4])
def test_a_client_of_many_threads_holds_few_places_in_the_models_queue(start_runtime, gate, handles):
    """With peers, a model process takes only its next batch off the socket, so the order of the
    model's queue (and of the line of senders waiting for room in it) is the order of service.
    Every thread of a flooding process waited in that line, and a one-call client came after all
    of them. Now a process's socket to the model (shared by its handles) has a small send buffer
    (client._SEND_BUFFER): the kernel keeps a few of its datagrams in the queue and the line at
    most, its other threads wait on its own socket, and the one-call client's request goes in
    after those few -- however many handles the flood uses (``handles``)."""
    qlen = int(open("/proc/sys/net/unix/max_dgram_qlen").read())
    if qlen > 64:
        pytest.skip(f"net.unix.max_dgram_qlen is {qlen}: a flood that fills it takes too long here")
    rt = start_runtime(cpu_model("m", functools.partial(models.faulty, gate.name, 0.02), max_batch_size=1,
                                 model_num=2, wait_time=0.0))
    here, there = mp.get_context("spawn").Pipe()
    other = mp.get_context("spawn").Process(target=workers.one_call_client, args=(rt.namespace, "m", there))
    other.start()
    try:
        assert here.poll(60) and here.recv() == "ready"
        ms = [SharedModel("m", max_shape=(1, 4), namespace=rt.namespace) for _ in range(handles)]
        m = ms[0]
        held = [_call_in_thread(m, np.full((1, 4), models.GATE, np.float32)) for _ in range(2)]
        gate.wait_entered()
        gate.wait_entered()   # both model processes are busy: nothing is taken off the socket
        done, lock = [], threading.Lock()

        def flood(k):
            x = np.full((1, 4), k, np.float32)
            np.testing.assert_array_equal(ms[k % handles].forward(x, timeout=60), x * 2 + 1)
            with lock:
                done.append(time.monotonic())

        n = qlen + 31
        threads = [threading.Thread(target=flood, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(workers.waiting_to_send(os.getpid())) < n - qlen - 1:   # the rest wait to send
            if time.monotonic() > deadline:
                gate.open()
                gate.open()
                if not workers.waiting_to_send(os.getpid()):
                    pytest.skip("/proc/<pid>/task/<tid>/wchan does not name kernel waits here")
                raise AssertionError("the flood never waited to send")
            threading.Event().wait(0.01)
        here.send("go")
        assert here.poll(60) and here.recv() == "sent"   # (or waits in the kernel to send it)
        gate.open()
        gate.open()
        assert here.poll(60)
        answered_at = here.recv()
        for t in threads:
            t.join(60)
        for t, out in held:
            t.join(60)
            assert "error" not in out, out
        assert len(done) == n
        before = sum(1 for t in done if t < answered_at)
        # A model process takes one at a time, two at once, 20 ms each: the order of answers is the
        # order in the queue, give or take a pair. Measured: 6-7 of 41 before it; 40 with the
        # default send buffer.
        assert before <= n - 20, f"{before} of the flood's {n} calls were answered before the other's one"
        for h in ms:
            h.close()
    finally:
        other.join(60)
        assert other.exitcode == 0

@pytest.mark.timeout(120)
def test_a_request_handed_back_by_a_process_that_died_is_still_answered(start_runtime):
    """A process holding more than its next batch while a peer is idle hands the rest back
    through the socket (Intake.hand_back). If it dies before the peer reads them, they must
    still be answered -- the peer honours a hand-back of a process that was a sibling, and the
    caller offers a request again whose claimer died with it still offered."""
    import os
    import signal
    from simpledbi.shm import pid_alive
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.5), max_batch_size=1,
                                 model_num=2, max_queue=100))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    inst = lambda field: [int(v) for v in m.ctl.all_instances[field][:2]]  # noqa: E731
    _wait_for(lambda: inst("free") == [1, 1])
    pids = inst("pid")
    calls = {}
    calls[1] = _call_in_thread(m, X * 1)
    _wait_for(lambda: sum(inst("held")) == 1)
    calls[2] = _call_in_thread(m, X * 2)
    _wait_for(lambda: inst("held") == [1, 1])
    for k in range(3, 7):
        calls[k] = _call_in_thread(m, X * k)
    # one took r3..r6 while the other was busy: all four, or three with the last taken later
    # (which process takes each is a race), client._SEND_BUFFER
    _wait_for(lambda: max(inst("held")) >= 3)
    held = inst("held")
    a = held.index(max(held))
    b = 1 - a
    os.kill(pids[b], signal.SIGSTOP)            # the peer, slow to read what comes back ...
    try:
        rt.ctls["m"].all_instances["free"][b] = 1   # ... and idle as far as a can tell (set here)
        _wait_for(lambda: inst("held")[a] == 1)  # a handed back all but the one it computes
        os.kill(pids[a], signal.SIGKILL)
        _wait_for(lambda: not pid_alive(pids[a]))
    finally:
        os.kill(pids[b], signal.SIGCONT)
    for k, (t, out) in calls.items():
        t.join(60)
        assert not t.is_alive(), f"call {k} never ended"
        if "error" in out:   # only what the dead process was computing may fail
            assert type(out["error"]).__name__ == "ModelProcessDied", out["error"]
        else:
            np.testing.assert_array_equal(out["y"], X * k * 2 + 1)
    assert sum("error" in out for _, out in calls.values()) <= 1


@pytest.mark.timeout(120)
def test_max_queue_refuses_only_what_would_wait(start_runtime, gate):
    """max_queue counts the requests waiting at every process; a process that goes idle gets what
    waits at its busy peer (handed back to the socket for it, helper-49), so max_queue is no longer
    reached and a newcomer is not refused."""
    # (ordered by a gate and by batch lengths: with two equal batches the processes finished
    # close together on a loaded machine, both took from the socket, and neither held max_queue)
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.5, gate.name), max_batch_size=1,
                                 model_num=2, max_queue=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    inst = lambda field: [int(v) for v in m.ctl.all_instances[field][:2]]  # noqa: E731
    _wait_for(lambda: inst("free") == [1, 1])
    xs = [np.full((1, 4), models.GATE, np.float32), X * 2]
    for k in (3, 4, 5):   # 1.5 s batches (SLOW): the other process is idle long before they end
        x = X * k
        x[0, 0] = models.SLOW
        xs.append(x)
    calls = [_call_in_thread(m, xs[0])]
    gate.wait_entered()                       # one process holds it until the gate opens
    calls.append(_call_in_thread(m, xs[1]))
    _wait_for(lambda: inst("held") == [1, 1])
    calls += [_call_in_thread(m, x) for x in xs[2:]]
    # the other finishes first, runs one and holds two waiting (max_queue) ...
    _wait_for(lambda: sorted(inst("queued")) == [0, 2])
    gate.open()   # ... and the gated one finishes, goes idle, and gets what its peer held
    _wait_for(lambda: min(inst("held")) >= 1 and sum(inst("queued")) <= 1)
    np.testing.assert_array_equal(m.forward(X * 6), X * 6 * 2 + 1)
    for (t, out), x in zip(calls, xs):
        t.join(60)
        np.testing.assert_array_equal(out["y"], x * 2 + 1)
    assert m.stats()["rejected"]["queue"] == 0


@pytest.mark.timeout(120)
def test_the_client_refuses_at_once_what_would_wait_beyond_max_queue(start_runtime, gate):
    """max_queue with no deadlines: while the model process runs a batch it keeps taking
    requests, so it publishes what waits; a newcomer that finds max_queue waiting is refused by
    its own client, unsent, told how many wait -- and counted by the model all the same. (A gate,
    not a batch's length, holds each step: with 0.3 s batches a loaded machine let A finish
    before B, C and D were all sent.)"""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1,
                                 max_queue=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    gated = np.full((1, 4), models.GATE, np.float32)
    calls = [_call_in_thread(m, gated)]   # A: runs, held at the gate; B, C, D queue on the socket
    gate.wait_entered()
    for k, x in enumerate((gated, X * 3, X * 4), start=1):
        calls.append(_call_in_thread(m, x))
        wait_queued(m, n=k)
    gate.open()   # A done: B runs (on a helper thread, held at the gate, its process taking requests)
    gate.wait_entered()
    _wait_for(lambda: int(m.ctl.all_instances["queued"][0]) == 2)   # C and D wait
    with pytest.raises(Overloaded, match="2 requests are waiting, ModelConfig.max_queue is 2") as e:
        m.forward(X * 9)
    assert e.value.reason == "queue"
    gate.open()
    for (t, out), x in zip(calls, (gated, gated, X * 3, X * 4)):
        t.join(60)
        np.testing.assert_array_equal(out["y"], x * 2 + 1)
    m.forward(X)   # its datagram reports the refusal
    assert m.stats()["rejected"] == {"deadline": 0, "queue": 1}


@pytest.mark.timeout(120)
def test_a_request_whose_caller_stopped_waiting_holds_no_place_in_max_queue(start_runtime, gate):
    """max_queue=2 is reached by C and D, then C's caller times out: a newcomer E (priority 1)
    takes C's place -- C is answered as expired -- and D, whose caller still waits, is not
    refused in E's favour."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1,
                                 max_queue=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    gated = np.full((1, 4), models.GATE, np.float32)
    first = _call_in_thread(m, gated)   # A: runs, held at the gate
    gate.wait_entered()
    calls = {"B": _call_in_thread(m, gated)}
    wait_queued(m, n=1)
    calls["C"] = _call_in_thread(m, X * 3, timeout=2.0)
    wait_queued(m, n=2)
    calls["D"] = _call_in_thread(m, X * 4)
    wait_queued(m, n=3)
    gate.open()          # A done: B runs (held at the gate), C and D wait
    gate.wait_entered()
    _wait_for(lambda: int(m.ctl.all_instances["queued"][0]) == 2)
    calls["C"][0].join(30)   # C's caller gives up while C waits
    assert "a model process took the request" in str(calls["C"][1].get("error")), calls["C"][1]
    calls["E"] = _call_in_thread(m, X * 5, priority=1)
    _wait_for(lambda: int(m.ctl.all_instances["held"][0]) == 3)   # B, D, E
    gate.open()
    for t, _ in [first, *calls.values()]:
        t.join(60)
    for name, k in (("D", 4), ("E", 5)):
        np.testing.assert_array_equal(calls[name][1]["y"], X * k * 2 + 1)
    stats = m.stats()
    assert stats["rejected"] == {"deadline": 0, "queue": 0} and stats["expired"] == 1, stats
    # `simpledbi status` shows them (helper-49: it showed rejections only), and an idle model's
    # newcomer waits for nothing, whatever was published while requests waited
    from simpledbi.status import format_status, inspect
    assert "expired 1  withdrawn 0  a newcomer's expected wait 0.00 ms" in format_status(
        inspect(namespace=rt.namespace))


@pytest.mark.timeout(120)
def test_a_newcomer_that_cannot_make_its_deadline_displaces_no_one(start_runtime, gate):
    """With max_queue reached, a higher-priority newcomer whose timeout is shorter than a batch
    is refused for its deadline, and the request it outranks keeps its place."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.3, gate.name), max_batch_size=1,
                                 max_queue=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    for _ in range(2):
        m.forward(X, timeout=10)   # it learns a batch takes 0.3 s
    first = _call_in_thread(m, np.full((1, 4), models.GATE, np.float32))
    gate.wait_entered()
    calls = {}
    for n, name in enumerate("BCD", start=1):   # (taken during the gated batch: it is learned long)
        calls[name] = _call_in_thread(m, X * n)
        _wait_sent(m, n + 1)
    newcomer = _call_in_thread(m, X * 9, priority=5, timeout=0.5)
    newcomer[0].join(60)
    gate.open()
    for t, _ in [first, newcomer, *calls.values()]:
        t.join(60)
    assert isinstance(newcomer[1].get("error"), Overloaded) and newcomer[1]["error"].reason == "deadline"
    for n, name in enumerate("BCD", start=1):
        np.testing.assert_array_equal(calls[name][1]["y"], X * n * 2 + 1)
    assert m.stats()["rejected"] == {"deadline": 1, "queue": 0}


@pytest.mark.timeout(120)
def test_cancelled_calls_a_model_process_took_do_not_run(start_runtime, gate):
    """Cancelling forward_async tasks whose requests a model process already holds (taken,
    waiting for a batch) drops them at their batch's close: they never run."""
    import asyncio
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.01, gate.name), max_batch_size=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    gated = np.full((1, 4), models.GATE, np.float32)

    async def until(cond):
        while not cond():
            await asyncio.sleep(0.005)   # polls a shared-memory condition

    async def main():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(m.forward_async(gated))
        await loop.run_in_executor(None, gate.wait_entered)
        queued = lambda: sum(slot.queued() for slot in list(m._h.busy))   # noqa: E731
        rest = [asyncio.ensure_future(m.forward_async(gated))]
        await until(lambda: queued() == 1)   # the gated one first: it runs first
        rest += [asyncio.ensure_future(m.forward_async(x)) for x in (X * 3, X * 4, X * 5)]
        # all four queued on the socket while the first runs ...
        await until(lambda: queued() == 4)
        gate.open()
        await loop.run_in_executor(None, gate.wait_entered)   # ... taken at once: 2 runs (held
        await until(lambda: _held(m) == 4)                    # at its gate), 3-5 wait
        for task in rest[1:]:
            task.cancel()
        # the cancelled calls' threads have told the model process (their slots wait, stale,
        # for the answers they no longer want) before the batches of 3-5 close
        await until(lambda: len(m._h.stale) == 3)
        gate.open()
        got = await asyncio.gather(first, *rest, return_exceptions=True)
        return got

    got = asyncio.run(asyncio.wait_for(main(), 60))
    np.testing.assert_array_equal(got[0], gated * 2 + 1)
    np.testing.assert_array_equal(got[1], gated * 2 + 1)
    assert all(isinstance(g, asyncio.CancelledError) for g in got[2:])
    np.testing.assert_array_equal(m.forward(X * 7), X * 15)   # its slots serve again
    s = m.stats()
    assert s["requests"] == 3 and s["withdrawn"] == 3, (s, got)


def test_the_runtime_answers_a_handed_back_request_left_on_the_socket_when_it_stops():
    """Requests still queued on a model's socket when the runtime stops are answered "stopped"
    (intake.answer_queued) -- a request a model process handed back (Intake.hand_back: wrapped,
    naming its client) too, not only as its client sent it."""
    import socket
    from simpledbi.intake import answer_queued
    from simpledbi.layout import FWD_MAGIC, FWD_PREFIX, ST_STOPPED
    from simpledbi.slots import ClientSlot
    rx, tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    slot = ClientSlot(tx, [(1, 4)], [np.dtype(np.float32)], send_fd=True)
    try:
        seq = slot.publish([X])
        data, anc, _, _ = rx.recvmsg(1 << 16, 1024)   # a model process took it ...
        fds = [fd for level, kind, blob in anc if kind == socket.SCM_RIGHTS
               for fd in np.frombuffer(blob, np.int32).tolist()]
        try:   # ... and hands it back, as Intake.hand_back does
            tx.sendmsg([FWD_PREFIX.pack(FWD_MAGIC, 0, os.getpid()) + data],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, np.array(fds, np.int32).tobytes())])
        finally:
            for fd in fds:
                os.close(fd)
        assert answer_queued(rx, ST_STOPPED, "the runtime stopped") == 1
        assert slot.answered(seq) and slot.response()[0] == ST_STOPPED
    finally:
        slot.detach()
        rx.close()
        tx.close()


@pytest.mark.timeout(120)
def test_callers_retrying_at_once_after_a_refusal_still_get_the_models_capacity(start_runtime):
    # A backlog published while the process held a batch stayed published while it then sat idle
    # for a poll interval: every caller refused its next call itself, nobody sent, and 8 threads
    # retrying at once got 8 answers/s of a 40/s model.
    from simpledbi import RuntimeOptions
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.05), max_batch_size=2,
                                 default_timeout=0.1),
                       options=RuntimeOptions(join_timeout=10.0))   # the default poll interval
    m = SharedModel("m", max_shape=(1, 3), namespace=rt.namespace)
    x = np.ones((1, 3), np.float32)
    for _ in range(5):
        m.forward(x)          # its batch cost learned
    answered, stop = [], time.monotonic() + 3.0

    def retry_loop():
        while time.monotonic() < stop:
            try:
                np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
                answered.append(1)
            except (Overloaded, TimeoutError):
                pass          # no back-off: the worst a caller can do

    threads = [threading.Thread(target=retry_loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # capacity: 2 rows / 50 ms = 40/s, 120 in the window; the stall left 16-24
    assert len(answered) >= 50, f"{len(answered)} answers in 3 s from a model of 40/s"
    m.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_request_waiting_for_a_busy_process_goes_to_a_peer_that_went_idle(start_runtime, gate, timeout):
    """helper-49: a CPU model process took a request for its next batch and ran a long batch meanwhile;
    its peer went idle, and the request waited for the whole long batch (with a timeout: refused, as it
    could not make it). Now it stays on the socket for whichever process is free first (no timeout), or
    the process taking requests during its batch hands what it holds to the peer that went idle."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1,
                                 model_num=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    gated = np.full((1, 4), models.GATE, np.float32)
    calls = []
    for _ in range(2):   # both processes held at the gate
        calls.append(_call_in_thread(m, gated, timeout=timeout))
        gate.wait_entered()
    slow = X * 3
    slow[0, 0] = models.SLOW   # a batch of SLOW_SECONDS
    calls += [_call_in_thread(m, x, timeout=timeout) for x in (slow, X * 4)]
    wait_queued(m, n=2)
    gate.open()    # one process answers and takes the slow one (and, before, the next one as well) ...
    _wait_for(lambda: "y" in calls[0][1] or "y" in calls[1][1])
    gate.open()    # ... and the other goes idle while the slow batch runs: it answers the last one
    for t, _ in calls:
        t.join(60)
    outs = [out for _, out in calls]
    for out, x in zip(outs, (gated, gated, slow, X * 4)):
        assert "error" not in out, out.get("error")
        np.testing.assert_array_equal(out["y"], x * 2 + 1)
    assert outs[3]["timing"]["done"] < outs[2]["timing"]["done"]   # not after the slow batch


@pytest.mark.timeout(120)
def test_a_burst_during_a_long_batch_is_refused_at_once_with_nothing_held_before(start_runtime, gate):
    """helper-49: with nothing waiting when a CPU batch began, its process ran it on the serving thread
    and read no requests: a burst's calls beyond max_queue were refused only when the batch ended. A
    batch learned to take at least holding._TAKE_WHILE_COMPUTING now always runs beside the intake."""
    rt = start_runtime(cpu_model("m", functools.partial(models.sleepy, 0.005, gate.name), max_batch_size=1,
                                 max_queue=1))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    for k in range(4):   # its batches take 5 ms: learned
        m.forward(X * k)
    calls = [_call_in_thread(m, np.full((1, 4), models.GATE, np.float32))]
    gate.wait_entered()   # a batch that lasts until the gate opens, nothing waiting
    calls += [_call_in_thread(m, X * k, timeout=60) for k in range(5)]
    refused = 0
    while refused < 3:   # 2 fit: one in the next batch, one waiting (max_queue); the rest is refused
        _wait_for(lambda: sum(isinstance(out.get("error"), Overloaded) for _, out in calls) > refused)
        refused = sum(isinstance(out.get("error"), Overloaded) for _, out in calls)
    assert all(out["error"].reason == "queue" for _, out in calls if "error" in out)
    gate.open()
    for t, _ in calls:
        t.join(60)
    assert sum("y" in out for _, out in calls) == 3 and refused == 3
