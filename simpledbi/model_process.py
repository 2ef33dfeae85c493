"""What runs in a model process: load, warm up, then gather ready slots into batches and serve them.

Entry point :func:`model_process_main` is module-level so ``spawn`` can pickle it. The loop::

    sleep on the model's doorbell (timeout: poll_interval, to notice orphaning / stop)
      -> scan the slot table (numpy) for PUBLISHED slots, oldest item-shape group first
      -> claim each with ready[s].trywait()            (see NOTE [slot protocol] in slots.py)
      -> until batching.close_decision says close: wait on the doorbell for more
      -> Engine.run: gather -> forward -> outputs
      -> write each requester's rows into its output segment, response header, done[s].post()
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import posix_ipc

from . import batching
from .config import ModelConfig, RuntimeOptions
from .shm import Segment, open_semaphore
from .slots import (
    B_FIELDS, C_BATCHES, C_ERRORS, C_REQUESTS, C_RING_HEAD, C_ROWS, CLAIMED, DONE, F_BATCH_ROWS,
    F_CLOSE, F_DONE, F_PUBLISH, FLAG_PROBE, I_DEVICE, I_PID, I_STATE, IDLE, INST_DEAD, INST_READY,
    MAX_IO, N_SPEC, P_CLAIMER, P_DESC, P_NOUT, P_OUT_BYTES, P_SEQ, P_STATUS, P_TUPLE, PUBLISHED,
    R_FLAGS, R_NIN, R_ROWS, R_SEQ, RING, ST_BAD_REQUEST, ST_MODEL_ERROR, ST_OK,
    STOPPING, T_ATTACHED, T_CLAIMER, T_GEN, T_KEY, T_ROWS, T_STATE, ControlBlock, SlotViews,
    ctl_name, desc_view, doorbell_name, dtype_code, read_desc, sem_name, shape_key, slot_name,
    write_desc, R_DESC, DESC_WORDS, H_STATE,
)

logger = logging.getLogger(__name__)
_FIELD = {name: i for i, name in enumerate(B_FIELDS)}


@dataclass(frozen=True)
class ModelProcessSpec:
    """Everything one model process needs, in one picklable object."""

    namespace: str
    config: ModelConfig
    instance: int
    options: RuntimeOptions
    parent_pid: int
    cpu_model_procs: int = 1


def model_process_main(spec: ModelProcessSpec, conn) -> None:
    """Child entry point. Reports ("ready", info) or ("failed", traceback) on ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    faulthandler.enable()
    tag = f"<{spec.config.name}|{spec.instance}>"
    try:
        server = ModelServer(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("ready", {"pid": os.getpid(), "device": str(server.engine.device)}))
    conn.close()
    logger.debug("%s serving on %s", tag, server.engine.device)
    try:
        server.serve()
    finally:
        server.close()


class _Peer:
    """A model process's handles on one attached client slot (one generation of it)."""

    def __init__(self, namespace: str, model: str, slot: int, gen: int, engine):
        self.slot, self.gen = slot, gen
        self.in_seg = Segment(slot_name(namespace, model, slot, gen, "in"), 0, create=False)
        self.out_seg: Optional[Segment] = None
        self.out_name = slot_name(namespace, model, slot, gen, "out")
        self.views = SlotViews(self.in_seg)
        self.ready = open_semaphore(sem_name(namespace, model, slot, "rdy"))
        self.done = open_semaphore(sem_name(namespace, model, slot, "don"))
        n_in = int(self.views.words[R_NIN])
        self.inputs = [read_desc(desc_view(self.views.words, R_DESC, k)) for k in range(n_in)]
        self._views: Dict[tuple, np.ndarray] = {}
        self._out_views: Dict[tuple, np.ndarray] = {}
        self.regions: Dict[int, Tuple[int, int]] = {}  # output j -> (offset, capacity)
        self.address = self.in_seg.address()
        self.registered = engine.register(self.address, self.in_seg.size)

    def request_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        w = self.views.words
        shapes = []
        for k in range(len(self.inputs)):
            base = R_DESC + k * DESC_WORDS
            ndim = int(w[base + 1])
            shapes.append(tuple(w[base + 4: base + 4 + ndim].tolist()))
        return tuple(shapes)

    def input_view(self, k: int, rows: int, item: Tuple[int, ...]) -> np.ndarray:
        view = self._views.get((k, rows, item))
        if view is None:
            dtype, _, offset, _ = self.inputs[k]
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[(k, rows, item)] = self.in_seg.ndarray(offset, dtype, (rows, *item))
        return view

    def output_view(self, j: int, offset: int, dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
        view = self._out_views.get((j, dtype, shape))
        if view is None:
            if self.out_seg is None:
                self.out_seg = Segment(self.out_name, int(self.views.words[P_OUT_BYTES]), create=False)
            if len(self._out_views) > 256:
                self._out_views.clear()
            view = self._out_views[(j, dtype, shape)] = self.out_seg.ndarray(offset, dtype, shape)
        return view

    def close(self, engine) -> None:
        engine.unregister(self.address)
        self._views.clear()
        self._out_views.clear()
        self.views.release()
        self.in_seg.close()
        if self.out_seg is not None:
            self.out_seg.close()
        self.ready.close()
        self.done.close()


_BUSY_POLL = 0.0002  # seconds between device checks while collecting behind a running batch


@dataclass
class _Request:
    slot: int
    peer: _Peer
    rows: int
    shapes: Tuple[Tuple[int, ...], ...]
    flags: int
    t_publish: float


@dataclass
class _InFlight:
    batch: List["_Request"]
    t_close: float
    launched: object = None
    error: Optional[Tuple[int, str]] = None


class ModelServer:
    """The state of one model process: control block, engine and the client slots it has seen."""

    def __init__(self, spec: ModelProcessSpec):
        from .engine import Engine  # torch is imported only in model processes
        self.spec = spec
        self.cfg = spec.config
        self.me = spec.instance
        self.poll = spec.options.poll_interval
        self.ctl = ControlBlock.attach(ctl_name(spec.namespace, self.cfg.name))
        self.door = open_semaphore(doorbell_name(spec.namespace, self.cfg.name))
        self.ctl.instances[self.me, I_PID] = os.getpid()
        self.engine = Engine(self.cfg, self.me, spec.cpu_model_procs)
        dev = self.engine.device
        self.ctl.instances[self.me, I_DEVICE] = -1 if dev.type == "cpu" else (dev.index or 0)
        self.peers: Dict[int, _Peer] = {}
        self.max_batch = int(self.cfg.max_batch_size)
        self.wait_time = float(self.cfg.wait_time)
        self._spec_next = 0
        self._launch_ema = 0.0    # host seconds to enqueue a forward pass (EMA)
        self._forward_ema = 0.0   # device seconds of a forward pass (EMA)
        if self.cfg.input_shapes:
            dtypes = self.cfg.input_dtypes or ("float32",) * len(self.cfg.input_shapes)
            result = self.engine.warm_up(self.cfg.input_shapes, dtypes,
                                         sorted({self.max_batch, 1}, reverse=True))
            key = shape_key([dtype_code(d) for d in dtypes], self.cfg.input_shapes, 0)
            self._record_spec(key, result.outputs, result.is_tuple)
            sizes = self.cfg.graph_batch_sizes()
            if sizes and self.engine.cuda:
                try:
                    self.engine.capture_graphs(self.cfg.input_shapes, dtypes, sizes)
                except Exception:
                    if self.cfg.cuda_graphs != "auto":
                        raise
                    logger.warning("<%s|%d> CUDA graph capture failed; running eagerly",
                                   self.cfg.name, self.me, exc_info=True)
        self._last_maintenance = time.monotonic()
        self.ctl.instances[self.me, I_STATE] = INST_READY

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
        (two buffer sets); on the CPU every batch is computed and answered in turn."""
        inflight: Optional[_InFlight] = None
        try:
            while True:
                if int(self.ctl.header[H_STATE]) >= STOPPING:
                    break
                batch = self._collect(inflight.launched if inflight else None)
                if batch:
                    nxt = self._stage(batch)  # copies in on the copy stream, behind nothing
                    if inflight is not None and (inflight.launched.ready() or not self._pipeline_forward(nxt)):
                        self._complete(inflight)  # answer k before spending time launching k+1
                        inflight = None
                    self._start(nxt)
                    if inflight is not None:
                        self._complete(inflight)
                        inflight = None
                    if nxt.error is None and nxt.launched.result is None:
                        inflight = nxt  # device work enqueued: finish it next round
                    else:
                        self._complete(nxt)
                    if time.monotonic() - self._last_maintenance > self.poll:
                        if not self._maintenance():
                            break
                    continue
                if inflight is not None:
                    self._complete(inflight)
                    inflight = None
                    continue
                try:
                    self.door.acquire(self.poll)
                except posix_ipc.BusyError:
                    if not self._maintenance():
                        break
        finally:
            if inflight is not None:
                self._complete(inflight)

    def close(self) -> None:
        for peer in self.peers.values():
            try:
                peer.close(self.engine)
            except Exception:  # noqa: BLE001 - best effort at exit
                logger.debug("closing slot %d failed", peer.slot, exc_info=True)
        self.peers.clear()
        self.engine.close()
        try:
            self.ctl.instances[self.me, I_STATE] = INST_DEAD
        except Exception:  # noqa: BLE001
            pass
        self.door.close()
        self.ctl.close()

    def _maintenance(self) -> bool:
        """Drop handles of detached clients; return False when this process should exit."""
        self._last_maintenance = time.monotonic()
        if os.getppid() != self.spec.parent_pid:
            logger.warning("<%s|%d> parent died; exiting", self.cfg.name, self.me)
            return False
        table = self.ctl.table
        for slot, peer in list(self.peers.items()):
            if table[T_GEN, slot] != peer.gen or not table[T_ATTACHED, slot]:
                del self.peers[slot]
                peer.close(self.engine)
        return True

    # ------------------------------------------------------------ batching
    def _drain_doorbell(self) -> None:
        try:
            while True:
                self.door.acquire(0)
        except posix_ipc.BusyError:
            pass

    def _peer(self, slot: int) -> Optional[_Peer]:
        gen = int(self.ctl.table[T_GEN, slot])
        peer = self.peers.get(slot)
        if peer is not None and peer.gen == gen:
            return peer
        if peer is not None:
            del self.peers[slot]
            peer.close(self.engine)
        try:
            peer = _Peer(self.spec.namespace, self.cfg.name, slot, gen, self.engine)
        except (posix_ipc.ExistentialError, OSError, ValueError):
            return None  # the client went away between publish and now
        self.peers[slot] = peer
        return peer

    def _claim(self, order: np.ndarray, room: int, batch: List[_Request]) -> int:
        """Claim requests of ``order`` (one key group, oldest first) that fit in ``room`` rows."""
        table = self.ctl.table
        taken = 0
        for slot in batching.take_fitting(order, table[T_ROWS], room):
            peer = self._peer(slot)
            if peer is None:
                continue
            try:
                peer.ready.acquire(0)  # the claim: only one process can win it
            except posix_ipc.BusyError:
                continue
            w = peer.views.words
            rows, flags = int(w[R_ROWS]), int(w[R_FLAGS])
            shapes = peer.request_shapes()
            if (batch and (shapes != batch[0].shapes or flags != batch[0].flags)) or rows > room - taken:
                # The hint was stale (the client withdrew and republished): hand it back.
                peer.ready.release()
                self.door.release()
                continue
            table[T_CLAIMER, slot] = self.me
            table[T_STATE, slot] = CLAIMED
            w[P_CLAIMER] = self.me
            batch.append(_Request(slot, peer, rows, shapes, flags, float(peer.views.floats[F_PUBLISH])))
            taken += rows
        return taken

    def _collect(self, busy=None) -> List[_Request]:
        """Claim the next batch. ``busy`` is the launched batch still on the device, if any:
        then the batch also closes as soon as the device is free (it would otherwise idle)."""
        self._drain_doorbell()
        table, t_pub = self.ctl.table, self.ctl.t_publish
        pending = np.flatnonzero(table[T_STATE] == PUBLISHED)
        if pending.size == 0:
            return []
        key, order = batching.oldest_group(pending, table[T_KEY], t_pub)
        batch: List[_Request] = []
        rows = self._claim(order, self.max_batch, batch)
        if not batch:
            return []
        oldest = min(r.t_publish for r in batch)
        probe = bool(batch[0].flags & FLAG_PROBE)
        while not probe:
            states = table[T_STATE]
            same = np.flatnonzero((states == PUBLISHED) & (table[T_KEY] == key))
            if same.size:  # newcomers of our shape: take what fits
                order = same[np.argsort(t_pub[same], kind="stable")]
                rows += self._claim(order, self.max_batch - rows, batch)
                states = table[T_STATE]
                same = np.flatnonzero((states == PUBLISHED) & (table[T_KEY] == key))
            # A same-shape request still waiting did not fit: the batch is as full as it gets.
            more = same.size == 0 and batching.more_can_arrive(states, (IDLE, DONE))
            close, wait = batching.close_decision(rows, self.max_batch, oldest, time.monotonic(),
                                                  self.wait_time, more)
            if close or (busy is not None and busy.ready()):
                break
            if busy is not None:
                wait = min(wait, _BUSY_POLL)  # check the device now and then while waiting
            try:
                self.door.acquire(wait)
                self._drain_doorbell()
            except posix_ipc.BusyError:
                pass
        if self.ctl.model_num > 1 and np.any(table[T_STATE] == PUBLISHED):
            self.door.release()  # leftovers (other shapes, no room): wake a peer process
        return batch

    # ------------------------------------------------------------ one batch
    def _stage(self, batch: List[_Request]) -> "_InFlight":
        t_close = time.monotonic()
        n_in = len(batch[0].shapes)
        parts = [[r.peer.input_view(k, r.rows, r.shapes[k]) for r in batch] for k in range(n_in)]
        flight = _InFlight(batch, t_close)
        try:
            flight.launched = self.engine.stage(parts, [r.peer.registered for r in batch])
        except Exception as e:  # noqa: BLE001
            flight.error = self._model_failed(e, batch)
        return flight

    def _start(self, flight: "_InFlight") -> None:
        if flight.error is not None:
            return
        try:
            self.engine.start(flight.launched)
        except Exception as e:  # noqa: BLE001 - the model's own failure goes to its callers
            flight.error = self._model_failed(e, batch=flight.batch)
            return
        ln = flight.launched
        if ln.started:
            self._launch_ema = 0.8 * self._launch_ema + 0.2 * ln.launch_cpu

    def _pipeline_forward(self, nxt: "_InFlight") -> bool:
        """Launch batch k+1's forward before answering batch k? Only when launching is cheap next
        to the device time it overlaps (CUDA graphs, or large batches): in a launch-bound model,
        launching first would make k's callers wait a whole launch for nothing."""
        return self._launch_ema < 0.5 * self._forward_ema

    def _model_failed(self, e: BaseException, batch) -> Tuple[int, str]:
        logger.exception("<%s|%d> forward failed for a batch of %d requests (%d rows)",
                         self.cfg.name, self.me, len(batch), sum(r.rows for r in batch))
        return ST_MODEL_ERROR, f"{type(e).__name__}\n{e}\n{traceback.format_exc()}"

    def _complete(self, flight: "_InFlight") -> None:
        """Finish a launched batch: check its outputs, write each requester's rows, wake them."""
        batch, t_close, error, result = flight.batch, flight.t_close, flight.error, None
        total = sum(r.rows for r in batch)
        if error is None:
            try:
                result = self.engine.finish(flight.launched)
                self._forward_ema = 0.8 * self._forward_ema + 0.2 * result.times.forward
                for j, o in enumerate(result.outputs):
                    if o.ndim == 0 or o.shape[0] != total:
                        raise ValueError(f"output {j} has shape {tuple(o.shape)}: expected {total} rows "
                                         f"(the batch dimension first), got "
                                         f"{o.shape[0] if o.ndim else 'a scalar'}")
                if len(result.outputs) > MAX_IO:
                    raise ValueError(f"the model returned {len(result.outputs)} outputs; at most "
                                     f"{MAX_IO} are supported")
            except Exception as e:  # noqa: BLE001
                error = self._model_failed(e, batch)
        t_scatter = time.monotonic()
        probe = bool(batch[0].flags & FLAG_PROBE)
        if probe and error is None:
            first = batch[0]
            key = shape_key([dtype_code(dt) for dt, _, _, _ in first.peer.inputs], first.shapes, 0)
            self._record_spec(key, [o[:1] for o in result.outputs], result.is_tuple)
        offset = 0
        for r in batch:
            status, text = error if error is not None else (ST_OK, "")
            if error is None:
                status, text = self._write_outputs(r, result, offset, probe)
            offset += r.rows
            self._respond(r, status, text, t_close, total)
        t_end = time.monotonic()
        self._account(batch, total, t_close, t_scatter, t_end, result, error is not None)

    def _write_outputs(self, r: _Request, result, offset: int, probe: bool) -> Tuple[int, str]:
        peer = r.peer
        w = peer.views.words
        w[P_NOUT] = len(result.outputs)
        w[P_TUPLE] = int(result.is_tuple)
        for j, o in enumerate(result.outputs):
            rows = o[offset:offset + r.rows]
            d = desc_view(w, P_DESC, j)
            # Always written: another model process may have answered this slot in between.
            write_desc(d, dtype_code(o.dtype), rows.shape)
            if probe:
                continue
            if j not in peer.regions:  # written by the client once, after its probe
                peer.regions[j] = (int(d[2]), int(d[3]))
            offset_j, capacity = peer.regions[j]
            if rows.nbytes > capacity:
                return ST_BAD_REQUEST, (
                    f"output {j} of shape {rows.shape} ({rows.dtype}) needs {rows.nbytes} bytes but "
                    f"this client reserved {capacity} (sized from its max_shape); an input smaller "
                    f"than max_shape must not give a larger output")
            peer.output_view(j, offset_j, rows.dtype, rows.shape)[...] = rows
        return ST_OK, ""

    def _respond(self, r: _Request, status: int, text: str, t_close: float, total: int) -> None:
        views = r.peer.views
        w = views.words
        if text:
            views.set_error(text)
        w[P_STATUS] = status
        views.floats[F_CLOSE] = t_close
        views.floats[F_BATCH_ROWS] = total
        views.floats[F_DONE] = time.monotonic()
        w[P_SEQ] = w[R_SEQ]  # last: the client trusts the response only when this matches
        self.ctl.table[T_STATE, r.slot] = DONE
        r.peer.done.release()

    def _record_spec(self, key: int, outputs, is_tuple: bool) -> None:
        """Publish the output shapes seen for an input key so later clients need no probe."""
        specs = self.ctl.specs[self.me]
        i = self._spec_next % N_SPEC
        self._spec_next += 1
        row = specs[i]
        row[3] = 0
        row[1] = len(outputs)
        row[2] = int(is_tuple)
        for j, o in enumerate(outputs[:MAX_IO]):
            write_desc(desc_view(row, 4, j), dtype_code(o.dtype), tuple(o.shape[1:]), 0, 0)
        row[0] = key
        row[3] = 1

    def _account(self, batch, total, t_close, t_scatter, t_end, result, failed) -> None:
        c = self.ctl.counters[self.me]
        c[C_REQUESTS] += len(batch)
        c[C_BATCHES] += 1
        c[C_ROWS] += total
        if failed:
            c[C_ERRORS] += len(batch)
        head = int(c[C_RING_HEAD])
        rec = self.ctl.ring[self.me, head % RING]
        times = result.times if result is not None else None
        rec[_FIELD["t_close"]] = t_close
        rec[_FIELD["rows"]] = total
        rec[_FIELD["requests"]] = len(batch)
        rec[_FIELD["queue_wait"]] = t_close - sum(r.t_publish for r in batch) / len(batch)
        rec[_FIELD["gather"]] = times.gather if times else 0.0
        rec[_FIELD["h2d"]] = times.h2d if times else 0.0
        rec[_FIELD["forward"]] = times.forward if times else 0.0
        rec[_FIELD["d2h"]] = times.d2h if times else 0.0
        rec[_FIELD["scatter"]] = t_end - t_scatter
        # The runtime's own work on this batch: copy in (issue and DMA overlap), copy out, scatter
        # and wake. Not wall time minus forward: with pipelining, a batch also waits for the one
        # ahead of it on the device, which is neither its forward nor the runtime's cost.
        own = max(times.gather, times.h2d) + times.d2h if times else 0.0
        rec[_FIELD["runtime"]] = own + (t_end - t_scatter)
        rec[_FIELD["t_end"]] = t_end
        c[C_RING_HEAD] = head + 1
