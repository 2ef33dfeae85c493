"""Shared-memory housekeeping: sealed segments, the slot size check and the sweeping of dead runs'
leftovers."""
import os
import subprocess
import sys

import posix_ipc
import pytest

from simpledbi import shm

def test_a_segment_is_a_memfd_nobody_can_resize_and_attach_refuses_anything_else(tmp_path):
    seg = shm.Segment.create_memfd("t", 3 * 4096, link=str(tmp_path / "t.ctl"))
    try:
        for size in (0, 4096, 10 * 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, size)
        other = shm.Segment.attach(str(tmp_path / "t.ctl"), readonly=True)
        assert other.size == 3 * 4096
        other.close()
    finally:
        seg.close()
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(4096))
    with pytest.raises(OSError, match="not a sealed simpledbi memfd"):
        shm.Segment.attach(str(plain))
    unsealed = os.memfd_create("u")
    os.ftruncate(unsealed, 4096)
    try:
        with pytest.raises(OSError, match="not a sealed simpledbi memfd"):
            shm.Segment.attach(f"/proc/self/fd/{unsealed}")
    finally:
        os.close(unsealed)


def test_max_shape_larger_than_memory_is_refused_up_front_naming_the_size():
    from simpledbi.inputs import _check_slot_size
    import numpy as np
    for shape in ((1, 2**40, 2**40), (1, 10**12), (2**64,)):
        with pytest.raises(ValueError, match=r"needs a slot of [\d,]+ bytes .* more than this machine's memory"):
            _check_slot_size([shape], [np.dtype("float32")])
    _check_slot_size([(32, 3, 224, 224)], [np.dtype("float32")])


def test_leftovers_of_a_dead_owner_are_swept():
    # A process that creates its namespace, a socket and a link in it, and dies without cleaning up.
    code = ("import os, socket; from simpledbi import shm; ns = shm.new_namespace(); print(ns, flush=True); "
            "socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).bind(shm.ns_path(ns, 'm.sock')); "
            "s = shm.Segment.create_memfd('y', 4096, link=shm.ns_path(ns, 'm.ctl')); os._exit(0)")
    ns = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        check=True).stdout.strip()
    assert sorted(os.listdir(os.path.join("/dev/shm", ns))) == ["m.ctl", "m.sock"]
    assert shm.sweep_dead_namespaces() >= 1
    assert not os.path.lexists(os.path.join("/dev/shm", ns))


def test_live_owner_is_not_swept():
    ns = shm.new_namespace()
    try:
        shm.sweep_dead_namespaces()
        assert os.path.isdir(os.path.join("/dev/shm", ns))
    finally:
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
    shm.remove_tree(str(link / "f"))
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
