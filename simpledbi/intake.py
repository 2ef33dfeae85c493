"""Taking requests in, in a model process: the model's socket, the client slots it maps, and the checks
between a datagram and a :class:`~simpledbi.slots.Request` (NOTE [slot protocol]: the kernel says who sent a
datagram and hands it to one process; all it says besides is checked against the sender's slot)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import select
import socket
import struct
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .layout import (CLAIM_OFF, FWD_MAGIC, FWD_PREFIX, HELD, INSTANCE, MAX_DATAGRAM, MAX_PRIORITY,
                     PUB_SEQ_OFF, REQ_MAGIC, REQ_PREFIX, ST_BAD_REQUEST, ST_FULL, WAKE_MAGIC, ControlBlock,
                     words)
from .shm import pid_alive
from .slots import BadRequest, Layout, Limits, Peer, Request, check_size, parse_layout, reported_by

logger = logging.getLogger(__name__)

_CREDS = struct.Struct("iII")     # struct ucred: pid, uid, gid
_ANC = socket.CMSG_SPACE(_CREDS.size) + socket.CMSG_SPACE(4)
_MAX_LAYOUTS = 4096               # validated layouts kept (a few per client and shape)
_HELD_PID, _HELD_WORDS = HELD.fields["pid"][1] // 8, HELD.itemsize // 8
_INST_PID, _INST_HELD, _INST_CLIENTS = (INSTANCE.fields[n][1] // 8 for n in ("pid", "held", "clients"))
_INST_WORDS = INSTANCE.itemsize // 8
WAKE = object()                   # what next() returns for the runtime's wake-up datagram
#: Precise waits shorter than this use select(), whose timer is precise, not the socket's receive timeout,
#: which the kernel rounds up to scheduler ticks (1-4 ms, and one more: measured 8 ms for any timeout under
#: 4 ms on a 250 Hz kernel). Other waits keep the receive timeout: a receiver blocked in recvmsg is woken
#: alone (select() wakes every process waiting in it): an idle process's wait. The batch loop's waits are
#: precise (a run with select() everywhere, the idle wait too, served 24% less, among other changes).
_PRECISE_BELOW = 0.02
#: Requests at least this large are checked to lie over memory the client wrote: a slot of
#: unwritten pages costs its client nothing, staging its "inputs" would cost this process their
#: full size. Halved, more requests pay an fstat; doubled, a liar's request costs more to stage.
_HOLES_CHECKED = 1 << 20
#: Descriptors kept free below the process's limit when it sizes its client slots (a mapped slot
#: holds one): what it opens once serving -- a refused newcomer's slot, a passed descriptor and its
#: dup, what the model's code or CUDA opens lazily (more than that: _out_of_descriptors).
_FD_RESERVE = 32


class Intake:
    """One model process's (``tag``) end of the model's socket and its mappings of client slots. Calls
    ``count`` (accounting's counters), ``on_new_peer`` and ``on_drop`` (before a peer's slot is unmapped)."""

    def __init__(self, sock: socket.socket, ctl: ControlBlock, row: int, limits: Limits,
                 max_clients: int, tag: str, count: Callable[..., None], on_new_peer: Callable[[Peer], None],
                 on_drop: Callable[[Peer], None]):
        self.sock = sock
        self.address = sock.getsockname()   # the model's socket: where hand-backs go
        self._readable = [sock]
        self._selectable = sock.fileno() < 1024      # select()'s FD_SETSIZE
        sock.setblocking(True)
        self.row, self.limits = row, limits
        self.max_clients, self.supervisor_pid = max_clients, int(ctl.hdr["supervisor_pid"])
        self.full_hint = "raise ModelConfig.max_clients"   # what a refused newcomer can do
        self._spare = _reserve_descriptor()   # freed to answer a newcomer when out of them
        self.pid, self.uid = os.getpid(), os.getuid()
        self.peers: Dict[Tuple[int, int], Peer] = {}     # (pid, token) -> the slot mapped
        # A pidfd per client process with a slot mapped: the kernel says when it exits (a zombie too)
        self._pidfds: Dict[int, int] = {}                # pid -> its pidfd
        self._pid_of: Dict[int, int] = {}                # pidfd -> pid
        self._slots_of: Dict[int, int] = {}              # pid -> its slots mapped
        self._exits = select.poll()                      # the pidfds, readable once their process exited
        self._layouts: Dict[bytes, Layout] = {}
        self._rcvtimeo = -1.0
        self._held = words(ctl.held[row])                # my HELD rows, as int64 words
        self._free: List[int] = list(range(ctl.held.shape[1] - 1, -1, -1))
        self._inst = words(ctl.all_instances[row:row + 1])
        self._all_inst = words(ctl.all_instances)   # every instance row, both banks
        self.tag, self.count, self.on_new_peer, self.on_drop = tag, count, on_new_peer, on_drop

    # ------------------------------------------------------------ receiving
    @property
    def full(self) -> bool:
        """Holding as many requests as the control block has rows for: take no more for now."""
        return not self._free

    @property
    def held(self) -> int:
        return len(self._held) // _HELD_WORDS - len(self._free)

    def next(self, timeout: float, precise: bool = False):
        """The next request for me: a Request, WAKE (the runtime wants me to look at the model's state), or
        None when nothing came within ``timeout`` seconds (0: only what is queued). Datagrams that carry
        no request for me (withdrawn, malformed: answered) are consumed. ``precise``: a short timeout is
        kept to the microsecond (_PRECISE_BELOW), for the waits that refusals depend on."""
        precise = precise and self._selectable
        deadline = time.monotonic() + timeout
        while True:
            try:
                if timeout <= 0:
                    data, anc, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, _ANC, socket.MSG_DONTWAIT)
                elif precise and timeout < _PRECISE_BELOW:   # (only a busy process waits so)
                    if not select.select(self._readable, (), (), timeout)[0]:
                        return None
                    data, anc, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, _ANC, socket.MSG_DONTWAIT)
                else:   # a kernel timeout on the blocking receive (_PRECISE_BELOW: why not select())
                    seconds = max(timeout, 1e-6)
                    if abs(seconds - self._rcvtimeo) > 2e-6:
                        sec = int(seconds)
                        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                             struct.pack("ll", sec, int((seconds - sec) * 1e6)))
                        self._rcvtimeo = seconds
                    data, anc, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, _ANC)
            except BlockingIOError:
                if timeout <= 0 or timeout >= _PRECISE_BELOW or not precise:
                    return None
                data = None   # another process took it first: wait on, until the deadline
            except InterruptedError:
                return None
            got = self._request(data, anc) if data is not None else None
            if got is not None:
                return got
            if timeout > 0:
                timeout = deadline - time.monotonic()
                if timeout <= 1e-6:
                    return None

    def _request(self, data: bytes, anc):
        if len(anc) == 1 and len(anc[0][2]) >= _CREDS.size:   # the common case: credentials only
            pid, uid, _ = _CREDS.unpack_from(anc[0][2])
            return self._checked(data, pid, uid, None)
        pid, uid, fd = _creds(anc)
        try:
            return self._checked(data, pid, uid, fd)
        finally:
            if fd is not None:
                os.close(fd)

    def _checked(self, data: bytes, pid: int, uid: int, fd: Optional[int]):
        if len(data) < REQ_PREFIX.size or uid != self.uid or pid <= 0:
            return None   # not from a process of ours: nothing to answer into
        magic, fd_no, token, seq, rows, t_pub, deadline, priority, refused = REQ_PREFIX.unpack_from(data)
        if magic != REQ_MAGIC:
            if magic == FWD_MAGIC and self._sibling(pid) and len(data) >= FWD_PREFIX.size + REQ_PREFIX.size:
                client = FWD_PREFIX.unpack_from(data)[2]
                inner = data[FWD_PREFIX.size:]
                if client > 0 and REQ_PREFIX.unpack_from(inner)[0] == REQ_MAGIC:
                    return self._checked(inner, client, uid, fd)
                return None
            return WAKE if magic == WAKE_MAGIC and pid == self.supervisor_pid else None
        peer = self.peers.get((pid, token)) or self._open(pid, fd_no, token, fd)   # (a Peer is always true)
        if peer is None:
            return None
        if refused > 0:   # calls its client refused itself since (NOTE [overload]): counted here
            for name, n in zip(("shed_deadline", "shed_queue", "withdrawn"), reported_by(refused)):
                self.count(name, n)
        if not peer.claim(seq, self.row, self.pid):
            self.count("withdrawn")   # taken back before I got to it (or a datagram sent again)
            return None
        now = time.monotonic()
        try:
            raw = data[REQ_PREFIX.size:]
            layout = self._layouts.get(raw)
            if layout is None:
                layout = parse_layout(raw, self.limits)
                if len(self._layouts) >= _MAX_LAYOUTS:
                    self._layouts.clear()
                self._layouts[raw] = layout
            nbytes = check_size(layout, rows, peer.file_size, self.limits)
            total = sum(nbytes)
            if total >= _HOLES_CHECKED and (held := os.fstat(peer.seg.fd).st_blocks * 512) < total:
                raise BadRequest(f"the inputs take {total} bytes but the slot holds only {held} bytes "
                                 f"of memory (unwritten pages)")
            if peer.size < peer.file_size:   # mapped in part (slots._FIRST_MAP): map what it reads
                end = max(off + n for (off, _), n in zip(layout.end_per_row, nbytes))
                if end > peer.size:
                    try:
                        peer.grow(end)   # (within the file: nothing is truncated)
                    except (OSError, ValueError, OverflowError) as e:
                        raise BadRequest(f"the slot's first {end} bytes cannot be mapped: {e}") from None
        except BadRequest as e:
            self.count("bad_requests")
            if not peer.warned:   # once per slot
                peer.warned = True
                logger.warning("%s rejected a request of process %d: %s", self.tag, pid, e)
            peer.respond(seq, ST_BAD_REQUEST, str(e), claimer=self.row)
            return None
        if not (now - self.limits.max_age <= t_pub <= now):   # NaN fails this too
            t_pub = now
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            priority = MAX_PRIORITY if priority > 0 else -MAX_PRIORITY   # scribbled: the client checks it
        if deadline != deadline:
            deadline = 0.0   # NaN: no deadline (the client sends monotonic seconds or 0)
        # My HELD row says whose request I hold (should I die, the supervisor answers its caller at
        # once): pid last, the row's "in use" mark.
        i = self._free.pop()
        w, base = self._held, i * _HELD_WORDS
        w[base], w[base + 1] = fd_no, token - 2**64 if token >= 2**63 else token
        w[base + 2], w[base + _HELD_PID] = seq, pid
        peer.inflight += 1
        self._inst[_INST_HELD] = self.held
        return Request(peer, seq, rows, layout, nbytes, t_pub, deadline, priority, t_seen=now,
                       layout_raw=raw, held=i)

    def _open(self, pid: int, fd_no: int, token: int, fd: Optional[int]) -> Optional[Peer]:
        if len(self.peers) >= self.max_clients:
            self._make_room()
        try:
            try:
                peer = Peer(pid, fd_no, token, os.dup(fd) if fd is not None else None)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE) or self._spare < 0:
                    raise
                self._out_of_descriptors(e)
                peer = Peer(pid, fd_no, token, os.dup(fd) if fd is not None else None)
        except (OSError, ValueError) as e:   # (its client closed it, or died: nobody waits)
            logger.debug("%s cannot open the slot of a request of process %d: %s", self.tag, pid, e)
            if getattr(e, "errno", None) not in (errno.EMFILE, errno.ENFILE):
                # its caller gave up and closed the slot before any process got to it (a handle keeps
                # few idle slots): withdrawn, as one taken back (uncounted: helper-52)
                self.count("withdrawn")
            return None
        try:
            if len(self.peers) >= self.max_clients:
                seq = struct.unpack_from("<q", peer.seg.buf, PUB_SEQ_OFF)[0]
                if peer.claim(seq, self.row, self.pid):
                    peer.respond(seq, ST_FULL, f"all {self.max_clients} client slots of this model are in "
                                 f"use ({self.full_hint})", claimer=self.row)
                peer.close()
                return None
            self.peers[(pid, token)] = peer
            self._watch(pid)
            self._inst[_INST_CLIENTS] = len(self.peers)
            self.on_new_peer(peer)
            return peer
        finally:
            if self._spare < 0:
                self._spare = _reserve_descriptor()

    def fit_to_descriptors(self) -> None:
        """Map at most as many client slots as the descriptor limit leaves room for (each holds one, and
        its process's pidfd another when it is the process's only slot; model_process_main raised the
        soft limit to the hard one): past that the process makes room
        as at ``max_clients`` (an idle slot goes, else the newcomer is refused) instead of failing to
        open the newcomer's slot, which dropped its request unanswered."""
        with contextlib.suppress(OSError, ValueError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft == resource.RLIM_INFINITY:
                return
            allowed = max(1, (soft - len(os.listdir("/proc/self/fd")) - _FD_RESERVE) // 2)
            if allowed < self.max_clients:
                logger.warning("%s max_clients is %d, but its descriptor limit (%d) leaves room for %d "
                               "client slots: it maps no more (raise the hard limit, `ulimit -Hn`)",
                               self.tag, self.max_clients, soft, allowed)
                self.max_clients = allowed
                self.full_hint = f"this process's descriptor limit ({soft}) allows no more"

    def _out_of_descriptors(self, e: OSError) -> None:
        """Out of descriptors though the process sized its slots to its limit at start (the model's
        code opened more since): it maps no more slots than now -- an idle one makes room, as at
        ``max_clients`` -- and this newcomer's is opened on the reserve descriptor, so that it is
        answered at least (it was dropped, its caller waiting out its timeout, forever without one)."""
        if self.max_clients > len(self.peers):
            logger.warning("%s out of descriptors (%s) with %d client slots mapped: it maps no more (raise "
                           "the hard limit, `ulimit -Hn`, or open fewer files in the model)",
                           self.tag, e.strerror, len(self.peers))
            self.max_clients = max(1, len(self.peers))
            self.full_hint = "this process ran out of descriptors"
        self._make_room()
        os.close(self._spare)
        self._spare = -1

    def _make_room(self) -> None:
        """At max_clients, unmap a slot with no request held here: one its client closed, else the one
        answered longest ago (its client may use it again: it is mapped again then). So only slots with
        a request here count: the idle slots a handle keeps (client._IDLE_KEPT) never take a newcomer's
        place (they did: a handle's 16 idle ones and those closed since the last prune left a second
        handle's calls SlotsExhausted)."""
        idle = [(not peer.closed(), peer.answered_at, key) for key, peer in self.peers.items()
                if not peer.inflight]
        if idle:
            self._drop(min(idle)[2])

    def _watch(self, pid: int) -> None:
        """A slot of process ``pid`` is mapped: open its pidfd with its first one. Without one (out of
        descriptors, or it exited meanwhile) prune asks the kernel by pid, as before pidfds."""
        self._slots_of[pid] = self._slots_of.get(pid, 0) + 1
        if pid not in self._pidfds:
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(pid)
                self._pidfds[pid], self._pid_of[fd] = fd, pid
                self._exits.register(fd, select.POLLIN)

    def _drop(self, key: Tuple[int, int]) -> None:
        """Unmap a slot (none of its requests held); its process's pidfd goes with its last slot."""
        peer = self.peers.pop(key)
        self.on_drop(peer)
        peer.close()
        pid = peer.pid
        self._slots_of[pid] -= 1
        if not self._slots_of[pid]:
            del self._slots_of[pid]
            fd = self._pidfds.pop(pid, None)
            if fd is not None:
                self._exits.unregister(fd)
                del self._pid_of[fd]
                os.close(fd)

    def _sibling(self, pid: int) -> bool:
        """Is ``pid`` a model process of this model (either bank, in any state: one that died after handing
        a request back was one when it sent it; me too: my own hand-back can come back to me)?"""
        return pid == self.pid or pid in self._all_inst[_INST_PID::_INST_WORDS]

    def hand_back(self, req: Request) -> bool:
        """Give a request I took but will not start soon back to the model's socket, for an idle peer (or,
        should its client withdraw first, for nobody). False if the socket's queue is full: I keep it. Its
        HELD row goes only once the datagram is sent: should I die in between, the supervisor answers it."""
        peer = req.peer
        msg = FWD_PREFIX.pack(FWD_MAGIC, 0, peer.pid) + REQ_PREFIX.pack(
            REQ_MAGIC, peer.fd_no, peer.token, req.seq, req.rows, req.t_publish, req.deadline,
            req.priority, 0) + req.layout_raw
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", peer.seg.fd))] if peer.passed else []
        peer.unclaim(req.seq)
        try:
            self.sock.sendmsg([msg], anc, socket.MSG_DONTWAIT, self.address)
        except OSError:
            if peer.claim(req.seq, self.row, self.pid):
                return False   # kept
            # its client took it back meanwhile: nothing to run, nobody to answer
        self.release(req)
        return True

    def release(self, req: Request) -> None:
        """The request is answered (or dropped): free its HELD row."""
        if req.held >= 0:
            self._held[req.held * _HELD_WORDS + _HELD_PID] = 0
            self._free.append(req.held)
            req.held = -1
            req.peer.inflight -= 1
            self._inst[_INST_HELD] = self.held

    # ------------------------------------------------------------ upkeep
    def may_send(self) -> int:
        """How many clients could send a request now: the slots I know, less the requests every
        process of the model holds (an estimate: a batching hint, never a correctness input)."""
        return max(len(self.peers) - sum(self._all_inst[_INST_HELD::_INST_WORDS]), 0)

    def prune(self) -> None:
        """Drop the mappings of slots whose client detached or exited (none with a request held). Which
        processes exited, killed and not reaped (zombies) too, one poll() of their pidfds says: asking by
        pid took a kill() each and a /proc read to tell a zombie, 2-3 ms for 128 clients, which under
        load was done only a few at a time (helper-51: a killed client's slots kept for as long as the
        load lasted) -- and a pid, unlike a pidfd, can be another process's by then."""
        exited = {self._pid_of[fd] for fd, _ in self._exits.poll(0)} if self._pid_of else ()
        for key, peer in list(self.peers.items()):
            if peer.inflight:
                continue
            pid = peer.pid
            try:
                gone = peer.closed() or pid in exited or pid not in self._pidfds and not pid_alive(pid)
            except ValueError:
                gone = True
            if gone:
                self._drop(key)
        self._inst[_INST_CLIENTS] = len(self.peers)

    def close(self) -> None:
        for key in list(self.peers):
            self._drop(key)
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
        for view in (self._held, self._inst, self._all_inst):
            view.release()


def _reserve_descriptor() -> int:
    """A descriptor held in reserve (Intake._out_of_descriptors), or -1 if none can be had."""
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


# ---------------------------------------------------------------- the runtime's side
def wake_datagram() -> bytes:
    """What the runtime sends to wake one model process (WAKE_MAGIC: honoured only from its pid)."""
    return REQ_PREFIX.pack(WAKE_MAGIC, -1, 0, 0, 0, 0.0, 0.0, 0, 0)


def answer_queued(sock: socket.socket, status: int, text: str, most: int = 100000,
                  counters: Optional[np.ndarray] = None) -> int:
    """Answer every request still queued on a model's socket with ``status`` (the runtime, when
    no model process will take them: stopping, or the model is broken); returns how many.
    ``counters``: a row of the control block whose ``died`` counts each, before its caller wakes."""
    peers: Dict[Tuple[int, int], Peer] = {}
    n = 0
    try:
        for _ in range(most):
            try:
                data, anc, _, _ = sock.recvmsg(MAX_DATAGRAM + 1, _ANC, socket.MSG_DONTWAIT)
            except OSError:   # nothing queued (BlockingIOError), or the socket is closed
                break
            pid, uid, fd = _creds(anc)
            try:
                if len(data) < REQ_PREFIX.size or pid <= 0 or uid != os.getuid():
                    continue
                if FWD_PREFIX.unpack_from(data)[0] == FWD_MAGIC and len(data) >= FWD_PREFIX.size + REQ_PREFIX.size:
                    # handed back by a model process (Intake.hand_back): its client is inside
                    pid, data = FWD_PREFIX.unpack_from(data)[2], data[FWD_PREFIX.size:]
                magic, fd_no, token, seq, *_ = REQ_PREFIX.unpack_from(data)
                if magic != REQ_MAGIC or pid <= 0:
                    continue
                peer = peers.get((pid, token))
                if peer is None:
                    try:
                        peer = peers[(pid, token)] = Peer(pid, fd_no, token, os.dup(fd) if fd is not None else None)
                    except (OSError, ValueError):
                        continue
                if peer.claim(seq, -1, os.getpid()):
                    if counters is not None:
                        counters["died"] += 1
                    peer.respond(seq, status, text, claimer=-1)
                    n += 1
            finally:
                if fd is not None:
                    os.close(fd)
    finally:
        for peer in peers.values():
            peer.close()
    return n


def answer_held(ctl: ControlBlock, row: int, pid: int, status: int, text: str) -> int:
    """Answer what a dead model process (``pid``, row ``row``) held, from its HELD rows; returns how many,
    counted in its row's ``died`` (before each caller wakes: stats() then includes its own call)."""
    n = 0
    for fd_no, token, seq, client in ctl.held[row].tolist():   # (a copy: HELD's fields, in order)
        if client <= 0:
            continue
        try:
            peer = Peer(client, fd_no, token)
        except (OSError, ValueError):
            continue   # its client is gone too
        try:
            claim = struct.unpack_from("<qqq", peer.seg.buf, CLAIM_OFF)
            if claim[1] == pid and claim[2] == seq and not peer.answered(seq):
                peer.take_ticket(seq)   # offered again if it died handing it back
                ctl.counters[row]["died"] += 1   # (the dead process's row: it writes no more)
                peer.respond(seq, status, text, claimer=row)
                n += 1
        finally:
            peer.close()
    ctl.held[row]["pid"] = 0
    return n


def _creds(anc) -> Tuple[int, int, Optional[int]]:
    """(pid, uid, descriptor or None) from a datagram's ancillary data."""
    pid, uid, fd = -1, -1, None
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET:
            if kind == socket.SCM_CREDENTIALS and len(blob) >= _CREDS.size:
                pid, uid, _ = _CREDS.unpack_from(blob)
            elif kind == socket.SCM_RIGHTS:
                fds = np.frombuffer(blob[:len(blob) - len(blob) % 4], np.int32).tolist()
                fd = fds[0] if fds else None
                for extra in fds[1:]:
                    os.close(extra)
    return pid, uid, fd
