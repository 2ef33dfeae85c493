"""A tiny watchdog process that cleans up if the main process dies without doing it itself (like
CPython's ``resource_tracker``, scoped to one run). It blocks on a pipe from the main process and
on its pidfd; normal shutdown sends ``("done",)``. If the main process dies (EOF, or the pidfd
turns readable) it stops the workers (SIGTERM), gives model processes ``grace`` seconds to notice
and exit cleanly (a CUDA MPS client should not be killed mid-kernel), kills what is left, then
stops the private MPS daemon (once its clients are gone) and removes the namespace directory."""
from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import wait

from .interrupts import child_signals
from .layout import STOPPING, ControlBlock
from .mps import KILL_WAIT, PrivateDaemon, pidfds, signal_all, wait_exit
from .naming import unregister
from .shm import sweep_namespace


def janitor_main(namespace: str, conn, grace: float, main_pid: int, forked_end=None) -> None:
    """``forked_end``: under the fork start method, the fd of the main process's end of the pipe,
    which this process inherited (closed at once: the main process's exit must be seen)."""
    child_signals()
    # A signal to the whole process group (a notebook kernel's shutdown or restart, systemd, ``kill
    # -TERM -PGID``) ends the main process without its clean-up: the janitor outlives it to do that.
    # A session of its own keeps it out of the group: SIGKILL to it (jupyter_client's shutdown and
    # restart with now=True, ``timeout -s KILL``) left the namespace and the name behind.
    with contextlib.suppress(OSError):
        os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):   # (SIGQUIT: Ctrl-backslash)
        signal.signal(sig, signal.SIG_IGN)
    if forked_end is not None:
        with contextlib.suppress(OSError):
            os.close(forked_end)
    # The pipe's end-of-file alone does not say the main process is gone: every process forked from it
    # since holds its end too (README, Cleanup). Its pidfd turns readable when it exits (pinned now).
    try:
        main, gone = [os.pidfd_open(main_pid)], False
    except ProcessLookupError:   # it died already
        main, gone = [], True
    except OSError:              # no pidfds on this kernel: the pipe's end-of-file tells
        main, gone = [], False
    plan = _Plan(namespace)
    orphaned = _follow(conn, plan, main, gone)
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


def _follow(conn, plan: _Plan, main_fds, gone: bool) -> bool:
    """Take the main process's messages until it says it is done (False) or is gone (True);
    ``gone``: it exited before its pid could be pinned (read what it sent, then stop)."""
    while True:
        ready = wait([conn, *main_fds], 0 if gone else None)
        try:
            while conn.poll():   # what it sent before it went, too
                if plan.take(conn.recv()):
                    return False
        except (EOFError, OSError):
            return True
        if gone or conn not in ready:    # only the main process's pidfd: it exited
            return True
