"""naming.py: where runtime names are registered, and that another user can neither take,
block, list nor read them (NOTE [registry directory]).

Most tests point ``naming.SHM_DIR`` at a stand-in for /dev/shm (a root-owned sticky 1777
directory under /tmp): the real ``/dev/shm/sdbi_u0`` is shared with every other root process on
the host and must not be squatted by a test. One test squats the real /dev/shm for a fresh uid
that no process uses. The stand-in lives under /tmp, not under ``tmp_path``, because ``nobody``
cannot reach ``tmp_path`` (/tmp/pytest-of-root is 0700): a denial must come from the directory
under test, not from an ancestor. Tests acting as another user need root and run it in a forked
child (setgid/setuid to ``nobody``).
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import tempfile
import traceback
from types import SimpleNamespace

import pytest

from simpledbi import naming

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


def _name() -> str:
    return f"t{os.getpid()}-{secrets.token_hex(3)}"


def _nobody():
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def _as(uid: int, gid: int, fn):
    """``fn()`` in a forked child running as ``uid``/``gid``; returns what it returns (JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # never returns into pytest
        rc = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(w, json.dumps(fn()).encode())
            rc = 0
        except BaseException:  # noqa: BLE001 - reported through the exit status
            traceback.print_exc()
        finally:
            os._exit(rc)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()   # EOF when the child exits, whatever it did
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed (its traceback is above)"
    return json.loads(data)


def _as_nobody(fn):
    return _as(*_nobody(), fn)


def _snapshot(path: str):
    st = os.lstat(path)
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return st.st_ino, st.st_uid, st.st_mode, st.st_size, link


def _probe(fn) -> str:
    try:
        fn()
    except PermissionError:
        return "denied"
    return "allowed"


@pytest.fixture
def place(monkeypatch):
    """A stand-in /dev/shm and home that ``nobody`` can reach; no $SIMPLEDBI_DIR."""
    base = tempfile.mkdtemp(prefix="sdbitest_naming_", dir="/tmp")
    os.chmod(base, 0o755)
    shm, home = os.path.join(base, "shm"), os.path.join(base, "home")
    os.mkdir(shm)
    os.chmod(shm, 0o1777)   # as /dev/shm
    os.mkdir(home, 0o755)
    monkeypatch.setattr(naming, "SHM_DIR", shm)
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv(naming.ENV_DIR, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    try:
        yield SimpleNamespace(
            base=base, shm=shm, home=home,
            primary=os.path.join(shm, f"sdbi_u{os.getuid()}"),
            fallback=os.path.join(home, ".cache", "simpledbi", "run-" + os.uname().nodename))
    finally:
        shutil.rmtree(base)


def _namespace(place) -> str:
    """A namespace directory in the stand-in /dev/shm: what makes a registration live."""
    ns = f"sdbi_{os.getpid()}_{secrets.token_hex(8)}"
    os.mkdir(os.path.join(place.shm, ns), 0o700)
    return ns


# ------------------------------------------------------------ where names go

@pytest.mark.parametrize("umask", [0o000, 0o777])
def test_names_go_to_a_private_directory_in_shm_made_whatever_the_umask(place, umask):
    name, ns = _name(), _namespace(place)
    old = os.umask(umask)
    try:
        d = naming.registry_dir()
        path = naming.register(name, ns, ["m"])
    finally:
        os.umask(old)
    assert d == place.primary
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert path == naming.registration_path(name) == os.path.join(d, naming.REG_PREFIX + name)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    naming.unregister(path, ns)
    assert os.listdir(d) == []
    assert os.path.isdir(d)   # kept: a removed directory could be taken
    assert not os.path.exists(os.path.join(place.home, ".cache"))


def test_a_place_others_could_swap_is_not_used(place, monkeypatch, tmp_path):
    # Without its sticky bit, /dev/shm would let anyone rename our directory away and put theirs.
    os.chmod(place.shm, 0o777)
    assert naming.registry_dir() == place.fallback
    assert not os.path.lexists(place.primary)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    monkeypatch.setenv(naming.ENV_DIR, str(open_dir / "names"))
    with pytest.raises(ValueError, match="others can write and is not sticky"):
        naming.registry_dir()
    assert list(open_dir.iterdir()) == []


def test_xdg_runtime_dir_does_not_move_the_names(place, monkeypatch, tmp_path):
    # A client in a login session (XDG_RUNTIME_DIR set) must find a runtime started from cron.
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert naming.registry_dir() == place.primary
    assert list(xdg.iterdir()) == []


def test_lookups_create_nothing(place):
    assert naming.lookup_dirs() == []
    assert naming.resolve(_name()) is None and naming.read(_name()) is None
    assert naming.list_registrations() == [] and naming.sweep_dead_registrations() == 0
    assert os.listdir(place.shm) == [] and os.listdir(place.home) == []


def test_a_runtime_of_another_process_is_found_held_and_replaced_once_dead(place):
    """Same user, another process: its live registration is found and holds the name; once it
    died without unregistering, the next runtime of that name replaces it."""
    name = _name()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # a runtime that registers, then dies without unregistering
        rc = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            ns = _namespace(place)
            naming.register(name, ns, ["m"])
            os.write(ready_w, ns.encode())
            os.read(go_r, 1)   # held until the parent has looked
            rc = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(rc)
    os.close(ready_w)
    os.close(go_r)
    try:
        ns = os.read(ready_r, 200).decode()
        assert ns, "the child did not register"
        reg = naming.resolve(name)
        assert reg is not None and (reg.pid, reg.namespace, reg.models) == (pid, ns, ("m",))
        assert [r.name for r in naming.list_registrations()] == [name]
        mine = _namespace(place)
        with pytest.raises(RuntimeError, match="already running"):
            naming.register(name, mine, ["m"])
        naming.unregister(naming.registration_path(name), mine)   # not ours: stays
        assert naming.read(name).pid == pid
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert naming.resolve(name) is None and naming.read(name).pid == pid   # stale
    path = naming.register(name, mine, ["m"])
    assert naming.resolve(name).pid == os.getpid()
    naming.unregister(path, mine)
    assert naming.read(name) is None and os.listdir(place.primary) == []


def test_the_sweep_removes_registrations_of_dead_processes_only(place):
    live, dead = _name(), _name()
    ns = _namespace(place)
    path = naming.register(live, ns, ["m"])
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    with open(naming.registration_path(dead), "w") as f:
        json.dump({"namespace": ns, "pid": pid, "models": ["m"], "started": 0}, f)
    assert sorted(r.name for r in naming.list_registrations()) == sorted([live, dead])
    assert naming.sweep_dead_registrations() == 1
    assert [r.name for r in naming.list_registrations()] == [live]
    naming.unregister(path, ns)


@pytest.mark.timeout(30)
def test_a_fifo_in_the_registry_blocks_nobody(place):
    # A buggy process of ours left a FIFO where a registration goes: opening it must not hang.
    name = _name()
    os.mkfifo(naming.registration_path(name), 0o600)
    assert naming.read(name) is None and naming.resolve(name) is None
    assert naming.list_registrations() == []
    naming.unregister(naming.registration_path(name), "sdbi_1_x")
    assert stat.S_ISFIFO(os.lstat(naming.registration_path(name)).st_mode)


# ------------------------------------------------------------ $SIMPLEDBI_DIR

def test_simpledbi_dir_is_used_alone_and_made_if_missing(place, monkeypatch, tmp_path):
    d = tmp_path / "names"
    monkeypatch.setenv(naming.ENV_DIR, str(d))
    assert naming.lookup_dirs() == []            # missing: nothing registered, nothing made
    assert naming.registry_dir() == str(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    name, ns = _name(), _namespace(place)
    path = naming.register(name, ns, ["m"])
    assert path == str(d / (naming.REG_PREFIX + name)) and naming.resolve(name).namespace == ns
    assert naming.lookup_dirs() == [str(d)]
    naming.unregister(path, ns)
    assert not os.path.exists(place.primary)     # not looked at


@pytest.mark.parametrize("kind", ["world-writable", "group-readable", "symlink", "file", "relative"])
def test_a_bad_simpledbi_dir_is_a_clear_error(place, monkeypatch, tmp_path, kind):
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    d = tmp_path / "d"
    if kind == "world-writable":
        d.mkdir()
        d.chmod(0o777)
        what = "has mode 777"
    elif kind == "group-readable":
        d.mkdir()
        d.chmod(0o750)
        what = "has mode 750"
    elif kind == "symlink":
        d.symlink_to(good)   # even to a good directory: a link is never followed
        what = "is a symlink"
    elif kind == "file":
        d.write_text("")
        what = "is not a directory"
    else:
        d = "names"
        what = "expected an absolute path"
    monkeypatch.setenv(naming.ENV_DIR, str(d))
    for call in (naming.registry_dir, naming.lookup_dirs, lambda: naming.resolve("x"),
                 lambda: naming.register(_name(), "sdbi_1_x", ["m"]), naming.list_registrations):
        with pytest.raises(ValueError, match=naming.ENV_DIR) as e:
            call()
        assert what in str(e.value) and str(d) in str(e.value)
    assert naming.sweep_dead_registrations() == 0   # a runtime without a name still starts
    assert list(good.iterdir()) == [] and not os.path.exists(place.primary)


@root_only
def test_a_simpledbi_dir_of_another_user_is_a_clear_error(place, monkeypatch, tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    os.chown(d, *_nobody())
    monkeypatch.setenv(naming.ENV_DIR, str(d))
    with pytest.raises(ValueError, match=f"belongs to uid {_nobody()[0]}"):
        naming.registry_dir()


# ------------------------------------------------------------ another user

SQUATS = ["dir", "private dir", "symlink", "file", "fifo", "ours, group bits"]


def _squat(place, kind: str, name: str) -> None:
    """``place.primary`` made first, by nobody (or, "ours, group bits", by a buggy us), and the
    old-style /dev/shm registration of ``name``."""
    primary, old_style = place.primary, os.path.join(place.shm, naming.REG_PREFIX + name)

    def as_nobody():
        os.close(os.open(old_style, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        if kind == "dir":
            os.mkdir(primary)
            os.chmod(primary, 0o777)
        elif kind == "private dir":
            os.mkdir(primary, 0o700)
        elif kind == "symlink":
            target = os.path.join(place.shm, "elsewhere")
            os.mkdir(target)
            os.chmod(target, 0o777)
            os.symlink(target, primary)
        elif kind == "file":
            os.close(os.open(primary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        elif kind == "fifo":
            os.mkfifo(primary, 0o666)
    _as_nobody(as_nobody)
    if kind == "ours, group bits":
        os.mkdir(primary)
        os.chmod(primary, 0o770)


@root_only
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SQUATS)
def test_another_user_cannot_take_a_name(place, kind):
    name = _name()
    _squat(place, kind, name)
    squats = {p: _snapshot(p) for p in (place.primary, os.path.join(place.shm, naming.REG_PREFIX + name))}
    assert naming.lookup_dirs() == []
    ns = _namespace(place)
    path = naming.register(name, ns, ["m"])
    assert os.path.dirname(path) == place.fallback
    for d in (place.fallback, os.path.dirname(place.fallback)):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    assert naming.resolve(name).namespace == ns
    assert [r.name for r in naming.list_registrations()] == [name]
    with pytest.raises(RuntimeError, match="already running"):
        naming.register(name, _namespace(place), ["m"])
    naming.unregister(path, ns)
    assert naming.read(name) is None and not os.path.exists(path)
    assert {p: _snapshot(p) for p in squats} == squats   # untouched


@root_only
@pytest.mark.parametrize("where", ["shm", "home"])
def test_another_user_can_neither_list_nor_read_nor_write_the_names(place, where):
    name = _name()
    if where == "home":
        _squat(place, "dir", name)
    ns = _namespace(place)
    path = naming.register(name, ns, ["m"])
    d = os.path.dirname(path)
    if where == "home":   # open the levels above: the directory itself must keep others out
        for up in (os.path.dirname(d), os.path.dirname(os.path.dirname(d))):
            os.chmod(up, 0o755)
    assert d == (place.primary if where == "shm" else place.fallback)

    def look():
        return {
            "parent": _probe(lambda: os.listdir(os.path.dirname(d))),
            "list": _probe(lambda: os.listdir(d)),
            "open": _probe(lambda: open(path, "rb").close()),
            "stat": _probe(lambda: os.stat(path)),
            "create": _probe(lambda: os.close(os.open(os.path.join(d, naming.REG_PREFIX + "x"),
                                                      os.O_WRONLY | os.O_CREAT, 0o644))),
            "unlink": _probe(lambda: os.unlink(path)),
        }
    seen = _as_nobody(look)
    assert seen == {"parent": "allowed", "list": "denied", "open": "denied", "stat": "denied",
                    "create": "denied", "unlink": "denied"}
    assert naming.resolve(name).namespace == ns
    naming.unregister(path, ns)


@root_only
def test_a_squatter_who_leaves_does_not_hide_a_running_runtime(place):
    """The runtime fell back to the home directory; the squatter then removes its directory, so
    /dev/shm is ours to use again. The running runtime is still found and still holds its name."""
    name = _name()
    _squat(place, "dir", name)
    ns = _namespace(place)
    path = naming.register(name, ns, ["m"])
    assert os.path.dirname(path) == place.fallback
    _as_nobody(lambda: os.rmdir(place.primary))
    assert naming.registry_dir() == place.primary
    assert naming.lookup_dirs() == [place.primary, place.fallback]
    assert naming.resolve(name).namespace == ns
    other = _namespace(place)
    with pytest.raises(RuntimeError, match="already running"):
        naming.register(name, other, ["m"])
    assert os.listdir(place.primary) == []
    naming.unregister(path, ns)
    path = naming.register(name, other, ["m"])
    assert os.path.dirname(path) == place.primary and naming.resolve(name).namespace == other
    naming.unregister(path, other)


@root_only
def test_no_usable_place_is_a_clear_error(place, monkeypatch):
    _squat(place, "dir", _name())
    monkeypatch.setenv("HOME", "/nonexistent")
    with pytest.raises(PermissionError, match=f"belongs to uid {_nobody()[0]}.*{naming.ENV_DIR}"):
        naming.registry_dir()


@root_only
@pytest.mark.timeout(60)
def test_a_squat_in_the_real_dev_shm(tmp_path):
    """The real /dev/shm, for a fresh uid no process uses (squatting root's own would break
    every other root process of the host): nobody makes /dev/shm/sdbi_u<uid> and the old-style
    /dev/shm/sdbi_rt_<name> first; a runtime of that uid still registers, is found, unregisters."""
    uid = 3_000_000 + os.getpid() % 1_000_000
    primary = os.path.join("/dev/shm", f"sdbi_u{uid}")
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    assert not os.path.lexists(primary)
    name = _name()
    old_style = os.path.join("/dev/shm", naming.REG_PREFIX + name)
    base = tempfile.mkdtemp(prefix="sdbitest_naming_", dir="/tmp")
    home = os.path.join(base, "home")
    try:
        os.chmod(base, 0o755)
        os.mkdir(home, 0o700)
        os.chown(home, uid, uid)

        def squat():
            os.mkdir(primary)
            os.chmod(primary, 0o777)
            os.close(os.open(old_style, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        _as_nobody(squat)
        before = {p: _snapshot(p) for p in (primary, old_style)}

        def runtime():
            os.environ["HOME"] = home
            os.environ.pop(naming.ENV_DIR, None)
            ns = f"sdbi_{os.getpid()}_{secrets.token_hex(8)}"
            os.mkdir(os.path.join("/dev/shm", ns), 0o700)
            try:
                path = naming.register(name, ns, ["m"])
                found = naming.resolve(name)
                names = [r.name for r in naming.list_registrations()]
                naming.unregister(path, ns)
                return {"path": path, "found": found and found.namespace == ns, "names": names,
                        "after": naming.read(name) is None and not os.path.exists(path)}
            finally:
                os.rmdir(os.path.join("/dev/shm", ns))
        seen = _as(uid, uid, runtime)
        assert seen == {"path": os.path.join(home, ".cache", "simpledbi", "run-" + os.uname().nodename,
                                             naming.REG_PREFIX + name),
                        "found": True, "names": [name], "after": True}
        assert {p: _snapshot(p) for p in before} == before
    finally:
        for p in (old_style, primary):
            if os.path.lexists(p):
                os.rmdir(p) if os.path.isdir(p) else os.unlink(p)
        shutil.rmtree(base)
