"""Shared fixtures: runtimes with short poll intervals, gates, and a leak check after every test."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import secrets
import signal
import threading

import numpy as np

import posix_ipc
import pytest

from simpledbi import ModelConfig, RuntimeOptions
from simpledbi.runtime import Runtime

FAST = RuntimeOptions(poll_interval=0.05, join_timeout=10.0)

# A shell starts a background job (`pytest &`, or under nohup) with SIGINT ignored, and every
# process the tests start would inherit that: the Ctrl-C tests would then test nothing. They
# start from Python's own default instead.
signal.signal(signal.SIGINT, signal.default_int_handler)


def ours(pid: int = None) -> list:
    """Entries of /dev/shm that belong to runtimes owned by ``pid`` (default: this process)."""
    tag = f"sdbi_{pid or os.getpid()}_"
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag))


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert ours() == [], "shared memory or semaphores left behind"
    assert mp.active_children() == [], "child processes left behind"


@pytest.fixture
def start_runtime():
    """``start_runtime(*configs)`` -> a started Runtime, shut down after the test."""
    with contextlib.ExitStack() as stack:
        def start(*configs, options=FAST):
            return stack.enter_context(Runtime(list(configs), options))
        yield start


class Gate:
    """Two named semaphores: a Gated model posts ``entered`` when a gated request reaches its
    forward pass, then blocks until the test calls :meth:`open`."""

    def __init__(self):
        self.name = f"/sdbitest_{os.getpid()}_{secrets.token_hex(3)}.gate"
        self._gate = posix_ipc.Semaphore(self.name, posix_ipc.O_CREX, initial_value=0)
        self._entered = posix_ipc.Semaphore(self.name + ".in", posix_ipc.O_CREX, initial_value=0)

    def wait_entered(self, timeout: float = 30.0) -> None:
        self._entered.acquire(timeout)

    def open(self) -> None:
        self._gate.release()

    def close(self) -> None:
        for sem in (self._gate, self._entered):
            sem.unlink()
            sem.close()


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.close()


@pytest.fixture
def sem_prefix():
    """A fresh prefix for test-owned semaphores; unlinks ``.arrived`` and ``.go`` afterwards."""
    prefix = f"/sdbitest_{os.getpid()}_{secrets.token_hex(3)}"
    sems = [posix_ipc.Semaphore(prefix + s, posix_ipc.O_CREX, initial_value=0) for s in (".arrived", ".go")]
    yield prefix, sems[0], sems[1]
    for s in sems:
        s.unlink()
        s.close()


def wait_queued(*handles, n: int, timeout: float = 30.0) -> None:
    """Wait until ``n`` requests of these SharedModels are sent (their datagrams in the socket's
    queue: a ticket is posted just before) and taken by no model process yet (their slots'
    tickets still posted): a bounded wait on a shared-memory condition."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(s.queued() and s.sent_seq == s.seq for h in handles for s in list(h._h.busy)) >= n:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"fewer than {n} requests were queued within {timeout} s")


def hammer_affine(model, threads: int, requests: int, max_rows: int, width: int) -> None:
    """``threads`` threads share ``model`` (an Affine model), each sending ``requests`` random
    requests of 1..max_rows rows and checking every answer is exactly its own 2x + 1."""
    errors = []

    def run(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(requests):
                x = rng.standard_normal((int(rng.integers(1, max_rows + 1)), width)).astype(np.float32)
                np.testing.assert_array_equal(model.forward(x, timeout=60), x * 2 + 1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pool = [threading.Thread(target=run, args=(seed,)) for seed in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert not any(t.is_alive() for t in pool), "a thread is still waiting"
    assert errors == [], errors


def cpu_model(name: str, factory, **kw) -> ModelConfig:
    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 1)
    return ModelConfig(name=name, factory=factory, **kw)


def stderr_lines(proc) -> "queue.Queue":
    """A process's stderr lines (None at its end), read by a thread of their own for the whole test:
    select() on a buffered text stream misses the lines that came in one read with the one before,
    and a pipe nobody reads fills and blocks the process's logging."""
    q = getattr(proc, "_lines", None)
    if q is None:
        q = proc._lines = queue.Queue()

        def read():
            for line in proc.stderr:
                q.put(line)
            q.put(None)

        threading.Thread(target=read, daemon=True).start()
    return q
