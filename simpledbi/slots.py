"""The slot protocol: every transition of a client slot, for the client and the model process alike.
Layouts are in :mod:`simpledbi.layout`.

NOTE [slot protocol]
--------------------
One *slot* = one request in flight at a time: a memfd of the client's, sealed against shrinking,
holding its claim tickets and done word (futex.py), the inputs, and the answer (a ``SharedModel``
lends its slots to calls).
Requests travel as datagrams on the model's socket, which every model process of the model reads::

    client                                        model process (any of model_num)
    ------                                        --------------------------------
    publish: inputs -> slot; PUB_SEQ = seq
             ticket.offer()
             send(datagram: seq, rows, layout) ---> the kernel hands it to exactly one reader,
                                                    with the sender's pid (SO_PASSCRED)
                                                    open /proc/<pid>/fd/<fd> once per slot, check
                                                    it is a sealed memfd with the datagram's token
                                                    claim: ticket.take() (one taker wins) and
                                                           PUB_SEQ == seq, else give it back
                                                    validate the datagram's layout against the
                                                    slot's real size (once per layout)
                                                    read inputs, forward
                                                    respond: outputs, RESPONSE, RESP_SEQ = seq (last)
    wait:    futex wait on done <-----------------         done = seq; futex wake
    read:    RESP_SEQ == seq -> outputs

    withdraw (timeout, close): ticket.take() succeeds -> nobody took the request, nobody will
             (a later datagram finds no ticket). If it fails, a model process owns the request:
             the slot is *stale* and is lent again only after the late answer (RESP_SEQ == seq)
             has arrived, or its claimer died.
    detach:  CLOSED = 1, withdraw, close: the memfd goes with its last descriptor and mapping
             (model processes drop theirs at their next maintenance pass).

Why it cannot cross, lose or wedge:
* Which requests exist and who sent them is the kernel's word (one datagram, one reader, the sender's
  pid); the datagram is the model process's private copy of the request's header.
* The ticket, an atomic word, decides who serves a request: a withdrawal and a claim never both win.
  Each seq has its own (layout.TICKETS): a datagram of a request withdrawn earlier finds its ticket
  taken, or a newer PUB_SEQ, and never holds the current request's, even for an instant.
* A model process answers into the requester's own slot, tagged with the request's seq, written last;
  a late answer can only land in its own stale slot, which is not reused before it arrives.
* Nothing any process maps can shrink (sealed memfds): a client can scribble on its own slot and make
  its own requests fail, never a SIGBUS elsewhere; every offset and size it gives is checked against
  the slot's real size before anything is read or written.
"""
from __future__ import annotations

import array
import contextlib
import math
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import futex
from .layout import (ABANDON_OFF, CLAIM_OFF, CLOSED_OFF, DATA_OFFSET, DONE_OFF, DTYPES, ERR_BYTES, ERR_OFF,
                     INPUT_HEAD, LAYOUT_HEAD, MAGIC, MAX_DIM, MAX_IO, MAX_NDIM, NAMES_BYTES, NAMES_OFF,
                     PUB_SEQ_OFF, REQ_MAGIC, REQ_PREFIX, RESP_OFF, RESP_SEQ_OFF, RESP_WORD, RESPONSE,
                     SEG_MAGIC_OFF, ST_OK, TICKETS, TICKETS_OFF, align, code_dtype, dtype_code, shape_key)
from .shm import Segment, check_sealed, pid_alive

_I64 = struct.Struct("<q")
#: A client's slot is mapped up to this size when first opened, and further only as far as a
#: request reads (Intake): a client can grow its own memfd to terabytes, and mapping all of it
#: took a model process's address space (80 such slots left no room to map a new client's).
#: Most slots are smaller (a batch of 32 ResNet-50 images: 19 MiB), so they are mapped once.
_FIRST_MAP = 64 << 20
_memmove = __import__("ctypes").memmove
_Q2 = struct.Struct("<QQ")
_CLAIM = struct.Struct("<qqq")   # instance, pid, seq
_RESP_WORDS = RESPONSE.itemsize // 8
_I64S = struct.Struct(f"<{_RESP_WORDS}q")
_CLAIMER_ROWS, _TIMES = struct.Struct("<qq"), struct.Struct("<dd")
(_RS_STATUS, _RS_NOUT, _RS_STRUCT, _RS_NAMESLEN, _RS_ERRLEN, _RS_CLAIMER, _RS_ROWS, _RS_NEEDED,
 _RS_TCLOSE, _RS_TDONE, _RS_DTYPE, _RS_NDIM, _RS_OFFSET, _RS_DIMS) = (RESP_WORD[n] for n in RESPONSE.names)
assert NAMES_OFF == RESP_OFF + 8 * _RESP_WORDS


def _dumpable() -> bool:
    """Can processes of this user open this process's descriptors through /proc? (Not when it made
    itself non-dumpable, e.g. a setuid program: then each request carries its slot's descriptor.)"""
    try:
        import ctypes
        return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 1   # PR_GET_DUMPABLE
    except (OSError, AttributeError):
        return True


# ================================================================ client side
class ClientSlot:
    """The client's half of one slot. Used by one call at a time (SharedModel lends it)."""

    def __init__(self, sock: socket.socket, max_shapes: Sequence[Tuple[int, ...]],
                 dtypes: Sequence[np.dtype], send_fd: bool = False):
        self.sock = sock
        self.pid = os.getpid()
        self.token = secrets.randbits(64) | 1
        self.seq = 0
        self.sent_seq = 0  # the last request whose datagram the kernel took (tests wait on it)
        self.stale_seq = 0          # a timed-out request a model process still owes an answer to
        # the current call's timeout, start and priority (for its datagram and its errors)
        self.call_timeout, self.call_start, self.priority = None, 0.0, 0
        self.published = self.woken = 0.0   # when the current request was published, its caller woken
        self.withdrawn = 0          # the last seq taken back before any model process took it
        self.interrupted = False    # close() from another thread while a call waits here
        self.cancel = None          # the current call's forward_async cancellation (client._Cancel)
        self._lock = threading.Lock()   # wake() from another thread vs. detach()
        self._inputs, size = [], DATA_OFFSET   # (dtype, offset in the slot) per input
        for s, dt in zip(max_shapes, dtypes):
            self._inputs.append((dt, size))
            size += align(int(np.prod(s)) * dt.itemsize, 64)
        self.out_offset = size
        self.seg = Segment.create_memfd("sdbi-slot", size + 4096, grow=True)
        self._map_views()
        _Q2.pack_into(self.seg.buf, SEG_MAGIC_OFF, MAGIC, self.token)
        for k in range(TICKETS):
            futex.ticket_init(self._base + TICKETS_OFF + 4 * k)
        self._waiter = futex.Waiter()
        self._codes = [dtype_code(dt) for dt in dtypes]
        # calls ended here, unsent: refused (deadline, queue), withdrawn -- the next datagram reports them
        self.refused = [0, 0, 0]
        self._reported = 0      # ... and those the current request's datagram reports (layout: REQ_PREFIX)
        self._layouts: Dict[tuple, bytes] = {}   # (names, positions, item shapes) -> layout bytes
        self._anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.seg.fd]).tobytes())] \
            if send_fd else None

    def _map_views(self) -> None:
        seg = self.seg
        self._u8 = seg.ndarray(0, np.uint8, (seg.size,))
        self._base = self._u8.ctypes.data
        self._resp_seq = seg.ndarray(RESP_SEQ_OFF, np.int64, (1,))
        self._in_views, self._out_views = {}, {}
        self._done = self._base + DONE_OFF

    def _drop_views(self) -> None:
        self._u8 = self._resp_seq = None
        self._in_views, self._out_views = {}, {}

    # ------------------------------------------------------------ publish
    def publish(self, arrays: Sequence[np.ndarray], names: int = 0,
                positions: Optional[Tuple[int, ...]] = None, deadline: float = 0.0,
                priority: int = 0, send: bool = True) -> int:
        """Write the request into the slot and (``send``) send its datagram; returns its seq.
        Inputs are positional (``names`` 0), or the declared inputs whose bits ``names`` sets, in
        ascending order, each in the slot's region ``positions[k]``."""
        positions = positions or tuple(range(len(arrays)))
        for x, p in zip(arrays, positions):
            view = self._in_views.get((p, x.shape))
            if view is None:
                if len(self._in_views) > 256:  # many distinct shapes: keep the cache bounded
                    self._in_views.clear()
                dt, off = self._inputs[p]
                view = self._in_views[(p, x.shape)] = self.seg.ndarray(off, dt, x.shape)
            np.copyto(view, x)
        items = tuple(x.shape[1:] for x in arrays)
        key = self.request_key = (names, positions, items)   # (the client's ModelError names the items)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 256:
                self._layouts.clear()
            parts = [LAYOUT_HEAD.pack(self.out_offset, names, len(positions))]
            for p, item in zip(positions, items):
                parts += [INPUT_HEAD.pack(self._codes[p], len(item), self._inputs[p][1]),
                          struct.pack(f"<{len(item)}q", *item)]
            layout = self._layouts[key] = b"".join(parts)
        self.seq += 1
        seq, r, refused = self.seq, self.refused, 0
        self.published = time.monotonic()
        if r[0] or r[1] or r[2]:   # 16 bits each, as many as fit (layout: REQ_PREFIX); the rest next time
            d, q, w = min(r[0], 0xFFFF), min(r[1], 0xFFFF), min(r[2], 0xFFFF)
            r[0], r[1], r[2] = r[0] - d, r[1] - q, r[2] - w
            refused = d | q << 16 | w << 32
        self._reported = refused
        _I64.pack_into(self.seg.buf, PUB_SEQ_OFF, seq)
        futex.offer(self._ticket)
        self._msg = REQ_PREFIX.pack(REQ_MAGIC, self.seg.fd, self.token, seq, arrays[0].shape[0],
                                    self.published, deadline, priority, refused) + layout
        if send:
            self.send(self._msg)
        return seq

    def send(self, msg: bytes, block: bool = False) -> None:
        """One datagram to the model's socket. BlockingIOError when its queue is full -- at once,
        or (``block``) after the socket's send timeout (a kernel wait)."""
        flags = 0 if block else socket.MSG_DONTWAIT
        if self._anc is None:
            self.sock.send(msg, flags)
        else:
            self.sock.sendmsg([msg], self._anc, flags)
        self.sent_seq = self.seq

    def unsent(self, withdrawn: bool = False) -> None:
        """The current request's datagram was never sent: the counts it was to report go with the
        next one (``withdrawn``: its call ended, cancelled, closed or timed out -- counted too)."""
        self.refused = [a + b for a, b in zip(self.refused, reported_by(self._reported, withdrawn))]
        self._reported = 0

    def resend(self) -> None:
        """Send the current request's datagram again (its refusal count already reported)."""
        msg = bytearray(self._msg)
        _REFUSED.pack_into(msg, _REFUSED_B, 0)
        self.send(bytes(msg))

    def answered(self, seq: int) -> bool:
        return int(self._resp_seq[0]) == seq

    def wait(self, seq: int, timeout: float) -> bool:
        """Sleep on the done word up to ``timeout``; True once the response to ``seq`` is written."""
        address, seen = self.done_word()
        if self.arrived(seq):
            return True
        if not (self.interrupted or self.cancel is not None and self.cancel.cancelled):
            self._waiter.wait(address, seen, timeout)   # (a close or cancel after the look wakes it)
        return self.arrived(seq)

    def done_word(self) -> Tuple[int, int]:
        """(address, value) of the done word, read *before* looking for an answer: a sleep while
        it holds that value cannot miss the answer's wake-up."""
        return self._done, futex.load(self._done)

    def arrived(self, seq: int) -> bool:
        """Has the response to ``seq`` been written? (Then its caller is counted woken now.)"""
        if int(self._resp_seq[0]) != seq:
            return False
        self.woken = time.monotonic()
        return True

    def claimed_by(self, seq: int) -> Optional[Tuple[int, int]]:
        """(instance, pid) of the model process that took request ``seq``, if it says so."""
        instance, pid, claimed = _CLAIM.unpack_from(self.seg.buf, CLAIM_OFF)
        return (instance, pid) if claimed == seq else None

    @property
    def _ticket(self) -> int:
        """The address of the current request's claim ticket."""
        return self._base + TICKETS_OFF + 4 * (self.seq % TICKETS)

    def queued(self) -> bool:
        """Is the request's ticket still offered (published, taken by nobody)?"""
        return self.seg is not None and futex.offered(self._ticket)

    def settled(self) -> bool:
        """A stale slot may be lent again: its late answer arrived, or its claimer is dead."""
        if self.answered(self.stale_seq):
            return True
        claim = self.claimed_by(self.stale_seq)
        return claim is not None and not pid_alive(claim[1])

    def wake(self) -> None:
        """Wake a thread sleeping in :meth:`wait` (close() from another thread); a no-op once
        detached: its call has ended."""
        with self._lock:
            if self.seg is not None:
                futex.store_and_wake(self._done, futex.load(self._done) + 1)

    def abandon(self, seq: int) -> None:
        """The call of request ``seq`` stopped waiting after a model process took it: the slot
        stays stale until its late answer arrives, and the model process, told in the slot,
        drops the request at its batch's close if it has not run yet."""
        self.stale_seq = seq
        with self._lock:
            if self.seg is not None:
                _I64.pack_into(self.seg.buf, ABANDON_OFF, seq)

    def withdraw(self) -> bool:
        """Take back a request no model process has taken; False if one owns it."""
        if self.seg is not None and futex.take(self._ticket):
            self.withdrawn = self.seq
            return True
        return self.withdrawn == self.seq

    # ------------------------------------------------------------ read
    def response(self) -> Tuple[int, str, int]:
        """(status, error text, structure) of the response just written; reads its header once."""
        w = self._rw = _I64S.unpack_from(self.seg.buf, RESP_OFF)
        status, text = w[_RS_STATUS], ""
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
        if w[_RS_NEEDED] > self.seg.size:  # the model process extended the slot (large outputs)
            with self._lock:   # not while wake() (close, from another thread) stores into the done word
                self._drop_views()
                try:
                    self.seg.map_at_least(w[_RS_NEEDED])
                except (OSError, ValueError, OverflowError) as e:   # a header scribbled on
                    raise ValueError(f"the response needs {w[_RS_NEEDED]} bytes of the slot: {e}") from None
                finally:
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

    def timing_tuple(self) -> tuple:
        """Where the request just read spent its time (time.monotonic seconds): published, batch
        closed, answer written, caller woken, and the rows of its batch."""
        t_close, t_done = _TIMES.unpack_from(self.seg.buf, RESP_OFF + _RS_TCLOSE * 8)   # adjacent words
        return self.published, t_close, t_done, self.woken, self._rw[_RS_ROWS]

    # ------------------------------------------------------------ detach
    def detach(self) -> None:
        """Give the slot up: mark it closed (model processes drop their mappings), take back a
        request nobody took, close. Only its creator process does this."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            seg, self.seg = self.seg, None
        if seg is None:
            return
        with contextlib.suppress(ValueError):
            _I64.pack_into(seg.buf, CLOSED_OFF, 1)
            futex.take(self._ticket)
        self._drop_views()
        seg.close()


_REFUSED_B, _REFUSED = REQ_PREFIX.size - 8, struct.Struct("<q")   # the last field of REQ_PREFIX


def reported_by(refused: int, withdrawn: bool = False) -> List[int]:
    """[deadline, queue, withdrawn]: the counts a request datagram's ``refused`` field reports (layout:
    REQ_PREFIX), plus its own call's withdrawal -- to report again when the datagram is never sent."""
    return [refused & 0xFFFF, refused >> 16 & 0xFFFF, (refused >> 32 & 0xFFFF) + withdrawn]


def unsent_datagram(msg: bytes) -> List[int]:
    """What a datagram given up and never sent was to report, and its call, withdrawn."""
    return reported_by(_REFUSED.unpack_from(msg, _REFUSED_B)[0], True)


# ================================================================ model-process side
class BadRequest(Exception):
    """A request that failed validation; answered with the message."""


@dataclass
class Limits:
    """What a model process accepts; everything else from a client is rejected."""

    max_batch: int
    n_inputs: Optional[int] = None                # known when the model declares its inputs
    dtypes: Optional[Tuple[np.dtype, ...]] = None
    names: Tuple[str, ...] = ()                   # the input names requests may use (flags bits)
    max_age: float = 3600.0                       # publish times older than this are clamped
    max_request_bytes: int = 2**31                # per input


@dataclass(frozen=True)
class Layout:
    """A request layout, validated: what requests alike share (NOTE [slot protocol])."""

    out_offset: int
    items: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[np.dtype, ...]
    offsets: Tuple[int, ...]
    end_per_row: Tuple[Tuple[int, int], ...]   # (offset, bytes per row): input k ends at off + rows * b
    names: Optional[Tuple[str, ...]]
    key: int
    kind: tuple


@dataclass(slots=True)
class Request:
    """A request taken by this process: its datagram's fields, checked, and its client's slot."""

    peer: "Peer"
    seq: int
    rows: int
    layout: Layout
    nbytes: Tuple[int, ...]
    t_publish: float
    deadline: float = 0.0
    priority: int = 0                             # higher runs first (NOTE [overload])
    turn: int = 0                                 # its client's rows ahead of it (overload.Backlog)
    answered: bool = False
    t_seen: float = 0.0                           # when this process received it
    layout_raw: bytes = b""                       # its datagram's layout bytes (a hand-back)
    held: int = -1                                # its HELD row in the control block

    pid = property(attrgetter("peer.pid"))   # its client (the kernel's word): the unit of fair turns


class Peer:
    """A model process's mapping of one client slot: opened once through
    ``/proc/<pid>/fd/<fd>`` (or the descriptor the datagram carried), checked to be a memfd
    sealed against shrinking whose token is the datagram's."""

    __slots__ = ("pid", "token", "fd_no", "passed", "seg", "file_size", "base", "u8", "inflight",
                 "answered_at", "answered_seq", "registered", "on_remap", "_heads", "warned", "__weakref__")

    def __init__(self, pid: int, fd_no: int, token: int, fd: Optional[int] = None):
        self.pid, self.fd_no, self.token = pid, fd_no, token
        self.passed = fd is not None   # the client sent its descriptor (it is not dumpable)
        if fd is None:
            fd = os.open(f"/proc/{pid}/fd/{fd_no}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            size = check_sealed(fd, f"the slot of process {pid}")
            if size < DATA_OFFSET:
                raise OSError(f"the slot of process {pid} is {size} bytes: too small")
            self.seg = Segment(fd, min(size, _FIRST_MAP), f"/proc/{pid}/fd/{fd_no}")
        except BaseException:
            os.close(fd)
            raise
        self.file_size = size    # (a model process grows it for large outputs: grow)
        self.u8 = self.seg.ndarray(0, np.uint8, (self.seg.size,))
        self.base = self.u8.ctypes.data
        magic, tok = _Q2.unpack_from(self.seg.buf, SEG_MAGIC_OFF)
        if magic != MAGIC or tok != token:
            self.close()
            raise OSError(f"the slot of process {pid} does not carry its datagram's token")
        self.inflight = 0        # requests taken through this peer and not answered yet
        self.answered_at, self.answered_seq = 0.0, -1   # when this process last answered it, and what
        self.registered = 0      # address registered for DMA (engine), 0 if not
        self.on_remap = None     # called before the mapping moves (grow): unregister it
        self._heads: dict = {}   # response header prefixes by output signature
        self.warned = False

    size = property(attrgetter("seg.size"))

    def answered(self, seq: int) -> bool:
        return _I64.unpack_from(self.seg.buf, RESP_SEQ_OFF)[0] == seq

    def closed(self) -> bool:
        """Has the client detached (or scribbled that it did)?"""
        return _I64.unpack_from(self.seg.buf, CLOSED_OFF)[0] != 0

    def abandoned(self, seq: int) -> bool:
        """Did the caller of request ``seq`` stop waiting for it (ClientSlot.abandon)?"""
        return _I64.unpack_from(self.seg.buf, ABANDON_OFF)[0] == seq

    def claim(self, seq: int, instance: int, pid: int) -> bool:
        """Take request ``seq``'s ticket (its own: layout.TICKETS). A datagram of an older
        request (withdrawn; its client has published a newer one since) takes nothing."""
        buf = self.seg.buf
        if _I64.unpack_from(buf, PUB_SEQ_OFF)[0] != seq:
            return False
        ticket = self.base + TICKETS_OFF + 4 * (seq % TICKETS)
        if not futex.take(ticket):
            return False
        if _I64.unpack_from(buf, PUB_SEQ_OFF)[0] != seq:   # republished 64 times meanwhile
            futex.offer(ticket)
            return False
        _CLAIM.pack_into(buf, CLAIM_OFF, instance, pid, seq)
        return True

    def unclaim(self, seq: int) -> None:
        """Offer request ``seq`` again (a hand-back: another model process will take it, or its
        client take it back). The claim record stays until someone else writes theirs."""
        futex.offer(self.base + TICKETS_OFF + 4 * (seq % TICKETS))

    def take_ticket(self, seq: int) -> None:
        """Take request ``seq``'s ticket if it is offered (answering it for a dead claimer)."""
        futex.take(self.base + TICKETS_OFF + 4 * (seq % TICKETS))

    def grow(self, size: int) -> None:
        """Extend the client's slot for outputs larger than it (it is sealed against shrinking) and
        map ``size`` bytes of it: what the answer needs, not the file's size (its client may have
        grown it to a petabyte). If that cannot be mapped, the old mapping stays and this raises."""
        if size > os.fstat(self.seg.fd).st_size:
            os.ftruncate(self.seg.fd, size)
            self.file_size = size
        if self.registered:
            self.on_remap(self)   # the DMA registration of the old mapping goes first (set with it)
        self.u8 = None            # (a view would keep the old mapping exported)
        try:
            self.seg.map_at_least(size)
        finally:
            self.u8 = self.seg.ndarray(0, np.uint8, (self.seg.size,))
            self.base = self.u8.ctypes.data

    def answer(self, seq: int, srcs, sig: tuple, out_offset: int, structure: int, names: bytes,
               claimer: int, t_close: float, t_done: float, batch_rows: int) -> None:
        """An answer with outputs: this request's rows of each (``srcs``: address and bytes per output, one
        memmove each), the response header (_response_head, made once per ``sig``, structure and ``names``),
        RESP_SEQ last; the caller wakes the client. Raises OSError, TypeError or ValueError for a bad slot."""
        key = (structure, out_offset, names, sig)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) > 64:
                self._heads.clear()
            head = self._heads[key] = _response_head(sig, out_offset, structure, names)
        if head[1] > self.seg.size:
            self.grow(head[1])   # the outputs need more room than the client made
        dst = self.base
        for off, (src, n) in zip(head[2], srcs):
            if n:
                _memmove(dst + off, src, n)   # inside the slot: head[1] <= its size
        buf = self.seg.buf
        buf[RESP_OFF:RESP_OFF + len(head[0])] = head[0]
        _CLAIMER_ROWS.pack_into(buf, RESP_OFF + _RS_CLAIMER * 8, claimer, batch_rows)
        _TIMES.pack_into(buf, RESP_OFF + _RS_TCLOSE * 8, t_close, t_done)
        _I64.pack_into(buf, RESP_SEQ_OFF, seq)  # last

    def respond(self, seq: int, status: int, text: str, claimer: int = 0, t_close: float = 0.0,
                batch_rows: int = 0, wake: bool = True) -> None:
        """An answer without outputs (``status``, not ST_OK, and its ``text``): the response header,
        RESP_SEQ last, then wake the client (unless ``wake`` is False). Never raises for a client's fault."""
        try:
            w = [0] * _RESP_WORDS
            data = text.encode("utf-8", "replace")[:ERR_BYTES]
            self.u8[ERR_OFF:ERR_OFF + len(data)] = np.frombuffer(data, np.uint8)
            w[_RS_ERRLEN], w[_RS_STATUS], w[_RS_CLAIMER], w[_RS_ROWS] = len(data), status, claimer, batch_rows
            buf = bytearray(_I64S.pack(*w))
            _TIMES.pack_into(buf, _RS_TCLOSE * 8, t_close, time.monotonic())
            self.seg.buf[RESP_OFF:RESP_OFF + len(buf)] = buf
            _I64.pack_into(self.seg.buf, RESP_SEQ_OFF, seq)  # last
        except (OSError, TypeError, ValueError):
            pass
        finally:
            if wake:
                self.wake(seq)

    def wake(self, seq: int) -> None:
        futex.store_and_wake(self.base + DONE_OFF, seq)

    def close(self) -> None:
        self.u8 = None
        self.seg.close()


def _response_head(sig, out_offset: int, structure: int, names: bytes = b"") -> Tuple[bytes, int, tuple]:
    """The RESPONSE words of an OK answer with outputs of signature ``sig`` (dtype, shape per output), up to
    the last one a client reads -- or all of them and the ``names`` text after them (claimer, rows and times
    are filled in per answer); the slot size the outputs need; and each output's offset."""
    w = [0] * _RESP_WORDS
    off = end = out_offset
    used, offsets = _RS_DIMS, []
    for j in range(len(sig) // 2):
        dtype, shape = sig[2 * j], sig[2 * j + 1]
        w[_RS_DTYPE + j], w[_RS_NDIM + j], w[_RS_OFFSET + j] = dtype_code(dtype), len(shape), off
        base = _RS_DIMS + j * (MAX_NDIM + 1)
        w[base:base + len(shape)] = shape
        used = base + len(shape)
        offsets.append(off)
        end = off + math.prod(shape) * dtype.itemsize
        off = align(end, 64)
    w[_RS_STATUS], w[_RS_NOUT], w[_RS_STRUCT], w[_RS_NEEDED] = ST_OK, len(sig) // 2, structure, end
    if names:
        w[_RS_NAMESLEN] = len(names)
        return _I64S.pack(*w) + names, end, tuple(offsets)   # NAMES_OFF follows the header
    return _I64S.pack(*w)[:max(used, _RS_TDONE + 1) * 8], end, tuple(offsets)


def parse_layout(raw: bytes, limits: Limits) -> Layout:
    """Validate a datagram's layout part (everything but the slot's size, checked per request)."""
    if len(raw) < LAYOUT_HEAD.size:
        raise BadRequest("the request datagram is cut short")
    out_offset, flags, n_in = LAYOUT_HEAD.unpack_from(raw, 0)
    if not 1 <= n_in <= MAX_IO:
        raise BadRequest(f"expected 1..{MAX_IO} inputs, got {n_in}")
    names, index = _input_names(flags, n_in, limits.names)
    if names is None and limits.n_inputs is not None and n_in != limits.n_inputs:
        raise BadRequest(f"the model takes {limits.n_inputs} input(s), got {n_in}")
    if not (out_offset >= DATA_OFFSET and out_offset % 64 == 0):
        raise BadRequest(f"output offset {out_offset} is outside the slot's data")
    pos = LAYOUT_HEAD.size
    inputs = []
    for k in range(n_in):
        if len(raw) < pos + INPUT_HEAD.size:
            raise BadRequest("the request datagram is cut short")
        code, ndim, off = INPUT_HEAD.unpack_from(raw, pos)
        pos += INPUT_HEAD.size
        if not 0 <= code < len(DTYPES):
            raise BadRequest(f"input {k}: unknown dtype code {code}")
        dt = code_dtype(code)
        j = k if index is None else index[k]   # the declared input it is
        if limits.dtypes is not None and j < len(limits.dtypes) and dt != limits.dtypes[j]:
            label = k if names is None else repr(names[k])
            raise BadRequest(f"input {label}: expected {limits.dtypes[j]}, got {dt}")
        if not 0 <= ndim <= MAX_NDIM or len(raw) < pos + 8 * ndim:
            raise BadRequest(f"input {k}: expected 0..{MAX_NDIM} item dimensions, got {ndim}")
        dims = struct.unpack_from(f"<{ndim}q", raw, pos)
        pos += 8 * ndim
        if not all(1 <= d <= MAX_DIM for d in dims):
            raise BadRequest(f"input {k}: item shape {dims} has a dimension outside 1..{MAX_DIM}")
        b = math.prod(dims) * dt.itemsize
        if b > limits.max_request_bytes or not (off >= DATA_OFFSET and off % 64 == 0):
            raise BadRequest(f"input {k}: {b} bytes a row at offset {off} do not fit a slot")
        inputs.append((dims, dt, off, b))
    if pos != len(raw):
        raise BadRequest(f"the request datagram has {len(raw) - pos} bytes too many")
    items, dtypes, offsets, per_row = zip(*inputs)   # tuples
    key = shape_key([dtype_code(d) for d in dtypes], items, flags)
    return Layout(out_offset, items, dtypes, offsets, tuple(zip(offsets, per_row)), names, key,
                  (dtypes, items, flags))


def check_size(layout: Layout, rows: int, size: int, limits: Limits) -> Tuple[int, ...]:
    """The bytes of each input of a request of ``rows`` rows, after checking they lie inside a
    slot of ``size`` bytes (raises BadRequest)."""
    if not 1 <= rows <= limits.max_batch:
        raise BadRequest(f"expected 1..{limits.max_batch} rows (max_batch_size), got {rows}")
    out = []
    for k, (off, b) in enumerate(layout.end_per_row):
        n = rows * b
        if off + n > size or n > limits.max_request_bytes:
            raise BadRequest(f"input {k}: {n} bytes at offset {off} do not fit the slot of {size} bytes")
        out.append(n)
    if layout.out_offset > size:
        raise BadRequest(f"output offset {layout.out_offset} is outside the slot of {size} bytes")
    return tuple(out)


def _input_names(flags: int, n_in: int, declared: Tuple[str, ...]):
    """(names, declared indices) of a request's inputs from its ``flags`` (a mask of the model's
    declared input names); (None, None) for positional inputs (flags 0)."""
    if not flags:
        return None, None
    if not declared:
        raise BadRequest(f"unknown request flags {flags:#x}: the model declares no input names "
                         f"(pass inputs positionally)")
    if flags < 0 or flags >> len(declared):
        raise BadRequest(f"request flags {flags:#x}: expected a mask of the model's {len(declared)} "
                         f"input names (bits 0..{len(declared) - 1})")
    index = [j for j in range(len(declared)) if flags >> j & 1]
    if len(index) != n_in:
        raise BadRequest(f"the request names {len(index)} input(s) (flags {flags:#x}) but carries {n_in}")
    return tuple(declared[j] for j in index), index
