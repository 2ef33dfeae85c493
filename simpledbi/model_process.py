"""What runs in a model process: load, warm up, then claim requests, batch them and answer them.

Entry point :func:`model_process_main` is module-level so ``spawn`` can pickle it. The loop::

    sleep on the model's doorbell (timeout: poll_interval, to notice orphaning / stop)
      -> scan the slot table's hints for PUBLISHED, unclaimed rows, oldest item-shape group first
      -> claim each (rdy.trywait), read + validate its header privately (slots.Peer)
      -> until batching.close_decision says close: wait on the doorbell for more
      -> Engine: gather (preadv / DMA) -> forward -> outputs
      -> pwrite each requester's rows and response into its segment, don.post()

Nothing a client writes is trusted (NOTE [slot protocol] in slots.py); each batch runs under one
catch-all that answers its callers with a typed error and keeps serving. When a forward pass
raises for a batch of several requests, the batch is bisected and retried so only the requests
that make the model fail get ``ModelError`` (``ModelConfig.isolate_errors``).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import posix_ipc

from . import batching
from .config import ModelConfig, RuntimeOptions
from .layout import (
    B_FIELDS, COUNTERS, INST_DEAD, INST_READY, MAX_IO, MAX_NDIM, OUT_TENSOR, OUT_TUPLE, PUBLISHED, IDLE, RING,
    ST_BAD_REQUEST, ST_INTERNAL, ST_MODEL_ERROR, ST_OK, ST_STOPPED, STOPPING, ControlBlock, SlotTable,
    doorbell_name, dtype_code,
)
from .shm import open_semaphore
from .slots import BadRequest, Limits, Peer, Request, claim_words, mark_answered, write_claim

logger = logging.getLogger(__name__)
assert B_FIELDS == ("t_close", "rows", "requests", "queue_wait", "gather", "h2d", "forward", "d2h",
                    "scatter", "runtime", "t_end")  # the order _account writes a record in
_C_REQUESTS, _C_BATCHES, _C_ROWS, _C_HEAD = (COUNTERS.fields[n][1] // 8 for n in
                                             ("requests", "batches", "rows", "ring_head"))
_BUSY_POLL = 0.0002  # seconds between device checks while collecting behind a running batch


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


def model_process_main(spec: ModelProcessSpec, conn) -> None:
    """Child entry point. Reports ("ready", info) or ("failed", ...) on ``conn``."""
    os.environ.update(spec.env)  # first: the CUDA driver reads CUDA_MPS_* once, when it initialises
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    try:
        server = ModelServer(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("failed", f"{type(e).__name__}: {_safe_str(e)}", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("ready", {"pid": os.getpid(), "device": str(server.engine.device)}))
    conn.close()
    logger.debug("%s serving on %s", server.tag, server.engine.device)
    try:
        server.serve()
    finally:
        server.close()
    if server.fatal:
        os._exit(3)  # the device context is unusable: let the supervisor start a fresh process


@dataclass
class _InFlight:
    batch: List[Request]
    t_close: float
    gather: object = None
    launched: object = None
    error: Optional[BaseException] = None


class ModelServer:
    """The state of one model process: control block, slot table, engine, the slots it knows."""

    def __init__(self, spec: ModelProcessSpec):
        from .engine import Engine  # torch is imported only in model processes
        self.spec = spec
        self.cfg = cfg = spec.config
        self.me = spec.instance
        self.pid = os.getpid()
        self.tag = f"<{cfg.name}|{self.me}>"
        self.poll = spec.options.poll_interval
        self.ctl = ControlBlock.attach(spec.namespace, cfg.name, readonly=False)
        self.table = SlotTable.attach(spec.namespace, cfg.name, self.ctl.max_slots)
        self.door = open_semaphore(doorbell_name(spec.namespace, cfg.name))
        inst = self.ctl.instances[self.me]
        inst["pid"], inst["t_start"] = self.pid, time.time()
        self.engine = Engine(cfg, self.me, spec.cpu_model_procs)
        dev = self.engine.device
        inst["device"] = -1 if dev.type == "cpu" else (dev.index or 0)
        self.max_batch = int(cfg.max_batch_size)
        self.wait_time = float(cfg.wait_time)
        dtypes = None
        if cfg.input_shapes and cfg.input_dtypes:
            dtypes = tuple(np.dtype(d) for d in cfg.input_dtypes)
        self.limits = Limits(self.max_batch, len(cfg.input_shapes) if cfg.input_shapes else None, dtypes)
        self.peers: Dict[int, Peer] = {}
        self.deferred: List[Request] = []      # claimed by me, not batched yet (other shape / no room)
        self._open: Dict[int, Request] = {}    # id -> every request claimed and not answered yet
        self.retired: set = set()              # replaced peers that still owe answers
        self._failed: Dict[int, int] = {}      # slot -> seq hint whose claim failed: don't retry it
        self.claim_seq, self.claim_token = self.ctl.claims["seq"], self.ctl.claims["token"]
        self.claim_done = self.ctl.claims["done"]
        self.claim_words = claim_words(self.ctl)
        self.counters = self.ctl.counters[self.me]
        self.count_words = self.ctl.counters.view(np.int64).reshape(self.ctl.model_num, -1)[self.me]
        self.fatal = False
        self._launch_ema = 0.0    # host seconds to enqueue a forward pass (EMA)
        self._forward_ema = 0.0   # device seconds of a forward pass (EMA)
        if cfg.input_shapes:
            in_dtypes = cfg.input_dtypes or ("float32",) * len(cfg.input_shapes)
            self.engine.warm_up(cfg.input_shapes, in_dtypes, sorted({self.max_batch, 1}, reverse=True))
            sizes = cfg.graph_batch_sizes()
            if sizes and self.engine.cuda:
                try:
                    self.engine.capture_graphs(cfg.input_shapes, in_dtypes, sizes)
                except Exception:
                    if cfg.cuda_graphs != "auto":
                        raise
                    logger.warning("%s CUDA graph capture failed; running eagerly", self.tag,
                                   exc_info=True)
        self._last_maintenance = time.monotonic()
        inst["state"] = INST_READY

    # ------------------------------------------------------------ main loop
    def serve(self) -> None:
        import torch
        with torch.inference_mode():  # once for the whole loop, not per batch
            self._serve()

    def _serve(self) -> None:
        """NOTE [pipelining]: on CUDA, batch k+1 is collected while batch k runs on the device
        (it closes early if the device goes idle), and its host->device copies are enqueued on a
        separate stream at once. Then either k is answered and k+1's forward launched, or -- when
        launching is cheap next to the device time (CUDA graphs, big batches) -- k+1's forward is
        launched first so the device never waits. At most two batches are unfinished at any time
        (two buffer sets); on the CPU every batch is computed and answered in turn.

        Every step runs under a catch-all: whatever goes wrong fails the requests it concerns
        with a typed error, and the loop goes on."""
        inflight: Optional[_InFlight] = None
        while not self.fatal:
            try:
                if int(self.ctl.hdr["state"]) >= STOPPING:
                    break
                batch = self._collect(inflight.launched if inflight else None)
                if batch:
                    nxt = self._stage(batch)  # copies in on the copy stream, behind nothing
                    if inflight is not None and (inflight.launched.ready() or not self._pipeline_forward()):
                        done, inflight = inflight, None
                        self._complete(done)  # answer k before spending time launching k+1
                    self._start(nxt)
                    if inflight is not None:
                        done, inflight = inflight, None
                        self._complete(done)
                    if nxt.error is None and nxt.launched.result is None:
                        inflight = nxt  # device work enqueued: finish it next round
                    else:
                        self._complete(nxt)
                    if time.monotonic() - self._last_maintenance > self.poll and not self._maintenance():
                        break
                    continue
                if inflight is not None:
                    done, inflight = inflight, None
                    self._complete(done)
                    continue
                try:
                    self.door.acquire(self.poll)
                except posix_ipc.BusyError:
                    if not self._maintenance():
                        break
            except Exception as e:  # noqa: BLE001 - the catch-all: nothing stops this loop
                logger.exception("%s internal error; failing the requests concerned", self.tag)
                inflight = None
                self.engine.quiesce()
                deferred = {id(r) for r in self.deferred}
                self._fail([r for r in self._open.values() if id(r) not in deferred], ST_INTERNAL,
                           f"{type(e).__name__}\nsimpledbi internal error: {_safe_str(e)}\n"
                           f"{traceback.format_exc()}")
        if inflight is not None:
            try:
                self._complete(inflight)
            except Exception:  # noqa: BLE001
                logger.exception("%s finishing the last batch failed", self.tag)
        self._fail(list(self._open.values()), ST_STOPPED, "the model process is stopping")

    def close(self) -> None:
        for peer in list(self.peers.values()) + list(self.retired):
            self.engine.unregister(peer.mapping[1] if peer.mapping else 0)
            peer.close()
        self.peers.clear()
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("%s engine close failed", self.tag, exc_info=True)
        try:
            self.ctl.instances[self.me]["state"] = INST_DEAD
        except Exception:  # noqa: BLE001
            pass
        self.door.close()
        self.table.close()
        self.ctl.close()

    def _maintenance(self) -> bool:
        """Drop handles of detached clients; return False when this process should exit."""
        self._last_maintenance = time.monotonic()
        if os.getppid() != self.spec.parent_pid:
            logger.warning("%s parent died; exiting", self.tag)
            return False
        state, token = self.table.state, self.table.token
        for slot, peer in list(self.peers.items()):
            if (state[slot] == 0 or token[slot] != peer.token) and not peer.inflight:
                self._drop_peer(slot)
        self._failed.clear()  # a failed claim is not retried within one poll interval, no longer
        return True

    # ------------------------------------------------------------ claiming
    def _drain_doorbell(self) -> None:
        try:
            while True:
                self.door.acquire(0)
        except posix_ipc.BusyError:
            pass

    def _drop_peer(self, slot: int) -> None:
        peer = self.peers.pop(slot, None)
        if peer is not None:
            self._close_peer(peer)

    def _close_peer(self, peer: Peer) -> None:
        """Close a peer -- or, while requests it carries are still unanswered, retire it: its
        descriptors stay open until the last of them is answered."""
        if peer.inflight:
            self.retired.add(peer)
            return
        self.retired.discard(peer)
        if peer.mapping is not None:
            self.engine.unregister(peer.mapping[1])
        peer.close()

    def _peer(self, slot: int, token: int) -> Optional[Peer]:
        peer = self.peers.get(slot)
        if peer is not None and peer.token == token:
            return peer
        try:  # the new one must open before the old one goes: a forged token opens nothing
            new = Peer(self.spec.namespace, self.cfg.name, slot, token)
        except (posix_ipc.Error, OSError, ValueError):
            return None  # gone (detached), or a hint that names nothing
        self._drop_peer(slot)
        if self.engine.wants_mapping:
            m = new.map()
            if m is not None and not self.engine.register(*m):
                new.mapping[0].close()
                new.mapping = None
        self.peers[slot] = new
        return new

    def _pending(self) -> np.ndarray:
        """Slots whose hints say: a request is published and nobody has claimed it."""
        t = self.table
        pend = np.flatnonzero(t.state == PUBLISHED)
        if pend.size:
            seqs = t.seq[pend]
            mine = (self.claim_seq[pend] == seqs) & (self.claim_token[pend] == t.token[pend])
            pend = pend[~mine]
            if self._failed and pend.size:
                failed = self._failed
                pend = np.array([s for s, k, q in zip(pend.tolist(), t.token[pend].tolist(),
                                                      t.seq[pend].tolist())
                                 if failed.get(s) != (k, q)], dtype=np.int64)
        return pend

    def _claim(self, slot: int, now: float) -> Optional[Request]:
        t = self.table
        token, seq_hint = int(t.token[slot]), int(t.seq[slot])
        peer = self._peer(slot, token)
        if peer is None or not peer.try_claim():
            self._failed[slot] = (token, seq_hint)  # this attach's request: not again this interval
            return None
        peer.inflight += 1
        try:
            req = peer.read_request(self.limits, seq_hint, now)
        except BadRequest as e:
            write_claim(self.claim_words, slot, token, e.seq, self.me, self.pid)
            peer.inflight -= 1
            self._reject(peer, e.seq, str(e))
            return None
        write_claim(self.claim_words, slot, token, req.seq, self.me, self.pid)
        if peer.mapping is not None:
            req.mapped = peer.mapping
        self._open[id(req)] = req
        return req

    def _reject(self, peer: Peer, seq: int, text: str) -> None:
        self.counters["bad_requests"] += 1
        if not peer.warned:
            peer.warned = True
            logger.warning("%s rejected a request of slot %d: %s", self.tag, peer.slot, text)
        peer.respond(seq, ST_BAD_REQUEST, text, claimer=self.me)

    def _fill(self, batch: List[Request], state: dict) -> int:
        """Add requests to ``batch``: first ones I already claimed (oldest first), then newly
        published ones of the batch's item shape. Returns the rows added."""
        added = 0
        room = self.max_batch - state["rows"]
        if self.deferred and room > 0:
            self.deferred.sort(key=lambda r: r.t_publish)
            if state["key"] is None:
                state["key"] = self.deferred[0].key
            keep = []
            for r in self.deferred:
                if r.key == state["key"] and r.rows <= room - added:
                    batch.append(r)
                    added += r.rows
                else:
                    keep.append(r)
            self.deferred = keep
        room -= added
        if room <= 0:
            return added
        t = self.table
        pend = self._pending()
        now = time.monotonic()
        while pend.size and room > 0:
            if pend.size == 1:
                order, target = pend, None
            else:
                keys = t.key[pend]
                if state["key"] is None:
                    target = keys[int(np.argmin(t.t_publish[pend]))]
                    group = pend[keys == target]
                else:
                    target, group = None, pend
                order = group[np.argsort(t.t_publish[group], kind="stable")] if group.size > 1 else group
            got = 0
            # rows hints are clipped: a lying hint must not block the requests behind it
            hinted = np.minimum(np.maximum(t.nrows[order], 1), self.max_batch)
            for slot in batching.take_fitting(order, hinted, room, indexed=False):
                req = self._claim(slot, now)
                if req is None:
                    continue
                if state["key"] is None:
                    state["key"] = req.key
                if req.key == state["key"] and req.rows <= room:
                    batch.append(req)
                    room -= req.rows
                    added += req.rows
                    got += 1
                else:
                    self.deferred.append(req)  # a hint that lied about its shape or size
            if got or target is None:
                break
            pend = pend[keys != target]  # that group's hints were stale: try the next group
        return added

    def _collect(self, busy=None) -> List[Request]:
        """Claim the next batch. ``busy`` is the launched batch still on the device, if any:
        then the batch also closes as soon as the device is free (it would otherwise idle)."""
        self._drain_doorbell()
        batch: List[Request] = []
        state = {"key": None, "rows": 0}
        state["rows"] += self._fill(batch, state)
        if not batch:
            return []
        oldest = min(r.t_publish for r in batch)
        t = self.table
        while True:
            if state["rows"] >= self.max_batch:
                break
            more = self._may_send()
            if more:  # ... unless a request of our shape is already waiting: it did not fit
                pend = self._pending()
                more = not (pend.size and bool(np.any(t.key[pend] == state["key"])))
            close, wait = batching.close_decision(state["rows"], self.max_batch, oldest,
                                                  time.monotonic(), self.wait_time, more)
            if close or (busy is not None and busy.ready()):
                break
            if busy is not None:
                wait = min(wait, _BUSY_POLL)  # check the device now and then while waiting
            try:
                self.door.acquire(wait)
                self._drain_doorbell()
            except posix_ipc.BusyError:
                pass
            state["rows"] += self._fill(batch, state)
        if self.ctl.model_num > 1 and self._pending().size:
            self.door.release()  # leftovers (other shapes, no room): wake a peer process
        return batch

    def _may_send(self) -> bool:
        """Could some attached client send a request now? Those with none in flight (IDLE), and
        those whose answer is written but not read yet (they are about to send again)."""
        t = self.table
        states = t.state
        if (states == IDLE).any():
            return True
        pub = states == PUBLISHED
        return bool(np.any(pub & (self.claim_done == t.seq) & (self.claim_token == t.token)))

    # ------------------------------------------------------------ one batch
    def _gather(self, batch: List[Request]):
        from .engine import Gather
        first = batch[0]
        sources = [[(r.peer.fd, r.offsets[k], r.nbytes[k],
                     r.mapped[1] if r.mapped and r.offsets[k] + r.nbytes[k] <= r.mapped[2] else 0)
                    for r in batch] for k in range(len(first.items))]
        return Gather(sum(r.rows for r in batch), first.items, first.dtypes, sources)

    def _stage(self, batch: List[Request]) -> _InFlight:
        flight = _InFlight(batch, time.monotonic(), self._gather(batch))
        try:
            flight.launched = self.engine.stage(flight.gather)
        except Exception as e:  # noqa: BLE001
            flight.error = e
        return flight

    def _start(self, flight: _InFlight) -> None:
        if flight.error is not None:
            return
        try:
            self.engine.start(flight.launched)
        except Exception as e:  # noqa: BLE001 - the model's own failure goes to its callers
            flight.error = e
            return
        ln = flight.launched
        if ln.started:
            self._launch_ema = 0.8 * self._launch_ema + 0.2 * ln.launch_cpu

    def _pipeline_forward(self) -> bool:
        """Launch batch k+1's forward before answering batch k? Only when launching is cheap next
        to the device time it overlaps (CUDA graphs, or large batches): in a launch-bound model,
        launching first would make k's callers wait a whole launch for nothing."""
        return self._launch_ema < 0.5 * self._forward_ema

    def _complete(self, flight: _InFlight) -> None:
        """Finish a launched batch: check its outputs, write each requester's rows, wake them."""
        batch, t_close, error, result = flight.batch, flight.t_close, flight.error, None
        total = sum(r.rows for r in batch)
        if error is None:
            try:
                result = self.engine.finish(flight.launched)
                self._forward_ema = 0.8 * self._forward_ema + 0.2 * result.times.forward
                _check_outputs(result.outputs, total)
            except Exception as e:  # noqa: BLE001
                error = e
        t_scatter = time.monotonic()
        short = flight.gather.short
        if error is not None:
            self._on_failure(batch, error, t_close)
        else:
            self._answer(batch, result, t_close, total, short)
        t_end = time.monotonic()
        self._account(batch, total, t_close, t_scatter, t_end, result, error is not None)

    def _answer(self, batch: List[Request], result, t_close: float, total: int, short=()) -> None:
        structure = OUT_TUPLE if result.is_tuple else OUT_TENSOR
        offset = 0
        for i, r in enumerate(batch):
            if i in short:
                self._respond(r, ST_BAD_REQUEST, "the request's input could not be read in full "
                              "(its slot's segment was truncated)", t_close=t_close, total=total)
            else:
                outs = [o[offset:offset + r.rows] for o in result.outputs]
                self._respond(r, ST_OK, "", outs, structure, t_close, total)
            offset += r.rows

    def _on_failure(self, batch: List[Request], error: BaseException, t_close: float) -> None:
        """A batch failed: bisect it to find the requests that make the model fail (if isolation
        is on and there is more than one request), answer the others normally."""
        fatal = self.engine.cuda and _is_cuda_fatal(error)
        if fatal or len(batch) == 1 or not self.cfg.isolate_errors:
            text = _error_text(error)
            logger.error("%s forward failed for a batch of %d requests (%d rows): %s", self.tag,
                         len(batch), sum(r.rows for r in batch), text.split("\n", 2)[1][:200])
            self._fail(batch, ST_MODEL_ERROR, text)
            self.counters["errors"] += len(batch)
            if fatal:
                logger.error("%s the CUDA context is broken; exiting to be restarted", self.tag)
                self.fatal = True
            return
        self.counters["isolated"] += 1
        culprits = self._bisect(batch, t_close)
        logger.error("%s forward failed for a batch of %d requests; isolated %d culprit(s)",
                     self.tag, len(batch), culprits)

    def _bisect(self, batch: List[Request], t_close: float) -> int:
        """Retry halves of ``batch`` until each request is answered; returns the culprits."""
        culprits, todo = 0, [batch[:len(batch) // 2], batch[len(batch) // 2:]]
        while todo:
            part = todo.pop()
            if not part:
                continue
            total = sum(r.rows for r in part)
            try:
                g = self._gather(part)
                result = self.engine.run_simple(g)
                _check_outputs(result.outputs, total)
            except Exception as e:  # noqa: BLE001
                if len(part) == 1:
                    self._fail(part, ST_MODEL_ERROR, _error_text(e))
                    self.counters["errors"] += 1
                    culprits += 1
                else:
                    todo += [part[:len(part) // 2], part[len(part) // 2:]]
                continue
            self._answer(part, result, t_close, total, g.short)
        return culprits

    def _fail(self, requests: List[Request], status: int, text: str) -> None:
        for r in requests:
            if not r.answered:
                self._respond(r, status, text)

    def _respond(self, r: Request, status: int, text: str = "", outs=(), structure: int = 0,
                 t_close: float = 0.0, total: int = 0) -> None:
        if r.answered:
            return
        r.answered = True
        self._open.pop(id(r), None)
        r.peer.inflight -= 1
        try:
            r.peer.respond(r.seq, status, text, outs, r.out_offset, structure, self.me, t_close, total)
            mark_answered(self.claim_words, r.slot, r.seq)
        except Exception:  # noqa: BLE001 - a closed peer: its client is gone
            logger.debug("%s answering slot %d failed", self.tag, r.slot, exc_info=True)
        if r.peer in self.retired and not r.peer.inflight:
            self._close_peer(r.peer)

    def _account(self, batch, total, t_close, t_scatter, t_end, result, failed) -> None:
        c = self.count_words  # int64 words of this instance's COUNTERS record
        c[_C_REQUESTS] += len(batch)
        c[_C_BATCHES] += 1
        c[_C_ROWS] += total
        head = int(c[_C_HEAD])
        times = result.times if result is not None else None
        # The runtime's own work on this batch: copy in (issue and DMA overlap), copy out, scatter
        # and wake. Not wall time minus forward: with pipelining, a batch also waits for the one
        # ahead of it on the device, which is neither its forward nor the runtime's cost.
        own = max(times.gather, times.h2d) + times.d2h if times else 0.0
        queue_wait = t_close - sum(r.t_publish for r in batch) / len(batch)
        self.ctl.ring[self.me, head % RING] = (  # in the order of layout.B_FIELDS
            t_close, total, len(batch), queue_wait, times.gather if times else 0.0,
            times.h2d if times else 0.0, times.forward if times else 0.0,
            times.d2h if times else 0.0, t_end - t_scatter, own + (t_end - t_scatter), t_end)
        c[_C_HEAD] = head + 1


def _check_outputs(outputs, total: int) -> None:
    """Outputs must split back into per-request rows and fit the response layout."""
    from .engine import BadModelOutput
    if len(outputs) > MAX_IO:
        raise BadModelOutput(f"the model returned {len(outputs)} outputs; at most {MAX_IO} are supported")
    for j, o in enumerate(outputs):
        if o.ndim == 0 or o.shape[0] != total:
            raise BadModelOutput(f"output {j} has shape {tuple(o.shape)}: expected {total} rows (the "
                                 f"batch dimension first), got {o.shape[0] if o.ndim else 'a scalar'}")
        if o.ndim > MAX_NDIM + 1:
            raise BadModelOutput(f"output {j} has {o.ndim} dimensions; at most {MAX_NDIM + 1} "
                                 f"(rows + {MAX_NDIM}) are supported")
        try:
            dtype_code(o.dtype)
        except TypeError as e:
            raise BadModelOutput(f"output {j}: {e}") from None


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        return f"<{type(e).__name__} whose message could not be formatted>"


def _error_text(e: BaseException) -> str:
    try:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # noqa: BLE001
        tb = ""
    return f"{type(e).__name__}\n{_safe_str(e)}\n{tb}"


def _is_cuda_fatal(e: BaseException) -> bool:
    """Errors after which the CUDA context cannot be used again (a device-side assert, an
    illegal address): the process must be replaced."""
    text = _safe_str(e)
    return isinstance(e, RuntimeError) and ("device-side assert" in text or "illegal memory access" in text
                                            or "CUDA error: an illegal" in text)
