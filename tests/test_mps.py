"""Runtime-managed CUDA MPS, on the CPU: a fake ``nvidia-cuda-mps-control`` on PATH stands in
for NVIDIA's, so starting, env passing, quitting, killing and every fallback run for real."""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from simpledbi import ModelConfig, RuntimeOptions, SharedModel
from simpledbi import mps
from simpledbi.runtime import Runtime

from . import models
from .conftest import cpu_model, ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# FAKE_MPS_MODE: ok | ignore_quit (answers, never exits) | silent (never answers) | fail_start.
# Each daemon writes FAKE_MPS_RECORD/<pid>: "started", then "quit" if it quit when asked.
FAKE_CONTROL = r'''#!{python}
"""A stand-in for nvidia-cuda-mps-control. `-d`: start a daemon that serves commands sent through
the FIFO $CUDA_MPS_PIPE_DIRECTORY/control; no arguments: send stdin's commands, print answers."""
import os, signal, sys
PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
CONTROL = os.path.join(PIPE, "control")
MODE = os.environ.get("FAKE_MPS_MODE", "ok")


def record(word):
    with open(os.path.join(os.environ["FAKE_MPS_RECORD"], str(os.getpid())), "a") as f:
        f.write(word + "\n")


def serve(ready_fd):
    fd = os.open(CONTROL, os.O_RDWR)  # a writer too, so reads never see EOF between clients
    with open(os.path.join(PIPE, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(os.getpid()))
    record("started")
    os.write(ready_fd, b"x")
    os.close(ready_fd)
    buf = b""
    while True:
        if MODE == "silent":
            signal.pause()  # listens (clients can connect) but never answers
        buf += os.read(fd, 4096)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            command, reply = line.decode().split(" ", 1)
            quitting = command == "quit" and MODE != "ignore_quit"
            if quitting:
                os.unlink(os.path.join(PIPE, "nvidia-cuda-mps-control.pid"))
                record("quit")
            with open(reply, "w") as r:
                r.write("")  # no MPS servers: an empty list
            if quitting:
                os._exit(0)


def daemonize():
    if MODE == "fail_start":
        sys.exit("fake failure to start")
    os.mkfifo(CONTROL, 0o600)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        os.setsid()
        if os.fork() == 0:
            serve(ready_w)
        os._exit(0)
    os.close(ready_w)
    os.waitpid(child, 0)
    os.read(ready_r, 1)  # like the real one, return once the daemon listens


def client():
    for command in (line.strip() for line in sys.stdin):
        if not command:
            continue
        try:
            fd = os.open(CONTROL, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            print("Cannot find MPS control daemon process")
            sys.exit(1)
        reply = os.path.join(PIPE, "reply.%d" % os.getpid())
        os.mkfifo(reply, 0o600)
        try:
            os.write(fd, ("%s %s\n" % (command, reply)).encode())
            os.close(fd)
            with open(reply) as r:
                sys.stdout.write(r.read())
        finally:
            os.unlink(reply)


daemonize() if sys.argv[1:] == ["-d"] else client()
'''


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """The fake control binary first on PATH, no MPS settings inherited from the host; afterwards
    every daemon it started must be gone, and every private directory of this process."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE_CONTROL.replace("{python}", sys.executable))
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv(mps.PIPE_VAR, raising=False)
    monkeypatch.delenv(mps.LOG_VAR, raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE_DIR", str(tmp_path / "no-system-daemon"))
    yield record
    alive = []
    for name in os.listdir(record):
        if not _exited(int(name), 10):
            os.kill(int(name), signal.SIGKILL)
            alive.append(int(name))
    assert alive == [], "fake MPS daemons left running"
    assert _private_dirs(os.getpid()) == []


def _private_dirs(pid: int) -> list:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"sdbi_mps_{pid}_*"))


def _exited(pid: int, timeout: float) -> bool:
    """Whether ``pid`` exits within ``timeout`` (its pidfd turns readable: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _daemons(record) -> dict:
    return {int(n): (record / n).read_text().split() for n in os.listdir(record)}


def env_probe(out_dir: str):
    """A model factory that writes what its model process sees of the MPS variables."""
    from tests.models import Affine
    with open(os.path.join(out_dir, str(os.getpid())), "w") as f:
        json.dump([os.environ.get(mps.PIPE_VAR), os.environ.get(mps.LOG_VAR)], f)
    return Affine()


def _options(mode: str, **kw) -> RuntimeOptions:
    return RuntimeOptions(poll_interval=0.05, join_timeout=10.0, mps=mode, **kw)


def _serves(rt: Runtime, name: str) -> None:
    with SharedModel(name, max_shape=(1, 2), namespace=rt.namespace) as model:
        np.testing.assert_array_equal(model.forward(np.ones((1, 2), np.float32)), np.full((1, 2), 3.0))


def _mps_records(caplog) -> list:
    return [r for r in caplog.records if r.name == mps.__name__]


# ---------------------------------------------------------------- pure decisions
def test_the_option_is_validated():
    with pytest.raises(ValueError, match=r"mps: expected one of \('auto', 'on', 'off'\), got 'yes'"):
        RuntimeOptions(mps="yes")
    with pytest.raises(TypeError, match="mps: expected one of"):
        RuntimeOptions(mps=True)
    assert RuntimeOptions().mps == "auto"


def _cfg(device, model_num=1, name="m"):
    return ModelConfig(name=name, factory=dict, device=device, model_num=model_num)


@pytest.mark.parametrize("mode,models,expected", [
    ("auto", [_cfg("cpu", 4)], None),
    ("auto", [_cfg("cuda", 1)], None),
    ("auto", [_cfg("cuda", 2)], "2 model processes on cuda:0"),
    ("auto", [_cfg("auto", 2)], "2 model processes on cuda:0"),          # "auto" lands on a GPU
    ("auto", [_cfg(["cuda:0", "cuda:1"], 2)], None),                     # one per device
    ("auto", [_cfg(["cuda:0", "cuda:1"], 3)], "2 model processes on cuda:0"),
    ("auto", [_cfg(["cpu", "cuda:1"], 3)], None),
    ("auto", [_cfg("cuda:0", 1, "a"), _cfg("cuda", 1, "b")], "2 model processes on cuda:0"),
    ("auto", [_cfg("cuda:1", 2, "a"), _cfg("cuda:0", 3, "b")],
     "3 model processes on cuda:0, 2 model processes on cuda:1"),
    ("off", [_cfg("cuda", 8)], None),
    ("on", [_cfg("cpu", 1)], "mps='on'"),
])
def test_which_placements_want_mps(mode, models, expected, monkeypatch):
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 1)
    assert mps.wanted(mode, models) == expected


def test_on_a_host_without_a_gpu_auto_wants_no_mps(monkeypatch):
    # it logged "running without it (2 model processes on cuda:0)" where status showed them on cpu
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 0)
    assert mps.wanted("auto", [_cfg("auto", 2)]) is None
    assert mps.wanted("auto", [_cfg("cuda", 2)]) == "2 model processes on cuda:0"   # asked for: it fails


@pytest.mark.parametrize("models,expected", [
    ([_cfg("cuda", 2)], None),                                           # one per GPU
    ([_cfg("auto", 4)], "2 model processes on cuda:0, 2 model processes on cuda:1"),
    ([_cfg(["cuda", "cpu"], 4)], None),                                  # 2 on "cuda": spread
    ([_cfg("cuda:1", 1, "a"), _cfg("cuda", 2, "b")], "2 model processes on cuda:1"),
])
def test_cuda_and_auto_spread_instances_over_every_visible_gpu(models, expected, monkeypatch):
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 2)
    assert mps.wanted("auto", models) == expected
    assert [models[-1].gpu_ordinal(i) for i in range(4)] == \
        ([0, 0, 1, 1] if len(models[-1].device) == 2 else [0, 1, 2, 3])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, tmp_path):
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: ["a", "b", "c", "d"]
                        if p == "/proc/driver/nvidia/gpus" else real_listdir(p))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert mps.visible_gpu_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert mps.visible_gpu_count() == 2


def _a_running_daemon_in(pipe_dir) -> None:
    """What a live daemon leaves in its pipe directory: the control socket and its pid file (this
    process stands in for it: _stale checks only that the pid is alive)."""
    pipe_dir.mkdir()
    (pipe_dir / "control").touch()
    (pipe_dir / "nvidia-cuda-mps-control.pid").write_text(str(os.getpid()))


def test_a_daemon_that_is_not_ours_is_recognised(tmp_path):
    system = tmp_path / "nvidia-mps"
    elsewhere = tmp_path / "elsewhere"
    # the variable names a directory no daemon serves (a cluster's module file): ours is started
    assert mps.foreign_daemon({mps.PIPE_VAR: str(elsewhere)}, str(system)) is None
    _a_running_daemon_in(elsewhere)
    assert mps.foreign_daemon({mps.PIPE_VAR: str(elsewhere)}, str(system)) == \
        f"{mps.PIPE_VAR}={elsewhere} is set and a daemon runs there"
    assert mps.foreign_daemon({}, str(system)) is None
    system.mkdir()
    (system / "control").touch()
    pid_file = system / "nvidia-cuda-mps-control.pid"
    pid_file.write_text(str(os.getpid()))
    assert "a system MPS daemon is running" in mps.foreign_daemon({}, str(system))  # alive
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait(30)
    pid_file.write_text(str(dead.pid))
    assert mps.foreign_daemon({}, str(system)) is None       # a socket left by a daemon that died
    pid_file.unlink()
    assert mps.foreign_daemon({}, str(system)) is None       # ... or quit (which removes its pid file)


# ---------------------------------------------------------------- a managed daemon
@pytest.mark.timeout(120)
def test_on_starts_a_private_daemon_that_only_model_processes_see(fake_mps, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=mps.__name__)
    seen = tmp_path / "seen"
    seen.mkdir()
    cfg = cpu_model("m", functools.partial(env_probe, str(seen)), model_num=2)
    with Runtime([cfg], _options("on")) as rt:
        status, directory = rt.mps, rt.mps.directory
        assert (status.state, status.reason) == ("managed", "mps='on'")
        assert os.path.basename(directory).startswith(f"sdbi_mps_{os.getpid()}_")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        pipe, log = os.path.join(directory, "pipe"), os.path.join(directory, "log")
        assert os.path.exists(os.path.join(pipe, "control")) and os.path.isdir(log)
        assert sorted(json.loads((seen / p).read_text()) for p in os.listdir(seen)) == [[pipe, log]] * 2
        assert mps.PIPE_VAR not in os.environ and mps.LOG_VAR not in os.environ
        _serves(rt, "m")
        (daemon,) = _daemons(fake_mps)
    # shutdown quit it (it was asked, not killed) and removed the directory
    assert _exited(daemon, 10) and _daemons(fake_mps) == {daemon: ["started", "quit"]}
    assert not os.path.exists(directory)
    assert [r.levelno for r in _mps_records(caplog)] == [logging.INFO]


@pytest.mark.timeout(120)
def test_sigkill_of_the_main_process_makes_the_janitor_quit_the_daemon(fake_mps, tmp_path):
    code = (
        "import threading\n"
        "from simpledbi import ModelConfig, RuntimeOptions, mps\n"
        "from simpledbi.runtime import Runtime\n"
        "from tests.models import affine\n"
        f"mps.SYSTEM_PIPE_DIR = {str(tmp_path / 'no-system-daemon')!r}\n"
        "cfg = ModelConfig(name='m', factory=affine, device='cpu', num_threads=1, model_num=2)\n"
        "rt = Runtime([cfg], RuntimeOptions(poll_interval=0.05, mps='on')).start()\n"
        "print('READY', rt.mps.directory, rt._janitor.pid, flush=True)\n"
        "threading.Event().wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY"):
            proc.kill()
            raise AssertionError(f"the runtime did not start: {proc.communicate()[1]}")
        _, directory, janitor = line.split()
        (daemon,) = _daemons(fake_mps)
        janitor_fd = os.pidfd_open(int(janitor))
        proc.kill()
        proc.communicate(timeout=30)
        # The janitor kills the model processes, quits the daemon, removes the directory, exits.
        assert select.select([janitor_fd], [], [], 60)[0], "the janitor did not finish"
        os.close(janitor_fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert _exited(daemon, 0) and _daemons(fake_mps) == {daemon: ["started", "quit"]}
    assert not os.path.exists(directory) and _private_dirs(proc.pid) == []
    assert ours(proc.pid) == []


@pytest.mark.timeout(60)
def test_a_daemon_that_ignores_quit_is_killed(fake_mps, monkeypatch, caplog):
    monkeypatch.setenv("FAKE_MPS_MODE", "ignore_quit")
    daemon = mps.PrivateDaemon.create(shutil.which(mps.CONTROL))
    daemon.start()
    (pid,) = _daemons(fake_mps)
    daemon.stop(timeout=1.0)
    assert _exited(pid, 0) and _daemons(fake_mps) == {pid: ["started"]}
    assert not os.path.exists(daemon.directory)
    assert any("did not quit within 1 s; killing" in r.getMessage() for r in _mps_records(caplog))
    daemon.stop(timeout=1.0)  # idempotent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_daemon_that_never_answers_is_given_up(fake_mps, monkeypatch, caplog, mode):
    monkeypatch.setenv("FAKE_MPS_MODE", "silent")
    adopted = []
    models = [_cfg("cuda", 2)]
    if mode == "on":
        with pytest.raises(RuntimeError, match="mps='on': cannot start a CUDA MPS daemon: the daemon "
                                               "did not answer get_server_list within 1 s"):
            mps.start_for(mode, models, adopted.append, timeout=1.0)
    else:
        status = mps.start_for(mode, models, adopted.append, timeout=1.0)
        assert status == mps.MpsStatus("skipped", "the daemon did not answer get_server_list within 1 s")
        assert [r.levelno for r in _mps_records(caplog)][-1:] == [logging.WARNING]
    (pid,) = _daemons(fake_mps)
    assert _exited(pid, 0) and not os.path.exists(adopted[0].directory)


# ---------------------------------------------------------------- fallbacks
@pytest.mark.timeout(120)
def test_a_daemon_that_fails_to_start_falls_back_once_and_serving_works(fake_mps, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=mps.__name__)
    monkeypatch.setenv("FAKE_MPS_MODE", "fail_start")
    # device "auto" where the driver lists a GPU: placed on it for the decision; runs on the CPU here
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 1)
    with Runtime([cpu_model("m", models.affine, device="auto", model_num=2)], _options("auto")) as rt:
        assert rt.mps.state == "skipped"
        assert rt.mps.reason == f"`{mps.CONTROL} -d` exited with code 1: fake failure to start"
        _serves(rt, "m")
    (record,) = _mps_records(caplog)
    assert record.levelno == logging.WARNING and "running without it" in record.getMessage()
    with pytest.raises(RuntimeError, match="mps='on': cannot start a CUDA MPS daemon: .*fake failure"):
        Runtime([cpu_model("m", models.affine)], _options("on")).start()


@pytest.mark.timeout(120)
def test_a_missing_binary_falls_back_once_and_serving_works(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=mps.__name__)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(mps.PIPE_VAR, raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE_DIR", str(tmp_path / "no-system-daemon"))
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 1)   # (as above)
    with Runtime([cpu_model("m", models.affine, device="auto", model_num=2)], _options("auto")) as rt:
        assert rt.mps == mps.MpsStatus("skipped", f"{mps.CONTROL} is not on PATH")
        _serves(rt, "m")
    (record,) = _mps_records(caplog)
    assert record.levelno == logging.INFO and "not on PATH" in record.getMessage()
    with pytest.raises(RuntimeError, match=f"mps='on': cannot start a CUDA MPS daemon: {mps.CONTROL} "
                                           "is not on PATH"):
        Runtime([cpu_model("m", models.affine)], _options("on")).start()
    assert _private_dirs(os.getpid()) == []


@pytest.mark.timeout(120)
def test_a_daemon_already_in_use_is_not_replaced(fake_mps, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=mps.__name__)
    theirs = tmp_path / "theirs"
    _a_running_daemon_in(theirs)
    monkeypatch.setenv(mps.PIPE_VAR, str(theirs))
    with Runtime([cpu_model("m", models.affine)], _options("on")) as rt:
        assert rt.mps == mps.MpsStatus("skipped", f"{mps.PIPE_VAR}={theirs} is set and a daemon runs there")
        _serves(rt, "m")
    assert _daemons(fake_mps) == {} and _private_dirs(os.getpid()) == []
    (record,) = _mps_records(caplog)
    assert record.levelno == logging.INFO and str(theirs) in record.getMessage()


@pytest.mark.timeout(120)
def test_a_pipe_directory_set_where_no_daemon_runs_gets_a_private_daemon(fake_mps, tmp_path, monkeypatch,
                                                                          caplog):
    """CUDA_MPS_PIPE_DIRECTORY left in the environment with nothing serving there (a cluster's module
    file; a benchmark script exporting it): the runtime skipped MPS for it and its model processes
    ran without (0.77-0.89x plain PyTorch on an H200, where the same code reached 0.96-1.05x)."""
    caplog.set_level(logging.INFO, logger=mps.__name__)
    nobody = tmp_path / "nobody-serves-here"
    monkeypatch.setenv(mps.PIPE_VAR, str(nobody))
    seen = tmp_path / "seen"
    seen.mkdir()
    cfg = cpu_model("m", functools.partial(env_probe, str(seen)), model_num=2)
    with Runtime([cfg], _options("on")) as rt:
        assert rt.mps.state == "managed"
        pipe = os.path.join(rt.mps.directory, "pipe")
        assert [json.loads((seen / p).read_text())[0] for p in os.listdir(seen)] == [pipe] * 2
        assert os.environ[mps.PIPE_VAR] == str(nobody)   # this process's own setting is left as it was
        _serves(rt, "m")
    assert any(str(nobody) in r.getMessage() and "no daemon runs there" in r.getMessage()
               for r in _mps_records(caplog))


@pytest.mark.timeout(120)
def test_auto_with_cpu_models_starts_nothing(fake_mps, caplog):
    caplog.set_level(logging.INFO, logger=mps.__name__)
    with Runtime([cpu_model("m", models.affine, model_num=2)], _options("auto")) as rt:
        assert rt.mps == mps.MpsStatus("off", "mps='auto': no CUDA device has two model processes")
        assert rt.mps.env == {}
        _serves(rt, "m")
    assert _daemons(fake_mps) == {} and _mps_records(caplog) == []


@pytest.mark.timeout(60)
def test_a_daemon_left_by_a_runtime_killed_with_its_janitor_is_swept(fake_mps):
    """Main process and janitor SIGKILLed together: nobody quit the daemon. The next runtime
    that wants MPS stops it and removes its directory; a live owner's directory is left alone."""
    code = ("import os, shutil\n"
            "from simpledbi import mps\n"
            "d = mps.PrivateDaemon.create(shutil.which(mps.CONTROL))\n"
            "d.start()\n"
            "print(d.directory, flush=True)\n"
            "os._exit(0)\n")                      # dies without stopping it
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    directory = out.stdout.strip()
    assert os.path.isdir(directory), out.stderr
    (daemon,) = _daemons(fake_mps)
    assert not _exited(daemon, 0)
    mine = mps.PrivateDaemon.create(shutil.which(mps.CONTROL))  # owner alive: not swept
    try:
        assert mps.sweep_dead_daemons(timeout=5.0) == 1
        assert os.path.isdir(mine.directory)
    finally:
        mine.stop(timeout=1.0)
    assert _exited(daemon, 10) and _daemons(fake_mps) == {daemon: ["started", "quit"]}
    assert not os.path.exists(directory)
