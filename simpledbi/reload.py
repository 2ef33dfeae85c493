"""Rolling reloads: a model's processes replaced without a failed request. A part of
:class:`simpledbi.runtime.Runtime` (its state), in a module of its own."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

from .config import ModelConfig
from .errors import RuntimeStopped
from .layout import BROKEN, INST_DEAD, INST_LOADING, INST_RETIRING, RUNNING, STATE_NAMES
from . import sources
from .supervisor import _ModelProc

logger = logging.getLogger("simpledbi.runtime")


class Reloads:
    def reload(self, model: str, path=None, timeout: float = 60.0) -> ModelConfig:
        """Replace the processes of ``model`` (with the model at ``path`` -- a file, a factory by import path
        ``"module:function"``, or the factory itself, a callable as ``ModelConfig(factory=)`` takes -- else
        the same source loaded again) without failing a request: start new processes in the other bank of the
        control block while the current ones serve (loaded, they claim nothing yet), switch, then let the old
        ones answer what they took and exit (killed after ``timeout`` seconds: what they still hold then
        fails with ModelProcessDied). If a new process fails to load, the new ones are stopped -- they hold
        nothing -- and the current version keeps serving; the error is raised. Holds both versions in memory
        meanwhile."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"reload timeout: expected 0 < seconds <= 3600, got {timeout!r}")
        with self._reload_lock:
            idx = next((k for k, c in enumerate(self.models) if c.name == model), None)
            if idx is None:
                raise LookupError(f"no model named {model!r}; this runtime serves "
                                  f"{[c.name for c in self.models]}")
            cfg = self.models[idx]
            if callable(path):
                kind, source = "factory", path
            elif path is not None:   # a model file, or a factory by import path "module:function"
                if not isinstance(path, (str, os.PathLike)):
                    raise TypeError(f"reload {model!r}: expected a model file, 'module:function' or a "
                                    f"factory (a callable), got {type(path).__name__} {path!r}")
                try:
                    kind, source = sources.resolve(os.fspath(path), by_name=True)
                except (FileNotFoundError, ValueError) as e:
                    raise type(e)(f"reload {model!r}: {e}") from None
            if path is not None:
                if kind == "factory":
                    source = sources.ship(f"model {model!r}: factory", source, self.ctx.get_start_method())
                cfg = dataclasses.replace(cfg, **{"path": None, "factory": None, kind: source})
            ctl = self.ctls.get(model)
            if ctl is None or ctl.state != RUNNING:
                raise RuntimeError(f"reload {model!r}: the model is " + (
                    "not started (Runtime.start() first)" if ctl is None else
                    f"{STATE_NAMES.get(ctl.state, ctl.state)}, not running" + (
                        f" ({ctl.message()}): a broken model is not restarted nor reloaded -- fix its "
                        f"cause and start the runtime (`simpledbi serve`) again; `simpledbi status "
                        f"--check` exits 1 meanwhile, for a supervisor to act on"
                        if ctl.state == BROKEN else "")))
            n = cfg.model_num
            bank = 1 - (int(ctl.hdr["bank"]) & 1)
            rows = range(bank * n, (bank + 1) * n)
            for r in rows:
                ctl.all_instances[r] = 0
                ctl.all_instances[r]["state"] = INST_LOADING
            with self._lifecycle_lock:
                if self._stop.is_set():
                    raise RuntimeStopped(f"reload {model!r}: the runtime is stopping")
                fresh = [self._spawn_model(cfg, i, row=rows[i]) for i in range(n)]
                self._loading = fresh          # shutdown stops these too
            try:
                self._await_models(fresh)
            except BaseException as e:
                with self._lifecycle_lock:
                    stopping = self._stop.is_set()   # then shutdown stops them (_loading)
                    if not stopping:
                        self._loading = []
                if stopping:
                    raise RuntimeStopped(f"reload {model!r}: the runtime stopped meanwhile") from e
                for m in fresh:  # on standby or still loading: they hold no request
                    m.proc.kill()
                    m.proc.join(self.options.join_timeout)
                    self._forget(m)
                for r in rows:
                    ctl.all_instances[r]["state"] = INST_DEAD
                raise RuntimeError(f"reload {model!r} failed; the running version keeps serving: "
                                   f"{type(e).__name__}: {e}") from e
            with self._lifecycle_lock:
                if self._stop.is_set():
                    raise RuntimeStopped(f"reload {model!r}: the runtime stopped meanwhile")
                self._loading = []
                old = [self.instances[(model, i)] for i in range(n)]
                for i, m in enumerate(fresh):
                    self.instances[(model, i)] = m
                    self._restart_at.pop((model, i), None)
                self.models[idx] = cfg
                ctl.hdr["bank"] = bank          # the new processes start claiming (await_switch)
                for m in old:   # they claim nothing more, answer what they took and exit
                    m.retiring = True
                    if ctl.all_instances[m.row]["state"] != INST_DEAD:
                        ctl.all_instances[m.row]["state"] = INST_RETIRING
                    ctl.all_instances[m.row]["free"] = 0
                self._retired.extend(old)   # the supervisor reaps them (_on_model_exit), forgets them
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"r")   # and watches their exits from now on
            self._wake_model_processes(model, 2 * n)   # old ones see they retire
            logger.info("model %r reloaded%s: %d new process(es) serve; the old ones finish what "
                        "they took", model, f" from {sources.describe(path) if callable(path) else path}" if path else "", n)
            deadline = time.monotonic() + timeout
            row = ctl.all_instances
            for m in old:   # the supervisor reaps them; never joined here (_ModelProc.handled)
                self._await_exit(m, deadline - time.monotonic())
                if row[m.row]["held"] == 0:
                    # it holds nothing: it retires, or is closing (torch's teardown can take longer
                    # than a short timeout); killed, it logged a death though nothing failed
                    self._await_exit(m, self.options.join_timeout)
                if not self._stop.is_set() and not m.handled.is_set():
                    logger.warning("model %r: old process %d did not finish within %g s (the reload's "
                                   "timeout); killing it: its %d request(s) in progress fail with "
                                   "ModelProcessDied", model, m.instance, timeout, int(row[m.row]["held"]))
                    with contextlib.suppress(ValueError):   # the supervisor closed it: it just exited
                        m.proc.kill()   # (it ignores SIGTERM: interrupts.child_signals)
                    self._await_exit(m, self.options.join_timeout)
            return cfg

    def _await_exit(self, m: _ModelProc, seconds: float) -> None:
        """Wait up to ``seconds`` until the supervisor has handled ``m``'s exit, or the runtime stops."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and not m.handled.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            m.handled.wait(min(0.5, left))   # in 0.5 s steps: a shutdown meanwhile ends the wait promptly

    def _forget(self, m: _ModelProc) -> None:
        """A process that exited and was handled: release its pipe and handle (a long-lived
        runtime reloads many times)."""
        with self._lifecycle_lock:
            if m in self._retired:
                self._retired.remove(m)
        self._tell_janitor("gone", m.proc.pid)
        with contextlib.suppress(OSError, ValueError):
            m.conn.close()   # idempotent
            m.proc.close()
