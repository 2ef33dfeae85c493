"""Rolling reload: new model processes take over while the old ones finish what they took --
no request fails, none is answered by a half-switched model, and a failed load changes nothing."""
from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch  # noqa: F401 - torch.jit below

from simpledbi import SharedModel, naming
from simpledbi.runtime import Runtime

from . import models
from .conftest import FAST, cpu_model
from .conftest import stderr_lines
from .test_serve import ROOT, _serve, _stop, _wait_for


def _scripted(tmp_path) -> str:
    path = str(tmp_path / "triple.pt")
    torch.jit.script(models.Triple()).save(path)
    return path


def _hammer(client, stop: threading.Event, seen: list, errors: list, seed: int):
    """Send requests until ``stop``; each answer must be 2x+1 (old) or 3x+1 (new)."""
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        x = rng.standard_normal((1, 3)).astype(np.float32) + 5
        try:
            y = client.forward(x, timeout=60)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return
        if np.array_equal(y, x * 3 + 1):
            seen.append(3)
        elif np.array_equal(y, x * 2 + 1):
            seen.append(2)
        else:
            errors.append(AssertionError(f"{y} is neither version's answer to {x}"))
            return


@pytest.mark.timeout(180)
def test_reload_under_load_fails_no_request_and_the_old_version_finishes_what_it_took(gate, tmp_path):
    path = _scripted(tmp_path)
    cfg = cpu_model("m", functools.partial(models.gated, gate.name), model_num=2, max_batch_size=4)
    with Runtime([cfg], FAST) as rt:
        client = SharedModel("m", (1, 3), namespace=rt.namespace)
        held = {}
        gated = np.full((1, 3), models.GATE, np.float32)
        t_gated = threading.Thread(target=lambda: held.setdefault("y", client.forward(gated, timeout=120)))
        t_gated.start()
        gate.wait_entered()                    # an old process is inside forward with it
        stop, seen, errors = threading.Event(), [], []
        hammers = [threading.Thread(target=_hammer, args=(client, stop, seen, errors, k)) for k in range(4)]
        for t in hammers:
            t.start()
        done = {}
        reloader = threading.Thread(target=lambda: done.setdefault("cfg", rt.reload("m", path, timeout=120)))
        reloader.start()
        # the new version answers while the old process still holds the gated request
        probe = np.ones((1, 3), np.float32)
        while not np.array_equal(client.forward(probe, timeout=60), probe * 3 + 1):
            pass
        assert reloader.is_alive()             # it waits for the old process to finish
        gate.open()
        reloader.join(120)
        t_gated.join(60)
        np.testing.assert_array_equal(held["y"], gated * 2 + 1)   # answered by the old version
        after = len(seen)
        x = np.full((1, 3), 4, np.float32)
        for _ in range(20):
            np.testing.assert_array_equal(client.forward(x), x * 3 + 1)
        stop.set()
        for t in hammers:
            t.join(60)
        assert errors == [] and 3 in seen
        assert all(v == 3 for v in seen[after + 4:])  # once reload returned: only the new version
        assert done["cfg"].path == path
        assert {m.proc.is_alive() for m in rt.model_procs if m.retiring} <= {False}
        assert client.stats()["restarts"] == 0
        client.close()


@pytest.mark.timeout(120)
def test_a_reload_that_fails_to_load_leaves_the_running_version_serving(tmp_path):
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"not a torchscript file")
    with Runtime([cpu_model("m", models.affine)], FAST) as rt:
        with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
            x = np.ones((1, 3), np.float32)
            pids = [m.proc.pid for m in rt.instances.values()]
            with pytest.raises(RuntimeError, match="reload 'm' failed; the running version keeps serving"):
                rt.reload("m", str(bad))
            np.testing.assert_array_equal(client.forward(x, timeout=30), x * 2 + 1)
            assert [m.proc.pid for m in rt.instances.values()] == pids
            with pytest.raises(FileNotFoundError, match="no model file at"):
                rt.reload("m", str(tmp_path / "missing.pt"))
            with pytest.raises(LookupError, match=r"no model named 'zz'; this runtime serves \['m'\]"):
                rt.reload("zz")


@pytest.mark.timeout(180)
def test_simpledbi_reload_command_reaches_a_serve_process(tmp_path):
    path = _scripted(tmp_path)
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    proc = _serve(name, "--model", "m=tests.models:affine")
    try:
        _wait_for(proc, "ready")
        client = SharedModel("m", (1, 3), runtime=name)
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(client.forward(x), x * 2 + 1)
        import socket
        from simpledbi.control import socket_path
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # connects, never sends
        idle.connect(socket_path(naming.resolve(name).namespace))
        out = subprocess.run([sys.executable, "-m", "simpledbi", "reload", "m", "--runtime", name,
                              "--path", path], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"model 'm' reloaded from {path}" in out.stdout
        np.testing.assert_array_equal(client.forward(x), x * 3 + 1)
        status = subprocess.run([sys.executable, "-m", "simpledbi", "status", name], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert "requests 2" in status.stdout and " ready " in status.stdout
        bad = subprocess.run([sys.executable, "-m", "simpledbi", "reload", "nope", "--runtime", name],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "no model named 'nope'" in bad.stderr
        idle.close()
        client.close()
        proc.terminate()
        assert proc.wait(60) == 0
        assert naming.read(name) is None
    finally:
        _stop(proc)


# found by an attacker after the reload landed ----------------------------------------------------
@pytest.mark.timeout(180)
def test_a_reload_failing_on_one_new_process_serves_nothing_new_and_fails_no_request(tmp_path):
    marker = str(tmp_path / "arm")
    cfg = cpu_model("m", functools.partial(models.armed, marker), model_num=2, max_batch_size=4)
    with Runtime([cfg], FAST) as rt:
        client = SharedModel("m", (1, 3), namespace=rt.namespace)
        open(marker + ".v2", "w").close()
        open(marker, "w").close()     # one of the two new processes fails, 2 s after loading
        stop, seen, errors = threading.Event(), [], []
        hammers = [threading.Thread(target=_hammer, args=(client, stop, seen, errors, k)) for k in range(4)]
        for t in hammers:
            t.start()
        with pytest.raises(RuntimeError, match="the running version keeps serving: .*armed: this load fails"):
            rt.reload("m")
        stop.set()
        for t in hammers:
            t.join(60)
        assert errors == [] and seen and set(seen) == {2}   # the loaded new one never claimed
        with pytest.raises(ValueError, match="reload timeout: expected 0 < seconds <= 3600, got nan"):
            rt.reload("m", timeout=float("nan"))
        client.close()


@pytest.mark.timeout(240)
def test_a_reload_while_an_old_process_restarts_retires_it_too(tmp_path):
    import os
    import signal
    import time
    marker = str(tmp_path / "arm")
    cfg = cpu_model("m", functools.partial(models.armed, marker), model_num=2, max_batch_size=4,
                    restart_backoff=0.0)
    with Runtime([cfg], FAST) as rt:
        client = SharedModel("m", (1, 3), namespace=rt.namespace)
        open(marker + ".slow", "w").close()       # every load from now on takes 3 s
        victim = rt.instances[("m", 1)].proc.pid
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30          # its replacement is loading (slowly)
        while rt.instances[("m", 1)].proc.pid == victim:
            assert time.monotonic() < deadline
            threading.Event().wait(0.02)
        stop, seen, errors = threading.Event(), [], []
        hammers = [threading.Thread(target=_hammer, args=(client, stop, seen, errors, k)) for k in range(3)]
        for t in hammers:
            t.start()
        t0 = time.monotonic()
        rt.reload("m", timeout=60)   # a process that never retires would hold it 60 s
        took = time.monotonic() - t0
        stop.set()
        for t in hammers:
            t.join(60)
        assert took < 45, f"the reload waited {took:.1f} s for a process that never retired"
        assert errors == [], errors
        deadline = time.monotonic() + 30          # every replaced process is reaped and forgotten
        while rt._retired:
            assert time.monotonic() < deadline, rt._retired
            threading.Event().wait(0.05)
        client.close()


@pytest.mark.timeout(180)
def test_a_failed_reload_command_is_logged_by_the_serve_process(tmp_path):
    # Only the command's caller saw the error; the server's log had nothing.
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    proc = _serve(name, "--model", "m=tests.models:affine")
    try:
        _wait_for(proc, "ready")
        bad = tmp_path / "broken.pt"
        bad.write_bytes(b"not a torchscript file")
        out = subprocess.run([sys.executable, "-m", "simpledbi", "reload", "m", "--runtime", name,
                              "--path", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "the running version keeps serving" in out.stderr, out
        proc.terminate()
        assert proc.wait(60) == 0
        q, rest = stderr_lines(proc), []
        while (line := q.get(timeout=60)) is not None:
            rest.append(line)
        log = "".join(rest)
        assert ("ERROR simpledbi.control: reload of 'm' failed: RuntimeError: reload 'm' failed; "
                "the running version keeps serving: ModelError: model 'm' process 0 failed to load") \
            in log, log
    finally:
        _stop(proc)


@pytest.mark.timeout(180)
def test_simpledbi_reload_takes_a_factory_by_import_path_like_serve_does():
    # --path took only a file: "tests.models:Triple" became "<cwd>/tests.models:Triple", not found
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    proc = _serve(name, "--model", "m=tests.models:affine")
    try:
        _wait_for(proc, "ready")
        x = np.ones((1, 3), np.float32)

        def reload(path):
            return subprocess.run([sys.executable, "-m", "simpledbi", "reload", "m", "--runtime", name,
                                   "--path", path], cwd=ROOT, capture_output=True, text=True, timeout=120)

        bad = reload("tests.models:Nothing")
        assert bad.returncode == 1 and "'tests.models' has no 'Nothing'" in bad.stderr, bad
        out = reload("tests.models:Triple")
        assert out.returncode == 0, out.stderr
        assert "model 'm' reloaded from tests.models:Triple" in out.stdout
        with SharedModel("m", (1, 3), runtime=name) as client:
            np.testing.assert_array_equal(client.forward(x), x * 3 + 1)
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        _stop(proc)


@pytest.mark.timeout(120)
def test_runtime_reload_takes_a_factory_itself():
    # as ModelConfig(factory=) does; it raised "expected str, bytes or os.PathLike object, not function"
    with Runtime([cpu_model("m", models.affine)], FAST) as rt:
        with pytest.raises(TypeError, match=r"reload 'm': expected a model file, 'module:function' or a "
                                            r"factory \(a callable\), got int 3"):
            rt.reload("m", 3)
        rt.reload("m", models.Triple)
        with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
            x = np.ones((1, 3), np.float32)
            np.testing.assert_array_equal(client.forward(x), x * 3 + 1)


@pytest.mark.timeout(120)
def test_a_reload_kills_no_old_process_that_answered_all_it_took(caplog, monkeypatch):
    """An old process that answered everything is left to exit, however slowly (helper-41: with
    --timeout 0.3, 3 of 4 reloads killed processes that had retired, and logged their SIGKILL deaths:
    the reload waited for them to exit). Here the old processes take 4 s more to exit than the
    reload's timeout of 2 s. The supervisor alone reaps them, the reload waits for it: when the
    reload's thread called waitpid() too, the loser of the two got ECHILD, which multiprocessing reads
    as "still running" -- under CPU load (4 busy loops on 2 cores) 1 run in 16 warned "killing it: its 0
    request(s)" about a process that had exited, and could signal its reaped pid."""
    import logging
    from simpledbi.shm import pid_alive
    caplog.set_level(logging.INFO, logger="simpledbi")
    with Runtime([cpu_model("m", functools.partial(models.slow_exit, 4.0), model_num=2)], FAST) as rt:
        with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
            x = np.ones((1, 3), np.float32)
            np.testing.assert_array_equal(client.forward(x), x * 2 + 1)
            old = [m.proc.pid for m in rt.instances.values()]
            reapers, waitpid = set(), os.waitpid

            def recorded(pid, options):   # who reaps them, or finds them reaped (ECHILD)
                try:
                    got = waitpid(pid, options)
                except ChildProcessError:
                    if pid in old:
                        reapers.add(threading.current_thread().name)
                    raise
                if pid in old and got[0] == pid:
                    reapers.add(threading.current_thread().name)
                return got
            monkeypatch.setattr(os, "waitpid", recorded)
            rt.reload("m", models.Triple, timeout=2.0)
            monkeypatch.undo()
            assert reapers == {"simpledbi-supervisor"}, reapers
            assert not [pid for pid in old if pid_alive(pid)]   # it returns once they exited
            np.testing.assert_array_equal(client.forward(x), x * 3 + 1)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "killing it" in m or "after it was replaced" in m], said


def test_a_reload_before_start_says_the_runtime_is_not_started():
    rt = Runtime([cpu_model("m", models.affine)])
    try:
        with pytest.raises(RuntimeError, match=r"the model is not started \(Runtime.start\(\) first\)"):
            rt.reload("m")
    finally:
        rt.shutdown()


@pytest.mark.timeout(240)
def test_once_a_new_process_answered_no_old_one_answers_a_later_request():
    # One client calling in turn through four reloads (2x+1 <-> 3x+1): an old process blocked in
    # recvmsg took the client's next request after a new process had answered its last, before it
    # saw it retires, and answered it with the old version (helper-45: new, old, new answers).
    cfg = cpu_model("m", models.affine, model_num=2, max_batch_size=4)
    with Runtime([cfg], FAST) as rt:
        client = SharedModel("m", (1, 3), namespace=rt.namespace)
        stop, seen, errors = threading.Event(), [], []
        caller = threading.Thread(target=_hammer, args=(client, stop, seen, errors, 0))
        caller.start()
        try:
            for version in (models.Triple, models.affine, models.Triple, models.affine):
                rt.reload("m", version, timeout=60)
        finally:
            stop.set()
            caller.join(60)
        client.close()
    assert not errors, errors
    changes = [k for k in range(1, len(seen)) if seen[k] != seen[k - 1]]
    assert len(changes) == 4, [seen[k - 1:k + 3] for k in changes]   # each reload switches once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_reload_by_import_path_sees_the_module_as_it_is_now(tmp_path, monkeypatch, start_method):
    # The runtime's process checked the name against its own copy of the module, imported at start:
    # a factory added to the file since was "not found" (helper-45), while the model processes would
    # have imported the file afresh.
    module = f"reloadable_{secrets.token_hex(4)}"
    source = tmp_path / f"{module}.py"
    source.write_text("from tests.models import Affine\n\ndef v1():\n    return Affine()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = __import__(module).v1   # imported here, as `simpledbi serve --model m=module:v1` does
    with Runtime([cpu_model("m", first)], FAST, start_method) as rt:
        source.write_text(source.read_text() + "\ndef v2():\n    from tests.models import Triple\n"
                                               "    return Triple()\n")
        rt.reload("m", f"{module}:v2")
        with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
            x = np.ones((1, 3), np.float32)
            np.testing.assert_array_equal(client.forward(x, timeout=30), x * 3 + 1)
        with pytest.raises(RuntimeError, match=r"keeps serving.*has no 'v3'"):
            rt.reload("m", f"{module}:v3")
        with pytest.raises(ValueError, match=r"cannot import 'no_such_module_here'"):
            rt.reload("m", "no_such_module_here:v1")
