"""Sending forward_async requests while the model's socket queue is full: one thread per handle.

The socket's queue is short (net.unix.max_dgram_qlen, 10 by default). A forward_async call whose
datagram finds it full queues the datagram here and waits in its event loop. The handle's sender
thread hands every queued datagram to the kernel in one ``sendmmsg`` on a socket of its own,
which sends each as soon as a model process has taken one: the queue is refilled at kernel
speed, with no Python (and no GIL) between two datagrams, however many calls wait. (A thread
per waiting call, the loop sending by itself, and a thread sending one datagram at a time were
measured and refilled it too slowly or took the GIL from the loop: docs/BENCHMARKS.md, run 44.)

A call that stops waiting (timeout, cancellation, close, the runtime gone) gives its datagram up.
One not handed to the kernel yet is never sent. One the kernel holds may still be sent after the
call has taken its request back (its ticket): that datagram is stale, and a model process takes
nothing for it (NOTE [slot protocol] in slots.py), even once the slot carries a later request.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import errno
import os
import socket
import struct
import threading
from typing import Callable, List, Optional

from . import watchers

_WAITING, _SENDING, _SENT, _GAVE_UP = range(4)
#: Datagrams handed to the kernel in one call at most: what the thread builds in Python before the
#: call (the kernel's own limit is 1024); the rest go in the next call, a moment later.
_BATCH = 256


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.c_void_p),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):   # struct mmsghdr: a message and the bytes of it sent
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


_sendmmsg = ctypes.CDLL(None, use_errno=True).sendmmsg   # (the GIL is released while it blocks)
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int


class Queued:
    """One datagram waiting for room. Its ``future`` is set in its loop when there is something to
    look at: it was sent (``sent``), the send failed (``error``), the handle was closed, or the
    queue stayed full for a poll interval (time to check that the runtime lives)."""

    __slots__ = ("msg", "loop", "future", "state", "error")

    def __init__(self, msg: bytes, loop: asyncio.AbstractEventLoop):
        self.msg, self.loop, self.future, self.state = msg, loop, loop.create_future(), _WAITING
        self.error: Optional[OSError] = None

    @property
    def sent(self) -> bool:
        return self.state == _SENT


class Sender:
    """The thread that sends a handle's queued datagrams through its own socket ``sock``
    (connected to the model's socket), each send waiting at most ``look`` seconds for room."""

    def __init__(self, sock: socket.socket, look: float, on_lost: Callable[[List[bytes]], None]):
        self._sock, self._on_lost = sock, on_lost
        sec = int(look)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", sec, int((look - sec) * 1e6)))
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._sending: List[Queued] = []   # handed to the kernel, in the call in progress
        self._closed = False
        threading.Thread(target=self._run, name="simpledbi-sender", daemon=True).start()

    @property
    def waiting(self) -> bool:
        """Are datagrams queued for room? (A new call's goes after them: in order. Those the kernel
        holds in the send in progress are not counted: a call that finds room goes in at once,
        as a thread waiting in the kernel would: funnelling forward() calls through one thread
        cost a 64-thread client 30-50% of its calls/s, docs/BENCHMARKS.md, run 49.)"""
        return bool(self._queue)

    def queue(self, msg: bytes, loop: asyncio.AbstractEventLoop) -> Queued:
        item = Queued(msg, loop)
        with self._more:
            self._queue.append(item)
            self._more.notify()
        return item

    def give_up(self, item: Queued) -> bool:
        """Never send ``item``: True; False if it was sent, or may still be (the kernel holds it)."""
        with self._lock:
            if item.state == _WAITING:
                item.state = _GAVE_UP
                return True
            if item.state == _SENDING:
                item.state = _GAVE_UP   # (if the kernel does not send it, it is not queued again)
            return False

    def wake_all(self) -> None:
        """Every waiting call looks at its state now (the handle was closed from another thread)."""
        with self._lock:
            waiting = [(item.loop, item.future, False) for item in (*self._queue, *self._sending)]
        watchers.hand_over(waiting)

    def rearm(self, item: Queued) -> bool:
        """After a look: False if ``item`` was sent meanwhile, else True with a new future to await
        (under the lock the thread sets futures under: no wake-up goes to the old one)."""
        with self._lock:
            if item.state == _SENT:
                return False
            if item.future.done():
                item.future = item.loop.create_future()
            return True

    def drop_inherited(self) -> None:
        """In a forked child, which has none of the parent's threads: close the socket it inherited."""
        self._sock.close()

    def close(self) -> None:
        """End the thread (within a poll interval) and close its socket."""
        with self._more:
            self._closed = True
            self._more.notify()

    def _run(self) -> None:
        fd, queue = self._sock.fileno(), self._queue
        try:
            while True:
                with self._more:
                    while not queue and not self._closed:
                        self._more.wait()   # idle: nothing waits for room
                    if self._closed:
                        return
                    batch = self._sending = []
                    while queue and len(batch) < _BATCH:
                        item = queue.popleft()
                        if item.state == _WAITING:
                            item.state = _SENDING
                            batch.append(item)
                n, err = self._send(fd, batch)
                done, lost = [], []
                with self._lock:
                    self._sending = []
                    for k, item in enumerate(batch):
                        if k < n:
                            item.state = _SENT
                            done.append((item.loop, item.future, True))
                        elif err is not None:   # the socket is gone: the runtime stopped
                            item.state, item.error = _GAVE_UP, err
                            done.append((item.loop, item.future, False))
                        elif item.state == _SENDING:
                            item.state = _WAITING
                        else:   # given up while the kernel held it, and not sent: its call withdrawn
                            lost.append(item.msg)   # (counted nowhere: helper-53)
                    if n < len(batch) and err is None:   # full for a poll interval: back in front, in
                        unsent = [item for item in batch[n:] if item.state == _WAITING]   # order, and
                        queue.extendleft(reversed(unsent))   # every waiting call checks the runtime
                        done += [(item.loop, item.future, False) for item in queue]
                watchers.hand_over(done)
                if lost:
                    self._on_lost(lost)
        finally:
            self._sock.close()

    @staticmethod
    def _send(fd: int, batch: List[Queued]):
        """(datagrams sent, the error that ended the send or None): sendmmsg of ``batch``."""
        n = len(batch)
        if not n:
            return 0, None
        iov, msgs = (_IOVec * n)(), (_MMsgHdr * n)()
        at, size = ctypes.addressof(iov), ctypes.sizeof(_IOVec)
        for k, item in enumerate(batch):   # (the items hold their bytes until the call returns)
            iov[k].base, iov[k].len = ctypes.cast(ctypes.c_char_p(item.msg), ctypes.c_void_p), len(item.msg)
            msgs[k].hdr.iov, msgs[k].hdr.iovlen = at + k * size, 1
        sent = _sendmmsg(fd, msgs, n, 0)
        if sent >= 0:
            return sent, None
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EINTR):
            return 0, None
        return 0, OSError(code, os.strerror(code))
