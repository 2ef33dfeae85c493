"""The two synchronisation words of a client slot, in shared memory a client can scribble on
(NOTE [slot protocol] in slots.py): nothing here may crash or hang a process other than the
scribbler, whatever the words hold. Words are 4 bytes at 4-aligned offsets of a sealed memfd's
mapping (it outlives every call on it); posix_ipc has no futexes, so these go through ctypes.

* The **ticket** (a request's claim token) is a glibc spinlock word used only through
  ``pthread_spin_trylock`` (one atomic compare-and-swap: of a client taking its request back and
  any number of model processes, exactly one wins) and ``pthread_spin_unlock`` (one atomic store:
  offer the request): neither reads anything but the word nor enters the kernel, and garbage is
  "not offered". (glibc's ``sem_post`` passes a field a client can overwrite into the futex call's
  operation, and aborts the process on the error that follows.)
* The **done** word: a model process stores the answered request's seq and wakes sleepers with a
  ``FUTEX_WAKE`` whose operation is ours, not read from memory; a client sleeps with
  ``FUTEX_WAIT_BITSET`` on the value it last saw, with a monotonic deadline. A store between its
  look and its sleep makes the sleep return at once: no wake-up is lost."""
from __future__ import annotations

import ctypes
import errno
import math
import platform
import time

_libc = ctypes.CDLL(None, use_errno=True)        # blocking calls: the GIL is released
_pylibc = ctypes.PyDLL(None, use_errno=True)     # quick calls: no GIL release and re-acquire

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine(), 202)
_FUTEX_WAKE, _FUTEX_WAIT_BITSET = 1, 9           # shared futexes: no FUTEX_PRIVATE_FLAG
_MATCH_ANY, _INT_MAX = 0xFFFFFFFF, 2**31 - 1     # FUTEX_WAIT_BITSET's bitset; FUTEX_WAKE: wake them all


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _fn(lib, name, restype, *args):
    f = getattr(lib, name)
    f.argtypes, f.restype = list(args), restype
    return f


_spin_init = _fn(_libc, "pthread_spin_init", ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_spin_trylock = _fn(_pylibc, "pthread_spin_trylock", ctypes.c_int, ctypes.c_void_p)
_spin_unlock = _fn(_pylibc, "pthread_spin_unlock", ctypes.c_int, ctypes.c_void_p)
_FUTEX_ARGS = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_uint)
_syscall = _fn(_libc, "syscall", ctypes.c_long, *_FUTEX_ARGS)
_syscall_quick = _fn(_pylibc, "syscall", ctypes.c_long, *_FUTEX_ARGS)

_word = ctypes.c_int(-7)
_spin_init(ctypes.addressof(_word), 1)
OFFERED = _word.value   # what an unlocked spinlock word holds on this platform (1 on x86-64, 0 elsewhere)


# ---------------------------------------------------------------- the ticket
def ticket_init(address: int) -> None:
    """A new slot's ticket, taken (no request offered). The slot's creator, once."""
    if _spin_init(address, 1) != 0:   # PTHREAD_PROCESS_SHARED
        raise OSError(ctypes.get_errno(), "pthread_spin_init failed")
    _spin_trylock(address)


def offer(address: int) -> None:
    """Offer the request: its client publishing it, or a model process putting it back."""
    _spin_unlock(address)


def take(address: int) -> bool:
    """Take the request if it is offered (True); False if it is not (taken, or garbage)."""
    return _spin_trylock(address) == 0


def offered(address: int) -> bool:
    return ctypes.c_int.from_address(address).value == OFFERED


# ---------------------------------------------------------------- the done word
def store_and_wake(address: int, value: int) -> None:
    """Store ``value`` (its low 32 bits) into the done word, then wake whoever sleeps on it."""
    ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF
    _syscall_quick(_SYS_FUTEX, address, _FUTEX_WAKE, _INT_MAX, None, None, 0)


def load(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


class Waiter:
    """Sleeps on a done word; one per waiting thread at a time (it owns a timespec)."""

    __slots__ = ("_ts", "_ref")

    def __init__(self):
        self._ts = _Timespec()
        self._ref = ctypes.byref(self._ts)

    def wait(self, address: int, seen: int, timeout: float) -> None:
        """Sleep while the word holds ``seen``, at most ``timeout`` seconds (a signal, or a
        change before the sleep, ends it sooner; the caller looks at what changed)."""
        if timeout <= 0:
            return
        deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout
        frac, whole = math.modf(deadline)
        self._ts.tv_sec, self._ts.tv_nsec = int(whole), int(frac * 1e9)
        if _syscall(_SYS_FUTEX, address, _FUTEX_WAIT_BITSET, seen - (1 << 32) if seen >= 1 << 31 else seen,
                    self._ref, None, _MATCH_ANY) != 0:
            err = ctypes.get_errno()
            if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
                raise OSError(err, "futex wait failed")


# ---------------------------------------------------------------- many done words at once
class WaitV(ctypes.Structure):
    """One word of a futex_waitv call (struct futex_waitv): sleep while ``*uaddr == val``."""
    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]


WAITV_MAX = 128                  # the kernel's limit of words per futex_waitv call
WAITV_U32 = 2                    # FUTEX2_SIZE_U32, shared (no FUTEX2_PRIVATE): the slots' done words
_SYS_FUTEX_WAITV = 449           # the same number on every architecture (Linux 5.16)
_waitv = _libc["syscall"]        # (a function object of its own: _syscall's argument types stay)
_waitv.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                   ctypes.c_int]
_waitv.restype = ctypes.c_long


def wait_any(words, n: int) -> int:
    """Sleep until one of the first ``n`` of ``words`` (a WaitV array) is woken; its index, or -1
    when one already holds another value than its ``val`` (or a signal or fault ended the sleep:
    the caller looks at every word). The GIL is released."""
    return max(_waitv(_SYS_FUTEX_WAITV, words, n, 0, None, time.CLOCK_MONOTONIC), -1)


def waitv_supported() -> bool:
    """Does this kernel have futex_waitv (Linux 5.16+, and not filtered out by a seccomp profile)?
    A call with no words is refused with EINVAL where it exists."""
    return _waitv(_SYS_FUTEX_WAITV, None, 0, 0, None, time.CLOCK_MONOTONIC) == -1 \
        and ctypes.get_errno() == errno.EINVAL
