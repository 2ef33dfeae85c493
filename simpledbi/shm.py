"""Where a run's shared objects live, and how they are created, mapped and removed.

Every run owns a *namespace* ``sdbi_<owner pid>_<128 random bits>``:

* a directory ``/dev/shm/<namespace>/`` created with ``mkdir(0o700)``: control blocks, slot tables,
  slot lock files and client slot segments are plain files in it. Other users can neither list,
  read, create nor squat anything inside; only the owner user can open it.
* POSIX semaphores ``/dev/shm/sem.<namespace>.*`` (``posix_ipc``: a semaphore name cannot hold a
  directory). The doorbell exists from start; every per-slot semaphore carries a 64-bit random
  token drawn at attach, so no other user can create one before its client does.

Why files in a directory and not ``posix_ipc.SharedMemory`` or ``multiprocessing.shared_memory``:
``shm_open`` is ``open`` on /dev/shm, but cannot use a private directory; and before Python 3.13
``SharedMemory`` registers every *attach* with ``resource_tracker``, which unlinks the segment and
warns "leaked shared_memory" when the attaching process exits (CPython #82300/#104291).

Only the creator unlinks; :func:`sweep_namespace` removes whatever a crashed run left, and
:func:`sweep_dead_namespaces` finds namespaces whose owner process is gone.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import time
from typing import List, Optional, Tuple

import numpy as np
import posix_ipc

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "sdbi_"
_NS_RE = re.compile(r"^sdbi_(\d+)_[0-9a-f]+$")


def new_namespace(shm_dir: str = SHM_DIR) -> str:
    """Create a fresh namespace owned by this process (its private directory, mode 0700)."""
    for _ in range(8):
        ns = f"{PREFIX}{os.getpid()}_{secrets.token_hex(16)}"
        try:
            os.mkdir(os.path.join(shm_dir, ns), 0o700)
        except FileExistsError:
            continue
        return ns
    raise OSError(errno.EEXIST, "could not create a fresh namespace directory in " + shm_dir)


def ns_path(namespace: str, name: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, namespace, name)


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
    """One mapped shared-memory file. ``create`` makes it exclusively (mode 0600) and reserves
    its pages -- or only the first ``reserve`` bytes: the rest stays sparse until :meth:`reserve`
    (writing an unreserved page of a full tmpfs through the mapping is a SIGBUS);
    ``readonly`` maps it without write access (what clients do with control blocks).

    Views made with :meth:`ndarray` keep the mapping exported; drop them before :meth:`close`.
    """

    def __init__(self, path: str, size: int = 0, create: bool = False, readonly: bool = False,
                 keep_fd: bool = False, reserve: Optional[int] = None):
        self.path = path
        self.size = int(size)
        self.owner = create
        self.fd: Optional[int] = None
        self._mmap: Optional[mmap.mmap] = None
        if create:
            reserve = self.size if reserve is None else min(reserve, self.size)
            check_free_space(reserve, f"segment {os.path.basename(path)}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                if reserve < self.size:
                    os.ftruncate(fd, self.size)
                _reserve(fd, reserve, path)
                self._mmap = mmap.mmap(fd, self.size)
            except BaseException:
                os.close(fd)
                _unlink(path)
                raise
        else:
            # Any client may put something else at a path of the namespace: never follow a
            # symlink, never block opening a FIFO, and map only a non-empty regular file.
            fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW
                         | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, f"{path} is not a regular file")
                if self.size <= 0:
                    self.size = st.st_size
                if self.size <= 0:
                    raise OSError(errno.EINVAL, f"{path} is empty")
                self._mmap = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ if readonly
                                       else mmap.ACCESS_WRITE)
            except BaseException:
                os.close(fd)
                raise
        if keep_fd:
            self.fd = fd
        else:
            os.close(fd)

    @property
    def buf(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.path} is closed")
        return self._mmap

    def ndarray(self, offset: int, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Reserve the pages of ``[offset, offset + nbytes)`` before writing them through the
        mapping (creator only): a full /dev/shm then raises OSError here, not SIGBUS later."""
        check_free_space(nbytes, f"segment {os.path.basename(self.path)}")
        _reserve(self.fd, offset + nbytes, self.path, offset)

    def grow(self, size: int) -> None:
        """Extend the file (creator only) and remap it; views made before must be dropped first."""
        if size <= self.size:
            return
        check_free_space(size - self.size, f"segment {os.path.basename(self.path)}")
        _reserve(self.fd, size, self.path)
        self._replace_mapping(size)

    def remap(self) -> None:
        """Map the file at its current size (after another process extended it)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._replace_mapping(size)

    def _replace_mapping(self, size: int) -> None:
        try:
            self._mmap.close()
        except BufferError:
            pass  # someone still holds a view of the old mapping: it lives until they drop it
        self._mmap = mmap.mmap(self.fd, size)
        self.size = size

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes when it does.
                logger.debug("segment %s still has views; leaving the mapping to the GC", self.path)
            self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def unlink(self) -> None:
        _unlink(self.path)


def _reserve(fd: int, size: int, path: str, start: int = 0) -> None:
    try:
        # Reserve the pages now: an over-committed tmpfs otherwise kills us with SIGBUS on
        # first touch, far from the cause.
        os.posix_fallocate(fd, start, size - start)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        else:
            raise OSError(e.errno, f"cannot reserve {(size - start) / 2**20:.1f} MiB for {path}: "
                          f"{e.strerror}") from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_file(path: str, trash: Optional[str] = None) -> None:
    """Remove what is at ``path`` in O(1), whatever a client put there. Never raises: cleanup
    must go on. See :func:`discard`."""
    discard(path, trash)


def unlink_sem(name: str) -> None:
    """Unlink semaphore ``name`` (or whatever a client put at its path). Never raises."""
    try:
        posix_ipc.unlink_semaphore(name)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        pass  # gone already, or another user's
    except (posix_ipc.Error, OSError):   # not a semaphore: set it aside in its namespace
        base = name.lstrip("/")
        discard(os.path.join(SHM_DIR, "sem." + base), os.path.join(SHM_DIR, base.split(".", 1)[0]))


def _open_parent(path: str) -> Tuple[Optional[int], str]:
    """A descriptor on ``path``'s directory -- refused if that directory is a symlink (a client
    that swaps the namespace directory for a link must not make the runtime delete elsewhere) --
    and the last component."""
    parent, name = os.path.split(path)
    try:
        return os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC), name
    except OSError as e:
        logger.debug("not removing %s: %s", path, e)
        return None, name


def _is_directory_left(pfd: int, name: str, path: str) -> bool:
    """Unlink ``name`` in the directory open at ``pfd``; True if it is a directory instead
    (unlink refuses those), False once nothing is left there or it cannot be removed."""
    try:
        os.unlink(name, dir_fd=pfd)
        return False
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.EPERM):
            return True
        logger.debug("could not remove %s: %s", path, e)
        return False


def discard(path: str, trash: Optional[str] = None) -> None:
    """Remove the file or link at ``path``; a directory (which a client may put where a file of
    the runtime goes) is removed if empty, else renamed aside -- into ``trash`` (a namespace
    directory) when given, else next to it -- to go with its namespace (:func:`remove_tree`):
    constant work, whatever the client keeps adding to it. Never raises."""
    pfd, name = _open_parent(path)
    if pfd is None:
        return
    try:
        if not _is_directory_left(pfd, name, path):
            return
        try:
            os.rmdir(name, dir_fd=pfd)
            return
        except OSError:
            pass
        tfd = pfd
        if trash is not None:
            try:
                tfd = os.open(trash, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return
        try:
            os.rename(name, f".junk.{secrets.token_hex(8)}", src_dir_fd=pfd, dst_dir_fd=tfd)
        except OSError as e:
            logger.debug("could not set %s aside: %s", path, e)
        finally:
            if tfd != pfd:
                os.close(tfd)
    finally:
        os.close(pfd)


def remove_tree(path: str, budget: float = 5.0) -> None:
    """Remove ``path`` and, if it is a directory, everything in it. Never raises, never follows a
    symlink (``path``'s own directory included), and never recurses: a client can nest
    directories deeper than Python's recursion limit (``shutil.rmtree`` then raises
    RecursionError) or than PATH_MAX. A non-empty subdirectory's own subdirectories are moved up
    into the top directory first, so no more than two directories are open at any time and the
    work is linear in the number of entries; a client that keeps adding entries is given up on
    after ``budget`` seconds (logged)."""
    pfd, base = _open_parent(path)
    if pfd is None:
        return
    try:
        if not _is_directory_left(pfd, base, path):
            return
        try:
            top = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as e:
            logger.debug("could not remove %s: %s", path, e)
            return
        try:
            _empty(top, path, time.monotonic() + budget)
            os.rmdir(base, dir_fd=pfd)
        except OSError as e:
            logger.debug("could not remove %s: %s", path, e)
        finally:
            os.close(top)
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
        with os.scandir(top) as entries:
            names = []
            for e in entries:   # a directory that keeps growing: list no more than the budget
                names.append((e.name, e.is_dir(follow_symlinks=False)))
                if len(names) % 4096 == 0 and time.monotonic() > deadline:
                    break
        for name, is_dir in names:
            try:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    progress = True
                    continue
                try:
                    os.rmdir(name, dir_fd=top)
                    progress = True
                    continue
                except OSError as e:
                    if e.errno != errno.ENOTEMPTY:
                        raise
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=top)
                try:
                    with os.scandir(sub) as inner:
                        below = []
                        for e in inner:
                            below.append((e.name, e.is_dir(follow_symlinks=False)))
                            if len(below) % 4096 == 0 and time.monotonic() > deadline:
                                break
                    for n2, d2 in below:
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


def create_semaphore(name: str, initial: int = 0) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(name)


def list_namespace(namespace: str, shm_dir: str = SHM_DIR) -> List[str]:
    """Entries of /dev/shm belonging to ``namespace``: its directory and its semaphores."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    return [e for e in entries if e == namespace or e.startswith("sem." + namespace + ".")]


def sweep_namespace(namespace: str, shm_dir: str = SHM_DIR) -> int:
    """Remove the namespace's directory and every semaphore of it; returns how many entries went."""
    removed = 0
    for entry in list_namespace(namespace, shm_dir):
        if entry.startswith("sem."):
            unlink_sem("/" + entry[4:])
        else:
            remove_tree(os.path.join(shm_dir, entry))
        removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (a killed child nobody reaped yet)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < 2**22 and os.path.exists(f"/proc/{pid}")
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
    removed = 0
    for ns in spaces:
        try:   # what a dead run's clients left there must not stop a new run from starting
            removed += sweep_namespace(ns, shm_dir)
        except Exception:  # noqa: BLE001
            logger.warning("could not remove the leftovers of %s", ns, exc_info=True)
    return removed
