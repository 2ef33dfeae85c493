"""Worker targets for Run-based tests. No torch import here: 12 spawned workers importing torch
on a 2-core machine would cost more than the tests themselves."""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from simpledbi import SharedModel


def affine_worker(rank, n_requests, max_rows, seed):
    model = SharedModel("affine", max_shape=(max_rows, 6, 5))
    rng = np.random.default_rng(seed + rank)
    for i in range(n_requests):
        rows = int(rng.integers(1, max_rows + 1))
        x = rng.standard_normal((rows, 6, 5)).astype(np.float32)
        y = model.forward(x)
        if y.shape != x.shape or not np.array_equal(y, x * 2 + 1):
            raise AssertionError(f"worker {rank} request {i}: wrong result")
    return n_requests


def load_worker(rank, n_requests, n_workers, name="slow"):
    model = SharedModel(name, max_shape=(1, 256))
    # Start line: one request each, then wait until the model process has seen every worker,
    # so the load really overlaps (on a busy 2-core machine one worker can otherwise finish
    # before the next one has even started).
    model.forward(np.zeros((1, 256), np.float32))
    deadline = time.monotonic() + 60
    while model.ctl.all_instances["clients"].max() < n_workers and time.monotonic() < deadline:
        threading.Event().wait(0.01)  # a bounded wait on a shared-memory condition
    rng = np.random.default_rng(rank)
    for _ in range(n_requests):
        x = rng.standard_normal((1, 256)).astype(np.float32)
        np.testing.assert_allclose(model.forward(x), x * 2 + 1, rtol=1e-6, atol=1e-6)
    return model.stats()


def mixed_shape_worker(rank):
    model = SharedModel("affine", max_shape=(2, 8, 8))
    rng = np.random.default_rng(rank)
    for _ in range(60):
        h, w = (int(v) for v in rng.integers(1, 9, 2))
        x = rng.standard_normal((int(rng.integers(1, 3)), h, w)).astype(np.float32)
        np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
    return True


def two_models_worker(rank):
    a = SharedModel("affine", max_shape=(1, 4))
    m = SharedModel("mean", max_shape=(1, 2, 3, 3))
    x = np.full((1, 4), rank, np.float32)
    img = np.full((1, 2, 3, 3), rank, np.float32)
    for _ in range(20):
        np.testing.assert_array_equal(a.forward(x), x * 2 + 1)
        np.testing.assert_allclose(m.forward(img), np.full((1, 2), rank, np.float32))
    return a.stats()["requests"], m.stats()["requests"]


def light_client(namespace, name, n_requests, conn):
    """One thread, ``n_requests`` calls one after another; sends back the seconds they took."""
    model = SharedModel(name, max_shape=(1, 4), namespace=namespace)
    x = np.ones((1, 4), np.float32)
    model.forward(x)
    conn.send("ready")
    conn.recv()   # go
    t0 = time.monotonic()
    for _ in range(n_requests):
        np.testing.assert_array_equal(model.forward(x, timeout=60), x * 2 + 1)
    conn.send(time.monotonic() - t0)
    model.close()


def sigterm_handler_worker(rank):
    """What SIGTERM does in this worker (a forked one inherited Run's handler, which raised)."""
    import signal
    return repr(signal.getsignal(signal.SIGTERM))


def waiting_to_send(pid):
    """Threads of process ``pid`` asleep in the kernel in a send: for room in a Unix socket's queue,
    or in their own socket's send buffer (a sleeping thread's wchan names the kernel function)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                if f.read().strip() in ("unix_wait_for_peer", "sock_alloc_send_pskb", "sock_wait_for_wmem"):
                    out.append(tid)
        except OSError:
            pass
    return out


def one_call_client(namespace, name, conn):
    """Attaches (one call to warm up); on "go" makes one call, says "sent" once its datagram is in
    the model's queue (or its thread waits in the kernel to send it), and sends back when the call
    returned (time.monotonic, comparable across processes)."""
    model = SharedModel(name, max_shape=(1, 4), namespace=namespace)
    x = np.full((1, 4), 7, np.float32)
    model.forward(x, timeout=60)
    conn.send("ready")
    conn.recv()   # go
    out = {}

    def call():
        out["y"] = model.forward(x, timeout=60)
        out["t"] = time.monotonic()
    go = time.monotonic()
    t = threading.Thread(target=call)
    t.start()
    deadline = go + 30
    while not (any(s.published > go and s.sent_seq == s.seq for s in list(model._h.busy))
               or waiting_to_send(os.getpid())):
        assert time.monotonic() < deadline, "the call was never sent"
        threading.Event().wait(0.001)   # polls a condition of this process
    conn.send("sent")
    t.join(60)
    np.testing.assert_array_equal(out["y"], x * 2 + 1)
    conn.send(out["t"])
    model.close()
