"""Named runtimes: how a process simpledbi did not start finds a running runtime by name.

A runtime started with ``name="myapp"`` (``simpledbi serve --name myapp``, ``Runtime(models,
name="myapp")``) writes one small *registration* file, ``/dev/shm/sdbi_rt_myapp`` (mode 0600),
that says which namespace (shm.py) it serves in::

    {"namespace": "sdbi_4242_9f...", "pid": 4242, "models": ["resnet50"], "started": 1.7e9}

The namespace itself keeps its unguessable random part; the registration is the only stable name.
Clients trust a registration only when its owner is their own user (/dev/shm is world-writable:
another user could squat the name, but never redirect our clients into a namespace of theirs).
A registration whose pid is gone is stale: the next runtime of that name replaces it, and
``sweep_dead_registrations`` removes it. Only the runtime that wrote it removes it (or its janitor).
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .shm import SHM_DIR, pid_alive

REG_PREFIX = "sdbi_rt_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,47}$")
#: Clients without ``namespace=``/``runtime=`` attach to the runtime named here.
ENV_RUNTIME = "SIMPLEDBI_RUNTIME"


@dataclass(frozen=True)
class Registration:
    name: str
    namespace: str
    pid: int
    models: tuple
    started: float


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"runtime name: expected 1-48 letters, digits, '_' or '-', got {name!r}")
    return name


def registration_path(name: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, REG_PREFIX + check_name(name))


def read(name: str, shm_dir: str = SHM_DIR) -> Optional[Registration]:
    """The registration of ``name`` if it is ours and complete, else None (live or not)."""
    path = registration_path(name, shm_dir)
    try:   # /dev/shm is everyone's: never block opening another user's FIFO
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or st.st_size > 65536:
            return None
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        d = json.loads(data)
        reg = Registration(name, str(d["namespace"]), int(d["pid"]), tuple(d["models"]),
                           float(d["started"]))
    except (ValueError, KeyError, TypeError):
        return None  # being written, or not ours to read
    if not reg.namespace.startswith("sdbi_") or "/" in reg.namespace:
        return None
    return reg


def resolve(name: str, shm_dir: str = SHM_DIR) -> Optional[Registration]:
    """The live runtime called ``name``, or None."""
    reg = read(name, shm_dir)
    return reg if reg is not None and _live(reg, shm_dir) else None


def _live(reg: Registration, shm_dir: str) -> bool:
    """A registration of a runtime that is running: its process is alive and its namespace
    directory exists (a rewritten file naming any live pid does not hold the name)."""
    return pid_alive(reg.pid) and os.path.isdir(os.path.join(shm_dir, reg.namespace))


def register(name: str, namespace: str, models: Sequence[str], shm_dir: str = SHM_DIR) -> str:
    """Claim ``name`` for this process's runtime; raises if a live runtime already holds it."""
    path = registration_path(name, shm_dir)
    body = json.dumps({"namespace": namespace, "pid": os.getpid(), "models": list(models),
                       "started": time.time()}).encode()
    for _ in range(8):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
        except FileExistsError:
            try:
                owner = os.stat(path, follow_symlinks=False).st_uid
            except FileNotFoundError:
                continue
            if owner != os.getuid():
                raise PermissionError(errno.EACCES, f"the runtime name {name!r} is taken by "
                                      f"another user (uid {owner}, {path})")
            old = read(name, shm_dir)
            if old is not None and _live(old, shm_dir):
                raise RuntimeError(f"a simpledbi runtime named {name!r} is already running "
                                   f"(pid {old.pid}); stop it or choose another name")
            if old is None and _young(path):
                time.sleep(0.05)  # another runtime is writing it right now
                continue
            _unlink(path)  # stale: its runtime died without removing it
            continue
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        return path
    raise RuntimeError(f"could not register the runtime name {name!r} ({path})")


def unregister(path: str, namespace: str) -> None:
    """Remove a registration -- only if it still names ``namespace`` (never a successor's)."""
    name = os.path.basename(path)[len(REG_PREFIX):]
    reg = read(name, os.path.dirname(path))
    if reg is not None and reg.namespace == namespace:
        _unlink(path)


def list_registrations(shm_dir: str = SHM_DIR) -> List[Registration]:
    out = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    for e in entries:
        if e.startswith(REG_PREFIX) and NAME_RE.match(e[len(REG_PREFIX):]):
            reg = read(e[len(REG_PREFIX):], shm_dir)
            if reg is not None:
                out.append(reg)
    return out


def sweep_dead_registrations(shm_dir: str = SHM_DIR) -> int:
    removed = 0
    for reg in list_registrations(shm_dir):
        if not pid_alive(reg.pid):
            unregister(registration_path(reg.name, shm_dir), reg.namespace)
            removed += 1
    return removed


def _young(path: str) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime < 2.0
    except OSError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
