"""No client can hurt the runtime or another client: kill, time out, close from another thread,
scribble, truncate, fork, SIGSTOP, forged datagrams, another user.

Each test ends by checking that an honest client is still served correctly and that no model
process was restarted (except where a test kills one on purpose); with a long ``wait_time``, that
a lone client's call is not held back by slots nobody uses any more.
"""
import asyncio
import contextlib
import functools
import os
import pwd
import signal
import socket
import struct
import subprocess
import collections
import sys
import threading
import time

import numpy as np
import pytest

from simpledbi import ModelError, ModelProcessDied, Runtime, RuntimeStopped, SharedModel
from simpledbi import client as client_module, futex, shm
from simpledbi import inspect as inspect_runtime
from simpledbi.status import format_status
from simpledbi.layout import (BROKEN, PUB_SEQ_OFF, REQ_MAGIC, REQ_PREFIX, STOPPING,
                              socket_path)

from . import models
from .conftest import FAST, cpu_model, wait_queued

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE_WAIT = 1.0  # the most ModelConfig allows (a 1-row batch closes at once whatever it is)


def _pids(rt, name):
    return [int(p) for p in rt.ctls[name].instances["pid"]]


def _clients(rt, name):
    """Client slots the model's processes map (each drops those of detached or dead clients)."""
    return int(rt.ctls[name].instances["clients"].max())


def _honest(rt, name, value=3.0, rows=1, width=2, timeout=10.0):
    """A fresh client alone on the model gets exactly its answer, fast."""
    with SharedModel(name, max_shape=(rows, width), namespace=rt.namespace) as m:
        x = np.full((rows, width), value, np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=timeout), x * 2 + 1)


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        threading.Event().wait(0.01)  # bounded wait on a shared-memory condition


def _gated_call(m, gate):
    """Start a call that blocks inside the model's forward pass; returns (thread, outcome dict)."""
    outcome = {}

    def call():
        try:
            outcome["y"] = m.forward(np.full((1, 2), models.GATE, np.float32))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["e"] = e

    t = threading.Thread(target=call)
    t.start()
    gate.wait_entered()
    return t, outcome


def _client_code(rt, body):
    return ("import os, signal, numpy as np; from simpledbi import SharedModel; "
            f"m = SharedModel('gated', max_shape=(1, 2), namespace={rt.namespace!r}); " + body)


def _gated(rt_start, gate, **kw):
    kw.setdefault("max_batch_size", 1)
    kw.setdefault("wait_time", HUGE_WAIT)
    return rt_start(cpu_model("gated", functools.partial(models.gated, gate.name), **kw))


def _send_raw(m, mutate=None, post_ticket=True):
    """Publish a request of handle ``m`` (one idle slot, last used for a (1, 2) call of 1.0s)
    by hand: its datagram goes through ``mutate(bytes) -> bytes`` first. Returns the slot and
    the seq to wait for."""
    slot = m._h.idle[0]
    slot.seq += 1
    seq = slot.seq
    struct.pack_into("<q", slot.seg.buf, PUB_SEQ_OFF, seq)
    if post_ticket:
        futex.offer(slot._ticket)
    msg = bytearray(slot._msg)
    struct.pack_into("<q", msg, 16, seq)
    msg = bytes(msg) if mutate is None else mutate(bytes(msg))
    m._h.sock.send(msg)
    return slot, seq


# ---------------------------------------------------------------- killed, timed out, closed
def test_timeout_then_close_on_a_first_request_does_not_kill_the_model(start_runtime, gate):
    rt = _gated(start_runtime, gate)
    pids = _pids(rt, "gated")
    b = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    np.testing.assert_array_equal(b.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    a = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    with pytest.raises(TimeoutError, match="being computed"):
        a.forward(np.full((1, 2), models.GATE, np.float32), timeout=0.3)
    a.close()                 # its slot is closed while the model holds its request
    gate.open()               # the model now answers a client that is gone
    np.testing.assert_array_equal(b.forward(np.ones((1, 2), np.float32), timeout=10), np.full((1, 2), 3.0))
    b.close()
    _honest(rt, "gated", timeout=5)
    assert _pids(rt, "gated") == pids and rt.ctls["gated"].instances["restarts"].sum() == 0


def test_client_killed_during_its_first_request_does_not_kill_the_model(start_runtime, gate):
    rt = _gated(start_runtime, gate)
    pids = _pids(rt, "gated")
    proc = subprocess.Popen([sys.executable, "-c", _client_code(
        rt, f"m.forward(np.full((1, 2), {models.GATE}, np.float32))")], cwd=ROOT)
    try:
        gate.wait_entered()
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    gate.open()
    _wait_for(lambda: _clients(rt, "gated") == 0)  # its slot dropped once answered
    _honest(rt, "gated", timeout=5)
    assert _pids(rt, "gated") == pids


def test_a_client_killed_while_its_request_is_queued_costs_nothing(start_runtime, gate):
    """A request sent, then its client SIGKILLed before any model process took it: the model
    process finds a slot nobody can be answered in (or answers a memfd that died with its
    process) and goes on."""
    rt = _gated(start_runtime, gate)
    pids = _pids(rt, "gated")
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, outcome = _gated_call(m, gate)
    proc = subprocess.Popen([sys.executable, "-c", _client_code(
        rt, "print('SENDING', flush=True); m.forward(np.ones((1, 2), np.float32))")], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SENDING"
        _wait_for(lambda: _sock_has_datagram(rt, "gated"))
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    gate.open()
    t.join(30)
    np.testing.assert_array_equal(outcome["y"], np.full((1, 2), models.GATE * 2 + 1, np.float32))
    m.close()
    _honest(rt, "gated", timeout=5)
    assert _pids(rt, "gated") == pids


def _sock_has_datagram(rt, name):
    try:
        rt.sockets[name].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return True
    except BlockingIOError:
        return False


def test_a_late_answer_never_overwrites_a_newer_request(start_runtime, gate):
    rt = _gated(start_runtime, gate)
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(TimeoutError, match="being computed"):
            m.forward(np.full((1, 2), models.GATE, np.float32), timeout=0.2)
        # The stale slot is not lent again before its late answer: this call takes another one,
        # queues behind the gated request and is answered after it.
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("y", m.forward(np.full((1, 2), 4.0, np.float32), timeout=30)))
        t.start()
        wait_queued(m, n=1)
        gate.open()
        t.join(30)
        np.testing.assert_array_equal(result["y"], np.full((1, 2), 9.0, np.float32))
        for v in (5.0, 6.0, 7.0):  # the stale slot is reused once settled; answers stay exact
            x = np.full((1, 2), v, np.float32)
            np.testing.assert_array_equal(m.forward(x, timeout=5), x * 2 + 1)
    _honest(rt, "gated", timeout=5)


def test_a_withdrawn_request_never_runs(start_runtime, gate):
    """Timed out while queued: taken back. When a model process gets to its datagram, there is
    no ticket: the model never sees it (stats()['withdrawn'] counts it)."""
    rt = _gated(start_runtime, gate, max_batch_size=4, wait_time=0.001)
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        t, outcome = _gated_call(m, gate)
        for v in (11.0, 12.0, 13.0):
            with pytest.raises(TimeoutError, match="withdrawn before any model process took it"):
                m.forward(np.full((1, 2), v, np.float32), timeout=0.05)
        before = m.stats()["rows"]
        gate.open()
        t.join(30)
        x = np.full((1, 2), 2.0, np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
        _wait_for(lambda: m.stats()["withdrawn"] == 3)
        assert m.stats()["rows"] == before + 2   # the gated request and the last one: nothing else ran


@pytest.mark.timeout(180)
def test_random_timeouts_never_hang_a_caller(start_runtime):
    rt = start_runtime(cpu_model("slow", models.slow, max_batch_size=4, model_num=2, wait_time=0.002))
    model = SharedModel("slow", max_shape=(1, 256), namespace=rt.namespace)
    errors, done = [], []

    def run(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                x = rng.standard_normal((1, 256)).astype(np.float32)
                timeout = [None, 5.0, float(rng.uniform(0.0, 0.003))][int(rng.integers(0, 3))]
                try:
                    y = model.forward(x, timeout=timeout)
                except TimeoutError:
                    continue
                np.testing.assert_allclose(y, x * 2 + 1, rtol=1e-6)
            done.append(seed)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a caller hangs"
    assert errors == [] and sorted(done) == list(range(8))
    model.close()
    _honest(rt, "slow", width=256)


def test_close_from_another_thread_ends_the_call_with_runtime_stopped(start_runtime, gate):
    rt = _gated(start_runtime, gate)
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, outcome = _gated_call(m, gate)
    m.close()
    t.join(10)
    assert not t.is_alive() and isinstance(outcome.get("e"), RuntimeStopped), outcome
    assert not m._h.busy and not m._h.idle  # the slot went back when the call ended
    with pytest.raises(RuntimeStopped):
        m.forward(np.ones((1, 2), np.float32))
    gate.open()
    _honest(rt, "gated", timeout=5)
    _wait_for(lambda: _clients(rt, "gated") == 0)


def _fill_the_queue(rt, gate, m, start):
    """Hold the model process in a gated forward pass and start calls of handle ``m`` (``start(k)``)
    until it can send no more (its socket's send buffer or the model's queue is full: the same wait,
    client._SEND_BUFFER) and two more wait for room: the blocker, (its thread, outcome), and how
    many of the calls were sent."""
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    if qlen > 64:
        pytest.skip(f"net.unix.max_dgram_qlen is {qlen}: too many threads to fill it")
    blocker = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    held = _gated_call(blocker, gate)
    for k in range(qlen + 3):   # (the kernel queues up to qlen + 1)
        start(k)
    wait_queued(m, n=1)
    _wait_for(lambda: sum(s.seq != s.sent_seq for s in list(m._h.busy)) >= 2)   # published, unsent
    return blocker, held, sum(s.seq == s.sent_seq for s in list(m._h.busy))


def test_close_ends_the_calls_waiting_for_room_in_a_full_queue(start_runtime, gate):
    """close() from another thread ends a call that waits for room in the model's full socket queue
    too (RuntimeStopped, its request taken back), not only those already sent -- not when room comes."""
    rt = _gated(start_runtime, gate, max_batch_size=1, wait_time=0.001)
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    outcomes, threads = {}, []

    def call(k):
        try:
            outcomes[k] = m.forward(np.full((1, 2), float(k), np.float32))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcomes[k] = e

    def start(k):
        threads.append(threading.Thread(target=call, args=(k,)))
        threads[-1].start()

    blocker, (t, _), _ = _fill_the_queue(rt, gate, m, start)
    m.close()
    for th in threads:
        th.join(10)    # the gated batch still runs: room never comes meanwhile
    assert not any(th.is_alive() for th in threads), "a call of a closed handle waits for room"
    assert all(isinstance(e, RuntimeStopped) for e in outcomes.values()), outcomes
    gate.open()
    t.join(30)
    _honest(rt, "gated", timeout=5)   # its datagram comes after theirs
    assert blocker.stats()["rows"] == 2    # the gated request and the honest one: nothing else ran
    blocker.close()


def test_a_cancelled_forward_async_waiting_for_room_in_a_full_queue_never_runs(start_runtime, gate):
    """Cancelling forward_async tasks whose calls wait for room in the model's full socket queue:
    every call ends and none of their requests ever runs. (A datagram the handle's sender thread
    had already handed to the kernel may still reach a model process once there is room: it takes
    nothing for it, and counts it withdrawn.)"""
    import asyncio
    rt = _gated(start_runtime, gate, max_batch_size=1, wait_time=0.001)
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        async def main():
            tasks = []
            start = lambda k: tasks.append(asyncio.ensure_future(   # noqa: E731
                m.forward_async(np.full((1, 2), float(k), np.float32))))
            held = await asyncio.to_thread(_fill_the_queue, rt, gate, m, lambda k: loop.call_soon_threadsafe(start, k))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return held

        loop = asyncio.new_event_loop()
        try:
            blocker, (t, _), sent = loop.run_until_complete(main())
        finally:
            loop.close()
        _wait_for(lambda: not m._h.busy, timeout=10)   # the gated batch still runs
        gate.open()
        t.join(30)
        x = np.full((1, 2), 3.0, np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
        _wait_for(lambda: m.stats()["withdrawn"] >= sent)
        assert m.stats()["rows"] == 2   # the gated request and the last one, nothing else
        calls = int(open("/proc/sys/net/unix/max_dgram_qlen").read()) + 3   # (_fill_the_queue's)
        assert m.stats()["withdrawn"] <= calls   # each counted once at most
        blocker.close()


def test_threads_that_come_and_go_do_not_keep_slots(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, max_clients=8))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        for wave in range(15):  # 60 threads in all, 4 at a time, each used once and gone
            threads = [threading.Thread(target=lambda v=float(wave * 4 + i): np.testing.assert_array_equal(
                m.forward(np.full((1, 2), v, np.float32), timeout=30), np.full((1, 2), 2 * v + 1)))
                for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert len(m._h.idle) + len(m._h.busy) <= 4  # one slot per call in flight, not per thread
        assert _clients(rt, "affine") <= 4
    _wait_for(lambda: _clients(rt, "affine") == 0)


@pytest.mark.timeout(120)
def test_a_model_process_short_of_descriptors_takes_newcomers_in_place_of_idle_slots(start_runtime):
    # Each mapped slot holds a descriptor in the model process. Under a descriptor limit below
    # max_clients, the slot after the last descriptor could not be opened: its request was dropped
    # and the caller waited out its timeout (forever without one). The process now holds at most
    # the slots its limit allows, so an idle one makes room as at max_clients.
    rt = start_runtime(cpu_model("affine", functools.partial(models.few_descriptors, 48), max_batch_size=4))
    with contextlib.ExitStack() as handles:
        _newcomers_left_idle(rt, handles, 80)
        assert _clients(rt, "affine") < 48


@pytest.mark.timeout(120)
def test_a_model_that_opens_files_after_start_up_still_answers_every_newcomer(start_runtime):
    # Slots are sized to the descriptor limit at start-up: a model that opened 40 files at its first
    # batch left the process out of descriptors, and each newcomer's request was dropped (helper-47:
    # 40 calls waited out their 15 s timeout). Now an idle slot makes room, or the newcomer is
    # answered "full" on a descriptor held in reserve.
    rt = start_runtime(cpu_model("affine", functools.partial(models.leaky, 48, 40), max_batch_size=4))
    with contextlib.ExitStack() as handles:
        _newcomers_left_idle(rt, handles, 30)


def _newcomers_left_idle(rt, handles: contextlib.ExitStack, n: int) -> None:
    """``n`` handles one after another, each a slot of its own: one call, then kept open and idle."""
    for i in range(n):
        m = handles.enter_context(SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace))
        x = np.full((1, 2), float(i), np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)


def test_a_client_stopped_with_sigstop_holds_up_nobody(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.01))
    code = ("import sys, numpy as np; from simpledbi import SharedModel; "
            f"m = SharedModel('affine', max_shape=(1, 2), namespace={rt.namespace!r}); "
            "x = np.ones((1, 2), np.float32); print('RUNNING', flush=True)\n"
            "while True:\n    assert (m.forward(x, timeout=60) == 3).all()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "RUNNING"
        proc.send_signal(signal.SIGSTOP)
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
            for v in range(50):
                x = np.full((1, 2), float(v), np.float32)
                np.testing.assert_array_equal(m.forward(x, timeout=5), x * 2 + 1)
        proc.send_signal(signal.SIGCONT)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(30)
    _honest(rt, "affine")


def test_a_handle_used_across_fork_gives_each_process_its_own_answers(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001))
    m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    pid = os.fork()
    if pid == 0:   # the child: its own slots, its own answers, then out without cleanup
        code = 0
        try:
            for v in range(100):
                x = np.full((1, 2), 1000.0 + v, np.float32)
                if not np.array_equal(m.forward(x, timeout=10), x * 2 + 1):
                    code = 1
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    for v in range(100):
        x = np.full((1, 2), float(v), np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    m.close()
    _honest(rt, "affine")


def test_a_fork_while_another_thread_holds_the_handles_locks_leaves_the_child_a_working_handle(start_runtime):
    # Another thread of the parent inside borrow()/give_back() (or re-attaching) at the moment of
    # fork: the child, which has only the forking thread, must not inherit those locks held.
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001))
    m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    np.testing.assert_array_equal(asyncio.run(m.forward_async(np.ones((1, 2), np.float32), timeout=10)),
                                  np.full((1, 2), 3.0))   # (the parent's async pool has threads)
    with m._h.lock, m._attach_lock, client_module._async_pool_lock:   # as threads of the parent hold them
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)   # a deadlocked child dies of SIGALRM instead of hanging the test
            code = 3
            try:
                x = np.full((1, 2), 7.0, np.float32)
                out = asyncio.run(m.forward_async(x, timeout=10))
                code = 0 if np.array_equal(m.forward(x, timeout=10), x * 2 + 1) and \
                    np.array_equal(out, x * 2 + 1) else 1
                m.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32), timeout=10), np.full((1, 2), 3.0))
    m.close()
    _honest(rt, "affine")


# ---------------------------------------------------------------- scribbled, truncated, forged
def test_control_block_is_read_only_and_cannot_be_truncated(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine))
    pids = _pids(rt, "affine")
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(ValueError, match="read-only"):
            m.ctl.hdr["state"] = STOPPING
        with pytest.raises(ValueError, match="read-only"):
            m.ctl.held["seq"][0, 0] = 5
        # any file a client can open: the control block is a sealed memfd (the kernel refuses to
        # shrink or grow it); the socket cannot be opened as a file at all
        fd = os.open(os.path.join("/dev/shm", rt.namespace, "affine.ctl"), os.O_RDWR)
        try:
            for size in (0, 100, 10**9):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        finally:
            os.close(fd)
        with pytest.raises(OSError):
            os.open(socket_path(rt.namespace, "affine"), os.O_RDWR | os.O_NONBLOCK)
        np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    assert _pids(rt, "affine") == pids


def test_a_client_cannot_shrink_its_own_slot(start_runtime):
    """Slots are memfds sealed against shrinking: truncating one fails in the client, so no model
    process mapping it can ever get a SIGBUS; growing it (sparse) changes nothing for anyone."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=2, wait_time=0.001))
    pids = _pids(rt, "affine")
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        m.forward(x)
        slot = m._h.idle[0]
        for size in (0, 100, 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(slot.seg.fd, size)
        os.ftruncate(slot.seg.fd, 1 << 34)   # 16 GiB of holes: nobody pays for them
        for v in range(5):
            x = np.full((1, 2), float(v), np.float32)
            np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
    _honest(rt, "affine")
    assert _pids(rt, "affine") == pids


def test_a_slot_grown_to_a_petabyte_costs_nobody_anything(start_runtime):
    """A client grows its own slot to 1 PiB of holes (the seals allow growing), then asks for
    outputs larger than its slot: the model process maps only what the answer needs (mapping
    the whole file failed and left it writing through an unmapped address: SIGSEGV)."""
    rt = start_runtime(cpu_model("expand", models.expand, max_batch_size=4, wait_time=0.001))
    pids = _pids(rt, "expand")
    with SharedModel("expand", max_shape=(4, 16), namespace=rt.namespace) as m:
        x = np.ones((1, 16), np.float32)
        assert m.forward(x, timeout=10).shape == (1, 1024)
        os.ftruncate(m._h.idle[0].seg.fd, 1 << 50)
        x = np.arange(64, dtype=np.float32).reshape(4, 16)
        np.testing.assert_array_equal(m.forward(x, timeout=10), np.repeat(x, 64, axis=1))
    with SharedModel("expand", max_shape=(4, 16), namespace=rt.namespace) as honest:
        x = np.full((4, 16), 2.0, np.float32)
        np.testing.assert_array_equal(honest.forward(x, timeout=10), np.repeat(x, 64, axis=1))
    assert _pids(rt, "expand") == pids


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.timeout(120)
def test_slots_grown_before_their_first_request_cost_the_model_no_address_space(start_runtime):
    """Clients grow their slots to 1 TiB each before the first request: the model process maps
    what a request reads, not the file (mapping 80 such slots left it no room to map a new
    client's, whose calls were then dropped unanswered)."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001))
    pid = _pids(rt, "affine")[0]
    before = _vm_size(pid)
    handles = [SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) for _ in range(8)]
    try:
        for k, m in enumerate(handles):
            os.ftruncate(m._h.idle[0].seg.fd, 1 << 40)   # before any model process opened it
            x = np.full((1, 2), float(k), np.float32)
            np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
        assert _vm_size(pid) - before < 8 << 30   # (8 TiB mapped, before)
    finally:
        for m in handles:
            m.close()
    _honest(rt, "affine")


def test_what_a_client_puts_at_the_runtimes_paths_hangs_nobody_and_stops_no_restart(start_runtime):
    """A same-user process removes the model's socket, binds one of its own at its path, or
    replaces the link to its control block: new clients get a clear error at once (they
    waited forever on the impostor socket), attached clients go on, and a model process that
    dies is restarted (a restarted process reopened the control block by its path: never again)."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001,
                                 restart_backoff=0.01))
    d = os.path.join("/dev/shm", rt.namespace)
    x = np.ones((1, 2), np.float32)
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as attached:
        attached.forward(x)
        sock_path = os.path.join(d, "affine.sock")
        os.rename(sock_path, sock_path + ".real")
        with pytest.raises(RuntimeError, match="request socket .* is missing"):
            SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
        impostor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        impostor.bind(sock_path)
        try:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="not the runtime's request socket"):
                SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
            assert time.monotonic() - t0 < 5
        finally:
            impostor.close()
            os.unlink(sock_path)
            os.rename(sock_path + ".real", sock_path)
        ctl_path = os.path.join(d, "affine.ctl")
        target = os.readlink(ctl_path)
        os.unlink(ctl_path)
        with open(ctl_path, "wb") as f:
            f.write(bytes(4096))
        try:
            with pytest.raises(RuntimeError, match="not a sealed simpledbi memfd"):
                SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
            old = _pids(rt, "affine")[0]
            os.kill(old, signal.SIGKILL)
            _wait_for(lambda: rt.ctls["affine"].instances["restarts"].sum() == 1 and
                      shm.pid_alive(_pids(rt, "affine")[0]) and _pids(rt, "affine")[0] != old and
                      int(rt.ctls["affine"].instances["state"][0]) == 1, timeout=120)
            for v in range(5):
                y = np.full((1, 2), float(v), np.float32)
                np.testing.assert_array_equal(attached.forward(y, timeout=30), y * 2 + 1)
        finally:
            os.unlink(ctl_path)
            os.symlink(target, ctl_path)
    _honest(rt, "affine")


_EVIL = [0, 1, -1, 7, 2**31, 2**31 - 1, 2**40, 2**62, 2**63 - 1, -2**63, 10**6, 1000,
         int(np.float64(np.nan).view(np.int64)), int(np.float64(np.inf).view(np.int64))]


@pytest.mark.timeout(300)
def test_fuzz_a_client_scribbling_on_its_slot_and_its_datagrams(start_runtime):
    """Thousands of random mutations of a hostile client's own slot (semaphores, published seq,
    claim and response words, magic, token) and of the words and bytes of its datagrams: the
    model processes survive every one, the hostile client gets an answer or a typed error, and
    an honest client keeps getting exact answers."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, model_num=2, wait_time=0.001))
    pids = _pids(rt, "affine")
    honest = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)
    rng = np.random.default_rng(7)
    outcomes = {}
    hostile = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)

    def evil():
        return _EVIL[int(rng.integers(0, len(_EVIL)))] if rng.random() < 0.7 else int(rng.integers(-2**62, 2**62))

    def mutate(msg: bytes) -> bytes:
        b = bytearray(msg)
        for _ in range(int(rng.integers(1, 3))):
            r = rng.random()
            if r < 0.6:
                j = int(rng.integers(0, len(b) // 8)) * 8
                b[j:j + 8] = np.int64(evil()).tobytes()
            elif r < 0.8:
                b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
            elif r < 0.9:
                b = b[:int(rng.integers(0, len(b)))]
            else:
                b += bytes(int(rng.integers(1, 64)))
        return bytes(b)

    for i in range(1500):
        hostile.forward(np.ones((1, 3), np.float32), timeout=5)  # a clean slot to scribble on
        slot = hostile._h.idle[0]
        seg = np.frombuffer(slot.seg.buf, np.int64, count=64)
        if rng.random() < 0.4:
            for _ in range(int(rng.integers(1, 3))):
                seg[int(rng.integers(0, 64))] = evil()   # the slot's first 512 bytes, its own
        del seg
        try:
            s, seq = _send_raw(hostile, mutate if rng.random() < 0.8 else None)
            deadline = time.monotonic() + 0.3
            while not s.wait(seq, 0.02) and time.monotonic() < deadline:
                pass
            kind = "answered" if s.answered(seq) else "no answer"
        except (ValueError, OSError, TimeoutError, ModelProcessDied, RuntimeStopped, ModelError) as e:
            kind = type(e).__name__
        outcomes[kind] = outcomes.get(kind, 0) + 1
        hostile.close()   # start afresh: the slot may be stale or wrecked
        hostile = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)
        if i % 20 == 0:
            h = rng.standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_array_equal(honest.forward(h, timeout=10), h * 2 + 1)
    hostile.close()
    honest.close()
    assert _pids(rt, "affine") == pids, "a model process died"
    assert rt.ctls["affine"].state not in (STOPPING, BROKEN)
    assert rt.ctls["affine"].counters["bad_requests"].sum() > 100, outcomes   # rejected, answered
    _honest(rt, "affine", width=3, timeout=5)


def test_datagrams_from_a_raw_socket_cost_nothing(start_runtime):
    """Garbage of every length, wake-ups that are not the runtime's, requests naming
    descriptors that are not slots (stdin, a regular file, an unsealed memfd, a socket),
    tokens that do not match: dropped or answered, never a crash; an honest client is served."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001))
    pids = _pids(rt, "affine")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect(socket_path(rt.namespace, "affine"))
    rng = np.random.default_rng(3)
    plain = os.memfd_create("plain")          # a memfd without seals
    os.ftruncate(plain, 1 << 16)
    path = os.path.join(ROOT, "tests", "__init__.py")
    regular = os.open(path, os.O_RDONLY)
    try:
        for n in (0, 1, 7, 8, 40, 56, 57, 100, 1000, 4000):
            s.send(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        s.send(struct.pack("<I", 0x53444257) + bytes(60))   # a wake-up, not from the runtime
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
            x = np.ones((1, 2), np.float32)
            m.forward(x)
            layout = m._h.idle[0]._msg[REQ_PREFIX.size:]
            for fd in (0, 1, 2, regular, plain, s.fileno(), 9999, -1):
                for token in (0, 1, 2**64 - 1):
                    s.send(REQ_PREFIX.pack(REQ_MAGIC, fd, token, 1, 1, time.monotonic(), 0.0, 0, 0) + layout)
            for v in range(20):
                x = np.full((1, 2), float(v), np.float32)
                np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
    finally:
        os.close(plain)
        os.close(regular)
        s.close()
    _honest(rt, "affine")
    assert _pids(rt, "affine") == pids


def test_a_datagram_naming_another_clients_slot_reaches_only_the_senders_own(start_runtime, gate):
    """The pid that opens a slot is the kernel's word: a client that copies a victim's
    descriptor number and token into its datagram names a descriptor of its own table (or
    nothing), never the victim's slot."""
    rt = _gated(start_runtime, gate, max_batch_size=4, wait_time=0.001)
    victim = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    victim.forward(np.ones((1, 2), np.float32))
    vslot = victim._h.idle[0]
    code = (f"import socket, struct, time, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            f"s.connect({socket_path(rt.namespace, 'gated')!r}); msg = bytes.fromhex(sys.argv[1]); "
            "[s.send(msg) for _ in range(50)]; print('SENT', flush=True)")
    forged = bytearray(vslot._msg)
    struct.pack_into("<q", forged, 16, vslot.seq + 1)
    out = subprocess.run([sys.executable, "-c", code, bytes(forged).hex()], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "SENT" in out.stdout, out.stderr
    x = np.full((1, 2), 5.0, np.float32)
    np.testing.assert_array_equal(victim.forward(x, timeout=10), x * 2 + 1)
    assert victim.stats()["requests"] == 2
    victim.close()


def test_a_request_over_unwritten_pages_is_refused_before_it_costs_the_model_memory(start_runtime):
    """A slot of holes costs its client nothing; staging its 'inputs' would cost the model
    process their full size. Such a request gets a ValueError; the model's memory stays put."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    pid = _pids(rt, "affine")[0]
    width = 32 * 2**20   # 128 MiB of float32 in one row

    def peak_rss_mib():
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    before = peak_rss_mib()
    with SharedModel("affine", max_shape=(1, width), namespace=rt.namespace) as liar:
        liar.forward(np.zeros((1, 1), np.float32))
        slot, seq = _send_raw(liar, lambda msg: msg[:-8] + struct.pack("<q", width))
        assert slot.wait(seq, 30)
        status, text, _ = slot.response()
        assert "unwritten pages" in text, text
    assert peak_rss_mib() - before < 64, (before, peak_rss_mib())
    _honest(rt, "affine")


@pytest.mark.parametrize("marker,words", [(models.COMPLEX, "complex128"),
                                          (models.TOO_MANY_DIMS, "11 dimensions"),
                                          (models.BAD_STR, "_Unprintable")])
def test_outputs_the_runtime_cannot_describe_give_model_error(start_runtime, marker, words):
    rt = start_runtime(cpu_model("weird", models.weird, max_batch_size=2))
    pids = _pids(rt, "weird")
    with SharedModel("weird", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(ModelError, match=words):
            m.forward(np.full((1, 2), marker, np.float32), timeout=30)
    _honest(rt, "weird")
    assert _pids(rt, "weird") == pids


# ---------------------------------------------------------------- dead model processes
def test_dead_model_process_is_restarted_and_its_callers_told_at_once(start_runtime, gate):
    rt = _gated(start_runtime, gate, model_num=2, wait_time=0.001, restart_backoff=0.01)
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, outcome = _gated_call(m, gate)
    inst = rt.ctls["gated"].instances
    claimer = int(inst["pid"][inst["held"] > 0][0])
    os.kill(claimer, signal.SIGKILL)
    t.join(5)  # told at once (the supervisor answers what it held), not after a timeout
    assert not t.is_alive() and isinstance(outcome.get("e"), ModelProcessDied), outcome
    assert str(claimer) in str(outcome["e"]) and outcome["e"].exitcode == -signal.SIGKILL
    assert m.stats()["died"] == 1   # counted before its caller woke (it was counted nowhere)
    assert "died 1" in format_status(inspect_runtime(namespace=rt.namespace))
    x = np.full((1, 2), 2.0, np.float32)
    np.testing.assert_array_equal(m.forward(x, timeout=30), x * 2 + 1)  # the survivor serves
    _wait_for(lambda: rt.ctls["gated"].instances["restarts"].sum() == 1 and claimer not in _pids(rt, "gated")
              and all(shm.pid_alive(p) for p in _pids(rt, "gated")), timeout=120)  # a fresh process loads torch
    m.close()
    for v in range(4):
        _honest(rt, "gated", value=float(v))


@pytest.mark.timeout(240)
def test_close_from_another_thread_as_a_named_call_starts_raises_runtime_stopped():
    """(It raised TypeError or ValueError, ~1% of the time: the call read the control block close() had
    just closed -- helper-40.)"""
    name = f"close{os.getpid()}"
    seen = collections.Counter()
    old = sys.getswitchinterval()
    with Runtime([cpu_model("affine", models.affine)], FAST, name=name):
        sys.setswitchinterval(1e-6)   # (switch threads as often as possible: the race is narrow)
        try:
            for _ in range(2500):   # (the old code failed about 1 in 100)
                m = SharedModel("affine", (1, 2), runtime=name)

                def call():
                    try:
                        m.forward(np.zeros((1, 2), np.float32), timeout=30)
                        seen["ok"] += 1
                    except Exception as e:  # noqa: BLE001 - counted
                        seen[type(e).__name__] += 1
                t = threading.Thread(target=call)
                t.start()
                m.close()
                t.join(30)
        finally:
            sys.setswitchinterval(old)
    assert set(seen) <= {"ok", "RuntimeStopped"}, seen


def test_model_that_dies_too_often_is_marked_broken(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_restarts=0))
    m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace, poll_interval=0.05)
    os.kill(_pids(rt, "affine")[0], signal.SIGKILL)
    _wait_for(lambda: rt.ctls["affine"].state == BROKEN)
    with pytest.raises(ModelProcessDied, match=r"model 'affine' failed once within 60 s \(max_restarts 0\) "
                                               r"and is marked broken"):
        m.forward(np.ones((1, 2), np.float32), timeout=10)
    m.close()
    with pytest.raises(RuntimeError, match=r"reload 'affine': the model is broken, not running \(model 'affine' "
                                           r".*a broken model is not restarted nor reloaded -- fix its cause and "
                                           r"start the runtime .* again"):   # (helper-48: said no more)
        rt.reload("affine")
    # what the supervisor answers queued requests with names the model once ("model 'k': model 'k' ...")
    from simpledbi.client import _status_error
    from simpledbi.layout import ST_DIED
    e = _status_error("affine", ST_DIED, rt.broken["affine"])
    assert str(e) == rt.broken["affine"] and str(e).startswith("model 'affine' process 0 (pid ")
    assert str(_status_error("affine", ST_DIED, "died (exit code 3)")) == "model 'affine': died (exit code 3)"


# ---------------------------------------------------------------- names and other users
def test_a_runtime_has_no_names_but_its_private_directory(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        m.forward(np.ones((1, 2), np.float32))
        assert [e for e in os.listdir("/dev/shm") if rt.namespace in e] == [rt.namespace]
        assert sorted(os.listdir(os.path.join("/dev/shm", rt.namespace))) == ["affine.ctl", "affine.sock"]
        assert os.stat(os.path.join("/dev/shm", rt.namespace)).st_mode & 0o777 == 0o700


def test_a_taken_namespace_name_is_never_reused(monkeypatch):
    monkeypatch.setattr(shm.secrets, "token_hex", lambda n: "ab" * n)
    ns = shm.new_namespace()
    try:
        with pytest.raises(OSError, match="fresh namespace"):
            shm.new_namespace()
    finally:
        shm.sweep_namespace(ns)


def _as_nobody(fn) -> int:
    """Run ``fn()`` in a forked child as user nobody; its exit code (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os._exit(0 if fn() else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_can_neither_reach_nor_block_a_runtime(start_runtime):
    """As user nobody: no way into the namespace (list, open the control block, connect to the
    socket), and nothing to squat in /dev/shm that a runtime's start needs."""
    rt = start_runtime(cpu_model("affine", models.affine))
    d = os.path.join("/dev/shm", rt.namespace)

    def attempts():
        for attempt in (lambda: os.listdir(d),
                        lambda: os.open(os.path.join(d, "affine.ctl"), os.O_RDONLY),
                        lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).connect(
                            socket_path(rt.namespace, "affine"))):
            try:
                attempt()
                return False
            except PermissionError:
                continue
        return True

    assert _as_nobody(attempts) == 0

    # nobody creates what an older runtime would have needed, and a namespace-like directory
    def squat():
        for name in (f"sem.{rt.namespace}.m.door", "sdbi_rt_squat", f"sdbi_{os.getppid()}_" + "0" * 32):
            try:
                os.mkdir(os.path.join("/dev/shm", name), 0o777)
            except FileExistsError:
                pass
        return True

    assert _as_nobody(squat) == 0
    try:
        with start_runtime.__self__ if False else contextlib.nullcontext():
            pass
        from simpledbi.runtime import Runtime
        with Runtime([cpu_model("m", models.affine)]) as rt2:
            with SharedModel("m", max_shape=(1, 2), namespace=rt2.namespace) as m:
                np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    finally:
        for name in (f"sem.{rt.namespace}.m.door", "sdbi_rt_squat", f"sdbi_{os.getpid()}_" + "0" * 32):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join("/dev/shm", name))
    _honest(rt, "affine")


def test_junk_at_the_control_block_path_blocks_nobody(start_runtime):
    """A client replaces the link to the control block with a FIFO: new clients get a clear
    error at once (never a blocking open); attached clients and the runtime go on."""
    rt = start_runtime(cpu_model("affine", models.affine))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        path = os.path.join("/dev/shm", rt.namespace, "affine.ctl")
        target = os.readlink(path)
        os.unlink(path)
        os.mkfifo(path, 0o600)
        try:
            t0 = time.monotonic()
            with pytest.raises((LookupError, RuntimeError, OSError)):
                SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
            assert time.monotonic() - t0 < 5
            np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
        finally:
            os.unlink(path)
            os.symlink(target, path)
    _honest(rt, "affine")


# ---------------------------------------------------------------- batching under abuse
def test_signals_during_a_call_are_not_errors(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    ticks = []
    previous = signal.signal(signal.SIGALRM, lambda *a: ticks.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
            for i in range(300):
                x = np.full((1, 2), float(i), np.float32)
                np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert ticks  # the calls really were interrupted


@pytest.mark.timeout(120)
def test_a_quiet_attached_slot_does_not_make_every_batch_wait(start_runtime):
    """A handle that once had two calls in flight keeps an idle slot, which 'may send': the
    adaptive batcher must not wait wait_time for it on every later call."""
    rt = start_runtime(cpu_model("lb", models.launch_bound, max_batch_size=8, wait_time=0.2))
    x = np.ones((1, 2), np.float32)

    def median_latency(m):
        lat = []
        for _ in range(15):
            t0 = time.monotonic()
            np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
            lat.append(time.monotonic() - t0)
        return float(np.median(lat[3:]))

    with SharedModel("lb", max_shape=(1, 2), namespace=rt.namespace) as m:
        alone = median_latency(m)
        ts = [threading.Thread(target=m.forward, args=(x,)) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert len(m._h.idle) == 2
        after = median_latency(m)
    assert after < alone + 0.05, (alone, after)


def _colliding_item_shapes():
    """Two different sets of four 1-D item shapes with the same shape_key (a CRC32): the key is
    linear in the message bits, so a dependency among the CRC contributions of 36 low bits of the
    four lengths (found by Gaussian elimination over GF(2)) flips to another shape, same CRC."""
    from simpledbi.layout import dtype_code, shape_key
    code = [dtype_code(np.dtype(np.float32))] * 4
    base = [512] * 4                       # flipping bits 0-8 keeps every length in 512..1023
    key = lambda dims: shape_key(code, [(d,) for d in dims]) - 1  # the CRC itself  # noqa: E731
    k0 = key(base)
    basis = {}                             # pivot bit -> (crc contribution, mask of flipped bits)
    for j in range(36):
        dims = list(base)
        dims[j // 9] ^= 1 << (j % 9)
        v, mask = key(dims) ^ k0, 1 << j
        while v:
            top = v.bit_length() - 1
            if top not in basis:
                basis[top] = (v, mask)
                break
            v, mask = v ^ basis[top][0], mask ^ basis[top][1]
        if not v:                          # a combination of flips that leaves the CRC as it was
            other = [d ^ (((mask >> (9 * i)) & 0x1FF)) for i, d in enumerate(base)]
            assert other != base and key(other) == k0
            return base, other
    raise AssertionError("no collision among 36 bits of 32-bit CRCs: impossible")


def test_requests_whose_shape_keys_collide_are_never_batched_together(start_runtime):
    """A client can choose item shapes whose batching key (a CRC) equals another client's: the
    model process batches by the exact shapes, so both still get exactly their own answer."""
    victim_dims, attacker_dims = _colliding_item_shapes()
    rt = start_runtime(cpu_model("cat4", models.concat4, max_batch_size=8, batching="fixed",
                                 wait_time=0.2, isolate_errors=False))  # a mixed batch fails all
    barrier, errors = threading.Barrier(2), []

    def client(dims, value):
        try:
            with SharedModel("cat4", max_shape=[(1, d) for d in dims], namespace=rt.namespace) as m:
                xs = [np.full((1, d), value, np.float32) for d in dims]
                want = np.concatenate(xs, axis=1) * 2 + 1
                for _ in range(10):
                    barrier.wait(timeout=30)   # send together: one batch window for both
                    np.testing.assert_array_equal(m.forward(*xs, timeout=30), want)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(victim_dims, 1.0)),
               threading.Thread(target=client, args=(attacker_dims, 5.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors[:1]


@pytest.mark.timeout(120)
def test_latency_sums_saturate_instead_of_breaking_the_accounting(start_runtime):
    """Forged publish times (an hour old each) push the int64 latency sums toward overflow; at
    the top they saturate, and every batch is still accounted."""
    from simpledbi.layout import H_LATENCY, H_QUEUE, H_SUM
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    hist = rt.ctls["affine"].hist[0]
    top = 2**63 - 1
    hist[H_LATENCY][H_SUM] = hist[H_QUEUE][H_SUM] = top - 10   # where forged times would take it
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        for _ in range(5):
            np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
        st = m.stats()
    # a batch's histograms are written just after its callers are woken
    _wait_for(lambda: int(hist[H_LATENCY][:H_SUM].sum()) == 5)
    assert int(hist[H_LATENCY][H_SUM]) == top and int(hist[H_QUEUE][H_SUM]) == top
    assert st["requests"] == 5 and int(hist[H_LATENCY][:H_SUM].sum()) == 5


def test_a_client_flooding_the_socket_delays_but_never_starves_others(start_runtime):
    """A client that keeps the model's queue full of requests (and never reads the answers):
    an honest client still gets every answer, exactly."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=8, wait_time=0.001))
    code = ("import sys, threading, numpy as np; from simpledbi import SharedModel; "
            f"m = SharedModel('affine', max_shape=(1, 2), namespace={rt.namespace!r}); "
            "x = np.ones((1, 2), np.float32); stop = []\n"
            "def loop():\n"
            "    while not stop:\n"
            "        try: m.forward(x, timeout=0.01)\n"
            "        except TimeoutError: pass\n"
            "ts = [threading.Thread(target=loop) for _ in range(16)]\n"
            "[t.start() for t in ts]; print('RUNNING', flush=True); sys.stdin.read(); stop.append(1)\n"
            "[t.join(30) for t in ts]; m.close()")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "RUNNING"
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
            for v in range(100):
                x = np.full((1, 2), float(v), np.float32)
                np.testing.assert_array_equal(m.forward(x, timeout=30), x * 2 + 1)
    finally:
        p.stdin.close()
        p.wait(60)
    _honest(rt, "affine")


# ---------------------------------------------------------------- callers who are gone (issue 22)
def test_a_cancelled_forward_async_task_takes_its_request_back(start_runtime, gate):
    """Cancelling the task of a forward_async call whose request waits behind a held batch: the
    request is withdrawn and never reaches the model; the handle's next calls are served."""
    import asyncio
    rt = _gated(start_runtime, gate, max_batch_size=4, wait_time=0.001)
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        t, outcome = _gated_call(m, gate)

        async def main():
            task = asyncio.ensure_future(m.forward_async(np.full((1, 2), 7.0, np.float32)))
            await asyncio.to_thread(wait_queued, m, n=1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        _wait_for(lambda: not any(s.queued() for s in list(m._h.busy) + m._h.idle))  # taken back
        rows = m.stats()["rows"]
        gate.open()
        t.join(30)
        x = np.full((1, 2), 3.0, np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)
        _wait_for(lambda: m.stats()["withdrawn"] == 1)
        assert m.stats()["rows"] == rows + 2   # the gated request and the last one, nothing else


def test_a_request_whose_deadline_passed_in_the_queue_is_not_run(start_runtime, gate):
    """A request a model process took (so its caller could not withdraw it) whose caller's
    deadline passes before its batch closes is answered 'expired', not run: past its capacity a
    model spends nothing on answers nobody reads."""
    rt = _gated(start_runtime, gate, max_batch_size=1, wait_time=0.001)
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        t1, first = _gated_call(m, gate)                       # G1 holds the model process
        out = {}
        t2 = threading.Thread(target=lambda: out.setdefault("a", m.forward(
            np.full((1, 2), models.GATE, np.float32), timeout=60)))   # A: gated too
        t2.start()
        wait_queued(m, n=1)

        def late():
            try:
                m.forward(np.full((1, 2), 5.0, np.float32), timeout=1.0)
            except TimeoutError as e:
                out["b"] = e

        t3 = threading.Thread(target=late)                    # B: a deadline 1 s away
        t3.start()
        wait_queued(m, n=2)
        gate.open()        # G1 done; the process takes A (held: gated) and B, a batch ahead
        gate.wait_entered()
        t3.join(30)        # B's caller gives up while A's batch runs
        assert "being computed" in str(out.get("b")), out
        gate.open()
        for t in (t1, t2):
            t.join(30)
        _wait_for(lambda: m.stats()["expired"] == 1)
        assert m.stats()["requests"] == 2    # G1 and A ran; B never did
        x = np.full((1, 2), 3.0, np.float32)
        np.testing.assert_array_equal(m.forward(x, timeout=10), x * 2 + 1)


def test_a_client_cannot_pass_for_a_model_process_handing_a_request_back(start_runtime):
    """A hand-back datagram (FWD_MAGIC: "this request is the client's, take it") is honoured only
    from a model process of the model -- the kernel's word. A client sending one for itself gets
    nothing taken: its request stays offered (it can take it back), the model is unharmed."""
    from simpledbi.layout import FWD_MAGIC, FWD_PREFIX
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=2, wait_time=0.001))
    pids = _pids(rt, "affine")
    forger = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    forger.forward(np.ones((1, 2), np.float32))   # a slot the model process has mapped
    slot, seq = _send_raw(forger, lambda msg: FWD_PREFIX.pack(FWD_MAGIC, 0, os.getpid()) + msg)
    # The socket is first in, first out and there is one model process: once a later request
    # is answered, the forged datagram was read before it.
    honest = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    x = np.full((1, 2), 3.0, np.float32)
    np.testing.assert_array_equal(honest.forward(x, timeout=30), x * 2 + 1)
    assert not slot.answered(seq) and slot.queued(), "a forged hand-back was taken"
    assert slot.withdraw()
    assert _pids(rt, "affine") == pids
    forger.close()
    honest.close()


@pytest.mark.timeout(180)
def test_a_withdrawn_request_datagram_cannot_lose_the_next_request(start_runtime):
    """Calls that time out at once (withdrawn: their datagrams stay queued) alternate with calls
    that must be answered, from four threads, to two model processes: one reading a withdrawn
    request's datagram must never make the other drop the slot's next request (slots.py: each
    request's own ticket)."""
    rt = start_runtime(cpu_model("m", models.affine, max_batch_size=4, model_num=2))
    m = SharedModel("m", max_shape=(1, 4), namespace=rt.namespace)
    x = np.ones((1, 4), np.float32)
    want = m.forward(x)
    lost = []

    def loop():
        for _ in range(1500):
            try:
                m.forward(x, timeout=0)
            except TimeoutError:
                pass
            try:
                np.testing.assert_array_equal(m.forward(x, timeout=5), want)
            except TimeoutError as e:
                lost.append(e)
                return

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not lost, f"{len(lost)} calls were never answered: {lost[0]}"
    assert m.stats()["withdrawn"] > 0   # the race was there to lose


@pytest.mark.timeout(120)
def test_a_killed_client_nobody_reaps_is_dropped_while_requests_keep_coming(start_runtime):
    """A client process killed and not reaped by its parent (a zombie) kept its slots mapped, memory and
    all, for as long as requests kept coming: under load the clean-up told zombies from live processes
    only at a quiet poll interval (helper-51: 82 slots and 320 MB kept). Now each client process's
    pidfd says it exited, at every clean-up."""
    rt = start_runtime(cpu_model("m", models.affine, max_batch_size=4))
    clients = lambda: int(rt.ctls["m"].instances["clients"][0])   # noqa: E731
    code = ("import sys, threading, numpy as np\n"
            "from simpledbi import SharedModel\n"
            f"m = SharedModel('m', (1, 3), namespace={rt.namespace!r})\n"
            "m.forward(np.ones((1, 3), np.float32))\n"
            "print('READY', flush=True)\n"
            "threading.Event().wait()\n")
    victim = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().startswith("READY")
        m = SharedModel("m", (1, 3), namespace=rt.namespace)
        x = np.ones((1, 3), np.float32)
        m.forward(x)
        assert clients() == 2
        os.kill(victim.pid, signal.SIGKILL)   # not waited for: a zombie while this test runs
        deadline = time.monotonic() + 30
        while clients() != 1:   # steady load meanwhile: this closed loop
            assert time.monotonic() < deadline, "the killed client's slot was kept"
            np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        with open(f"/proc/{victim.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"   # it was a zombie all along
        m.close()
    finally:
        victim.kill()
        victim.wait(30)
        victim.stdout.close()
