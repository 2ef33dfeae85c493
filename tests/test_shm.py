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


def test_nothing_is_removed_through_a_symlinked_directory(tmp_path):
    # A client that swaps the namespace directory for a symlink must not make the runtime
    # delete where the link points.
    real = tmp_path / "elsewhere"
    (real / "m.s0.lock").mkdir(parents=True)
    (real / "m.s0.lock" / "x").write_text("x")
    (real / "f").write_text("f")
    link = tmp_path / "ns"
    os.symlink(real, link)
    shm.remove_tree(str(link / "m.s0.lock"))
    shm.discard(str(link / "f"))
    shm.discard(str(link / "m.s0.lock"))
    assert (real / "m.s0.lock" / "x").read_text() == "x" and (real / "f").read_text() == "f"


def test_removal_gives_up_on_a_directory_that_keeps_growing(tmp_path):
    import threading
    top = tmp_path / "junk"
    top.mkdir()
    stop = threading.Event()

    def refill():   # a client that keeps adding directories while the runtime removes them
        k = 0
        while not stop.is_set():
            k += 1
            try:
                os.makedirs(top / f"d{k}" / "e", exist_ok=True)
            except OSError:
                pass

    t = threading.Thread(target=refill)
    t.start()
    try:
        done = threading.Event()
        remover = threading.Thread(target=lambda: (shm.remove_tree(str(top), budget=0.5), done.set()))
        remover.start()
        assert done.wait(30), "remove_tree did not give up on a growing directory"
    finally:
        stop.set()
        t.join(30)
    shm.remove_tree(str(top), budget=30)
    assert not top.exists()


def test_a_directory_at_a_lock_path_is_set_aside_in_constant_time(tmp_path):
    # Attach (slots._open_lock) and the reaper set junk aside with one rename, whatever is in it.
    from simpledbi.slots import _open_lock
    lock = tmp_path / "m.s0.lock"
    lock.mkdir()
    for k in range(2000):
        (lock / f"d{k}").mkdir()
    fd = _open_lock(str(lock))
    assert fd is not None
    os.close(fd)
    assert lock.is_file()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".junk.")]
    assert len(aside) == 1 and len(list(aside[0].iterdir())) == 2000


def test_another_programs_semaphore_is_never_swept():
    # A semaphore of someone else with a short name (sem.XXXXXX, like glibc's temporaries)
    # survives a runtime's start and stop.
    from simpledbi import ModelConfig, Runtime
    name = "/Zq" + os.urandom(2).hex()
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=1)
    path = os.path.join(shm.SHM_DIR, "sem." + name[1:])
    old = os.stat(path).st_mtime - 3600
    os.utime(path, (old, old))
    try:
        with Runtime([ModelConfig(name="noop", factory=_identity, device="cpu", num_threads=1)]):
            pass
        assert os.path.exists(path)
    finally:
        sem.unlink()
        sem.close()


def _identity():
    import torch
    return torch.nn.Identity()
