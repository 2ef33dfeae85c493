"""Awaiting answers in an asyncio event loop: one watcher thread per 127 calls in flight.

A ``forward_async`` call publishes and sends its request from the event loop, then awaits
:func:`changed` on its slot's done word (NOTE [slot protocol] in slots.py). A watcher thread
sleeps in one ``futex_waitv`` on the done words of up to 127 such calls and a bell word of its
own, and when a word changes, resolves that call's future in its loop. The loop reads the answer.
A thread per call (the fallback, where the kernel has no futex_waitv) took the GIL from the loop:
tens of milliseconds of lag at 200 calls on 2 cores, seconds at 2000 (docs/BENCHMARKS.md, run 44).

No wake-up is lost: a call reads the word's value *before* it looks for its answer, and the
watcher sleeps only while every word still holds the value its call saw (futex_waitv compares
them all in the kernel). Words are added and removed by the loop, applied by the watcher before
it next sleeps: a new word rings the bell once per loop iteration (not once per call); a removed
one needs no wake-up, since the watcher reads no word it was told to drop (the slot's memory may
be unmapped once its call ends), and a sleep that started with it is harmless.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import weakref
from typing import List, Optional

from . import futex

_CAPACITY = futex.WAITV_MAX - 1   # words per watcher thread: the kernel's limit, less the bell
_supported: Optional[bool] = None


def available() -> bool:
    """Can calls wait in their event loop here (a kernel with futex_waitv)?"""
    global _supported
    if _supported is None:
        _supported = futex.waitv_supported()
    return _supported


class _Watch:
    __slots__ = ("address", "seen", "loop", "future", "live", "k")

    def __init__(self, address, seen, loop, future):
        self.address, self.seen, self.loop, self.future = address, seen, loop, future
        self.live = True   # watched, or about to be (False: fired, or dropped by its call)
        self.k = 0         # its index in the watcher's words (0: not there yet, or no longer)


class _Watcher:
    """A thread sleeping on up to 127 done words (and its bell), for calls of any event loops."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = 0              # words watched or about to be (under the lock)
        self._ops: List[_Watch] = []   # added (live) or dropped (not live) since the thread looked
        self._bell = ctypes.c_uint32(0)
        self._ring_due = weakref.WeakSet()   # the loops that ring the bell at their next iteration
        self._sleeping = False
        self._words = (futex.WaitV * futex.WAITV_MAX)()
        self._watches: List[Optional[_Watch]] = [None]   # index k watches self._words[k]; 0: the bell
        self._words[0].uaddr, self._words[0].flags = ctypes.addressof(self._bell), futex.WAITV_U32
        threading.Thread(target=self._run, name="simpledbi-watcher", daemon=True).start()

    def add(self, watch: _Watch) -> None:   # in the loop, under self.lock
        self.live += 1
        self._ops.append(watch)
        if watch.loop not in self._ring_due:   # (once per loop iteration, however many calls)
            self._ring_due.add(watch.loop)
            watch.loop.call_soon(self._ring, watch.loop)

    def drop(self, watch: _Watch) -> None:   # in the loop: the call stopped waiting
        with self.lock:
            if watch.live:
                watch.live = False
                self.live -= 1
                self._ops.append(watch)

    def _ring(self, loop) -> None:
        with self.lock:
            self._ring_due.discard(loop)
            if not self._sleeping:
                return   # it applies the new words before it sleeps again
            self._bell.value += 1
        futex.store_and_wake(ctypes.addressof(self._bell), self._bell.value)

    # ------------------------------------------------------------ in the thread, under self.lock
    def _apply(self) -> None:
        for watch in self._ops:
            if watch.live and not watch.k:
                watch.k = len(self._watches)
                self._watches.append(watch)
                word = self._words[watch.k]
                word.uaddr, word.val, word.flags = watch.address, watch.seen, futex.WAITV_U32
            elif not watch.live and watch.k:
                self._remove(watch)
        self._ops.clear()

    def _remove(self, watch: _Watch) -> None:
        """Out of the words: the last one takes its place."""
        k, last = watch.k, self._watches.pop()
        watch.k = 0
        if last is not watch:
            self._watches[k], last.k = last, k
            ctypes.memmove(ctypes.addressof(self._words[k]),
                           ctypes.addressof(self._words[len(self._watches)]), ctypes.sizeof(futex.WaitV))

    def _fire(self, watch: _Watch, fired: list) -> None:
        watch.live = False
        self.live -= 1
        self._remove(watch)
        fired.append((watch.loop, watch.future, True))

    def _run(self) -> None:
        woken = None   # the watch the last sleep woke for; None: look at every word
        while True:
            fired: list = []
            with self.lock:
                self._sleeping = False
                self._apply()
                if woken is None:   # a word changed before the sleep (or a signal ended it)
                    for watch in self._watches[:0:-1]:
                        if futex.load(watch.address) != watch.seen:
                            self._fire(watch, fired)
                elif woken.live and woken.k:
                    self._fire(woken, fired)
                self._words[0].val = self._bell.value
                self._sleeping = True
                n = len(self._watches)
            hand_over(fired)
            k = futex.wait_any(self._words, n)
            woken = None if k < 0 else self._watches[k] if k else _BELL


_BELL = _Watch(0, 0, None, None)   # the bell woke the thread: apply what was added, look at nothing
_BELL.live = False


def hand_over(done: list) -> None:
    """Set the futures of ``done``, (loop, future, result) triples, each in its loop: one wake-up
    per loop however many futures."""
    by_loop: dict = {}
    for loop, future, result in done:
        by_loop.setdefault(loop, []).append((future, result))
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, futures)
        except RuntimeError:   # that loop is closed: nobody awaits these
            pass


def _resolve(futures) -> None:
    for future, result in futures:
        if not future.done():
            future.set_result(result)


def settle(future: asyncio.Future, result=False) -> None:
    """Set ``future`` to ``result`` unless it is done (a timer's: time to look)."""
    if not future.done():
        future.set_result(result)


_watchers: List[_Watcher] = []
_watchers_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: it starts its own watchers."""
    global _watchers, _watchers_lock
    _watchers, _watchers_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


async def changed(address: int, seen: int, timeout: float) -> None:
    """Return once the 4-byte word at ``address`` no longer holds ``seen`` (or a wake-up says to
    look), or after ``timeout`` seconds; the caller looks at what changed. Called in the loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    with _watchers_lock:
        for watcher in _watchers:
            if watcher.live < _CAPACITY:
                break
        else:
            watcher = _Watcher()
            _watchers.append(watcher)
        watch = _Watch(address, seen, loop, future)
        with watcher.lock:
            watcher.add(watch)
    timer = loop.call_later(timeout, settle, future)
    try:
        await future
    finally:
        timer.cancel()
        watcher.drop(watch)
