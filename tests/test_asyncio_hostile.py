"""Hostile clients of the forward_async event-loop path (watchers.py, sender.py)."""
import asyncio
import functools
import random
import threading
import time

import numpy as np
import pytest

from simpledbi import RuntimeStopped, SharedModel, watchers

from . import models
from .conftest import cpu_model

needs_waitv = pytest.mark.skipif(not watchers.available(), reason="this kernel has no futex_waitv")


def _x(k, rows=1):
    return np.full((rows, 3), float(k), np.float32)


@needs_waitv
@pytest.mark.timeout(180)
def test_cancellation_storm_every_survivor_gets_its_own_answer(start_runtime, gate):
    n = 600
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=8,
                                 wait_time=0.0, max_clients=n + 8))
    m = SharedModel("g", (4, 3), namespace=rt.namespace)
    rng = random.Random(1)

    async def main():
        blocker = asyncio.ensure_future(m.forward_async(_x(models.GATE)))
        await asyncio.to_thread(gate.wait_entered)
        calls = {k: asyncio.ensure_future(m.forward_async(_x(k, 1 + k % 4), timeout=60)) for k in range(n)}
        for _ in range(3):
            await asyncio.sleep(0)
        # cancel a third now (queued in the sender, or in the socket)
        for k in rng.sample(range(n), n // 3):
            calls[k].cancel()
        gate.open()
        await blocker
        # cancel more at random moments while answers flow
        for _ in range(40):
            await asyncio.sleep(rng.random() * 0.005)
            for k in rng.sample(range(n), 5):
                calls[k].cancel()
        res = await asyncio.gather(*calls.values(), return_exceptions=True)
        return dict(zip(calls, res))

    out = asyncio.run(main())
    ok = 0
    for k, r in out.items():
        if isinstance(r, asyncio.CancelledError):
            continue
        assert not isinstance(r, BaseException), (k, r)
        np.testing.assert_array_equal(r, _x(k, 1 + k % 4) * 2 + 1)
        ok += 1
    assert ok > 0
    assert not m._h.busy
    # the handle still works, from a fresh loop
    np.testing.assert_array_equal(asyncio.run(m.forward_async(_x(7), timeout=30)), _x(7) * 2 + 1)
    m.close()


async def _hold_and_fill(m, gate, n=40):
    """A call of ``m`` held in the gated forward pass, and ``n`` calls behind it: the socket's queue
    (10) fills, the rest wait in the sender. (blocker, fillers)"""
    blocker = asyncio.ensure_future(m.forward_async(_x(models.GATE)))
    await asyncio.to_thread(gate.wait_entered)
    fillers = [asyncio.ensure_future(m.forward_async(_x(k), timeout=60)) for k in range(n)]
    await asyncio.sleep(0)   # each filler runs to its first await: sent, or queued in the sender
    sender = m._h._sender
    assert sender is not None   # (made by the first filler that found the queue full)

    def in_the_kernel():   # the sender thread took them all into its sendmmsg, which waits for room:
        t = time.monotonic()   # a call queued from now on waits in the queue for a poll interval
        while sender._queue or not sender._sending:
            assert time.monotonic() - t < 30, "the sender thread never took the queued datagrams"
            time.sleep(0.001)
    await asyncio.to_thread(in_the_kernel)
    return blocker, fillers


@needs_waitv
@pytest.mark.timeout(120)
def test_a_timeout_while_waiting_for_room_is_a_timeout_not_a_stopped_runtime(start_runtime, gate):
    """TimeoutError is an OSError: _send_when_room's `except OSError` took its own timeout for a
    socket gone, raised RuntimeStopped("the runtime is gone") and marked the handle gone."""
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 wait_time=0.0))
    # the sender's sendmmsg waits a poll interval for room: the timed-out call's datagram stays
    # queued behind it (not sent: "queue stayed full") only if that is longer than its timeout
    m = SharedModel("g", (1, 3), namespace=rt.namespace, poll_interval=10)

    async def main():
        blocker, fillers = await _hold_and_fill(m, gate)
        try:
            with pytest.raises(TimeoutError, match="queue stayed full"):
                await m.forward_async(_x(-1), timeout=0.3)
            assert not m._h.gone
        finally:
            gate.open()
        await blocker
        for k, y in enumerate(await asyncio.gather(*fillers)):
            np.testing.assert_array_equal(y, _x(k) * 2 + 1)

    asyncio.run(main())
    assert not m._h.busy
    m.close()


@needs_waitv
@pytest.mark.timeout(120)
def test_a_timeout_while_waiting_for_room_leaves_a_named_client_attached(gate):
    """Attached by name: the same mistaken RuntimeStopped became a _Resend, the call went to a
    thread to wait for a 'successor' runtime that never comes, and the handle stayed 'gone'."""
    from simpledbi.runtime import Runtime
    from .conftest import FAST
    name = f"h44-{random.randrange(1 << 30):x}"
    with Runtime([cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                            wait_time=0.0)], FAST, name=name):
        m = SharedModel("g", (1, 3), runtime=name, connect_timeout=5)

        async def main():
            blocker, fillers = await _hold_and_fill(m, gate)
            try:
                t = time.monotonic()
                with pytest.raises(TimeoutError):
                    await m.forward_async(_x(-1), timeout=0.3)
                assert time.monotonic() - t < 3
            finally:
                gate.open()
            await blocker
            await asyncio.gather(*fillers)
            t = time.monotonic()
            np.testing.assert_array_equal(await m.forward_async(_x(3), timeout=30), _x(3) * 2 + 1)
            assert time.monotonic() - t < 3   # not a connect_timeout's wait for a 'successor'

        asyncio.run(main())
        m.close()


def _closed_once_published(m):
    """SharedModel._publish, after which handle ``m`` is closed from another thread (what a GIL
    switch there lets another thread do)."""
    publish = SharedModel._publish

    def publish_then_closed_elsewhere(self, *args):
        seq = publish(self, *args)
        if self is m:
            closer = threading.Thread(target=self.close)
            closer.start()
            closer.join()
        return seq
    return publish_then_closed_elsewhere


@needs_waitv
@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_full", [False, True])
def test_close_from_another_thread_while_a_call_publishes_ends_it_at_once(start_runtime, gate, monkeypatch,
                                                                          queue_full):
    """close() from another thread between the call's borrow and its first look at the done word
    (while it publishes or sends: the loop thread runs it without an await, but another thread
    can take the GIL anywhere in it): the close's wake-up came before the call read the word,
    so the call slept a whole poll interval (30 s here) before it saw it was closed. The same
    race while the model's queue is full (``queue_full``): close()'s wake_all came before the
    call queued its datagram in the sender, which looks again only a poll interval later."""
    rt = start_runtime(cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 wait_time=0.0))
    m = SharedModel("g", (1, 3), namespace=rt.namespace, poll_interval=30)
    held = SharedModel("g", (1, 3), namespace=rt.namespace)

    async def main():
        if queue_full:
            blocker, fillers = await _hold_and_fill(held, gate)   # m's datagram must wait for room too
        else:
            blocker, fillers = asyncio.ensure_future(held.forward_async(_x(models.GATE))), []
            await asyncio.to_thread(gate.wait_entered)   # the model process is busy: nobody answers m
        monkeypatch.setattr(SharedModel, "_publish", _closed_once_published(m))
        t = time.monotonic()
        try:
            with pytest.raises(RuntimeStopped):
                await asyncio.wait_for(m.forward_async(_x(4)), 10)
            return time.monotonic() - t
        finally:
            gate.open()
            await blocker
            await asyncio.gather(*fillers)

    assert asyncio.run(main()) < 10
    assert not m._h.busy
    held.close()


_REMAP_CLIENT = r"""
import asyncio, sys, threading
import numpy as np
from simpledbi import SharedModel, RuntimeStopped, shm
m = SharedModel("e", (4, 64), namespace=sys.argv[1])
grow = shm.Segment.map_at_least
def grown_then_closed_elsewhere(self, size):
    grow(self, size)
    closer = threading.Thread(target=m.close)   # what a GIL switch here lets another thread do
    closer.start()
    closer.join(2)   # it ends here, unless the slot's move holds it off until done (then it ends later)
shm.Segment.map_at_least = grown_then_closed_elsewhere
x = np.ones((4, 64), np.float32)
try:
    y = asyncio.run(m.forward_async(x, timeout=30)) if sys.argv[2] == "async" else m.forward(x, timeout=30)
    assert y.shape == (4, 4096) and (y == 1).all()
except RuntimeStopped:
    pass
print("survived", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_close_from_another_thread_while_a_call_maps_its_grown_slot_does_not_crash(start_runtime, mode):
    """A model process grows a slot for outputs larger than it; the call reading them maps the
    slot anew and unmaps the old mapping, then points its done-word address at the new one. A
    close() from another thread in between (release: slot.wake) stored into the unmapped word:
    SIGSEGV of the client process."""
    import subprocess
    import sys
    rt = start_runtime(cpu_model("e", models.expand, max_batch_size=4, wait_time=0.0))
    p = subprocess.run([sys.executable, "-c", _REMAP_CLIENT, rt.namespace, mode], capture_output=True,
                       text=True, timeout=90)
    assert p.returncode == 0 and "survived" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
