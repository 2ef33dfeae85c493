"""Supervision of a runtime's model processes (README, Liveness): deaths seen within milliseconds,
what a dead process held answered at once (``ModelProcessDied``), restarts with back-off, a model that
fails too often (``ModelConfig.max_restarts``) marked broken. A part of :class:`simpledbi.runtime.Runtime`."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait

from .config import ModelConfig
from .intake import answer_held, answer_queued, wake_datagram
from .layout import BROKEN, DRAINING, INST_RESTARTING, ST_DIED, STOPPING, socket_path

logger = logging.getLogger("simpledbi.runtime")


class _ModelProc:
    """One incarnation of one model instance."""

    def __init__(self, cfg: ModelConfig, instance: int, row: int, proc, conn):
        self.cfg, self.instance, self.row, self.proc, self.conn = cfg, instance, row, proc, conn
        self.loading, self.exit_handled = True, False
        self.retiring = False    # replaced by a rolling reload: its exit is expected
        #: Set once the supervisor handled its exit (_on_model_exit: reaped, what it held answered). The
        #: supervisor is its one reaper: another thread waits on this, never on the process -- of two
        #: threads' waitpid(), the loser gets ECHILD, which multiprocessing reads as "still running" (a
        #: reload under load killed an old process that had exited, warning it did not finish).
        self.handled = threading.Event()

    def describe(self) -> str:
        return (f"model {self.cfg.name!r} process {self.instance} (pid {self.proc.pid}) died with "
                f"{exit_how(self.proc.exitcode)}")


def exit_how(code) -> str:
    """``exit code N``, and the signal's name when a signal ended the process."""
    how = f"exit code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    return how


class Supervision:
    def _supervise_models(self) -> None:
        """The supervisor thread: restarts and broken models. Never raises."""
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                with self._lifecycle_lock:
                    for key, at in list(self._restart_at.items()):
                        if at <= now and not self._stop.is_set():
                            del self._restart_at[key]
                            self._restart(*key)
                watch = {self._wake_r: None}
                for m in list(self.instances.values()) + list(self._retired):  # not a reload's
                    # new processes before the switch: the reload reads their load reports
                    if m.exit_handled:
                        continue
                    if m.proc.exitcode is not None:  # died (and was reaped) since the last look
                        self._on_model_exit(m)
                        continue
                    watch[m.proc.sentinel] = m       # until its death is handled, not while alive:
                    if m.loading and not m.retiring:  # is_alive() reaps, and a reaped death
                        watch[m.conn] = m            # must still be handled
                # after the look above: a death it handled has just scheduled a restart
                timeout = max(0.0, min(self._restart_at.values()) - time.monotonic()) \
                    if self._restart_at else None
                for obj in wait(list(watch), timeout=timeout):
                    if obj == self._wake_r:
                        os.read(self._wake_r, 64)
                        continue
                    m = watch[obj]
                    if self._stop.is_set() or not m.retiring and \
                            self.instances.get((m.cfg.name, m.instance)) is not m:
                        continue
                    if obj is m.conn:
                        msg = self._loaded(m)
                        if msg is not None and msg[0] == "ready":
                            logger.info("model %r process %d restarted (pid %d)", m.cfg.name,
                                        m.instance, m.proc.pid)
                        elif msg is not None:
                            logger.error("model %r process %d failed to load again: %s", m.cfg.name,
                                         m.instance, msg[1])
                    elif not m.proc.is_alive():
                        self._on_model_exit(m)
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one failure
                logger.exception("simpledbi supervisor: unexpected error")
                self._stop.wait(self.options.poll_interval)

    def _on_model_exit(self, m: _ModelProc) -> None:
        if m.exit_handled:
            return
        m.exit_handled = True
        try:
            self._handle_exit(m)
        finally:
            m.handled.set()

    def _handle_exit(self, m: _ModelProc) -> None:
        m.proc.join(1)   # reaps it: it has exited
        name, ctl = m.cfg.name, self.ctls[m.cfg.name]
        ctl.hdr["deaths"] += 1   # before its callers are woken: a request taken and not yet
        # recorded may now be reported lost (client._check_alive)
        if ctl.state == STOPPING:
            return
        text = m.describe() + (" while loading" if m.loading else "")
        row = ctl.all_instances[m.row]
        row["free"] = 0        # a dead process is not an idle peer,
        row["queued"] = 0      # and what it held is answered below: nothing waits there
        row["newcomer_wait"] = 0.0
        # What it held (its HELD rows), answered with ModelProcessDied: its callers learn at once.
        n = answer_held(ctl, m.row, m.proc.pid, ST_DIED,
                        f"model process {m.instance} (pid {m.proc.pid}) died while computing this "
                        f"request ({exit_how(m.proc.exitcode)}; it may or may not have run)")
        row["held"] = 0
        if n:
            logger.debug("answered %d request(s) that %s held", n, m.describe())
        self._tell_janitor("gone", m.proc.pid)  # never signal a pid the system may reuse
        if m.retiring:
            if m.proc.exitcode:
                logger.warning("%s after it was replaced by a reload", m.describe())
            self._forget(m)
            return
        if ctl.state in (BROKEN, DRAINING):
            return
        now = time.monotonic()
        failures = self._failures[name]
        failures.append(now)
        while failures and failures[0] < now - m.cfg.restart_window:
            failures.popleft()
        if len(failures) > m.cfg.max_restarts:
            times = "once" if len(failures) == 1 else f"{len(failures)} times"
            why = (f"{text}; model {name!r} failed {times} within {m.cfg.restart_window:g} s (max_restarts "
                   f"{m.cfg.max_restarts}) and is marked broken")
            logger.error("%s", why)
            self.broken[name] = why
            ctl.set_state(BROKEN, why, m.proc.exitcode or 0)
            # callers whose requests wait learn now
            answer_queued(self.sockets[name], ST_DIED, why, counters=ctl.counters[m.row])
            return
        delay = min(m.cfg.restart_backoff * 2 ** (len(failures) - 1), 10.0)
        logger.error("%s; restarting it in %.2f s", text, delay)
        ctl.all_instances[m.row]["state"] = INST_RESTARTING
        self._restart_at[(name, m.instance)] = now + delay

    def _restart(self, name: str, instance: int) -> None:
        cfg = next(c for c in self.models if c.name == name)
        if self.ctls[name].state >= STOPPING:
            return
        m = self._spawn_model(cfg, instance)
        self.ctls[name].all_instances[m.row]["restarts"] += 1

    def _wake_model_processes(self, name: str, n: int) -> None:
        """Wake up to ``n`` model processes of ``name`` sleeping on the socket (each datagram wakes
        one): they look at the model's state (stopping, a reload's switch)."""
        for _ in range(n):
            try:
                self._waker.sendto(wake_datagram(), socket.MSG_DONTWAIT, socket_path(self.namespace, name))
            except OSError:
                return   # its queue is full: those processes are awake anyway
