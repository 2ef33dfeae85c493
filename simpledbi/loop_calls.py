"""SharedModel's asyncio face (a mixin of :class:`~simpledbi.client.SharedModel`): connect_async, and
forward_async's call in the event loop.

The request is published and sent from the loop (by the handle's sender thread while the model's
socket queue is full: sender.py) and its answer awaited there (watchers.py); the steps it shares
with the synchronous call (_publish, _next_wait, _still_wanted, _answer, _unwind) are
SharedModel's. forward_async decides when a call waits here and when in a thread of the pool.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from . import client, watchers   # (client imports this module: its names are read at call time)
from .errors import RuntimeStopped

if TYPE_CHECKING:
    from .client import ClientSlot, SharedModel, _Handles


class LoopCalls:
    @classmethod
    async def connect_async(cls, *args, **kw) -> "SharedModel":
        """``SharedModel(*args, **kw)``, awaited: the wait for a runtime not up yet (up to
        ``connect_timeout``) runs in a thread, and the event loop goes on (the constructor held it the
        whole time, helper-52). Cancelled, the handle it went on to make is closed."""
        cancel = client._Cancel()

        def make() -> "SharedModel":
            client._connecting.cancel = cancel   # (the constructor's wait for the runtime looks at it)
            try:
                return cls(*args, **kw)
            finally:
                client._connecting.cancel = None
        made = asyncio.get_running_loop().run_in_executor(client._async_executor(), make)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            cancel.cancel()   # its thread stops waiting (it held the process's exit connect_timeout long)
            made.add_done_callback(_close_unwanted)
            raise

    async def forward_async(self, *inputs, timeout: Optional[float] = None,
                            priority: Optional[int] = None, **kw_inputs):
        """``await``-able :meth:`forward`: the event loop never blocks, and concurrent coroutines
        of one process are batched together. The request is sent from the loop (by the handle's
        sender thread while the model's queue is full: sender.py) and its answer awaited there (a
        watcher thread per 127 calls in flight sees it arrive: watchers.py). Cancelling the
        coroutine withdraws the request if no model process has taken it yet, else abandons its
        result (its slot is lent again once the answer has arrived)."""
        timeout = self._h.default_timeout if timeout is None else client._check_timeout(timeout)
        t_call = time.monotonic()   # its timeout counts from now, whatever runs it
        # (a client that sends its slot's descriptor with each datagram waits in a thread: the
        # sender's datagrams carry none)
        if not (client._ASYNC_WATCHERS and watchers.available()) or self._h.send_fd:
            return await self._in_thread(self._forward, inputs, kw_inputs, timeout, priority, t_call=t_call)
        if self._closed:
            raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
        arrays, as_torch, names, positions = self._validate(inputs, kw_inputs)
        priority = self.priority if priority is None else client._check_priority(priority)
        h = self._h
        if self.runtime is not None and h.left():
            # re-attaching waits for the successor: in a thread
            return await self._in_thread(self._forward, inputs, kw_inputs, timeout, priority, t_call=t_call)
        try:
            return await self._in_loop(h, arrays, as_torch, names, positions, timeout, priority, t_call)
        except client._Resend:   # the runtime went away before anyone took it: to its successor, from a thread
            return await self._in_thread(self._forward, inputs, kw_inputs, timeout, priority, t_call=t_call)

    async def _in_thread(self, fn, *args, **kw):
        """``fn(*args, cancel=..., **kw)`` in a thread of the async pool (what must wait in a thread:
        re-attaching to a named runtime; and every call where the kernel has no futex_waitv).
        Its result is the call's; cancelling the task tells the thread to give up."""
        cancel = client._Cancel()

        def call():
            out = fn(*args, cancel=cancel, **kw)
            return out, self._last.get(None)   # set by this executor thread's own call
        # (shielded: a thread that has not started yet still runs, to give up what it holds)
        running = asyncio.get_running_loop().run_in_executor(client._async_executor(), call)
        try:
            out, timing = await asyncio.shield(running)
        except asyncio.CancelledError:
            cancel.cancel()   # the waiting thread takes the request back, if nobody took it yet
            # Its outcome is nobody's now: asyncio.shield stopped looking at it, and asyncio would log
            # an exception it ends with as "never retrieved" (once per cancelled call).
            running.add_done_callback(_outcome_read)
            raise
        self._last.set(timing)  # in this task's context: last_timing() in the task sees its own
        return out

    async def _in_loop(self, h: "_Handles", arrays, as_torch, names, positions, timeout, priority, t_call):
        """forward_async's call, sent and awaited in the event loop."""
        deadline = None if timeout is None else t_call + timeout
        slot = h.borrow(self)
        slot.call_timeout, slot.call_start, slot.priority, slot.cancel = timeout, t_call, priority, None
        try:
            seq = self._publish(h, slot, arrays, deadline, names, positions)
            try:
                try:
                    if h._sender is not None and h._sender.waiting:
                        raise BlockingIOError   # earlier calls wait for room: it goes after them
                    slot.send(slot._msg)
                except BlockingIOError:   # the model's queue is full
                    await self._send_when_room(h, slot, deadline)
                except OSError as e:   # the socket is gone: the runtime stopped
                    slot.unsent()
                    self._stopped(h, f"the runtime is gone ({e.strerror or e})")
                while True:   # as _await, with the sleep awaited
                    wait = self._next_wait(slot, seq, deadline)
                    if wait is None:
                        break
                    address, seen = slot.done_word()
                    if slot.arrived(seq):
                        break
                    if slot.interrupted:   # closed before the word was read: its wake-up is not ahead
                        self._given_up(slot)
                    await watchers.changed(address, seen, wait)
                    if slot.arrived(seq):
                        break
                    self._still_wanted(h, slot, seq)
                return self._answer(h, slot, as_torch)
            except BaseException:
                self._unwind(slot, seq)
                raise
        finally:
            h.give_back(slot)

    async def _send_when_room(self, h: "_Handles", slot: ClientSlot, deadline: Optional[float]) -> None:
        """forward_async's _send while the model's socket queue is full: the handle's sender thread
        sends the datagram once there is room (sender.py). It wakes the call when the queue stayed
        full for a poll interval, to check that the call is still wanted and the runtime alive."""
        try:
            sender = h.sender(self.poll_interval)
        except OSError as e:   # the socket is gone: the runtime stopped
            slot.unsent()
            self._stopped(h, f"the runtime is gone ({e.strerror or e})")
        loop = asyncio.get_running_loop()
        item = sender.queue(slot._msg, loop)
        try:
            if slot.interrupted:   # closed before it was queued: wake_all did not see it
                self._given_up(slot)
            while True:
                timer = None
                if deadline is not None:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        if not sender.give_up(item):
                            return   # sent (or the kernel holds it): the wait for its answer times out
                        slot.unsent(withdrawn=True)
                        self._on_timeout(slot, "the model's queue stayed full; the request was not sent")
                    timer = loop.call_later(wait, watchers.settle, item.future)   # (then a look)
                try:
                    await item.future
                finally:
                    if timer is not None:
                        timer.cancel()
                if item.error is not None:   # the socket is gone: the runtime stopped
                    slot.unsent()
                    self._stopped(h, f"the runtime is gone ({item.error.strerror or item.error})")
                if not sender.rearm(item):
                    slot.sent_seq = slot.seq
                    return
                if slot.interrupted:
                    self._given_up(slot)
                self._check_runtime(h, slot)
        except BaseException as e:   # (the call's TimeoutError too: an OSError, not "the socket is gone")
            if sender.give_up(item):   # never sent: the counts it was to report go with the next
                slot.unsent(withdrawn=isinstance(e, (asyncio.CancelledError, TimeoutError, RuntimeStopped)))
            raise


def _outcome_read(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _close_unwanted(future: asyncio.Future) -> None:
    """connect_async's handle, made after its caller was cancelled: nobody will close it."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()
