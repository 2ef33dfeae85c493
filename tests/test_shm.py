"""Shared-memory housekeeping: the /dev/shm size check and the sweeping of dead runs' leftovers."""
import os
import subprocess
import sys
from collections import namedtuple

import posix_ipc
import pytest

from simpledbi import shm

_Stat = namedtuple("_Stat", "f_bavail f_frsize")


def test_too_small_dev_shm_fails_up_front_naming_the_size(monkeypatch):
    monkeypatch.setattr(shm.os, "statvfs", lambda path: _Stat(f_bavail=16, f_frsize=4096))  # 64 KiB
    ns = shm.new_namespace()
    try:
        with pytest.raises(OSError) as info:
            shm.Segment(shm.ns_path(ns, "big"), 3 * 2**20, create=True)
    finally:
        shm.sweep_namespace(ns)
    text = str(info.value)
    assert "3.0 MiB" in text and "0.1 MiB free" in text and "--shm-size" in text


def test_leftovers_of_a_dead_owner_are_swept():
    # A process that creates objects in its own namespace and dies without cleaning up.
    code = ("import os, posix_ipc; from simpledbi import shm; ns = shm.new_namespace(); print(ns, flush=True); "
            "posix_ipc.Semaphore('/' + ns + '.x', posix_ipc.O_CREX); "
            "s = shm.Segment(shm.ns_path(ns, 'y'), 4096, create=True); os._exit(0)")
    ns = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        check=True).stdout.strip()
    assert sorted(shm.list_namespace(ns)) == sorted([ns, "sem." + ns + ".x"])
    assert os.listdir(os.path.join("/dev/shm", ns)) == ["y"]
    assert shm.sweep_dead_namespaces() >= 2
    assert shm.list_namespace(ns) == []


def test_live_owner_is_not_swept():
    ns = shm.new_namespace()
    sem = posix_ipc.Semaphore(f"/{ns}.z", posix_ipc.O_CREX)
    try:
        shm.sweep_dead_namespaces()
        assert sorted(shm.list_namespace(ns)) == sorted([ns, "sem." + ns + ".z"])
    finally:
        sem.unlink()
        sem.close()
        shm.sweep_namespace(ns)
    assert not shm.pid_alive(2**22 + 12345) and shm.pid_alive(os.getpid())


def test_namespace_directory_is_private():
    ns = shm.new_namespace()
    try:
        st = os.stat(os.path.join("/dev/shm", ns))
        assert st.st_mode & 0o777 == 0o700  # other users can neither list nor create inside
        assert len(ns.rsplit("_", 1)[1]) == 32  # 128 random bits
    finally:
        shm.sweep_namespace(ns)


def _nest(top: str, depth: int, name: str = "d" * 200) -> None:
    """A chain of ``depth`` directories under ``top`` (made with descriptors: the chain's path is
    longer than PATH_MAX), a FIFO and a symlink here and there."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(depth):
        os.mkdir(name, dir_fd=fd)
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
        if i % 300 == 0:
            os.mkfifo("fifo", dir_fd=fd)
            os.symlink("/", "root", dir_fd=fd)
    os.close(fd)


def test_remove_tree_removes_any_depth_without_following_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    top = tmp_path / "top"
    top.mkdir()
    _nest(str(top), 1500)            # deeper than the recursion limit and than PATH_MAX
    os.symlink(outside, top / "link")
    shm.remove_tree(str(top))
    assert not top.exists()
    assert (outside / "keep").read_text() == "x"   # a symlink is removed, never followed
    shm.remove_tree(str(top))        # gone already: nothing happens


def test_a_namespace_a_client_nested_deeply_is_swept_and_does_not_block_the_next_start():
    # A dead run whose namespace a client filled with a deep chain of directories:
    # shutil.rmtree raised RecursionError there, at every later Runtime start.
    code = ("import os; from simpledbi import shm; ns = shm.new_namespace(); print(ns, flush=True)")
    ns = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                        timeout=60).stdout.strip()
    _nest(os.path.join(shm.SHM_DIR, ns), 1500)
    assert shm.sweep_dead_namespaces() >= 1
    assert ns not in os.listdir(shm.SHM_DIR)


def test_semaphore_temporaries_left_by_killed_processes_are_swept():
    # glibc creates a semaphore as sem.XXXXXX, then links it to its name: a process killed in
    # between leaves the temporary. Only old, semaphore-sized regular files of that pattern go.
    names = {n: f"sem.{n}" for n in ("Zq3xY1", "Zq3xY2", "Zq3xY3")}
    paths = {n: os.path.join(shm.SHM_DIR, f) for n, f in names.items()}
    old = os.stat(shm.SHM_DIR).st_mtime - 3600
    try:
        for n in ("Zq3xY1", "Zq3xY2"):
            with open(paths[n], "wb") as f:
                f.write(bytes(32))
        os.utime(paths["Zq3xY1"], (old, old))          # orphaned an hour ago: removed
        os.mkdir(paths["Zq3xY3"])                       # not a file: kept
        os.utime(paths["Zq3xY3"], (old, old))
        other = os.path.join(shm.SHM_DIR, "sem.Zq3xY12")  # not the pattern: kept
        with open(other, "wb") as f:
            f.write(bytes(32))
        os.utime(other, (old, old))
        assert shm.sweep_semaphore_temps() >= 1
        assert not os.path.exists(paths["Zq3xY1"])
        assert os.path.exists(paths["Zq3xY2"])          # fresh: maybe inside sem_open right now
        assert os.path.isdir(paths["Zq3xY3"]) and os.path.exists(other)
    finally:
        for p in list(paths.values()) + [os.path.join(shm.SHM_DIR, "sem.Zq3xY12")]:
            shm.remove_tree(p)
