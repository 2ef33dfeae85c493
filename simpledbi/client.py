"""What runs in the caller: ``SharedModel``, a PyTorch-looking handle on a served model.

A call borrows a *slot* (NOTE [slot protocol] in slots.py) from its handle's pool, or makes one.
Slots belong to the handle, not to threads, so a web server's thread pool that retires and
creates threads never leaks them: a handle holds a slot per call in flight and up to _IDLE_KEPT
idle ones (plus those owed a late answer after a timeout, lent again once it has arrived).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import collections
import errno
import functools
import logging
import math
import numbers
import os
import re
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import naming, sender, stats as _stats
from .loop_calls import LoopCalls
from .config import MODEL_NAME_RE
from .errors import (ModelError, ModelProcessDied, Overloaded, RuntimeStopped, RuntimeUnavailable,
                     SlotsExhausted)
from .inputs import Inputs
from .layout import (BROKEN, MAX_PRIORITY, OUT_DICT, OUT_TENSOR, OUT_TUPLE, ST_BAD_REQUEST, ST_DIED,
                     ST_EXPIRED, ST_FULL, ST_INTERNAL, ST_MODEL_ERROR, ST_OK, ST_OVERLOADED, ST_STOPPED,
                     STARTING, STOPPING, ControlBlock, decode_names, socket_path)
from .overload import Refusal
from .shm import NAMESPACE_RE, SHM_DIR, pid_alive
from .slots import ClientSlot, _dumpable, unsent_datagram

logger = logging.getLogger(__name__)
_running_loop = asyncio._get_running_loop   # (C, ~50 ns: None outside a coroutine or callback)
_warned_in_loop: set = set()   # models whose forward() was called inside a running loop (warned once)
_told_gone: set = set()        # namespaces of named runtimes whose stop was logged (once each)

ENV_NAMESPACE = "SIMPLEDBI_NAMESPACE"
_live_clients: "weakref.WeakSet[SharedModel]" = weakref.WeakSet()


#: False: every forward_async call waits in a thread of the pool below, as where the kernel has no
#: futex_waitv (experiments/async_lag.py compares the two).
_ASYNC_WATCHERS = True
#: Idle slots a handle keeps beyond its calls in flight; more are closed as they come back. Each
#: holds memory for its largest request and answer (a burst of 800 forward_async calls kept 800).
#: A new slot costs 0.15-0.7 ms here and a mapping in each model process that takes a request from
#: it; keeping a burst's slots for 10 s instead changed nothing measurable but a load swinging
#: between 64 and 4 calls in flight every 0.5 s (H200: p99 6.6 vs 7.6 ms, same calls/s;
#: experiments/slot_churn.py). Idle slots never cost another client its place: Intake._make_room.
_IDLE_KEPT = 16
#: SO_SNDBUF of a process's socket to a model (shared by its handles of that model: _shared_socket):
#: 1 asks for the kernel's minimum (4608 bytes), room for about 6 request datagrams. The kernel
#: charges a datagram to its sender's socket until a model process takes it off the model's queue,
#: and a send past the buffer waits on that socket (or fails at once, MSG_DONTWAIT). So a client
#: process holds at most ~6 of the ~11 places in the model's queue however many threads and
#: handles call it, and the rest of its calls wait on its own socket. With the default (212 KB)
#: they all waited in the line for the model's queue, where the kernel hands out places thread
#: by thread: a one-thread client beside a 64-thread one got 40-44 calls/s, now 76-80 (93 alone;
#: CPU echo, 2 model processes, docs/BENCHMARKS.md run 49). Its cost: -4% for one process that
#: alone keeps a model busy from 64 threads (same run); buffers for 9 or 11 datagrams cost nothing
#: there but left the one-thread clients 62-67.
_SEND_BUFFER = 1
#: Threads the async waiters may use at most (each waits for one call in flight; threads are
#: made only when every earlier one is busy, so a process has as many as its peak concurrency).
_ASYNC_MAX_THREADS = 4096
_async_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_async_pool_lock = threading.Lock()


_connecting = threading.local()   # .cancel: the _Cancel of connect_async's constructor in this thread


def _async_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's executor for ``forward_async``: it grows with the calls in flight, so any
    number of concurrent coroutines can be batched together without sizing anything."""
    global _async_pool
    with _async_pool_lock:
        if _async_pool is None:
            _async_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=_ASYNC_MAX_THREADS, thread_name_prefix="simpledbi-async")
        return _async_pool


def _after_fork_in_child() -> None:
    """A forked child runs only the thread that forked: a lock another thread held at that moment
    would stay held forever, and the slots in the pools are the parent's. So every handle gets a
    fresh pool and locks (its slots are made anew on the child's first call)."""
    global _async_pool, _async_pool_lock, _sockets_lock
    _async_pool, _async_pool_lock = None, threading.Lock()   # (the parent's threads are not here)
    _sockets_lock = threading.RLock()
    inherited = [entry[0] for entry in _sockets.values()]   # the parent's: each handle gets this
    _sockets.clear()                                         # process's own (_new_pool)
    for client in list(_live_clients):
        client._attach_lock = threading.Lock()
        client._h._new_pool()
    in_use = {id(client._h.sock) for client in list(_live_clients)}
    for sock in inherited:
        if id(sock) not in in_use:   # (kept where connecting failed: the runtime is gone)
            sock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


def close_all_clients() -> None:
    """Detach every SharedModel of this process (the worker wrapper calls it on exit)."""
    for client in list(_live_clients):
        client.close()


_BUILDERS: Dict[Tuple[int, bytes], object] = {}   # (structure, names text) -> outputs -> result


def _restructure(outs: list, structure: int, names: bytes):
    """The model's output structure around ``outs``: a tensor, tuple, dict or namedtuple."""
    if structure == OUT_TENSOR:
        return outs[0]
    if structure == OUT_TUPLE:
        return tuple(outs)
    build = _BUILDERS.get((structure, names))
    if build is None:  # parsed once per distinct structure: the steady state costs a lookup
        type_name, keys = decode_names(names)
        if structure == OUT_DICT:
            build = lambda outs, keys=keys: dict(zip(keys, outs))  # noqa: E731
        else:
            build = _output_namedtuple(type_name, tuple(keys))._make
        if len(_BUILDERS) > 256:
            _BUILDERS.clear()
        _BUILDERS[(structure, names)] = build
    return build(outs)


@functools.lru_cache(maxsize=256)
def _output_namedtuple(type_name: str, keys: tuple) -> type:
    """A namedtuple class like the model's (made here: the model's own may not import in the caller),
    whose instances pickle: made anew wherever they are unpickled (helper-48: a DataLoader worker
    returning one hung, the class unknown to pickle)."""
    cls = collections.namedtuple(type_name, keys, rename=True)
    cls.__reduce__ = lambda self: (_rebuild_namedtuple, (type_name, tuple(self._fields), tuple(self)))
    return cls


def _rebuild_namedtuple(type_name: str, keys: tuple, values: tuple):
    return _output_namedtuple(type_name, keys)._make(values)


class SharedModel(Inputs, LoopCalls):
    """A handle on the model ``name`` served by the runtime this process belongs to.

    ``max_shape`` is the largest request this client will send, rows first; requests may be
    smaller in every dimension. Give a list of shapes for a model with several inputs, and
    ``dtype`` (one, or one per input) when inputs are not float32. Both default to what the
    model declares (``ModelConfig.input_shapes`` with ``max_batch_size`` rows, ``input_dtypes``).
    Input ``k`` of the client is the model's ``k``-th input name (:attr:`input_names`), so
    inputs may also be passed by name. Safe to share between threads and to keep across
    ``fork`` (a child gets slots of its own).

    Which runtime: ``namespace=`` (``Runtime.namespace``), else ``runtime=`` (a runtime started
    with a name, e.g. ``simpledbi serve --name myapp``), else the one that started this process
    (``Run``), else ``$SIMPLEDBI_RUNTIME``. A client attached by name waits up to
    ``connect_timeout`` seconds for that runtime to come up (its model processes loaded), and when
    it restarts, re-attaches on the next call.
    """

    def __init__(self, name: str, max_shape=None, dtype=None, *, runtime: Optional[str] = None,
                 namespace: Optional[str] = None, poll_interval: float = 0.5,
                 connect_timeout: float = 30.0, priority: int = 0):
        if not isinstance(name, str):
            raise TypeError(f"name: expected str, got {type(name).__name__}")
        if not MODEL_NAME_RE.match(name):   # no runtime can serve it (ModelConfig's rule)
            raise LookupError(f"no model can be named {name[:60]!r}{'...' if len(name) > 60 else ''}"
                              f": model names are 1-48 letters, digits, '_' or '-'")
        self.name = name
        if not (isinstance(poll_interval, (int, float)) and 0.001 <= poll_interval <= 60):
            raise ValueError(f"poll_interval: expected 0.001..60 seconds, got {poll_interval!r}")
        self.poll_interval = float(poll_interval)
        if not (isinstance(connect_timeout, (int, float)) and connect_timeout >= 0):
            raise ValueError(f"connect_timeout: expected seconds >= 0, got {connect_timeout!r}")
        self.connect_timeout = float(connect_timeout)
        #: The priority of calls that give none (higher runs first; NOTE [overload]).
        self.priority = _check_priority(priority)
        if namespace is not None and runtime is not None:   # (runtime= won, and namespace= went unseen)
            raise TypeError(f"pass runtime= (a runtime's name) or namespace= (Runtime.namespace), not "
                            f"both; got runtime={runtime!r}, namespace={namespace!r}")
        if namespace is None and runtime is None:
            namespace = os.environ.get(ENV_NAMESPACE) or None
            runtime = None if namespace else os.environ.get(naming.ENV_RUNTIME) or None
        if namespace is None and runtime is None:
            raise LookupError("no simpledbi runtime here: this process was not started by "
                              "simpledbi.Run; pass runtime='<name>' (a runtime started with a "
                              "name), namespace=rt.namespace (a Runtime started in this process) "
                              "or set $" + naming.ENV_RUNTIME + _running_now(
                                  " (none is running: start one with `simpledbi serve --name <name>`)"))
        self._args = (max_shape, dtype)
        #: The runtime's name when attached by name (re-attached after a restart), else None.
        self.runtime = None if runtime is None else naming.check_name(runtime)
        self._h = _Handles.open(namespace, name) if runtime is None else self._connect(
            cancel=getattr(_connecting, "cancel", None))
        self.namespace = self._h.namespace
        self._attach_lock = threading.Lock()
        # The last request of the calling thread -- or asyncio task: every thread and every task
        # sees its own value of a context variable.
        self._last: contextvars.ContextVar = contextvars.ContextVar(f"simpledbi_last_{id(self)}")
        self._latest = None   # the timing of the last request this handle completed, any thread
        self._closed = False
        # Detach on close(), at worker exit, or when the handle is garbage-collected: an attached
        # but unused slot would make model processes wait for a request that never comes.
        self._finalizer = weakref.finalize(self, self._h.release)
        _live_clients.add(self)
        try:
            self._set_inputs(self._h)
            self._h.give_back(self._h.borrow(self))  # attach one slot now: setup errors surface here
        except BaseException:
            self.close()
            raise

    def __reduce__(self):
        """Sent to another process (a multiprocessing Pool task, a DataLoader worker's dataset, any
        pickle or deepcopy), a handle arrives as a new one on the same model and runtime, with
        slots of its own: slots and calls in flight are this process's. A closed one arrives closed."""
        if self._closed:
            return _Unattached, (self.name, None, RuntimeStopped(f"SharedModel({self.name!r}) is closed"))
        max_shape, dtype = self._args
        where = {"runtime": self.runtime} if self.runtime is not None else {"namespace": self.namespace}
        return _attach, (self.name, max_shape, dtype, dict(
            where, poll_interval=self.poll_interval, connect_timeout=self.connect_timeout,
            priority=self.priority))

    @property
    def ctl(self) -> ControlBlock:
        return self._h.ctl

    def _connect(self, avoid: Optional[str] = None, call_deadline: Optional[float] = None,
                 cancel: Optional["_Cancel"] = None, timeout: Optional[float] = None) -> "_Handles":
        return _Handles.find(self, avoid, call_deadline, cancel, timeout)

    def _reattach(self, old: "_Handles", deadline: Optional[float],
                  cancel: Optional["_Cancel"] = None, timeout: Optional[float] = None) -> "_Handles":
        """The runtime ``old`` belongs to is stopping or gone: attach to its successor. Each call
        waits for it on its own clock (its timeout, the connect timeout), not behind another's
        wait: the lock is taken only to install what was found."""
        if self._h is not old:  # another thread did it
            return self._h
        new = self._connect(old.namespace, deadline, cancel, timeout)
        with self._attach_lock:
            if self._h is not old:  # another thread did it meanwhile: its handles serve
                new.release()
                return self._h
            try:
                self._set_inputs(new)   # what the successor's model declares
            except BaseException:
                new.release()
                raise
            self._finalizer.detach()
            self._h = new
            self.namespace = new.namespace
            self._finalizer = weakref.finalize(self, new.release)
            if self._closed:   # close() meanwhile, which may have run the old finalizer: this one too
                self._finalizer()
        old.release()
        logger.info("SharedModel(%r) re-attached to runtime %r (%s)", self.name, self.runtime,
                    new.namespace)
        return new

    # ------------------------------------------------------------ public API
    def forward(self, *inputs, timeout: Optional[float] = None, priority: Optional[int] = None, **named):
        """Run the model on ``inputs`` (numpy arrays or CPU torch tensors), batched with others:
        positional, by keyword (``input_ids=x``: the model's declared input names), or as one
        dict of them. Requests with other keywords are never batched together.

        Returns numpy arrays for numpy inputs and torch tensors for torch inputs, in the
        structure the model returns: a tensor, a tuple, a dict (same keys, in order) or a
        namedtuple (same type name and fields). Raises ``TimeoutError`` when ``timeout``
        seconds (default: the model's ``default_timeout``, else none) pass first.

        Past the model's capacity (NOTE [overload]): a call that could not be answered within
        its timeout, or that finds ``max_queue`` requests waiting, raises ``Overloaded`` at once
        and never runs. ``priority`` (default: the handle's): higher runs first and is refused
        last.
        """
        if _running_loop() is not None and self.name not in _warned_in_loop:
            _warned_in_loop.add(self.name)   # (once per model name: a warning per call would flood)
            logger.warning("SharedModel(%r).forward() was called inside a running asyncio event loop: "
                           "it blocks the loop until the answer comes; use `await forward_async(...)`",
                           self.name)
        return self._forward(inputs, named, timeout, priority)

    __call__ = forward

    def _forward(self, inputs, named, timeout, priority, cancel: Optional["_Cancel"] = None,
                 t_call: Optional[float] = None):
        """``t_call``: when the call began (forward_async's: its timeout counts from then, and its
        messages name that timeout, not what is left of it)."""
        if self._closed:
            raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
        arrays, as_torch, names, positions = self._validate(inputs, named)
        timeout = self._h.default_timeout if timeout is None else _check_timeout(timeout)
        priority = self.priority if priority is None else _check_priority(priority)
        t_call = time.monotonic() if t_call is None else t_call
        deadline = None if timeout is None else t_call + timeout
        while True:
            h = self._h
            if self.runtime is not None and h.left():
                h = self._reattach(h, deadline, cancel, timeout)
            slot = h.borrow(self)
            slot.call_timeout, slot.call_start, slot.priority, slot.cancel = timeout, t_call, priority, cancel
            if cancel is not None:
                cancel.slot = slot
            try:
                seq = self._publish(h, slot, arrays, deadline, names, positions)
                try:
                    self._send(h, slot, deadline)
                    self._await(h, slot, seq, deadline)
                    return self._answer(h, slot, as_torch)
                except BaseException:
                    self._unwind(slot, seq)
                    raise
            except _Resend:
                continue   # the runtime went away before anyone took the request: its successor
            finally:
                h.give_back(slot)

    def last_timing(self) -> dict:
        """Where the calling thread's (or asyncio task's) last request spent its time (seconds,
        ``time.monotonic`` clock): ``published``, ``batch_closed`` (its batch started), ``done``
        (its result was written), ``woken`` (the caller resumed), and ``batch_rows``. A thread or
        task that made no request of its own (the code that awaited ``asyncio.gather`` of several
        calls, say) gets the last request this handle completed."""
        last = self._last.get(None) or self._latest
        if last is None:
            raise RuntimeError(f"SharedModel({self.name!r}): no request has completed through this "
                               f"handle yet")
        return dict(zip(_TIMING_KEYS, last))

    def stats(self) -> dict:
        """Counters of the whole model (all its processes): requests, batches, mean_batch_size, ..."""
        if self._closed:
            raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
        return _stats.summarize(self._h.ctl)

    def close(self) -> None:
        """Detach every slot of this handle. Idempotent. Calls in flight on other threads end
        with ``RuntimeStopped``."""
        if self._closed:
            return
        self._closed = True
        _live_clients.discard(self)
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"SharedModel({self.name!r}, max_shape={self.max_shapes}, namespace={self.namespace!r})"

    # ------------------------------------------------------------ one call
    def _publish(self, h: "_Handles", slot: ClientSlot, arrays: List[np.ndarray], deadline: Optional[float],
                 names: int, positions: Optional[Tuple[int, ...]]) -> int:
        """Refuse the call here (Overloaded), or write its request into ``slot``; its seq."""
        if h.ctl.state >= STOPPING:
            self._raise_runtime_state(h)
        if deadline is not None and slot.priority <= 0 or h.max_queue is not None:
            h.refuse(slot, deadline)
        if any(h.refused):   # this datagram reports the calls refused or withdrawn here, unsent
            with h.lock:
                slot.refused = [a + b for a, b in zip(slot.refused, h.refused)]
                h.refused = [0, 0, 0]
        return slot.publish(arrays, names, positions, deadline or 0.0, slot.priority, send=False)

    @staticmethod
    def _unwind(slot: ClientSlot, seq: int) -> None:
        """Whatever ended the call (a timeout, a typed error, KeyboardInterrupt, cancellation, ...):
        a request nobody took is taken back; one still owed an answer keeps its slot stale, so the
        late answer can never reach a later call."""
        if not slot.stale_seq and not slot.answered(seq) and not slot.withdraw():
            slot.abandon(seq)

    def _send(self, h: "_Handles", slot: ClientSlot, deadline: Optional[float]) -> None:
        """Send the request's datagram; while the model's socket queue is full, wait for room in the
        kernel (woken alone when a model process takes a datagram) a poll interval at a time, checking
        that someone is still there to take it and that the call is still wanted (not closed, cancelled)."""
        block = False   # the first try returns at once
        while True:
            if slot.interrupted or slot.cancel is not None and slot.cancel.cancelled:
                slot.unsent(withdrawn=True)   # closed or cancelled meanwhile: never sent, taken back
                self._given_up(slot)
            try:
                slot.send(slot._msg, block)
                return
            except BlockingIOError:
                pass
            except OSError as e:   # the socket is gone: the runtime stopped
                slot.unsent()
                self._stopped(h, f"the runtime is gone ({e.strerror or e})")
            if block:
                self._check_runtime(h, slot)
            wait = self.poll_interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    slot.unsent(withdrawn=True)
                    self._on_timeout(slot, "the model's queue stayed full; the request was not sent")
            h.set_send_timeout(wait)
            block = True

    def _await(self, h: "_Handles", slot: ClientSlot, seq: int, deadline: Optional[float]) -> None:
        """Sleep until the answer to ``seq`` has arrived (forward_async awaits it the same way)."""
        while True:
            wait = self._next_wait(slot, seq, deadline)
            if wait is None or slot.wait(seq, wait):
                return
            self._still_wanted(h, slot, seq)

    def _next_wait(self, slot: ClientSlot, seq: int, deadline: Optional[float]) -> Optional[float]:
        """How long to sleep for the answer before looking again: a poll interval, at most what is
        left of the timeout; None if the answer came just in time; past the deadline, TimeoutError."""
        wait = self.poll_interval
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                if slot.answered(seq):
                    return None   # it came in time; this thread only ran late
                self._on_timeout(slot)
        return wait

    def _still_wanted(self, h: "_Handles", slot: ClientSlot, seq: int) -> None:
        """Woken without the answer: raises if the call was given up or nobody will answer it."""
        if slot.interrupted or slot.cancel is not None and slot.cancel.cancelled:
            self._given_up(slot)
        self._check_alive(h, slot, seq)

    def _answer(self, h: "_Handles", slot: ClientSlot, as_torch: bool):
        """The call's result, from the response in ``slot`` (or the exception its status says)."""
        status, text, structure = slot.response()
        if status != ST_OK:
            if status == ST_STOPPED:   # the runtime stopped before computing it: it never ran
                if h.ctl.state == BROKEN:   # (a model process stops when its model is marked
                    self._raise_runtime_state(h)   # broken: the runtime itself is still there)
                self._stopped(h, text or "runtime stopped")
            error = _status_error(self.name, status, text, slot.call_timeout, slot.call_start, h.max_queue)
            if status == ST_MODEL_ERROR and self._declared_items:
                error.args = (error.args[0] + self._shape_note(slot.request_key),)
            raise error
        outs = slot.outputs()
        out_names = slot.output_names() if structure >= OUT_DICT else b""
        self._latest = timing = slot.timing_tuple()
        self._last.set(timing)
        if as_torch:
            torch = sys.modules["torch"]
            outs = [torch.from_numpy(o) for o in outs]
        return _restructure(outs, structure, out_names)

    def _given_up(self, slot: ClientSlot):
        """The call's handle was closed from another thread, or its forward_async task cancelled."""
        if slot.cancel is not None and slot.cancel.cancelled:
            raise RuntimeStopped(f"model {self.name!r}: the awaiting task was cancelled")
        raise RuntimeStopped(f"SharedModel({self.name!r}) was closed while this call waited")

    def _on_timeout(self, slot: ClientSlot, unsent: str = "the request was withdrawn before any model "
                                                          "process took it"):
        within = _within(slot.call_timeout)
        if slot.withdraw():
            raise TimeoutError(f"model {self.name!r}: no result within the timeout ({within}{unsent})")
        raise TimeoutError(f"model {self.name!r}: no result within the timeout"
                           f"{_within(slot.call_timeout, '')}; "
                           f"a model process took the request: if it is being computed, its late result "
                           f"will be discarded, else it will not run")

    def _stopped(self, h: "_Handles", why: str, resend: bool = True):
        """``h``'s runtime is stopping or gone: attached by name, a request nobody took
        (``resend``) goes to the successor (_Resend); else RuntimeStopped saying ``why``."""
        h.gone = True
        if resend and self.runtime is not None:
            raise _Resend()
        raise RuntimeStopped(f"model {self.name!r}: {why}") from None

    def _check_runtime(self, h: "_Handles", slot: ClientSlot) -> None:
        """Is the runtime still there to take a request? (Raises if not: _Resend when attached
        by name and the request was taken back, so the call goes to the successor.)"""
        state = h.ctl.state
        supervisor = int(h.ctl.hdr["supervisor_pid"])
        if supervisor and not pid_alive(supervisor):
            self._stopped(h, f"the runtime (pid {supervisor}) is gone", slot.withdraw())
        if (state == BROKEN or state == STOPPING) and slot.withdraw():
            self._raise_runtime_state(h)

    def _check_alive(self, h: "_Handles", slot: ClientSlot, seq: int) -> None:
        """After a poll interval without an answer: is anyone still going to answer?"""
        claim = slot.claimed_by(seq)
        if claim is not None:
            instance, pid = claim
            queued = slot.queued()
            if not pid_alive(pid):
                if queued:   # handed back (Intake.hand_back) by a process that died since: its
                    try:     # datagram may be gone with it -- offered again, to the live ones
                        slot.resend()
                    except OSError:
                        pass   # full queue: the next look sends it; the runtime gone: below
                else:
                    raise ModelProcessDied(f"model {self.name!r}: model process {instance} (pid "
                                           f"{pid}) died while computing this request")
            elif not queued:
                return
        self._check_runtime(h, slot)

    def _raise_runtime_state(self, h: "_Handles"):
        ctl = h.ctl
        if ctl.state == BROKEN:
            raise ModelProcessDied(ctl.message() or f"model {self.name!r}: the runtime is broken",
                                   int(ctl.hdr["broken_code"]) or None)
        self._stopped(h, "the runtime has stopped or is stopping")


def _attach(name: str, max_shape, dtype, kw: dict):
    """A pickled SharedModel, in the process that loads it (SharedModel.__reduce__)."""
    try:
        return SharedModel(name, max_shape, dtype, **kw)
    except Exception as e:  # noqa: BLE001 - raised on use instead (_Unattached)
        return _Unattached(name, (name, max_shape, dtype, kw), e)


class _Unattached:
    """A pickled SharedModel that could not attach where it arrived (its runtime gone, or out of
    reach): each use raises why. Raised while unpickling, the error killed a multiprocessing Pool's
    worker and lost its task, and the caller waited forever."""

    def __init__(self, name: str, args: tuple, error: Exception):
        self.name, self._args, self._error = name, args, error

    def __getattr__(self, attr):
        if attr.startswith("__"):   # (what copy, pickle and libraries probe for: absent)
            raise AttributeError(attr)
        raise self._error.with_traceback(None)

    def __reduce__(self):   # sent on: it tries again there (a closed handle's copy stays closed)
        if self._args is None:
            return _Unattached, (self.name, None, self._error)
        return _attach, self._args

    def __call__(self, *args, **kw):   # (dunders are looked up on the type: `m(x)` and `with m:`
        raise self._error.with_traceback(None)   # said "not callable", helper-48)

    def __enter__(self):
        raise self._error.with_traceback(None)

    def __exit__(self, *exc):
        return False

    def close(self) -> None:
        pass


#: This process's sockets to models' request sockets, shared by its handles: (pid, path) ->
#: [socket, handles using it]. (An RLock: a handle's finalizer may run in a garbage collection
#: that starts while this thread holds it.)
_sockets: Dict[Tuple[int, str], list] = {}
_sockets_lock = threading.RLock()


def _shared_socket(path: str) -> socket.socket:
    """This process's socket to the model's request socket at ``path``, one more handle using it."""
    key = (os.getpid(), path)
    with _sockets_lock:
        entry = _sockets.get(key)
        if entry is None:
            entry = _sockets[key] = [_connect(path), 0]
        entry[1] += 1
        return entry[0]


def _unshare_socket(path: str, sock: socket.socket) -> None:
    """A handle no longer uses ``sock``: closed with the last (or at once: not this process's share)."""
    with _sockets_lock:
        key = (os.getpid(), path)
        entry = _sockets.get(key)
        if entry is not None and entry[0] is sock:
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _sockets[key]
    sock.close()


def _connect(path: str) -> socket.socket:
    """A datagram socket connected to the model's request socket at ``path`` (_SEND_BUFFER)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def _overloaded(name: str, why: Refusal, timeout: Optional[float], t_call: float,
                max_queue: Optional[int] = None, waiting: Optional[int] = None) -> Overloaded:
    """The ``Overloaded`` a refused call raises (refused by a model process, or by its client on
    what the model's processes published, ``waiting`` requests: NOTE [overload])."""
    wait = why.expected_wait + time.monotonic() - t_call
    if why.reason == "deadline":
        expected = (f"about {wait * 1e3:.1f} ms" if wait != float("inf") else
                    "longer than any timeout (higher priorities take all of its capacity)")
        message = (f"model {name!r} is overloaded: this call would have taken {expected}, past its "
                   f"timeout" + (f" of {timeout * 1e3:.1f} ms" if timeout is not None else "")
                   + "; the request was refused without running (retry later, or allow a longer "
                   "timeout)")
    else:
        limit = "" if max_queue is None else f" is {max_queue}"
        message = (f"model {name!r} is overloaded: "
                   + (f"{waiting} requests are waiting, ModelConfig.max_queue is {max_queue}"
                      if waiting is not None else f"its queue is full (ModelConfig.max_queue{limit})")
                   + "; this request was refused without running (retry later)")
    return Overloaded(message, why.reason, wait, timeout)


def _running_now(none: str = "") -> str:
    """The runtimes running now, for an error message (``none`` when none is)."""
    running = [r.name for r in naming.list_registrations() if pid_alive(r.pid)]
    return f" (running now: {', '.join(running)})" if running else none


def _status_error(name: str, status: int, text: str, timeout: Optional[float] = None,
                  t_call: float = 0.0, max_queue: Optional[int] = None) -> Exception:
    """The exception a call raises for the response ``status`` (not ST_OK) and its ``text``."""
    if status == ST_OVERLOADED:
        return _overloaded(name, Refusal.parse(text), timeout, t_call, max_queue)
    if status in (ST_MODEL_ERROR, ST_INTERNAL):
        type_name, _, rest = text.partition("\n")
        message, _, tb = rest.partition("\n")
        where = "raised" if status == ST_MODEL_ERROR else "failed internally with"
        return ModelError(f"model {name!r} {where} {type_name}: {message}",
                          remote_type=type_name, remote_traceback=tb)
    if status == ST_BAD_REQUEST:
        return ValueError(f"model {name!r} rejected the request: {text}")
    if status == ST_DIED:   # the supervisor's text says how it died (supervisor.exit_how)
        code = re.search(r"exit code (-?\d+)", text)
        prefix = "" if text.startswith(f"model {name!r}") else f"model {name!r}: "   # (the supervisor's says it)
        return ModelProcessDied(prefix + text, int(code.group(1)) if code else None)
    if status == ST_FULL:
        return SlotsExhausted(f"model {name!r}: {text}")
    if status == ST_EXPIRED:
        return TimeoutError(f"model {name!r}: no result within the timeout ({_within(timeout)}{text})")
    return ModelProcessDied(f"model {name!r}: unknown response status {status}: {text}")


def _within(timeout: Optional[float], sep: str = ": ") -> str:
    """A timeout message's "0.2 s: " (in parentheses but for ``sep=""``): the call's timeout."""
    if timeout is None:
        return ""
    return f"{timeout:.3g} s{sep}" if sep else f" ({timeout:.3g} s)"


def _check_priority(priority) -> int:
    if not isinstance(priority, numbers.Integral) or isinstance(priority, (bool, np.bool_)):
        raise TypeError(f"priority: expected an int, got {type(priority).__name__} {priority!r}")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority: expected -{MAX_PRIORITY}..{MAX_PRIORITY}, got {priority}")
    return int(priority)


def _check_timeout(timeout) -> float:
    """Seconds >= 0 (any real number: a numpy scalar too), as a float."""
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, (bool, np.bool_)):
        try:
            seconds = float(timeout)
        except OverflowError:
            seconds = math.inf
        if seconds >= 0:   # (NaN fails this)
            return seconds
    raise ValueError(f"timeout: expected None or seconds >= 0, got {timeout!r}")


class _Cancel:
    """Cancelling a forward_async task: the thread waiting for its answer is woken and takes
    the request back if no model process took it yet (it then never reaches the model)."""

    def __init__(self):
        self.cancelled = False
        self.slot: Optional[ClientSlot] = None   # where the call waits (its slot.cancel is this)

    def cancel(self) -> None:
        self.cancelled = True
        slot = self.slot
        if slot is not None:
            slot.wake()   # (lent to another call since, it only wakes that one for a look)


class _Resend(Exception):
    """Internal: the runtime went away before any model process took the request (it was taken
    back): a client attached by name sends it to the successor."""


_TIMING_KEYS = ("published", "batch_closed", "done", "woken", "batch_rows")


class _Handles:
    """What a SharedModel holds: the model's control block (read-only), this process's socket to its
    request socket (shared by the process's handles of it: _shared_socket), and the slot pool --
    apart from the SharedModel, so its finalizer can reach them."""

    def __init__(self, namespace: str, name: str, ctl: ControlBlock, sock: socket.socket):
        self.namespace, self.name = namespace, name
        self.path = socket_path(namespace, name)
        self.ctl, self.sock = ctl, sock
        self._new_pool()
        self.closed, self.gone = False, False   # gone: its runtime's main process was seen dead
        self.send_fd = not _dumpable()
        self.default_timeout = ctl.default_timeout   # ModelConfig.default_timeout, or None
        self.max_queue = ctl.max_queue               # ModelConfig.max_queue, or None

    @classmethod
    def open(cls, namespace: str, name: str) -> "_Handles":
        if not isinstance(namespace, str) or not NAMESPACE_RE.match(namespace):   # ("../../etc", "")
            raise LookupError(f"no simpledbi runtime {namespace!r} is running here (a namespace is "
                              f"Runtime.namespace: sdbi_<pid>_<hex>)")
        try:
            ctl = ControlBlock.attach(namespace, name, readonly=True)
        except OSError as e:
            if e.errno == errno.EINVAL:   # something else is at its path
                raise RuntimeError(f"model {name!r}: {e.strerror} (something replaced the link to its "
                                   f"control block in runtime {namespace})") from None
            if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES):
                raise
            try:
                with os.scandir(os.path.join(SHM_DIR, namespace)) as entries:
                    available = sorted(e.name[:-4] for e in entries if e.name.endswith(".ctl"))
            except OSError:
                raise LookupError(f"no simpledbi runtime {namespace!r} is running here") from None
            raise LookupError(f"no model named {name!r} in runtime {namespace}; available: "
                              f"{available}") from None
        path = socket_path(namespace, name)
        try:
            try:
                ino = os.stat(path).st_ino
            except FileNotFoundError:
                raise RuntimeError(f"model {name!r}: its request socket {path} is missing (removed "
                                   f"by someone, or the runtime is going away)") from None
            if ctl.hdr["sock_ino"] and ino != ctl.hdr["sock_ino"]:   # (0: the runtime has not bound it yet)
                raise RuntimeError(f"model {name!r}: {path} is not the runtime's request socket "
                                   f"(something was bound at its path since)")
            try:
                sock = _shared_socket(path)
            except OSError as e:
                raise RuntimeError(f"model {name!r}: cannot send to its request socket {path}: "
                                   f"{e.strerror}") from None
        except BaseException:
            ctl.close()
            raise
        return cls(namespace, name, ctl, sock)

    @classmethod
    def find(cls, model: SharedModel, avoid: Optional[str] = None, call_deadline: Optional[float] = None,
             cancel: Optional["_Cancel"] = None, timeout: Optional[float] = None) -> "_Handles":
        """Attach ``model`` to the runtime named ``model.runtime`` (not to namespace ``avoid``, the one
        that went away), waiting for it until the connect timeout or the call's ``call_deadline`` ends
        (``timeout``: the call's, for the message), the handle is closed or ``cancel`` cancelled."""
        now = time.monotonic()
        deadline, call_timeout = now + model.connect_timeout, None
        if call_deadline is not None and call_deadline < deadline:
            deadline, call_timeout = call_deadline, call_deadline - now if timeout is None else timeout
        pause, told = 0.01, False
        while True:
            reg, starting = naming.resolve(model.runtime), False   # (as last seen)
            if reg is None and not told and avoid is None and deadline > time.monotonic():
                told = True   # a typo would otherwise be connect_timeout seconds of silence
                # (not "yet": a serve that is draining has unregistered too, helper-52)
                logger.warning("no simpledbi runtime named %r is running now (not started, or stopping); "
                               "waiting up to %.3g s more for one (%s)", model.runtime, deadline - time.monotonic(),
                               f"connect_timeout={model.connect_timeout:g} s" if call_timeout is None else
                               f"the call's timeout, {call_timeout:g} s")
            elif avoid is not None and (reg is None or reg.namespace == avoid) and avoid not in _told_gone \
                    and deadline > time.monotonic():
                _told_gone.add(avoid)   # (once, not once per waiting thread: helper-55 saw 30 s of silence)
                logger.warning("simpledbi runtime %r stopped; calls wait up to %.3g s for a runtime of that "
                               "name to come back (%s)", model.runtime, deadline - time.monotonic(),
                               f"connect_timeout={model.connect_timeout:g} s" if call_timeout is None else
                               f"the call's timeout, {call_timeout:g} s")
            if reg is not None and reg.namespace != avoid:
                if model.name not in reg.models:
                    raise LookupError(f"runtime {model.runtime!r} serves {list(reg.models)}, not "
                                      f"{model.name!r}")
                try:
                    h = cls.open(reg.namespace, model.name)
                except (LookupError, RuntimeError, OSError):
                    pass  # still creating its files, or gone again: look once more
                else:
                    if h.ctl.state != STARTING:
                        return h
                    # its model processes still load: what the model declares (input shapes,
                    # dtypes, names) is published with RUNNING, and this client is built on it
                    starting = True
                    h.release()
            if getattr(model, "_closed", False):   # close() from another thread while waiting
                raise RuntimeStopped(f"SharedModel({model.name!r}) is closed")
            if cancel is not None and cancel.cancelled:   # its task is gone: free the pool's thread
                raise RuntimeStopped(f"model {model.name!r}: the awaiting task was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                what = ("finished starting (its model processes were still loading)" if starting
                        else "came back" if avoid else "is running")
                if call_timeout is not None:
                    raise RuntimeUnavailable(
                        f"model {model.name!r}: no result within the timeout ({call_timeout:.3g} s): "
                        f"no simpledbi runtime named {model.runtime!r} {what} meanwhile")
                hint = ("raise connect_timeout for a model that loads longer" if starting else
                        f"start it with `simpledbi serve --name {model.runtime} ...` or "
                        f"Runtime(models, name={model.runtime!r})" + _running_now())
                raise RuntimeUnavailable(f"no simpledbi runtime named {model.runtime!r} {what} within "
                                         f"the connect timeout ({model.connect_timeout:g} s); {hint}")
            # Connecting is rare (start-up, a runtime restart): a short backed-off poll of the
            # registration file costs nothing while requests flow.
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)

    def left(self) -> bool:
        """Attached by name: is the runtime gone or stopping (time to attach to its successor)?"""
        try:
            return self.gone or self.ctl.state >= STOPPING and self.ctl.state != BROKEN
        except (TypeError, ValueError):   # close() from another thread closed the control block
            raise RuntimeStopped(f"SharedModel({self.name!r}) is closed") from None

    def refuse(self, slot: ClientSlot, deadline: Optional[float]) -> None:
        """Raise Overloaded if the call in ``slot`` is refused here, unsent (NOTE [overload]): while
        every serving process has requests waiting, it would wait past its ``deadline`` or beyond
        max_queue (none waiting below its priority). Counted for this handle's next datagram."""
        seen = self.ctl.backlog()
        if seen is None:
            return
        waiting, wait, lowest = seen
        if deadline is not None and slot.priority <= 0 and time.monotonic() + wait > deadline:
            why = Refusal("deadline", wait)   # (first: as a model process decides)
        elif self.max_queue is not None and waiting >= self.max_queue and slot.priority <= lowest:
            why = Refusal("queue", wait)      # it would displace no one waiting
        else:
            return
        with self.lock:
            self.refused[why.reason == "queue"] += 1
        raise _overloaded(self.name, why, slot.call_timeout, slot.call_start, self.max_queue, waiting)

    def set_send_timeout(self, seconds: float) -> None:
        """How long a blocking send waits for room in the model's queue (a kernel wait). Set before
        every such wait, never cached: the socket's setting is shared with this process's other
        threads and handles of the model (a forked child's 20 ms, when children shared it too,
        left its parent looping every 20 ms)."""
        seconds = max(seconds, 1e-6)
        sec = int(seconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                             struct.pack("ll", sec, int((seconds - sec) * 1e6)))

    def borrow(self, client: SharedModel) -> ClientSlot:
        if os.getpid() != self.pid:   # forked by a fork() that skipped Python's hooks (one in C):
            self._new_pool()          # lending the parent's slots would cross answers
        with self.lock:
            if self.closed:
                raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
            if self.idle:
                slot = self.idle.pop()
                self.busy.add(slot)
                return slot
            for slot in self.stale:
                if slot.settled():
                    self.stale.remove(slot)
                    slot.stale_seq = 0
                    self.busy.add(slot)
                    return slot
            self.creating += 1  # the shared handles stay open until this one is made
        slot = None
        try:
            slot = ClientSlot(self.sock, client.max_shapes, client.dtypes, self.send_fd)
        finally:
            with self.lock:
                self.creating -= 1
                if slot is not None:
                    self.busy.add(slot)
                closed = self.closed
            if closed:   # meanwhile: given back at once (None: the slot failed to be made)
                self.give_back(slot)
        if closed:
            raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
        return slot

    def give_back(self, slot: Optional[ClientSlot]) -> None:
        """To the pool, unless it holds _IDLE_KEPT idle slots beyond the calls in flight; once the
        handle is closed, detached (the last one out closes the shared handles)."""
        with self.lock:
            self.busy.discard(slot)
            if slot is not None and any(slot.refused):   # reported by the handle's next datagram, any slot's
                self.refused = [a + b for a, b in zip(self.refused, slot.refused)]
                slot.refused = [0, 0, 0]
            if not self.closed:
                (self.stale if slot.stale_seq else self.idle).append(slot)
                stale = self.stale
                # the oldest first (late answers come about in order): settled at the next call after a
                # burst of abandoned calls, not after as many calls as there are stale slots (helper-51)
                while stale and stale[0].answered(stale[0].stale_seq):
                    settled = stale.pop(0)
                    settled.stale_seq = 0
                    self.idle.append(settled)
                self._given_back += 1
                if len(self.stale) > _IDLE_KEPT and self._given_back >= len(self.stale):
                    self._settle_stale()
                excess = self.idle[:max(len(self.idle) - len(self.busy) - _IDLE_KEPT, 0)]
                del self.idle[:len(excess)]
            else:
                excess = [slot] if slot is not None else []
            last = self.closed and not self.busy and not self.creating
        for idle in excess:
            idle.detach()
        if last:
            self._close_shared()

    def _settle_stale(self) -> None:
        """Stale slots whose late answer came are idle ones again, trimmed as those are (a burst of
        abandoned calls kept its slots for good: 546 memfds after 300 timed out, helper-48). Looked at
        once per as many calls as there are stale slots: O(1) a call however many wait."""
        self._given_back = 0
        answered = [s for s in self.stale if s.answered(s.stale_seq)]
        for s in answered:
            self.stale.remove(s)
            s.stale_seq = 0
        self.idle.extend(answered)

    def _new_pool(self) -> None:
        """This process's empty slot pool (in a forked child too: the parent's calls use its slots)."""
        forked = hasattr(self, "pid")
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.idle: List[ClientSlot] = []
        self.stale: List[ClientSlot] = []   # owed a late answer: lent again once settled()
        self._given_back = 0       # slots given back since stale ones were last looked at
        self.busy: set = set()
        self.creating = 0          # slots being made right now (outside the lock)
        # calls ended here unsent (refused: deadline, queue -- NOTE [overload]; withdrawn), not reported yet
        self.refused = [0, 0, 0]
        if getattr(self, "_sender", None) is not None:   # (a forked child: its parent's)
            self._sender.drop_inherited()
        if forked:   # a forked child: its own socket, not a share of its parent's send buffer
            try:     # (_SEND_BUFFER) and send timeout
                self.sock = _shared_socket(self.path)
            except OSError:
                pass   # (the runtime is gone: the inherited socket says so at the first send)
        self._sender: Optional[sender.Sender] = None   # forward_async's, made at its first full queue

    def release(self) -> None:
        """Detach idle slots now, busy ones when their call ends (woken with RuntimeStopped)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            idle, self.idle, self.stale = self.idle + self.stale, [], []
            for slot in self.busy:  # woken under the lock: a slot given back meanwhile is not
                slot.interrupted = True
                slot.wake()
            if self._sender is not None:   # forward_async calls waiting for room
                self._sender.wake_all()
            last = not self.busy and not self.creating
        for slot in idle:
            slot.detach()
        if last:
            self._close_shared()

    def sender(self, look: float) -> "sender.Sender":
        """The thread that sends forward_async's datagrams while the model's queue is full, through
        a socket of its own (its send timeout is its own)."""
        with self.lock:
            if self._sender is None:
                self._sender = sender.Sender(_connect(self.path), look, self._lost)
            return self._sender

    def _lost(self, msgs: List[bytes]) -> None:
        """Datagrams the sender thread never sent after their calls gave them up: what each was to
        report, and the call itself, withdrawn, go with the handle's next request."""
        with self.lock:
            for msg in msgs:
                self.refused = [a + b for a, b in zip(self.refused, unsent_datagram(msg))]

    def _close_shared(self) -> None:
        if self._sender is not None:
            self._sender.close()
        _unshare_socket(self.path, self.sock)
        self.ctl.close()
