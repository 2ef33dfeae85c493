"""foreign_sem: a client's semaphore used only through the kernel -- what posix_ipc sees of it, and
that a truncated semaphore file is an error, not a SIGBUS, in the process using it."""
import os
import secrets
import threading

import posix_ipc
import pytest

from simpledbi import foreign_sem
from simpledbi.foreign_sem import ForeignSemaphore, lock_segment, sem_path, unlock_segment

pytestmark = pytest.mark.skipif(not foreign_sem.supported(), reason="not glibc's 64-bit semaphore layout")


@pytest.fixture
def owned():
    """A semaphore this test owns (posix_ipc: the client's side), and a lock file for take()."""
    name = f"/sdbitest_{os.getpid()}_{secrets.token_hex(4)}.sem"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    fd = os.open(sem_path(name), os.O_RDWR)
    try:
        yield name, sem, fd
    finally:
        os.close(fd)
        sem.unlink()
        sem.close()


def test_post_value_and_take_are_what_the_owner_sees(owned):
    name, sem, fd = owned
    f = ForeignSemaphore(name)
    try:
        assert f.post() and sem.value == 1 and f.has_token()
        sem.acquire(0)                      # the owner takes what the kernel posted
        assert not f.has_token() and not f.take(fd)
        sem.release()
        sem.release()
        assert f.take(fd) and sem.value == 0   # a token is taken whole
        assert not f.take(fd)
    finally:
        f.close()


def test_take_fails_while_someone_else_holds_the_claim_lock(owned):
    name, sem, fd = owned
    other = os.open(sem_path(name), os.O_RDWR)   # another open file description: the client's
    f = ForeignSemaphore(name)
    try:
        sem.release()
        assert lock_segment(other)
        assert not f.take(fd) and sem.value == 1   # the withdrawal in progress wins
        unlock_segment(other)
        assert f.take(fd) and sem.value == 0
    finally:
        f.close()
        os.close(other)


def test_a_truncated_semaphore_is_an_error_not_a_crash(owned):
    name, sem, fd = owned
    f = ForeignSemaphore(name)
    g = ForeignSemaphore(name)
    try:
        sem.release()
        os.ftruncate(fd, 0)
        assert not f.post() and not g.post()
        assert not f.has_token() and not f.take(fd)
        with pytest.raises(ValueError):       # opened after the truncation: refused
            ForeignSemaphore(name)
        os.ftruncate(fd, foreign_sem.SEM_BYTES)   # back (its memory is zeros now): usable again
        assert f.post() and f.has_token()
    finally:
        f.close()
        g.close()


def test_it_holds_no_descriptor(owned):
    # A model process holds a handle per attached slot: a descriptor per semaphore on top of the
    # segment's doubled them, and 3 x 168 idle slots of one client then exhausted a 1024 limit.
    name, _, _ = owned
    before = len(os.listdir("/proc/self/fd"))
    sems = [ForeignSemaphore(name) for _ in range(20)]
    try:
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for f in sems:
            f.close()


def test_supported_is_never_answered_before_its_check_is_done(monkeypatch):
    # Round 18's soak: a model process's slot-finder thread and its serving thread both open
    # handles; one asked while the other ran the check, got a transient False and used
    # user-space operations while every other process used the kernel's -- two ways of taking a
    # token that do not exclude each other, so two processes took one request.
    if not foreign_sem.supported():
        pytest.skip("kernel-side semaphores are not supported on this platform")
    monkeypatch.setattr(foreign_sem, "_supported", None)
    entered, release = threading.Event(), threading.Event()
    real = foreign_sem._self_check

    def slow_check():
        entered.set()
        release.wait(10)
        return real()

    monkeypatch.setattr(foreign_sem, "_self_check", slow_check)
    answers = []
    first = threading.Thread(target=lambda: answers.append(foreign_sem.supported()))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=lambda: answers.append(foreign_sem.supported()))
    second.start()
    second.join(0.5)   # bounded: it must still be waiting for the check (it answered False before)
    release.set()
    first.join(10)
    second.join(10)
    assert answers == [True, True]
