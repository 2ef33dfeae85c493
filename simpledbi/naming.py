"""Named runtimes: how a process simpledbi did not start finds a running runtime by name.

A runtime started with ``name="myapp"`` (``simpledbi serve --name myapp``) writes a
*registration* ``sdbi_rt_myapp`` (mode 0600) into its user's private *registry directory*: the
namespace it serves in (shm.py) has an unguessable random part, so no stable name but this::

    {"namespace": "sdbi_4242_9f...", "pid": 4242, "models": ["resnet50"], "started": 1.7e9}

NOTE [registry directory]
-------------------------
Where a runtime registers (``registry_dir``, the same checks in every process)::

    $SIMPLEDBI_DIR set? ──yes──> that directory (made 0700 if missing), else ValueError saying why
        │ no
        v
    /dev/shm/sdbi_u<uid>  ──ours──> use it (mkdir 0700 if missing)
        │ another user made it first; a symlink, a file, a FIFO; group/other bits
        v
    ~/.cache/simpledbi/run-<hostname>  (each level made 0700 if missing), else PermissionError

Lookups (``lookup_dirs``) create nothing and search *both* directories of that chain, /dev/shm
first, skipping one that fails the checks (with ``$SIMPLEDBI_DIR`` set, it alone). Re-deriving
the runtime's choice instead would let another user who deletes their squatting directory after
a runtime fell back to the home directory steer every later client away from that runtime.

Why so. /dev/shm is world-writable: another user can create any fixed name there first (as the old
``/dev/shm/sdbi_rt_<name>`` was, or ``sdbi_u<uid>`` is) and keep a runtime from starting. In a directory only
we can write, nobody else can list, open, create, replace or block anything; what is left to defend is its own
name, claimed with ``mkdir`` (the sticky bit keeps others from renaming or removing it) and never removed (it
could be taken). Someone who took it first is not fought: nobody else can create anything in our home. Not
``$XDG_RUNTIME_DIR``: processes of one user disagree about it (unset under sudo, cron, ``docker exec``,
``User=``), and ``/run/user/<uid>`` goes at the last logout while a nohup'ed runtime runs on. The fallback
also names the host: a home shared over NFS serves several, and a pid means something only there.

A directory counts (``_why_not_private``) when it is ours alone, in a parent that others, if they
can write it, cannot rename it out of (sticky); what we create is ``fchmod``-ed to 0700 after
``mkdir`` (a default ACL must not open it to others, nor a umask of 07xx close it to us). Clients
trust a registration only when it is a regular file of their own user. One whose pid is gone is
stale: the next runtime of that name replaces it, ``sweep_dead_registrations`` removes it; only
the runtime that wrote it (or its janitor) removes a live one."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .shm import SHM_DIR, pid_alive

logger = logging.getLogger(__name__)

REG_PREFIX = "sdbi_rt_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,47}\Z")   # (\Z: "$" lets a final newline in)
#: Clients without ``namespace=``/``runtime=`` attach to the runtime named here.
ENV_RUNTIME = "SIMPLEDBI_RUNTIME"
#: The registry directory, instead of the chain of NOTE [registry directory].
ENV_DIR = "SIMPLEDBI_DIR"

_MISSING = "does not exist"
_warned: set = set()
#: Seconds a registration that does not parse counts as being written (a write takes microseconds;
#: older, its runtime died writing it, and it is replaced).
_WRITING = 2.0
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


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


# ------------------------------------------------------------ the registry directory
def registry_dir() -> str:
    """The directory this user's runtimes register in, made if missing (NOTE [registry
    directory]). ValueError for a bad ``$SIMPLEDBI_DIR``; PermissionError when no place works."""
    env = _env_dir()
    if env is not None:
        if (why := _claim(env)) is not None:
            raise _env_error(env, why)
        return env
    shm_dir = _shm_registry()
    why = _claim(shm_dir)
    if why is None:
        return shm_dir
    home = _home_registry()
    why_home = _claim_home(home) if home is not None else "cannot be found (no home directory)"
    if why_home is not None:
        raise PermissionError(errno.EACCES, f"no private directory for simpledbi runtime names: "
                              f"{shm_dir} {why}, and {home or '~/.cache/simpledbi'} {why_home}; "
                              f"set ${ENV_DIR} to a directory only you can access")
    if (shm_dir, why) not in _warned:   # once: a runtime start asks twice
        _warned.add((shm_dir, why))
        logger.warning("%s %s: registering runtime names in %s instead", shm_dir, why, home)
    return home


def lookup_dirs() -> List[str]:
    """The directories a registration of this user may be in, in search order; creates nothing.
    ValueError for a bad ``$SIMPLEDBI_DIR``."""
    env = _env_dir()
    if env is not None:
        why = _why_not_private(env)
        if why == _MISSING:
            return []
        if why is not None:
            raise _env_error(env, why)
        return [env]
    return [d for d in (_shm_registry(), _home_registry()) if d is not None and _why_not_private(d) is None]


def _shm_registry() -> str:
    return os.path.join(SHM_DIR, f"sdbi_u{os.getuid()}")


def _home_registry() -> Optional[str]:
    home = os.path.expanduser("~")   # $HOME, else the password database
    if not os.path.isabs(home):
        return None
    host = re.sub(r"[^A-Za-z0-9._-]", "_", os.uname().nodename) or "localhost"
    return os.path.join(os.path.normpath(home), ".cache", "simpledbi", "run-" + host)


def _env_dir() -> Optional[str]:
    path = os.environ.get(ENV_DIR)
    if not path:
        return None
    if not os.path.isabs(path):  # relative to each process's own working directory: no
        raise ValueError(f"${ENV_DIR}: expected an absolute path, got {path!r}")
    return os.path.normpath(path)


def _env_error(path: str, why: str) -> ValueError:
    return ValueError(f"${ENV_DIR}: expected a directory of this user (uid {os.getuid()}), not a "
                      f"symlink, with no group or other permissions (chmod 700), got {path} that {why}")


def _why_not_private(path: str) -> Optional[str]:
    """None when ``path`` is a directory nobody but us can use or replace, else what is wrong
    (``_MISSING`` when there is nothing). Never follows ``path`` itself, never opens it."""
    uid = os.getuid()
    parent = os.path.dirname(path)
    try:
        pst = os.stat(parent)   # the directory the entry is in, wherever a symlink puts it
    except OSError as e:
        return f"is in {parent}, which cannot be examined ({e.strerror})"
    if pst.st_uid not in (0, uid):
        return f"is in {parent}, which belongs to uid {pst.st_uid} (who could replace it)"
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        return f"is in {parent}, which others can write and is not sticky (they could replace it)"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return _MISSING
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid} (not to uid {uid})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o} (others have access; expected 700)"
    return None


def _claim(path: str) -> Optional[str]:
    """Make ``path`` our private directory if nothing is there; then ``_why_not_private``."""
    why = _why_not_private(path)
    if why != _MISSING:
        return why
    why = _mkdir_private(path)   # someone quicker is judged below like anything else there
    if why is not None:
        return f"could not be created ({why})"
    why = _why_not_private(path)
    return "was removed while being created" if why == _MISSING else why


def _mkdir_private(path: str) -> Optional[str]:
    """mkdir ``path`` and chmod it 700 (umask, default ACL); None if made or there, else why not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return None
    except OSError as e:
        return e.strerror
    try:
        fd = os.open(path, _OPEN_DIR)
    except OSError:
        return None   # not a directory (any more): _why_not_private says so
    try:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_uid == os.getuid():   # root may chmod anyone's: only ours
                os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _claim_home(path: str) -> Optional[str]:
    """``_claim`` for ``~/.cache/simpledbi/run-<host>`` and the levels above it, up to the home."""
    top = os.path.dirname(path)
    cache = os.path.dirname(top)
    why = _mkdir_private(cache)   # chmod: a umask of 077x would leave it unusable
    if why is not None:
        return f"could not be created ({cache}: {why})"
    if (why := _claim(top)) is not None:
        return f"is in {top}, which {why}"
    return _claim(path)


# ------------------------------------------------------------ registrations
def registration_path(name: str) -> str:
    """Where this process would register ``name``: in ``registry_dir()`` (made if missing)."""
    check_name(name)
    return os.path.join(registry_dir(), REG_PREFIX + name)


def read(name: str, live: bool = False) -> Optional[Registration]:
    """The first registration of ``name`` in ``lookup_dirs()`` that is ours and complete (and,
    with ``live``, of a runtime that is running), else None."""
    check_name(name)
    for d in lookup_dirs():
        reg = _read(name, d)
        if reg is not None and (not live or _live(reg)):
            return reg
    return None


def resolve(name: str) -> Optional[Registration]:
    """The live runtime called ``name``, or None."""
    return read(name, live=True)


def _read(name: str, directory: str) -> Optional[Registration]:
    path = os.path.join(directory, REG_PREFIX + name)
    try:   # never block opening a FIFO that a buggy process left
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
        reg = Registration(name, str(d["namespace"]), int(d["pid"]), tuple(d["models"]), float(d["started"]))
    except (ValueError, KeyError, TypeError):
        return None  # being written, or not ours to read
    return reg if reg.namespace.startswith("sdbi_") and "/" not in reg.namespace else None


def _live(reg: Registration) -> bool:
    """A registration of a runtime that is running: its process is alive and its namespace
    directory exists (a rewritten file naming any live pid does not hold the name)."""
    return pid_alive(reg.pid) and os.path.isdir(os.path.join(SHM_DIR, reg.namespace))


def register(name: str, namespace: str, models: Sequence[str]) -> str:
    """Claim ``name`` for this process's runtime (in ``registry_dir()``); raises if a live
    runtime already holds it. Returns the registration's path."""
    path = registration_path(name)
    here = os.path.dirname(path)
    for other in lookup_dirs():
        if other != here:   # here: the loop below
            refuse_if_live(_read(name, other), name)
    body = json.dumps({"namespace": namespace, "pid": os.getpid(), "models": list(models),
                       "started": time.time()}).encode()
    for _ in range(8):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_uid != os.getuid():
                raise PermissionError(errno.EACCES, f"the runtime name {name!r} is taken by "
                                      f"another user (uid {st.st_uid}, {path})")
            old = _read(name, here)
            refuse_if_live(old, name)
            if old is None and time.time() - st.st_mtime < _WRITING:
                time.sleep(0.05)  # another runtime is writing it right now
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: its runtime died without removing it
            continue
        try:
            os.fchmod(fd, 0o600)   # whatever the umask: clients of our user must read it
            os.write(fd, body)
        finally:
            os.close(fd)
        return path
    raise RuntimeError(f"could not register the runtime name {name!r} ({path})")


def refuse_if_live(reg: Optional[Registration], name: str) -> None:
    if reg is not None and _live(reg):
        here = (": this process started it (a notebook cell run again?): call shutdown() on that "
                "Runtime first" if reg.pid == os.getpid() else "; stop it")
        raise RuntimeError(f"a simpledbi runtime named {name!r} is already running "
                           f"(pid {reg.pid}){here} or choose another name")


def unregister(path: str, namespace: str) -> None:
    """Remove a registration -- only if it still names ``namespace`` (never a successor's)."""
    name = os.path.basename(path)[len(REG_PREFIX):]
    reg = _read(name, os.path.dirname(path)) if NAME_RE.match(name) else None
    if reg is not None and reg.namespace == namespace:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def list_registrations() -> List[Registration]:
    """Every complete registration of ours in ``lookup_dirs()``, one per name -- a live one where
    a name is in two directories -- in name order."""
    by_name = {}
    for _, reg in _all():
        if reg.name not in by_name or (not pid_alive(by_name[reg.name].pid) and pid_alive(reg.pid)):
            by_name[reg.name] = reg
    return [by_name[n] for n in sorted(by_name)]


def sweep_dead_registrations() -> int:
    """Remove the registrations whose runtime process is gone; returns how many went."""
    try:
        found = _all()
    except ValueError:   # a bad $SIMPLEDBI_DIR: raised where a name is registered or looked up
        logger.warning("not sweeping runtime names", exc_info=True)
        return 0
    removed = 0
    for d, reg in found:
        if not pid_alive(reg.pid):
            unregister(os.path.join(d, REG_PREFIX + reg.name), reg.namespace)
            removed += 1
    return removed


def _all() -> List[tuple]:
    out = []
    for d in lookup_dirs():
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for e in entries:
            name = e[len(REG_PREFIX):]
            if e.startswith(REG_PREFIX) and NAME_RE.match(name) and (reg := _read(name, d)) is not None:
                out.append((d, reg))
    return out
