"""The slot protocol: every transition of a client slot, for the client, the model process and
the reaper alike. Layouts are in :mod:`simpledbi.layout`.

NOTE [slot protocol]
--------------------
One *slot* = one request in flight at a time: a lock file, a segment and two semaphores, all
created by one client (a ``SharedModel`` lends its slots to calls, one call per slot at a time)::

    client                                          model process (any of model_num)
    ------                                          --------------------------------
    attach:  lock s<i>.lock        (an open-file-description lock: index i is mine until I close
                                    it or die -- the kernel releases it either way)
             row i = (fresh 64-bit token, NEW); create segment + rdy/don under that token
    publish: inputs + REQUEST header
             rdy.post()            (the claim token exists before any hint points at it)
             row i: rows, key, seq, t_publish, state = PUBLISHED (last)
             doorbell.post() --------------------->  scan rows: PUBLISHED and not claimed
                                                     claim:   take rdy (exactly one wins): under
                                                              the segment's claim lock, through
                                                              the kernel only (foreign_sem)
                                                              pread REQUEST -> private copy,
                                                              validate every field against the
                                                              segment's real size and the model
                                                              claims[i] = (pid, inst, token, seq)
                                                     respond: pwrite outputs, RESPONSE, error text
                                                              pwrite RESP_SEQ = seq (last)
    wait:    don.wait(poll) <-----------------------          don.post()
    read:    RESP_SEQ == seq -> outputs; row i: state = IDLE

    withdraw (timeout before a claim): under the segment's claim lock, rdy.trywait() succeeds
             -> row i = IDLE. If it fails (or the lock is held: a claim in progress), a
             model process owns the request: the slot is *stale* and is lent again only after
             the late response (RESP_SEQ == seq) has arrived and been dropped.
    detach:  withdraw; unlink segment and semaphores; row i = FREE; unlock (last).
    reap:    (runtime) locking s<i>.lock succeeds on a non-FREE row -> its owner died: unlink its
             objects, row i = FREE, unlock.

Row states (hints, written only by the row's client, or by the reaper once it is dead)::

    FREE --attach--> NEW --publish--> PUBLISHED --read / withdraw--> IDLE --publish--> ...
      ^-------------------------- detach / reap --------------------------------'

Why it cannot cross, lose or wedge:
* Ownership of a request is the ``rdy`` semaphore's token alone; the kernel decides.
* A model process never writes the table. Its claims go to the control block (read-only for
  clients); its answers go into the requester's own segment, tagged with the request's seq,
  written last. A late answer can only land in its own stale slot, which is not reused before it
  arrives, so nothing can overwrite a newer request or leave a freed row in a waiting state.
* A model process never maps a client's segment on the CPU path: it reads and writes it with
  pread/pwrite on a file descriptor, so a truncated segment gives a short read (a clear error
  for that client), never SIGBUS; the header it acts on is its own private, validated copy.
* Hints only order the scan. A wrong hint costs a failed trywait (remembered per seq, so it is
  not retried) or a delay; a client whose request is not claimed rewrites its own row at every
  poll interval, so hints damaged by anyone else heal.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import posix_ipc

from .errors import SlotsExhausted
from .foreign_sem import ForeignSemaphore, lock_segment, unlock_segment
from .layout import (
    CLAIM, DATA_OFFSET, DTYPES, REQ_WORD, RESP_WORD, ERR_BYTES, ERR_OFF, FREE, IDLE, MAGIC, MAX_DIM, MAX_IO, MAX_NDIM,
    NAMES_BYTES, NAMES_OFF, NEW, PUBLISHED, REQ_OFF, REQUEST, RESP_OFF, RESP_SEQ_OFF, RESPONSE, SLOT, ST_BAD_REQUEST,
    ST_OK, ControlBlock, SlotTable, align, code_dtype, dtype_code, lock_path, segment_path, sem_name,
    shape_key, words,
)
from .shm import Segment, create_semaphore, pid_alive, unlink_file, unlink_sem

logger = logging.getLogger(__name__)

_SEQ_BYTES = np.dtype("<i8").itemsize
_RECHECK_BYTES = 1 << 18   # requests this large have their segment's memory checked every time
_REFUSED_FIRST = 0.005     # seconds a handle waits after its claim lock was found held (Peer.try_claim)


def backoff(gap: float, first: float, most: float) -> float:
    """The next wait of a doubling backoff: ``first``, then twice the last ``gap``, up to ``most``."""
    return min(2.0 * gap or first, most)


# ================================================================ client side
class ClientSlot:
    """The client's half of one slot. Used by one call at a time (SharedModel lends it)."""

    def __init__(self, namespace: str, model: str, ctl: ControlBlock, table: SlotTable, doorbell,
                 max_shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype]):
        self.namespace, self.model = namespace, model
        self.ctl, self.table, self.doorbell = ctl, table, doorbell
        self.pid = os.getpid()
        self.index, self.lock_fd = _lock_free_index(namespace, model, table, ctl.max_slots)
        self.token = 0
        self.seg: Optional[Segment] = None
        self.ready = self.done = None
        self.seq = 0
        self.stale_seq = 0          # a timed-out request a model process still owes an answer to
        self.withdrawn = 0          # the last seq taken back before any model process claimed it
        self.woken = 0.0
        self.interrupted = False    # close() from another thread while a call waits here
        self._sem_lock = threading.Lock()  # wake() from another thread vs. detach() closing ``done``
        self.lost_at = 0.0          # since when the request is taken but no claim is visible
        self.deaths_at_publish = 0  # the model's death count (ControlBlock.deaths) at publish
        try:
            self._create(max_shapes, dtypes)
        except BaseException:
            self.detach()
            raise

    def _create(self, max_shapes, dtypes) -> None:
        ns, model, i = self.namespace, self.model, self.index
        t = self.table
        if t.state[i] != FREE:     # the last owner died and was not reaped yet
            _unlink_slot_objects(ns, model, i, int(t.token[i]))
        self.token = secrets.randbits(64) | 1
        # The row names the token before any object exists: whenever this process dies, the
        # reaper finds (by the lock) and removes everything it created.
        t.token[i], t.seq[i] = self.token, 0
        t.state[i] = NEW
        self.ready = create_semaphore(sem_name(ns, model, i, self.token, "rdy"))
        self.done = create_semaphore(sem_name(ns, model, i, self.token, "don"))
        offsets, size = [], DATA_OFFSET
        for s, dt in zip(max_shapes, dtypes):
            nbytes = align(int(np.prod(s)) * dt.itemsize, 64)
            offsets.append(size)
            size += nbytes
        # Input pages are reserved as requests first reach them (publish): a client whose
        # max_shape defaults to max_batch_size rows costs only what it sends.
        self.seg = Segment(segment_path(ns, model, i, self.token), size, create=True, keep_fd=True,
                           reserve=DATA_OFFSET)
        self._map_views()
        req = self._req
        req["magic"], req["slot"], req["token"] = MAGIC, i, self.token
        req["out_offset"] = size
        self._inputs = [(dt, off) for off, dt in zip(offsets, dtypes)]
        self._codes = [dtype_code(dt) for dt in dtypes]
        self._reserved = [0] * len(max_shapes)     # bytes of each input region reserved so far
        self._layouts: dict = {}                   # names mask -> {item shapes: shape key}
        self._key = 0                              # the key of the last request published
        self._set_layout(0, tuple(range(len(max_shapes))))

    def _set_layout(self, names: int, positions: Tuple[int, ...]) -> None:
        """Which of the slot's input regions the next requests carry (``positions``), under
        which input names (``names``: the request's flags; 0 = positional)."""
        req = self._req
        req["n_in"], req["flags"] = len(positions), names
        for k, p in enumerate(positions):
            req["dtype"][0, k], req["offset"][0, k] = self._codes[p], self._inputs[p][1]
        self._names, self._positions = names, positions
        self._shapes: List[Optional[tuple]] = [None] * len(positions)  # last shape written per input
        self._keys = self._layouts.setdefault(names, {})

    def _map_views(self) -> None:
        seg = self.seg
        self._req = seg.ndarray(REQ_OFF, REQUEST, (1,))
        self._resp = seg.ndarray(RESP_OFF, RESPONSE, (1,))
        self._resp_seq = seg.ndarray(RESP_SEQ_OFF, np.int64, (1,))
        self._r_seq, self._r_rows, self._r_t = self._req["seq"], self._req["rows"], self._req["t_publish"]
        self._r_ndim, self._r_dims = self._req["ndim"][0], self._req["dims"][0]
        self._in_views, self._out_views = {}, {}

    def _drop_views(self) -> None:
        self._req = self._resp = self._resp_seq = None
        self._r_seq = self._r_rows = self._r_t = self._r_ndim = self._r_dims = None
        self._in_views, self._out_views = {}, {}

    # ------------------------------------------------------------ publish
    def publish(self, arrays: Sequence[np.ndarray], names: int = 0,
                positions: Optional[Tuple[int, ...]] = None) -> int:
        """Write the request and make it claimable; returns its seq. Inputs are positional
        (``names`` 0), or the declared inputs whose bits ``names`` sets, in ascending order, each
        in the slot's region ``positions[k]``."""
        if names != self._names:
            self._set_layout(names, positions or tuple(range(len(self._inputs))))
        for k, (x, p) in enumerate(zip(arrays, self._positions)):
            shape = x.shape
            view = self._in_views.get((p, shape))
            if view is None:
                if len(self._in_views) > 256:  # many distinct shapes: keep the cache bounded
                    self._in_views.clear()
                dt, off = self._inputs[p]
                if x.nbytes > self._reserved[p]:
                    self.seg.reserve(off, x.nbytes)
                    self._reserved[p] = x.nbytes
                view = self._in_views[(p, shape)] = self.seg.ndarray(off, dt, shape)
            np.copyto(view, x)
            if shape != self._shapes[k]:
                nd = len(shape) - 1
                self._r_ndim[k] = nd
                self._r_dims[k, :nd] = shape[1:]
                self._r_dims[k, nd:] = 0
                self._shapes[k] = shape
        rows = arrays[0].shape[0]
        items = (arrays[0].shape[1:],) if len(arrays) == 1 else tuple(x.shape[1:] for x in arrays)
        key = self._keys.get(items)
        if key is None:
            if len(self._keys) > 256:
                self._keys.clear()
            key = self._keys[items] = shape_key([self._codes[p] for p in self._positions], items, names)
        self._key = key
        self.seq += 1
        self.lost_at = 0.0
        self.deaths_at_publish = self.ctl.deaths
        seq, now = self.seq, time.monotonic()
        buf = self.seg.buf
        _SEQ_ROWS.pack_into(buf, REQ_OFF + _SEQ_B, seq, rows)
        _F64.pack_into(buf, REQ_OFF + _T_B, now)
        self.ready.release()
        t, i = self.table, self.index
        _ROW_HINTS.pack_into(t.raw, i * SLOT.itemsize + _ROW_HINTS_B, seq, rows, key, self.token, now)
        t.state[i] = PUBLISHED   # last
        self.doorbell.release()
        return seq

    def answered(self, seq: int) -> bool:
        return int(self._resp_seq[0]) == seq

    def wait(self, seq: int, timeout: float) -> bool:
        """Sleep on ``don`` up to ``timeout``; True once the response to ``seq`` is written."""
        try:
            self.done.acquire(max(timeout, 0.0))
            woke = True
        except (posix_ipc.BusyError, posix_ipc.SignalError):  # a signal: the caller loops
            woke = False
        if int(self._resp_seq[0]) == seq:
            if not woke:  # written, but its post is still to come: absorb it
                try:
                    self.done.acquire(0)
                except posix_ipc.BusyError:
                    pass
            self.woken = time.monotonic()
            return True
        return False

    def settled(self) -> bool:
        """A stale slot may be lent again: its late answer arrived, or its claimer is dead."""
        if self.answered(self.stale_seq):
            return True
        claim = self.claimed_by(self.stale_seq)
        return claim is not None and not pid_alive(claim[1])

    def wake(self) -> None:
        """Wake a thread sleeping in :meth:`wait` (close() from another thread). A no-op once
        the slot is detached: its call has ended already."""
        with self._sem_lock:
            if self.done is not None:
                self.done.release()

    def withdraw(self) -> bool:
        """Take back a request no model process has claimed; False if one owns it. Under the
        slot's claim lock: a model process holding it is taking the request right now."""
        if not lock_segment(self.seg.fd):
            return self.withdrawn == self.seq
        try:
            self.ready.acquire(0)
        except posix_ipc.BusyError:
            return self.withdrawn == self.seq  # taken back already, or not
        finally:
            unlock_segment(self.seg.fd)
        self.withdrawn = self.seq
        self.table.state[self.index] = IDLE
        return True

    def claimed_by(self, seq: int) -> Optional[Tuple[int, int]]:
        """(instance, pid) of the model process that claimed ``seq``, if its claim is visible."""
        c = self.ctl.claims[self.index]
        if int(c["token"]) == self.token and int(c["seq"]) == seq:
            return int(c["instance"]), int(c["pid"])
        return None

    def answered_under_another_seq(self, seq: int) -> Optional[int]:
        """The seq a model process claimed and answered under this slot's token in place of
        ``seq`` (it could not read this request's header, so it used the table row's), if any."""
        c = self.ctl.claims[self.index]
        other = int(c["seq"])
        if int(c["token"]) == self.token and other != seq and int(c["done"]) == other and self.answered(other):
            return other
        return None

    def repair_hint(self, seq: int) -> None:
        """Rewrite this slot's row if anyone else changed it while the request waits unclaimed."""
        t, i = self.table, self.index
        if t.state[i] == PUBLISHED and t.seq[i] == seq and t.token[i] == self.token:
            return
        t.nrows[i], t.token[i], t.seq[i] = int(self._r_rows[0]), self.token, seq
        t.key[i], t.t_publish[i] = self._key, float(self._r_t[0])
        t.state[i] = PUBLISHED
        self.doorbell.release()
        logger.debug("slot %d of model %r: its row was changed by someone else; repaired",
                     i, self.model)

    # ------------------------------------------------------------ read
    def mark_idle(self) -> None:
        self.table.state[self.index] = IDLE

    def response(self) -> Tuple[int, str, int]:
        """(status, error text, structure) of the response just written; reads its header once."""
        w = self._rw = _RESP_UNPACK(self.seg.buf, RESP_OFF)
        status = w[_RS_STATUS]
        text = ""
        if status != ST_OK:
            n = min(max(w[_RS_ERRLEN], 0), ERR_BYTES)
            text = bytes(self.seg.buf[ERR_OFF:ERR_OFF + n]).decode("utf-8", "replace")
        return status, text, w[_RS_STRUCT]

    def output_names(self) -> bytes:
        """The names text of the dict / namedtuple answer read by :meth:`response`."""
        n = min(max(self._rw[_RS_NAMESLEN], 0), NAMES_BYTES)
        return bytes(self.seg.buf[NAMES_OFF:NAMES_OFF + n])

    def outputs(self) -> List[np.ndarray]:
        """Copies of the outputs of the response read by :meth:`response`."""
        w = self._rw
        if w[_RS_NEEDED] > self.seg.size:  # the model process extended the segment (large outputs)
            self._drop_views()
            self.seg.remap()
            self._map_views()
        n_out = w[_RS_NOUT]
        if not 1 <= n_out <= MAX_IO:
            raise ValueError(f"response with {n_out} outputs")
        outs = []
        for j in range(n_out):
            base = _RS_DIMS + j * (MAX_NDIM + 1)
            key = (j, w[_RS_DTYPE + j], w[_RS_OFFSET + j], w[base:base + w[_RS_NDIM + j]])
            view = self._out_views.get(key)
            if view is None:
                if len(self._out_views) > 256:
                    self._out_views.clear()
                view = self._out_views[key] = self.seg.ndarray(key[2], code_dtype(key[1]), key[3])
            outs.append(view.copy())
        return outs

    def timing(self) -> dict:
        """Where the request just read spent its time (time.monotonic seconds)."""
        w = self._rw
        t_close, t_done = _F64.unpack_from(self.seg.buf, RESP_OFF + _RS_TCLOSE * 8)[0], \
            _F64.unpack_from(self.seg.buf, RESP_OFF + _RS_TDONE * 8)[0]
        return {"published": float(self._r_t[0]), "batch_closed": t_close, "done": t_done,
                "woken": self.woken, "batch_rows": w[_RS_ROWS]}

    # ------------------------------------------------------------ detach
    def detach(self) -> None:
        """Give the slot back and remove its objects. Only its creator process does this."""
        if os.getpid() != self.pid:
            return
        ns, model, i = self.namespace, self.model, self.index
        try:
            if self.ready is not None:
                try:
                    self.ready.acquire(0)  # withdraw a request nobody took
                except posix_ipc.BusyError:
                    pass
        finally:
            self._drop_views()
            if self.seg is not None:
                self.seg.close()
                self.seg.unlink()
                self.seg = None
            with self._sem_lock:
                for which in ("ready", "done"):
                    sem = getattr(self, which)
                    if sem is not None:
                        sem.close()
                        setattr(self, which, None)
            if self.token:
                unlink_sem(sem_name(ns, model, i, self.token, "rdy"))
                unlink_sem(sem_name(ns, model, i, self.token, "don"))
            # Only now is the row freed (all objects are gone), then the index: a process killed
            # anywhere in here leaves a non-FREE row with a free lock, which the reaper finishes.
            if self.token and self.table.state is not None and self.table.token[i] == self.token:
                self.table.state[i] = FREE
            if self.lock_fd is not None:
                _lock_fds.discard(self.lock_fd)
                os.close(self.lock_fd)  # last: releases the index
                self.lock_fd = None
            try:  # one client fewer may let a waiting batch close now
                self.doorbell.release()
            except Exception:  # noqa: BLE001 - the runtime is already gone
                pass


# struct flock for F_OFD_SETLK: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_FLOCK = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_lock_fds: "set[int]" = set()   # this process's slot locks (closed in forked children)


def try_lock(fd: int) -> bool:
    """Take an open-file-description lock on ``fd`` without waiting. Unlike POSIX record locks
    (``lockf``), it conflicts with another open of the same file in the same process (the
    runtime's reaper may share a process with its clients), and it is released only when the
    last descriptor of that open goes: by close, or by the kernel when the process dies."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK)
        return True
    except OSError:
        return False


def _close_inherited_locks() -> None:
    # A forked child shares its parent's lock descriptions; closing its copies keeps the locks
    # tied to the parent's lifetime alone.
    for fd in list(_lock_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _lock_free_index(namespace: str, model: str, table: SlotTable, max_slots: int):
    """Lock the first free slot index (free rows first, then rows whose hint may be stale)."""
    states = table.state.copy()
    order = np.concatenate([np.flatnonzero(states == FREE), np.flatnonzero(states != FREE)])
    for i in map(int, order):
        fd = _open_lock(lock_path(namespace, model, i))
        if fd is None:
            continue
        if not try_lock(fd):
            os.close(fd)
            continue
        _lock_fds.add(fd)
        return i, fd
    raise SlotsExhausted(f"model {model!r}: all {max_slots} client slots are in use "
                         f"(raise ModelConfig.max_clients)")


#: what opening a lock path gives when a client put something else there: a directory, a
#: symlink (O_NOFOLLOW), a socket
_NOT_A_LOCK = (errno.EISDIR, errno.ELOOP, errno.ENXIO)


def _open_lock(path: str) -> Optional[int]:
    """Open (or create) the lock file at ``path``. Whatever else a client put there -- a
    directory, a symlink, a FIFO: no client can hold a lock on it -- is set aside first (in
    constant time: :func:`shm.discard`); None if the path still holds no lock file after that."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            if e.errno not in _NOT_A_LOCK:
                return None
            unlink_file(path)
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        unlink_file(path)
    return None


def _unlink_slot_objects(namespace: str, model: str, slot: int, token: int) -> None:
    if token:
        unlink_file(segment_path(namespace, model, slot, token))
        unlink_sem(sem_name(namespace, model, slot, token, "rdy"))
        unlink_sem(sem_name(namespace, model, slot, token, "don"))


# ================================================================ reaper
def reap_dead(namespace: str, model: str, table: SlotTable) -> List[int]:
    """Free the slots whose client died (its lock is free although its row says attached).
    Called by the runtime's supervisor; returns the reaped slot indices."""
    reaped = []
    for i in map(int, np.flatnonzero(table.state != FREE)):
        path = lock_path(namespace, model, i)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            table.state[i] = FREE  # never attached: a stray hint
            continue
        except OSError as e:
            if e.errno not in _NOT_A_LOCK:
                continue   # out of descriptors, say: nothing to conclude about the slot
            fd = None
        try:
            if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
                # A directory, a symlink...: what a client put at the lock path. Whether the
                # slot's owner is alive (holding its lock on the file that was there) cannot be
                # told, so only the junk goes; the row is handled next time, like any row whose
                # lock file is missing.
                unlink_file(path)
                continue
            if not try_lock(fd):
                continue  # its owner is alive
            if table.state[i] == FREE:
                continue  # detached cleanly meanwhile
            _unlink_slot_objects(namespace, model, i, int(table.token[i]))
            table.state[i] = FREE
            reaped.append(i)
        except OSError:   # one slot's trouble must not stop the reaper (nor its caller)
            logger.debug("reaping slot %d of model %r failed", i, model, exc_info=True)
        finally:
            if fd is not None:
                os.close(fd)  # releases our lock
    return reaped


# ================================================================ model-process side
class BadRequest(Exception):
    """A request that failed validation; ``seq`` is the seq to answer it under."""

    def __init__(self, text: str, seq: int):
        super().__init__(text)
        self.seq = seq


@dataclass
class Limits:
    """What a model process accepts; everything else from a client is rejected."""

    max_batch: int
    n_inputs: Optional[int] = None                # known when the model declares its inputs
    dtypes: Optional[Tuple[np.dtype, ...]] = None
    names: Tuple[str, ...] = ()                   # the input names requests may use (flags bits)
    max_age: float = 3600.0                       # publish times older than this are clamped
    max_request_bytes: int = 2**31                # per input: a sparse segment must not size staging


@dataclass(slots=True)
class Request:
    """A claimed request: a private, validated copy of what its client wrote."""

    peer: "Peer"
    seq: int
    rows: int
    items: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[np.dtype, ...]
    offsets: Tuple[int, ...]
    nbytes: Tuple[int, ...]
    out_offset: int
    key: int
    t_publish: float
    answered: bool = field(default=False)
    mapped: Optional[tuple] = None                # (mmap, address, size) when mapped for DMA
    t_seen: float = 0.0                           # when the claiming process first saw it pending
    names: Optional[Tuple[str, ...]] = None       # keyword inputs: their names; None: positional
    # (dtypes, item shapes, names mask) exactly: only requests of one kind share a batch. ``key``
    # is its CRC, comparable with clients' hints -- and a client can pick a shape whose CRC
    # matches another client's: equal keys alone would batch different shapes together.
    kind: tuple = ()

    @property
    def slot(self) -> int:
        return self.peer.slot


class Peer:
    """A model process's handle on one attached slot (slot index + token): a file descriptor on
    its segment and its two semaphores. The segment is mapped only for CUDA DMA (``map``)."""

    def __init__(self, namespace: str, model: str, slot: int, token: int):
        self.slot, self.token = slot, token
        self.ready = self.done = self.fd = None
        self.mapping = None      # (mmap, address, size) once mapped for DMA
        self.warned = False
        self.inflight = 0        # requests claimed through this peer and not answered yet
        self.size = 0            # the segment's size when last validated (or extended by us)
        self.allocated = 0       # ... and the bytes of memory behind it (st_blocks), then
        self.answered_at = 0.0   # when this process last woke the client (time.monotonic) ...
        self.answered_seq = -1   # ... and for which request
        self.last_ok = 0.0       # when a claim through this handle last succeeded
        # Not looked at (sweep, paced retries) before this: its claim lock was found held, its
        # token posted again or its request rejected (see try_claim and ModelServer._claim).
        self.refused_until = 0.0
        self._refuse_gap = 0.0
        self.reject_gap = 0.0    # ... its last requests failed validation (ModelServer._claim)
        self._last = None        # the last request validated: its static header bytes and result
        self._heads = {}         # response header prefixes by output signature
        # The segment a client created, not what it may have put at its path since: no symlink
        # (O_NOFOLLOW), no FIFO or device (no blocking open, then S_ISREG), no second name of
        # another file (one link).
        self.fd = os.open(segment_path(namespace, model, slot, token),
                          os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise ValueError(f"slot {slot}'s segment is not a regular file of its own")
            # The client's semaphores, used only through the kernel: a client that truncates
            # one must not make a SIGBUS here (foreign_sem).
            self.ready = ForeignSemaphore(sem_name(namespace, model, slot, token, "rdy"))
            self.done = ForeignSemaphore(sem_name(namespace, model, slot, token, "don"))
        except BaseException:
            self.close()
            raise

    def try_claim(self, most: float) -> Optional[bool]:
        """Take the request's ``rdy`` token (under the slot's claim lock, which the client's
        withdrawal takes too): True, False when there is none, None when the lock is held.

        A lock held is mostly a race: a peer model process taking this very request, or its
        client withdrawing it, holds it for microseconds. So the first refusal keeps the handle
        out of sweeps and retries for _REFUSED_FIRST only, and each refusal after it, with no
        lock taken between, doubles that up to ``most`` (a client holding its own lock for good
        buys a look per poll interval, not one per ring). A poll interval for every refusal
        made honest clients of a model with two processes wait up to that long whenever a
        forger hid their rows (round 16, docs/RELIABILITY.md)."""
        got = self.ready.take(self.fd)
        if got is None:
            self._refuse_gap = backoff(self._refuse_gap, _REFUSED_FIRST, most)
            self.refused_until = time.monotonic() + self._refuse_gap
        else:
            self._refuse_gap = 0.0
        return got

    def waiting(self) -> bool:
        """Is a request of this slot published and claimed by nobody? (``rdy`` is posted: only
        the slot's owner posts it, whatever anyone wrote into the table.)"""
        return self.ready.has_token()

    def linked(self) -> bool:
        """Does the segment still have its name? It loses it when its client detaches or the
        runtime reaps the slot of a dead client."""
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def read_request(self, limits: Limits, seq_hint: int, now: float) -> Request:
        """Read the request header into private memory and validate every field (raises
        BadRequest with a message for the client)."""
        raw = os.pread(self.fd, REQUEST.itemsize, REQ_OFF)
        if len(raw) != REQUEST.itemsize:
            raise BadRequest("the request header is cut short (the slot's segment was truncated)",
                             seq_hint)
        last = self._last
        if last is not None and raw[_STATIC_B:] == last[0] and raw[:_SEQ_B] == last[1] and \
                raw[_NIN_B:_T_B] == last[2]:
            # Same shapes, dtypes and offsets as the last request validated here: only seq, rows
            # and the publish time are new (the common case: a client sends alike requests).
            seq, rows, t = _SEQ_ROWS_T.unpack_from(raw, _SEQ_B)
            req = last[3]
            # As many rows as that request: its bounds checks hold (self.size only grows until
            # the next full validation, which drops this cache first).
            if rows * last[6] >= _RECHECK_BYTES and not self._memory_holds(rows * last[6]):
                nbytes = None   # its pages may be holes again: the full validation says why
            elif rows == req.rows and limits is last[5]:
                nbytes = req.nbytes
            elif 1 <= rows <= limits.max_batch and rows * last[6] <= self.allocated and \
                    all(off + rows * per_row <= self.size and rows * per_row <= limits.max_request_bytes
                        for off, per_row in zip(req.offsets, last[4])):
                nbytes = tuple(rows * n for n in last[4])
            else:
                nbytes = None
            if nbytes is not None and 0 < seq < 2**62:
                if not (now - limits.max_age <= t <= now):  # NaN fails this too
                    t = now
                return Request(self, seq, rows, req.items, req.dtypes, req.offsets, nbytes,
                               req.out_offset, req.key, t, names=req.names, kind=req.kind)
        req = self._validate(raw, limits, seq_hint, now)
        per_row = tuple(n // req.rows for n in req.nbytes)
        self._last = (raw[_STATIC_B:], raw[:_SEQ_B], raw[_NIN_B:_T_B], req, per_row, limits, sum(per_row))
        return req

    def _memory_holds(self, nbytes: int) -> bool:
        """Does the segment (still) hold ``nbytes`` of memory? A client can turn the pages of a
        request validated before back into holes (truncate and extend): a large request is
        checked again each time, a small one costs little however often it is replayed."""
        try:
            self.allocated = os.fstat(self.fd).st_blocks * 512
        except OSError:
            return False
        return nbytes <= self.allocated

    def _validate(self, raw: bytes, limits: Limits, seq_hint: int, now: float) -> Request:
        self._last = None
        w = _unpack_words(raw)  # plain ints, read once: the client cannot change them under us
        seq = w[_RQ_SEQ]
        if (w[_RQ_MAGIC] & _U64) != MAGIC or w[_RQ_SLOT] != self.slot or (w[_RQ_TOKEN] & _U64) != self.token:
            raise BadRequest("the request header does not belong to this slot (overwritten)", seq_hint)
        if not 0 < seq < 2**62:
            raise BadRequest(f"request sequence number {seq} is out of range", seq_hint)
        rows, n_in, flags = w[_RQ_ROWS], w[_RQ_NIN], w[_RQ_FLAGS]
        if not 1 <= rows <= limits.max_batch:
            raise BadRequest(f"expected 1..{limits.max_batch} rows (max_batch_size), got {rows}", seq)
        if not 1 <= n_in <= MAX_IO:
            raise BadRequest(f"expected 1..{MAX_IO} inputs, got {n_in}", seq)
        names, index = _input_names(flags, n_in, limits.names, seq)
        if names is None and limits.n_inputs is not None and n_in != limits.n_inputs:
            raise BadRequest(f"the model takes {limits.n_inputs} input(s), got {n_in}", seq)
        st = os.fstat(self.fd)
        size = self.size = st.st_size
        self.allocated = st.st_blocks * 512
        out_offset = w[_RQ_OUT]
        if not (DATA_OFFSET <= out_offset <= size and out_offset % 64 == 0):
            raise BadRequest(f"output offset {out_offset} is outside the slot's segment of {size} bytes", seq)
        items, dtypes, offsets, nbytes = [], [], [], []
        for k in range(n_in):
            code, ndim, off = w[_RQ_DTYPE + k], w[_RQ_NDIM + k], w[_RQ_OFFSET + k]
            if not 0 <= code < len(DTYPES):
                raise BadRequest(f"input {k}: unknown dtype code {code}", seq)
            dt = code_dtype(code)
            j = k if index is None else index[k]   # the declared input it is
            if limits.dtypes is not None and j < len(limits.dtypes) and dt != limits.dtypes[j]:
                label = k if names is None else repr(names[k])
                raise BadRequest(f"input {label}: expected {limits.dtypes[j]}, got {dt}", seq)
            if not 0 <= ndim <= MAX_NDIM:
                raise BadRequest(f"input {k}: expected 0..{MAX_NDIM} item dimensions, got {ndim}", seq)
            base = _RQ_DIMS + k * MAX_NDIM
            dims = tuple(w[base:base + ndim])
            if not all(1 <= d <= MAX_DIM for d in dims):
                raise BadRequest(f"input {k}: item shape {dims} has a dimension outside 1..{MAX_DIM}", seq)
            n = rows * math.prod(dims) * dt.itemsize
            if n > limits.max_request_bytes:
                raise BadRequest(f"input {k}: {n} bytes is more than the {limits.max_request_bytes} "
                                 f"a request may carry", seq)
            if not (off >= DATA_OFFSET and off % 64 == 0 and off + n <= size):
                raise BadRequest(f"input {k}: {n} bytes at offset {off} do not fit the slot's segment "
                                 f"of {size} bytes", seq)
            items.append(dims)
            dtypes.append(dt)
            offsets.append(off)
            nbytes.append(n)
        if sum(nbytes) > self.allocated:
            # A file of holes: the client pays nothing, my staging buffer would pay it all.
            raise BadRequest(f"the inputs take {sum(nbytes)} bytes but the slot's segment holds only "
                             f"{self.allocated} bytes of memory (unwritten pages)", seq)
        t = _F64.unpack_from(raw, _RQ_T * 8)[0]
        if not (math.isfinite(t) and now - limits.max_age <= t <= now):
            t = now
        sig = (tuple(dtypes), tuple(items), flags)
        key = _KEYS.get(sig)
        if key is None:
            if len(_KEYS) > 4096:
                _KEYS.clear()
            key = _KEYS[sig] = shape_key([dtype_code(d) for d in dtypes], items, flags)
        return Request(self, seq, rows, tuple(items), tuple(dtypes), tuple(offsets), tuple(nbytes),
                       out_offset, key, t, names=names, kind=sig)

    def respond(self, seq: int, status: int, text: str = "", outputs: Sequence[np.ndarray] = (),
                out_offset: int = 0, structure: int = 0, claimer: int = 0, t_close: float = 0.0,
                batch_rows: int = 0, wake: bool = True, names: bytes = b"") -> None:
        """Write outputs (rows of this request), the response header (with ``names``, the keys of
        a dict / namedtuple answer) and, last, RESP_SEQ; then wake the client (or leave that to
        :meth:`wake`). Never raises for a client's fault: a write that fails (the client's
        segment is gone or /dev/shm is full) turns into an error response or is dropped."""
        if status == ST_OK and not text:
            try:
                self._respond_ok(seq, outputs, out_offset, structure, names, claimer, t_close, batch_rows)
            except (OSError, TypeError, ValueError) as e:
                status, text = ST_BAD_REQUEST, f"could not write the outputs into the client's slot: {e}"
            else:
                if wake:
                    self.wake()
                return
        w = [0] * _RESP_WORDS
        try:
            if status == ST_OK:
                off = end = out_offset
                for j, o in enumerate(outputs):
                    o = np.ascontiguousarray(o)
                    if o.nbytes:
                        os.pwrite(self.fd, o.reshape(-1).view(np.uint8), off)
                    w[_RS_DTYPE + j], w[_RS_NDIM + j], w[_RS_OFFSET + j] = dtype_code(o.dtype), o.ndim, off
                    base = _RS_DIMS + j * (MAX_NDIM + 1)
                    w[base:base + o.ndim] = o.shape
                    end = off + o.nbytes
                    off = align(end, 64)
                w[_RS_NOUT], w[_RS_STRUCT], w[_RS_NEEDED] = len(outputs), structure, end
                if names:
                    os.pwrite(self.fd, names, NAMES_OFF)
                    w[_RS_NAMESLEN] = len(names)
        except (OSError, TypeError, ValueError) as e:
            status, text = ST_BAD_REQUEST, f"could not write the outputs into the client's slot: {e}"
        try:
            if text:
                data = text.encode("utf-8", "replace")[:ERR_BYTES]
                os.pwrite(self.fd, data, ERR_OFF)
                w[_RS_ERRLEN] = len(data)
            w[_RS_STATUS], w[_RS_CLAIMER], w[_RS_ROWS] = status, claimer, batch_rows
            buf = bytearray(_I64S.pack(*w))
            _F64.pack_into(buf, _RS_TCLOSE * 8, t_close)
            _F64.pack_into(buf, _RS_TDONE * 8, time.monotonic())
            os.pwrite(self.fd, buf, RESP_OFF)
            os.pwrite(self.fd, _I64.pack(seq), RESP_SEQ_OFF)  # last
        except (OSError, TypeError, ValueError):
            logger.debug("slot %d: the response could not be written", self.slot, exc_info=True)
        finally:
            if wake:
                self.wake()

    def _respond_ok(self, seq, outputs, out_offset, structure, names, claimer, t_close, batch_rows) -> None:
        """The common answer: outputs, then a response header built once per output signature
        (structure, dtypes, shapes, offsets) and only the words it uses, then RESP_SEQ."""
        fd, off, sig = self.fd, out_offset, [structure, out_offset, names]
        for o in outputs:
            if not o.flags.c_contiguous:
                o = np.ascontiguousarray(o)
            if o.nbytes:
                os.pwrite(fd, o, off)
            sig.append(o.dtype)
            sig.append(o.shape)
            off = align(off + o.nbytes, 64)
        key = tuple(sig)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) > 64:
                self._heads.clear()
            head = self._heads[key] = _response_head(outputs, out_offset, structure, names)
        if head[1] > self.size:
            self.size = head[1]  # the outputs extended the segment
        buf = bytearray(head[0])
        _CLAIMER_ROWS.pack_into(buf, _RS_CLAIMER * 8, claimer, batch_rows)
        _TIMES.pack_into(buf, _RS_TCLOSE * 8, t_close, time.monotonic())
        os.pwrite(fd, buf, RESP_OFF)
        os.pwrite(fd, _I64.pack(seq), RESP_SEQ_OFF)  # last

    def wake(self) -> None:
        if self.done is not None:
            self.done.post()

    def map(self) -> Optional[Tuple[int, int]]:
        """Map the segment (for registration and DMA by the device); (address, size) or None."""
        if self.mapping is None:
            import mmap
            try:
                st = os.fstat(self.fd)
                size = st.st_size
                if st.st_blocks * 512 < size // 2:
                    return None   # mostly holes: page-locking it would allocate them, at my cost
                m = mmap.mmap(self.fd, size)
                address = np.frombuffer(m, np.uint8, count=1).ctypes.data
            except (OSError, ValueError):
                return None
            self.mapping = (m, address, size)
        return self.mapping[1], self.mapping[2]

    def close(self) -> None:
        if self.mapping is not None:
            try:
                self.mapping[0].close()
            except BufferError:
                pass
            self.mapping = None
        for sem in (self.ready, self.done):
            if sem is not None:
                sem.close()
        self.ready = self.done = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _response_head(outputs, out_offset: int, structure: int, names: bytes = b"") -> Tuple[bytes, int]:
    """The RESPONSE words of an OK answer with these outputs, up to the last one a client reads
    -- or all of them and the ``names`` text after them (claimer, rows and times are filled in
    per answer); and the segment size the outputs need."""
    w = [0] * _RESP_WORDS
    off = end = out_offset
    used = _RS_DIMS
    for j, o in enumerate(outputs):
        w[_RS_DTYPE + j], w[_RS_NDIM + j], w[_RS_OFFSET + j] = dtype_code(o.dtype), o.ndim, off
        base = _RS_DIMS + j * (MAX_NDIM + 1)
        w[base:base + o.ndim] = o.shape
        used = base + o.ndim
        end = off + o.nbytes
        off = align(end, 64)
    w[_RS_STATUS], w[_RS_NOUT], w[_RS_STRUCT], w[_RS_NEEDED] = ST_OK, len(outputs), structure, end
    if names:
        w[_RS_NAMESLEN] = len(names)
        return _I64S.pack(*w) + names, end   # NAMES_OFF follows the header
    return _I64S.pack(*w)[:used * 8], end


def write_claim(words: memoryview, slot: int, token: int, seq: int, instance: int, pid: int) -> None:
    """Record who owns a slot's request (the client checks that process's liveness).
    ``words`` is ``claim_words(ctl)``."""
    row = slot * CLAIM_WORDS
    words[row + _CL_PID], words[row + _CL_INST] = pid, instance
    words[row + _CL_TOKEN] = token - 2**64 if token >= 2**63 else token
    words[row + _CL_SEQ] = seq  # last


def mark_answered(words: memoryview, slot: int, seq: int) -> None:
    """After answering: the slot's client may send again as soon as it has read the answer."""
    words[slot * CLAIM_WORDS + _CL_DONE] = seq


def claim_words(ctl: ControlBlock, fmt: str = "q") -> memoryview:
    """The claims table as one flat memoryview of int64 words (``fmt`` "Q": unsigned), slot i's
    at ``i * CLAIM_WORDS``: fields read and written as plain ints, a fraction of a numpy scalar's
    cost. Release it before the control block closes."""
    return words(ctl.claims, fmt)


def table_words(table: SlotTable, fmt: str = "q") -> memoryview:
    """The slot table's hints as one flat memoryview of 8-byte words (``fmt``: "q", "Q" for the
    token, "d" for t_publish), slot i's at ``i * SLOT_WORDS``. Release it before the table closes."""
    return words(table.rows, fmt)


_KEYS: dict = {}   # (dtypes, item shapes) -> shape_key, in a model process
_U64 = 2**64 - 1
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
_RQ_WORDS, _RESP_WORDS = REQUEST.itemsize // 8, RESPONSE.itemsize // 8
_I64S = struct.Struct(f"<{_RESP_WORDS}q")
_RESP_UNPACK = _I64S.unpack_from
_unpack_words = struct.Struct(f"<{_RQ_WORDS}q").unpack
_CLAIMER_ROWS, _TIMES = struct.Struct("<qq"), struct.Struct("<dd")
(_RQ_MAGIC, _RQ_SLOT, _RQ_TOKEN, _RQ_SEQ, _RQ_ROWS, _RQ_NIN, _RQ_FLAGS, _RQ_OUT, _RQ_T, _RQ_DTYPE,
 _RQ_NDIM, _RQ_OFFSET, _RQ_DIMS) = (REQ_WORD[n] for n in REQUEST.names)
_CL_TOKEN, _CL_SEQ, _CL_INST, _CL_PID, _CL_DONE = (CLAIM.fields[n][1] // 8 for n in
                                                   ("token", "seq", "instance", "pid", "done"))
CLAIM_WORDS, SLOT_WORDS = CLAIM.itemsize // 8, SLOT.itemsize // 8
#: word indices of the fields of a CLAIM / SLOT row (claim_words, table_words)
CL_TOKEN, CL_SEQ, CL_DONE = _CL_TOKEN, _CL_SEQ, _CL_DONE
T_SEQ, T_ROWS, T_KEY, T_TOKEN, T_PUBLISH = (SLOT.fields[n][1] // 8 for n in SLOT.names)
(_RS_STATUS, _RS_NOUT, _RS_STRUCT, _RS_NAMESLEN, _RS_ERRLEN, _RS_CLAIMER, _RS_ROWS, _RS_NEEDED,
 _RS_TCLOSE, _RS_TDONE, _RS_DTYPE, _RS_NDIM, _RS_OFFSET, _RS_DIMS) = (RESP_WORD[n] for n in RESPONSE.names)
assert NAMES_OFF == RESP_OFF + 8 * _RESP_WORDS

# Byte ranges of a REQUEST header: what changes per request (seq, rows: words 3-4; t_publish:
# word 8) and what a client normally keeps (everything else, flags included: read_request's
# cache compares all of it).
assert (_RQ_SEQ, _RQ_ROWS, _RQ_NIN, _RQ_FLAGS, _RQ_OUT, _RQ_T, _RQ_DTYPE) == (3, 4, 5, 6, 7, 8, 9)
_SEQ_B, _NIN_B, _T_B, _STATIC_B = 8 * _RQ_SEQ, 8 * _RQ_NIN, 8 * _RQ_T, 8 * _RQ_DTYPE
_SEQ_ROWS_T = struct.Struct(f"<qq{_T_B - _NIN_B}xd")   # seq, rows, (n_in .. out_offset), t_publish
_SEQ_ROWS = struct.Struct("<qq")
# A SLOT row's hints in one write: seq, rows, key, token, t_publish (its state is written after)
assert SLOT.names == ("seq", "rows", "key", "token", "t_publish")
_ROW_HINTS, _ROW_HINTS_B = struct.Struct("<qqqQd"), SLOT.fields["seq"][1]


def _input_names(flags: int, n_in: int, declared: Tuple[str, ...], seq: int):
    """(names, declared indices) of a request's inputs from its ``flags`` (a mask of the model's
    declared input names); (None, None) for positional inputs (flags 0)."""
    if not flags:
        return None, None
    if not declared:
        raise BadRequest(f"unknown request flags {flags:#x}: the model declares no input names "
                         f"(pass inputs positionally)", seq)
    if flags < 0 or flags >> len(declared):
        raise BadRequest(f"request flags {flags:#x}: expected a mask of the model's {len(declared)} "
                         f"input names (bits 0..{len(declared) - 1})", seq)
    index = [j for j in range(len(declared)) if flags >> j & 1]
    if len(index) != n_in:
        raise BadRequest(f"the request names {len(index)} input(s) (flags {flags:#x}) but carries "
                         f"{n_in}", seq)
    return tuple(declared[j] for j in index), index

