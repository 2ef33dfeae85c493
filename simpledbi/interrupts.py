"""Ctrl-C belongs to the main process: its children neither see it nor print a traceback for it.

NOTE [Ctrl-C and children]
--------------------------
Ctrl-C sends SIGINT to the whole foreground process group. A spawned child spends its first second
or two unpickling its arguments (importing the user's main module and torch), where a SIGINT raised
KeyboardInterrupt and each child printed a traceback. A child's entry point runs only after those
imports, so the main process starts each child with SIGINT blocked (the mask survives fork and
exec), and the entry point ignores SIGINT before it unblocks it: only the main process stops them.

Blocking SIGINT in the starting thread does not hold a Ctrl-C back from Python: the kernel hands it
to another thread, and CPython raises KeyboardInterrupt in the main thread at its next bytecode --
inside ``Process.start()`` between spawning the child and writing its bootstrap data (the child
dies printing "EOFError: Ran out of input"), or before the runtime recorded the child (shutdown
then neither stops nor joins it). So while the block lasts the main thread's SIGINT handler only
takes note, and the Ctrl-C is raised when it ends; callers record the child inside the block.
SIGTERM is held the same way (Run's handler raises; the default ends the process): bootstrap data
larger than a pipe holds keeps ``start()`` writing until the child, importing, reads it all."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from multiprocessing import resource_tracker

_SIGINT = {signal.SIGINT}
_HELD = (signal.SIGINT, signal.SIGTERM)   # held while a child starts, raised after


@contextlib.contextmanager
def children_deaf_to_ctrl_c():
    """Children started inside this block begin with SIGINT blocked; a Ctrl-C or SIGTERM meanwhile
    is raised when the block ends, never inside it (NOTE [Ctrl-C and children])."""
    # multiprocessing starts its resource tracker with the first spawned child, unblocking SIGINT
    # when done: start it first, or that child would begin with SIGINT unblocked
    resource_tracker.ensure_running()
    # The main thread's handlers record a signal meanwhile. Nothing to hold elsewhere (Python runs
    # handlers in the main thread only), nor where one is ignored or handled outside Python.
    previous, pending = {}, []
    if threading.current_thread() is threading.main_thread():
        for sig in _HELD:
            if signal.getsignal(sig) not in (None, signal.SIG_IGN):
                previous[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
    try:
        yield
    finally:
        # unblocking delivers a SIGINT the kernel kept pending, to the recorder still installed
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):   # each once, in the order they came
            if callable(previous[sig]):
                previous[sig](sig, None)     # default_int_handler: KeyboardInterrupt; Run's: SystemExit
            else:                            # SIG_DFL: the process ends, as it would have
                signal.raise_signal(sig)


def child_signals(ignore_term: bool = False) -> None:
    """A child's first step: ignore SIGINT, then unblock it (a pending one is dropped); SIGTERM back to its
    default -- a forked child inherits the main process's Python handler (Run's raises SystemExit wherever the
    child happens to be, with a traceback) -- or, for a model process (``ignore_term``), ignored: a SIGTERM to
    the whole process group (systemd's default KillMode, ``timeout``, ``kill -- -PGID``) is the main process's
    to act on, and `serve` drains at SIGTERM, which needs its model processes alive. The runtime stops them
    through the model's state, and kills one that does not stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignored_here(os.getpid()) if ignore_term else signal.SIG_DFL)
    if ignore_term:   # system calls interrupted by it resume where the kernel can (SA_RESTART)
        signal.siginterrupt(signal.SIGTERM, False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)


def _ignored_here(pid: int):
    """A SIGTERM handler that ignores it in process ``pid`` only. Not SIG_IGN: that is inherited
    across fork and exec, and the model's own children (a ``multiprocessing.Pool`` in its factory,
    a helper it ``terminate()``s) would ignore SIGTERM too -- the pool's exit hung, and a
    helper outlived a SIGTERM to the group. A handler is reset to the default by exec; a process
    forked from this one (the handler copied) takes the default action itself. The cost: a wait
    the kernel never restarts (``sem_timedwait``, ``nanosleep``, ``select``) returns EINTR in the
    model's code; Python's own calls retry, a C extension may raise (posix_ipc's SignalError)."""
    def on_sigterm(signum, frame):
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    return on_sigterm
