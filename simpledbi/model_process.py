"""What runs in a model process: load, warm up, then claim requests, batch them and answer them.

Entry point :func:`model_process_main` is module-level so ``spawn`` can pickle it. The loop::

    sleep on the model's doorbell (timeout: poll_interval, to notice orphaning / stop)
      -> scan the slot table's hints for PUBLISHED, unclaimed rows, oldest first
      -> claim each (take rdy, through the kernel), read + validate its header privately (slots.Peer)
      -> until batching.decide says close: wait on the doorbell for more (NOTE [adaptive batching])
      -> Engine: gather (preadv / DMA) -> forward -> outputs
      -> pwrite each requester's rows and response into its segment, don.post()

Nothing a client writes is trusted (NOTE [slot protocol] in slots.py); each batch runs under one
catch-all that answers its callers with a typed error and keeps serving. When a forward pass
raises for a batch of several requests, the batch is bisected and retried so only the requests
that make the model fail get ``ModelError`` (``ModelConfig.isolate_errors``).
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import struct
import time
import traceback
from bisect import bisect_left
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import posix_ipc

from . import batching
from .config import ModelConfig, RuntimeOptions
from .layout import (
    B_FIELDS, BATCH_HIST_MAX, COUNTERS, INST_RETIRING, H_COMPUTE, H_LATENCY, H_QUEUE, H_SUM,
    LAT_BOUNDS, INST_DEAD, INST_READY, MAX_IO, MAX_NDIM, PUBLISHED, IDLE, RING,
    ST_BAD_REQUEST, ST_INTERNAL, ST_MODEL_ERROR, ST_OK, ST_STOPPED, STOPPING, BROKEN, DRAINING, ControlBlock,
    HEADER, INSTANCE, SlotTable,
    doorbell_name, dtype_code, words,
)
from .discovery import SlotFinder
from .interrupts import ignore_ctrl_c
from .logs import install_child_handler
from .shm import open_semaphore
from .slots import (
    CLAIM_WORDS, CL_DONE, CL_SEQ, CL_TOKEN, SLOT_WORDS, T_KEY, T_PUBLISH, T_ROWS, T_SEQ, T_TOKEN,
    BadRequest, Limits, Peer, Request, backoff, claim_words, mark_answered, table_words, write_claim,
)

logger = logging.getLogger(__name__)
_I64_MAX = 2**63 - 1
_ASIDE_MAX = 64        # handles kept that no row names (NOTE [hidden requests]); a victim's evicted
_ADOPT_PER_PASS = 32   # one is found again when its row is repaired; finder handles adopted per pass
assert B_FIELDS == ("t_close", "rows", "requests", "queue_wait", "gather", "h2d", "forward", "d2h",
                    "scatter", "runtime", "t_end")  # the order _account writes a record in
_C_REQUESTS, _C_BATCHES, _C_ROWS, _C_HEAD, _C_OVER = (
    COUNTERS.fields[n][1] // 8 for n in ("requests", "batches", "rows", "ring_head", "over_target"))
_H_STATE = HEADER.fields["state"][1] // 8
_I_STATE, _I_FREE = (INSTANCE.fields[n][1] // 8 for n in ("state", "free"))
_RECORD = struct.Struct(f"<{len(B_FIELDS)}d")   # one batch record of the ring
_BUSY_POLL = 0.0002
_REJECTED_FIRST = 0.005   # seconds a slot's rows wait after a request of it failed validation
_SEM_VALUE = posix_ipc.SEMAPHORE_VALUE_SUPPORTED
_DRAIN_MAX = 4096   # doorbell rings taken per pass (about a millisecond): see _drain_doorbell
# NOTE [rewritten rows] (_scan_rows): slots whose claim got nothing lately
_CHECK_EVERY = 0.005    # ... are each looked at once per this many seconds at most, doubling up
_CHECK_MAX = 0.02       # to this while a handle's rdy shows nothing;
_RANKED_EVERY = 0.002   # the _RETRY_BUDGET served here most recently are tried this often,
_UNKNOWN_EVERY = 0.002  # and _RETRY_BUDGET rows naming no handle I hold this often
_RETRY_BUDGET = 8
_RECHECK_FOR = 2 * _CHECK_MAX   # how long after a ring that claimed nothing it is looked at again
_FIND_EVERY = 0.05      # the namespace directory is listed at most this often (and 20 x its cost)


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
    #: Started by a rolling reload: after loading, claim nothing until the runtime makes this
    #: process's bank the serving one (a reload that fails can then stop it without loss).
    standby: bool = False


def _raise_fd_limit() -> None:
    """A handle per attached slot (up to max_clients) plus torch's own: the soft descriptor
    limit (often 1024) goes up to the hard one, as far as 2**20."""
    import resource
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard if hard != resource.RLIM_INFINITY else 2**20, 2**20)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass


def model_process_main(spec: ModelProcessSpec, conn) -> None:
    """Child entry point. Reports ("ready", info) or ("failed", ...) on ``conn``."""
    os.environ.update(spec.env)  # first: the CUDA driver reads CUDA_MPS_* once, when it initialises
    install_child_handler(spec.log_conn, f"<{spec.config.name}|{spec.instance}>", spec.log_level)
    ignore_ctrl_c()  # the parent decides when to stop (NOTE [Ctrl-C and children])
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    _raise_fd_limit()
    try:
        server = ModelServer(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("failed", f"{type(e).__name__}: {_safe_str(e)}", traceback.format_exc()))
        conn.close()
        os._exit(1)
    # Everything loaded so far (torch, the model) lives as long as the process: keep it out of
    # the garbage collector's full passes, which otherwise stall a batch for tens of ms.
    gc.collect()
    gc.freeze()
    conn.send(("ready", {"pid": os.getpid(), "device": str(server.engine.device),
                         "input_names": list(server.engine.input_names)}))
    conn.close()
    logger.debug("%s serving on %s", server.tag, server.engine.device)
    try:
        if not spec.standby or server.await_switch():
            server.serve()
    finally:
        server.close()
    if server.fatal:
        os._exit(3)  # the device context is unusable: let the supervisor start a fresh process


@dataclass(slots=True)
class _Collecting:
    """The batch being collected: its shape key, rows, row cap and oldest request."""

    key: Optional[int] = None
    kind: tuple = ()      # its requests' Request.kind (exact; key is only its CRC)
    rows: int = 0
    limit: int = 0
    oldest: float = float("inf")
    newest: float = 0.0
    waiting: int = 0      # rows of its shape seen pending that did not fit
    leftover: bool = False   # pending requests left for another process (other shape, no room)


@dataclass(slots=True)
class _InFlight:
    batch: List[Request]
    t_close: float
    gather: object = None
    launched: object = None
    error: Optional[BaseException] = None
    completed: bool = False


class ModelServer:
    """The state of one model process: control block, slot table, engine, the slots it knows."""

    def __init__(self, spec: ModelProcessSpec):
        from .engine import Engine, Gather  # torch is imported only in model processes
        self._Gather = Gather
        self.spec = spec
        self.cfg = cfg = spec.config
        self.me = spec.instance
        self.pid = os.getpid()
        self.tag = f"<{cfg.name}|{self.me}>"
        self.poll = spec.options.poll_interval
        self.ctl = ControlBlock.attach(spec.namespace, cfg.name, readonly=False)
        self.table = SlotTable.attach(spec.namespace, cfg.name, self.ctl.max_slots)
        self.door = open_semaphore(doorbell_name(spec.namespace, cfg.name))
        inst = self.ctl.all_instances[self.me]
        inst["pid"], inst["t_start"] = self.pid, time.time()
        self.engine = Engine(cfg, self.me % cfg.model_num, spec.cpu_model_procs)
        dev = self.engine.device
        inst["device"] = -1 if dev.type == "cpu" else (dev.index or 0)
        self.max_batch = int(cfg.max_batch_size)
        self.policy = batching.Policy(self.max_batch, float(cfg.wait_time), cfg.latency_target,
                                      adaptive=cfg.batching == "adaptive")
        self.costs = batching.CostModel()
        self._late_after = self.policy.latency_target or float("inf")   # over_target counts these
        self.arrivals = batching.RateMeter()
        dtypes = None
        if cfg.input_shapes and cfg.input_dtypes:
            dtypes = tuple(np.dtype(d) for d in cfg.input_dtypes)
        self.limits = Limits(self.max_batch, len(cfg.input_shapes) if cfg.input_shapes else None, dtypes,
                             names=self.engine.input_names)
        self.peers: Dict[int, Peer] = {}       # slot -> the handle its row named last
        # NOTE [hidden requests]: other live handles of a slot index -- a row naming a new token
        # (maybe another client's forgery) sets the old one aside, it is not dropped while its
        # segment lives -- and handles found by listing the namespace directory.
        self.aside: Dict[Tuple[int, int], Peer] = {}
        self._aside_cap = min(self.ctl.max_slots, _ASIDE_MAX)
        self._finder = SlotFinder(spec.namespace, os.path.dirname(self.table.seg.path), cfg.name,
                                  self.ctl.max_slots, interval=_FIND_EVERY, found=self.door.release)
        self._asked_at = 0.0      # when the finder was last asked (NOTE [hidden requests])
        self._ask_due = False     # ... and whether a listing is owed
        # A ring that ended with nothing claimed (a forged row may hide what it announced):
        # look again at this time, once, even if no other ring comes.
        self._recheck_at = 0.0
        self._woken = False   # the idle wait took a ring (_collect's drain then finds none)
        self._rechecking = False   # ... or woke for a recheck
        self._ring_at = 0.0   # when a pass last consumed a ring
        self.deferred: List[Request] = []      # claimed by me, not batched yet (other shape / no room)
        self._open: Dict[int, Request] = {}    # id -> every request claimed and not answered yet
        self.retired: set = set()              # replaced peers that still owe answers
        self._failed: Dict[int, Tuple[int, int]] = {}  # slot -> (token, seq) whose claim failed
        # ... because someone held the slot's claim lock: a peer process claiming it or its client
        # withdrawing it (the token is gone a moment later), or its client holding the lock for
        # good. Retried at the next maintenance pass, not at every ring: a client's own rings
        # must not buy a claim attempt on each of its locked slots.
        self._locked: Dict[int, Tuple[int, int]] = {}
        # Per slot: when a claim on it last got nothing (no token, lock held, nothing to open, a
        # token posted again), under which seq hint, when such a slot was last looked at, and a
        # token that named nothing to open. Rows are hints anyone may rewrite -- a new seq
        # before each ring makes each row a new (token, seq): NOTE [rewritten rows].
        n = self.ctl.max_slots
        self._missed_at, self._next_look = np.zeros(n), np.zeros(n)
        self._look_gap = np.full(n, _CHECK_EVERY)
        self._missed_seq = np.full(n, -1, np.int64)
        self._ok_at = np.zeros(n)   # when a claim on the slot last succeeded
        self._nopeer = np.zeros(n, np.uint64)
        # a slot whose owner posted its token again (no honest client does): until when its rows
        # under that token are not looked at, at all
        self._banned_until, self._banned_tok = np.zeros(n), np.zeros(n, np.uint64)
        self._missed_w, self._next_w = words(self._missed_at, "d"), words(self._next_look, "d")
        self._gap_w = words(self._look_gap, "d")
        self._missed_q, self._nopeer_w = words(self._missed_seq), words(self._nopeer, "Q")
        self._unknown_at = self._ranked_at = 0.0
        self._ok_w = words(self._ok_at, "d")
        self._banned_w, self._banned_tok_w = words(self._banned_until, "d"), words(self._banned_tok, "Q")
        # NOTE [hidden requests]: slots whose request waits unclaimed although their table row
        # does not say so -- another client rewrote the row. Found through the slots' own ``rdy``
        # semaphores, which only their owners post (see _sweep).
        self._hidden: Dict[int, int] = {}      # slot -> token of the peer holding the request
        self._suspect = False     # a ring found nothing to claim since the last directory look
        self._accounting_failed = False
        self._last_sweep = 0.0
        self._hidden_seen = False   # the last look found hidden requests
        self.claim_seq, self.claim_token = self.ctl.claims["seq"], self.ctl.claims["token"]
        self.claim_done = self.ctl.claims["done"]
        self.claim_words = claim_words(self.ctl)
        # the same tables as flat word views (plain ints; tokens unsigned, publish times floats)
        self._claims_u = claim_words(self.ctl, "Q")
        self._tw, self._tw_u, self._tw_f = (table_words(self.table, f) for f in "qQd")
        self.counters = self.ctl.counters[self.me]
        # int64 words of this instance's COUNTERS record, header and INSTANCE record, and its
        # batch ring as bytes: the hot loop reads and writes them as plain ints and floats
        self.count_words = words(self.ctl.counters[self.me:self.me + 1])
        self._hdr_words = words(self.ctl.header)
        self._inst_words = words(self.ctl.all_instances[self.me:self.me + 1])
        self._ring = words(self.ctl.ring[self.me], "B")
        hist = self.ctl.hist[self.me]
        # int64 memoryviews: an element += 1 costs a fraction of a numpy scalar's
        self.h_latency, self.h_queue, self.h_compute = (
            words(hist[k]) for k in (H_LATENCY, H_QUEUE, H_COMPUTE))
        self.h_batch = words(self.ctl.batch_hist[self.me])
        self.fatal = False
        self._rescan = True       # pending requests may be left from the last scan
        self._first_seen: Dict[int, tuple] = {}   # slot -> (seq, when first seen pending)
        self._graphs_shown = 0    # CUDA graphs ready, as the instance row shows them
        # INSTANCE.free: 1 while this process sleeps with nothing claimed or running. A peer whose
        # device is busy leaves new requests to it rather than claiming them for later.
        self._inst_words[_I_FREE] = 0
        self._free = self.ctl.all_instances["free"]   # mine is 0 whenever I look at it
        self.retiring = False     # a rolling reload replaced me: finish what I hold, then exit
        self.turnaround = batching.Ema()   # seconds from an answer to that client's next request
        self._launch_ema = 0.0    # host seconds to enqueue a forward pass (EMA)
        self._forward_ema = 0.0   # device seconds of a forward pass (EMA)
        if cfg.input_shapes:
            in_dtypes = cfg.input_dtypes or ("float32",) * len(cfg.input_shapes)
            # Declared names: clients will pass inputs by name, so warm up (and capture) that way.
            self.engine.warm_up(cfg.input_shapes, in_dtypes, sorted({self.max_batch, 1}, reverse=True),
                                cfg.input_names)
            sizes = cfg.graph_batch_sizes()
            if sizes and self.engine.cuda:
                try:
                    self.engine.capture_graphs(cfg.input_shapes, in_dtypes, sizes, cfg.input_names)
                except Exception:
                    if cfg.cuda_graphs != "auto":
                        raise
                    logger.warning("%s CUDA graph capture failed; running eagerly", self.tag,
                                   exc_info=True)
        self._last_maintenance = time.monotonic()
        inst["graphs"] = self._graphs_shown = self.engine.graph_count
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
            state = self._hdr_words[_H_STATE]
            if self._inst_words[_I_STATE] == INST_RETIRING or state in (STOPPING, BROKEN) or \
                    os.getppid() != self.spec.parent_pid:
                return False
            time.sleep(0.005)

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
        hdr_words, inst_words = self._hdr_words, self._inst_words
        while not self.fatal:
            try:
                state = hdr_words[_H_STATE]
                if state >= STOPPING and state != DRAINING:  # draining: serve what was published
                    break
                if inst_words[_I_STATE] == INST_RETIRING:
                    self.retiring = True
                if self.retiring and inflight is None and not self.deferred and not self._open:
                    logger.info("%s retired: every request it took is answered", self.tag)
                    break
                batch = self._collect(inflight)
                if inflight is not None and inflight.completed:
                    inflight = None  # answered inside _collect
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
                if self.retiring:
                    continue
                inst_words[_I_FREE] = 1
                quiet = False
                wait = self.poll
                if self._recheck_at:
                    wait = min(wait, max(self._recheck_at - time.monotonic(), 0.0))
                try:
                    self.door.acquire(wait)
                    self._rescan = self._woken = True  # the ring this consumed is news for _collect
                    self._failed.clear()
                    self._recheck_at = 0.0
                except posix_ipc.BusyError:
                    if self._recheck_at:
                        # NOTE [hidden requests]: the last ring claimed nothing and none came
                        # since: look once more (a row forged after its ring hides a request
                        # that only the paced looks and the sweep find, and no ring may follow)
                        self._recheck_at, self._rescan, self._rechecking = 0.0, True, True
                        if time.monotonic() - self._last_sweep > 0.01:
                            self._sweep()
                    elif not self._maintenance():
                        break
                    else:
                        quiet = True
                finally:
                    inst_words[_I_FREE] = 0
                if not quiet and time.monotonic() - self._last_maintenance > self.poll and \
                        not self._maintenance():
                    break   # rings that come faster than poll_interval must not put it off
                if quiet and self.engine.cuda:
                    self.engine.take_graphs()   # captured off-thread while nothing came
                    self._show_graphs()
                if quiet and self.engine.quiet_work_pending and not self.deferred:
                    # Nothing came for a poll interval: now the first run of a batch size costs
                    # no one (NOTE [first batch of a size]). At any lull it stalled the next requests.
                    self.engine.quiet_step()
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

    def _peer_free(self) -> bool:
        """Is another model process of this model idle (nothing claimed, nothing running)?"""
        return self.ctl.model_num > 1 and bool(self._free.any())

    def close(self) -> None:
        self._finder.close()
        for peer in list(self.peers.values()) + list(self.aside.values()) + list(self.retired):
            self.engine.unregister(peer.mapping[1] if peer.mapping else 0)
            peer.close()
        self.peers.clear()
        self.aside.clear()
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("%s engine close failed", self.tag, exc_info=True)
        try:
            self.ctl.all_instances[self.me]["free"] = 0
            self.ctl.all_instances[self.me]["state"] = INST_DEAD
        except Exception:  # noqa: BLE001
            pass
        for view in (self.h_latency, self.h_queue, self.h_compute, self.h_batch, self.count_words,
                     self._hdr_words, self._inst_words, self._ring, self.claim_words, self._claims_u,
                     self._tw, self._tw_u, self._tw_f):
            view.release()
        self.door.close()
        self.table.close()
        self.ctl.close()

    def _maintenance(self) -> bool:
        """Drop handles of detached clients; return False when this process should exit."""
        self._last_maintenance = time.monotonic()
        if os.getppid() != self.spec.parent_pid:
            logger.warning("%s parent died; exiting", self.tag)
            return False
        for slot, peer in list(self.peers.items()):
            # Gone when its segment is: its client detached, or the reaper freed it. (Not by its
            # table row: any client can write that, and would make me forget the slot.)
            if not peer.inflight and not peer.linked():
                self._drop_peer(slot)
        for key, peer in list(self.aside.items()):
            if not peer.inflight and not peer.linked():
                del self.aside[key]
                self._close_peer(peer)
        self._adopt(self._finder.take())
        if self._suspect and not self.retiring:
            self._finder.ask(frozenset([(s, p.token) for s, p in self.peers.items()] + list(self.aside)))
        self._suspect = False
        self._sweep()
        self._failed.clear()  # a failed claim is not retried before a ring or this, no longer
        self._locked.clear()
        self._rescan = True
        seen, t = self._first_seen, self.table
        for s in [s for s, (q, _) in seen.items() if t.state[s] != PUBLISHED or t.seq[s] != q]:
            del seen[s]
        return True

    def _sweep(self) -> None:
        """NOTE [hidden requests]: a request is findable by its table row, and any client can
        rewrite any row -- over and over, faster than the row's owner repairs it -- or make its
        row name a token of its own. So, at once when a ring finds nothing to claim (at most every
        10 ms unless hidden requests keep turning up) and at every maintenance pass, every handle
        I have (the row's last token and those set aside) whose ``rdy`` is posted -- a request
        nobody claimed; only its owner posts it -- while the row does not show it is claimed
        through that handle. Slots I have no handle on are found by a SlotFinder, asked when a
        ring found nothing (it wakes me when it opened something). A ring that claimed nothing
        is followed by looks every _CHECK_EVERY for _RECHECK_FOR (its request may be hidden
        after the ring, and no ring may follow), each with this sweep at most every 10 ms; a
        row naming a token that opens nothing is looked behind through the slot's handle
        (_look_behind). A hidden request waits milliseconds; a poll interval at the most."""
        self._last_sweep = time.monotonic()
        if self.retiring:
            return
        tw_u, state = self._tw_u, self.table.state
        # A handle whose claim lock was held lately waits (Peer.try_claim): else every doorbell
        # ring would retry each such handle (a client holding its own locks, ringing).
        now = self._last_sweep
        for slot, peer in self.peers.items():
            # a row that shows its request is the scan's (NOTE [rewritten rows]): no syscall here
            if peer.refused_until <= now and not (
                    state[slot] == PUBLISHED and tw_u[slot * SLOT_WORDS + T_TOKEN] == peer.token) \
                    and peer.waiting():
                self._hidden[slot] = peer.token
        for (slot, token), peer in self.aside.items():
            if peer.refused_until <= now and peer.waiting():
                self._hidden[slot] = token
        self._hidden_seen = bool(self._hidden)   # under attack: look again at every empty ring

    def _suspicious(self) -> None:
        """A ring found nothing it could claim: maybe a row was rewritten over a request, maybe
        over a new client's first one, whose handle nobody has yet. Ask the SlotFinder to list
        the directory (it wakes me when it found something)."""
        self._suspect = self._ask_due = True
        self._ask_finder()

    def _ask_finder(self) -> None:
        """A listing owed is asked for at most every _FIND_EVERY (building what I know costs a
        pass over my handles); one not asked yet keeps the looks-again going until it is."""
        now = time.monotonic()
        if self._ask_due and not self.retiring and now - self._asked_at >= _FIND_EVERY:
            self._asked_at, self._ask_due = now, False
            self._finder.ask(frozenset([(s, p.token) for s, p in self.peers.items()] + list(self.aside)))

    def _adopt(self, found: List[Peer], hidden: bool = False) -> None:
        """Take the handles a SlotFinder opened: the row's slot if I had none, else set aside.
        Only those with a request waiting, at most _ADOPT_PER_PASS: names anyone can create
        must not fill my descriptors or my time (the finder never reopens one it gave me).
        ``hidden``: claim their requests through these handles, whatever the rows say."""
        for n, peer in enumerate(found):
            key = (peer.slot, peer.token)
            have = self.peers.get(peer.slot)
            if n >= _ADOPT_PER_PASS or (have is not None and have.token == peer.token) or \
                    key in self.aside or not peer.waiting():
                peer.close()
                continue
            if have is None:
                self._register(peer)
                self.peers[peer.slot] = peer
            else:
                self._set_aside(peer)
            if hidden:
                self._hidden[peer.slot] = peer.token

    def _set_aside(self, peer: Peer) -> None:
        """Keep a live handle that its row no longer names, within a bound: at most max_slots
        are kept, those whose last claim succeeded longest ago go first."""
        self.aside[(peer.slot, peer.token)] = peer
        if len(self.aside) > self._aside_cap:
            idle = [k for k, p in self.aside.items() if not p.inflight]
            if idle:
                self._close_peer(self.aside.pop(min(idle, key=lambda k: self.aside[k].last_ok)))

    def _register(self, peer: Peer) -> None:
        if self.engine.wants_mapping:
            m = peer.map()
            if m is not None and not self.engine.register(*m):
                peer.mapping[0].close()
                peer.mapping = None

    # ------------------------------------------------------------ claiming
    def _drain_doorbell(self) -> int:
        """Take the pending rings of the doorbell -- at most ``_DRAIN_MAX`` (a client can post it
        millions of times: the rest is taken a chunk per pass, between batches, never all at once
        in front of everyone's requests); returns how many were taken. A ring may be a new
        request under a seq whose claim failed before (a forged hint): failed claims are retried
        after every ring."""
        n, door = 0, self.door
        try:
            # sem_getvalue first where there is one: a failed trywait raises, which costs more
            todo = min(door.value, _DRAIN_MAX) if _SEM_VALUE else _DRAIN_MAX
            take = door.acquire
            while n < todo:
                take(0)
                n += 1
        except posix_ipc.BusyError:
            pass
        if n and self._failed:
            self._failed.clear()
        return n

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
        new = self.aside.pop((slot, token), None)
        if new is None:
            try:  # the new one must open before the old one goes: a forged token opens nothing
                new = Peer(self.spec.namespace, self.cfg.name, slot, token)
            except (posix_ipc.Error, OSError, ValueError):
                return None  # gone (detached), or a hint that names nothing
            self._register(new)
        if peer is not None:
            self.peers.pop(slot)
            if peer.linked():
                self._set_aside(peer)   # maybe the row is a forgery: keep serving its owner
            else:
                self._close_peer(peer)
        self.peers[slot] = new
        return new

    def _scan(self) -> Tuple[List[int], int]:
        """One pass over the hints: the slots whose request is published and claimed by nobody
        (not retried while their claim failed this interval), and how many attached clients could
        send a request now: those with none in flight (IDLE) and those whose answer is written
        but not read yet (about to send again)."""
        if self.retiring:
            return [], 0   # claim nothing new; and no one may add to what is left
        states = self.table.state
        pub = (states == PUBLISHED).nonzero()[0]
        may = int(np.count_nonzero(states == IDLE))
        out, soon = self._scan_rows(pub) if pub.size else ([], 0)
        if self._hidden:   # NOTE [hidden requests]
            now, seen, listed = time.monotonic(), self._first_seen, set(out)
            for s in self._hidden:
                if s not in listed:
                    if s not in seen:
                        seen[s] = (-1, now)
                    out.append(s)
        return out, may + soon

    def _scan_rows(self, pub: np.ndarray) -> Tuple[List[int], int]:
        """_scan's look at the PUBLISHED rows ``pub``: (unclaimed ones, answered ones).

        NOTE [rewritten rows]: a row is a hint anyone may rewrite, and a ring may announce a new
        request under a (token, seq) whose claim failed before -- so every new (token, seq) is
        worth a try. A client that writes a new seq into many rows before each ring would buy a
        claim attempt per row per ring (one process at 80-99% of a core, honest throughput -70%).
        So the rows of a slot whose claim got nothing within a poll interval are tried by time,
        not per ring: every _RANKED_EVERY, the _RETRY_BUDGET slots on which I served a request
        most recently (an honest client whose row is being rewritten is served at once, its
        claims succeed); and each such slot is looked at once per _CHECK_EVERY at most, which
        nobody can outrank: when the row names the handle I hold, its ``rdy`` says whether a
        request waits (only its owner posts it: served within _CHECK_EVERY, or _CHECK_MAX
        after a pause -- the gap doubles while nothing waits; a handle whose claim lock was
        held waits for the next maintenance pass); a row naming a token I have no handle on is
        tried _RETRY_BUDGET at a time, the one that missed longest ago first, at most every
        _UNKNOWN_EVERY, and a token that named nothing to open is not tried again while the
        slot keeps missing. A slot whose owner posted its token again (no honest client does;
        re-armed before each ring it bought a claim and a reject each time) is not looked at
        under that token for a poll interval. Not limited: slots that did not miss lately, and a row naming the
        request after the last one claimed on that slot (by any process) when its miss was for
        another seq -- a process that lost a race to a peer tries that client's next request at
        once (2-6% of claims miss that way with several model processes under load)."""
        t = self.table
        failed, locked, seen, now = self._failed, self._locked, self._first_seen, time.monotonic()
        recent = now - self.poll
        soon = 0
        if pub.size <= 16:  # the common case: a few plain ints beat a dozen vector operations
            tw, tw_u, cw, cw_u = self._tw, self._tw_u, self.claim_words, self._claims_u
            missed, missed_q, next_look = self._missed_w, self._missed_q, self._next_w
            banned, banned_tok = self._banned_w, self._banned_tok_w
            out, cand = [], None
            for s in pub.tolist():
                row, c = s * SLOT_WORDS, s * CLAIM_WORDS
                q, k = tw[row + T_SEQ], tw_u[row + T_TOKEN]
                if cw_u[c + CL_TOKEN] == k:
                    if cw[c + CL_DONE] == q:
                        soon += 1
                    if cw[c + CL_SEQ] == q:
                        continue
                if (failed and failed.get(s) == (k, q)) or (locked and locked.get(s) == (k, q)):
                    continue
                if banned[s] > now and banned_tok[s] == k:
                    continue
                if missed[s] > recent and not (cw_u[c + CL_TOKEN] == k and cw[c + CL_SEQ] + 1 == q
                                               and missed_q[s] != q):
                    if cand is None:
                        cand, ranked = [], []
                    ranked.append(s)
                    if next_look[s] <= now:
                        cand.append((s, k))
                    continue
                first = seen.get(s)
                if first is None or first[0] != q:
                    seen[s] = (q, now)
                out.append(s)
            if cand is not None:
                for s in self._retry(cand, now, ranked):
                    q = tw[s * SLOT_WORDS + T_SEQ]
                    first = seen.get(s)
                    if first is None or first[0] != q:
                        seen[s] = (q, now)
                    out.append(s)
            return out, soon
        seqs, toks = t.seq[pub], t.token[pub]
        same = self.claim_token[pub] == toks
        soon = int(np.count_nonzero(same & (self.claim_done[pub] == seqs)))
        keep = ~(same & (self.claim_seq[pub] == seqs))
        keep &= ~((self._banned_until[pub] > now) & (self._banned_tok[pub] == toks))
        retry = keep & (self._missed_at[pub] > recent)
        chosen: List[int] = []
        if retry.any():
            retry &= ~(same & (self.claim_seq[pub] + 1 == seqs) & (self._missed_seq[pub] != seqs))
            keep &= ~retry
            look = retry & (self._next_look[pub] <= now)
            chosen = self._retry(zip(pub[look].tolist(), toks[look].tolist()), now, pub[retry])
        out = pub[keep].tolist()
        qs = seqs[keep].tolist()
        if chosen:
            tw = self._tw
            out += chosen
            qs += [tw[s * SLOT_WORDS + T_SEQ] for s in chosen]
        if failed or locked:
            tw_u = self._tw_u
            pairs = [(s, q) for s, q in zip(out, qs)
                     if failed.get(s) != (tw_u[s * SLOT_WORDS + T_TOKEN], q) and
                     locked.get(s) != (tw_u[s * SLOT_WORDS + T_TOKEN], q)]
            out, qs = [s for s, _ in pairs], [q for _, q in pairs]
        for s, q in zip(out, qs):
            first = seen.get(s)
            if first is None or first[0] != q:
                seen[s] = (q, now)
        return out, soon

    def _retry(self, cand, now: float, ranked) -> List[int]:
        """NOTE [rewritten rows]: which rows of slots that missed lately to try now: of
        ``ranked`` (all of them), the _RETRY_BUDGET on which a request was served most recently,
        at most every _RANKED_EVERY; of the (slot, token) rows ``cand`` (those due for a look),
        the ones whose handle's ``rdy`` shows a request, and a few naming no handle I hold."""
        out, unknown = [], []
        if len(ranked) and now - self._ranked_at >= _RANKED_EVERY:
            self._ranked_at = now
            ranked = np.asarray(ranked)
            if ranked.size > _RETRY_BUDGET:
                ranked = ranked[np.argsort(-self._ok_at[ranked], kind="stable")[:_RETRY_BUDGET]]
            peers = self.peers
            out = [s for s in ranked.tolist() if self._ok_w[s] > 0.0 and   # served here once
                   (s not in peers or peers[s].refused_until <= now)]
        next_look, gap, nopeer, peers = self._next_w, self._gap_w, self._nopeer_w, self.peers
        for s, k in cand:
            p = peers.get(s)
            if p is not None:
                # The handle I hold for the slot, whatever token its row names now (a row forged
                # over a request hides it: its own rdy does not lie). A lock held lately waits
                # (Peer.try_claim).
                if p.refused_until <= now and p.waiting():
                    out.append(s)
                    if p.token != k:
                        self._hidden[s] = p.token   # claimed through my handle, not the row's token
                    gap[s] = _CHECK_EVERY
                else:
                    gap[s] = min(gap[s] * 2, _CHECK_MAX)
                next_look[s] = now + gap[s]
                if p.token == k or s in self._hidden:
                    continue
            else:
                next_look[s] = now + _CHECK_EVERY
            if nopeer[s] != k:
                unknown.append(s)
        if unknown and now - self._unknown_at >= _UNKNOWN_EVERY:
            self._unknown_at = now
            if len(unknown) > _RETRY_BUDGET:
                unknown.sort(key=self._missed_w.__getitem__)
                del unknown[_RETRY_BUDGET:]
            out += unknown
        return list(dict.fromkeys(out)) if len(out) > 1 else out

    def _claim(self, slot: int, now: float) -> Optional[Request]:
        row = slot * SLOT_WORDS
        token, seq_hint = self._tw_u[row + T_TOKEN], self._tw[row + T_SEQ]
        hidden = self._hidden.pop(slot, None) if self._hidden else None
        if hidden is not None:   # NOTE [hidden requests]: the handle I have, not what the row says
            token, peer = hidden, self.peers.get(slot)
            if peer is None or peer.token != token:
                peer = self.aside.get((slot, token))
        else:
            peer = self._peer(slot, token)
            if peer is None:
                peer = self._look_behind(slot, now)
                if peer is not None:
                    token = hidden = peer.token
        got = peer.try_claim(self.poll) if peer is not None else False
        if not got:
            self._missed_w[slot], self._missed_q[slot] = now, seq_hint
            if peer is None and hidden is None:
                self._nopeer_w[slot] = token   # names nothing: not tried again while it misses
            self.counters["claims_missed"] += 1
            if got is None:
                self._locked[slot] = (token, seq_hint)
            else:
                self._failed[slot] = (token, seq_hint)  # this attach's request: not again this interval
            return None
        peer.inflight += 1
        try:
            req = peer.read_request(self.limits, seq_hint, now)
        except OSError:  # its segment cannot be read at all: nothing to answer into, drop it
            peer.inflight -= 1
            self.counters["bad_requests"] += 1
            self._failed[slot] = (token, seq_hint)
            self._missed_w[slot], self._missed_q[slot] = now, seq_hint
            if self.peers.get(slot) is peer:
                self._drop_peer(slot)
            elif self.aside.pop((slot, token), None) is peer:
                self._close_peer(peer)
            return None
        except BadRequest as e:
            write_claim(self.claim_words, slot, token, e.seq, self.me, self.pid)
            peer.inflight -= 1
            self._reject(peer, e.seq, str(e))
            # This library's clients validate before they publish: a header that fails here is
            # a broken or hostile client's. Its rows under this token are not looked at for 5 ms,
            # doubling with each reject in a row up to a poll interval (a bad header re-armed
            # before each ring bought a claim, a read and a reject per ring: round 17).
            peer.reject_gap = backoff(peer.reject_gap, _REJECTED_FIRST, self.poll)
            peer.refused_until = self._banned_w[slot] = now + peer.reject_gap
            self._banned_tok_w[slot] = token
            return None
        c = slot * CLAIM_WORDS
        if req.seq <= peer.answered_seq or (self._claims_u[c + CL_TOKEN] == peer.token and
                                            self.claim_words[c + CL_SEQ] >= req.seq):
            # A token for a request already claimed: its owner posted ``rdy`` again (only the
            # owner can). Running it again would cost a forward per post; it gets nothing --
            # unless its row says a newer request waits: then the header was not rewritten.
            peer.inflight -= 1
            self._failed[slot] = (token, seq_hint)
            self._missed_w[slot], self._missed_q[slot] = now, seq_hint
            # No honest client does this: its rows under this token are not looked at for a poll
            # interval (a token re-armed before each ring bought a claim and a reject each time).
            peer.refused_until = self._banned_w[slot] = now + self.poll
            self._banned_tok_w[slot] = token
            if req.seq < seq_hint < 2**62:
                write_claim(self.claim_words, slot, token, seq_hint, self.me, self.pid)
                self._reject(peer, seq_hint, f"the request header says seq {req.seq}, answered "
                             f"already, but the slot's row says {seq_hint}: the header was not "
                             f"rewritten")
                return None
            if not peer.warned:
                peer.warned = True
                logger.warning("%s slot %d posted its token again for request %d, answered or "
                               "claimed already: ignored", self.tag, slot, req.seq)
            return None
        write_claim(self.claim_words, slot, token, req.seq, self.me, self.pid)
        peer.last_ok = self._ok_w[slot] = now
        peer.reject_gap = 0.0
        first = self._first_seen.pop(slot, None)
        req.t_seen = first[1] if first is not None else now
        if req.seq == peer.answered_seq + 1:  # its last request was answered by me: a sample
            self.turnaround.add(min(max(req.t_publish - peer.answered_at, 0.0), 0.1))
        if peer.mapping is not None:
            req.mapped = peer.mapping
        self._open[id(req)] = req
        return req

    def _look_behind(self, slot: int, now: float) -> Optional[Peer]:
        """The slot's row names a token that opens nothing -- forged, maybe written over a request
        of the client whose handle I hold: if that handle's own rdy shows one, claim through it
        (a look paced per slot like _retry's, so rows forged before every ring buy one look per
        slot per _CHECK_EVERY at most)."""
        mine = self.peers.get(slot)
        if mine is None or mine.refused_until > now or self._next_w[slot] > now:
            return None
        if mine.waiting():
            self._gap_w[slot] = _CHECK_EVERY
            self._next_w[slot] = now + _CHECK_EVERY
            return mine
        self._gap_w[slot] = min(self._gap_w[slot] * 2, _CHECK_MAX)
        self._next_w[slot] = now + self._gap_w[slot]
        return None

    def _reject(self, peer: Peer, seq: int, text: str) -> None:
        self.counters["bad_requests"] += 1
        if not peer.warned:
            peer.warned = True
            logger.warning("%s rejected a request of slot %d: %s", self.tag, peer.slot, text)
        peer.respond(seq, ST_BAD_REQUEST, text, claimer=self.me)
        mark_answered(self.claim_words, peer.slot, seq)

    def _take(self, batch: List[Request], c: _Collecting, req: Request) -> None:
        if c.key is None:
            c.key, c.kind = req.key, req.kind
            if self.policy.latency_target is not None:  # else row_limit is max_batch
                c.limit = batching.row_limit(self.policy, self.costs.fit(req.key),
                                             self.arrivals.rate(time.monotonic()))
        batch.append(req)
        c.rows += req.rows
        if req.t_publish < c.oldest:
            c.oldest = req.t_publish
        if req.t_publish > c.newest:
            c.newest = req.t_publish

    def _fill(self, batch: List[Request], c: _Collecting, pending: List[int]) -> None:
        """Add requests to ``batch``: first ones I already claimed, then newly published ones of
        the batch's item shape, oldest first. A request that does not fit stops the scan (it goes
        first next time: nobody is overtaken for good)."""
        c.waiting, c.leftover = 0, False
        if self.deferred:
            self.deferred.sort(key=attrgetter("t_seen"))
            keep = []
            for r in self.deferred:
                if c.key is None or (r.kind == c.kind and r.rows <= c.limit - c.rows):
                    self._take(batch, c, r)
                else:
                    keep.append(r)
                    if r.kind == c.kind:
                        c.waiting += r.rows
            self.deferred = keep
        if not pending:
            return
        if c.rows >= c.limit > 0 or c.waiting:
            c.leftover = True
            return
        t = self.table
        if len(pending) > 1:
            # Oldest first by when this process first saw each request pending (a client cannot
            # forge that); the client's publish-time hint only orders requests first seen together.
            seen, hint = self._first_seen, t.t_publish
            if len(pending) > 32:
                arr = np.asarray(pending)
                first = np.fromiter((seen[s][1] for s in pending), np.float64, len(pending))
                pending = arr[np.lexsort((hint[arr], first))].tolist()
            else:
                tw_f = self._tw_f
                pending = sorted(pending, key=lambda s: (seen[s][1], tw_f[s * SLOT_WORDS + T_PUBLISH]))
        tw = self._tw
        now = time.monotonic()
        claimed = 0
        for i, s in enumerate(pending):
            if c.key is not None:
                if tw[s * SLOT_WORDS + T_KEY] != c.key:
                    c.leftover = True   # another shape, by its hint: a later batch (or a peer)
                    continue
                # rows hints are clipped: a lying hint must not block the requests behind it
                if min(max(tw[s * SLOT_WORDS + T_ROWS], 1), self.max_batch) > c.limit - c.rows:
                    c.waiting += 1
                    c.leftover = True
                    break
            req = self._claim(s, now)
            if req is None:
                continue
            claimed += req.rows
            if c.key is None or (req.kind == c.kind and req.rows <= c.limit - c.rows):
                self._take(batch, c, req)
            else:
                self.deferred.append(req)  # a hint that lied about its shape or size
                c.waiting += req.kind == c.kind
            if c.rows >= c.limit:
                c.leftover = c.leftover or i + 1 < len(pending)
                break
        if claimed:
            self.arrivals.add(claimed, now)

    def _collect(self, inflight: Optional[_InFlight] = None) -> List[Request]:
        """Claim the next batch. ``inflight`` is the batch launched before, if any: while it is on
        the device, waiting is free (batching.decide). When it is done and no client could add
        to this batch, it is answered here first: its callers are the ones who can."""
        busy = inflight.launched if inflight is not None else None
        if busy is not None and self._peer_free():
            return []  # an idle peer takes newcomers sooner than my busy device would
        if self.retiring and not self.deferred:
            return []  # the doorbell's rings are for the processes that replaced me
        rang = 0 if self.retiring else self._drain_doorbell()
        woken, self._woken = self._woken, False   # a ring the idle wait took
        rechecking, self._rechecking = self._rechecking, False
        if not self.retiring:
            self._adopt(self._finder.take(), hidden=True)   # slots the directory showed
            self._ask_finder()
        if not rang and not self._rescan and not self.deferred:
            return []  # every publish rings the doorbell after its row is written: nothing new
        pending, may = self._scan()
        if not pending and not self.deferred:
            # Woken by a ring and nothing to claim: a peer took it, it was withdrawn -- or its row
            # was rewritten by someone else (NOTE [hidden requests]). Look through my handles now.
            if rang or woken:   # (a look again is no ring: it must not owe another listing)
                self._suspicious()
            if self._hidden_seen or time.monotonic() - self._last_sweep > 0.01:
                self._sweep()
                if self._hidden:
                    pending, may = self._scan()
        batch: List[Request] = []
        c = _Collecting(limit=self.max_batch)
        self._fill(batch, c, pending)
        if pending and not batch and not self.deferred and \
                time.monotonic() - self._last_sweep > 0.01:
            # Every claim failed: maybe rows were rewritten over requests that wait (a new
            # token in each row before each ring hides them from the scan) -- look through my
            # handles as for an empty ring, at most every 10 ms.
            if rang or woken:
                self._suspicious()
            self._sweep()
            if self._hidden:
                pending, may = self._scan()
                self._fill(batch, c, pending)
        self._rescan = bool(pending) and not batch   # only failed claims: scan again next time
        self._recheck_at = 0.0
        if not batch and (rang or woken or rechecking):
            # NOTE [hidden requests]: a ring that claimed nothing -- its request may be hidden
            # by a row forged after the ring, found only by a paced look, a sweep or a listing
            # of the directory, and no other ring may come: look again every _CHECK_EVERY for
            # _RECHECK_FOR after it, and until the listing it owes was asked for.
            now = time.monotonic()
            if rang or woken:
                self._ring_at = now
                if pending:   # rows it could not claim (an empty ring asked already)
                    self._suspicious()
            if now - self._ring_at < _RECHECK_FOR or self._ask_due:
                self._recheck_at = now + _CHECK_EVERY
        if not batch:
            return []
        policy, costs, arrivals = self.policy, self.costs, self.arrivals
        while c.rows < c.limit:
            device_busy = busy is not None and not busy.ready()
            if busy is not None and not device_busy and may == 0 and not c.waiting:
                self._complete(inflight)  # answer the batch that just finished ...
                inflight.completed, busy = True, None
                pending, may = self._scan()  # ... and see who comes back
                self._fill(batch, c, pending)
                continue
            if batching.must_close(c.rows, c.limit, c.waiting, may):
                break   # what decide would say, at no cost
            now = time.monotonic()
            snap = batching.Snapshot(c.rows, c.oldest, c.waiting, may, device_busy, c.newest)
            close, wait = batching.decide(snap, now, costs.fit(c.key), arrivals.rate(now), policy,
                                          c.limit, self.turnaround.value)
            if close or (snap.device_busy and self._peer_free()):
                break
            if snap.device_busy:
                wait = min(wait, _BUSY_POLL)  # check the device now and then while waiting
            try:
                self.door.acquire(wait)
                self._drain_doorbell()
            except posix_ipc.BusyError:
                if not c.leftover:
                    continue  # nothing was published meanwhile: decide again, without a scan
            if snap.device_busy and self._peer_free():
                self.door.release()  # the news is for the idle peer
                break
            pending, may = self._scan()
            self._fill(batch, c, pending)
        self._rescan = c.leftover
        if (self.ctl.model_num > 1 or self.retiring) and c.leftover:
            self.door.release()  # leftovers (other shapes, no room): wake a peer process
        return batch

    # ------------------------------------------------------------ one batch
    def _gather(self, batch: List[Request]):
        Gather = self._Gather
        first = batch[0]
        sources = [[(r.peer.fd, r.offsets[k], r.nbytes[k],
                     r.mapped[1] if r.mapped and r.offsets[k] + r.nbytes[k] <= r.mapped[2] else 0)
                    for r in batch] for k in range(len(first.items))]
        return Gather(sum(r.rows for r in batch), first.items, first.dtypes, sources, names=first.names)

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
            self._show_graphs()

    def _show_graphs(self) -> None:
        """The instance row counts the CUDA graphs in use (captured off the serving thread)."""
        if self.engine.graph_total != self._graphs_shown:
            self._graphs_shown = self.ctl.all_instances[self.me]["graphs"] = self.engine.graph_total

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

        def settle():  # after the answers are written, before anyone is woken (see _answer)
            t_end = time.monotonic()
            try:
                if error is None:  # what this batch cost, for the batching policy
                    tm = result.times
                    self.costs.observe(batch[0].key, total, tm.h2d + tm.forward + tm.d2h
                                       if self.engine.cuda else t_end - t_close)
                self._account(batch, total, t_close, t_scatter, t_end, result, error is not None)
            except Exception:  # noqa: BLE001 - bookkeeping never fails a batch, nor the next one
                if not self._accounting_failed:
                    self._accounting_failed = True
                    logger.exception("%s accounting a batch failed (logged once)", self.tag)

        if error is not None:
            self._on_failure(batch, error, t_close)
            settle()
        else:
            self._answer(batch, result, t_close, total, short, settle)

    def _answer(self, batch: List[Request], result, t_close: float, total: int, short=(),
                before_wake=None) -> None:
        """Write every answer first, then wake the callers: a woken caller often takes this CPU
        at once, and should not delay the answers of the rest of its batch. ``before_wake`` runs
        in between: counters a caller reads after its answer already include it."""
        structure = result.structure
        offset = 0
        todo = [r for r in batch if not r.answered]
        single = len(batch) == 1  # its rows are the outputs: no slicing
        try:
            for i, r in enumerate(batch):
                if i in short:
                    self.counters["bad_requests"] += 1
                    self._respond(r, ST_BAD_REQUEST, "the request's input could not be read in full "
                                  "(its slot's segment was truncated)", t_close=t_close, total=total,
                                  wake=False)
                else:
                    outs = result.outputs if single else [o[offset:offset + r.rows] for o in result.outputs]
                    self._respond(r, ST_OK, "", outs, structure.code, t_close, total, wake=False,
                                  names=structure.names)
                offset += r.rows
            if before_wake is not None:
                before_wake()
        finally:
            for r in todo:
                if r.answered:
                    self._wake(r)

    def _on_failure(self, batch: List[Request], error: BaseException, t_close: float) -> None:
        """A batch failed: bisect it to find the requests that make the model fail (if isolation
        is on and there is more than one request), answer the others normally."""
        fatal = self.engine.cuda and _is_cuda_fatal(error)
        if fatal or len(batch) == 1 or not self.cfg.isolate_errors:
            text = _error_text(error)
            logger.error("%s forward failed for a batch of %d requests (%d rows): %s", self.tag,
                         len(batch), sum(r.rows for r in batch), text.split("\n", 2)[1])
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
                 t_close: float = 0.0, total: int = 0, wake: bool = True, names: bytes = b"") -> None:
        """Answer ``r`` (once); with ``wake=False`` the caller must call :meth:`_wake` after."""
        if r.answered:
            return
        r.answered = True
        self._open.pop(id(r), None)
        try:
            r.peer.respond(r.seq, status, text, outs, r.out_offset, structure, self.me, t_close, total,
                           wake=False, names=names)
            mark_answered(self.claim_words, r.slot, r.seq)
        except Exception:  # noqa: BLE001 - a closed peer: its client is gone
            logger.debug("%s answering slot %d failed", self.tag, r.slot, exc_info=True)
        if wake:
            self._wake(r)

    def _wake(self, r: Request) -> None:
        peer = r.peer
        peer.wake()
        peer.answered_at, peer.answered_seq = time.monotonic(), r.seq
        peer.inflight -= 1
        if not peer.inflight and peer in self.retired:
            self._close_peer(peer)

    def _account(self, batch, total, t_close, t_scatter, t_end, result, failed) -> None:
        c = self.count_words  # int64 words of this instance's COUNTERS record
        c[_C_REQUESTS] += len(batch)
        c[_C_BATCHES] += 1
        c[_C_ROWS] += total
        head = c[_C_HEAD]
        if result is not None:
            tm = result.times
            gather, h2d, forward, d2h = tm.gather, tm.h2d, tm.forward, tm.d2h
        else:
            gather = h2d = forward = d2h = 0.0
        # The runtime's own work on this batch: copy in (issue and DMA overlap), copy out, scatter
        # and wake. Not wall time minus forward: with pipelining, a batch also waits for the one
        # ahead of it on the device, which is neither its forward nor the runtime's cost.
        own = max(gather, h2d) + d2h
        queue_wait = t_close - sum([r.t_publish for r in batch]) / len(batch)
        _RECORD.pack_into(self._ring, head % RING * _RECORD.size,  # in the order of layout.B_FIELDS
                          t_close, total, len(batch), queue_wait, gather, h2d, forward, d2h,
                          t_end - t_scatter, own + (t_end - t_scatter), t_end)
        c[_C_HEAD] = head + 1
        self.h_batch[total if total <= BATCH_HIST_MAX else 0] += 1
        h_lat, h_queue, h_compute = self.h_latency, self.h_queue, self.h_compute
        h_compute[bisect_left(LAT_BOUNDS, t_end - t_close)] += 1
        lat_ns = queue_ns = 0
        late, target = 0, self._late_after
        for r in batch:
            # t_publish is the client's word: clamp it, a forged one only skews its own entry
            t_pub = min(max(r.t_publish, t_close - 3600.0), t_close)
            h_lat[bisect_left(LAT_BOUNDS, t_end - t_pub)] += 1
            lat_ns += int((t_end - t_pub) * 1e9)
            h_queue[bisect_left(LAT_BOUNDS, t_close - t_pub)] += 1
            queue_ns += int((t_close - t_pub) * 1e9)
            late += t_end - t_pub > target
        # The sums saturate: forged publish times (up to an hour each) must not overflow them,
        # nor make this accounting raise for every batch after.
        for h, ns in ((h_compute, int((t_end - t_close) * 1e9)), (h_lat, lat_ns), (h_queue, queue_ns)):
            total_ns = h[H_SUM] + ns
            h[H_SUM] = total_ns if total_ns < _I64_MAX else _I64_MAX
        if late:
            c[_C_OVER] += late


def _check_outputs(outputs, total: int) -> None:
    """Outputs must split back into per-request rows and fit the response layout."""
    if len(outputs) > MAX_IO:
        raise _bad_output(f"the model returned {len(outputs)} outputs; at most {MAX_IO} are supported")
    for j, o in enumerate(outputs):
        shape = o.shape
        if not shape or shape[0] != total:
            raise _bad_output(f"output {j} has shape {tuple(shape)}: expected {total} rows (the "
                              f"batch dimension first), got {shape[0] if shape else 'a scalar'}")
        if len(shape) > MAX_NDIM + 1:
            raise _bad_output(f"output {j} has {len(shape)} dimensions; at most {MAX_NDIM + 1} "
                              f"(rows + {MAX_NDIM}) are supported")
        if o.dtype not in _OUT_DTYPES:
            try:
                dtype_code(o.dtype)
            except TypeError as e:
                raise _bad_output(f"output {j}: {e}") from None
            _OUT_DTYPES.add(o.dtype)


_OUT_DTYPES: set = set()   # output dtypes the response layout was found to carry


def _bad_output(text: str) -> Exception:
    from .engine import BadModelOutput  # torch is imported only in model processes
    return BadModelOutput(text)


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
    return f"{type(e).__name__}\n{_one_line(_safe_str(e))}\n{tb}"


def _one_line(message: str, most: int = 600) -> str:
    """The caller's error message is one line. A message of several (TorchScript's: "The
    following operation failed in the TorchScript interpreter. ... RuntimeError: mat1 and mat2
    shapes cannot be multiplied") keeps its first and its last line, where the cause is; the
    whole of it is in the remote traceback."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1:
        message = f"{lines[0]} ... {lines[-1]}"
    elif lines:
        message = lines[0]
    return message if len(message) <= most else message[:most - 3] + "..."


def _is_cuda_fatal(e: BaseException) -> bool:
    """Errors after which the CUDA context cannot be used again (a device-side assert, an
    illegal address): the process must be replaced."""
    text = _safe_str(e)
    return isinstance(e, RuntimeError) and ("device-side assert" in text or "illegal memory access" in text
                                            or "CUDA error: an illegal" in text)
