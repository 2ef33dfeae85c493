"""forward_async waits in the event loop: its answers are watched by a thread per 127 calls
(watchers.py), its datagrams sent by a thread per handle while the model's queue is full
(sender.py). Nothing else of a call runs outside the loop."""
import asyncio
import ctypes
import functools
import gc
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from simpledbi import ModelProcessDied, RuntimeStopped, SharedModel
from simpledbi import client as client_module, futex, watchers

from . import models
from .conftest import cpu_model

needs_waitv = pytest.mark.skipif(not watchers.available(), reason="this kernel has no futex_waitv")


@pytest.fixture(params=["loop", "threads"])
def async_mode(request, monkeypatch):
    """forward_async as it runs here (loop), and as where the kernel has no futex_waitv (threads)."""
    if request.param == "loop" and not watchers.available():
        pytest.skip("this kernel has no futex_waitv")
    monkeypatch.setattr(client_module, "_ASYNC_WATCHERS", request.param == "loop")
    return request.param


# ---------------------------------------------------------------- watchers, alone
@needs_waitv
@pytest.mark.timeout(60)
def test_watchers_wake_each_call_for_its_own_word_only():
    n, idle = 300, 20
    words = (ctypes.c_uint32 * (n + idle))()
    addr = [ctypes.addressof(words) + 4 * k for k in range(n + idle)]
    ended = {}

    async def wait(k, timeout):
        t = time.monotonic()
        await watchers.changed(addr[k], 0, timeout)
        ended[k] = (time.monotonic() - t, words[k])

    def change_all():
        for k in random.sample(range(n), n):
            futex.store_and_wake(addr[k], 1)

    async def main():
        tasks = [asyncio.ensure_future(wait(k, 30.0)) for k in range(n)]
        tasks += [asyncio.ensure_future(wait(k, 0.2)) for k in range(n, n + idle)]
        for _ in range(3):
            await asyncio.sleep(0)   # every call watches its word (and the bells have rung)
        assert all(k not in ended for k in range(n))
        before = len(watchers._watchers)
        await asyncio.to_thread(change_all)
        await asyncio.gather(*tasks)
        return before

    watching = asyncio.run(main())
    # one thread per 127 words watched at once (words watched before this test's are counted too)
    assert len(watchers._watchers) == watching <= math.ceil((n + idle) / 127) + 1
    for k in range(n):   # each returned because its own word changed, long before its timeout
        assert ended[k][1] == 1 and ended[k][0] < 10, (k, ended[k])
    for k in range(n, n + idle):   # the others at their timeout, their words untouched
        assert ended[k][1] == 0 and 0.15 < ended[k][0] < 10, (k, ended[k])


@needs_waitv
@pytest.mark.timeout(30)
def test_a_word_that_changed_before_the_watcher_slept_returns_at_once():
    word = ctypes.c_uint32(7)

    async def main():
        t = time.monotonic()
        await watchers.changed(ctypes.addressof(word), 6, 20.0)   # the caller saw 6; it holds 7
        return time.monotonic() - t

    assert asyncio.run(main()) < 5


# ---------------------------------------------------------------- forward_async end to end
@needs_waitv
@pytest.mark.timeout(120)
def test_forward_async_calls_wait_in_the_loop_not_in_a_thread_each(start_runtime, gate):
    """300 calls of one loop behind a model process stuck in a forward pass: they wait on a few
    threads (a watcher, the sender), not 300; once it goes on, each gets its own answer."""
    n = 300
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=16,
                                 wait_time=0.0, max_clients=n + 8))
    m = SharedModel("g", (1, 3), namespace=rt.namespace)

    async def main():
        blocker = asyncio.ensure_future(m.forward_async(np.full((1, 3), models.GATE, np.float32)))
        await asyncio.to_thread(gate.wait_entered)
        before = threading.active_count()
        xs = [np.full((1, 3), k, np.float32) for k in range(n)]
        calls = [asyncio.ensure_future(m.forward_async(x, timeout=60)) for x in xs]
        for _ in range(3):
            await asyncio.sleep(0)   # each call has published and sent or queued its request
        assert sum(s.seq == s.sent_seq for s in m._h.busy) >= 1   # (some are in the socket's queue)
        assert threading.active_count() - before <= 3, threading.enumerate()
        gate.open()
        ys = await asyncio.gather(*calls)
        await blocker
        return xs, ys

    xs, ys = asyncio.run(main())
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(y, x * 2 + 1)
    assert m.stats()["requests"] == n + 1
    m.close()


@pytest.mark.timeout(120)
def test_close_from_another_thread_ends_waiting_forward_async_calls_at_once(start_runtime, gate, async_mode):
    """With a 30 s poll interval, only the close's wake-up can end the calls within 10 s: the one
    whose request a model process holds, those queued on its socket and (in the loop, where they
    wait for the sender thread, not in a blocked send) those waiting for room in the full queue."""
    n = 20 if async_mode == "loop" else 5   # (the socket's queue holds 10: net.unix.max_dgram_qlen)
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 wait_time=0.0))
    m = SharedModel("g", (1, 3), namespace=rt.namespace, poll_interval=30)

    async def main():
        calls = [asyncio.ensure_future(m.forward_async(np.full((1, 3), models.GATE, np.float32)))]
        await asyncio.to_thread(gate.wait_entered)
        calls += [asyncio.ensure_future(m.forward_async(np.full((1, 3), k, np.float32))) for k in range(n)]
        await asyncio.sleep(0.2)   # (not a synchronisation: the calls end with RuntimeStopped either way)
        t = time.monotonic()
        await asyncio.to_thread(m.close)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        return outcomes, time.monotonic() - t

    outcomes, took = asyncio.run(main())
    gate.open()
    assert all(isinstance(o, RuntimeStopped) for o in outcomes), outcomes
    assert took < 10
    with SharedModel("g", (1, 3), namespace=rt.namespace) as again:   # the runtime is unharmed
        x = np.full((1, 3), 5.0, np.float32)
        np.testing.assert_array_equal(asyncio.run(again.forward_async(x, timeout=30)), x * 2 + 1)


@pytest.mark.timeout(120)
def test_forward_async_times_out_and_hears_of_a_dead_model_process(start_runtime, gate, async_mode):
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 wait_time=0.0, model_num=2, restart_backoff=0.01))
    m = SharedModel("g", (1, 3), namespace=rt.namespace)
    x = np.full((1, 3), models.GATE, np.float32)

    async def main():
        with pytest.raises(TimeoutError, match="no result within the timeout"):
            await m.forward_async(x, timeout=0.3)   # held in a forward pass until the gate opens
        await asyncio.to_thread(gate.wait_entered)
        held = asyncio.ensure_future(m.forward_async(x))
        await asyncio.to_thread(gate.wait_entered)   # the other process holds this one
        inst = rt.ctls["g"].instances
        for pid in [int(p) for p in inst["pid"][inst["held"] > 0]]:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(ModelProcessDied):
            await asyncio.wait_for(held, 20)   # told at once by the supervisor, not after a timeout

    asyncio.run(main())
    m.close()


def _burst(m, gate, base):
    """40 calls of ``m`` in flight at once (a gated one and 39 more), each answered its own."""
    async def main():
        blocker = asyncio.ensure_future(m.forward_async(np.full((1, 3), models.GATE, np.float32)))
        await asyncio.to_thread(gate.wait_entered)   # every call below is in flight at once
        xs = [np.full((1, 3), base + k, np.float32) for k in range(39)]
        calls = [asyncio.ensure_future(m.forward_async(x, timeout=60)) for x in xs]
        await asyncio.sleep(0)   # each call has published (a slot of its own)
        assert len(m._h.busy) == 40
        gate.open()
        return xs, await asyncio.gather(*calls), await blocker
    xs, ys, _ = asyncio.run(main())
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(y, x * 2 + 1)


@pytest.mark.timeout(120)
def test_a_bursts_idle_slots_never_take_another_clients_place(start_runtime, gate):
    """A handle closes the slots a burst made beyond _IDLE_KEPT idle ones, and a model process at
    max_clients unmaps an idle slot (a closed one first) for a newcomer: with max_clients 48, a second
    handle's 40 calls beside the first's 16 idle slots (and 24 closed, not yet dropped) are all served
    (8 got SlotsExhausted), and so is the first's next burst."""
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=64,
                                 wait_time=0.0, max_clients=48))
    kept = client_module._IDLE_KEPT
    a = SharedModel("g", (1, 3), namespace=rt.namespace)
    b = SharedModel("g", (1, 3), namespace=rt.namespace)
    _burst(a, gate, 0)
    assert len(a._h.idle) == kept and not a._h.busy
    _burst(b, gate, 100)   # 16 + 40 > 48
    _burst(a, gate, 200)   # its idle slots that were unmapped are mapped again
    assert len(a._h.idle) == len(b._h.idle) == kept
    assert rt.ctls["g"].instances["clients"].max() <= 48
    a.close()
    b.close()


@pytest.mark.timeout(120)
def test_cancelled_forward_async_calls_leave_no_unretrieved_exceptions(start_runtime, gate, async_mode):
    """Cancelled calls end quietly. In a thread (the fallback) each one's thread still ended with
    RuntimeStopped, in a future asyncio.shield had stopped watching: asyncio logged "Future exception
    was never retrieved" with a traceback, once per cancelled call (167 of 200)."""
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 wait_time=0.0))
    m = SharedModel("g", (1, 3), namespace=rt.namespace)
    seen = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))
        held = asyncio.ensure_future(m.forward_async(np.full((1, 3), models.GATE, np.float32)))
        await asyncio.to_thread(gate.wait_entered)
        calls = [asyncio.ensure_future(m.forward_async(np.full((1, 3), k, np.float32))) for k in range(20)]
        await asyncio.sleep(0.1)   # (not a synchronisation: they end cancelled however far they got)
        for call in calls + [held]:
            call.cancel()
        outcomes = await asyncio.gather(*calls, held, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
        gate.open()
        deadline = time.monotonic() + 30   # every call's thread (or the loop) gives its slot back
        while m._h.busy:
            assert time.monotonic() < deadline, m._h.busy
            await asyncio.sleep(0.01)
        for _ in range(10):   # what the threads' ends scheduled in the loop runs
            await asyncio.sleep(0)
        del calls, held, outcomes
        gc.collect()

    asyncio.run(main())
    assert not seen, [c.get("message") for c in seen]
    x = np.full((1, 3), 5.0, np.float32)   # the handle still serves
    np.testing.assert_array_equal(asyncio.run(m.forward_async(x, timeout=30)), x * 2 + 1)
    m.close()


@pytest.mark.timeout(180)
def test_calls_cancelled_as_their_own_timeout_ends_leave_no_unretrieved_exceptions(start_runtime, async_mode):
    """asyncio.wait_for around a call with the same short timeout: the task is cancelled while the
    call's own TimeoutError is on its way. In a thread, 4 in 1,000 such calls logged "Future exception
    was never retrieved" (the cancellation came after the thread had looked for it) -- helper-40."""
    rt = start_runtime(cpu_model("s", functools.partial(models.sleepy, 0.02), max_batch_size=8))
    m = SharedModel("s", (1, 3), namespace=rt.namespace)
    seen = []

    async def one(x):
        try:
            return await asyncio.wait_for(m.forward_async(x, timeout=0.01), 0.01)
        except (TimeoutError, asyncio.TimeoutError):
            return None

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))
        x = np.ones((1, 3), np.float32)
        for _ in range(100):
            await asyncio.gather(*[one(x) for _ in range(20)])
        deadline = time.monotonic() + 30   # every call's thread (or the loop) gives its slot back
        while m._h.busy:
            assert time.monotonic() < deadline, m._h.busy
            await asyncio.sleep(0.01)
        for _ in range(10):
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(main())
    assert not seen, [c.get("message") for c in seen][:3]
    m.close()


@pytest.mark.timeout(120)
def test_the_slots_of_abandoned_calls_are_trimmed_once_their_late_answers_came(start_runtime, gate):
    """A call that timed out after a model process took it keeps its slot stale until the late answer
    comes; those slots were never trimmed afterwards (helper-48: 546 memfds after 300 timed out). Once
    answered they are idle ones again, and the handle keeps _IDLE_KEPT beyond its calls in flight --
    from the handle's next call on."""
    # (max_queue, and batches learned to take 5 ms: the process takes every request in while its
    # batch waits at the gate)
    rt = start_runtime(cpu_model("g", functools.partial(models.sleepy, 0.005, gate.name), max_batch_size=64,
                                 wait_time=0.0, max_queue=1000))
    m = SharedModel("g", (1, 3), namespace=rt.namespace)
    gated = np.full((1, 3), models.GATE, np.float32)
    held = lambda: int(rt.ctls["g"].instances["held"].sum())   # noqa: E731
    for _ in range(4):
        m.forward(np.ones((1, 3), np.float32))

    async def abandon():   # 48 calls a model process holds, each abandoned by its caller
        first = asyncio.ensure_future(m.forward_async(gated))
        await asyncio.to_thread(gate.wait_entered)
        calls = [asyncio.ensure_future(m.forward_async(gated)) for _ in range(48)]
        deadline = time.monotonic() + 30
        while held() < 49:
            assert time.monotonic() < deadline, held()
            await asyncio.sleep(0.01)   # bounded wait on a shared-memory condition
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        while len(m._h.busy) > 1:
            assert time.monotonic() < deadline, m._h.busy
            await asyncio.sleep(0.01)   # bounded wait on the calls' ends
        assert len(m._h.stale) == 48   # owed their answers
        gate.open()   # the gated batch ends, and the 48 are answered at their batch's close, unrun
        await first

    asyncio.run(abandon())
    x = np.ones((1, 3), np.float32)
    # one call (sent after them: they were answered first) settles them all (it took 48 calls: helper-51)
    np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
    assert len(m._h.stale) + len(m._h.idle) <= client_module._IDLE_KEPT, (len(m._h.stale), len(m._h.idle))
    m.close()


@pytest.mark.timeout(120)
def test_cancelled_calls_whose_slots_were_closed_are_counted_withdrawn(start_runtime, gate):
    """Calls cancelled while their requests waited on the model's socket: the handle keeps only
    _IDLE_KEPT of their slots and closes the rest, and a model process that then reads a request of a
    closed slot has nothing to answer. It dropped it uncounted: stats()['withdrawn'] read 9, 1 and 0
    for 20, 30 and 50 cancelled calls (helper-52). Every call is run or counted withdrawn."""
    rt = start_runtime(cpu_model("g", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1))
    m = SharedModel("g", (1, 3), namespace=rt.namespace)
    gated = np.full((1, 3), models.GATE, np.float32)
    x = np.ones((1, 3), np.float32)
    m.forward(x)
    before = m.stats()
    n = 3 * client_module._IDLE_KEPT

    async def cancel_them():
        first = asyncio.ensure_future(m.forward_async(gated))
        await asyncio.to_thread(gate.wait_entered)   # the process is busy: the rest wait on the socket
        calls = [asyncio.ensure_future(m.forward_async(x)) for _ in range(n)]
        deadline = time.monotonic() + 30
        while len(m._h.busy) < n + 1:
            assert time.monotonic() < deadline, len(m._h.busy)
            await asyncio.sleep(0.01)   # bounded wait: every call has sent its request
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        gate.open()
        np.testing.assert_array_equal(await first, gated * 2 + 1)

    asyncio.run(asyncio.wait_for(cancel_them(), 60))
    np.testing.assert_array_equal(m.forward(x * 3), x * 7)   # sent after them all: they were read first
    s = m.stats()
    ran = s["requests"] - before["requests"] - 2
    assert ran + s["withdrawn"] - before["withdrawn"] == n, (ran, s)
    m.close()


@pytest.mark.timeout(60)
def test_a_cancelled_connect_async_does_not_hold_the_process_at_exit():
    """connect_async's constructor waits for the runtime in a pool thread; cancelled, that thread went
    on waiting for the whole connect_timeout, and the process could not exit before (helper-53)."""
    code = ("import asyncio, time\n"
            "from simpledbi import SharedModel\n"
            "async def main():\n"
            "    t = asyncio.ensure_future(SharedModel.connect_async('m', (1, 3), runtime='nobody-serves-this',\n"
            "                                                        connect_timeout=120))\n"
            "    await asyncio.sleep(0.2)\n"
            "    t.cancel()\n"
            "    try:\n"
            "        await t\n"
            "    except asyncio.CancelledError:\n"
            "        print('CANCELLED', flush=True)\n"
            "asyncio.run(main())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and "CANCELLED" in out.stdout, out
    assert time.monotonic() - t0 < 30, "the process waited for the cancelled connect's thread"


@pytest.mark.timeout(120)
def test_calls_cancelled_while_the_sender_held_their_datagrams_are_counted_withdrawn(start_runtime, gate):
    """forward_async's sender thread hands queued datagrams to the kernel in one sendmmsg, which waits
    up to a poll interval for room. Calls cancelled meanwhile were not sent when that wait ended, and
    were counted nowhere (helper-53: 15-52 of 100 missing); they are reported by the next request."""
    rt = start_runtime(cpu_model("g", functools.partial(models.sleepy, 0.0, gate.name), max_batch_size=1))
    m = SharedModel("g", (1, 3), namespace=rt.namespace, poll_interval=2.0)   # the sender's wait
    gated = np.full((1, 3), models.GATE, np.float32)
    x = np.ones((1, 3), np.float32)
    m.forward(x)
    before = m.stats()
    n = 40

    async def cancel_them():
        first = asyncio.ensure_future(m.forward_async(gated))
        await asyncio.to_thread(gate.wait_entered)   # the process is busy: the socket's queue fills
        calls = [asyncio.ensure_future(m.forward_async(x)) for _ in range(n)]
        deadline = time.monotonic() + 30
        while m._h._sender is None or not m._h._sender._sending:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)   # bounded wait: the sender holds datagrams in its sendmmsg
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        while m._h.refused[2] == 0:   # its sendmmsg returns (some sent, or 2 s) with them unsent: handed back
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        gate.open()
        np.testing.assert_array_equal(await first, gated * 2 + 1)

    asyncio.run(asyncio.wait_for(cancel_them(), 60))
    np.testing.assert_array_equal(m.forward(x * 3), x * 7)   # reports them, after the others were read
    s = m.stats()
    ran = s["requests"] - before["requests"] - 2
    assert ran + s["withdrawn"] - before["withdrawn"] == n, (ran, s)
    m.close()


@pytest.mark.timeout(60)
def test_a_blocking_forward_inside_a_coroutine_warns_once(start_runtime, caplog):
    """forward() inside a running event loop blocks the loop until the answer comes, silently
    (helper-55: a 195 ms stall of every other task); it now says so, once per model."""
    import logging
    rt = start_runtime(cpu_model("a", models.affine, max_batch_size=4))
    m = SharedModel("a", (1, 3), namespace=rt.namespace)
    x = np.ones((1, 3), np.float32)
    np.testing.assert_array_equal(m.forward(x), x * 2 + 1)   # outside a loop: no warning

    async def main():
        for _ in range(3):
            np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
    with caplog.at_level(logging.WARNING, logger="simpledbi"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "inside a running asyncio event loop" in r.getMessage()]
    assert len(said) == 1 and "await forward_async" in said[0], said
    m.close()
