"""Sending forward_async requests while the model's socket queue is full: one thread per handle.

The socket's queue is short (net.unix.max_dgram_qlen, 10 by default). A forward_async call whose
datagram finds it full queues the datagram here and waits in its event loop; the handle's sender
thread waits for room in the kernel (poll) and sends the queued datagrams, in order, as model
processes take theirs. One thread however many calls wait, and the loop stays free.

Measured alternatives (experiments/async_lag.py, 2 cores): a thread per waiting call, blocked in
send, refilled the queue at once, but 2000 such threads held the GIL from the loop for seconds;
the loop polling the socket and sending itself refilled it only between its other work, so model
processes closed their batches half full.

A call that stops waiting (timeout, cancellation, close, the runtime gone) gives its datagram up;
the sender sends only under its lock, so once :meth:`Sender.give_up` returns True the datagram is
never sent and the call's slot may be lent again.
"""
from __future__ import annotations

import asyncio
import collections
import select
import threading
from typing import Optional

from . import watchers

_WAITING, _SENT, _GAVE_UP = range(3)


class Queued:
    """One datagram waiting for room. Its ``future`` is set in its loop when there is something to
    look at: it was sent (``sent``), the send failed (``error``), or the handle was closed."""

    __slots__ = ("slot", "loop", "future", "state", "error")

    def __init__(self, slot, loop: asyncio.AbstractEventLoop):
        self.slot, self.loop, self.future, self.state = slot, loop, loop.create_future(), _WAITING
        self.error: Optional[OSError] = None

    @property
    def sent(self) -> bool:
        return self.state == _SENT


class Sender:
    """The thread that sends a handle's queued datagrams on its socket ``sock``. It looks at its
    queue at least every ``look`` seconds (the handle's poll interval) without room, to end once
    the handle is closed."""

    def __init__(self, sock, look: float):
        self._sock, self._look_ms = sock, max(1, int(look * 1e3))
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._closed = False
        threading.Thread(target=self._run, name="simpledbi-sender", daemon=True).start()

    def queue(self, slot, loop: asyncio.AbstractEventLoop) -> Queued:
        """Send ``slot``'s current datagram when there is room (the slot stays the caller's)."""
        item = Queued(slot, loop)
        with self._more:
            self._queue.append(item)
            self._more.notify()
        return item

    @property
    def waiting(self) -> bool:
        """Are datagrams waiting for room? (A new call's goes after them: in order.)"""
        return bool(self._queue)

    def give_up(self, item: Queued) -> bool:
        """Never send ``item``: True, or False if it was sent already."""
        with self._lock:
            if item.state == _SENT:
                return False
            item.state = _GAVE_UP
            return True

    def wake_all(self) -> None:
        """Every waiting call looks at its state now (the handle was closed from another thread)."""
        with self._lock:
            waiting = [(item, False) for item in self._queue if item.state == _WAITING]
        watchers.hand_over(waiting)

    def close(self) -> None:
        """End the thread (within ``look``): the handle closes its socket."""
        with self._more:
            self._closed = True
            self._more.notify()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        while True:
            with self._more:
                while not self._queue and not self._closed:
                    self._more.wait()   # idle: nothing waits for room
                if self._closed:
                    return
            poller.poll(self._look_ms)   # until a model process takes a datagram
            done = []
            with self._lock:
                queue = self._queue
                while queue:
                    item = queue[0]
                    if item.state == _WAITING:
                        try:
                            item.slot.send(item.slot._msg)
                        except BlockingIOError:
                            break   # full again
                        except OSError as e:   # the socket is gone: the runtime stopped
                            item.error, item.state = e, _GAVE_UP
                            done.append((item, False))
                        else:
                            item.state = _SENT
                            done.append((item, True))
                    queue.popleft()
            watchers.hand_over(done)
