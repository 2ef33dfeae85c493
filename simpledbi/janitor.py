"""A tiny watchdog process that cleans up if the main process dies without doing it itself.

The main process (``Run``) holds one end of a pipe; the janitor blocks reading the other.
Normal shutdown sends ``("done",)``. If the main process is SIGKILLed the read returns EOF:
the janitor then stops the workers (SIGTERM), gives model processes ``grace`` seconds to
notice the orphaning and exit cleanly (a CUDA MPS client should not be killed mid-kernel), kills
what is left, then stops the run's private MPS daemon (once its clients are gone) and removes
the run's namespace directory. Same idea as CPython's ``resource_tracker``,
scoped to one run.
"""
from __future__ import annotations

import contextlib
import os
import signal

from .interrupts import ignore_ctrl_c
from .layout import STOPPING, ControlBlock
from .mps import PrivateDaemon, pidfds, wait_exit
from .naming import unregister
from .shm import sweep_namespace


def janitor_main(namespace: str, conn, grace: float) -> None:
    ignore_ctrl_c()
    # A signal to the whole process group -- a notebook kernel's shutdown or restart, systemd,
    # ``kill -TERM -PGID`` -- ends the main process without its clean-up: the janitor is what is
    # left to do it, so it outlives such signals (it exits once the main process is gone).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    workers, models, daemons, registrations, ctls = set(), set(), [], [], []
    orphaned = False
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            orphaned = True
            break
        kind = msg[0]
        if kind == "worker":
            workers.add(msg[1])
        elif kind == "model":
            models.add(msg[1])
        elif kind == "mps":  # announced before it starts: (control binary, private directory)
            daemons.append(PrivateDaemon(msg[1], msg[2]))
        elif kind == "gone":  # a model process that died and was replaced
            models.discard(msg[1])
        elif kind == "registration":  # the runtime's name (naming.py)
            registrations.append(msg[1])
        elif kind == "ctl":  # a model's control block: mapped now, while the runtime lives (its
            # memfd is reached through the runtime's /proc fd table)
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                ctls.append(ControlBlock.attach(namespace, msg[1], readonly=False))
        elif kind == "done":
            break
    if orphaned:
        for path in registrations:
            unregister(path, namespace)
        for ctl in ctls:   # attached clients see it at once, and named ones re-attach
            ctl.set_state(STOPPING)
        for pid in workers:
            _signal(pid, signal.SIGTERM)
        _wait_all(models | workers, grace)
        for pid in models | workers:
            _signal(pid, signal.SIGKILL)
        _wait_all(models | workers, 5.0)
        for daemon in daemons:
            daemon.stop(grace)
    for ctl in ctls:
        ctl.close()
    sweep_namespace(namespace)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_all(pids, timeout: float) -> None:
    """Wait until every pid has exited, or the timeout."""
    fds = pidfds(pids)
    try:
        wait_exit(fds, timeout)
    finally:
        for fd in fds.values():
            os.close(fd)
