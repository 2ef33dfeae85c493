"""Ctrl-C belongs to the main process: its children neither see it nor print a traceback for it.

NOTE [Ctrl-C and children]
--------------------------
Ctrl-C sends SIGINT to the whole foreground process group, children included. A spawned child
spends its first second or two unpickling its arguments, which imports the user's main module
and torch; a SIGINT then raised KeyboardInterrupt inside those imports and each child printed a
traceback (three or four of them for the sample) although the main process cleans everything
up. A child's entry point can only ignore SIGINT once it runs, after those imports. So the main
process starts each child with SIGINT blocked (the signal mask survives fork and exec; a Ctrl-C
meanwhile stays pending for the main process and is handled right after), and the child's entry
point ignores SIGINT before it unblocks it. The main process alone decides when children stop.
"""
from __future__ import annotations

import contextlib
import signal
from multiprocessing import resource_tracker

_SIGINT = {signal.SIGINT}


@contextlib.contextmanager
def children_deaf_to_ctrl_c():
    """Children started inside this block begin with SIGINT blocked."""
    # multiprocessing starts its resource tracker with the first spawned child, and unblocks
    # SIGINT when that is done: start it first, or that child would begin with SIGINT unblocked
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_ctrl_c() -> None:
    """A child's first step: ignore SIGINT, then unblock it (a pending one is dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)
