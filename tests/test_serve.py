"""Serving processes simpledbi did not start: named runtimes, `simpledbi serve`, re-attach after a
restart, draining at SIGTERM, status / inspect / Prometheus, model-process logs, forward_async."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import simpledbi
from simpledbi import RuntimeStopped, SharedModel, naming
from simpledbi.cli import load_serve_config, _parser
from simpledbi.layout import BROKEN
from simpledbi.runtime import Runtime

from . import models
from .conftest import FAST, cpu_model, stderr_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name() -> str:
    return f"t{os.getpid()}-{secrets.token_hex(3)}"


def _serve(name: str, *extra: str, env=None, group: bool = False) -> subprocess.Popen:
    """``group``: in a process group of its own, so a test may signal all of it."""
    cmd = [sys.executable, "-m", "simpledbi", "serve", "--name", name, "--device", "cpu",
           "--model-num", "1", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})}, start_new_session=group)


def _wait_for(proc: subprocess.Popen, word: str, timeout: float = 60) -> str:
    """Read the serve process's log (stderr) until a line containing ``word``."""
    seen = []
    q = stderr_lines(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if word in line:
            return line
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"{word!r} never came; log:\n{''.join(seen)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _gone(reg) -> bool:
    return not os.path.exists(f"/dev/shm/{reg.namespace}") and not any(
        e.startswith(f"sem.{reg.namespace}") for e in os.listdir("/dev/shm"))


def _attached_to_a_runtime_that_stopped(name: str, **kw) -> SharedModel:
    """A client attached by name that was served once, by a runtime that has stopped since."""
    x = np.ones((1, 3), np.float32)
    rt = Runtime([cpu_model("m", models.affine)], FAST, name=name).start()
    try:
        client = SharedModel("m", (1, 3), runtime=name, **kw)
        np.testing.assert_array_equal(client.forward(x), x * 2 + 1)
    finally:
        rt.shutdown()
    return client


# ---------------------------------------------------------------- named runtimes in-process
@pytest.mark.timeout(120)
def test_a_named_runtime_is_found_by_name_and_the_name_is_exclusive(monkeypatch):
    name = _name()
    with Runtime([cpu_model("m", models.affine)], FAST, name=name) as rt:
        reg = naming.resolve(name)
        assert reg.namespace == rt.namespace and reg.models == ("m",) and reg.pid == os.getpid()
        second = Runtime([cpu_model("m", models.affine)], FAST, name=name)
        with pytest.raises(RuntimeError, match=f"runtime named '{name}' is already running \\(pid {os.getpid()}\\): "
                                               f"this process started it .* call shutdown\\(\\) on that Runtime"):
            second.start()
        assert second.namespace is None and second._janitor is None   # refused before starting anything
        with SharedModel("m", (2, 3), runtime=name) as a:
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            np.testing.assert_array_equal(a.forward(x), x * 2 + 1)
        monkeypatch.setenv(naming.ENV_RUNTIME, name)
        with SharedModel("m", (1, 3)) as b:   # $SIMPLEDBI_RUNTIME
            assert b.runtime == name and b.namespace == rt.namespace
        with pytest.raises(LookupError, match=rf"runtime '{name}' serves \['m'\], not 'other'"):
            SharedModel("other", (1, 3), runtime=name)
    assert naming.read(name) is None  # unregistered at shutdown


@pytest.mark.timeout(120)
def test_a_client_waits_for_a_runtime_that_starts_later_or_times_out_clearly():
    name = _name()
    with pytest.raises(RuntimeStopped, match=f"no simpledbi runtime named '{name}' is running "
                                             r"within the connect timeout \(0.2 s\)") as info:
        SharedModel("m", (1, 3), runtime=name, connect_timeout=0.2)
    assert isinstance(info.value, TimeoutError)   # RuntimeUnavailable: it may come up later
    got = {}

    def early_client():
        try:
            with SharedModel("m", (1, 3), runtime=name, connect_timeout=60) as c:
                got["y"] = c.forward(np.ones((1, 3), np.float32), timeout=60)
        except BaseException as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=early_client)
    t.start()  # before the runtime exists: it polls the name until the runtime registers
    with Runtime([cpu_model("m", models.affine)], FAST, name=name):
        t.join(60)
    assert not t.is_alive() and "error" not in got, got
    np.testing.assert_array_equal(got["y"], np.full((1, 3), 3, np.float32))


@pytest.mark.timeout(120)
def test_a_client_attached_by_name_survives_a_runtime_restart():
    name = _name()
    x = np.ones((1, 3), np.float32)
    client = _attached_to_a_runtime_that_stopped(name)
    old = client.namespace
    with Runtime([cpu_model("m", models.affine)], FAST, name=name) as second:
        np.testing.assert_array_equal(client.forward(x, timeout=30), x * 2 + 1)  # re-attached
        assert client.namespace == second.namespace != old
        client.close()
    # attached by namespace, there is nothing to re-attach to: a clear error
    with Runtime([cpu_model("m", models.affine)], FAST) as third:
        fixed = SharedModel("m", (1, 3), namespace=third.namespace)
    with pytest.raises(RuntimeStopped):
        fixed.forward(x, timeout=5)
    fixed.close()


@pytest.mark.timeout(120)
def test_close_ends_a_call_waiting_for_the_named_runtime_to_come_back():
    name = _name()
    client = _attached_to_a_runtime_that_stopped(name, connect_timeout=60)
    connecting, got = threading.Event(), {}
    connect = client._connect

    def watched_connect(*a, **kw):   # the call is now waiting for a successor
        connecting.set()
        return connect(*a, **kw)

    client._connect = watched_connect

    def call():
        try:
            got["y"] = client.forward(np.ones((1, 3), np.float32))
        except BaseException as e:  # noqa: BLE001 - asserted below
            got["error"] = e

    t = threading.Thread(target=call)
    t.start()
    assert connecting.wait(30)
    client.close()
    t.join(10)   # not connect_timeout (60 s): close() ends the wait
    assert not t.is_alive(), "close() did not end a call waiting for the runtime to come back"
    assert isinstance(got.get("error"), RuntimeStopped) and "closed" in str(got["error"]), got


@pytest.mark.timeout(120)
def test_calls_waiting_for_the_named_runtime_to_come_back_each_keep_their_own_timeout():
    """Calls of one handle wait for a successor side by side, each on its own clock: a call with
    timeout=0.5 s behind one without a timeout used to wait out that call's connect_timeout first
    (the wait held the handle's attach lock), and the k-th call without one k connect timeouts."""
    name = _name()
    client = _attached_to_a_runtime_that_stopped(name, connect_timeout=30)
    x = np.ones((1, 3), np.float32)
    connecting, got = threading.Semaphore(0), {}
    connect = client._connect

    def watched_connect(*a, **kw):   # a call is now waiting for a successor
        connecting.release()
        return connect(*a, **kw)

    client._connect = watched_connect

    def call(k, timeout=None):
        t0 = time.monotonic()
        try:
            got[k] = client.forward(x, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - asserted below
            got[k] = e
        got[k, "s"] = time.monotonic() - t0

    waiting = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    waiting[0].start()
    assert connecting.acquire(timeout=30)
    hurried = threading.Thread(target=call, args=("hurried", 0.5))
    hurried.start()
    hurried.join(20)   # (connect_timeout is 30 s)
    assert not hurried.is_alive() and isinstance(got["hurried"], simpledbi.RuntimeUnavailable), got
    assert got["hurried", "s"] < 5, got
    for t in waiting[1:]:   # they wait side by side
        t.start()
        assert connecting.acquire(timeout=10)
    with Runtime([cpu_model("m", models.affine)], FAST, name=name) as second:
        for t in waiting:
            t.join(60)
        assert not any(t.is_alive() for t in waiting)
        for k in range(3):   # all three re-attached, to one set of handles
            np.testing.assert_array_equal(got[k], x * 2 + 1)
        assert client.namespace == second.namespace
        np.testing.assert_array_equal(client.forward(x, timeout=10), x * 2 + 1)
        client.close()


@pytest.mark.timeout(120)
def test_a_cancelled_forward_async_waiting_for_the_named_runtime_frees_its_thread():
    """Cancelling forward_async tasks whose calls wait for a named runtime to come back ends those
    waits too: the pool's threads kept waiting (up to connect_timeout) for a call nobody awaits."""
    name = _name()
    client = _attached_to_a_runtime_that_stopped(name, connect_timeout=60)
    waiting, lock = [0], threading.Lock()
    connect = client._connect

    def watched_connect(*a, **kw):   # counts the calls waiting for a successor
        with lock:
            waiting[0] += 1
        try:
            return connect(*a, **kw)
        finally:
            with lock:
                waiting[0] -= 1

    client._connect = watched_connect

    async def main():
        tasks = [asyncio.ensure_future(client.forward_async(np.ones((1, 3), np.float32)))
                 for _ in range(8)]
        while waiting[0] < 8:
            await asyncio.sleep(0.005)   # bounded by the test's timeout: all 8 wait for a successor
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    deadline = time.monotonic() + 10   # not connect_timeout (60 s)
    while waiting[0] and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert waiting[0] == 0, f"{waiting[0]} pool threads still wait for the runtime of cancelled tasks"
    client.close()


@pytest.mark.timeout(120)
def test_a_request_held_when_its_model_breaks_gets_model_process_died_at_once(gate):
    """A model marked broken while a surviving process holds requests of a client attached by name:
    that process, stopping, answers them "stopped"; the client took it for its runtime gone and
    waited connect_timeout for a successor -- on that call and every later one of the handle -- then
    raised RuntimeUnavailable, though the runtime runs on. Now: ModelProcessDied, at once."""
    name = _name()
    cfg = cpu_model("m", functools.partial(models.sleepy, 0.0, gate.name), model_num=2,
                    max_batch_size=2, wait_time=0.001, max_restarts=0)
    with Runtime([cfg], FAST, name=name) as rt:
        m = SharedModel("m", (1, 2), runtime=name, connect_timeout=60)
        other = SharedModel("m", (1, 3), runtime=name, connect_timeout=60)   # another item shape
        held = lambda: sorted(int(v) for v in rt.ctls["m"].instances["held"][:2])   # noqa: E731
        got, threads = {}, []

        def start(k, h, x):
            def call():
                try:
                    got[k] = h.forward(x)
                except BaseException as e:  # noqa: BLE001 - asserted below
                    got[k] = e
            threads.append(threading.Thread(target=call))
            threads[-1].start()

        def sent(h, n):
            return lambda: sum(s.sent_seq == s.seq for s in list(h._h.busy)) == n

        start("gated", m, np.full((1, 2), models.GATE, np.float32))
        gate.wait_entered()                                          # process A: in the gate
        start("slow", m, np.full((1, 2), models.SLOW, np.float32))   # process B: a 1 s batch
        _wait_until(lambda: held() == [1, 1])
        start("gated2", m, np.full((1, 2), models.GATE, np.float32))
        _wait_until(sent(m, 3))
        for k in range(2):   # queued behind it: B takes 0, of another shape, into its backlog, and
            start(k, other, np.full((1, 3), float(k), np.float32))   # leaves 1 on the socket (a CPU
            _wait_until(sent(other, k + 1))                          # process with peers holds no
        gate.wait_entered()                                          # more than a batch)
        assert held() == [1, 2]
        a = int(np.argmin(rt.ctls["m"].instances["held"][:2]))
        os.kill(int(rt.ctls["m"].instances["pid"][a]), signal.SIGKILL)   # max_restarts=0: broken
        _wait_until(lambda: rt.ctls["m"].state == BROKEN)
        gate.open()
        gate.open()
        for t in threads:
            t.join(20)   # not connect_timeout (60 s)
        assert not any(t.is_alive() for t in threads), got
        assert isinstance(got[0], simpledbi.ModelProcessDied) and \
            isinstance(got[1], simpledbi.ModelProcessDied), got
        with pytest.raises(simpledbi.ModelProcessDied):
            other.forward(np.ones((1, 3), np.float32), timeout=10)   # later calls: at once too
        m.close()
        other.close()


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        threading.Event().wait(0.002)   # bounded wait on a shared-memory condition


# ---------------------------------------------------------------- simpledbi serve
@pytest.mark.timeout(180)
@pytest.mark.parametrize("to_group", [False, True, "twice"])
def test_serve_drains_accepted_requests_at_sigterm_and_cleans_up(gate, to_group):
    # to_group: what systemd's default KillMode, `timeout` and `kill -- -PGID` do; the model
    # processes got the SIGTERM too, died, and every accepted request failed with ModelProcessDied.
    # "twice": what `timeout` does, to the process and then to its group -- the second SIGTERM was
    # taken for a second Ctrl-C, and serve stopped without draining (helper-55: 2 runs of 41).
    name = _name()
    proc = _serve(name, "--model", "g=tests.models:gated_from_env", "--max-batch-size", "4",
                  env={"SDBI_TEST_GATE": gate.name}, group=bool(to_group))
    try:
        line = _wait_for(proc, "ready")
        assert f"SharedModel('g', runtime='{name}')" in line
        reg = naming.resolve(name)
        client = SharedModel("g", (1, 3), runtime=name)
        held = {}
        x = np.full((1, 3), models.GATE, np.float32)
        t = threading.Thread(target=lambda: held.setdefault("y", client.forward(x, timeout=60)))
        t.start()
        gate.wait_entered()          # the request is inside the forward pass
        if to_group == "twice":
            proc.send_signal(signal.SIGTERM)
            _wait_for(proc, "stopping: the requests accepted are answered first")
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _wait_for(proc, "draining: new requests are refused; finishing 1 accepted")
        assert naming.read(name) is None  # no new client finds a runtime that is going
        with pytest.raises(RuntimeStopped):
            client.forward(np.ones((1, 3), np.float32), timeout=0.5)   # refused while draining
        gate.open()
        t.join(60)
        np.testing.assert_array_equal(held["y"], x * 2 + 1)  # the accepted one was answered
        assert proc.wait(60) == 0
        client.close()
        assert _gone(reg)
        rest = []
        q = stderr_lines(proc)
        while (line := q.get(timeout=60)) is not None:
            rest.append(line)
        assert "Traceback" not in "".join(rest)
    finally:
        _stop(proc)


@pytest.mark.timeout(180)
def test_connect_async_waits_for_a_runtime_without_holding_the_event_loop():
    """SharedModel(name) waits for a runtime that is not up yet -- inside a coroutine it held the event
    loop that long (a 10 ms ticker ran 7.7 s late, helper-52). connect_async waits in a thread; a
    cancelled one closes the handle it makes."""
    name = _name()

    async def main():
        late, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.01)
                late.append(time.monotonic() - t - 0.01)
        tick = asyncio.ensure_future(ticker())
        attaching = asyncio.ensure_future(SharedModel.connect_async("m", (1, 3), runtime=name,
                                                                    connect_timeout=120))
        abandoned = asyncio.ensure_future(SharedModel.connect_async("m", (1, 3), runtime=name,
                                                                    connect_timeout=120))
        await asyncio.sleep(0.05)
        abandoned.cancel()
        proc = _serve(name, "--model", "m=tests.models:affine")
        try:
            m = await asyncio.wait_for(attaching, 120)
            x = np.ones((1, 3), np.float32)
            np.testing.assert_array_equal(await m.forward_async(x), x * 2 + 1)
            stop.set()
            await tick
            m.close()
            with pytest.raises(asyncio.CancelledError):
                await abandoned
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
        return late

    late = asyncio.run(main())
    assert len(late) > 20 and max(late) < 1.0, (len(late), max(late))   # serve took seconds to come up


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_while_serve_drains_stops_it_at_once(gate):
    """The first Ctrl-C drains (up to --drain-timeout); a second one did nothing, so the only way out
    of a long drain was SIGKILL (helper-52). Now it stops the runtime at once: the request it held gets
    RuntimeStopped, nothing is left behind."""
    name = _name()
    proc = _serve(name, "--model", "g=tests.models:gated_from_env", "--drain-timeout", "300",
                  env={"SDBI_TEST_GATE": gate.name})
    try:
        _wait_for(proc, "ready")
        reg = naming.resolve(name)
        client = SharedModel("g", (1, 3), runtime=name)
        got = {}

        def call():
            try:
                got["y"] = client.forward(np.full((1, 3), models.GATE, np.float32), timeout=120)
            except Exception as e:
                got["y"] = e
        t = threading.Thread(target=call)
        t.start()
        gate.wait_entered()          # held inside the forward pass, which the gate holds
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, "Ctrl-C again to stop now")
        _wait_for(proc, "draining: new requests are refused; finishing 1 accepted")
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, "interrupted again: stopping now; requests still unanswered (at least 1) end")
        assert proc.wait(60) == 128 + signal.SIGINT
        t.join(60)
        assert isinstance(got["y"], (RuntimeStopped, simpledbi.ModelProcessDied)), got
        client.close()
        assert _gone(reg)
    finally:
        gate.open()
        _stop(proc)


@pytest.mark.timeout(180)
def test_a_killed_serve_is_cleaned_up_and_clients_reattach_to_the_next_one():
    name = _name()
    first = _serve(name, "--model", "m=tests.models:affine")
    second = None
    try:
        _wait_for(first, "ready")
        reg = naming.resolve(name)
        client = SharedModel("m", (1, 3), runtime=name)
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(client.forward(x), x * 2 + 1)
        first.kill()
        first.wait(30)
        second = _serve(name, "--model", "m=tests.models:affine")  # its start sweeps what is left
        _wait_for(second, "ready")
        np.testing.assert_array_equal(client.forward(x, timeout=60), x * 2 + 1)
        assert client.namespace == naming.resolve(name).namespace != reg.namespace
        assert _gone(reg)
        client.close()
        second.send_signal(signal.SIGINT)   # Ctrl-C stops it cleanly too
        assert second.wait(60) == 0
    finally:
        _stop(first)
        if second is not None:
            _stop(second)


@pytest.mark.timeout(60)
def test_serve_config_from_toml_and_flags(tmp_path):
    cfg = tmp_path / "serve.toml"
    (tmp_path / "b.pt").write_bytes(b"")
    cfg.write_text('name = "fromfile"\nmetrics_port = 9999\n[options]\nmps = "off"\n'
                   '[[models]]\nname = "a"\nfactory = "tests.models:affine"\nmax_batch_size = 8\n'
                   f'[[models]]\nname = "b"\npath = "{tmp_path / "b.pt"}"\nlatency_target = 0.02\n')
    args = _parser().parse_args(["serve", "--config", str(cfg), "--model-num", "2",
                                 "--model", "c=tests.models:affine", "--input-shape", "3,4",
                                 "--max-queue", "50", "--default-timeout", "0.25"])
    sc = load_serve_config(args)
    assert sc.name == "fromfile" and sc.metrics_port == 9999 and sc.options.mps == "off"
    assert [m.name for m in sc.models] == ["a", "b", "c"]
    assert sc.models[0].factory is models.affine and sc.models[0].max_batch_size == 8
    assert sc.models[1].path == str(tmp_path / "b.pt") and sc.models[1].latency_target == 0.02
    assert all(m.model_num == 2 and m.input_shapes == ((3, 4),) for m in sc.models)
    assert all(m.max_queue == 50 and m.default_timeout == 0.25 for m in sc.models)
    cfg.write_text('name = "x"\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\nbatch = 3\n')
    with pytest.raises(ValueError, match=r"model 'a' \(\[\[models\]\]\): unknown setting 'batch' \(did you mean 'batching'\?\); expected some of name, "):
        load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(ValueError, match="factory 'tests.models:nothing': 'tests.models' has no 'nothing'"):
        load_serve_config(_parser().parse_args(["serve", "--name", "x", "--model",
                                                "a=tests.models:nothing"]))
    cfg.write_text('name = "x"\n[options]\njoin_timout = 3\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\n')
    with pytest.raises(ValueError, match=r"\[options\]: unknown setting 'join_timout' \(did you mean 'join_timeout'\?\); expected some of .*join_timeout"):
        load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))   # (a raw TypeError)
    cfg.write_text('name = "x"\nmetrics_port = "9100"\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\n')
    with pytest.raises(ValueError, match=r"metrics_port: expected a port number 0-65535, got '9100'"):
        load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))
    for toml, words in (("models = 3", r"models: expected \[\[models\]\] tables .*got 3"),
                        ('options = 2\n[[models]]\nname = "a"\nfactory = "tests.models:affine"',
                         r"options: expected an \[options\] table, got 2")):
        cfg.write_text(f'name = "x"\n{toml}\n')   # ('int' object is not iterable)
        with pytest.raises(ValueError, match=words):
            load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(ValueError, match=r"--input-shape: expected item dimensions as integers D1,D2,..., "
                                         r"got \['8,x'\]"):   # (int()'s message did not name the flag)
        load_serve_config(_parser().parse_args(["serve", "--name", "x", "--model", "a=tests.models:affine",
                                                "--input-shape", "8,x"]))
    with pytest.raises(SystemExit):   # argparse's "invalid choice": LOUD was taken for INFO
        _parser().parse_args(["serve", "--name", "x", "--log-level", "LOUD"])
    assert _parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    for bad in ('"abc"', "-1", "nan"):   # (a negative one skipped the drain; a string said "could not convert")
        cfg.write_text(f'name = "x"\ndrain_timeout = {bad}\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\n')
        with pytest.raises(ValueError, match=r"drain_timeout: expected seconds >= 0, got "):
            load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(ValueError, match=r"drain_timeout: expected seconds >= 0, got -2.0"):
        load_serve_config(_parser().parse_args(["serve", "--name", "x", "--model", "a=tests.models:affine",
                                                "--drain-timeout", "-2"]))
    with pytest.raises(ValueError, match="a runtime name is needed"):
        load_serve_config(_parser().parse_args(["serve", "--model", "a=m.pt"]))
    with pytest.raises(ValueError, match="model 'a': no model file at 'missing.pt'"):
        load_serve_config(_parser().parse_args(["serve", "--name", "x", "--model", "a=missing.pt"]))


@pytest.mark.timeout(60)
def test_a_model_value_that_is_neither_a_file_nor_a_factory_or_could_be_both_says_so(tmp_path, monkeypatch):
    # `--model mlp=../mymodels:build` was read as a file path: "no model file at '../mymodels:build'"
    (tmp_path / "mymodels.py").write_text("def build():\n    return None\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")

    def load(value):
        return load_serve_config(_parser().parse_args(["serve", "--name", "x", "--model", value]))

    with pytest.raises(ValueError, match=r"model 'mlp': '\.\./mymodels:build' is neither a model file "
                                         r"\(no file at '.*/mymodels:build'\) nor a factory "
                                         r"MODULE:FUNCTION \('\.\./mymodels' is not a module name\); "
                                         r"to use build\(\) of \.\./mymodels\.py, put its directory on the "
                                         r"import path and name its module: PYTHONPATH=\.\. \.\.\. "
                                         r"mymodels:build"):
        load("mlp=../mymodels:build")
    with pytest.raises(ValueError, match=r"model 'mlp': factory 'nomodule_here:build': cannot import "
                                         r"'nomodule_here'.*modules are imported from the current "
                                         r"directory, .*/sub, and \$PYTHONPATH.*\(and there is no model file "
                                         r"'nomodule_here:build'\)"):
        load("mlp=nomodule_here:build")
    monkeypatch.chdir(tmp_path)
    assert load("mlp=mymodels:build").models[0].factory.__module__ == "mymodels"
    (tmp_path / "tests.models:affine").write_bytes(b"")   # a file named like a factory
    with pytest.raises(ValueError, match=r"model 'mlp': 'tests.models:affine' could be the model file "
                                         r"'.*/tests.models:affine' or the factory 'affine' of module "
                                         r"'tests.models': write './tests.models:affine' for the file"):
        load("mlp=tests.models:affine")
    assert load("mlp=./tests.models:affine").models[0].path == "./tests.models:affine"
    # a Python file, or a factory written with dots: torch.load called the file a corrupted checkpoint
    with pytest.raises(ValueError, match=r"'mymodels.py' is Python source, not a model file .*"
                                         r"MODULE:FUNCTION, e.g. 'mymodels:build'"):
        load("mlp=mymodels.py")
    with pytest.raises(ValueError, match=r"no model file at 'mymodels.build' \(for the factory 'build' "
                                         r"of module 'mymodels', write 'mymodels:build'\)"):
        load("mlp=mymodels.build")


@pytest.mark.timeout(120)
def test_serve_shows_where_a_factory_failed(tmp_path):
    """The model process's traceback, down to the factory's line (it printed only "KeyError:
    'weights'", even with --log-level DEBUG; Runtime showed it)."""
    (tmp_path / "broken_models.py").write_text("def build():\n    cfg = {'weight': 1}\n"
                                               "    return cfg['weights']\n")
    out = subprocess.run([sys.executable, "-m", "simpledbi", "serve", "--name", _name(), "--model",
                          "net=broken_models:build", "--device", "cpu"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=100, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2, out.stderr
    assert "broken_models.py\", line 3, in build" in out.stderr, out.stderr
    assert out.stderr.rstrip().endswith("failed to load: KeyError: 'weights'"), out.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_while_serve_imports_the_models_module_prints_no_traceback(tmp_path):
    (tmp_path / "slow_models.py").write_text(
        "import pathlib, time\npathlib.Path('importing').write_text('')\ntime.sleep(60)\n"
        "def build():\n    return None\n")
    proc = subprocess.Popen([sys.executable, "-m", "simpledbi", "serve", "--name", _name(), "--model",
                             "net=slow_models:build", "--device", "cpu"], cwd=tmp_path, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "importing").exists():   # a bounded wait on a file
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            threading.Event().wait(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and err.strip() == "simpledbi serve: interrupted", err


# ---------------------------------------------------------------- looking inside
@pytest.mark.timeout(120)
def test_inspect_and_status_read_a_runtime_without_taking_a_slot(gate):
    name = _name()
    with Runtime([cpu_model("g", __import__("functools").partial(models.gated, gate.name),
                            max_clients=1, max_batch_size=4)], FAST, name=name) as rt:
        client = SharedModel("g", (1, 3), runtime=name)   # holds the only slot
        for _ in range(5):
            client.forward(np.ones((1, 3), np.float32))
        t = threading.Thread(target=client.forward, args=(np.full((1, 3), models.GATE, np.float32),),
                             kwargs={"timeout": 60})
        t.start()
        gate.wait_entered()
        info = simpledbi.inspect(name)
        (m,) = info.models
        assert info.ready and info.namespace == rt.namespace and m.ready
        assert m.attached_clients == 1 and m.max_clients == 1 and m.queued == 1
        assert m.requests == 5 and m.batch_sizes == {1: 5} and m.latency.count == 5
        assert 0 < m.latency.quantile(0.5) <= m.latency.quantile(0.99) < 10
        (inst,) = m.instances
        assert inst.alive and inst.state == "ready" and inst.pid == rt.model_procs[0].proc.pid
        out = subprocess.run([sys.executable, "-m", "simpledbi", "status", name], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "model g: running" in out.stdout and "queued 1" in out.stdout
        check = subprocess.run([sys.executable, "-m", "simpledbi", "status", name, "--check"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and check.stdout.startswith("READY"), check
        as_json = subprocess.run([sys.executable, "-m", "simpledbi", "status", name, "--json"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert json.loads(as_json.stdout)["models"][0]["queued"] == 1
        gate.open()
        t.join(60)
        client.close()
    check = subprocess.run([sys.executable, "-m", "simpledbi", "status", name, "--check"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and check.stdout.startswith("NOT READY"), check


def _status_out(capsys, *args: str):
    from simpledbi.cli import main
    rc = main(["status", *args])
    return rc, capsys.readouterr().out


@pytest.mark.timeout(120)
def test_status_check_json_is_one_line_of_health_and_plain_json_keeps_everything(capsys):
    # --check --json printed the whole of --json (~400 lines, a histogram bound a line)
    name = _name()
    with Runtime([cpu_model("m", models.affine, model_num=2)], FAST, name=name) as rt:
        rc, out = _status_out(capsys, name, "--check", "--json")
        assert rc == 0 and out.count("\n") == 1, out
        assert json.loads(out) == {
            "name": name, "ready": True, "pid": os.getpid(), "alive": True,
            "models": [{"name": "m", "state": "running", "ready": True, "ready_instances": 2, "instances": 2}]}
        rc, out = _status_out(capsys, name, "--json")
        full = json.loads(out)
        assert rc == 0 and full["namespace"] == rt.namespace and full["ready"] is True
        assert full["models"][0]["latency"]["bounds"] and out.count("\n") > 100
    rc, out = _status_out(capsys, name, "--check", "--json")
    assert rc == 1 and json.loads(out) == {"name": name, "ready": False,
                                           "error": f"no simpledbi runtime named {name!r} is running (a `simpledbi serve` "
                     f"registers its name once its models start loading, after importing their "
                     f"modules: if one is starting, try again in a few seconds)"}


@pytest.mark.timeout(120)
def test_prometheus_collector_exports_the_runtime_counters():
    prometheus_client = pytest.importorskip("prometheus_client")
    from simpledbi.metrics import RuntimeCollector
    name = _name()
    with Runtime([cpu_model("m", models.affine, max_batch_size=8)], FAST, name=name):
        with SharedModel("m", (4, 3), runtime=name) as c:
            for rows in (1, 2, 4):
                c.forward(np.ones((rows, 3), np.float32))
        registry = prometheus_client.CollectorRegistry()
        registry.register(RuntimeCollector(name))
        # a batch's histograms are written just after its caller is woken (README): the last
        # one may land a moment after forward() returned
        deadline = time.monotonic() + 30
        while True:
            text = prometheus_client.generate_latest(registry).decode()
            if 'simpledbi_request_duration_seconds_count{model="m"} 3.0' in text or time.monotonic() > deadline:
                break
            threading.Event().wait(0.01)   # bounded wait on a shared-memory condition
    assert 'simpledbi_request_success_total{model="m"} 3.0' in text
    assert 'simpledbi_inference_count_total{model="m"} 7.0' in text
    assert 'simpledbi_request_failure_total{model="m",reason="process_died"} 0.0' in text
    assert 'simpledbi_batch_size_bucket{le="2",model="m"} 2.0' in text
    assert 'simpledbi_request_duration_seconds_count{model="m"} 3.0' in text
    assert 'simpledbi_instance_up{device="cpu",instance="0",model="m"} 1.0' in text
    assert 'simpledbi_model_ready{model="m"} 1.0' in text
    assert 'simpledbi_abandoned_total{model="m",reason="expired"} 0.0' in text
    assert f'simpledbi_runtime_up{{runtime="{name}"}} 1.0' in text
    # the runtime gone, or a name that never was one: 0, not silence (helper-48)
    text = prometheus_client.generate_latest(registry).decode()
    assert f'simpledbi_runtime_up{{runtime="{name}"}} 0.0' in text and "simpledbi_model_ready" not in text
    typo = prometheus_client.CollectorRegistry()
    typo.register(RuntimeCollector(name + "-typo"))
    assert f'simpledbi_runtime_up{{runtime="{name}-typo"}} 0.0' in prometheus_client.generate_latest(typo).decode()


@pytest.mark.timeout(120)
def test_model_process_logs_reach_the_parents_handlers(caplog):
    caplog.set_level(logging.INFO)
    with Runtime([cpu_model("loud", models.loud)], FAST) as rt:
        with SharedModel("loud", (1, 3), namespace=rt.namespace) as c:
            c.forward(np.full((1, 3), models.LOG_ME, np.float32))
    # the relay hands over everything the processes wrote before shutdown returns
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name == "tests.loud"]
    assert ("tests.loud", "WARNING", "<loud|0> loading the loud model") in lines
    assert ("tests.loud", "ERROR", "<loud|0> saw a row asking to be logged") in lines


# ---------------------------------------------------------------- asyncio
@pytest.mark.timeout(120)
def test_forward_async_batches_concurrent_coroutines_and_never_blocks_the_loop(gate):
    import functools
    n = 24
    with Runtime([cpu_model("g", functools.partial(models.gated, gate.name), max_batch_size=32,
                            wait_time=0.0)], FAST) as rt:
        client = SharedModel("g", (1, 3), namespace=rt.namespace)

        async def main():
            blocker = asyncio.ensure_future(client.forward_async(np.full((1, 3), models.GATE, np.float32)))
            await asyncio.to_thread(gate.wait_entered)   # the model process is stuck in forward
            xs = [np.full((1, 3), i, np.float32) for i in range(n)]
            # (had forward_async blocked the loop, the blocked call would have stopped it above)
            calls = [asyncio.ensure_future(client.forward_async(x, timeout=60)) for x in xs]
            # open the gate only once all 24 are published (they publish from pool threads)
            deadline = time.monotonic() + 60
            while sum(s.queued() for s in list(client._h.busy)) < n:   # sent (or sending), not taken
                assert time.monotonic() < deadline, "the coroutines never published"
                await asyncio.sleep(0.01)
            gate.open()
            ys = await asyncio.gather(*calls)
            await blocker
            return xs, ys

        xs, ys = asyncio.run(main())
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(y, x * 2 + 1)
        st = client.stats()
        # the 24 calls queued behind the blocked batch are served in far fewer batches
        assert st["requests"] == n + 1 and st["batches"] <= n // 2, st
        client.close()


@pytest.mark.timeout(120)
def test_a_request_withdrawn_after_it_was_sent_does_not_hold_a_drain(gate):
    """Drain counts what model processes hold and what is queued on the socket; a queued request
    whose caller took it back is found and dropped by a model process, and the drain ends."""
    import functools
    import time
    with Runtime([cpu_model("m", functools.partial(models.gated, gate.name), wait_time=0.001)],
                 FAST) as rt:
        client = SharedModel("m", (1, 3), namespace=rt.namespace)
        blocker = threading.Thread(target=client.forward, args=(np.full((1, 3), models.GATE, np.float32),),
                                   kwargs={"timeout": 60})
        blocker.start()
        gate.wait_entered()
        with pytest.raises(TimeoutError, match="withdrawn"):
            client.forward(np.ones((1, 3), np.float32), timeout=0.2)   # queued, then taken back
        gate.open()
        blocker.join(60)
        t0 = time.monotonic()
        assert rt.drain(20) is True
        assert time.monotonic() - t0 < 5
        client.close()


@pytest.mark.timeout(120)
def test_a_call_timeout_while_the_named_runtime_is_down_is_a_timeout_error():
    import time
    name = _name()
    x = np.ones((1, 3), np.float32)
    client = _attached_to_a_runtime_that_stopped(name, connect_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"no result within the timeout \(0.3 s\): no simpledbi "
                                           rf"runtime named '{name}' came back") as e:
        client.forward(x, timeout=0.3)
    assert isinstance(e.value, RuntimeStopped) and time.monotonic() - t0 < 5
    client.close()


@pytest.mark.timeout(120)
def test_a_multi_line_model_error_keeps_its_cause_in_the_message():
    with Runtime([cpu_model("m", models.many_lines)], FAST) as rt:
        with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
            with pytest.raises(simpledbi.ModelError, match=r"raised RuntimeError: The following operation "
                               r"failed in the TorchScript interpreter\. \.\.\. RuntimeError: mat1 and "
                               r"mat2 shapes cannot be multiplied \(1x5 and 8x4\)") as e:
                client.forward(np.ones((1, 3), np.float32))
            assert "Traceback of TorchScript" in e.value.remote_traceback


@pytest.mark.timeout(120)
def test_a_registration_naming_some_other_live_pid_does_not_hold_the_name():
    """A registration rewritten to name a live process (pid 1) and a namespace that does not
    exist is stale: the next runtime of that name starts, and clients find it."""
    name = _name()
    path = naming.registration_path(name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, json.dumps({"namespace": "sdbi_1_deadbeef", "pid": 1, "models": ["m"],
                             "started": 0}).encode())
    os.close(fd)
    try:
        assert naming.resolve(name) is None
        with Runtime([cpu_model("m", models.affine)], FAST, name=name) as rt:
            assert naming.resolve(name).namespace == rt.namespace
            with SharedModel("m", (1, 3), runtime=name) as c:
                np.testing.assert_array_equal(c.forward(np.ones((1, 3), np.float32)), np.full((1, 3), 3.0))
    finally:
        if os.path.exists(path) and json.load(open(path))["pid"] == 1:
            os.unlink(path)
    assert not os.path.exists(path)


@pytest.mark.timeout(120)
def test_serve_refuses_a_name_that_is_taken_before_it_logs_starting():
    # It logged "starting runtime 'dup'" (and started a janitor) before refusing.
    name = _name()
    namespace = f"sdbi_{os.getpid()}_taken{secrets.token_hex(3)}"
    os.mkdir(f"/dev/shm/{namespace}")           # a live runtime, as far as its name says
    path = naming.register(name, namespace, ["m"])
    try:
        proc = subprocess.run([sys.executable, "-m", "simpledbi", "serve", "--name", name, "--model",
                               "m=tests.models:affine", "--device", "cpu"], cwd=ROOT,
                              capture_output=True, text=True, timeout=100)
    finally:
        naming.unregister(path, namespace)
        os.rmdir(f"/dev/shm/{namespace}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"simpledbi serve: a simpledbi runtime named '{name}' is already running (pid {os.getpid()}); "
        f"stop it or choose another name"], proc.stderr


@pytest.mark.timeout(120)
def test_a_call_waiting_for_a_stopped_runtime_to_come_back_says_so_once(caplog):
    """A call of a handle attached by name whose runtime stopped waits for a successor up to its
    connect_timeout; it did so in silence (helper-55: 30 s, then RuntimeUnavailable). It now logs
    one warning for that runtime, not one per call."""
    import logging
    name = _name()
    client = _attached_to_a_runtime_that_stopped(name)
    x = np.ones((1, 3), np.float32)
    with caplog.at_level(logging.WARNING, logger="simpledbi"):
        for _ in range(2):
            with pytest.raises(simpledbi.RuntimeUnavailable, match="came back meanwhile"):
                client.forward(x, timeout=0.3)
    said = [r.getMessage() for r in caplog.records if "stopped; calls wait up to" in r.getMessage()]
    assert len(said) == 1 and repr(name) in said[0], said
    client.close()
