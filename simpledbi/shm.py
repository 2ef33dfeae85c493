"""Where a run's shared objects live, and how they are created, mapped and removed (README, Architecture).

Every run owns a *namespace* ``sdbi_<owner pid>_<128 random bits>``: a directory ``/dev/shm/<namespace>/``
of mode 0700 (other users can neither list, open, create nor squat anything in it) that holds only names:
``<m>.sock``, the ``<m>.ctl`` link, ``simpledbi serve``'s command socket. Shared memory is a *memfd*
sealed against shrinking: the kernel refuses to truncate it, to anyone, so a mapping of it can never
SIGBUS. Others reach one through ``/proc/<owner pid>/fd/<n>`` (only the same user may). Nothing is
unlinked: a memfd goes with its last descriptor and mapping. (Why not ``multiprocessing.shared_memory``:
README, Architecture; CPython #82300/#104291.)"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAMESPACE_RE = re.compile(r"sdbi_(\d+)_[0-9a-f]+\Z")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def new_namespace() -> str:
    """Create a fresh namespace owned by this process (its private directory, mode 0700)."""
    for _ in range(8):
        ns = f"sdbi_{os.getpid()}_{secrets.token_hex(16)}"
        try:
            os.mkdir(os.path.join(SHM_DIR, ns), 0o700)
        except FileExistsError:
            continue
        return ns
    raise OSError(errno.EEXIST, "could not create a fresh namespace directory in " + SHM_DIR)


def ns_path(namespace: str, name: str) -> str:
    return os.path.join(SHM_DIR, namespace, name)


class Segment:
    """One mapped, sealed memfd: made (:meth:`create_memfd`) or opened (:meth:`attach`, :meth:`from_fd`:
    only a memfd sealed against shrinking), ``readonly`` for clients' control blocks. Views made with
    :meth:`ndarray` keep the mapping exported: drop them before closing."""

    def __init__(self, fd: int, size: int, path: str = "", readonly: bool = False):
        self.fd: Optional[int] = fd
        self.size = int(size)
        self.path = path
        self._access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
        self._mmap: Optional[mmap.mmap] = mmap.mmap(fd, self.size, access=self._access)

    @classmethod
    def create_memfd(cls, name: str, size: int, link: Optional[str] = None,
                     grow: bool = False) -> "Segment":
        """A fresh memfd of ``size`` bytes, sealed against shrinking (and against growing unless
        ``grow``: a client slot grows when outputs outgrow it)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS if grow else SEALS | fcntl.F_SEAL_GROW)
            seg = cls(fd, size, link or f"memfd:{name}")
            if link is not None:
                os.symlink(f"/proc/{os.getpid()}/fd/{fd}", link)
        except BaseException:
            os.close(fd)
            raise
        return seg

    @classmethod
    def attach(cls, path: str, readonly: bool = True) -> "Segment":
        """Map all of the memfd at ``path`` (a symlink to a /proc fd path)."""
        fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NONBLOCK)
        return cls.from_fd(fd, path, readonly)

    @classmethod
    def from_fd(cls, fd: int, path: str, readonly: bool = True) -> "Segment":
        """Map the memfd open at ``fd`` (this segment owns the descriptor from now on)."""
        try:
            return cls(fd, check_sealed(fd, path), path, readonly)
        except BaseException:
            os.close(fd)
            raise

    @property
    def buf(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.path} is closed")
        return self._mmap

    def ndarray(self, offset: int, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    def map_at_least(self, size: int) -> None:
        """Map ``size`` bytes of the memfd (at least as many as now), the new mapping made before the
        old one goes (a failure leaves the old one in place). Views made before must be dropped."""
        if size <= self.size:
            return
        new = mmap.mmap(self.fd, size, access=self._access)
        old, self._mmap, self.size = self._mmap, new, size
        with contextlib.suppress(BufferError):  # a view of the old mapping lives: so does it, until dropped
            old.close()

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:   # a view is alive: the mapping goes when it does
                logger.debug("segment %s still has views; leaving the mapping to the GC", self.path)
            self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class InheritedFd:
    """A descriptor handed to a child process at its start: under ``spawn`` multiprocessing duplicates
    it into the child, which gets a number of its own (:func:`inherited_fd`); a forked child has it."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _rebuild_fd, (reduction.DupFd(self.fd),)


def _rebuild_fd(dup) -> int:
    return dup.detach()


def inherited_fd(obj) -> int:
    """The descriptor an :class:`InheritedFd` became in this (child) process."""
    return os.dup(obj.fd) if isinstance(obj, InheritedFd) else obj


def check_sealed(fd: int, what: str) -> int:
    """The size of the memfd open at ``fd`` -- after checking that it is one and that nobody can
    shrink it (else OSError): a mapping of it can then never SIGBUS."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & fcntl.F_SEAL_SHRINK == 0:
        raise OSError(errno.EINVAL, f"{what} is not a sealed simpledbi memfd")
    size = os.fstat(fd).st_size
    if size <= 0:
        raise OSError(errno.EINVAL, f"{what} is empty")
    return size


def remove_tree(path: str, budget: float = 5.0) -> None:
    """Remove ``path`` and, if a directory, all in it. Never raises, never follows a symlink (``path``'s
    own directory included: a client that swaps the namespace directory for a link must not make the
    runtime delete elsewhere), never recurses (a client can nest directories deeper than the recursion
    limit, where ``shutil.rmtree`` raises, or than PATH_MAX): a non-empty subdirectory's subdirectories
    move up into the top one, so at most two are open and the work is linear in the entries. One that
    keeps growing is given up on after ``budget`` seconds (logged)."""
    parent, base = os.path.split(path)
    try:
        pfd = os.open(parent, _O_DIR)
    except OSError as e:
        logger.debug("not removing %s: %s", path, e)
        return
    try:
        try:
            os.unlink(base, dir_fd=pfd)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.EPERM):   # EISDIR, EPERM: a directory
                raise
        top = os.open(base, _O_DIR, dir_fd=pfd)
        try:
            _empty(top, path, time.monotonic() + budget)
        finally:
            os.close(top)
        os.rmdir(base, dir_fd=pfd)
    except OSError as e:
        logger.debug("could not remove %s: %s", path, e)
    finally:
        os.close(pfd)


def _empty(top: int, path: str, deadline: float) -> None:
    """:func:`remove_tree`'s work: remove what is in the directory open at ``top``."""
    moved, progress = 0, True
    while progress:
        if time.monotonic() > deadline:
            logger.warning("gave up removing %s: entries keep appearing", path)
            return
        progress = False
        for name, is_dir in _entries(top, deadline):
            try:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                else:
                    try:
                        os.rmdir(name, dir_fd=top)
                    except OSError as e:
                        if e.errno != errno.ENOTEMPTY:
                            raise
                        sub = os.open(name, _O_DIR, dir_fd=top)
                        try:
                            for n2, d2 in _entries(sub, deadline):
                                if time.monotonic() > deadline:
                                    break
                                if d2:
                                    moved += 1
                                    os.rename(n2, f".rm{moved}_{secrets.token_hex(4)}", src_dir_fd=sub,
                                              dst_dir_fd=top)
                                else:
                                    os.unlink(n2, dir_fd=sub)
                                progress = True
                        finally:
                            os.close(sub)
                        os.rmdir(name, dir_fd=top)
                progress = True
            except FileNotFoundError:
                progress = True
            except OSError as e:
                logger.debug("could not remove %s/%s: %s", path, name, e)
            if time.monotonic() > deadline:
                break


def _entries(fd: int, deadline: float) -> list:
    """(name, is a directory) of what is in the directory open at ``fd``; of one that keeps
    growing, no more than the time budget lists."""
    out = []
    with os.scandir(fd) as entries:
        for e in entries:
            out.append((e.name, e.is_dir(follow_symlinks=False)))
            if len(out) % 4096 == 0 and time.monotonic() > deadline:
                break
    return out


def sweep_namespace(namespace: str) -> int:
    path = os.path.join(SHM_DIR, namespace)
    if not os.path.lexists(path):
        return 0
    remove_tree(path)
    return 1


def pid_exists(pid: int) -> bool:
    """True while process ``pid`` exists, a zombie too: one system call (pid_alive reads /proc
    besides, some 15 us more)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:   # another user's
        return True
    return True


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (a killed child nobody reaped yet)."""
    if not pid_exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def sweep_dead_namespaces() -> int:
    """Remove what runs whose owner process no longer exists left in /dev/shm."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return 0
    removed = 0
    for ns in entries:
        m = NAMESPACE_RE.match(ns)
        if not m or pid_alive(int(m.group(1))):
            continue
        try:   # what a dead run's clients left there must not stop a new run from starting
            removed += sweep_namespace(ns)
        except Exception:  # noqa: BLE001
            logger.warning("could not remove the leftovers of %s", ns, exc_info=True)
    return removed
