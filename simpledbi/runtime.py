"""``Run`` and ``Runtime``: start the model process groups, then the workers; supervise (supervisor.py); clean
up (the process tree: README, Architecture; a private CUDA MPS daemon: mps.py). Shutdown is ordered and
idempotent: refuse new requests -> stop workers -> wake and stop model processes -> join with timeout -> kill
(they ignore SIGTERM) -> answer what is left queued -> close views -> remove the namespace."""
from __future__ import annotations

import atexit
import collections
import contextlib
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
from .errors import ModelError, ModelProcessDied
from .interrupts import children_deaf_to_ctrl_c
from .janitor import await_janitor, join_janitor, start_janitor
from .logs import LogRelay
from .intake import answer_queued
from .layout import (BROKEN, DRAINING, INST_LOADING, INST_RESTARTING, RUNNING, ST_STOPPED, STOPPING,
                     ControlBlock, socket_path)
from .model_process import ModelProcessSpec, model_process_main
from .shm import InheritedFd, new_namespace, sweep_dead_namespaces, sweep_namespace
from .reload import Reloads
from .supervisor import Supervision, _ModelProc
from .worker_group import Workers

logger = logging.getLogger(__name__)
#: Runtimes this process started and has not shut down: a notebook cell that starts one, run
#: again, starts a second beside the first (which runs, holding its memory and GPU, until the
#: process exits): start() says so.
_started_here: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


class Runtime(Supervision, Reloads, Workers):
    """The model process groups of one run, a context manager: ``Run`` is the usual entry point;
    ``with Runtime([cfg]) as rt: SharedModel(name, shape, namespace=rt.namespace)`` serves this
    process too (tests, notebooks). With ``name="myapp"`` any process of this user can attach:
    ``SharedModel(model, runtime="myapp")`` or ``$SIMPLEDBI_RUNTIME=myapp`` (naming.py)."""

    def __init__(self, models: Sequence[ModelConfig], options: Optional[RuntimeOptions] = None,
                 start_method: str = "spawn", *, name: Optional[str] = None):
        models = [models] if isinstance(models, ModelConfig) else list(models)
        if not models or not all(isinstance(m, ModelConfig) for m in models):
            raise TypeError(f"models: expected a non-empty list of ModelConfig, got {models!r}")
        if len({m.name for m in models}) != len(models):
            raise ValueError(f"models: expected unique names, got {[m.name for m in models]}")
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
        self._janitor = self._janitor_conn = None
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
        self._input_names: Dict[str, tuple] = {}   # per model, (names, required) from its first "ready"
        self._started = self._closed = False
        self._owner = os.getpid()   # the process that may stop it (not a fork of it)

    @property
    def model_procs(self) -> List[_ModelProc]:
        return list(self.instances.values()) + list(self._retired) + list(self._loading)

    # ------------------------------------------------------------ start
    def start(self) -> "Runtime":
        """Start the model processes and wait until they serve. Again on a started runtime: a no-op."""
        if self._closed:   # (its namespace, sockets and processes are gone: nothing to start again)
            raise RuntimeError("this Runtime was shut down (or its start failed or was interrupted) and "
                               "cannot start again: create a new Runtime")
        if self._started:
            return self
        _check_startable(self.models, self.ctx.get_start_method())
        if self.name is not None:   # at once, before a janitor and a namespace (the claim below decides)
            naming.refuse_if_live(naming.resolve(self.name), self.name)
        self._started, self._owner = True, os.getpid()
        twins = [rt for rt in list(_started_here) if not rt._closed and rt._owner == self._owner and
                 {m.name for m in rt.models} == {m.name for m in self.models}]
        if twins:
            logger.warning("this process already runs a Runtime of the same models (%s, namespace %s), "
                           "started before and not shut down (a notebook cell run again?): it keeps "
                           "running until this process exits; call its shutdown(), or start runtimes "
                           "with `with Runtime(...) as rt:`", ", ".join(m.name for m in self.models),
                           twins[0].namespace)
        _started_here.add(self)
        _forget_children_in_forks()
        # A script that ends (or raises) without shutdown() hung for good: at exit multiprocessing
        # joins its children, the janitor among them, which waits for us. This runs first (LIFO).
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
                self._registration = naming.register(self.name, self.namespace, [m.name for m in self.models])
            self.mps = mps.start_for(self.options.mps, self.models, self._adopt_mps_daemon)
            self._waker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            for cfg in self.models:
                self.ctls[cfg.name] = ControlBlock.create(
                    self.namespace, cfg.name, cfg.model_num, cfg.max_batch_size, cfg.wait_time,
                    os.getpid(), cfg.max_clients, cfg.default_timeout, cfg.max_queue)
                self._tell_janitor("ctl", cfg.name)   # it marks the model stopping if we die
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self.sockets[cfg.name] = sock
                sock.bind(socket_path(self.namespace, cfg.name))
                # clients check they connect to this very socket (not one bound at its path since)
                self.ctls[cfg.name].hdr["sock_ino"] = os.stat(socket_path(self.namespace, cfg.name)).st_ino
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)   # datagrams name their sender
            self._cpu_procs = sum(m.model_num for m in self.models
                                  if any(d in ("cpu", "auto") for d in m.device))
            for cfg in self.models:
                for i in range(cfg.model_num):
                    self._spawn_model(cfg, i)
            self._await_models()
            await_janitor(self._janitor, self._janitor_conn)
            for cfg in self.models:  # what clients may rely on, published before RUNNING
                ctl = self.ctls[cfg.name]
                ctl.write_spec(*self._input_names.get(cfg.name, ((), ())), cfg.input_shapes, cfg.input_dtypes)
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
        with children_deaf_to_ctrl_c():   # (recorded inside: NOTE [Ctrl-C and children])
            self._janitor, self._janitor_conn = start_janitor(self.namespace, self.options.join_timeout)

    def _adopt_mps_daemon(self, daemon: mps.PrivateDaemon) -> None:
        """Before the daemon starts: shutdown and the janitor must stop it whatever happens next."""
        self._mps_daemon = daemon
        self._tell_janitor("mps", daemon.control, daemon.directory)

    def _tell_janitor(self, *msg) -> None:
        with self._janitor_lock:
            if self._janitor_conn is not None:
                with contextlib.suppress(OSError):
                    self._janitor_conn.send(msg)

    def _spawn_model(self, cfg: ModelConfig, instance: int, row: Optional[int] = None) -> _ModelProc:
        """Start model process ``instance`` of ``cfg`` in its row of the serving bank, as the
        current one; with ``row`` (a reload's), on standby in that row."""
        standby = row is not None
        if not standby:
            row = self.ctls[cfg.name].active_rows()[instance]
        parent_end, child_end = self.ctx.Pipe(duplex=False)
        log_r, log_w = self.ctx.Pipe(duplex=False)
        spec = ModelProcessSpec(self.namespace, cfg, row, self.options, os.getpid(), self._cpu_procs,
                                self.mps.env, log_w, logging.getLogger("simpledbi").getEffectiveLevel(),
                                standby)
        proc = self.ctx.Process(target=model_process_main, name=f"simpledbi-{cfg.name}-{instance}",
                                args=(spec, child_end, self.sockets[cfg.name],
                                      InheritedFd(self.ctls[cfg.name].seg.fd)), daemon=False)
        try:
            with children_deaf_to_ctrl_c():   # NOTE [Ctrl-C and children]
                proc.start()
                self._logs.add(log_r)
                self._tell_janitor("model", proc.pid)
                m = _ModelProc(cfg, instance, row, proc, parent_end)
                if not standby:
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
                raise TimeoutError(f"model processes {names} did not load within their load_timeout "
                                   f"({max(m.cfg.load_timeout for m in procs):g} s)")
            for obj in wait(list(waiting) + list(sentinels), timeout=left):
                if obj in waiting:
                    m = waiting.pop(obj)
                    msg = self._loaded(m)
                    if msg is not None and msg[0] != "ready":
                        raise ModelError(f"model {m.cfg.name!r} process {m.instance} failed to load: "
                                         f"{msg[1]}", msg[1].split(":")[0], msg[2])
                    died = msg is None
                else:
                    m = sentinels.pop(obj)
                    died = m.conn in waiting and not m.conn.poll()
                if died:
                    m.proc.join(5)   # its exit code, for the message: it is exiting
                    raise ModelProcessDied(m.describe() + " while loading" + _guard_hint(m), m.proc.exitcode)

    def _loaded(self, m: _ModelProc):
        """Read a model process's load report; None if it died first."""
        try:
            msg = m.conn.recv()
        except (EOFError, OSError):
            msg = None
        m.conn.close()
        m.loading = False
        if msg is not None and msg[0] == "ready":
            names = tuple(msg[1].get("input_names", ())), tuple(msg[1].get("required_inputs", ()))
            known = self._input_names.setdefault(m.cfg.name, names)
            if names != known:  # clients were told ``known`` (ControlBlock.write_spec)
                logger.warning("model %r process %d takes inputs named %s (required %s), not %s "
                               "(required %s) like the first", m.cfg.name, m.instance, *names, *known)
        return msg

    # ------------------------------------------------------------ stop
    def drain(self, timeout: float = 30.0) -> bool:
        """Refuse new requests and let model processes answer those already published; returns
        True when nothing was left unanswered within ``timeout`` seconds. ``shutdown`` follows."""
        self._unregister()
        for ctl in self.ctls.values():
            if ctl.state == RUNNING:
                ctl.set_state(DRAINING)
        logger.info("draining: new requests are refused; finishing %d accepted (up to %g s)",
                    self.unanswered(), timeout)
        deadline = time.monotonic() + timeout
        while (pending := self.unanswered()) and time.monotonic() < deadline and any(
                m.proc.is_alive() for m in self.model_procs if not m.exit_handled):
            time.sleep(0.01)  # shutdown only: a short poll of the counts, not a hot path
        if pending:
            logger.warning("drain: %d request(s) still unanswered after %.1f s", pending,
                           min(timeout, time.monotonic() - deadline + timeout))
        return not pending

    def unanswered(self) -> int:
        """Requests model processes hold unanswered, plus one per model whose socket still has a
        request queued (a datagram's count is not known without taking it), over all models."""
        n = 0
        for name, ctl in self.ctls.items():
            n += int(ctl.all_instances["held"].sum())
            with contextlib.suppress(OSError):
                self.sockets[name].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                n += 1
        return n

    def _unregister(self) -> None:
        if self._registration is not None:
            naming.unregister(self._registration, self.namespace)
            self._registration = None

    def shutdown(self) -> None:
        """Stop everything and remove what this run created. Idempotent. Does nothing in a forked
        process (a pre-fork server's worker, exiting): the runtime is its parent's."""
        if self._closed or os.getpid() != self._owner:
            return
        restore, terms = {}, []
        if threading.current_thread() is threading.main_thread():   # finish cleaning up first:
            restore[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
            if callable(signal.getsignal(signal.SIGTERM)):  # Run's, or the user's: it would raise
                # in the middle of this (a second SIGTERM to a group): handed over afterwards
                restore[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda *a: terms.append(a))
        self._closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
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
                with self._janitor_lock:   # against a reload thread in _tell_janitor
                    self._janitor_conn.close()
                    self._janitor_conn = None
                join_janitor(self._janitor, self.options.join_timeout)
            for sig, handler in restore.items():
                signal.signal(sig, handler)
            if terms:
                restore[signal.SIGTERM](*terms[0])

    def _stop_children(self) -> None:
        for name, ctl in self.ctls.items():
            if ctl.state != BROKEN:
                ctl.set_state(STOPPING)
            self._wake_model_processes(name, len(self.model_procs) + 1)
        for proc in self.worker_procs.values():
            proc.terminate()   # (one that exited is left alone)
        for proc in self.worker_procs.values():
            _join_or_kill(proc, self.options.join_timeout)
            proc.close()
        with self._lifecycle_lock:  # a reload thread adds or drops processes only under it
            procs = self.model_procs
        for m in procs:
            # Still loading (the user's factory, a warm-up): it holds no request and would see
            # STOPPING only once loaded -- a Ctrl-C during a long load waited out join_timeout.
            if self.ctls[m.cfg.name].all_instances[m.row]["state"] in (INST_LOADING, INST_RESTARTING):
                m.proc.kill()   # (a model process ignores SIGTERM: interrupts.child_signals)
        deadline = time.monotonic() + self.options.join_timeout
        for m in procs:
            m.proc.join(max(0.0, deadline - time.monotonic()))
        for m in procs:
            if m.proc.is_alive():
                logger.warning("model %r process %d did not stop in time; killing it", m.cfg.name, m.instance)
                _join_or_kill(m.proc, 0)
            m.conn.close()   # idempotent
            m.proc.close()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _join_or_kill(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def Run(target: Optional[Callable] = None, worker_num: int = 1, args: Sequence = (),
        kwargs: Optional[dict] = None, models: Sequence[ModelConfig] = (), *,
        options: Optional[RuntimeOptions] = None, start_method: str = "spawn",
        name: Optional[str] = None) -> List[Any]:
    """Start ``models``, run ``target(rank, *args, **kwargs)`` in ``worker_num`` processes, clean up.

    Model processes load and warm up before any worker starts. Returns the workers' return values
    (by rank). Raises :class:`WorkerError` naming the first worker that raised or died (the others
    are then stopped), :class:`ModelProcessDied` if a model breaks (its processes keep dying), and
    cleans up on any exit, Ctrl-C and SIGTERM included. ``name`` lets processes it did not start
    attach too."""
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
    if worker_num:
        target = sources.ship("Run: target", target, start_method, "worker processes")
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
            if "__main__" in f.read():
                return ""
    except OSError:
        return ""
    return (f". {os.path.basename(path)} has no `if __name__ == \"__main__\":` guard: model processes "
            f"are started with 'spawn' and re-import the main script, so the code that starts the "
            f"runtime must sit under that guard")


def _check_startable(models: List[ModelConfig], start_method: str) -> None:
    """What would only fail seconds later, in a model process, fails here with its reason. A
    factory the model processes could not import by name (a notebook's, a lambda) is replaced in
    ``models`` -- the runtime's own list -- by one sent by value (sources.ship)."""
    sources.forget_unreadable_main_file(start_method)   # NOTE [a __main__ that is no file]
    if (unguarded := sources.unguarded_start(start_method)) is not None:
        raise RuntimeError(f"{os.path.basename(unguarded[0])}, line {unguarded[1]}, starts a simpledbi "
                           f"runtime outside `if __name__ == \"__main__\":` -- model processes are started "
                           f"with {start_method!r} and re-import the main script, so each would run that "
                           f"line again. Put the code that starts the runtime under that guard.")
    for k, cfg in enumerate(models):
        if cfg.path is not None and not os.path.exists(cfg.path):
            raise FileNotFoundError(f"model {cfg.name!r}: no model file at {cfg.path!r}")
        if cfg.factory is not None and start_method != "fork":
            factory = sources.ship(f"model {cfg.name!r}: factory", cfg.factory, start_method)
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


@functools.lru_cache(maxsize=None)   # once per process
def _forget_children_in_forks() -> None:
    """A process ``os.fork()``-ed from one running a runtime (a pre-fork server's worker) inherits
    multiprocessing's list of its parent's children and at exit tried to join them ("can only
    join a child process"): the list is emptied in the child (as multiprocessing's own do)."""
    os.register_at_fork(after_in_child=lambda: mp.process._children.clear())


def _shutdown_at_exit(ref: "weakref.ref[Runtime]") -> None:
    """atexit: shut down a runtime its program left running."""
    rt = ref()
    if rt is not None:
        try:
            rt.shutdown()
        except (SystemExit, KeyboardInterrupt):   # a signal handed over (shutdown): the program
            pass                                  # is exiting already
