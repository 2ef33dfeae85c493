"""What a new user hit (issue 21, items 1, 2, 4, 5, 6, 10): each test failed on the code before."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from simpledbi import Runtime, RuntimeStopped, SharedModel, naming

from . import models
from .conftest import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(name: str, model: str = "m=tests.models:affine", *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "simpledbi", "serve", "--name", name, "--device", "cpu",
                             "--model-num", "2", "--model", model, *extra], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def _until(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        threading.Event().wait(0.02)   # a bounded wait on an outside condition


def _kill(p: subprocess.Popen, sig=signal.SIGKILL) -> str:
    if p.poll() is None:
        p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=30)
    return err


# 1 --------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_runtime_killed_while_it_starts_does_not_fail_a_call_attached_by_name():
    """SIGTERM the runtime, start a second, SIGKILL it while its model processes load, start a
    third: a client looping forward(timeout=60) by name gets every answer -- each call waits
    for a successor within its timeout, whatever state its runtime died in."""
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    first = _serve(name)
    procs = [first]
    try:
        _until(lambda: naming.resolve(name) is not None, what="the first runtime")
        client = SharedModel("m", (1, 3), runtime=name, connect_timeout=60)
        errors, served, stop = [], [], threading.Event()

        def loop():
            i = 0
            while not stop.is_set():
                x = np.full((1, 3), float(i), np.float32)
                try:
                    np.testing.assert_array_equal(client.forward(x, timeout=60), x * 2 + 1)
                    served.append(time.monotonic())
                except BaseException as e:  # noqa: BLE001 - the test reports it
                    errors.append(e)
                    return
                i += 1

        t = threading.Thread(target=loop)
        t.start()
        _until(lambda: len(served) > 5, what="calls to the first runtime")
        _kill(first, signal.SIGTERM)
        second = _serve(name)
        procs.append(second)
        _until(lambda: (naming.resolve(name) or naming.Registration("", "", 0, (), 0)).pid == second.pid,
               what="the second runtime's registration")
        _kill(second)                     # while its model processes load
        third = _serve(name)
        procs.append(third)
        _until(lambda: (naming.resolve(name) or naming.Registration("", "", 0, (), 0)).pid == third.pid,
               what="the third runtime")
        n = len(served)
        _until(lambda: len(served) > n + 5 or errors, what="calls to the third runtime")
        stop.set()
        t.join(90)
        assert not t.is_alive() and errors == [], errors[:1]
        client.close()
    finally:
        for p in procs:
            _kill(p, signal.SIGTERM)


# 2 --------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_model_processes_of_a_runtime_killed_while_they_load_print_no_traceback(tmp_path):
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    marker = tmp_path / "loading"
    p = _serve(name, "m=tests.models:slow_to_load", env={"SDBI_TEST_LOADING": str(marker)})
    try:
        _until(marker.exists, what="a model process loading")   # inside its 3 s factory now
    finally:
        err = _kill(p)   # reads stderr to its end: until the janitor and every model process exit
    assert "Traceback" not in err, err
    assert err.count("\n") <= 6, err


@pytest.mark.timeout(180)
def test_status_shows_a_loading_process_on_its_device(tmp_path):
    # `simpledbi status` showed "cuda:0 loading" for a CPU model: the device was written once loaded
    from simpledbi import inspect
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    marker = tmp_path / "loading"
    p = _serve(name, "m=tests.models:slow_to_load", env={"SDBI_TEST_LOADING": str(marker)})
    try:
        _until(marker.exists, what="a model process loading")   # inside its 3 s factory now
        loading = [i for i in inspect(name).models[0].instances if i.state == "loading"]
        assert loading and all(i.device == ("cpu" if i.pid else "-") for i in loading), loading
        assert any(i.pid for i in loading), loading
    finally:
        _kill(p, signal.SIGTERM)


@pytest.mark.timeout(120)
def test_a_client_attached_by_name_while_the_model_loads_gets_the_declared_inputs(tmp_path):
    # it attached the moment the name was registered, read no declared shapes (published with
    # RUNNING), and failed: "expected max_shape=(rows, *item_shape) ... declares no input shapes"
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    marker = tmp_path / "loading"
    p = _serve(name, "m=tests.models:slow_to_load", "--input-shape", "3", "--max-batch-size", "4",
               env={"SDBI_TEST_LOADING": str(marker)})
    try:
        _until(marker.exists, what="a model process loading")   # inside its 3 s factory now
        with SharedModel("m", runtime=name, connect_timeout=60) as client:
            assert client.max_shapes == ((4, 3),)
            x = np.arange(3, dtype=np.float32).reshape(1, 3)
            np.testing.assert_array_equal(client.forward(x, timeout=60), x * 2 + 1)
    finally:
        _kill(p, signal.SIGTERM)


# 4 --------------------------------------------------------------------------------------------
def test_last_timing_under_asyncio(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=8, wait_time=0.001))
    m = SharedModel("affine", (1, 3), namespace=rt.namespace)
    x = np.ones((1, 3), np.float32)

    async def one():
        y = await m.forward_async(x)
        return y, m.last_timing()          # the task's own request

    async def many():
        await asyncio.gather(*[m.forward_async(x) for _ in range(5)])
        return m.last_timing()             # no request of its own: the handle's last one

    y, own = asyncio.run(one())
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert own["published"] <= own["batch_closed"] <= own["done"] <= own["woken"]
    after = m.last_timing()                # the main thread, after asyncio.run() of one call
    assert after["published"] == own["published"]
    t = asyncio.run(many())
    assert t["published"] > own["published"] and t["batch_rows"] >= 1
    m.close()


# 5 --------------------------------------------------------------------------------------------
def test_stats_after_close_is_runtime_stopped(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine))
    m = SharedModel("affine", (1, 3), namespace=rt.namespace)
    assert m.stats()["requests"] == 0
    m.close()
    with pytest.raises(RuntimeStopped, match="closed"):
        m.stats()


# 6 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 2**40, 2**40), (1, 10**12), (2**64,)])
def test_a_max_shape_that_cannot_fit_is_refused_up_front(start_runtime, shape):
    rt = start_runtime(cpu_model("affine", models.affine))
    with pytest.raises(ValueError, match=r"needs a slot of [\d,]+ bytes .* more than this machine's memory"):
        SharedModel("affine", shape, namespace=rt.namespace)


# 10 -------------------------------------------------------------------------------------------
def _pool_call(namespace):
    m = SharedModel("affine", (1, 3), namespace=namespace)
    return float(m.forward(np.ones((1, 3), np.float32))[0, 0])


def test_pool_workers_that_exit_holding_handles_log_nothing_at_info(start_runtime, caplog):
    rt = start_runtime(cpu_model("affine", models.affine))
    caplog.set_level(logging.INFO, logger="simpledbi")
    with mp.get_context("spawn").Pool(3) as pool:
        assert pool.map(_pool_call, [rt.namespace] * 6) == [3.0] * 6
    _until(lambda: int(rt.ctls["affine"].instances["clients"].max()) == 0, what="slots dropped")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


# 11 -------------------------------------------------------------------------------------------
def test_a_second_runtime_of_the_same_models_in_one_process_is_pointed_out(start_runtime, caplog):
    """A notebook cell that starts a Runtime, run again, starts a second beside the first, which
    runs (its memory, its GPU) until the kernel exits: the second's start says so. Runtimes of
    other models, or after the first was shut down, are not pointed out."""
    caplog.set_level(logging.WARNING, logger="simpledbi.runtime")

    def twin_warnings():
        return [r.getMessage() for r in caplog.records if "already runs a Runtime" in r.getMessage()]

    first = start_runtime(cpu_model("affine", models.affine))
    start_runtime(cpu_model("other", models.affine))   # other models: nothing to say
    assert twin_warnings() == []
    second = start_runtime(cpu_model("affine", models.affine))
    assert len(twin_warnings()) == 1 and first.namespace in twin_warnings()[0], twin_warnings()
    first.shutdown()
    second.shutdown()
    start_runtime(cpu_model("affine", models.affine))   # the others are shut down: nothing to say
    assert len(twin_warnings()) == 1


def _forward_in_worker(m: SharedModel, v: float):
    return os.getpid(), m.forward(np.full((1, 2), v, np.float32), timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_handle_sent_to_pool_workers_attaches_there(start_runtime, method):
    """A SharedModel passed to a Pool's task (pickled) arrives attached to the same model, with slots
    of its own (it raised "TypeError: cannot pickle 'mmap.mmap' object")."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    m = SharedModel("affine", (1, 2), namespace=rt.namespace, priority=3)
    copy = __import__("copy").deepcopy(m)
    assert copy is not m and copy.namespace == m.namespace and copy.priority == 3
    np.testing.assert_array_equal(copy.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    copy.close()
    with mp.get_context(method).Pool(2) as pool:
        out = pool.starmap(_forward_in_worker, [(m, float(v)) for v in range(8)])
    assert len({pid for pid, _ in out} - {os.getpid()}) >= 1
    for v, (_, y) in enumerate(out):
        np.testing.assert_array_equal(y, np.full((1, 2), 2.0 * v + 1))
    np.testing.assert_array_equal(m.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))
    m.close()
    for closed in (__import__("copy").deepcopy(m), __import__("pickle").loads(__import__("pickle").dumps(m))):
        with pytest.raises(RuntimeStopped, match="is closed"):   # (it arrived open and attached)
            closed.forward(np.ones((1, 2), np.float32))
        with pytest.raises(RuntimeStopped, match="is closed"):   # ("not callable", helper-48)
            closed(np.ones((1, 2), np.float32))
        with pytest.raises(RuntimeStopped, match="is closed"):   # (no context manager, helper-48)
            with closed:
                pass
        closed.close()


@pytest.mark.timeout(120)
def test_a_handle_sent_where_its_runtime_is_gone_raises_in_the_task():
    """Unpickled where it cannot attach, the handle raises at its first use (the error raised while
    unpickling killed the Pool's worker and lost the task: the caller waited forever -- helper-40)."""
    rt = Runtime([cpu_model("affine", models.affine)]).start()
    m = SharedModel("affine", (1, 2), namespace=rt.namespace)
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_forward_in_worker, (m, 1.0))[1].tolist() == [[3.0, 3.0]]
        rt.shutdown()
        with pytest.raises(LookupError, match="no simpledbi runtime"):
            pool.apply_async(_forward_in_worker, (m, 1.0)).get(timeout=60)
        m.close()
