"""Whole applications in their own process: exit paths, signals, dead children, and /dev/shm after."""
from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from simpledbi import ModelProcessDied, SharedModel

from . import models
from .conftest import cpu_model, ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("Traceback", "leaked", "resource_tracker", "Warning", "Error")


def _start(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.apps.app", mode], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _await_children_starting(proc: subprocess.Popen, marks) -> None:
    """Until a model process of ``proc`` (an app run with APP_SLOW_START=marks) is starting: it leaves a
    file in ``marks`` as it begins importing (the janitor, a program of its own, started before it)."""
    deadline = time.monotonic() + 60
    while not os.listdir(marks):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        threading.Event().wait(0.01)   # bounded wait on a file condition


def _run(mode: str):
    proc = _start(mode)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # a failing test must not leave the app running
            proc.kill()
            proc.communicate()
    return proc, out, err


def _assert_cleaned_up_after(pid: int, name: str) -> None:
    """Until the janitor of the runtime ``name`` of the killed process ``pid`` removed its namespace
    and its name (it does once it sees the main process gone), for at most 30 s."""
    from simpledbi.naming import registration_path
    deadline = time.monotonic() + 30
    while (ours(pid) or os.path.exists(registration_path(name))) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert ours(pid) == [] and not os.path.exists(registration_path(name))


def _wait_line(proc: subprocess.Popen, word: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(word):
                return line
    proc.kill()
    raise AssertionError(f"{word!r} never came: {proc.stderr.read()}")


def _clean(err: str) -> bool:
    return not any(word in err for word in NOISE)


@pytest.mark.timeout(120)
def test_normal_exit_is_clean():
    proc, out, err = _run("ok")
    assert proc.returncode == 0, err
    assert "RESULT [0, 1, 2]" in out
    assert _clean(err), err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_worker_exception_is_reported_with_its_rank_and_type():
    proc, out, err = _run("worker_raises")
    assert proc.returncode == 3, err
    assert "WORKERERROR rank=1" in out and "type=KeyError" in out and "failed on purpose" in out
    assert "leaked" not in err and "resource_tracker" not in err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_worker_that_dies_is_reported_with_its_exit_code():
    proc, out, err = _run("worker_dies")
    assert proc.returncode == 3, err
    assert "WORKERERROR rank=1 exitcode=7" in out
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_model_process_crash_fails_its_callers_and_is_restarted():
    proc, out, err = _run("model_dies")
    assert proc.returncode == 0, err
    # The caller whose request crashed the process is told at once; the instance is restarted
    # and every worker's later requests are served.
    assert "CAUGHT model 'm': model process" in out and "died while computing this request" in out
    assert "RESULT [0, 1, 2]" in out
    assert "SIGSEGV" in err and "restarting it" in err
    assert "leaked" not in err and "resource_tracker" not in err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_model_that_keeps_crashing_is_marked_broken_and_run_raises():
    proc, out, err = _run("model_broken")
    assert proc.returncode == 4, err
    assert "MODELDIED" in out and "marked broken" in out and "SIGSEGV" in out
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "INTERRUPTED"), (signal.SIGTERM, 143, "")])
def test_signal_to_the_main_process_cleans_up(sig, code, word):
    proc = _start("busy")
    try:
        _wait_line(proc, "READY")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert word in out
    assert _clean(err), err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_ctrl_c_while_children_start_is_reported_by_the_main_process_only(tmp_path):
    # Ctrl-C signals the whole process group. Children still importing (the main module, torch)
    # printed a KeyboardInterrupt traceback each; now they start with SIGINT blocked.
    proc = subprocess.Popen([sys.executable, "-m", "tests.apps.app", "ok"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(os.environ, APP_SLOW_START=str(tmp_path)))
    try:
        _await_children_starting(proc, tmp_path)
        os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in its terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "INTERRUPTED" in out, (out, err)
    assert "KeyboardInterrupt" not in err and _clean(err), err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,code", [("run", 128 + signal.SIGTERM), ("runtime", -signal.SIGTERM)])
def test_sigterm_while_a_model_process_is_being_started_is_clean(tmp_path, how, code):
    # Its bootstrap data is more than a pipe holds, so starting it waits until the child (slow to
    # start, as with torch) reads it: a SIGTERM then (Run's handler raises, a bare Runtime's is the
    # default) cut that data short and the child printed "UnpicklingError: pickle data was truncated"
    # (or "EOFError: Ran out of input"), a child no shutdown knew of.
    proc = subprocess.Popen([sys.executable, "-m", "tests.apps.app", "big_start", how], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, APP_SLOW_START=str(tmp_path)))
    try:
        _await_children_starting(proc, tmp_path)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)   # until the janitor, last, closed stderr too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code and _clean(err), (proc.returncode, err)
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method,to_group,sig", [
    ("spawn", True, signal.SIGTERM), ("fork", True, signal.SIGTERM), ("fork", False, signal.SIGKILL),
    ("spawn", True, signal.SIGKILL)])
def test_a_runtime_killed_by_a_signal_leaves_nothing_behind(start_method, to_group, sig):
    # SIGTERM to the group is what a notebook kernel's shutdown or restart does (and systemd, or
    # `kill -TERM -PGID`): the main process (a Runtime, no handler of ours) dies without atexit,
    # and so did the janitor. Under fork, the model processes hold the main process's end of the
    # janitor's pipe too: the janitor never saw it close, and cleaned up nothing. SIGKILL to the
    # group (jupyter_client's now=True, `timeout -s KILL`) killed the janitor too.
    from simpledbi.naming import registration_path
    name = f"lifecycle-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.apps.app", "runtime", name, start_method], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_line(proc, "READY")
        assert ours(proc.pid) != [] and os.path.exists(registration_path(name))
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -sig, (out, err)
    _assert_cleaned_up_after(proc.pid, name)


@pytest.mark.timeout(120)
def test_a_group_sigkill_while_the_model_processes_start_leaves_nothing_behind(tmp_path):
    # Under spawn the janitor left the process group only once its entry point ran, after it had
    # imported the main module (torch and the user's code: 1-4 s): a group SIGKILL then (a notebook
    # kernel restarted while a cell starts a runtime) killed it too, and the namespace and the
    # name stayed in /dev/shm until another runtime swept them.
    from simpledbi.naming import registration_path
    name = f"lifecycle-early-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.apps.app", "runtime", name, "spawn"], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(os.environ, APP_SLOW_START=str(tmp_path)))
    try:
        _await_children_starting(proc, tmp_path)
        assert ours(proc.pid) != [] and os.path.exists(registration_path(name))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    _assert_cleaned_up_after(proc.pid, name)


@pytest.mark.timeout(120)
def test_a_model_that_stops_its_own_children_with_sigterm_still_can(start_runtime):
    # Model processes ignore SIGTERM (a group SIGTERM is the main process's to act on: serve
    # drains). With SIG_IGN their children ignored it too, exec'ed or forked: a Pool's exit in a
    # factory hung until load_timeout, and a helper outlived a SIGTERM to the group.
    rt = start_runtime(cpu_model("m", models.term_children))
    with SharedModel("m", (1, 3), namespace=rt.namespace) as client:
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(client.forward(x), x * 2 + 1)


@pytest.mark.timeout(120)
def test_ctrl_c_while_a_model_loads_stops_at_once(tmp_path):
    # A loading process holds no request and sees STOPPING only once loaded: shutdown used to
    # wait out join_timeout (30 s here) for it before terminating it.
    proc = subprocess.Popen([sys.executable, "-m", "tests.apps.app", "slow_load", str(tmp_path)], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "loading"):   # the factory runs
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            threading.Event().wait(0.01)   # bounded wait on a file condition
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in its terminal does
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "INTERRUPTED" in out, (out, err)
    assert took < 20, f"Ctrl-C took {took:.1f} s to stop a runtime whose model was loading"
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_sigkill_of_the_main_process_leaves_nothing_behind():
    proc = _start("busy")
    _wait_line(proc, "READY")
    assert ours(proc.pid) != []
    proc.kill()
    proc.communicate(timeout=30)
    # The janitor notices (pipe EOF), stops the children and unlinks; wait for that condition.
    deadline = time.monotonic() + 30
    while ours(proc.pid) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert ours(proc.pid) == []


def test_client_waiting_on_a_killed_model_process_gets_an_error(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1))
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as model:
        errors = []
        t = threading.Thread(target=lambda: _capture(errors, model.forward,
                                                     np.full((1, 2), models.GATE, np.float32)))
        t.start()
        gate.wait_entered()
        os.kill(rt.model_procs[0].proc.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ModelProcessDied)
        assert "died" in str(errors[0])


def _capture(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_an_idle_runtime_costs_no_cpu(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, model_num=2))
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as model:
        model.forward(np.ones((1, 2), np.float32))
        pids = [m.proc.pid for m in rt.model_procs]
        before = [_cpu_ticks(p) for p in pids]
        threading.Event().wait(1.0)  # measuring an interval, not synchronising
        used = [_cpu_ticks(p) - b for p, b in zip(pids, before)]
    hz = os.sysconf("SC_CLK_TCK")
    assert all(u / hz < 0.05 for u in used), f"model processes used {used} ticks in 1 s idle"


def test_a_killed_client_process_leaves_nothing_and_its_slot_is_dropped(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=2))
    code = ("import os, numpy as np; from simpledbi import SharedModel; "
            f"m = SharedModel('affine', max_shape=(1, 2), namespace={rt.namespace!r}); "
            "m.forward(np.ones((1, 2), np.float32)); print('ATTACHED', flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "ATTACHED" in out.stdout, out.stderr
    clients = rt.ctls["affine"].all_instances["clients"]
    deadline = time.monotonic() + 30
    while clients.max() and time.monotonic() < deadline:
        threading.Event().wait(0.02)  # bounded wait: the model process drops a dead client's slot
    assert clients.max() == 0
    assert os.listdir(os.path.join("/dev/shm", rt.namespace)) == ["affine.ctl", "affine.sock"] or \
        sorted(os.listdir(os.path.join("/dev/shm", rt.namespace))) == ["affine.ctl", "affine.sock"]
    with SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace) as model:
        np.testing.assert_array_equal(model.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))


@pytest.mark.timeout(120)
def test_a_script_without_the_main_guard_is_told_what_is_missing():
    proc = subprocess.run([sys.executable, os.path.join("tests", "apps", "noguard.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    # said before any process starts: one traceback, not one per child re-running the script
    assert last.startswith("RuntimeError: noguard.py, line 13, starts a simpledbi runtime outside "
                           "`if __name__ == \"__main__\":`"), proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    assert "AssertionError" not in proc.stderr and "leaked" not in proc.stderr


@pytest.mark.parametrize("ending", ["raise AttributeError('boom')", "pass"])
def test_a_program_that_ends_without_shutdown_exits_and_leaves_nothing(ending):
    # Runtime.start() and then the script ends -- or raises -- without shutdown(): at exit,
    # multiprocessing joined the janitor, which waited for the script to go: it never exited.
    code = ("from simpledbi import ModelConfig, Runtime; from tests import models\n"
            "rt = Runtime([ModelConfig(name='m', factory=models.affine, device='cpu', num_threads=1)])\n"
            "rt.start(); print(rt.namespace, flush=True)\n" + ending)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert p.returncode == (1 if ending.startswith("raise") else 0), p.stderr
    ns = p.stdout.split()[0]
    assert not [e for e in os.listdir("/dev/shm") if ns in e]


@pytest.mark.timeout(120)
def test_a_sigterm_during_shutdown_is_handed_over_once_it_is_done(gate):
    # A second SIGTERM to a process group (Run turns SIGTERM into SystemExit) raised in the middle
    # of shutdown: the supervisor thread then read a pipe closed under it, and children were left
    # to the janitor.
    from simpledbi import Runtime
    from simpledbi.layout import STOPPING
    from .conftest import FAST
    handled = []

    def handler(signum, frame):
        handled.append(ours())   # what shutdown had left when the signal was handled
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        rt = Runtime([cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1)],
                     FAST).start()
        client = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
        errors = []
        call = threading.Thread(target=lambda: _capture(errors, client.forward,
                                                        np.full((1, 2), models.GATE, np.float32)))
        call.start()
        gate.wait_entered()      # the model process holds a batch: shutdown waits for it

        def second_sigterm():
            deadline = time.monotonic() + 30
            while rt.ctls["gated"].state != STOPPING and time.monotonic() < deadline:
                threading.Event().wait(0.01)   # bounded wait on a state change
            os.kill(os.getpid(), signal.SIGTERM)
            gate.open()

        helper = threading.Thread(target=second_sigterm)
        helper.start()
        with pytest.raises(SystemExit):
            rt.shutdown()
        helper.join(30)
        call.join(30)
        client.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handled == [[]], handled   # once, after shutdown removed everything
    assert not call.is_alive() and not helper.is_alive()


@pytest.mark.timeout(120)
def test_a_child_forked_in_c_without_pythons_fork_hooks_does_not_lend_its_parents_slots():
    # A fork() made by C code runs no os.register_at_fork hook: the handle still sees the pid change
    # (parent and child lending the same slot crossed answers).
    proc = _start("raw_fork")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0 and "OK" in out, (out, err)
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_a_forked_child_that_exits_leaves_its_parents_runtime_running():
    # Its atexit shut the parent's runtime down (STOPPING, namespace removed), and it tried to
    # join the parent's janitor: "AssertionError: can only join a child process".
    proc = _start("fork_child_exit")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0 and "OK" in out, (out, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_a_program_that_closed_its_stdin_keeps_its_runtime():
    # The janitor's pipe took fd 0, which Popen(stdin=DEVNULL) replaced with /dev/null in the janitor:
    # it read end-of-file at once, took it for the main process's death, killed the model processes
    # and removed the namespace.
    proc = _start("stdin_closed")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0 and "OK" in out, (out, err)
    assert "Traceback" not in err, err
    assert ours(proc.pid) == []


@pytest.mark.timeout(120)
def test_model_processes_under_forkserver_know_the_main_process_is_alive():
    # They took "my parent is not the main process" (it is the fork server) for its death:
    # each exited at its first maintenance, was restarted, and the model was marked broken.
    from simpledbi import Runtime, RuntimeOptions
    with Runtime([cpu_model("affine", models.affine)], RuntimeOptions(poll_interval=0.05, join_timeout=10.0),
                 start_method="forkserver") as rt:
        with SharedModel("affine", max_shape=(1, 3), namespace=rt.namespace) as m:
            x = np.ones((1, 3), np.float32)
            end = time.monotonic() + 1.0   # twenty maintenance rounds
            while time.monotonic() < end:
                np.testing.assert_array_equal(m.forward(x, timeout=30), x * 2 + 1)
            assert m.stats()["restarts"] == 0


def test_a_forked_worker_does_not_inherit_runs_sigterm_handler():
    from simpledbi import Run
    from . import workers
    out = Run(target=workers.sigterm_handler_worker, worker_num=1, start_method="fork",
              models=[cpu_model("affine", models.affine)])
    assert out == [repr(signal.SIG_DFL)], out


@pytest.mark.timeout(180)
def test_a_script_that_finds_its_packages_through_sys_path_gets_a_janitor_that_runs(tmp_path):
    # A Python whose own paths hold no numpy, and a script that adds them to sys.path (as a spawned
    # child gets them): the janitor, a program of its own, failed to import numpy at start -- a
    # traceback, and after a SIGKILL nobody removed the namespace or the name.
    import sysconfig
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=60)
    paths = [ROOT, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    boot = (f"import runpy, sys; sys.path[:0] = {paths!r}; "
            "runpy.run_module('tests.apps.app', run_name='__main__')")
    name = f"lifecycle-paths-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(tmp_path / "bare" / "bin" / "python"), "-c", boot, "runtime", name, "spawn"],
                            cwd=str(tmp_path), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)
    try:
        _wait_line(proc, "READY")
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    _assert_cleaned_up_after(proc.pid, name)
    assert "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_a_json_py_in_the_working_directory_does_not_stop_the_janitor(tmp_path):
    # The janitor, `python -c`, has the working directory first on its path: it imported a json.py
    # there, died, and start() failed ("the clean-up process did not start").
    (tmp_path / "json.py").write_text("raise ImportError('the json.py of the working directory')\n")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "apps", "app.py"), "ok"],
                            cwd=str(tmp_path), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "RESULT [0, 1, 2]" in out, (out, err)
    assert _clean(err), err
    assert ours(proc.pid) == []
