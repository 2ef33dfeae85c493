"""forward_async's call in the event loop: a mixin of :class:`~simpledbi.client.SharedModel`.

The request is published and sent from the loop (by the handle's sender thread while the model's
socket queue is full: sender.py) and its answer awaited there (watchers.py); the steps it shares
with the synchronous call (_publish, _next_wait, _still_wanted, _answer, _unwind) are
SharedModel's. forward_async (client.py) decides when a call waits here and when in a thread.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from . import watchers
from .errors import RuntimeStopped

if TYPE_CHECKING:
    from .client import ClientSlot, _Handles


class LoopCalls:
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
