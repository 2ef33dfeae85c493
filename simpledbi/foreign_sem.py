"""A client's semaphores, used by the model processes and the supervisor without touching their
memory from user space.

A client creates its slot's ``rdy`` and ``don`` semaphores: files in /dev/shm that glibc maps.
If the client truncates one, any user-space access to the mapping is a SIGBUS -- in the process
that touches it (a model process, the supervisor), not in the client. So those processes only go
through the kernel, which answers EFAULT instead:

* post: ``FUTEX_WAKE_OP`` adds 1 to the value atomically and wakes one sleeper (what sem_post
  does in user space);
* has a token (value > 0): ``FUTEX_CMP_REQUEUE`` against 0, which compares and moves nobody
  (no descriptor is kept per semaphore: a model process holds one per attached slot already);
* take (trywait): under an open-file-description lock on the slot's segment, if it has a token,
  set the value to 0 with ``FUTEX_WAKE_OP``. The client's own trywait (a
  withdrawal, ``slots.ClientSlot.withdraw``) takes the same lock, so nothing comes between the
  read and the set; only the slot's owner posts ``rdy``, and a post in between is a second
  token its owner cannot have meant (one request at a time), so taking both is right.

glibc's semaphore on 64-bit Linux is one 64-bit word: the value in its low 32 bits (also the
futex word sleepers wait on), the number of sleepers in the high 32. ``supported()`` checks that
layout once per process against posix_ipc; where it does not hold, these handles fall back to
posix_ipc's user-space operations (and a truncated semaphore is a crash again).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import platform
import stat
import struct
import sys
import threading
from typing import Optional

import posix_ipc

logger = logging.getLogger(__name__)

SEM_BYTES = 32                 # sizeof(sem_t) on 64-bit glibc
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_CMP_REQUEUE, _FUTEX_WAKE_OP = 4, 5
_OP_SET, _OP_ADD, _CMP_EQ = 0, 1, 0
_PROT_RW, _MAP_SHARED = 0x1 | 0x2, 0x01
# struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks); byte 0 of the segment
_LOCK_BYTE = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK_BYTE = struct.pack("hhxxxxqqixxxx", fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def _op(op: int, oparg: int) -> int:
    return ((op & 0xF) << 28) | ((_CMP_EQ & 0xF) << 24) | ((oparg & 0xFFF) << 12)


_POST, _CLEAR = _op(_OP_ADD, 1), _op(_OP_SET, 0)

_libc = None
_supported: Optional[bool] = None
_support_lock = threading.Lock()


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        # futex(uaddr, op, val, val2 (in the timeout's place), uaddr2, val3): declared once, so a
        # call converts plain ints without building ctypes objects (a post per request)
        libc.syscall.restype = ctypes.c_long
        libc.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


def _wake_op(addr: int, wake: int, op: int) -> bool:
    """FUTEX_WAKE_OP on one word: ``op`` on it atomically, then wake up to ``wake`` sleepers.
    False when the kernel cannot reach the page (the file was truncated under the mapping)."""
    return _libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAKE_OP, wake, None, addr, op) >= 0


def _has_token(addr: int) -> bool:
    """Is the value at ``addr`` non-zero? FUTEX_CMP_REQUEUE fails with EAGAIN when the word is
    not the expected 0 (and with EFAULT on a truncated file: no token then)."""
    if _libc.syscall(_SYS_FUTEX, addr, _FUTEX_CMP_REQUEUE, 0, None, addr, 0) >= 0:
        return False
    return ctypes.get_errno() == errno.EAGAIN


def lock_segment(fd: int) -> bool:
    """Take the slot's claim lock (one byte of its segment, an open-file-description lock):
    False at once if another holder has it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _LOCK_BYTE)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock_segment(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _UNLOCK_BYTE)
    except OSError:
        pass


def sem_path(name: str, shm_dir: str = "/dev/shm") -> str:
    """The file glibc keeps semaphore ``name`` ("/x") in."""
    return os.path.join(shm_dir, "sem." + name[1:])


class ForeignSemaphore:
    """Semaphore ``name``, created by another process that may truncate it at any time."""

    def __init__(self, name: str):
        self.name = name
        self._addr = 0
        self._sem = None            # posix_ipc fallback
        if not supported():
            self._sem = posix_ipc.Semaphore(name)
            return
        fd = os.open(sem_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < SEM_BYTES:
                raise ValueError(f"semaphore {name} is not a semaphore file")
            addr = _libc.mmap(None, SEM_BYTES, _PROT_RW, _MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of semaphore {name} failed")
        finally:
            os.close(fd)   # the mapping keeps the file
        self._addr = addr

    def post(self) -> bool:
        """sem_post; False if the semaphore's file was truncated (its owner broke it)."""
        if self._sem is not None:
            self._sem.release()
            return True
        return bool(self._addr) and _wake_op(self._addr, 1, _POST)

    def has_token(self) -> bool:
        """Is the value positive (a post nobody took)?"""
        if self._sem is not None:
            return self._sem.value > 0
        return bool(self._addr) and _has_token(self._addr)

    def take(self, lock_fd: int) -> Optional[bool]:
        """trywait, arbitrated by the claim lock on ``lock_fd`` (the slot's segment): True when
        the token was taken, False when there was none, None when another holder has the lock
        (a peer claiming it, its client withdrawing it -- or its client holding it for good)."""
        if self._sem is not None:   # user space: still under the claim lock, like a withdrawal
            if not lock_segment(lock_fd):
                return None
            try:
                self._sem.acquire(0)
                return True
            except posix_ipc.BusyError:
                return False
            finally:
                unlock_segment(lock_fd)
        if not self._addr:
            return False
        if not lock_segment(lock_fd):
            return None
        try:
            return _has_token(self._addr) and _wake_op(self._addr, 0, _CLEAR)
        finally:
            unlock_segment(lock_fd)

    def close(self) -> None:
        if self._sem is not None:
            self._sem.close()
            self._sem = None
        if self._addr:
            _libc.munmap(ctypes.c_void_p(self._addr), SEM_BYTES)
            self._addr = 0


def supported() -> bool:
    """Does this platform's semaphore have the layout the kernel-side operations assume? Checked
    once per process on a private semaphore, against posix_ipc. Thread-safe, and never answers
    before the check is done: a model process's slot-finder thread and its serving thread both
    open handles, and one that got a transient False used user-space operations while the other
    used the kernel's -- two ways of taking a token that do not exclude each other, so two
    processes took one request (round 18's soak)."""
    global _supported
    if _supported is None:
        with _support_lock:
            if _supported is None:
                ok = False
                if _SYS_FUTEX is not None and sys.byteorder == "little" and sys.maxsize > 2**32:
                    try:
                        ok = _self_check()
                    except Exception:  # noqa: BLE001
                        logger.debug("kernel-side semaphore check failed", exc_info=True)
                if not ok:
                    logger.warning("semaphores of clients are used from user space on this platform: "
                                   "a client that truncates its own semaphore can crash a model process")
                _supported = ok
    return _supported


def _self_check() -> bool:
    _load_libc()
    # named like a namespace's semaphore: if this process dies right here, the next runtime
    # start removes it with the rest of what dead processes left (shm.sweep_dead_namespaces)
    name = f"/sdbi_{os.getpid()}_{os.urandom(8).hex()}.semcheck"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    fd = addr = None
    try:
        fd = os.open(sem_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        if os.fstat(fd).st_size < SEM_BYTES:
            return False
        addr = _libc.mmap(None, SEM_BYTES, _PROT_RW, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return False
        if _has_token(addr) or not (_wake_op(addr, 1, _POST) and sem.value == 1 and _has_token(addr)):
            return False
        if not (_wake_op(addr, 0, _CLEAR) and sem.value == 0 and not _has_token(addr)):
            return False
        _wake_op(addr, 1, _POST)
        sem.acquire(0)            # glibc takes what the kernel posted
        return sem.value == 0
    finally:
        if addr not in (None, 0, ctypes.c_void_p(-1).value):
            _libc.munmap(ctypes.c_void_p(addr), SEM_BYTES)
        if fd is not None:
            os.close(fd)
        try:
            sem.unlink()
        finally:
            sem.close()
