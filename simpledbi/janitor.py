"""A tiny watchdog process that cleans up if the main process dies without doing it itself (like
CPython's ``resource_tracker``, scoped to one run). It blocks on a pipe from the main process and
on its pidfd; normal shutdown sends ``("done",)``. If the main process dies (EOF, or the pidfd
turns readable) it stops the workers (SIGTERM), gives model processes ``grace`` seconds to notice
and exit cleanly (a CUDA MPS client should not be killed mid-kernel), kills what is left, then
stops the private MPS daemon (once its clients are gone) and removes the namespace directory.

It is a new program (``python -c``), not a ``multiprocessing`` child, so that it starts in a
session of its own: a signal to the main process's group -- a notebook kernel's shutdown or restart,
systemd, ``timeout -s KILL``, ``kill -- -PGID`` -- ends the main process without its clean-up,
and must not reach the process that does it. A spawned child could leave the group only once its
entry point ran, after importing the main module (torch and the user's code, 1-4 s): a group
SIGKILL meanwhile left the namespace and the runtime's name behind."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
from multiprocessing import spawn
from multiprocessing.connection import Connection, wait
from typing import Tuple

from .interrupts import child_signals
from .layout import STOPPING, ControlBlock
from .mps import KILL_WAIT, PrivateDaemon, pidfds, signal_all, wait_exit
from .naming import unregister
from .shm import sweep_namespace

#: What the janitor runs. First without the working directory ('' under -c: a json.py there was
#: imported), then the main process's ``sys.path`` -- sent on the connection (on the command line a
#: long one exceeded the kernel's 128 KiB per argument) -- as a spawned child gets it (a script that
#: edits it to find numpy), then this very package (from its directory, its ``__init__`` not run:
#: the janitor needs none of the client's imports, nor another installed version of the package).
_BOOT = ("import sys; sys.path[:] = [p for p in sys.path if p]; import types; "
         "from multiprocessing.connection import Connection; c = Connection(int(sys.argv[2])); "
         "sys.path[:] = c.recv(); p = sys.modules['simpledbi'] = types.ModuleType('simpledbi'); "
         "p.__path__ = [sys.argv[1]]; from simpledbi.janitor import _main; _main(c, *sys.argv[3:])")


#: How long start() waits for the janitor to say it is ready (after the models loaded, so mostly
#: overlapped): it imports numpy and a few modules of ours, well under a second; a minute allows a
#: crowded or swapping host, while a janitor that cannot run (stopped, starved) fails start() in a
#: minute rather than after the models' load_timeout (300 s by default).
READY_WAIT = 60.0


def start_janitor(namespace: str, grace: float) -> Tuple[subprocess.Popen, Connection]:
    """Start the janitor of ``namespace``; its process and the connection to tell it what to clean up
    (it says it is ready there: :func:`await_janitor`). The main process's pidfd goes with it, opened
    here: never a pid the system reused since."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        ours_fd, theirs_fd = _above_stdio(ours.detach(), theirs.detach())
    try:
        main_fd, = _above_stdio(os.pidfd_open(os.getpid()))
    except OSError:   # no pidfds on this kernel: the connection's end-of-file tells
        main_fd = -1
    try:
        proc = subprocess.Popen(
            [_interpreter(), "-c", _BOOT, os.path.dirname(os.path.abspath(__file__)), str(theirs_fd),
             namespace, repr(grace), str(main_fd)],
            pass_fds=[fd for fd in (theirs_fd, main_fd) if fd >= 0], stdin=subprocess.DEVNULL,
            start_new_session=True)
    except BaseException:
        os.close(ours_fd)
        raise
    finally:
        os.close(theirs_fd)
        if main_fd >= 0:
            os.close(main_fd)
    conn = Connection(ours_fd)
    try:
        conn.send(list(sys.path))   # (_BOOT reads it first)
    except OSError:   # it died at once: await_janitor says so
        pass
    return proc, conn


def _interpreter() -> str:
    """The Python to run the janitor with: multiprocessing's (``set_executable``), else this process's
    own binary where ``sys.executable`` is empty (``exec -a``) -- if it is a Python."""
    exe = spawn.get_executable()
    if exe:
        return exe
    with contextlib.suppress(OSError):
        own = os.readlink("/proc/self/exe")
        if os.path.basename(own).startswith("python"):
            return own
    raise RuntimeError("simpledbi starts a clean-up process with this Python, and sys.executable is "
                       "empty here: call multiprocessing.set_executable(path to python) first")


def await_janitor(proc: subprocess.Popen, conn: Connection, timeout: float = READY_WAIT) -> None:
    """Until the janitor says it is ready: one that failed to start (an import error: its traceback
    is on stderr) would leave nothing to clean up after a kill, silently."""
    try:
        exited = [_Pidfd(proc.pid)]
    except OSError:   # no pidfds: its exit closes the connection (end-of-file) too
        exited = []
    try:
        if conn in wait([conn, *exited], timeout) and conn.recv() == ("ready",):
            return
    except (EOFError, OSError):
        pass
    finally:
        for fd in exited:
            fd.close()
    code = proc.poll()
    why = (f"it exited with code {code} (its error is above)" if code is not None
           else f"no word from it in {timeout:g} s")
    raise RuntimeError(f"simpledbi's clean-up process (pid {proc.pid}) did not start: {why}")


class _Pidfd:
    """A process's pidfd, for ``wait`` (readable once it exits)."""

    def __init__(self, pid: int):
        self.fd = os.pidfd_open(pid)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        os.close(self.fd)


def _above_stdio(*fds: int) -> Tuple[int, ...]:
    """``fds`` moved to 3 or above (close-on-exec, as they were): in a program that closed its stdin,
    stdout or stderr, a new fd takes that number, and the janitor's stdin (/dev/null) or the
    stdout and stderr it inherits would take its place in the janitor."""
    out = []
    for fd in fds:
        if 0 <= fd <= 2:
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            os.close(fd)
            fd = moved
        out.append(fd)
    return tuple(out)


def join_janitor(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for it to finish cleaning up after ``("done",)``; killed after ``timeout``."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _main(conn: Connection, namespace: str, grace: str, main_fd: str) -> None:
    child_signals()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):   # (SIGQUIT: Ctrl-backslash)
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError):   # (the main process is gone already: janitor_main sees it)
        conn.send(("ready",))            # (await_janitor)
    janitor_main(namespace, conn, float(grace), int(main_fd))


def janitor_main(namespace: str, conn: Connection, grace: float, main_fd: int) -> None:
    """``main_fd``: the main process's pidfd, or -1 where the kernel has none."""
    # The pipe's end-of-file alone does not say the main process is gone: every process forked from it
    # since holds its end too (README, Cleanup). Its pidfd turns readable when it exits.
    main = [main_fd] if main_fd >= 0 else []
    plan = _Plan(namespace)
    orphaned = _follow(conn, plan, main)
    for fd in main:
        os.close(fd)
    if orphaned:
        for path in plan.registrations:
            unregister(path, namespace)
        for ctl in plan.ctls:   # attached clients see it at once, and named ones re-attach
            ctl.set_state(STOPPING)
        pinned = pidfds(plan.models | plan.workers)   # pinned before any signal: never a pid reused since
        try:
            signal_all([fd for pid, fd in pinned.items() if pid in plan.workers], signal.SIGTERM)
            left = wait_exit(pinned, grace)
            signal_all(left.values(), signal.SIGKILL)
            wait_exit(left, KILL_WAIT)
        finally:
            for fd in pinned.values():
                os.close(fd)
        for daemon in plan.daemons:
            daemon.stop(grace)
    for ctl in plan.ctls:
        ctl.close()
    sweep_namespace(namespace)


class _Plan:
    """What the main process told: what to stop and remove if it dies."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.workers, self.models, self.daemons, self.registrations, self.ctls = set(), set(), [], [], []

    def take(self, msg) -> bool:
        """Note one message; True for ``("done",)``: the main process cleaned up itself."""
        kind = msg[0]
        if kind == "worker":
            self.workers.add(msg[1])
        elif kind == "model":
            self.models.add(msg[1])
        elif kind == "mps":  # announced before it starts: (control binary, private directory)
            self.daemons.append(PrivateDaemon(msg[1], msg[2]))
        elif kind == "gone":  # a model process that died and was replaced
            self.models.discard(msg[1])
        elif kind == "registration":  # the runtime's name (naming.py)
            self.registrations.append(msg[1])
        elif kind == "ctl":  # a model's control block: mapped now, while the runtime lives (its
            # memfd is reached through the runtime's /proc fd table)
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.ctls.append(ControlBlock.attach(self.namespace, msg[1], readonly=False))
        return kind == "done"


def _follow(conn, plan: _Plan, main_fds) -> bool:
    """Take the main process's messages until it says it is done (False) or is gone (True)."""
    while True:
        ready = wait([conn, *main_fds])
        try:
            while conn.poll():   # what it sent before it went, too
                if plan.take(conn.recv()):
                    return False
        except (EOFError, OSError):
            return True
        if conn not in ready:    # only the main process's pidfd: it exited
            return True
