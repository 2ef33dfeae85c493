"""``Run`` and ``Runtime``: start the model process groups, then the workers; supervise; clean up.

Process tree of one run::

    main (Run / Runtime: supervisor)
     +-- janitor                        cleans /dev/shm if main dies (janitor.py)
     +-- model "a" instance 0..n-1       model_process.py
     +-- model "b" instance 0..m-1
     +-- worker 0..worker_num-1          worker.py -> your target(rank, *args, **kwargs)

Supervision blocks in ``multiprocessing.connection.wait`` on every child's sentinel and result
pipe, so a death is seen within milliseconds without polling; every ``poll_interval`` it also
reaps slots of clients that died without detaching. Shutdown is ordered and idempotent: refuse
new requests -> stop workers -> wake and stop model processes -> join with timeout -> terminate ->
kill -> fail what is left -> close views -> unlink everything of the namespace.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence

from .config import ModelConfig, RuntimeOptions
from .errors import ModelError, ModelProcessDied, WorkerError
from .janitor import janitor_main
from .model_process import ModelProcessSpec, model_process_main
from .shm import (
    check_free_space, create_semaphore, new_namespace, open_semaphore, pid_alive, sweep_dead_namespaces,
    sweep_namespace, unlink_sem, unlink_shm,
)
from .slots import (
    BROKEN, CLAIMED, FREE, PUBLISHED, RUNNING, STOPPING, T_ATTACHED, T_GEN, T_OWNER, T_STATE,
    ControlBlock, ctl_name, doorbell_name, sem_name, slot_name,
)
from .worker import worker_main

logger = logging.getLogger(__name__)


class _ModelProc:
    def __init__(self, cfg: ModelConfig, instance: int, proc, conn):
        self.cfg, self.instance, self.proc, self.conn = cfg, instance, proc, conn

    def describe(self) -> str:
        code = self.proc.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            try:
                how += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return f"model {self.cfg.name!r} process {self.instance} (pid {self.proc.pid}) died with {how}"


class Runtime:
    """The model process groups of one run, usable as a context manager.

    ``Run`` is the usual entry point; ``Runtime`` serves callers in this process too (tests,
    notebooks): ``with Runtime([cfg]) as rt: SharedModel(name, shape, namespace=rt.namespace)``.
    """

    def __init__(self, models: Sequence[ModelConfig], options: Optional[RuntimeOptions] = None,
                 start_method: str = "spawn"):
        if isinstance(models, ModelConfig):
            models = [models]
        models = list(models)
        if not models or not all(isinstance(m, ModelConfig) for m in models):
            raise TypeError(f"models: expected a non-empty list of ModelConfig, got {models!r}")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: expected unique names, got {names}")
        self.models = models
        self.options = options or RuntimeOptions()
        self.ctx = mp.get_context(start_method)
        self.namespace = new_namespace()
        self.ctls: Dict[str, ControlBlock] = {}
        self.doorbells: Dict[str, Any] = {}
        self.model_procs: List[_ModelProc] = []
        self.worker_procs: Dict[int, Any] = {}
        self._janitor = None
        self._janitor_conn = None
        self._reaper: Optional[threading.Thread] = None
        self._reaper_stop = threading.Event()
        self._started = False
        self._closed = False

    # ------------------------------------------------------------ start
    def start(self) -> "Runtime":
        if self._started:
            return self
        self._started = True
        try:
            sweep_dead_namespaces()
            self._start_janitor()
            for cfg in self.models:
                size = ControlBlock.size(cfg.max_clients, cfg.model_num)
                check_free_space(size, f"model {cfg.name!r}")
                self.ctls[cfg.name] = ControlBlock.create(
                    ctl_name(self.namespace, cfg.name), cfg.max_clients, cfg.model_num,
                    cfg.max_batch_size, cfg.wait_time)
                self.doorbells[cfg.name] = create_semaphore(doorbell_name(self.namespace, cfg.name))
            cpu_procs = sum(m.model_num for m in self.models if any(d in ("cpu", "auto") for d in m.device))
            for cfg in self.models:
                for i in range(cfg.model_num):
                    self._spawn_model(cfg, i, cpu_procs)
            self._await_models()
            for ctl in self.ctls.values():
                ctl.set_state(RUNNING)
            self._reaper = threading.Thread(target=self._reap_loop, name="simpledbi-reaper", daemon=True)
            self._reaper.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_janitor(self) -> None:
        parent_end, child_end = self.ctx.Pipe()
        self._janitor = self.ctx.Process(target=janitor_main, name="simpledbi-janitor",
                                         args=(self.namespace, child_end, self.options.join_timeout),
                                         daemon=False)
        self._janitor.start()
        child_end.close()
        self._janitor_conn = parent_end

    def _tell_janitor(self, *msg) -> None:
        if self._janitor_conn is not None:
            try:
                self._janitor_conn.send(msg)
            except OSError:
                pass

    def _spawn_model(self, cfg: ModelConfig, instance: int, cpu_procs: int) -> None:
        parent_end, child_end = self.ctx.Pipe(duplex=False)
        spec = ModelProcessSpec(self.namespace, cfg, instance, self.options, os.getpid(), cpu_procs)
        proc = self.ctx.Process(target=model_process_main, args=(spec, child_end),
                                name=f"simpledbi-{cfg.name}-{instance}", daemon=False)
        proc.start()
        child_end.close()
        self._tell_janitor("model", proc.pid)
        self.model_procs.append(_ModelProc(cfg, instance, proc, parent_end))

    def _await_models(self) -> None:
        """Block until every model process reported it loaded and warmed up."""
        deadline = time.monotonic() + max(m.load_timeout for m in self.models)
        waiting = {mp_.conn: mp_ for mp_ in self.model_procs}
        sentinels = {mp_.proc.sentinel: mp_ for mp_ in self.model_procs}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted({f"{m.cfg.name}|{m.instance}" for m in waiting.values()})
                raise TimeoutError(f"model processes {names} did not load within their load_timeout")
            for obj in wait(list(waiting) + list(sentinels), timeout=left):
                if obj in waiting:
                    m = waiting.pop(obj)
                    try:
                        msg = obj.recv()
                    except EOFError:
                        msg = None
                    obj.close()
                    if msg is None or msg[0] != "ready":
                        if msg is None:
                            m.proc.join(5)
                            raise ModelProcessDied(m.describe() + " while loading", m.proc.exitcode)
                        raise ModelError(f"model {m.cfg.name!r} process {m.instance} failed to load: "
                                         f"{msg[1]}", msg[1].split(":")[0], msg[2])
                elif obj in sentinels:
                    m = sentinels.pop(obj)
                    if m.conn in waiting and not m.conn.poll():
                        m.proc.join(5)
                        raise ModelProcessDied(m.describe() + " while loading", m.proc.exitcode)

    # ------------------------------------------------------------ workers
    def run_workers(self, target: Callable, worker_num: int, args=(), kwargs=None) -> List[Any]:
        kwargs = dict(kwargs or {})
        conns = {}
        for rank in range(worker_num):
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=worker_main, name=f"simpledbi-worker-{rank}",
                                    args=(rank, target, tuple(args), kwargs, self.namespace, child_end))
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
        model_sentinels = {m.proc.sentinel: m for m in self.model_procs}
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
            for obj in wait(list(conns) + list(sentinels) + list(model_sentinels),
                            timeout=self.options.poll_interval):
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
                elif obj in model_sentinels:
                    m = model_sentinels.pop(obj)
                    if self.ctls[m.cfg.name].state >= STOPPING:
                        continue
                    raise self._model_died(m)
        for conn in conns:
            conn.close()
        return results

    def _model_died(self, m: _ModelProc) -> ModelProcessDied:
        m.proc.join(1)
        text = m.describe()
        logger.error("%s", text)
        ctl = self.ctls[m.cfg.name]
        ctl.set_state(BROKEN, text, m.proc.exitcode or 0)
        self._wake_waiters(m.cfg.name)
        return ModelProcessDied(text, m.proc.exitcode)

    def _wake_waiters(self, name: str) -> None:
        """Post ``done`` of every slot with a request in flight, so its client wakes up, finds no
        response and reads the control block's state (stopping or broken)."""
        ctl = self.ctls[name]
        table = ctl.table
        for slot in range(ctl.max_slots):
            if table[T_ATTACHED, slot] and table[T_STATE, slot] in (PUBLISHED, CLAIMED):
                try:
                    sem = open_semaphore(sem_name(self.namespace, name, slot, "don"))
                except Exception:  # noqa: BLE001 - the client is gone
                    continue
                sem.release()
                sem.close()

    def _reap_loop(self) -> None:
        """Every poll_interval, free the slots of clients that died (Run and Runtime alike)."""
        while not self._reaper_stop.wait(self.options.poll_interval):
            try:
                self.reap_dead_clients()
            except Exception:  # noqa: BLE001 - keep reaping; a failure here must not kill the run
                logger.exception("reaping dead clients failed")

    def reap_dead_clients(self) -> int:
        """Free the slots (and shared memory) of clients that died without detaching."""
        reaped = 0
        for name, ctl in self.ctls.items():
            table = ctl.table
            for slot in map(int, (table[T_ATTACHED] != 0).nonzero()[0]):
                pid = int(table[T_OWNER, slot])
                if pid and not pid_alive(pid):
                    gen = int(table[T_GEN, slot])
                    table[T_ATTACHED, slot] = 0
                    table[T_STATE, slot] = FREE
                    table[T_OWNER, slot] = 0
                    for part in ("in", "out"):
                        unlink_shm(slot_name(self.namespace, name, slot, gen, part))
                    unlink_sem(sem_name(self.namespace, name, slot, "don"))
                    unlink_sem(sem_name(self.namespace, name, slot, "rdy"))  # last: frees the index
                    reaped += 1
                    self.doorbells[name].release()  # a batch may be waiting for this client
                    logger.warning("reaped slot %d of model %r: its client (pid %d) died", slot, name, pid)
        return reaped

    # ------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Stop everything and remove every segment and semaphore of this run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish cleaning up first
        try:
            self._reaper_stop.set()
            if self._reaper is not None:
                self._reaper.join()
            self._stop_children()
        finally:
            for ctl in self.ctls.values():
                ctl.close()
            for sem in self.doorbells.values():
                sem.close()
            sweep_namespace(self.namespace)
            if self._janitor is not None:
                self._tell_janitor("done")
                self._janitor_conn.close()
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
            for _ in range(len(self.model_procs) + 1):
                self.doorbells[name].release()
        for proc in self.worker_procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.worker_procs.values():
            proc.join(self.options.join_timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for name in self.ctls:
            self._wake_waiters(name)
        deadline = time.monotonic() + self.options.join_timeout
        for m in self.model_procs:
            m.proc.join(max(0.0, deadline - time.monotonic()))
        for m in self.model_procs:
            if m.proc.is_alive():
                logger.warning("model %r process %d did not stop in time; terminating",
                               m.cfg.name, m.instance)
                m.proc.terminate()
                m.proc.join(2)
            if m.proc.is_alive():
                m.proc.kill()
                m.proc.join()
        for m in self.model_procs:
            if not m.conn.closed:
                m.conn.close()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def Run(target: Optional[Callable] = None, worker_num: int = 1, args: Sequence = (),
        kwargs: Optional[dict] = None, models: Sequence[ModelConfig] = (), *,
        options: Optional[RuntimeOptions] = None, start_method: str = "spawn") -> List[Any]:
    """Start ``models``, run ``target(rank, *args, **kwargs)`` in ``worker_num`` processes, clean up.

    Model processes load and warm up before any worker starts. Returns the workers' return values
    (by rank). Raises :class:`WorkerError` naming the first worker that raised or died (the others
    are then stopped), :class:`ModelProcessDied` if a model process dies, and cleans up on any
    exit, Ctrl-C and SIGTERM included.
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
    runtime = Runtime(models, options, start_method)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        with runtime:
            return runtime.run_workers(target, worker_num, args, kwargs) if worker_num else []
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
