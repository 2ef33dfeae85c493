"""CUDA MPS for one runtime: decide whether it is wanted, start a private daemon, always stop it.

Several model processes on one GPU time-slice it; under MPS their kernels run concurrently. The
runtime starts a *private* control daemon, so it never depends on or disturbs a system one (README:
"CUDA MPS is managed by the runtime"): ``start_for`` decides (``wanted``; none if ``foreign_daemon``),
makes its 0700 directory and hands it to ``adopt`` -- shutdown and the janitor -- before ``-d`` starts
it; only model processes get its variables (``ModelProcessSpec.env``, never ``os.environ``);
``PrivateDaemon.stop`` quits it after they exit, kills what is left and removes the directory.

NOTE [finding our daemon]: ``-d`` daemonizes, so we never hold its pid. Our processes are found by
scanning /proc for a process named ``nvidia-cuda-mps*`` (the control daemon and the servers it
starts) whose environment holds ``CUDA_MPS_PIPE_DIRECTORY=<our private pipe dir>``: that path is
fresh and unique to this runtime, so the match cannot name anything that is not ours, and unlike
the daemon's pid file it also finds its servers and survives a daemon that died half-way. Each
match is pinned with a pidfd and checked again, so a pid reused in between is never signalled."""
from __future__ import annotations

import collections
import contextlib
import glob
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

from .shm import pid_alive, remove_tree

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
SYSTEM_PIPE_DIR = "/tmp/nvidia-mps"   # where clients look when CUDA_MPS_PIPE_DIRECTORY is unset
ANSWER_TIMEOUT = 5.0                  # seconds a fresh daemon has to answer get_server_list
#: After SIGKILL, how long to wait for a process (the daemon's, or one the janitor stops) to go: the
#: kernel reaps one in milliseconds unless it is in an uninterruptible GPU call; past this we go on.
KILL_WAIT = 5.0


class MpsUnavailable(Exception):
    """A private daemon could not be started; the message says why."""


@dataclass(frozen=True)
class MpsStatus:
    """What the runtime did about MPS (``Runtime.mps``): ``state`` is "managed" (a private daemon
    runs in ``directory``), "skipped" (wanted, but ``reason`` says why not) or "off"."""

    state: str
    reason: str
    directory: Optional[str] = None

    @property
    def env(self) -> Dict[str, str]:
        """The variables that make a model process a client of our daemon (none unless managed)."""
        return daemon_env(self.directory) if self.state == "managed" else {}


def daemon_env(directory: str) -> Dict[str, str]:
    return {PIPE_VAR: os.path.join(directory, "pipe"), LOG_VAR: os.path.join(directory, "log")}


def visible_gpu_count() -> int:
    """GPUs a model process will see, without initialising CUDA here: the driver's list,
    capped by CUDA_VISIBLE_DEVICES. 0 when unknown (then everything counts as cuda:0)."""
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def wanted(mode: str, models: Sequence) -> Optional[str]:
    """Why this runtime wants MPS, or None. "auto": two or more model processes (of all
    ``models``, each instance placed by ``ModelConfig.device_of``) share a CUDA device. "cuda"
    and "auto" spread instances over the visible GPUs (engine.resolve_device); "auto" counts as a
    GPU where the NVIDIA driver lists one (the parent never imports torch to check), else the CPU."""
    if mode == "off":
        return None
    if mode == "on":
        return "mps='on'"
    seen = visible_gpu_count()
    gpus = max(seen, 1)
    per_gpu = collections.Counter()
    for cfg in models:
        for i in range(cfg.model_num):
            device = cfg.device_of(i)
            if device != "cpu" and (device != "auto" or seen):
                per_gpu[device if ":" in device else f"cuda:{cfg.gpu_ordinal(i) % gpus}"] += 1
    shared = [f"{n} model processes on {gpu}" for gpu, n in sorted(per_gpu.items()) if n > 1]
    return ", ".join(shared) or None


def foreign_daemon(environ=None, system_pipe_dir: Optional[str] = None) -> Optional[str]:
    """Why an MPS daemon not ours already serves this environment (its clients would be our model
    processes too: a second daemon would only compete), or None."""
    environ = os.environ if environ is None else environ
    system_pipe_dir = SYSTEM_PIPE_DIR if system_pipe_dir is None else system_pipe_dir
    if environ.get(PIPE_VAR):
        # (set with no daemon there -- a cluster's module file, a stale shell -- it serves nobody:
        # skipping ours for it ran the model processes without MPS, 11-23% fewer img/s on an H200)
        if _serving(environ[PIPE_VAR]):
            return f"{PIPE_VAR}={environ[PIPE_VAR]} is set and a daemon runs there"
        return None
    if _serving(system_pipe_dir):
        return f"a system MPS daemon is running ({os.path.join(system_pipe_dir, 'control')} exists)"
    return None


def _serving(pipe_dir: str) -> bool:
    return os.path.exists(os.path.join(pipe_dir, "control")) and not _stale(pipe_dir)


def _stale(pipe_dir: str) -> bool:
    """The control socket outlives its daemon; the daemon's pid file does not (seen with driver
    580: `quit` removes the pid file and leaves ``control``). Running = the pid file names a live
    process (one of another user counts: kill() answers EPERM)."""
    try:
        with open(os.path.join(pipe_dir, "nvidia-cuda-mps-control.pid")) as f:
            return not pid_alive(int(f.read().strip()))
    except (OSError, ValueError):
        return True


class PrivateDaemon:
    """One MPS control daemon of ours in its own directory: (control, directory) is all that
    :meth:`stop` needs, so the janitor rebuilds it from those."""

    def __init__(self, control: str, directory: str):
        self.control, self.directory = control, directory
        self.env = daemon_env(directory)

    @classmethod
    def create(cls, control: str) -> "PrivateDaemon":
        """A fresh private directory (mode 0700) with pipe/ and log/; the daemon is not started."""
        directory = tempfile.mkdtemp(prefix=f"sdbi_mps_{os.getpid()}_")
        daemon = cls(control, directory)
        for path in daemon.env.values():
            os.mkdir(path, 0o700)
        return daemon

    def start(self, timeout: float = ANSWER_TIMEOUT) -> None:
        """Start the daemon; return once it answers a harmless command. Raises MpsUnavailable."""
        deadline = time.monotonic() + timeout
        out_path = os.path.join(self.env[LOG_VAR], "start.out")
        with open(out_path, "wb") as out:   # not a pipe: the daemon may keep it (no EOF till it exits)
            try:
                done = subprocess.run([self.control, "-d"], env=dict(os.environ, **self.env),
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                raise MpsUnavailable(f"`{CONTROL} -d` did not return within {timeout:g} s") from None
            except OSError as e:
                raise MpsUnavailable(f"cannot run {self.control}: {e}") from None
        if done.returncode != 0:
            with open(out_path, "rb") as f:
                said = f.read()[-300:].decode(errors="replace").strip()
            raise MpsUnavailable(f"`{CONTROL} -d` exited with code {done.returncode}: {said}")
        # -d may return before the daemon listens: ask until it answers or the deadline passes.
        while self.command("get_server_list", deadline - time.monotonic()) is None:
            if time.monotonic() >= deadline:
                raise MpsUnavailable(f"the daemon did not answer get_server_list within {timeout:g} s")
            time.sleep(0.05)   # a fresh daemon listens within tens of ms; the deadline bounds the tries

    def command(self, text: str, timeout: float) -> Optional[str]:
        """Send one control command through our pipe directory; its answer, or None on failure."""
        if timeout <= 0 or not os.path.exists(os.path.join(self.env[PIPE_VAR], "control")):
            return None
        try:
            done = subprocess.run([self.control], input=text + "\n", env=dict(os.environ, **self.env),
                                  capture_output=True, text=True, timeout=timeout)
        except (subprocess.TimeoutExpired, OSError):
            return None
        return done.stdout if done.returncode == 0 else None

    def stop(self, timeout: float) -> None:
        """Quit the daemon, SIGKILL what of it is alive after ``timeout``, remove the directory.
        Idempotent; never raises (it runs on every exit path, the janitor's included)."""
        pinned = {}
        try:
            pipe_dir = self.env[PIPE_VAR]
            pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
            pinned = pidfds([p for p in pids if _is_ours(p, pipe_dir)], lambda pid: _is_ours(pid, pipe_dir))
            deadline = time.monotonic() + timeout
            self.command("quit", timeout)
            left = wait_exit(pinned, deadline - time.monotonic())
            if left:
                logger.warning("CUDA MPS daemon in %s did not quit within %g s; killing pids %s",
                               self.directory, timeout, sorted(left))
                signal_all(left.values(), signal.SIGKILL)
                wait_exit(left, KILL_WAIT)
        except Exception:  # noqa: BLE001 - cleanup goes on; say what failed
            logger.exception("stopping the CUDA MPS daemon in %s failed", self.directory)
        finally:
            for fd in pinned.values():
                os.close(fd)
            remove_tree(self.directory)


def sweep_dead_daemons(timeout: float = 5.0) -> int:
    """Stop the private daemons of runtimes that are gone (their main process and janitor killed
    together) and remove their directories: the directory's name holds its creator's pid. Only
    directories of this user; only processes whose environment names their pipe directory. ``timeout``:
    how long such a daemon has to quit before it is killed (a live one quits in milliseconds)."""
    swept = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "sdbi_mps_*_*")):
        m = re.match(r"sdbi_mps_(\d+)_", os.path.basename(path))
        try:
            if not m or os.stat(path).st_uid != os.getuid() or pid_alive(int(m.group(1))):
                continue
        except OSError:
            continue
        logger.info("stopping the CUDA MPS daemon a dead runtime (pid %s) left in %s", m.group(1), path)
        PrivateDaemon(shutil.which(CONTROL) or CONTROL, path).stop(timeout)
        swept += 1
    return swept


def _is_ours(pid: int, pipe_dir: str) -> bool:
    """NOTE [finding our daemon]: an MPS process whose environment names our pipe directory."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            if not f.read().startswith(b"nvidia-cuda-mps"):
                return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:  # gone, or another user's: not ours either way
        return False
    return os.fsencode(f"{PIPE_VAR}={pipe_dir}") in environ


def pidfds(pids, keep: Optional[Callable[[int], bool]] = None) -> Dict[int, int]:
    """pid -> pidfd of each process that exists and, once pinned, passes ``keep`` (checked after
    the pidfd is open: a pid reused in between fails it)."""
    pinned = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        if keep is None or keep(pid):
            pinned[pid] = fd
        else:
            os.close(fd)
    return pinned


def signal_all(fds, sig: int) -> None:
    """Send ``sig`` through each pidfd (a process gone or not ours meanwhile is skipped)."""
    for fd in fds:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(fd, sig)


def wait_exit(pinned: Dict[int, int], timeout: float) -> Dict[int, int]:
    """Wait until every pinned process exited (its pidfd turns readable); those still alive."""
    left, deadline = dict(pinned), time.monotonic() + timeout
    while left and (wait := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(left.values()), [], [], wait)
        left = {pid: fd for pid, fd in left.items() if fd not in ready}
    return left


def start_for(mode: str, models: Sequence, adopt: Callable[[PrivateDaemon], None],
              timeout: float = ANSWER_TIMEOUT) -> MpsStatus:
    """Start a private daemon if ``mode`` and the placement of ``models`` want one; ``adopt`` gets
    it before it starts, so whoever cleans up knows its directory even if start-up is interrupted.
    Wanted but not to be had: one log line says why and the runtime goes on without it; with
    ``mode="on"``, RuntimeError (a foreign daemon that already serves the children is fine)."""
    why = wanted(mode, models)
    if why is None:
        return MpsStatus("off", f"mps={mode!r}" + (": no CUDA device has two model processes"
                                                    if mode == "auto" else ""))
    if (foreign := foreign_daemon()) is not None:
        logger.info("CUDA MPS: not starting a private daemon: %s", foreign)
        return MpsStatus("skipped", foreign)
    if os.environ.get(PIPE_VAR):
        logger.info("CUDA MPS: %s=%s is set but no daemon runs there: the model processes get a "
                    "private one", PIPE_VAR, os.environ[PIPE_VAR])
    control = shutil.which(CONTROL)
    try:
        if control is None:
            raise MpsUnavailable(f"{CONTROL} is not on PATH")
        daemon = PrivateDaemon.create(control)
        adopt(daemon)
        try:
            daemon.start(timeout)
        except BaseException:
            daemon.stop(timeout)
            raise
    except MpsUnavailable as e:
        if mode == "on":
            raise RuntimeError(f"mps='on': cannot start a CUDA MPS daemon: {e}") from None
        # No binary usually means no GPU tooling at all: worth a line, not a warning.
        logger.log(logging.INFO if control is None else logging.WARNING,
                   "CUDA MPS: running without it (%s): %s", why, e)
        return MpsStatus("skipped", str(e))
    logger.info("CUDA MPS: started a private daemon in %s (%s)", daemon.directory, why)
    return MpsStatus("managed", why, daemon.directory)
