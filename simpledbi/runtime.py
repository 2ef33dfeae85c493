"""``Run`` and ``Runtime``: start the model process groups, then the workers; supervise; clean up.

Process tree of one run::

    main (Run / Runtime)                 supervisor thread: restarts (this module)
     +-- janitor                        cleans /dev/shm if main dies (janitor.py)
     +-- (nvidia-cuda-mps-control -d)   a private CUDA MPS daemon, when wanted (mps.py)
     +-- model "a" instance 0..n-1       model_process.py
     +-- model "b" instance 0..m-1
     +-- worker 0..worker_num-1          worker.py -> your target(rank, *args, **kwargs)

The supervisor thread blocks in ``multiprocessing.connection.wait`` on every model process's
sentinel, so a death is seen within milliseconds without polling. A dead model process is
restarted with bounded exponential back-off while the other instances keep serving; the callers
whose requests it held get ``ModelProcessDied`` at once (the supervisor answers them, from the
process's HELD rows in the control block); after ``ModelConfig.max_restarts`` failures within
``restart_window`` seconds the model is marked broken and every caller gets
``ModelProcessDied`` with the reason. ``Run`` and ``Runtime`` behave the same; ``Run`` raises
only once a model is broken. Clients need no reaping: a client's slot is a memfd of its own,
gone with it. Shutdown is ordered and idempotent: refuse new requests -> stop workers -> wake and
stop model processes -> join with timeout -> terminate -> kill -> answer what is left queued ->
close views -> remove the namespace.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import mps, naming, sources
from .config import ModelConfig, RuntimeOptions
from .errors import ModelError, ModelProcessDied, RuntimeStopped, WorkerError
from .interrupts import children_deaf_to_ctrl_c
from .janitor import janitor_main
from .logs import LogRelay
from .intake import answer_queued, answer_held, wake_datagram
from .layout import (
    BROKEN, DRAINING, INST_DEAD, INST_LOADING, INST_RESTARTING, INST_RETIRING, RUNNING, ST_DIED,
    ST_STOPPED, STOPPING, ControlBlock, socket_path,
)
from .model_process import ModelProcessSpec, model_process_main
from .shm import InheritedFd, new_namespace, sweep_dead_namespaces, sweep_namespace
from .worker import worker_main

logger = logging.getLogger(__name__)


class _ModelProc:
    """One incarnation of one model instance."""

    def __init__(self, cfg: ModelConfig, instance: int, row: int, proc, conn):
        self.cfg, self.instance, self.row, self.proc, self.conn = cfg, instance, row, proc, conn
        self.loading = True
        self.exit_handled = False
        self.retiring = False    # replaced by a rolling reload: its exit is expected

    def how(self) -> str:
        code = self.proc.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            try:
                how += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return how

    def describe(self) -> str:
        return f"model {self.cfg.name!r} process {self.instance} (pid {self.proc.pid}) died with {self.how()}"


class Runtime:
    """The model process groups of one run, usable as a context manager.

    ``Run`` is the usual entry point; ``Runtime`` serves callers in this process too (tests,
    notebooks): ``with Runtime([cfg]) as rt: SharedModel(name, shape, namespace=rt.namespace)``.
    With ``name="myapp"`` any process of this user can attach by name, started by simpledbi or
    not: ``SharedModel(model, runtime="myapp")`` or ``$SIMPLEDBI_RUNTIME=myapp`` (naming.py).
    """

    def __init__(self, models: Sequence[ModelConfig], options: Optional[RuntimeOptions] = None,
                 start_method: str = "spawn", *, name: Optional[str] = None):
        if isinstance(models, ModelConfig):
            models = [models]
        models = list(models)
        if not models or not all(isinstance(m, ModelConfig) for m in models):
            raise TypeError(f"models: expected a non-empty list of ModelConfig, got {models!r}")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: expected unique names, got {names}")
        self.models = models
        self.name = naming.check_name(name) if name is not None else None
        self._registration: Optional[str] = None
        self.options = options or RuntimeOptions()
        self.ctx = mp.get_context(start_method)
        self.namespace: Optional[str] = None
        self.ctls: Dict[str, ControlBlock] = {}
        self.sockets: Dict[str, socket.socket] = {}   # each model's request socket (model_process.py)
        self._waker: Optional[socket.socket] = None   # sends the runtime's wake-up datagrams
        self.instances: Dict[Tuple[str, int], _ModelProc] = {}   # current incarnations
        self.worker_procs: Dict[int, Any] = {}
        self._cpu_procs = 1
        self._janitor = None
        self._janitor_conn = None
        self._janitor_lock = threading.Lock()
        self._logs: Optional[LogRelay] = None
        #: What was done about CUDA MPS: managed (a private daemon), skipped (and why) or off.
        self.mps = mps.MpsStatus("off", "the runtime has not started")
        self._mps_daemon: Optional[mps.PrivateDaemon] = None
        self._supervisor: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = None, None
        self._failures: Dict[str, collections.deque] = {m.name: collections.deque() for m in models}
        self._restart_at: Dict[Tuple[str, int], float] = {}
        self._at_exit: Optional[Callable[[], None]] = None   # shutdown at interpreter exit (start)
        self._retired: List[_ModelProc] = []        # replaced by a reload, maybe still finishing
        self._loading: List[_ModelProc] = []        # a reload's new processes, before the switch
        self._lifecycle_lock = threading.RLock()     # restarts vs. a reload's switch
        self._reload_lock = threading.Lock()
        self.broken: Dict[str, str] = {}
        self._input_names: Dict[str, Tuple[str, ...]] = {}   # per model, from its first "ready"
        self._started = False
        self._closed = False

    @property
    def model_procs(self) -> List[_ModelProc]:
        return list(self.instances.values()) + list(self._retired) + list(self._loading)

    # ------------------------------------------------------------ start
    def start(self) -> "Runtime":
        if self._started:
            return self
        _check_startable(self.models, self.ctx.get_start_method())
        self._started = True
        # A script that starts a runtime and then ends -- or raises -- without shutdown(): at
        # exit, multiprocessing joins its non-daemon children, the janitor among them, which
        # waits for this process to go: it hung for good. This runs first (atexit is LIFO).
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            sweep_dead_namespaces()
            naming.sweep_dead_registrations()
            if mps.wanted(self.options.mps, self.models):
                mps.sweep_dead_daemons()   # what runtimes killed with their janitor left
            self.namespace = new_namespace()
            self._start_janitor()
            self._logs = LogRelay()
            if self.name is not None:  # after the janitor: it removes the registration if we die
                self._tell_janitor("registration", naming.registration_path(self.name))
                self._registration = naming.register(self.name, self.namespace,
                                                     [m.name for m in self.models])
            self.mps = mps.start_for(self.options.mps, self.models, self._adopt_mps_daemon)
            self._waker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            for cfg in self.models:
                self.ctls[cfg.name] = ControlBlock.create(
                    self.namespace, cfg.name, cfg.model_num, cfg.max_batch_size, cfg.wait_time,
                    os.getpid(), cfg.max_clients)
                self._tell_janitor("ctl", cfg.name)   # it marks the model stopping if we die
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self.sockets[cfg.name] = sock
                sock.bind(socket_path(self.namespace, cfg.name))
                # clients check they connect to this very socket (not one bound at its path since)
                self.ctls[cfg.name].hdr["sock_ino"] = os.stat(socket_path(self.namespace, cfg.name)).st_ino
                # Every datagram says which process sent it: the kernel's word (intake.py)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._cpu_procs = sum(m.model_num for m in self.models
                                  if any(d in ("cpu", "auto") for d in m.device))
            for cfg in self.models:
                for i in range(cfg.model_num):
                    self._spawn_model(cfg, i)
            self._await_models()
            for cfg in self.models:  # what clients may rely on, published before RUNNING
                self.ctls[cfg.name].write_spec(self._input_names.get(cfg.name, ()), cfg.input_shapes,
                                               cfg.input_dtypes)
            for ctl in self.ctls.values():
                ctl.set_state(RUNNING)
            self._wake_r, self._wake_w = os.pipe()
            self._supervisor = threading.Thread(target=self._supervise_models,
                                                name="simpledbi-supervisor", daemon=True)
            self._supervisor.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_janitor(self) -> None:
        parent_end, child_end = self.ctx.Pipe()
        janitor = self.ctx.Process(target=janitor_main, name="simpledbi-janitor",
                                   args=(self.namespace, child_end, self.options.join_timeout),
                                   daemon=False)
        try:
            with children_deaf_to_ctrl_c():
                janitor.start()
                self._janitor, self._janitor_conn = janitor, parent_end  # only once it runs
        except BaseException:
            if self._janitor is None:
                parent_end.close()
            raise
        finally:
            child_end.close()

    def _adopt_mps_daemon(self, daemon: mps.PrivateDaemon) -> None:
        """Before the daemon starts: shutdown and the janitor must stop it whatever happens next."""
        self._mps_daemon = daemon
        self._tell_janitor("mps", daemon.control, daemon.directory)

    def _tell_janitor(self, *msg) -> None:
        with self._janitor_lock:
            if self._janitor_conn is not None:
                try:
                    self._janitor_conn.send(msg)
                except OSError:
                    pass

    def _spawn_model(self, cfg: ModelConfig, instance: int, row: Optional[int] = None,
                     standby: bool = False) -> _ModelProc:
        """Start model process ``instance`` of ``cfg`` in control-block row ``row`` (default: its
        row in the serving bank) and make it the current one -- unless ``row`` is given."""
        current = row is None
        if current:
            row = self.ctls[cfg.name].active_rows()[instance]
        parent_end, child_end = self.ctx.Pipe(duplex=False)
        log_r, log_w = self.ctx.Pipe(duplex=False)
        spec = ModelProcessSpec(self.namespace, cfg, row, self.options, os.getpid(), self._cpu_procs,
                                self.mps.env, log_w, logging.getLogger("simpledbi").getEffectiveLevel(),
                                standby)
        proc = self.ctx.Process(target=model_process_main,
                                args=(spec, child_end, self.sockets[cfg.name],
                                      InheritedFd(self.ctls[cfg.name].seg.fd)),
                                name=f"simpledbi-{cfg.name}-{instance}", daemon=False)
        try:
            with children_deaf_to_ctrl_c():   # NOTE [Ctrl-C and children]
                proc.start()
                self._logs.add(log_r)
                self._tell_janitor("model", proc.pid)
                m = _ModelProc(cfg, instance, row, proc, parent_end)
                if current:
                    self.instances[(cfg.name, instance)] = m
        finally:
            child_end.close()
            log_w.close()
        return m

    def _await_models(self, procs: Optional[List[_ModelProc]] = None) -> None:
        """Block until every model process (of ``procs``) reported it loaded and warmed up."""
        procs = list(self.instances.values()) if procs is None else procs
        deadline = time.monotonic() + max(m.cfg.load_timeout for m in procs)
        waiting = {m.conn: m for m in procs}
        sentinels = {m.proc.sentinel: m for m in procs}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted({f"{m.cfg.name}|{m.instance}" for m in waiting.values()})
                raise TimeoutError(f"model processes {names} did not load within their load_timeout")
            for obj in wait(list(waiting) + list(sentinels), timeout=left):
                if obj in waiting:
                    m = waiting.pop(obj)
                    msg = self._loaded(m)
                    if msg is None:
                        m.proc.join(5)
                        raise ModelProcessDied(m.describe() + " while loading" + _guard_hint(m),
                                               m.proc.exitcode)
                    if msg[0] != "ready":
                        raise ModelError(f"model {m.cfg.name!r} process {m.instance} failed to load: "
                                         f"{msg[1]}", msg[1].split(":")[0], msg[2])
                elif obj in sentinels:
                    m = sentinels.pop(obj)
                    if m.conn in waiting and not m.conn.poll():
                        m.proc.join(5)
                        raise ModelProcessDied(m.describe() + " while loading" + _guard_hint(m),
                                               m.proc.exitcode)

    def _loaded(self, m: _ModelProc):
        """Read a model process's load report; None if it died first."""
        try:
            msg = m.conn.recv()
        except (EOFError, OSError):
            msg = None
        m.conn.close()
        m.loading = False
        if msg is not None and msg[0] == "ready":
            names = tuple(msg[1].get("input_names", ()))
            known = self._input_names.setdefault(m.cfg.name, names)
            if names != known:  # clients were told ``known`` (ControlBlock.write_spec)
                logger.warning("model %r process %d takes inputs named %s, not %s like the first",
                               m.cfg.name, m.instance, names, known)
        return msg

    # ------------------------------------------------------------ supervision
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
        m.proc.join(1)
        name, ctl = m.cfg.name, self.ctls[m.cfg.name]
        ctl.hdr["deaths"] += 1   # before its callers are woken: a request taken and not yet
        # recorded may now be reported lost (client._check_alive)
        if ctl.state == STOPPING:
            return
        text = m.describe() + (" while loading" if m.loading else "")
        if not m.loading:
            try:
                m.conn.close()
            except OSError:
                pass
        ctl.all_instances[m.row]["free"] = 0  # a dead process is not an idle peer
        self._answer_held(name, m)
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
            why = (f"{text}; model {name!r} failed {len(failures)} times within "
                   f"{m.cfg.restart_window:g} s and is marked broken")
            logger.error("%s", why)
            self._mark_broken(name, why, m.proc.exitcode or 0)
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

    def _mark_broken(self, name: str, why: str, code: int) -> None:
        self.broken[name] = why
        self.ctls[name].set_state(BROKEN, why, code)
        answer_queued(self.sockets[name], ST_DIED, why)   # callers whose requests wait learn now

    def _answer_held(self, name: str, m: _ModelProc) -> None:
        """Answer every request the dead process ``m`` held (its HELD rows in the control
        block) with ModelProcessDied: its callers learn at once."""
        ctl = self.ctls[name]
        n = answer_held(ctl, m.row, m.proc.pid, ST_DIED,
                        f"model process {m.instance} (pid {m.proc.pid}) died while computing this "
                        f"request ({m.how()}; it may or may not have run)")
        ctl.all_instances[m.row]["held"] = 0
        if n:
            logger.debug("answered %d request(s) that %s held", n, m.describe())

    def _wake_model_processes(self, name: str, n: int) -> None:
        """Wake up to ``n`` model processes of ``name`` sleeping on the socket (each datagram wakes
        one): they look at the model's state (stopping, a reload's switch)."""
        for _ in range(n):
            try:
                self._waker.sendto(wake_datagram(), socket.MSG_DONTWAIT, socket_path(self.namespace, name))
            except OSError:
                return   # its queue is full: those processes are awake anyway

    # ------------------------------------------------------------ rolling reload
    def reload(self, model: str, path: Optional[str] = None, timeout: float = 60.0) -> ModelConfig:
        """Replace the processes of ``model`` (with the model at ``path`` -- a file, or a factory
        by import path ``"module:function"`` -- else the same source loaded again) without failing
        a request: start new processes in the other bank of the control block while the current
        ones serve (loaded, they claim nothing yet), switch, then let the old ones answer what
        they took and exit (terminated after ``timeout`` seconds). If a new process fails to
        load, the new ones are stopped -- they hold nothing -- and the current version keeps
        serving; the error is raised. Holds both versions in memory meanwhile."""
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                and 0 < timeout <= 3600):
            raise ValueError(f"reload timeout: expected 0 < seconds <= 3600, got {timeout!r}")
        with self._reload_lock:
            idx = next((k for k, c in enumerate(self.models) if c.name == model), None)
            if idx is None:
                raise LookupError(f"no model named {model!r}; this runtime serves "
                                  f"{[c.name for c in self.models]}")
            cfg = self.models[idx]
            if path is not None:   # a model file, or a factory by import path "module:function"
                try:
                    kind, source = sources.resolve(os.fspath(path))
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"reload {model!r}: {e}") from None
                except ValueError as e:
                    raise ValueError(f"reload {model!r}: {e}") from None
                if kind == "path":
                    cfg = dataclasses.replace(cfg, path=source, factory=None)
                else:
                    cfg = dataclasses.replace(cfg, path=None, factory=sources.ship(
                        model, source, self.ctx.get_start_method()))
            ctl = self.ctls[model]
            if ctl.state != RUNNING:
                raise RuntimeError(f"reload {model!r}: the model is {ctl.state_name}, not running")
            n = cfg.model_num
            bank = 1 - (int(ctl.hdr["bank"]) & 1)
            rows = range(bank * n, (bank + 1) * n)
            for r in rows:
                ctl.all_instances[r] = 0
                ctl.all_instances[r]["state"] = INST_LOADING
            with self._lifecycle_lock:
                if self._stop.is_set():
                    raise RuntimeStopped(f"reload {model!r}: the runtime is stopping")
                fresh = [self._spawn_model(cfg, i, row=rows[i], standby=True) for i in range(n)]
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
                for m in old:
                    m.retiring = True
                    self._retire(ctl, m)
            self._wake_model_processes(model, 2 * n)   # old ones see they retire
            logger.info("model %r reloaded%s: %d new process(es) serve; the old ones finish what "
                        "they took", model, f" from {path}" if path else "", n)
            deadline = time.monotonic() + timeout
            for m in old:
                while not self._stop.is_set() and not _exited(m) and time.monotonic() < deadline:
                    try:
                        m.proc.join(min(0.5, max(0.0, deadline - time.monotonic())))
                    except ValueError:  # reaped and closed by the supervisor meanwhile
                        break
            for m in old:
                if not self._stop.is_set() and not _exited(m):
                    logger.warning("model %r: old process %d (pid %d) did not finish within %.0f s; "
                                   "terminating it", model, m.instance, m.proc.pid, timeout)
                    m.proc.terminate()
                    m.proc.join(self.options.join_timeout)
            return cfg

    def _retire(self, ctl: ControlBlock, m: _ModelProc) -> None:
        """(Under _lifecycle_lock.) Old process ``m`` claims nothing more, answers what it took
        and exits; the supervisor reaps it (_on_model_exit) and forgets it."""
        if ctl.all_instances[m.row]["state"] != INST_DEAD:
            ctl.all_instances[m.row]["state"] = INST_RETIRING
        ctl.all_instances[m.row]["free"] = 0
        self._retired.append(m)
        try:
            os.write(self._wake_w, b"r")  # the supervisor watches its exit from now on
        except OSError:
            pass

    def _forget(self, m: _ModelProc) -> None:
        """A process that exited and was handled: release its pipe and handle (a long-lived
        runtime reloads many times)."""
        with self._lifecycle_lock:
            if m in self._retired:
                self._retired.remove(m)
        self._tell_janitor("gone", m.proc.pid)
        try:
            if not m.conn.closed:
                m.conn.close()
            m.proc.close()
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------ workers
    def run_workers(self, target: Callable, worker_num: int, args=(), kwargs=None) -> List[Any]:
        kwargs = dict(kwargs or {})
        conns = {}
        for rank in range(worker_num):
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=worker_main, name=f"simpledbi-worker-{rank}",
                                    args=(rank, target, tuple(args), kwargs, self.namespace, child_end))
            with children_deaf_to_ctrl_c():
                proc.start()
                child_end.close()
                self._tell_janitor("worker", proc.pid)
                self.worker_procs[rank] = proc
                conns[parent_end] = rank
        return self._supervise(conns, worker_num)

    def _supervise(self, conns: Dict[Any, int], worker_num: int) -> List[Any]:
        results: List[Any] = [None] * worker_num
        reported = set()
        sentinels = {p.sentinel: r for r, p in self.worker_procs.items()}
        pending = set(range(worker_num))

        def take(conn, rank):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                conns.pop(conn, None)
                return
            reported.add(rank)
            if msg[0] == "ok":
                results[rank] = msg[1]
            else:
                _, type_name, text, tb = msg
                raise WorkerError(f"worker {rank} raised {type_name}: {text}", rank, None, type_name, tb)

        while pending:
            if self.broken:
                name, why = next(iter(self.broken.items()))
                raise ModelProcessDied(why, self.ctls[name].hdr["broken_code"].item() or None)
            for obj in wait(list(conns) + list(sentinels), timeout=self.options.poll_interval):
                if obj in conns:
                    take(obj, conns[obj])
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    proc = self.worker_procs[rank]
                    proc.join()
                    for conn, r in list(conns.items()):
                        if r == rank:
                            if conn.poll():
                                take(conn, rank)
                            conns.pop(conn, None)
                            conn.close()
                    if proc.exitcode != 0 and rank not in reported:
                        code = proc.exitcode
                        how = f"exit code {code}"
                        if code is not None and code < 0:
                            how += f" ({signal.Signals(-code).name})"
                        raise WorkerError(f"worker {rank} (pid {proc.pid}) died with {how}", rank, code)
                    pending.discard(rank)
        for conn in conns:
            conn.close()
        return results

    # ------------------------------------------------------------ stop
    def drain(self, timeout: float = 30.0) -> bool:
        """Refuse new requests and let model processes answer those already published; returns
        True when nothing was left unanswered within ``timeout`` seconds. ``shutdown`` follows."""
        self._unregister()
        for ctl in self.ctls.values():
            if ctl.state == RUNNING:
                ctl.set_state(DRAINING)
        logger.info("draining: new requests are refused; finishing %d accepted (up to %.0f s)",
                    self.unanswered(), timeout)
        deadline = time.monotonic() + timeout
        while True:
            pending = self.unanswered()
            alive = any(m.proc.is_alive() for m in self.model_procs if not m.exit_handled)
            if not pending or not alive or time.monotonic() >= deadline:
                if pending:
                    logger.warning("drain: %d request(s) still unanswered after %.1f s", pending,
                                   min(timeout, time.monotonic() - deadline + timeout))
                return not pending
            time.sleep(0.01)  # shutdown only: a short poll of the counts, not a hot path

    def unanswered(self) -> int:
        """Requests model processes hold unanswered, plus one per model whose socket still has a
        request queued (a datagram's count is not known without taking it), over all models."""
        n = 0
        for name, ctl in self.ctls.items():
            n += int(ctl.all_instances["held"].sum())
            try:
                self.sockets[name].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                n += 1
            except OSError:
                pass
        return n

    def _unregister(self) -> None:
        if self._registration is not None:
            naming.unregister(self._registration, self.namespace)
            self._registration = None

    def shutdown(self) -> None:
        """Stop everything and remove every segment and semaphore of this run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish cleaning up first
        try:
            self._unregister()  # first: no new client may find a runtime that is going
            self._stop.set()
            if self._supervisor is not None:
                os.write(self._wake_w, b"x")
                self._supervisor.join()
            self._stop_children()
        finally:
            if self._logs is not None:
                self._logs.close()
            for name, sock in self.sockets.items():
                answer_queued(sock, ST_STOPPED, f"model {name!r}: the runtime stopped before any "
                              f"model process took this request")
                sock.close()
            if self._waker is not None:
                self._waker.close()
            for ctl in self.ctls.values():
                ctl.close()
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            if self.namespace is not None:
                sweep_namespace(self.namespace)
            if self._mps_daemon is not None:  # its clients, the model processes, are gone
                self._mps_daemon.stop(self.options.join_timeout)
            if self._janitor is not None:
                self._tell_janitor("done")
                with self._janitor_lock:
                    if self._janitor_conn is not None:
                        self._janitor_conn.close()
                        self._janitor_conn = None
                self._janitor.join(self.options.join_timeout)
                if self._janitor.is_alive():
                    self._janitor.kill()
                    self._janitor.join()
            if restore is not None:
                signal.signal(signal.SIGINT, restore)

    def _stop_children(self) -> None:
        for name, ctl in self.ctls.items():
            if ctl.state != BROKEN:
                ctl.set_state(STOPPING)
            self._wake_model_processes(name, len(self.model_procs) + 1)
        for proc in self.worker_procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.worker_procs.values():
            proc.join(self.options.join_timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        with self._lifecycle_lock:  # a reload thread adds or drops processes only under it
            procs = self.model_procs
        deadline = time.monotonic() + self.options.join_timeout
        for m in procs:
            m.proc.join(max(0.0, deadline - time.monotonic()))
        for m in procs:
            if m.proc.is_alive():
                logger.warning("model %r process %d did not stop in time; terminating",
                               m.cfg.name, m.instance)
                m.proc.terminate()
                m.proc.join(2)
            if m.proc.is_alive():
                m.proc.kill()
                m.proc.join()
        for m in procs:
            if not m.conn.closed:
                m.conn.close()
            m.proc.close()
        for proc in self.worker_procs.values():
            proc.close()


    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _exited(m: _ModelProc) -> bool:
    """Has ``m`` exited? (The supervisor may close its handle at any moment once it has.)"""
    try:
        return m.exit_handled or m.proc.exitcode is not None
    except ValueError:
        return True


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def Run(target: Optional[Callable] = None, worker_num: int = 1, args: Sequence = (),
        kwargs: Optional[dict] = None, models: Sequence[ModelConfig] = (), *,
        options: Optional[RuntimeOptions] = None, start_method: str = "spawn",
        name: Optional[str] = None) -> List[Any]:
    """Start ``models``, run ``target(rank, *args, **kwargs)`` in ``worker_num`` processes, clean up.

    Model processes load and warm up before any worker starts. Returns the workers' return values
    (by rank). Raises :class:`WorkerError` naming the first worker that raised or died (the others
    are then stopped), :class:`ModelProcessDied` if a model process dies, and cleans up on any
    exit, Ctrl-C and SIGTERM included. ``name`` lets processes it did not start attach too.
    """
    if target is not None and not callable(target):
        raise TypeError(f"target: expected a callable, got {type(target).__name__}")
    if not isinstance(worker_num, int) or isinstance(worker_num, bool) or worker_num < 0:
        raise ValueError(f"worker_num: expected an int >= 0, got {worker_num!r}")
    if target is None and worker_num:
        raise ValueError("worker_num > 0 needs a target")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: expected a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs: expected a dict, got {type(kwargs).__name__}")
    runtime = Runtime(models, options, start_method, name=name)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        with runtime:
            return runtime.run_workers(target, worker_num, args, kwargs) if worker_num else []
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _guard_hint(m: _ModelProc) -> str:
    """A model process that dies while loading under spawn is most often a script without
    ``if __name__ == "__main__":`` -- the child re-runs it and starts a runtime of its own."""
    import __main__
    path = getattr(__main__, "__file__", None)
    if not path or m.proc.exitcode != 1:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if "__main__" in text:
        return ""
    return (f". {os.path.basename(path)} has no `if __name__ == \"__main__\":` guard: model processes "
            f"are started with 'spawn' and re-import the main script, so the code that starts the "
            f"runtime must sit under that guard")


def _check_startable(models: List[ModelConfig], start_method: str) -> None:
    """What would only fail seconds later, in a model process, fails here with its reason.

    A factory the model processes could not import by name (a notebook's, a lambda) is replaced
    in ``models`` -- the runtime's own list -- by one sent by value (sources.ship)."""
    sources.forget_unreadable_main_file(start_method)   # NOTE [a __main__ that is no file]
    for k, cfg in enumerate(models):
        if cfg.path is not None and not os.path.exists(cfg.path):
            raise FileNotFoundError(f"model {cfg.name!r}: no model file at {cfg.path!r}")
        if cfg.factory is not None and start_method != "fork":
            factory = sources.ship(cfg.name, cfg.factory, start_method)
            try:
                ForkingPickler.dumps(factory)
            except Exception as e:  # noqa: BLE001 - pickle raises many kinds
                raise TypeError(f"model {cfg.name!r}: factory {cfg.factory!r} cannot be sent to a model "
                                f"process ({type(e).__name__}: {e}); model processes are started with "
                                f"{start_method!r}, so the factory must be picklable: a module-level "
                                f"function or class, or functools.partial of one with picklable "
                                f"arguments") from None
            if factory is not cfg.factory:
                models[k] = dataclasses.replace(cfg, factory=factory)


def _shutdown_at_exit(ref: "weakref.ref[Runtime]") -> None:
    """atexit: shut down a runtime its program left running."""
    rt = ref()
    if rt is not None:
        rt.shutdown()
