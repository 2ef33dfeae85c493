"""POSIX shared-memory segments and semaphores, and the names they live under.

Why ``posix_ipc`` and not ``multiprocessing.shared_memory``: before Python 3.13 every *attach*
of a ``SharedMemory`` registers the segment with ``resource_tracker``, which then unlinks it (and
prints "leaked shared_memory") when the attaching process exits -- CPython #82300/#104291. The
segments here are the same ``/dev/shm`` objects, mapped with ``mmap``, with ownership handled
explicitly: only the creator unlinks, and :func:`sweep_namespace` removes whatever a crashed
process left behind.

Names: every object carries the run's namespace, ``sdbi_<owner pid>_<random>``, so leftovers of a
dead owner can be recognised (:func:`sweep_dead_namespaces`) and nothing collides across runs.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from typing import List, Optional

import numpy as np
import posix_ipc

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "sdbi_"
_NS_RE = re.compile(r"^sdbi_(\d+)_[0-9a-f]+$")


def new_namespace() -> str:
    """A fresh namespace owned by this process."""
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def check_free_space(nbytes: int, what: str, shm_dir: str = SHM_DIR) -> None:
    """Fail up front, with the size, instead of a later SIGBUS when /dev/shm runs out."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise OSError(
            errno.ENOSPC,
            f"{what} needs {nbytes / 2**20:.1f} MiB of shared memory but {shm_dir} has only "
            f"{free / 2**20:.1f} MiB free (in Docker, raise --shm-size)")


class Segment:
    """One mapped POSIX shared-memory segment.

    Views made with :meth:`ndarray` keep the mapping exported; drop them before :meth:`close`.
    """

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        self.size = int(size)
        self.owner = create
        self._mmap: Optional[mmap.mmap] = None
        if create:
            check_free_space(self.size, f"segment {name}")
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
            try:
                try:
                    # Reserve the pages now: an over-committed tmpfs otherwise kills us with
                    # SIGBUS on first touch, far from the cause.
                    os.posix_fallocate(shm.fd, 0, self.size)
                except OSError as e:
                    if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                        os.ftruncate(shm.fd, self.size)
                    else:
                        raise OSError(e.errno, f"cannot reserve {self.size / 2**20:.1f} MiB "
                                      f"for {name} in {SHM_DIR}: {e.strerror}") from None
                self._mmap = mmap.mmap(shm.fd, self.size)
            except BaseException:
                shm.unlink()
                raise
            finally:
                os.close(shm.fd)
        else:
            shm = posix_ipc.SharedMemory(name)
            try:
                if size <= 0:
                    self.size = os.fstat(shm.fd).st_size
                self._mmap = mmap.mmap(shm.fd, self.size)
            finally:
                os.close(shm.fd)

    @property
    def buf(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    def ndarray(self, offset: int, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    def address(self) -> int:
        """Base address of the mapping (for cudaHostRegister)."""
        return np.frombuffer(self.buf, dtype=np.uint8, count=1).ctypes.data

    def close(self) -> None:
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError:
            # A view is still alive somewhere; the mapping goes when it does.
            logger.debug("segment %s still has views; leaving the mapping to the GC", self.name)
        self._mmap = None

    def unlink(self) -> None:
        unlink_shm(self.name)


def unlink_shm(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def unlink_sem(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def create_semaphore(name: str, initial: int = 0) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(name)


def list_namespace(namespace: str, shm_dir: str = SHM_DIR) -> List[str]:
    """Entries of /dev/shm belonging to ``namespace`` (semaphores show as ``sem.<name>``)."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    return [e for e in entries if e.startswith(namespace + ".") or e.startswith("sem." + namespace + ".")]


def sweep_namespace(namespace: str, shm_dir: str = SHM_DIR) -> int:
    """Unlink every segment and semaphore of ``namespace``; returns how many were removed."""
    removed = 0
    for entry in list_namespace(namespace, shm_dir):
        if entry.startswith("sem."):
            unlink_sem("/" + entry[4:])
        else:
            unlink_shm("/" + entry)
        removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (a killed child nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def sweep_dead_namespaces(shm_dir: str = SHM_DIR) -> int:
    """Remove what runs whose owner process no longer exists left in /dev/shm."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return 0
    spaces = set()
    for e in entries:
        base = e[4:] if e.startswith("sem.") else e
        ns = base.split(".", 1)[0]
        m = _NS_RE.match(ns)
        if m and not pid_alive(int(m.group(1))):
            spaces.add(ns)
    return sum(sweep_namespace(ns, shm_dir) for ns in spaces)
