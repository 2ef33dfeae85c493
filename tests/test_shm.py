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
