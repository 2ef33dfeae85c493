"""No client can hurt the runtime: the nine behaviours of issue 7 and a fuzz test.

Each test ends by checking that an honest client is still served correctly, that no model process
was restarted (except where a test kills one on purpose), and -- with a huge ``wait_time`` -- that
a lone client's call is not held back by slots that nobody uses any more.
"""
import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import posix_ipc
import pytest

from simpledbi import ModelError, ModelProcessDied, RuntimeStopped, SharedModel
from simpledbi.layout import FREE, MAGIC, PUBLISHED, REQUEST, SLOT, STOPPING, BROKEN
from simpledbi import shm
from simpledbi.slots import _REFUSED_FIRST

from . import models
from .conftest import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE_WAIT = 30.0  # a batch that waited for a client that cannot send would blow every timeout


def _pids(rt, name):
    return [int(p) for p in rt.ctls[name].instances["pid"]]


def _attached(rt, name):
    return int(np.count_nonzero(rt.tables[name].state != FREE))


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


def _ring_and_wait(door, timeout=10.0):
    """Ring the model's doorbell and wait until a model process has taken the ring."""
    door.release()
    deadline = time.monotonic() + timeout
    while door.value:
        assert time.monotonic() < deadline, "ring not taken"
        threading.Event().wait(0.0005)   # bounded wait on a semaphore's value


@contextlib.contextmanager
def _hostile_process(code: str, *args: str):
    """Run a hostile client script until the block ends (it stops when its stdin closes);
    yields a dict whose "out" is what it printed after "RUNNING"."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result = {}
    try:
        assert p.stdout.readline().strip() == "RUNNING"
        yield result
    finally:
        p.stdin.close()
        result["out"] = p.stdout.read()
        p.wait(60)


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
    return ("import os, signal, numpy as np, posix_ipc; from simpledbi import SharedModel; "
            f"m = SharedModel('gated', max_shape=(1, 2), namespace={rt.namespace!r}); " + body)


# 1 ------------------------------------------------------------------------------------------
def test_timeout_then_close_on_a_first_request_does_not_kill_the_model(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name),
                                 max_batch_size=1, wait_time=HUGE_WAIT))
    pids = _pids(rt, "gated")
    b = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    np.testing.assert_array_equal(b.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    a = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    with pytest.raises(TimeoutError, match="being computed"):
        a.forward(np.full((1, 2), models.GATE, np.float32), timeout=0.3)
    a.close()                 # its segment and semaphores are unlinked while the model holds them
    gate.open()               # the model now answers a client that is gone
    np.testing.assert_array_equal(b.forward(np.ones((1, 2), np.float32), timeout=10), np.full((1, 2), 3.0))
    b.close()
    _honest(rt, "gated", timeout=5)
    assert _pids(rt, "gated") == pids and rt.ctls["gated"].instances["restarts"].sum() == 0


def test_client_killed_during_its_first_request_does_not_kill_the_model(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name),
                                 max_batch_size=1, wait_time=HUGE_WAIT))
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
    _wait_for(lambda: _attached(rt, "gated") == 0)  # reaped
    _honest(rt, "gated", timeout=5)
    assert _pids(rt, "gated") == pids


# 2 ------------------------------------------------------------------------------------------
def test_a_late_answer_never_overwrites_a_newer_request_nor_holds_batches(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name),
                                 max_batch_size=1, wait_time=HUGE_WAIT))
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(TimeoutError, match="being computed"):
            m.forward(np.full((1, 2), models.GATE, np.float32), timeout=0.2)
        # The stale slot is not lent again before its late answer: this call takes another one,
        # queues behind the gated request and is answered after it.
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("y", m.forward(np.full((1, 2), 4.0, np.float32), timeout=30)))
        t.start()
        _wait_for(lambda: int(np.count_nonzero(rt.tables["gated"].state == PUBLISHED)) >= 2)
        gate.open()
        t.join(30)
        np.testing.assert_array_equal(result["y"], np.full((1, 2), 9.0, np.float32))
        for v in (5.0, 6.0, 7.0):  # the stale slot is reused once settled; answers stay exact
            x = np.full((1, 2), v, np.float32)
            np.testing.assert_array_equal(m.forward(x, timeout=5), x * 2 + 1)
    _honest(rt, "gated", timeout=5)  # nothing left IDLE or PUBLISHED holds a batch back


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


# 3 ------------------------------------------------------------------------------------------
def test_close_from_another_thread_ends_the_call_with_runtime_stopped(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name),
                                 max_batch_size=1, wait_time=HUGE_WAIT))
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, outcome = _gated_call(m, gate)
    m.close()
    t.join(10)
    assert not t.is_alive() and isinstance(outcome.get("e"), RuntimeStopped), outcome
    assert _attached(rt, "gated") == 0  # the slot went back when the call ended
    with pytest.raises(RuntimeStopped):
        m.forward(np.ones((1, 2), np.float32))
    gate.open()
    _honest(rt, "gated", timeout=5)


# 4 ------------------------------------------------------------------------------------------
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
        assert _attached(rt, "affine") <= 4  # one slot per call in flight, not per thread ever
    assert _attached(rt, "affine") == 0


# 5 ------------------------------------------------------------------------------------------
def _idle_slot(m):
    assert m._h.idle, "expected an idle slot"
    return m._h.idle[0]


def _req_words(slot):
    return np.frombuffer(slot.seg.buf, np.int64, count=REQUEST.itemsize // 8)


_EVIL = [0, 1, -1, 7, 2**31, 2**31 - 1, 2**40, 2**62, 2**63 - 1, -2**63, 10**6, 1000,
         int(np.float64(np.nan).view(np.int64)), int(np.float64(np.inf).view(np.int64))]


def test_control_block_is_read_only_for_clients(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(ValueError, match="read-only"):
            m.ctl.hdr["state"] = STOPPING
        with pytest.raises(ValueError, match="read-only"):
            m.ctl.claims["seq"][0] = 5
        np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))


@pytest.mark.timeout(300)
def test_fuzz_a_client_scribbling_on_its_slot_and_the_table(start_runtime):
    """Thousands of random 1-2 field mutations of a hostile client's own request header and of any
    row of the slot table (the part of the runtime's shared state clients can write): the model
    process survives every one, the hostile client gets an answer or a typed error, and an honest
    client keeps getting exact answers."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, model_num=2, wait_time=0.001))
    pids = _pids(rt, "affine")
    honest = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)
    rng = np.random.default_rng(7)
    table = rt.tables["affine"]
    # the first four slots' hints: their rows and their states (a contiguous column of its own)
    row_words = np.frombuffer(table.seg.buf, np.int64, count=4 * SLOT.itemsize // 8)
    table_words = [(row_words, j) for j in range(len(row_words))] + [(table.state, j) for j in range(4)]
    outcomes = {}
    hostile = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)
    n = 0
    for i in range(2000):
        x = rng.standard_normal((int(rng.integers(1, 3)), 3)).astype(np.float32)
        hostile.forward(np.ones((1, 3), np.float32), timeout=5)  # a clean slot to scribble on
        slot = _idle_slot(hostile)
        words = _req_words(slot)
        for _ in range(int(rng.integers(1, 3))):
            value = _EVIL[int(rng.integers(0, len(_EVIL)))] if rng.random() < 0.7 else int(rng.integers(-2**62, 2**62))
            if rng.random() < 0.6:
                words[int(rng.integers(0, len(words)))] = value
            else:
                where, j = table_words[int(rng.integers(0, len(table_words)))]
                where[j] = value
        slot._shapes = [(-1,)] * len(slot._shapes)  # keep our corrupt dims only if shapes repeat
        if rng.random() < 0.5:
            slot._shapes = [x.shape]  # the client will not rewrite the (maybe corrupted) dims
        del words, slot
        try:
            y = hostile.forward(x, timeout=0.3)
            kind = "ok" if np.array_equal(y, x * 2 + 1) else "wrong-own"
        except (ValueError, TimeoutError, ModelProcessDied, RuntimeStopped, ModelError) as e:
            kind = type(e).__name__
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind != "ok":  # start afresh: the slot may be stale or wrecked
            hostile.close()
            hostile = SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace, poll_interval=0.05)
        if i % 20 == 0:
            h = rng.standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_array_equal(honest.forward(h, timeout=10), h * 2 + 1)
            n += 1
    hostile.close()
    honest.close()
    assert _pids(rt, "affine") == pids, "a model process died"
    assert rt.ctls["affine"].state not in (STOPPING, BROKEN)
    assert outcomes.get("ValueError", 0) > 100, outcomes  # the model rejected bad headers
    _honest(rt, "affine", width=3, timeout=5)


def test_truncated_segment_is_a_bad_request_not_a_crash(start_runtime, gate):
    """A client truncates its own segment (before publishing, and while its request waits): the
    model process reads it with pread, sees a short read, and answers with an error."""
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name),
                                 max_batch_size=2, wait_time=0.001))
    pids = _pids(rt, "gated")
    body = ("x = np.ones((1, 2), np.float32); m.forward(x); s = m._h.idle[0]; "
            "os.ftruncate(s.seg.fd, {size}); s.seq += 1; "
            "w = np.frombuffer(s.seg.buf, np.int64, count=8) if {size} >= 64 else None; "
            "s.ready.release(); t = s.table; t.seq[s.index] = s.seq; t.state[s.index] = 2; "
            "m._h.doorbell.release(); print('PUBLISHED', flush=True); os._exit(0)")
    for size in (0, 100, 4096, 16384 + 4):
        out = subprocess.run([sys.executable, "-c", _client_code(rt, body.format(size=size))], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert "PUBLISHED" in out.stdout, out.stderr
        _honest(rt, "gated", timeout=10)
    assert _pids(rt, "gated") == pids
    assert rt.ctls["gated"].counters["bad_requests"].sum() >= 3


# 6 ------------------------------------------------------------------------------------------
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


# 8 ------------------------------------------------------------------------------------------
def test_dead_model_process_is_restarted_and_its_callers_told_at_once(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1,
                                 model_num=2, wait_time=0.001, restart_backoff=0.01))
    m = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, outcome = _gated_call(m, gate)
    claimer = int(rt.ctls["gated"].claims["pid"][rt.ctls["gated"].claims["seq"] > 0][0])
    os.kill(claimer, signal.SIGKILL)
    t.join(5)  # told at once (its don is posted by the supervisor), not after a timeout
    assert not t.is_alive() and isinstance(outcome.get("e"), ModelProcessDied), outcome
    assert str(claimer) in str(outcome["e"])
    x = np.full((1, 2), 2.0, np.float32)
    np.testing.assert_array_equal(m.forward(x, timeout=30), x * 2 + 1)  # the survivor serves
    _wait_for(lambda: rt.ctls["gated"].instances["restarts"].sum() == 1 and claimer not in _pids(rt, "gated")
              and all(shm.pid_alive(p) for p in _pids(rt, "gated")), timeout=120)  # a fresh process loads torch
    m.close()
    for v in range(4):
        _honest(rt, "gated", value=float(v))


def test_model_that_dies_too_often_is_marked_broken(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_restarts=0))
    m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace, poll_interval=0.05)
    os.kill(_pids(rt, "affine")[0], signal.SIGKILL)
    _wait_for(lambda: rt.ctls["affine"].state == BROKEN)
    with pytest.raises(ModelProcessDied, match="marked broken"):
        m.forward(np.ones((1, 2), np.float32), timeout=10)
    m.close()


# 9 ------------------------------------------------------------------------------------------
def test_slot_objects_carry_unguessable_names(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace):
        sems = [e for e in os.listdir("/dev/shm") if e.startswith(f"sem.{rt.namespace}.affine.s")]
        assert len(sems) == 2 and all(len(e.split(".")[-2]) == 16 for e in sems)  # 64-bit tokens
        files = os.listdir(os.path.join("/dev/shm", rt.namespace))  # inside the 0700 directory
        assert any(f.startswith("affine.s0.") and not f.endswith(".lock") for f in files)


def test_a_taken_namespace_name_is_never_reused(monkeypatch):
    monkeypatch.setattr(shm.secrets, "token_hex", lambda n: "ab" * n)
    ns = shm.new_namespace()
    try:
        with pytest.raises(OSError, match="fresh namespace"):
            shm.new_namespace()
    finally:
        shm.sweep_namespace(ns)


def test_a_slot_that_vanishes_while_a_model_process_opens_it_is_skipped_cleanly():
    # Seen in the soak: a client detached between a model process opening its segment and its
    # semaphores. The open must fail with the missing object's error, nothing else.
    from simpledbi.layout import segment_path
    from simpledbi.slots import Peer
    ns = shm.new_namespace()
    try:
        open(segment_path(ns, "m", 0, 5), "wb").close()
        with pytest.raises(FileNotFoundError):
            Peer(ns, "m", 0, 5)
    finally:
        shm.sweep_namespace(ns)


# found by an attacker after the first round -----------------------------------------------------
def test_a_forged_token_in_a_claimed_clients_row_does_not_lose_its_answer(start_runtime):
    # The batch waits (another client is idle) with the victim's request claimed; meanwhile its
    # row's token is forged. The model process must keep the victim's slot open and answer it.
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=1.0))
    idle = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    idle.forward(np.ones((1, 2), np.float32))  # now IDLE: batches wait for it
    victim = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    table, claims = rt.tables["affine"], rt.ctls["affine"].claims
    x = np.full((1, 2), 4.0, np.float32)
    out = {}
    slot = victim._h.idle[0].index   # its only slot, which the call below borrows
    t = threading.Thread(target=lambda: out.setdefault("y", victim.forward(x, timeout=10)))
    t.start()
    _wait_for(lambda: int(claims["seq"][slot]) == int(table.seq[slot]) > 0)
    table.token[slot] ^= 2
    rt.doorbells["affine"].release()
    t.join(15)
    np.testing.assert_array_equal(out["y"], x * 2 + 1)
    victim.close()
    idle.close()
    _honest(rt, "affine")


def test_a_client_that_rewrites_its_own_header_and_row_seq_gets_an_error_not_a_hang(start_runtime, gate):
    # While its request waits, a client breaks its own REQUEST header (magic) and gives its row
    # another seq. The model process can only answer under the row's seq; the caller must find
    # that answer (ClientSlot.answered_under_another_seq) and raise, not wait forever.
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1))
    pids = _pids(rt, "gated")
    blocker = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t_block, blocked = _gated_call(blocker, gate)  # the only model process waits in forward
    # A poll interval far longer than this test's steps: the caller does not repair its row
    # before the model process has claimed the request.
    victim = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace, poll_interval=1.0)
    x = np.full((1, 2), 3.0, np.float32)
    out = {}

    def call():
        try:
            out["y"] = victim.forward(x, timeout=30)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["e"] = e

    t = threading.Thread(target=call)
    t.start()
    table, claims = rt.tables["gated"], rt.ctls["gated"].claims
    _wait_for(lambda: victim._h.busy and table.state[next(iter(victim._h.busy)).index] == PUBLISHED)
    slot = next(iter(victim._h.busy))
    i, seq = slot.index, slot.seq
    slot._req["magic"] = 0
    table.seq[i] = seq + 100
    gate.open()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(out.get("e"), ValueError) and "does not belong to this slot" in str(out["e"]), out
    assert int(claims["seq"][i]) == seq + 100   # answered under the row's seq: the path tested
    t_block.join(30)
    np.testing.assert_array_equal(blocked["y"], np.full((1, 2), models.GATE * 2 + 1, np.float32))
    victim.close()
    blocker.close()
    _honest(rt, "gated")
    assert _pids(rt, "gated") == pids


def test_a_fresh_client_at_a_reused_index_is_served_at_once(start_runtime):
    # A failed claim is remembered per (token, seq): a new client of the same index starts at
    # seq 1 again and must not be mistaken for the old one.
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.003))
    x = np.ones((1, 2), np.float32)
    for k in range(150):
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as a:
            try:
                a.forward(x, timeout=0.0001 * (k % 6))
            except TimeoutError:
                pass
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as b:
            np.testing.assert_array_equal(b.forward(x, timeout=5), x * 2 + 1)


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


# ---------------------------------------------------------------- attacker's round 2 (issue 8)
# Regressions for what a second attacker found in the adaptive batcher and the fast paths.
_FORGE_OLD_HINTS = r"""
import sys, threading, types, numpy as np
import simpledbi.slots as slots
from simpledbi import SharedModel
slots.time = types.SimpleNamespace(monotonic=lambda: 1.0)   # every hint: published at t=1.0
m = SharedModel('lb', max_shape=(1, 2), namespace=sys.argv[1])
stop = False
def loop():
    x = np.ones((1, 2), np.float32)
    while not stop:
        m.forward(x, timeout=30)
ts = [threading.Thread(target=loop) for _ in range(6)]
for t in ts: t.start()
print('RUNNING', flush=True)
sys.stdin.read()
stop = True
for t in ts: t.join(30)
m.close()
"""


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


@pytest.mark.timeout(120)
def test_forged_old_publish_hints_cannot_starve_another_shape(start_runtime):
    rt = start_runtime(cpu_model("lb", models.launch_bound, max_batch_size=2, wait_time=0.003))
    pids = _pids(rt, "lb")
    with _hostile_process(_FORGE_OLD_HINTS, rt.namespace):
        _wait_for(lambda: rt.ctls["lb"].counters["batches"].sum() > 20)
        with SharedModel("lb", max_shape=(1, 3), namespace=rt.namespace) as honest:
            x = np.ones((1, 3), np.float32)
            for _ in range(5):
                np.testing.assert_array_equal(honest.forward(x, timeout=3), x * 2 + 1)
    assert _pids(rt, "lb") == pids


@pytest.mark.timeout(120)
def test_a_forged_next_seq_in_a_victims_row_does_not_delay_it(start_runtime):
    """The attacker publishes the victim's next seq under its token (both readable in the table)
    while the victim is idle: the failed claim must not make the model skip the real request."""
    from simpledbi.layout import IDLE
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    pids = _pids(rt, "affine")
    attacker = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    t = attacker._h.table
    victim = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    x = np.ones((1, 2), np.float32)
    victim.forward(x, timeout=5)
    vi = victim._h.idle[0].index
    stop = threading.Event()

    def forge():
        last = -1
        while not stop.is_set():
            if t.state[vi] == IDLE and int(t.seq[vi]) != last:
                last = int(t.seq[vi])
                t.seq[vi] = last + 1
                t.state[vi] = PUBLISHED
                attacker._h.doorbell.release()
            stop.wait(0.0002)  # the attacker's polling loop

    th = threading.Thread(target=forge)
    th.start()
    lat = []
    try:
        for _ in range(10):
            stop.wait(0.01)  # the victim's think time: the attacker forges meanwhile
            t0 = time.monotonic()
            np.testing.assert_array_equal(victim.forward(x, timeout=10), x * 2 + 1)
            lat.append(time.monotonic() - t0)
    finally:
        stop.set()
        th.join(10)
    victim.close()
    attacker.close()
    assert _pids(rt, "affine") == pids
    assert np.median(lat) < 0.05, lat


def test_the_header_fast_path_keeps_the_per_request_byte_bound(start_runtime):
    from simpledbi.slots import BadRequest, Limits, Peer
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    with SharedModel("affine", max_shape=(4, 20), namespace=rt.namespace) as m:
        m.forward(np.ones((1, 20), np.float32))
        s = _idle_slot(m)
        peer = Peer(rt.namespace, "affine", s.index, s.token)   # what a model process sees
        try:
            lim = Limits(max_batch=4, max_request_bytes=100)    # 80 bytes a row
            s._r_rows[0], s._r_seq[0], s._r_t[0] = 1, 100, time.monotonic()
            peer.read_request(lim, 100, time.monotonic())        # validated in full, remembered
            s._r_rows[0], s._r_seq[0] = 4, 101
            with pytest.raises(BadRequest, match="more than the 100"):
                peer.read_request(lim, 101, time.monotonic())    # the same header, more rows
        finally:
            peer.close()


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
    """A client can choose item shapes whose batching key (a CRC) equals another client's:
    the model process batches by the exact shapes, so both still get exactly their own answer.
    (Batched together, the victim's rows would be read with the attacker's layout -- here the
    batch fails; with equal byte counts, its answer would silently be wrong.)"""
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
                    barrier.wait(timeout=30)   # publish together: one batch window for both
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


def test_a_segment_swapped_for_a_fifo_is_refused_and_leaks_nothing(start_runtime):
    """A client replaces its own segment file with a FIFO: the model process refuses to open it
    (a pread on it raised inside the claim before, failing honest requests collected with it,
    and its descriptor leaked), the honest client keeps its exact answers, no descriptor stays."""
    from simpledbi.layout import segment_path
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=8))
    pid = _pids(rt, "affine")[0]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as honest:
        x = np.full((1, 2), 3.0, np.float32)
        np.testing.assert_array_equal(honest.forward(x, timeout=10), x * 2 + 1)
        before = len(os.listdir(f"/proc/{pid}/fd"))
        for _ in range(10):
            with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
                slot = _idle_slot(m)
                path = segment_path(rt.namespace, "affine", slot.index, slot.token)
                os.unlink(path)
                os.mkfifo(path, 0o600)
                with pytest.raises(TimeoutError):
                    m.forward(np.ones((1, 2), np.float32), timeout=0.3)
            np.testing.assert_array_equal(honest.forward(x, timeout=10), x * 2 + 1)
        assert len(os.listdir(f"/proc/{pid}/fd")) <= before
        assert _pids(rt, "affine")[0] == pid and honest.stats()["errors"] == 0


def test_growing_requests_keep_one_staging_buffer_not_every_size_seen(start_runtime):
    """Requests that keep growing (any client can send them): the model process's memory grows
    with the largest, not with the sum of all sizes (a cache of staging views once kept every
    outgrown buffer alive: 1.5 GB for 100 requests up to 25 MiB)."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    pid = _pids(rt, "affine")[0]

    def rss_mib():
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    step = 50_000   # floats per row per request: 0.8 MB per request more each time
    with SharedModel("affine", max_shape=(4, 40 * step), namespace=rt.namespace) as m:
        np.testing.assert_array_equal(m.forward(np.ones((4, step), np.float32)), 3.0)
        before = rss_mib()
        for i in range(1, 41):          # 32 MB at the end, 656 MB summed
            x = np.full((4, i * step), float(i), np.float32)
            assert float(m.forward(x, timeout=30)[0, -1]) == 2.0 * i + 1
        grown = rss_mib() - before
    assert grown < 200, f"the model process grew {grown:.0f} MiB for requests of at most 32 MB"
    assert _pids(rt, "affine")[0] == pid


# A client that spins over the table turning every other client's PUBLISHED row back to IDLE
# (table rows are hints any client can write), until its stdin closes.
_HIDE_ROWS = r"""
import sys, threading, numpy as np
from simpledbi import SharedModel
m = SharedModel("affine", max_shape=(1, 2), namespace=sys.argv[1])
state = m._h.table.state
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("RUNNING", flush=True)
hidden = 0
while not done.is_set():
    for i in np.flatnonzero(state == 2).tolist():   # PUBLISHED
        state[i] = 1                                  # IDLE
        hidden += 1
print(hidden, flush=True)
m.close()
"""


@pytest.mark.timeout(180)
def test_rows_hidden_over_and_over_by_another_client_do_not_starve_their_owners(start_runtime):
    """NOTE [hidden requests]: a request is found by its table row, which another client can
    rewrite faster than its owner repairs it. Model processes also look at the slots' own rdy
    semaphores: every call is answered, exactly, long before its timeout."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, max_clients=16))
    pids = _pids(rt, "affine")
    with _hostile_process(_HIDE_ROWS, rt.namespace) as hostile:
        # default client poll (0.5 s): before, its hint repairs lost the race -- calls took
        # seconds each and timed out
        with SharedModel("affine", max_shape=(2, 2), namespace=rt.namespace) as honest:
            rng = np.random.default_rng(3)
            for _ in range(30):
                x = rng.standard_normal((int(rng.integers(1, 3)), 2)).astype(np.float32)
                np.testing.assert_array_equal(honest.forward(x, timeout=5), x * 2 + 1)
    assert int(hostile["out"].split()[-1]) > 0, "the attacker never hid a row: the test proves nothing"
    assert _pids(rt, "affine") == pids


@pytest.mark.timeout(120)
def test_a_request_over_unwritten_pages_is_refused_before_it_costs_the_model_memory(start_runtime, monkeypatch):
    """A segment of holes costs its client nothing; staging its 'inputs' would cost the model
    process their full size. Such a request gets a ValueError; the model's memory stays put."""
    from simpledbi import shm, slots
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    pid = _pids(rt, "affine")[0]
    width = 32 * 2**20   # 128 MiB of float32 in one row

    def peak_rss_mib():
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    before = peak_rss_mib()
    with SharedModel("affine", max_shape=(1, width), namespace=rt.namespace) as liar:
        monkeypatch.setattr(shm.Segment, "reserve", lambda self, *a, **k: None)   # no fallocate
        monkeypatch.setattr(slots.np, "copyto", lambda *a, **k: None)            # nothing written
        x = np.zeros((1, width), np.float32)
        with pytest.raises(ValueError, match="holds only .* bytes of memory"):
            liar.forward(x, timeout=30)
        monkeypatch.undo()
    assert peak_rss_mib() - before < 64, (before, peak_rss_mib())
    _honest(rt, "affine")


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
    assert int(hist[H_LATENCY][H_SUM]) == top and int(hist[H_QUEUE][H_SUM]) == top
    assert st["requests"] == 5 and int(hist[H_LATENCY][:H_SUM].sum()) == 5


@pytest.mark.timeout(120)
def test_a_request_forged_under_my_slot_index_does_not_make_my_call_fail(start_runtime, gate, monkeypatch):
    """Another client creates a slot of its own under my slot's index (new token) while my
    request is inside model process A; idle process B claims the forged request and its claim
    record replaces A's. Nobody died, so my call keeps waiting -- and gets its answer."""
    from simpledbi import slots
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), model_num=2,
                                 max_batch_size=1))
    pids = _pids(rt, "gated")
    victim = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace, poll_interval=0.05)
    t, outcome = _gated_call(victim, gate)
    (mine,) = victim._h.busy
    attacker = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    h = attacker._h

    class Forged(slots.ClientSlot):
        def __init__(self):  # a slot of my own at the victim's index: no lock, new token
            self.namespace, self.model = rt.namespace, "gated"
            self.ctl, self.table, self.doorbell = h.ctl, h.table, h.doorbell
            self.pid, self.index, self.lock_fd = os.getpid(), mine.index, None
            self.seq = self.stale_seq = self.withdrawn = 0
            self.woken, self.lost_at, self.deaths_at_publish = 0.0, 0.0, 0
            self.interrupted, self._sem_lock = False, threading.Lock()
            self._create([(1, 2)], [np.dtype(np.float32)])

    monkeypatch.setattr(slots, "_unlink_slot_objects", lambda *a: None)   # leave the victim's be
    forged = Forged()
    try:
        seq = forged.publish([np.ones((1, 2), np.float32)])
        assert forged.wait(seq, 30), "process B did not answer the forged request"
        claims = rt.ctls["gated"].claims[mine.index]
        assert int(claims["token"]) == forged.token   # A's record of my request is gone
        # my call looks for its claim every 0.05 s; before, the second look raised
        # ModelProcessDied. Let it look several times.
        looks = set()
        _wait_for(lambda: looks.add(mine.lost_at) or len(looks - {0.0}) >= 3)
        assert "e" not in outcome, outcome
    finally:
        gate.open()
        t.join(30)
        forged._drop_views()
        forged.seg.close()
        forged.seg.unlink()
        for sem in (forged.ready, forged.done):
            sem.unlink()
            sem.close()
    assert "e" not in outcome, outcome
    np.testing.assert_array_equal(outcome["y"], np.full((1, 2), models.GATE, np.float32) * 2 + 1)
    victim.close()
    attacker.close()
    assert _pids(rt, "gated") == pids


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(180)
def test_a_directory_flooded_with_fake_slot_names_costs_the_model_process_little(start_runtime):
    """20,000 fake segment names in the namespace directory and doorbell rings with nothing
    published: the model process lists the directory off its serving thread, rate-limited, and
    never retries a name that failed -- before, every empty ring cost a listing and 20,000 failed
    opens on the serving thread (90% of a core)."""
    rt = start_runtime(cpu_model("affine", models.affine))
    pid = _pids(rt, "affine")[0]
    attacker = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    d = os.path.dirname(rt.tables["affine"].seg.path)
    rng = np.random.default_rng(0)
    for i in range(20000):
        fd = os.open(os.path.join(d, f"affine.s{i % 200 + 100}.{int(rng.integers(1, 2**62)):016x}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    t0, c0 = time.monotonic(), _cpu_seconds(pid)
    while time.monotonic() - t0 < 4:
        attacker._h.doorbell.release()
        threading.Event().wait(0.1)   # the attacker's ring period: two poll intervals
    share = (_cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    attacker.close()
    assert share < 0.3, f"the model process used {share:.0%} of a core"
    _honest(rt, "affine")


# A client that makes its own slot objects (a new token) under another client's slot index, makes
# the row name them (so the model process opens them as that slot's), then keeps the row hidden.
_HIJACK = r"""
import os, sys, secrets, threading, numpy as np, posix_ipc
from simpledbi import SharedModel
from simpledbi.layout import sem_name, segment_path, DATA_OFFSET, PUBLISHED, IDLE
ns, i = sys.argv[1], int(sys.argv[2])
m = SharedModel("affine", max_shape=(1, 2), namespace=ns)
t = m._h.table
F = secrets.randbits(64) | 1
path = segment_path(ns, "affine", i, F)
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.pwrite(fd, b"\0" * (DATA_OFFSET + 4096), 0)
os.close(fd)
sems = [posix_ipc.Semaphore(sem_name(ns, "affine", i, F, w), posix_ipc.O_CREX, 0o600, 0) for w in ("rdy", "don")]
t.token[i], t.seq[i], t.state[i] = F, 12345, PUBLISHED
m._h.doorbell.release()
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("RUNNING", flush=True)
n = 0
while not done.is_set():
    t.token[i], t.state[i] = F, IDLE
    n += 1
os.unlink(path)
for s in sems:
    s.unlink()
    s.close()
m.close()
print(n, flush=True)
"""


@pytest.mark.timeout(180)
def test_a_row_pointed_at_another_clients_objects_does_not_cut_its_owner_off(start_runtime):
    """The model process keeps its handle on the owner's objects when a row names new ones (which
    may be a forgery), and looks at both: the owner's calls are answered while the row is kept
    naming the forgery and hidden -- before, every one of them timed out."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    pids = _pids(rt, "affine")
    victim = SharedModel("affine", max_shape=(2, 2), namespace=rt.namespace)
    x = np.ones((2, 2), np.float32)
    victim.forward(x, timeout=5)   # the model process has a handle on the victim's slot
    with _hostile_process(_HIJACK, rt.namespace, str(victim._h.idle[0].index)) as hostile:
        for _ in range(30):
            np.testing.assert_array_equal(victim.forward(x, timeout=5), x * 2 + 1)
    assert int(hostile["out"].split()[-1]) > 0
    victim.close()
    assert _pids(rt, "affine") == pids


@pytest.mark.timeout(180)
def test_fake_slots_of_a_clients_own_do_not_fill_the_model_processes_descriptors(start_runtime):
    """A client creates 400 slots of its own (segment + semaphores, fresh tokens, no request) and
    rings with nothing published: the model process keeps handles only on slots with a request
    waiting -- before, it kept one per fake, up to twice max_clients, until a real client's open
    failed with 'too many open files'."""
    from simpledbi.layout import DATA_OFFSET, sem_name, segment_path
    rt = start_runtime(cpu_model("affine", models.affine))
    pid = _pids(rt, "affine")[0]
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    attacker = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    rng = np.random.default_rng(1)
    made = []
    for i in range(400):
        slot, token = 10 + i % 200, int(rng.integers(1, 2**62))
        path = segment_path(rt.namespace, "affine", slot, token)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.pwrite(fd, b"\0" * (DATA_OFFSET + 4096), 0)
        os.close(fd)
        sems = [posix_ipc.Semaphore(sem_name(rt.namespace, "affine", slot, token, w), posix_ipc.O_CREX, 0o600, 0)
                for w in ("rdy", "don")]
        made.append((path, sems))
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:   # several finder looks (one a second at most)
            attacker._h.doorbell.release()
            threading.Event().wait(0.1)
        held = len(os.listdir(f"/proc/{pid}/fd")) - fds_before
        assert held < 50, f"the model process holds {held} more descriptors"
        _honest(rt, "affine")
    finally:
        for path, sems in made:
            os.unlink(path)
            for s in sems:
                s.unlink()
                s.close()
        attacker.close()


# ninth round -------------------------------------------------------------------------------
def test_junk_a_client_leaves_at_its_paths_never_stops_the_supervisor(start_runtime):
    # A client replaces its own segment (and semaphore) with directories and dies; another
    # plants directories at lock paths. Reaping them raised IsADirectoryError in the supervisor
    # thread at every pass, so a killed model process was never restarted and new clients got a
    # raw IsADirectoryError.
    from simpledbi.layout import NEW, lock_path
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, max_clients=8))
    ns = rt.namespace
    code = ("import os, numpy as np; from simpledbi import SharedModel, shm; "
            "from simpledbi.layout import segment_path, sem_name; "
            f"m = SharedModel('affine', max_shape=(1, 2), namespace={ns!r}); "
            "m.forward(np.ones((1, 2), np.float32)); s = m._h.idle[0]; "
            f"p = segment_path({ns!r}, 'affine', s.index, s.token); os.unlink(p); os.mkdir(p); "
            f"q = '/dev/shm/sem.' + sem_name({ns!r}, 'affine', s.index, s.token, 'rdy')[1:]; "
            "os.unlink(q); os.mkdir(q); os.mkdir(os.path.join(q, 'x')); print(s.index, flush=True); os._exit(0)")
    dead = int(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=120).stdout)
    table = rt.tables["affine"]
    for i in range(8):        # every other index: a directory where its lock file goes
        if i != dead:
            os.mkdir(lock_path(ns, "affine", i))
    table.state[(dead + 1) % 8] = NEW   # one of them "attached"
    _wait_for(lambda: table.state[dead] == FREE and table.state[(dead + 1) % 8] == FREE)
    assert not any(n.startswith(f"affine.s{dead}.") for n in os.listdir(os.path.join(shm.SHM_DIR, ns))
                   if not n.endswith(".lock"))
    assert not [e for e in os.listdir(shm.SHM_DIR) if e.startswith(f"sem.{ns}.affine.s{dead}.")]
    _honest(rt, "affine")     # a new client attaches: the junk at its lock path is removed
    os.kill(_pids(rt, "affine")[0], signal.SIGKILL)   # and the supervisor still restarts
    _wait_for(lambda: rt.ctls["affine"].instances["restarts"].sum() == 1
              and all(shm.pid_alive(p) for p in _pids(rt, "affine")), timeout=120)
    _honest(rt, "affine")


def test_a_fifo_where_a_registration_or_control_block_goes_blocks_nobody(start_runtime):
    # A FIFO blocks open() for reading until a writer comes: a client (or another user, in
    # /dev/shm) could hang every runtime start, inspect() and attach by name or model.
    import simpledbi
    from simpledbi import naming
    reg = os.path.join(shm.SHM_DIR, f"sdbi_rt_fifo{os.getpid()}")
    os.mkfifo(reg)
    try:
        rt = start_runtime(cpu_model("affine", models.affine))   # sweeps registrations first
        os.mkfifo(os.path.join(shm.SHM_DIR, rt.namespace, "nosuch.ctl"))
        out = {}

        def look():
            out["reg"] = naming.read(f"fifo{os.getpid()}")
            out["names"] = [r.name for r in naming.list_registrations()]
            out["models"] = [m.name for m in simpledbi.inspect(namespace=rt.namespace).models]
            try:
                SharedModel("nosuch", max_shape=(1, 2), namespace=rt.namespace)
            except LookupError as e:
                out["lookup"] = str(e)

        t = threading.Thread(target=look, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "blocked opening a FIFO"
        assert out["reg"] is None and out["models"] == ["affine"]
        assert "no model named 'nosuch'" in out["lookup"] and "['affine']" in out["lookup"]
        _honest(rt, "affine")
    finally:
        os.unlink(reg)


def test_a_stuffed_doorbell_does_not_stall_the_other_clients(start_runtime, gate):
    # A client posts the doorbell millions of times while the model process is busy: it used to
    # take every post back in one go, in front of everyone's requests (seconds).
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=4))
    blocker = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    t, blocked = _gated_call(blocker, gate)
    door = rt.doorbells["gated"]   # what every client can open and post
    release = door.release
    for _ in range(3_000_000):
        release()
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as honest:
        x = np.full((1, 2), 2.0, np.float32)
        t0 = time.monotonic()
        gate.open()
        np.testing.assert_array_equal(honest.forward(x, timeout=30), x * 2 + 1)
        waited = time.monotonic() - t0
    t.join(30)
    assert "y" in blocked
    assert waited < 0.5, f"an honest call waited {waited:.2f} s behind the stuffed doorbell"
    blocker.close()
    _honest(rt, "gated")


def test_junk_at_a_live_clients_lock_path_does_not_take_its_slot(start_runtime):
    # Someone replaces a live client's lock file with a directory: the reaper cannot tell
    # whether the owner lives (it holds its lock on the file that was there), so it must only
    # set the junk aside -- not unlink the client's segment and semaphores.
    from simpledbi.layout import lock_path
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    victim = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)
    x = np.full((1, 2), 5.0, np.float32)
    np.testing.assert_array_equal(victim.forward(x, timeout=10), x * 2 + 1)
    path = lock_path(rt.namespace, "affine", victim._h.idle[0].index)
    os.unlink(path)
    os.mkdir(path)
    os.mkdir(os.path.join(path, "x"))
    _wait_for(lambda: not os.path.isdir(path))   # set aside by the reaper
    _wait_for(lambda: rt.tables["affine"].state[victim._h.idle[0].index] == FREE)  # a row whose lock is missing
    slot = victim._h.idle[0]
    from simpledbi.layout import segment_path, sem_name
    assert os.path.exists(segment_path(rt.namespace, "affine", slot.index, slot.token))
    assert os.path.exists(os.path.join(shm.SHM_DIR, "sem." + sem_name(rt.namespace, "affine", slot.index,
                                                                      slot.token, "rdy")[1:]))
    for v in (6.0, 7.0, 8.0):
        y = np.full((1, 2), v, np.float32)
        np.testing.assert_array_equal(victim.forward(y, timeout=10), y * 2 + 1)
    victim.close()
    _honest(rt, "affine")


# ---------------------------------------------------------------- eleventh round (2026-11-27)
# A client's semaphores are files it can truncate: any user-space access to them after that is a
# SIGBUS in whoever makes it. The model processes and the supervisor go through the kernel only.
_SEM_HOSTILE = r"""
import os, sys, threading, numpy as np
from simpledbi import SharedModel
from tests.models import GATE
ns, which = sys.argv[1], sys.argv[2]
m = SharedModel("gated", max_shape=(1, 2), namespace=ns)
m.forward(np.ones((1, 2), np.float32))         # the model process now holds this slot's handles
s = m._h.idle[0]
path = f"/dev/shm/sem.{ns}.gated.s{s.index}.{s.token:016x}."
if which == "don_mid":
    threading.Thread(target=m.forward, args=(np.full((1, 2), GATE, np.float32),), daemon=True).start()
    print(path + "don", flush=True)           # the driver truncates it while the model computes
else:
    os.truncate(path + which.split("_")[0], 0)
    print("-", flush=True)
sys.stdin.read()                                # until the driver is done
os._exit(0)                                     # never touch the truncated semaphore here
"""

_SEM_DRIVER = r"""
import functools, os, subprocess, sys, numpy as np
from simpledbi import ModelConfig, RuntimeOptions, SharedModel
from simpledbi.runtime import Runtime
from tests import models
from tests.conftest import Gate
which, hostile_code = sys.argv[1], sys.argv[2]
gate = Gate()
cfg = ModelConfig(name="gated", factory=functools.partial(models.gated, gate.name), max_batch_size=2,
                  wait_time=0.001, device="cpu", num_threads=1)
rt = Runtime([cfg], RuntimeOptions(poll_interval=0.05)).start()
try:
    pids = [int(p) for p in rt.ctls["gated"].instances["pid"]]
    h = subprocess.Popen([sys.executable, "-c", hostile_code, rt.namespace, which],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = h.stdout.readline().strip()
    if which == "don_mid":
        gate.wait_entered()
        os.truncate(line, 0)
        gate.open()
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as m:
        for i in range(40):   # rings that find nothing make the model look at every handle
            rt.doorbells["gated"].release()
            x = np.full((1, 2), float(i), np.float32)
            assert (m.forward(x, timeout=10) == x * 2 + 1).all()
    assert [int(p) for p in rt.ctls["gated"].instances["pid"]] == pids, "a model process died"
finally:
    rt.shutdown()                       # posts every attached slot's don, the hostile's too
    h.stdin.close()
    h.wait(30)
    gate.close()
print("DRIVER OK", flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["rdy", "don", "don_mid"])
def test_a_client_that_truncates_its_own_semaphore_hurts_nobody_else(which):
    # rdy: the model process read its value (a sweep for hidden requests) and died of SIGBUS, and
    # the slot finder gave it to each restarted process until the model was marked broken. don:
    # the model process died posting it, and so did the supervisor -- the whole runtime -- when it
    # posted it for the dead process's callers or at shutdown.
    p = subprocess.Popen([sys.executable, "-c", _SEM_DRIVER, which, _SEM_HOSTILE], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=150)
    finally:
        p.kill()
        for e in os.listdir("/dev/shm"):   # a driver that died leaves its gate behind
            if e.startswith(f"sem.sdbitest_{p.pid}_"):
                os.unlink(os.path.join("/dev/shm", e))
    assert p.returncode == 0 and "DRIVER OK" in out, (p.returncode, out, err[-3000:])


def test_a_token_posted_again_does_not_run_the_request_again(start_runtime):
    # A client posted its rdy 100,000 times after an answered request: model processes took one
    # token per poll interval and ran the same request again each time, for hours.
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        s = m._h.idle[0]
        batches = rt.ctls["affine"].counters["batches"]
        before = int(batches.sum())
        for _ in range(1000):
            s.ready.release()
        door = rt.doorbells["affine"]
        _wait_for(lambda: door.release() or s.ready.value == 0)   # a model process took them
        assert int(batches.sum()) == before, "the answered request ran again"
        np.testing.assert_array_equal(m.forward(2 * x), 2 * x * 2 + 1)


def test_a_replayed_header_over_pages_turned_back_into_holes_is_refused(start_runtime):
    # The header of a validated request, published again after the client turned its input
    # pages back into holes (truncate, extend): the fast path reused the old checks, and the
    # model process staged memory the client no longer paid for (8 x 128 MiB -> 1.2 GiB kept).
    from simpledbi.layout import DATA_OFFSET
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=2))
    n = 1 << 17   # 512 KiB a request
    with SharedModel("affine", max_shape=(1, n), namespace=rt.namespace) as m:
        x = np.ones((1, n), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        s = m._h.idle[0]
        size = os.fstat(s.seg.fd).st_size
        os.ftruncate(s.seg.fd, DATA_OFFSET)
        os.ftruncate(s.seg.fd, size)
        # publish the same header again without writing the inputs
        s.seq += 1
        s._r_seq[0] = s.seq
        s.ready.release()
        t = s.table
        t.seq[s.index] = s.seq
        t.state[s.index] = PUBLISHED
        s.doorbell.release()
        with pytest.raises(ValueError, match="unwritten pages"):
            m._await(s, s.seq, time.monotonic() + 30)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)   # written for real: served
    _honest(rt, "affine")


# ---------------------------------------------------------------- thirteenth round (2026-11-27)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hidden", [False, True], ids=["published", "hidden"])
def test_a_client_holding_its_own_claim_locks_does_not_buy_a_claim_per_ring(start_runtime, hidden):
    # Round 12: a client that held the claim lock of 200 of its own slots, each with a request
    # (its row published, or hidden), and rang the doorbell 500 times a second kept a model
    # process at 40-60% of a core: every ring retried every locked slot. Now a slot whose lock was
    # held is retried once per poll interval; its requests are served once the lock goes.
    from simpledbi.config import RuntimeOptions
    from simpledbi.foreign_sem import lock_segment, unlock_segment
    from simpledbi.layout import IDLE
    from simpledbi.slots import ClientSlot
    poll, k, rings = 1.0, 12, 60
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    refused = rt.ctls["affine"].counters["claims_missed"]
    door = rt.doorbells["affine"]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        h = m._h
        slots, seqs = [], []
        try:
            for i in range(k):
                s = ClientSlot(h.namespace, h.name, h.ctl, h.table, h.doorbell, m.max_shapes, m.dtypes)
                slots.append(s)
                assert lock_segment(s.seg.fd)
                seqs.append(s.publish([np.full((1, 2), i, np.float32)]))
                if hidden:
                    s.table.state[s.index] = IDLE
            door.release()
            _wait_for(lambda: int(refused.sum()) >= k)   # each locked slot found and tried once
            base, t0 = int(refused.sum()), time.monotonic()
            for _ in range(rings):
                _ring_and_wait(door)
            elapsed = time.monotonic() - t0
            tried = int(refused.sum()) - base
            # per slot: the escalating waits after a refusal (5 ms doubling up to poll: about
            # log2(poll / 5 ms) tries), and one more per maintenance pass (and the sweep after
            # it); each ring retried every slot before (720 tries)
            escalating = math.ceil(math.log2(poll / _REFUSED_FIRST)) + 1
            assert tried <= k * (escalating + 2 * (elapsed / poll + 1)), (tried, elapsed)
            np.testing.assert_array_equal(m.forward(2 * x), 2 * x * 2 + 1)
            for s in slots:
                unlock_segment(s.seg.fd)
                if hidden:
                    s.table.state[s.index] = PUBLISHED
            door.release()
            for i, (s, q) in enumerate(zip(slots, seqs)):
                assert s.wait(q, 4 * poll + 10), f"slot {i}: its request was never served"
                assert s.response()[0] == 0, s.response()
                np.testing.assert_array_equal(s.outputs()[0], np.full((1, 2), 2 * i + 1, np.float32))
        finally:
            for s in slots:
                s.detach()
    _honest(rt, "affine")


@pytest.mark.timeout(120)
def test_rows_rewritten_before_every_ring_buy_a_few_claims_not_one_per_row(start_runtime):
    # Round 13: a client that wrote a new seq into every row of the table (no slots of its own,
    # no lock) before each doorbell ring made the model process try a claim per row per ring:
    # 96% of a core at 1000 rings/s, honest throughput -60% and p50 0.5 -> 3.4 ms. Now slots whose
    # claims got nothing lately are tried a few per scan, honest ones (which succeed) first.
    from simpledbi.config import RuntimeOptions
    from simpledbi.model_process import _RETRY_BUDGET
    poll, rings = 2.0, 60
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, max_clients=256),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    missed = rt.ctls["affine"].counters["claims_missed"]
    door, table = rt.doorbells["affine"], rt.tables["affine"]
    rows = table.state.shape[0]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        mine = m._h.idle[0].index
        forged = np.array([i for i in range(rows) if i != mine])
        seq = 10**6
        base, t0 = int(missed.sum()), time.monotonic()
        for r in range(rings):
            seq += 1
            table.seq[forged] = seq
            table.state[forged] = PUBLISHED
            _ring_and_wait(door)
            if r % 10 == 9:   # an honest call meanwhile: exact, and not held up
                np.testing.assert_array_equal(m.forward(r * x, timeout=5), r * x * 2 + 1)
        elapsed = time.monotonic() - t0
        tried = int(missed.sum()) - base
        assert tried >= len(forged) // 2, "the forged rows were not tried: the test tests nothing"
        # each forged slot once (then it "missed lately"), then a budget per scan (a ring, the
        # honest calls' own rings, their rescans)
        assert tried <= len(forged) * (1 + elapsed / poll) + 4 * rings * _RETRY_BUDGET, (tried, elapsed)
        table.state[forged] = FREE
    _honest(rt, "affine")


# 16 slots of its own kept busy (served more recently than anyone), and a new seq written into
# every row of the table before each doorbell ring, until its stdin closes.
_BUSY_AND_REWRITE = r"""
import sys, threading, time
import numpy as np
from simpledbi import SharedModel
from simpledbi.layout import PUBLISHED
ns = sys.argv[1]
stop = threading.Event()
x = np.ones((1, 2), np.float32)
def busy():
    with SharedModel("affine", max_shape=(1, 2), namespace=ns) as b:
        while not stop.is_set():
            b.forward(x)
            time.sleep(0.001)
handles = [threading.Thread(target=busy) for _ in range(16)]
for t in handles:
    t.start()
m = SharedModel("affine", max_shape=(1, 2), namespace=ns)
table, door = m._h.table, m._h.doorbell
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("RUNNING", flush=True)
seq = 10**9
while not stop.is_set():
    seq += 1
    table.seq[:] = seq
    table.state[:] = PUBLISHED
    door.release()
    time.sleep(0.0002)
for t in handles:
    t.join()
m.close()
"""


@pytest.mark.timeout(120)
def test_rows_rewritten_while_the_attacker_is_served_often_do_not_starve_an_honest_client(start_runtime):
    # Round 14: a client keeping 12-16 slots of its own busy (served more recently than anyone) and
    # writing a new seq into every row before each ring pushed honest slots out of the retry
    # budget until their miss aged (poll_interval): honest max 320-500 ms, throughput -46-61%.
    # Now a slot that missed lately and whose row names a handle the model process holds is
    # looked at through its rdy every 5-20 ms, whatever the others' rank.
    from simpledbi.config import RuntimeOptions
    poll = 2.0
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=8, max_clients=64),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    x = np.ones((1, 2), np.float32)
    slow = []
    with _hostile_process(_BUSY_AND_REWRITE, rt.namespace):
        with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as h:
            for i in range(500):
                t = time.monotonic()
                np.testing.assert_array_equal(h.forward(i * x, timeout=poll), i * x * 2 + 1)
                if time.monotonic() - t > poll / 4:
                    slow.append(round(time.monotonic() - t, 3))
                threading.Event().wait(0.005)   # a client that thinks between calls: meanwhile
                # its row, rewritten, is tried with nothing posted and "misses"
    # before: some calls waited until their slot's miss aged (up to poll_interval); now 5-20 ms
    assert not slow, slow
    _honest(rt, "affine")


# ---------------------------------------------------------------- fifteenth round (2026-11-27)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("header", ["answered", "invalid"])
def test_a_token_re_armed_before_every_ring_buys_one_reject_per_poll_interval(start_runtime, header):
    # Round 15: a client that posted its own answered slot's rdy again and wrote a higher seq
    # into its row before each ring bought a claim, a header read and a reject per ring: 300
    # such slots at 1000 rings/s took a model process to 89% of a core and honest throughput
    # -87%. Now such a slot's rows under that token are not looked at for a poll interval.
    # Round 17: the same over a header that fails validation (magic 0) was not banned at all:
    # 41 rejects in 60 rings; 300 such slots, honest throughput -81 to -87%. Now each reject in
    # a row doubles the slot's wait, from 5 ms up to a poll interval.
    from simpledbi.config import RuntimeOptions
    from simpledbi.model_process import _REJECTED_FIRST
    poll, rings = 2.0, 60
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    bad, door = rt.ctls["affine"].counters["bad_requests"], rt.doorbells["affine"]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as m:
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
        s = m._h.idle[0]
        if header == "invalid":
            s._req["magic"] = 0
        base, t0 = int(bad.sum()), time.monotonic()
        for r in range(rings):
            s.ready.release()
            s.table.seq[s.index] = 10**6 + r
            s.table.state[s.index] = PUBLISHED
            _ring_and_wait(door)
        elapsed = time.monotonic() - t0
        rejects = int(bad.sum()) - base
        assert rejects >= 1, "the re-armed token was never claimed: the test tests nothing"
        escalating = math.ceil(math.log2(poll / _REJECTED_FIRST)) + 1 if header == "invalid" else 0
        assert rejects <= escalating + 2 * (1 + elapsed / poll), (rejects, elapsed)
        if header == "invalid":
            s._req["magic"] = MAGIC
    _honest(rt, "affine")   # (the attacker's own next call may get the rejection: its fault)


# ---------------------------------------------------------------- sixteenth round (2026-11-27)
@pytest.mark.timeout(120)
def test_a_claim_lock_found_held_once_does_not_hide_the_slot_for_a_poll_interval(start_runtime):
    # Round 16: a model process that found a slot's claim lock held -- mostly a race: a peer
    # process taking that very request, or its client withdrawing it -- left the slot out of
    # its sweeps for a whole poll interval. A forger who then hid that client's row (a fresh
    # token in every row before each ring) made its next request wait that long: with two model
    # processes, honest throughput -60% and waits of 500 ms. Now a first refusal costs 5 ms.
    from simpledbi.config import RuntimeOptions
    from simpledbi.foreign_sem import lock_segment, unlock_segment
    poll = 2.0
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=2),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    missed, door = rt.ctls["affine"].counters["claims_missed"], rt.doorbells["affine"]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace, poll_interval=poll) as m:
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)   # the model process has a handle
        s = m._h.idle[0]
        assert lock_segment(s.seg.fd)   # as a peer process does for the microseconds of a claim
        base = int(missed.sum())
        seq = s.publish([3 * x])
        _wait_for(lambda: int(missed.sum()) > base)   # the claim found the lock held
        unlock_segment(s.seg.fd)
        rng = np.random.default_rng(16)
        t0 = time.monotonic()
        while not s.answered(seq) and time.monotonic() - t0 < 2 * poll:
            s.table.token[s.index] = int(rng.integers(1, 2**62))   # the forger, before each ring
            _ring_and_wait(door)
        took = time.monotonic() - t0
        s.table.token[s.index] = s.token
        np.testing.assert_array_equal(m._await(s, seq, time.monotonic() + 10)[0][0], 3 * x * 2 + 1)
        assert took < poll / 10, f"the hidden request waited {took:.3f} s (poll interval {poll} s)"
        np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
    _honest(rt, "affine")


# ---------------------------------------------------------------- eighteenth round (2026-11-27)
_FORGE_TOKENS_QUIETLY = r"""
import sys, threading, time
import numpy as np
from simpledbi import SharedModel
m = SharedModel("affine", max_shape=(1, 2), namespace=sys.argv[1])
m.forward(np.ones((1, 2), np.float32))
table, rng = m._h.table, np.random.default_rng(18)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("RUNNING", flush=True)
while not stop.is_set():   # a fresh token in every row, every 0.5 ms; never a ring, never a post
    table.token[:] = rng.integers(1, 2**62, table.token.shape[0]).astype(np.uint64)
    time.sleep(0.0005)
m.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("new_clients", [False, True], ids=["established", "new"])
def test_rows_forged_without_rings_do_not_leave_a_request_for_a_poll_interval(start_runtime, new_clients):
    # Round 18: a client that wrote a fresh token into every row every 0.5 ms -- no ring, no post
    # -- hid an honest request whose ring a model process had already taken: the pass claimed
    # nothing, the sweep was rate-limited and nothing woke the process again before its poll
    # interval (honest calls of 0.5-1.5 s, -99% throughput). A new client's first request,
    # whose handle no process had yet, waited for the directory listing, at most once a second.
    # Now a ring that claims nothing is looked at again every 5 ms for 40 ms (paced looks
    # through the handles held, the sweep), a forged row is looked behind at once through the
    # slot's handle, and the directory is listed when asked, at most every 50 ms.
    from simpledbi.config import RuntimeOptions
    poll = 2.0
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4),
                       options=RuntimeOptions(poll_interval=poll, join_timeout=10.0))
    x = np.ones((1, 2), np.float32)
    worst = 0.0
    with _hostile_process(_FORGE_TOKENS_QUIETLY, rt.namespace):
        m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace, poll_interval=poll)
        try:
            for i in range(300):
                if new_clients and i % 20 == 0:
                    m.close()
                    m = SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace,
                                    poll_interval=poll)
                t0 = time.monotonic()
                np.testing.assert_array_equal(m.forward(x * i, timeout=3 * poll), x * i * 2 + 1)
                worst = max(worst, time.monotonic() - t0)
        finally:
            m.close()
    assert worst < poll / 4, f"a call waited {worst:.3f} s (poll interval {poll} s)"
    _honest(rt, "affine")
