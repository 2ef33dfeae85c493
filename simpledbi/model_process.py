"""What runs in a model process: load, warm up, then the batch loop (README, Architecture, steps 3-6):
intake.py takes a request off the model's socket, admission.py may refuse it (NOTE [overload]), holding.py
fills the batch from what is held, in order, until batching.decide closes it (NOTE [adaptive batching]),
the Engine runs it, answer.py answers and wakes each requester, accounting.py counts. Entry point
:func:`model_process_main` is module-level so ``spawn`` can pickle it."""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import resource
import select
import signal
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import batching
from .accounting import Accounting
from .admission import Admission
from .answer import Answers, check_outputs, safe_str
from .config import ModelConfig, RuntimeOptions
from .holding import _BUSY_POLL, _TAKE_WHILE_COMPUTING, Holding, _Collecting
from .intake import WAKE, Intake
from .interrupts import child_signals
from .layout import (BROKEN, DRAINING, HEADER, INST_DEAD, INST_READY, INST_RETIRING, INSTANCE,
                     ST_INTERNAL, ST_STOPPED, STOPPING, ControlBlock, words)
from .logs import install_child_handler
from .overload import Limits as OverloadLimits
from .shm import inherited_fd
from .slots import Limits, Peer, Request

logger = logging.getLogger(__name__)
#: A client's turnaround (answered -> next request) counts at most this long: a client that
#: paused (between jobs, asleep) says nothing about how soon busy clients send again, and one such
#: sample would make batches wait for clients that are not coming.
_TURNAROUND_CAP = 0.1
_H_STATE = HEADER.fields["state"][1] // 8
_I_STATE, _I_FREE = (INSTANCE.fields[n][1] // 8 for n in ("state", "free"))


@dataclass(frozen=True)
class ModelProcessSpec:
    """Everything one model process needs, in one picklable object."""

    namespace: str
    config: ModelConfig
    instance: int
    options: RuntimeOptions
    parent_pid: int
    cpu_model_procs: int = 1
    #: Variables for this process only: the runtime's private CUDA MPS daemon (mps.py).
    env: Dict[str, str] = field(default_factory=dict)
    #: Where this process's log records go (logs.py), and from which level.
    log_conn: Any = None
    log_level: int = logging.WARNING
    #: Started by a rolling reload: after loading, take nothing until the runtime makes this
    #: process's bank the serving one (a reload that fails can then stop it without loss).
    standby: bool = False


def model_process_main(spec: ModelProcessSpec, conn, sock, ctl_fd) -> None:
    """Child entry point. Reports ("ready", info) or ("failed", ...) on ``conn``; ``sock`` is
    the model's request socket, ``ctl_fd`` its control block (shm.InheritedFd)."""
    os.environ.update(spec.env)  # first: the CUDA driver reads CUDA_MPS_* once, when it initialises
    install_child_handler(spec.log_conn, f"<{spec.config.name}|{spec.instance}>", spec.log_level)
    child_signals(ignore_term=True)  # the parent decides when to stop (NOTE [Ctrl-C and children])
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    # A mapping per client slot plus torch's own descriptors: the soft descriptor limit (often
    # 1024) goes up to the hard one, as far as 2**20.
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard if hard != resource.RLIM_INFINITY else 2**20, 2**20)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        server = ModelServer(spec, sock, inherited_fd(ctl_fd))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        with contextlib.suppress(OSError):   # (the parent is gone: nothing to report to)
            conn.send(("failed", f"{type(e).__name__}: {safe_str(e)}", traceback.format_exc()))
            conn.close()
        os._exit(1)
    # Everything loaded so far (torch, the model) lives as long as the process: keep it out of
    # the garbage collector's full passes, which otherwise stall a batch for tens of ms.
    gc.collect()
    gc.freeze()
    try:
        conn.send(("ready", {"pid": os.getpid(), "device": str(server.engine.device),
                             "input_names": list(server.engine.input_names),
                             "required_inputs": list(server.engine.required_inputs)}))
        conn.close()
    except OSError:
        logger.warning("%s the runtime went away while this process loaded; exiting", server.tag)
        os._exit(1)
    logger.debug("%s serving on %s", server.tag, server.engine.device)
    try:
        if not spec.standby or server.await_switch():
            import torch
            with torch.inference_mode():  # once for the whole loop, not per batch
                server.serve()
    finally:
        server.close()
    if server.answers.fatal:
        os._exit(3)  # the device context is unusable: let the supervisor start a fresh process


@dataclass(slots=True)
class _InFlight:
    batch: List[Request]
    t_close: float
    launched: object = None
    error: Optional[BaseException] = None


class ModelServer(Holding):
    """One model process: its engine, its intake, the batch being collected and the one on the device."""

    def __init__(self, spec: ModelProcessSpec, sock, ctl_fd: int):
        from .engine import Engine, Gather, resolve_device  # torch is imported only in model processes
        self._Gather = Gather
        self.spec = spec
        try:   # pinned now: the main process is alive while it starts us (_main_gone)
            self._main_fd: Optional[int] = os.pidfd_open(spec.parent_pid)
        except ProcessLookupError:
            self._main_fd = -1     # it died already
        except OSError:
            self._main_fd = None   # no pidfds on this kernel: the parent is compared instead
        cfg = spec.config
        self.me = spec.instance
        self.tag = f"<{cfg.name}|{self.me}>"
        self.poll = spec.options.poll_interval
        self.ctl = ControlBlock.attach(spec.namespace, cfg.name, readonly=False, fd=ctl_fd)
        inst = self.ctl.all_instances[self.me]
        inst["pid"], inst["t_start"] = os.getpid(), time.time()
        k = self.me % cfg.model_num
        dev = resolve_device(cfg.device_of(k), cfg.gpu_ordinal(k))   # status shows it while loading
        inst["device"] = -1 if dev.type == "cpu" else (dev.index or 0)
        self.engine = Engine(cfg, k, spec.cpu_model_procs)
        self.max_batch = int(cfg.max_batch_size)
        self.policy = batching.Policy(self.max_batch, float(cfg.wait_time), cfg.latency_target,
                                      adaptive=cfg.batching == "adaptive")
        self.costs, self.arrivals = batching.CostModel(), batching.RateMeter()
        self.turnaround: Optional[float] = None   # seconds from an answer to the client's next request (EMA)
        dtypes = tuple(np.dtype(d) for d in cfg.input_dtypes) if cfg.input_dtypes else None   # (shapes too)
        limits = Limits(self.max_batch, len(cfg.input_shapes) if cfg.input_shapes else None, dtypes,
                        names=self.engine.input_names)
        self.acct = Accounting(self.ctl, self.me, self.policy.latency_target)
        self.intake = Intake(sock, self.ctl, self.me, limits, cfg.max_clients, self.tag, count=self.acct.add,
                             on_new_peer=self._register, on_drop=self._unregister)
        self.answers = Answers(self.tag, self.me, self.engine, self._gather, self._release,
                               self.acct.add, cfg.isolate_errors)
        # taken, not batched yet (another kind / no room), and the refusals past capacity
        self.admission = Admission(self.ctl, self.me, OverloadLimits(cfg.max_queue), self.answers.fail,
                                   self.acct.add)
        self.backlog = self.admission.backlog
        self._open: Dict[int, Request] = {}    # id -> every request taken and not answered yet
        self._accounting_failed = False
        self._helper = None   # a thread for CPU forward passes past capacity (_compute_while_taking),
        # and the pipe it says "done" on (made now: a process's descriptors stay flat once serving)
        self._done_r, self._done_w = os.pipe() if not self.engine.cuda else (-1, -1)
        # Fair turns (NOTE [overload]): clients answered last whose next request is expected
        # (they have nothing waiting), and until when the next batch holds room for them.
        self._returning, self._hold_until = set(), 0.0
        self._just_answered: set = set()   # slots (ids of Peers) my last batch answered, not back yet
        self._hdr_words = words(self.ctl.header)
        self._inst_words = words(self.ctl.all_instances[self.me:self.me + 1])
        self._inst_words[_I_FREE] = 0
        self._free = self.ctl.all_instances["free"]   # mine is 0 whenever I look at it
        self.retiring = False     # a rolling reload replaced me: finish what I hold, then exit
        self._launch_ema = 0.0    # host seconds to enqueue a forward pass (EMA)
        self._forward_ema = 0.0   # device seconds of a forward pass (EMA)
        self._lead = 0.0          # host seconds to stage and launch a batch (EMA)
        self._device_free_at = 0.0   # when the device should finish what I launched (monotonic)
        if cfg.input_shapes:
            in_dtypes = cfg.input_dtypes or ("float32",) * len(cfg.input_shapes)
            # Declared names: clients will pass inputs by name, so warm up (and capture) that way.
            warm_sizes = sorted({self.max_batch, 1}, reverse=True)
            try:
                self.engine.warm_up(cfg.input_shapes, in_dtypes, warm_sizes, cfg.input_names)
            except Exception as e:   # (else it read as the factory's failure)
                raise RuntimeError(f"the model loaded, but its warm-up on zeros of the declared input_shapes "
                                   f"{[tuple(s) for s in cfg.input_shapes]} ({', '.join(map(str, in_dtypes))}; "
                                   f"batches of {' and '.join(map(str, warm_sizes))} rows) failed: "
                                   f"{type(e).__name__}: {e}") from e
            sizes = cfg.graph_batch_sizes()
            if sizes and self.engine.cuda:
                try:
                    self.engine.capture_graphs(cfg.input_shapes, in_dtypes, sizes, cfg.input_names)
                except Exception:
                    if cfg.cuda_graphs != "auto":
                        raise
                    logger.warning("%s CUDA graph capture failed; running eagerly", self.tag, exc_info=True)
        self._last_maintenance = time.monotonic()
        inst["graphs"] = self._graphs_shown = self.engine.graph_total   # as the instance row shows them
        self.intake.fit_to_descriptors()   # (after the model and CUDA opened theirs)
        if inst["state"] != INST_RETIRING:  # replaced by a reload while loading: it stays retiring
            inst["state"] = INST_READY

    # ------------------------------------------------------------ main loop
    def await_switch(self) -> bool:
        """A reload's new process, loaded: wait until the runtime switches the serving bank to
        mine (True), or retires me, stops or dies (False). Polls: it lasts one switch."""
        mine = self.me // self.ctl.model_num
        while True:
            if int(self.ctl.hdr["bank"]) & 1 == mine:
                return True
            if self._inst_words[_I_STATE] == INST_RETIRING or \
                    self._hdr_words[_H_STATE] in (STOPPING, BROKEN) or self._main_gone():
                return False
            time.sleep(0.005)

    def serve(self) -> None:
        """The batch loop (under torch.inference_mode). NOTE [pipelining]: on CUDA, batch k+1 is collected
        while batch k runs on the device, and closes once k should end in about the time staging and launching
        k+1 take (learned), so the device goes on without a gap (fast command, H200: 0.71x plain PyTorch when
        it closed only once the device was idle, 0.91x so). Its host->device copies go on a separate stream at
        once. Then k is answered and k+1's forward launched, or -- when launching is cheap next to the device
        time (CUDA graphs, big batches) -- k+1's forward goes first so the device never waits. At most two
        batches are unfinished (two buffer sets); on the CPU each batch is computed and answered in turn."""
        inflight: Optional[_InFlight] = None
        hdr_words, inst_words = self._hdr_words, self._inst_words
        while not self.answers.fatal:
            try:
                state = hdr_words[_H_STATE]
                if state >= STOPPING and state != DRAINING:  # draining: serve what was sent
                    break
                if inst_words[_I_STATE] == INST_RETIRING:
                    self.retiring = True
                if self.retiring and inflight is None and not self._open:
                    logger.info("%s retired: every request it took is answered", self.tag)
                    break
                batch, inflight = self._collect(inflight)
                if batch:
                    nxt = self._stage(batch)  # copies in on the copy stream, behind nothing
                    # Answer k before spending time launching k+1, unless launching is cheap next to the
                    # device time it overlaps: in a launch-bound model, launching first would make k's
                    # callers wait a whole launch for nothing.
                    if inflight is not None and (inflight.launched.ready() or
                                                 self._launch_ema >= 0.5 * self._forward_ema):
                        inflight = self._complete(inflight, wait=True)
                    self._start(nxt)
                    if inflight is not None:
                        inflight = self._complete(inflight, wait=True)
                    if nxt.error is None and nxt.launched.result is None:
                        inflight = nxt  # device work enqueued: finish it next round
                    else:
                        self._complete(nxt)
                    if time.monotonic() - self._last_maintenance > self.poll and not self._maintenance():
                        break
                elif inflight is not None:
                    inflight = self._complete(inflight, wait=True)
                elif not self.retiring and not self._idle_wait():
                    break
            except Exception as e:  # noqa: BLE001 - the catch-all: nothing stops this loop
                logger.exception("%s internal error; failing the requests concerned", self.tag)
                inflight = None
                self.admission.in_progress = 0
                self.engine.quiesce()
                deferred = {id(r) for r in self.backlog.items}
                self.answers.fail([r for r in self._open.values() if id(r) not in deferred], ST_INTERNAL,
                                  f"{type(e).__name__}\nsimpledbi internal error: {safe_str(e)}\n"
                                  f"{traceback.format_exc()}")
        if inflight is not None:
            try:
                self._complete(inflight)
            except Exception:  # noqa: BLE001
                logger.exception("%s finishing the last batch failed", self.tag)
        self.answers.fail(list(self._open.values()), ST_STOPPED, "the model process is stopping")

    def _idle_wait(self) -> bool:
        """Nothing held or running: sleep on the socket for up to a poll interval (False: exit)."""
        self._inst_words[_I_FREE] = 1
        self.admission.room = self.max_batch   # what comes now starts a batch
        # ... and clients must know it: an old backlog would make them refuse all calls (ControlBlock.backlog)
        # while I sleep idle (measured: 8 threads retrying at once got 8 answers/s of a 40/s model)
        self.admission.publish()
        try:
            got = None if self.intake.full else self.intake.next(self.poll)
        finally:
            self._inst_words[_I_FREE] = 0
        if isinstance(got, Request) and self._took(got):
            self.backlog.add(got)
        # (not between taking a request and batching it: serve() does it once the batch is launched)
        if not self.backlog and time.monotonic() - self._last_maintenance > self.poll and \
                not self._maintenance():
            return False
        if got is None:
            if self.engine.cuda:
                self.engine.take_graphs()   # captured off-thread while nothing came
                self._show_graphs()
            if not self.backlog:
                # Nothing came for a poll interval: now the first run of a batch size costs
                # no one (NOTE [first batch of a size]). At any lull it stalled the next requests.
                self.engine.quiet_step()
        return True

    def _peer_free(self) -> bool:
        """Is another model process of this model idle (nothing held, nothing running)?"""
        return self.ctl.model_num > 1 and bool(self._free.any())

    def close(self) -> None:
        self.admission.close()
        if self._helper is not None:
            self._helper.shutdown(wait=True)
        if self._done_r >= 0:
            os.close(self._done_r)
            os.close(self._done_w)
        self.intake.close()
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("%s engine close failed", self.tag, exc_info=True)
        with contextlib.suppress(Exception):
            self.ctl.all_instances[self.me]["free"] = 0
            self.ctl.all_instances[self.me]["state"] = INST_DEAD
        self.acct.close()
        if self._main_fd is not None and self._main_fd >= 0:
            os.close(self._main_fd)
        for view in (self._hdr_words, self._inst_words):
            view.release()
        self.ctl.close()

    def _maintenance(self) -> bool:
        """Drop the slots of detached or exited clients; return False when this process should exit.
        Never run between taking a request and batching it: telling 128 clients' zombies from live
        processes by pid took 2-3 ms, which, paid there, was the p99 of an open loop at low load (H200,
        ResNet-50, 168 img/s: 5.5 ms against 2.2 at p50); their pidfds now say it in one poll()."""
        self._last_maintenance = time.monotonic()
        if self._main_gone():
            logger.warning("%s the runtime's main process died; exiting", self.tag)
            return False
        self.intake.prune()
        return True

    def _main_gone(self) -> bool:
        """Has the runtime's main process exited? Its pidfd says (under forkserver the parent is
        the fork server, not the main process: comparing getppid() killed every process)."""
        if self._main_fd is None:
            return os.getppid() != self.spec.parent_pid
        return self._main_fd < 0 or bool(select.select([self._main_fd], (), (), 0)[0])

    def _register(self, peer: Peer) -> None:
        """A new client slot: page-lock it for DMA where the engine wants that (not a slot of
        mostly unwritten pages: locking them would allocate them, at this process's cost)."""
        if self.engine.wants_mapping:
            try:
                st = os.fstat(peer.seg.fd)
            except OSError:
                return
            if st.st_blocks * 512 >= peer.size // 2 and self.engine.register(peer.base, peer.size):
                peer.registered = peer.base
                peer.on_remap = self._unregister

    def _unregister(self, peer: Peer) -> None:
        if peer.registered:
            self.engine.unregister(peer.registered)
            peer.registered = 0

    def _took(self, req: Request) -> bool:
        """A request arrived: learn from it (arrival rate, turnaround); False if refused (answered), or
        handed back because a reload retired me. Retiring is read here, at each request: a process that
        took one before its next look at the mark answered it with the old version after a new process
        had answered that client's previous request."""
        if self._inst_words[_I_STATE] == INST_RETIRING:
            self.retiring = True   # (and takes no more: _fill, _await_device, _compute_while_taking)
            if self.intake.hand_back(req):   # to the model's socket, for the new processes
                return False
        self._open[id(req)] = req
        peer = req.peer
        if req.seq == peer.answered_seq + 1:  # its last request was answered by me: a sample
            x, t = min(max(req.t_publish - peer.answered_at, 0.0), _TURNAROUND_CAP), self.turnaround
            self.turnaround = x if t is None else t + 0.05 * (x - t)
        self.arrivals.add(req.rows, req.t_seen)
        self._returning.discard(req.pid)   # back: the batch need hold its turn no longer
        self._just_answered.discard(id(peer))
        return self.admission.take(req)

    def _release(self, req: Request) -> None:
        self._open.pop(id(req), None)
        self.intake.release(req)

    # ------------------------------------------------------------ collecting a batch
    def _collect(self, inflight: Optional[_InFlight]) -> Tuple[List[Request], Optional[_InFlight]]:
        """The next batch, and ``inflight`` unless answered here. ``inflight`` is the batch launched before,
        if any: while it is on the device, waiting is free (batching.decide). When it is done and no client
        could add to this batch, it is answered here first: its callers are the ones who can."""
        busy = inflight.launched if inflight is not None else None
        if busy is not None and self._peer_free() and not self.backlog:
            return [], inflight  # an idle peer takes newcomers sooner than my busy device would
        batch: List[Request] = []
        c = _Collecting(limit=self.max_batch)
        self._fill(batch, c)
        if not batch and c.holding:
            self._top_up(batch, c)   # nobody's first turn is waiting
        if not batch:
            return [], inflight
        policy, costs, arrivals, intake = self.policy, self.costs, self.arrivals, self.intake
        while c.rows < c.limit and not self.retiring:
            running = busy is not None and not busy.ready()
            # (busy for batching.decide until the running one should end within our lead: NOTE [pipelining])
            device_busy = running and time.monotonic() < self._device_free_at - self._lead
            may = intake.may_send()
            if busy is not None and not running and may == 0 and not c.waiting:
                self._complete(inflight)  # answer the batch that just finished ...
                inflight = busy = None
                self._fill(batch, c)      # ... and see who comes back
                continue
            if batching.must_close(c.rows, c.limit, c.waiting, may):
                break   # what decide would say, at no cost
            now = time.monotonic()
            if c.holding:   # room held for clients just answered (_expect_returns)
                if not self._returning or now >= self._hold_until or busy is not None and not running:
                    break   # they came back, will not in time, or the device waits
                close, wait = False, self._hold_until - now
            else:
                snap = batching.Snapshot(c.rows, c.oldest, c.waiting, may, device_busy, c.newest,
                                         len(self._just_answered))
                close, wait = batching.decide(snap, now, costs.fit(c.key), arrivals.rate(now), policy,
                                              c.limit, self.turnaround)
            if close or (device_busy and self._peer_free()) or intake.full:
                break
            if device_busy:
                wait = min(wait, _BUSY_POLL)  # check the device now and then while waiting
            # (precise: a kernel timeout oversleeps by ticks -- a 50 us wait the policy chose for an
            # attached client that could send slept 8 ms, each time: helper-48, 10x fewer calls/s)
            got = intake.next(wait, precise=True)
            if isinstance(got, Request):
                if self._took(got):
                    self.backlog.add(got)
                self._fill(batch, c)
            elif got is WAKE and self._hdr_words[_H_STATE] >= STOPPING:
                break
        if c.holding:
            self._top_up(batch, c)
        return self._close(batch, c), inflight

    # ------------------------------------------------------------ one batch
    def _gather(self, batch: List[Request]):
        first = batch[0].layout
        sources = [[(r.peer.base, r.layout.offsets[k], r.nbytes[k], r.peer.registered) for r in batch]
                   for k in range(len(first.items))]
        return self._Gather(sum(r.rows for r in batch), first.items, first.dtypes, sources, first.names)

    def _stage(self, batch: List[Request]) -> _InFlight:
        flight = _InFlight(batch, time.monotonic())
        gather = self._gather(batch)
        try:
            flight.launched = self.engine.stage(gather)
        except Exception as e:  # noqa: BLE001
            flight.error = e
        return flight

    def _start(self, flight: _InFlight) -> None:
        if flight.error is not None:
            return
        try:
            if not self.engine.cuda and self.admission.refuses_early and (
                    self.backlog or self._forward_ema >= _TAKE_WHILE_COMPUTING):
                self._compute_while_taking(flight.launched)
            else:
                self.engine.start(flight.launched)
        except Exception as e:  # noqa: BLE001 - the model's own failure goes to its callers
            flight.error = e
            return
        ln = flight.launched
        if ln.started:
            self._launch_ema = 0.8 * self._launch_ema + 0.2 * ln.launch_cpu
            self._lead = 0.8 * self._lead + 0.2 * (ln.gather + ln.launch_cpu)
            # my batches run in turn on one stream: this one ends a forward pass after the last
            self._device_free_at = max(time.monotonic(), self._device_free_at) + self._forward_ema
            self._show_graphs()

    def _show_graphs(self) -> None:
        """The instance row counts the CUDA graphs in use (captured off the serving thread)."""
        if self.engine.graph_total != self._graphs_shown:
            self._graphs_shown = self.ctl.all_instances[self.me]["graphs"] = self.engine.graph_total

    def _complete(self, flight: _InFlight, wait: bool = False) -> None:
        """Finish a launched batch (``wait``: taking requests in meanwhile, _await_device): check
        its outputs, write each requester's rows, wake them. Returns None (no batch in flight)."""
        if wait:
            self._await_device(flight)
        batch, t_close, error, result = flight.batch, flight.t_close, flight.error, None
        total = sum(r.rows for r in batch)
        self.admission.in_progress -= total
        if error is None:
            try:
                result = self.engine.finish(flight.launched)
                self._forward_ema = 0.8 * self._forward_ema + 0.2 * result.times.forward
                check_outputs(result.outputs, total)
            except Exception as e:  # noqa: BLE001
                error = e
        t_scatter = time.monotonic()
        # counted before its callers wake (Answers.batch): a caller's stats() after its answer includes it
        count = partial(self.acct.count, batch, total)
        self._just_answered = {id(r.peer) for r in batch}   # (taken here only after this returns)
        if error is not None:
            count()   # first: isolating answers (and wakes) parts of the batch as it goes
            self.answers.failure(batch, error, t_close)
        else:
            self.answers.batch(batch, result, t_close, total, count)
        if self.backlog.repeats and not self.engine.cuda:
            self._expect_returns(batch)
        # what the callers do not wait for: the batch's times, histograms and cost sample
        t_end = time.monotonic()
        try:
            if error is None:  # what this batch cost, for the batching policy
                tm = result.times
                self.costs.observe(batch[0].layout.key, total, tm.h2d + tm.forward + tm.d2h
                                   if self.engine.cuda else t_end - t_close)
            self.acct.record(batch, total, t_close, t_scatter, t_end, result)
            self.admission.rate.batch_done(total, t_close, t_end, total >= self.max_batch)  # full: backlogged
            self.admission.publish()
        except Exception:  # noqa: BLE001 - bookkeeping never fails a batch, nor the next one
            if not self._accounting_failed:
                self._accounting_failed = True
                logger.exception("%s accounting a batch failed (logged once)", self.tag)
