"""What runs in the caller: ``SharedModel``, a PyTorch-looking handle on a served model.

One :class:`_Slot` per (SharedModel, thread): its own input segment sized from ``max_shape``, its
own output segment sized from the model's output shapes, and two semaphores (``rdy``: request
ready, the token a model process claims; ``don``: response done). The request path is: validate
-> copy inputs into the slot -> publish (numpy stores + two semaphore posts) -> sleep on ``don``
-> copy outputs out. See NOTE [slot protocol] in slots.py.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from typing import List, Optional, Tuple

import numpy as np
import posix_ipc

from . import stats as _stats
from .errors import ModelError, ModelProcessDied, RuntimeStopped
from .shm import Segment, create_semaphore, list_namespace, open_semaphore, pid_alive, unlink_sem
from .slots import (
    BROKEN, DATA_OFFSET, DESC_WORDS, F_BATCH_ROWS, F_CLOSE, F_DONE, F_PUBLISH, FLAG_PROBE, FREE, I_PID, IDLE,
    MAX_IO, MAX_NDIM, P_DESC, P_NOUT, P_OUT_BYTES, P_SEQ, P_STATUS, P_TUPLE,
    NEW, PUBLISHED, R_DESC, R_FLAGS, R_NIN, R_ROWS, R_SEQ, ST_BAD_REQUEST, ST_MODEL_ERROR, ST_OK,
    ST_STOPPED, STOPPING, CLAIMED, H_MAX_BATCH, T_ATTACHED, T_CLAIMER, T_GEN, T_KEY, T_OWNER,
    T_ROWS, T_SEQ, T_STATE, ControlBlock, SlotViews, align, code_dtype, ctl_name, desc_view,
    doorbell_name, dtype_code, read_desc, sem_name, shape_key, slot_name, write_desc,
)

logger = logging.getLogger(__name__)

ENV_NAMESPACE = "SIMPLEDBI_NAMESPACE"
_live_clients: "weakref.WeakSet[SharedModel]" = weakref.WeakSet()


def close_all_clients() -> None:
    """Detach every SharedModel of this process (the worker wrapper calls it on exit)."""
    for client in list(_live_clients):
        client.close()


def _normalize_shapes(max_shape) -> Tuple[Tuple[int, ...], ...]:
    if isinstance(max_shape, (tuple, list)) and max_shape and all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in max_shape):
        shapes = (tuple(int(d) for d in max_shape),)
    elif isinstance(max_shape, (tuple, list)) and max_shape and all(
            isinstance(s, (tuple, list)) for s in max_shape):
        shapes = tuple(tuple(int(d) if isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                             else _bad_shape(max_shape) for d in s) for s in max_shape)
    else:
        _bad_shape(max_shape)
    if len(shapes) > MAX_IO:
        raise ValueError(f"max_shape: expected at most {MAX_IO} inputs, got {len(shapes)}")
    for s in shapes:
        if not 1 <= len(s) <= MAX_NDIM + 1 or any(d < 1 for d in s):
            raise ValueError(f"max_shape: expected (rows, *item_shape) with 1..{MAX_NDIM + 1} "
                             f"positive dims, got {s}")
    return shapes


def _bad_shape(max_shape):
    raise TypeError("max_shape: expected a shape tuple such as (1, 3, 224, 224), or a list of "
                    f"them for several inputs, got {max_shape!r}")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and "torch" in sys.modules and \
        isinstance(x, sys.modules["torch"].Tensor)


class SharedModel:
    """A handle on the model ``name`` served by the runtime this process belongs to.

    ``max_shape`` is the largest request this client will send, rows first; requests may be
    smaller in every dimension. Give a list of shapes for a model with several inputs, and
    ``dtype`` (one, or one per input) when inputs are not float32. Safe to share between threads:
    each thread gets its own slot.
    """

    def __init__(self, name: str, max_shape, dtype=None, *, namespace: Optional[str] = None,
                 poll_interval: float = 0.5):
        if not isinstance(name, str):
            raise TypeError(f"name: expected str, got {type(name).__name__}")
        self.name = name
        self.max_shapes = _normalize_shapes(max_shape)
        n_in = len(self.max_shapes)
        if dtype is None:
            dtypes = ["float32"] * n_in
        elif isinstance(dtype, (list, tuple)):
            dtypes = list(dtype)
            if len(dtypes) != n_in:
                raise ValueError(f"dtype: expected {n_in} dtypes (one per input), got {len(dtypes)}")
        else:
            dtypes = [dtype] * n_in
        self.dtypes = [code_dtype(dtype_code(d)) for d in dtypes]
        self.max_rows = self.max_shapes[0][0]
        if any(s[0] != self.max_rows for s in self.max_shapes):
            raise ValueError(f"max_shape: every input needs the same row count, got "
                             f"{[s[0] for s in self.max_shapes]}")
        self.poll_interval = float(poll_interval)
        self.namespace = namespace or os.environ.get(ENV_NAMESPACE)
        if not self.namespace:
            raise LookupError("no simpledbi runtime here: create SharedModel inside a worker "
                              f"started by simpledbi.Run, or pass namespace= (or set ${ENV_NAMESPACE})")
        try:
            self.ctl = ControlBlock.attach(ctl_name(self.namespace, name))
            self.doorbell = open_semaphore(doorbell_name(self.namespace, name))
        except posix_ipc.ExistentialError:
            available = sorted({e.split(".")[1] for e in list_namespace(self.namespace)
                                if e.endswith(".ctl")})
            raise LookupError(f"no model named {name!r} in runtime {self.namespace}; available: "
                              f"{available}") from None
        max_batch = int(self.ctl.header[H_MAX_BATCH])
        if self.max_rows > max_batch:
            self.ctl.close()
            self.doorbell.close()
            raise ValueError(f"max_shape has {self.max_rows} rows but model {name!r} has "
                             f"max_batch_size={max_batch}: a request must fit in one batch")
        self._local = threading.local()
        self._slots: List[_Slot] = []
        self._lock = threading.Lock()
        self._closed = False
        # Detach on close(), at worker exit, or when the handle is garbage-collected: an attached
        # but unused slot would make model processes wait for a request that never comes.
        self._finalizer = weakref.finalize(self, _release, self._slots, self.doorbell, self.ctl,
                                           os.getpid())
        _live_clients.add(self)
        try:
            self._slot()  # attach now so setup errors surface at construction
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public API
    def forward(self, *inputs, timeout: Optional[float] = None):
        """Run the model on ``inputs`` (numpy arrays or CPU torch tensors), batched with others.

        Returns numpy arrays for numpy inputs and torch tensors for torch inputs; a tuple when the
        model returns a tuple. Raises ``TimeoutError`` when ``timeout`` seconds pass first.
        """
        arrays, as_torch = self._validate(inputs)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(f"timeout: expected None or seconds >= 0, got {timeout!r}")
        outs, is_tuple = self._slot().call(arrays, timeout)
        if as_torch:
            torch = sys.modules["torch"]
            outs = [torch.from_numpy(o) for o in outs]
        return tuple(outs) if is_tuple else outs[0]

    __call__ = forward

    def last_timing(self) -> dict:
        """Where the calling thread's last request spent its time (seconds, ``time.monotonic``
        clock): ``published``, ``batch_closed`` (its batch started), ``done`` (its result was
        written), ``woken`` (this thread resumed), and ``batch_rows``."""
        return self._slot().timing()

    def stats(self) -> dict:
        """Counters of the whole model (all its processes): requests, batches, mean_batch_size, ..."""
        return _stats.summarize(self.ctl)

    def close(self) -> None:
        """Detach every slot of this handle and remove its shared memory. Idempotent."""
        with self._lock:
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

    # ------------------------------------------------------------ internals
    def _slot(self) -> "_Slot":
        slot = getattr(self._local, "slot", None)
        if slot is None or slot.pid != os.getpid():  # new thread, or a forked child
            if self._closed:
                raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
            slot = _Slot(self)
            with self._lock:
                self._slots.append(slot)
            self._local.slot = slot
        return slot

    def _validate(self, inputs) -> Tuple[List[np.ndarray], bool]:
        if len(inputs) != len(self.max_shapes):
            raise TypeError(f"model {self.name!r}: expected {len(self.max_shapes)} input(s) "
                            f"(one per max_shape), got {len(inputs)}")
        arrays, as_torch, rows = [], False, None
        for k, (x, max_s, dt) in enumerate(zip(inputs, self.max_shapes, self.dtypes)):
            if _is_torch(x):
                if x.device.type != "cpu":
                    raise TypeError(f"input {k}: expected a CPU tensor, got one on {x.device}")
                as_torch = True
                try:
                    x = x.detach().numpy()
                except TypeError as e:
                    raise TypeError(f"input {k}: dtype {inputs[k].dtype} has no numpy equivalent, "
                                    f"expected {dt}") from e
            elif not isinstance(x, np.ndarray):
                raise TypeError(f"input {k}: expected a numpy array or a torch tensor, got "
                                f"{type(x).__name__}")
            if x.dtype != dt:
                raise TypeError(f"input {k}: expected dtype {dt}, got {x.dtype}")
            if x.ndim != len(max_s):
                raise ValueError(f"input {k}: expected {len(max_s)} dimensions (rows first, at most "
                                 f"{max_s}), got shape {x.shape}")
            if x.shape[0] < 1 or x.shape[0] > max_s[0]:
                raise ValueError(f"input {k}: expected 1..{max_s[0]} rows, got {x.shape[0]} "
                                 f"(shape {x.shape}, max_shape {max_s})")
            for d, (got, most) in enumerate(zip(x.shape[1:], max_s[1:]), start=1):
                if got > most or got < 1:
                    raise ValueError(f"input {k}: dimension {d} is {got}, expected 1..{most} "
                                     f"(shape {x.shape}, max_shape {max_s})")
            if rows is not None and x.shape[0] != rows:
                raise ValueError(f"input {k}: expected {rows} rows like input 0, got {x.shape[0]}")
            rows = x.shape[0]
            arrays.append(x)
        return arrays, as_torch


def _release(slots: list, doorbell, ctl, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        for slot in slots:
            slot.detach()
    slots.clear()
    doorbell.close()
    ctl.close()


class _Slot:
    """One thread's request slot: segments, semaphores and the client half of the protocol."""

    def __init__(self, client: SharedModel):
        # No reference back to the SharedModel: its finalizer holds the slots, and a cycle would
        # keep the handle alive forever.
        self.name, self.namespace = client.name, client.namespace
        self.poll_interval, self.doorbell = client.poll_interval, client.doorbell
        self.pid = os.getpid()
        # close() may come from another thread while this slot's thread waits inside a call:
        # then the detach is left to that thread (closing a semaphore under a waiter crashes).
        self._guard = threading.Lock()
        self._busy = self._detach_pending = False
        self.ctl = client.ctl
        ns, name = client.namespace, client.name
        self.index, self.ready = self._take_index(ns, name)
        self.done = None
        self.in_seg = self.out_seg = self.views = None
        try:
            self.done_name = sem_name(ns, name, self.index, "don")
            unlink_sem(self.done_name)  # a leftover of a crashed owner, if any
            self.done = create_semaphore(self.done_name)
            table = self.ctl.table
            self.gen = int(table[T_GEN, self.index]) + 1
            offsets, size = [], DATA_OFFSET
            for s, dt in zip(client.max_shapes, client.dtypes):
                nbytes = align(int(np.prod(s)) * dt.itemsize, 64)
                offsets.append((size, nbytes))
                size += nbytes
            self.in_seg = Segment(slot_name(ns, name, self.index, self.gen, "in"), size, create=True)
            self.views = SlotViews(self.in_seg)
            w = self.views.words
            w[R_NIN] = len(client.max_shapes)
            for k, ((off, cap), s, dt) in enumerate(zip(offsets, client.max_shapes, client.dtypes)):
                write_desc(desc_view(w, R_DESC, k), dtype_code(dt), s[1:], off, cap)
            self.seq = 0
            self.stale_seq = 0
            self.woken = 0.0
            self._inputs = [(dt, off) for (off, _), dt in zip(offsets, client.dtypes)]
            self._codes = [dtype_code(dt) for dt in client.dtypes]
            self._in_views = {}    # (k, shape) -> view of the input region
            self._out_views = {}   # (j, dtype code, shape) -> view of the output region
            self._keys = {}        # (item shapes, flags) -> batching key
            table[T_OWNER, self.index] = self.pid
            table[T_STATE, self.index] = NEW
            table[T_GEN, self.index] = self.gen
            table[T_ATTACHED, self.index] = 1
            self._setup_outputs(client, ns, name)
        except BaseException:
            self.detach()
            raise

    def _take_index(self, ns: str, name: str):
        """Slot allocation without a lock: creating the slot's ready semaphore with
        O_CREAT|O_EXCL succeeds for exactly one process."""
        table = self.ctl.table
        for i in range(self.ctl.max_slots):
            if table[T_ATTACHED, i]:
                continue
            try:
                return i, create_semaphore(sem_name(ns, name, i, "rdy"))
            except posix_ipc.ExistentialError:
                continue
        raise RuntimeError(f"model {name!r}: all {self.ctl.max_slots} client slots are in use "
                           f"(raise ModelConfig.max_clients)")

    def _setup_outputs(self, client: SharedModel, ns: str, name: str) -> None:
        codes = [dtype_code(d) for d in client.dtypes]
        key = shape_key(codes, [s[1:] for s in client.max_shapes], 0)
        spec = self._find_spec(key)
        if spec is None:  # ask a model process: one row at the maximal item shape
            rows = [np.zeros((1, *s[1:]), dt) for s, dt in zip(client.max_shapes, client.dtypes)]
            self._publish(rows, FLAG_PROBE)
            self._await(self.seq, None)
            w = self.views.words
            self._check_status(int(w[P_STATUS]))
            spec = (int(w[P_NOUT]), bool(w[P_TUPLE]),
                    [read_desc(desc_view(w, P_DESC, j)) for j in range(int(w[P_NOUT]))])
            spec = (spec[0], spec[1], [(dt, shp[1:]) for dt, shp, _, _ in spec[2]])
            self.ctl.table[T_STATE, self.index] = NEW
        n_out, self.is_tuple, outs = spec
        self.n_out = n_out
        size, w = 0, self.views.words
        for j, (dt, item) in enumerate(outs):
            cap = align(client.max_rows * int(np.prod(item, dtype=np.int64)) * dt.itemsize, 64)
            write_desc(desc_view(w, P_DESC, j), dtype_code(dt), (client.max_rows, *item), size, cap)
            size += cap
        w[P_OUT_BYTES] = max(size, 64)
        self.out_seg = Segment(slot_name(ns, name, self.index, self.gen, "out"), max(size, 64),
                               create=True)

    def _find_spec(self, key: int):
        specs = self.ctl.specs
        hits = np.argwhere((specs[:, :, 0] == key) & (specs[:, :, 3] == 1))
        if hits.size == 0:
            return None
        row = specs[hits[0][0], hits[0][1]].copy()
        if row[0] != key or row[3] != 1:  # overwritten meanwhile
            return None
        n_out = int(row[1])
        outs = []
        for j in range(n_out):
            dt, item, _, _ = read_desc(desc_view(row, 4, j))
            outs.append((dt, item))
        return n_out, bool(row[2]), outs

    # ------------------------------------------------------------ request path
    def call(self, arrays: List[np.ndarray], timeout: Optional[float]):
        with self._guard:
            if self.ready is None or self._detach_pending:
                raise RuntimeStopped(f"SharedModel({self.name!r}) is closed")
            self._busy = True
        try:
            return self._call(arrays, timeout)
        finally:
            with self._guard:
                self._busy = False
                pending = self._detach_pending
            if pending:
                self._detach_now()

    def _call(self, arrays: List[np.ndarray], timeout: Optional[float]):
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stale_seq:
            self._await(self.stale_seq, deadline)  # drain the late answer of a timed-out call
            self.stale_seq = 0
            self.ctl.table[T_STATE, self.index] = IDLE
        self._publish(arrays, 0)
        seq = self.seq
        self._await(seq, deadline)
        w = self.views.words
        status = int(w[P_STATUS])
        self.ctl.table[T_STATE, self.index] = IDLE
        self._check_status(status)
        n_out = int(w[P_NOUT])
        if n_out != self.n_out:
            raise ModelError(f"model {self.name!r} returned {n_out} outputs, expected "
                             f"{self.n_out} (as at its first call)")
        outs = []
        for j in range(n_out):
            d = w[P_DESC + j * DESC_WORDS: P_DESC + (j + 1) * DESC_WORDS]
            cache_key = (j, *d[:4 + int(d[1])].tolist())
            view = self._out_views.get(cache_key)
            if view is None:
                dt, shape, off, _ = read_desc(d)
                view = self._out_views[cache_key] = self.out_seg.ndarray(off, dt, shape)
            outs.append(view.copy())
        return outs, self.is_tuple

    def _publish(self, arrays: List[np.ndarray], flags: int) -> None:
        state = self.ctl.state
        if state >= STOPPING:
            self._raise_runtime_state()
        w = self.views.words
        for k, x in enumerate(arrays):
            view = self._in_views.get((k, x.shape))
            if view is None:
                dt, off = self._inputs[k]
                view = self._in_views[(k, x.shape)] = self.in_seg.ndarray(off, dt, x.shape)
                if len(self._in_views) > 256:  # many distinct shapes: keep the cache bounded
                    self._in_views.clear()
            np.copyto(view, x)
            base = R_DESC + k * DESC_WORDS
            nd = x.ndim - 1
            w[base + 1] = nd
            w[base + 4: base + 4 + nd] = x.shape[1:]
        rows = arrays[0].shape[0]
        items = tuple(x.shape[1:] for x in arrays)
        key = self._keys.get((items, flags))
        if key is None:
            key = self._keys[(items, flags)] = shape_key(self._codes, items, flags)
        self.seq += 1
        w[R_ROWS] = rows
        w[R_FLAGS] = flags
        w[R_SEQ] = self.seq
        now = time.monotonic()
        self.views.floats[F_PUBLISH] = now
        table, i = self.ctl.table, self.index
        table[T_ROWS, i] = rows
        table[T_KEY, i] = key
        table[T_SEQ, i] = self.seq
        self.ctl.t_publish[i] = now
        table[T_STATE, i] = PUBLISHED
        self.ready.release()
        self.doorbell.release()

    def _await(self, seq: int, deadline: Optional[float]) -> None:
        """Sleep until the response to ``seq`` is written; check liveness at every poll interval."""
        poll = self.poll_interval
        w = self.views.words
        while True:
            wait = poll
            if deadline is not None:
                wait = min(poll, deadline - time.monotonic())
                if wait <= 0:
                    self._on_timeout(seq)
            try:
                self.done.acquire(max(wait, 0.0))
                woke = True
            except posix_ipc.BusyError:
                woke = False
            if int(w[P_SEQ]) == seq:
                if not woke:  # written, but its post is still to come (or was lost): absorb it
                    try:
                        self.done.acquire(0)
                    except posix_ipc.BusyError:
                        pass
                self.woken = time.monotonic()
                return
            self._check_alive(seq)

    def timing(self) -> dict:
        f = self.views.floats
        return {"published": float(f[F_PUBLISH]), "batch_closed": float(f[F_CLOSE]),
                "done": float(f[F_DONE]), "woken": self.woken, "batch_rows": int(f[F_BATCH_ROWS])}

    def _on_timeout(self, seq: int):
        try:
            self.ready.acquire(0)  # withdraw: succeeds only if no model process claimed it
        except posix_ipc.BusyError:
            self.stale_seq = seq
            raise TimeoutError(f"model {self.name!r}: no result within the timeout; the "
                               f"request is being computed and its late result will be discarded")
        self.ctl.table[T_STATE, self.index] = IDLE
        raise TimeoutError(f"model {self.name!r}: no result within the timeout (the request "
                           f"was withdrawn before any model process took it)")

    def _check_alive(self, seq: int) -> None:
        ctl = self.ctl
        if ctl.state == BROKEN:
            self._raise_runtime_state()
        table = ctl.table
        if table[T_STATE, self.index] == CLAIMED:
            claimer = int(table[T_CLAIMER, self.index])
            pid = int(ctl.instances[claimer, I_PID])
            if pid and not pid_alive(pid):
                raise ModelProcessDied(f"model {self.name!r}: model process {claimer} "
                                       f"(pid {pid}) died while computing this request")
        pids = [int(p) for p in ctl.instances[:, I_PID] if p]
        if pids and not any(pid_alive(p) for p in pids):
            raise ModelProcessDied(f"model {self.name!r}: no model process is alive")
        if ctl.state == STOPPING and table[T_STATE, self.index] != CLAIMED:
            self._raise_runtime_state()

    def _raise_runtime_state(self):
        state, msg = self.ctl.state, self.ctl.message()
        if state == BROKEN:
            raise ModelProcessDied(msg or f"model {self.name!r}: the runtime is broken")
        raise RuntimeStopped(f"model {self.name!r}: the runtime is shutting down")

    def _check_status(self, status: int) -> None:
        if status == ST_OK:
            return
        text = self.views.error_text()
        if status == ST_MODEL_ERROR:
            type_name, _, rest = text.partition("\n")
            message, _, tb = rest.partition("\n")
            raise ModelError(f"model {self.name!r} raised {type_name}: {message}",
                             remote_type=type_name, remote_traceback=tb)
        if status == ST_BAD_REQUEST:
            raise ValueError(f"model {self.name!r}: {text}")
        if status == ST_STOPPED:
            raise RuntimeStopped(f"model {self.name!r}: {text or 'runtime stopped'}")
        raise ModelProcessDied(f"model {self.name!r}: {text or 'model process died'}")

    def detach(self) -> None:
        """Give the slot back and remove its shared memory (only this slot's creator does this)."""
        with self._guard:
            if self._busy:
                self._detach_pending = True
                return
        self._detach_now()

    def _detach_now(self) -> None:
        ns, name = self.namespace, self.name
        try:
            if self.ready is not None:
                try:
                    self.ready.acquire(0)  # withdraw a request nobody took
                except posix_ipc.BusyError:
                    pass
            table = self.ctl.table
            if table is not None and getattr(self, "gen", None) == int(table[T_GEN, self.index]):
                table[T_ATTACHED, self.index] = 0
                table[T_STATE, self.index] = FREE
                table[T_OWNER, self.index] = 0
        finally:
            if self.views is not None:
                self.views.release()
            for seg in (self.in_seg, self.out_seg):
                if seg is not None:
                    seg.close()
                    seg.unlink()
            self.in_seg = self.out_seg = self.views = None
            if self.done is not None:
                self.done.close()
                unlink_sem(self.done_name)
                self.done = None
            if self.ready is not None:  # last: frees the index for the next client
                self.ready.close()
                unlink_sem(sem_name(ns, name, self.index, "rdy"))
                self.ready = None
            try:  # one client fewer may let a waiting batch close now
                self.doorbell.release()
            except Exception:  # noqa: BLE001 - the runtime is already gone
                pass
