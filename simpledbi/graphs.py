"""CUDA graphs and batch sizes, a part of :class:`simpledbi.engine.Engine`: which graphs to capture (off
the serving thread), and which batch size to run an eager batch at (NOTE [first batch of a size])."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Item signatures (shapes + dtypes) a model process keeps CUDA graphs for; others run eagerly.
MAX_GRAPH_SIGNATURES = 4
#: Eager batches of one (item signature, graph bucket) before its graph is captured.
GRAPH_AFTER_BATCHES = 3
#: An eager forward pass that takes at least this fraction of its device time to enqueue (averaged over
#: batches) marks a launch-bound model: the device waits on the Python thread, while a graph replay enqueues
#: in tens of microseconds, so cuda_graphs="auto" then captures large batches too. H200: ResNet-18 at
#: 112x112 ~1 (graphs: 0.49x -> 0.72x of plain PyTorch), ResNet-50 beside 128 busy clients ~0.6 (graphs
#: halved the p99); one long kernel stays far below (docs/BENCHMARKS.md run 38).
LAUNCH_BOUND = 0.5
#: A new batch size is padded to one already run until the padding rows spent on it reach this
#: many full batches (about the first-run cost of a size, NOTE [first batch of a size]).
PAD_BUDGET_BATCHES = 4


def signature(shapes, dtypes, names=None) -> tuple:
    """An item signature: (item shape, dtype, input name or None) per input."""
    return tuple((tuple(s), np.dtype(d), name)
                 for s, d, name in zip(shapes, dtypes, names or (None,) * len(shapes)))


def _describe(sig) -> str:
    return ", ".join(f"{name + ' ' if name else ''}{tuple(item)} {np.dtype(d)}" for item, d, name in sig)


class GraphsAndSizes:
    def _init_graphs(self, cfg) -> None:
        self._graphs: dict = {}                      # signature -> {batch size: _Graph}
        self._graph_sizes = cfg.graph_batch_sizes(launch_bound=True) if self.cuda else ()
        self._graph_sizes_always = set(cfg.graph_batch_sizes())   # the rest: once launch-bound
        self._launch_share: dict = {}                # signature -> enqueue / device time (EMA)
        self._launch_bound: set = set()              # signatures found launch-bound
        self._graph_queued: set = set()              # (signature, batch size) being captured
        self._graph_uses: dict = {}                  # (signature, batch size) -> eager batches
        self._graph_failed: set = set()              # signatures whose capture failed
        self._graph_pool = None
        self._capturer: Optional[_Capturer] = None
        self.graph_total = 0                         # graphs ready (the instance row shows it)
        # NOTE [first batch of a size]: a new batch size's first forward pass costs far more than the
        # next (cuDNN plans per shape, per thread: 33-54 ms against 4-5 ms for ResNet-50 on an H200,
        # experiments/first_batch_cost.py): 50 ms stalls in the tail at 128 workers. So an eager batch
        # of a size not run here yet is padded up to the smallest size that was (rows are independent,
        # as for CUDA graphs), and the new size runs once on zeros when the process is quiet. Under
        # constant load a size runs as itself once its padding rows add up to PAD_BUDGET_BATCHES full
        # batches: a rare size stays padded, a frequent one is bought within a few batches (padding
        # every new size for good took the 90%-load median from 3.9 to 11.4 ms, BENCHMARKS.md run 17).
        self._sizes_run: Dict[tuple, set] = {}     # signature -> eager batch sizes run here
        self._size_todo: List[tuple] = []          # (signature, size) to run once when quiet
        self._pad_waste: Dict[tuple, int] = {}     # (signature, size) -> padding rows spent on it
        self._pad_budget = PAD_BUDGET_BATCHES * cfg.max_batch_size

    # ------------------------------------------------------------ CUDA graphs
    def _count_use(self, sig, bucket: int) -> None:
        """A batch of this signature ran eagerly (or padded past its bucket): after a few, queue
        the graph of that bucket -- only sizes that actually occur are captured."""
        key = (sig, bucket)
        self._graph_uses[key] = self._graph_uses.get(key, 0) + 1
        if self._graph_uses[key] != GRAPH_AFTER_BATCHES:
            return
        sigs = set(self._graphs) | {s for s, _ in self._graph_queued}
        if sig not in sigs and len(sigs) >= MAX_GRAPH_SIGNATURES:
            logger.info("%s: item shapes %s run eagerly (CUDA graphs are kept for at most %d item "
                        "shapes per model process)", self.cfg.name, _describe(sig), MAX_GRAPH_SIGNATURES)
            return
        if self._capturer is None:
            self._capturer = _Capturer(self)
        self._graph_queued.add(key)
        self._capturer.submit(sig, bucket)

    def _may_capture(self, sig, bucket: int) -> bool:
        return bucket in self._graph_sizes_always or sig in self._launch_bound

    def _saw_eager(self, sig, rows: int, launch_cpu: float, forward: float) -> None:
        """An eager batch of ``rows`` took ``launch_cpu`` seconds to enqueue and ``forward`` on the
        device: learn whether this signature is launch-bound (LAUNCH_BOUND)."""
        if sig in self._launch_bound or rows <= max(self._graph_sizes_always, default=0) or forward <= 0:
            return
        # one batch counts at most as "all launch" (its first pinned output buffer, a GIL wait
        # on the capture thread can inflate it): it takes several in a row to mark the model
        share = 0.8 * self._launch_share.get(sig, 0.0) + 0.2 * min(launch_cpu / forward, 1.0)
        self._launch_share[sig] = share
        if share >= LAUNCH_BOUND:
            self._launch_bound.add(sig)
            logger.info("%s: item shapes %s are launch-bound (enqueueing a batch of %d rows took %.2f ms, "
                        "the device ran it in %.2f ms): capturing CUDA graphs for large batches too",
                        self.cfg.name, _describe(sig), rows, launch_cpu * 1e3, forward * 1e3)

    def take_graphs(self) -> None:
        """Put the graphs the capture thread finished to use (serving thread, between batches)."""
        if self._capturer is None or not self._capturer.finished:
            return
        for sig, n, graph, seconds in self._capturer.take():
            self._graph_queued.discard((sig, n))
            if sig in self._graph_failed:
                continue
            if isinstance(graph, BaseException):
                self._graph_failed.add(sig)
                self._graphs.pop(sig, None)
                logger.warning("%s: CUDA graph capture failed for item shapes %s (%s: %s); running "
                               "them eagerly", self.cfg.name, _describe(sig), type(graph).__name__, graph)
            else:
                self._graphs.setdefault(sig, {})[n] = graph
                logger.info("%s: CUDA graph captured for item shapes %s, %d rows, in %.0f ms (off "
                            "the serving thread)", self.cfg.name, _describe(sig), n, seconds * 1e3)
        self.graph_total = sum(len(g) for g in self._graphs.values())

    def _eager_rows(self, sig, rows: int, bs, staged) -> int:
        """How many rows to run an eager batch of ``rows`` with: itself if this process ran that
        size before (or no larger one), else the smallest larger size it ran, padded."""
        done = self._sizes_run.setdefault(sig, set())
        if rows in done:
            return rows
        if self.cfg.cuda_graphs is False:  # no padding: rows are not assumed independent
            done.add(rows)
            return rows
        room = min(bs.dev[k].numel() // (d.numel() // rows) for k, (d, _, _) in enumerate(staged))
        bigger = [m for m in done if rows < m <= room]
        key = (sig, rows)
        if bigger:
            pad = min(bigger)
            waste = self._pad_waste.get(key, 0) + pad - rows
            if waste < self._pad_budget:
                self._pad_waste[key] = waste
                if key not in self._size_todo and len(self._size_todo) < 4 * self.cfg.max_batch_size:
                    self._size_todo.append(key)
                return pad
        done.add(rows)   # no larger size run yet, or padding it cost enough: run it as itself
        self._pad_waste.pop(key, None)
        if key in self._size_todo:
            self._size_todo.remove(key)
        return rows

    def quiet_step(self) -> None:
        """One piece of quiet-time work, if any: run a new batch size once on zeros (so it is never
        padded again). On the serving thread: cuDNN's plans are cached per thread."""
        if self._size_todo:
            sig, n = self._size_todo.pop(0)
            names = None if sig[0][2] is None else tuple(name for _, _, name in sig)
            with torch.cuda.stream(self.stream):
                self.warm_up([item for item, _, _ in sig], [d for _, d, _ in sig], [n], names)
            self.stream.synchronize()

    def capture_graphs(self, shapes, dtypes, sizes, names=None) -> None:
        """CUDA: capture graphs for one item signature now (at load time, from ``input_shapes``)."""
        sig = signature(shapes, dtypes, names)
        try:
            for n in sorted(sizes, reverse=True):
                self._graphs.setdefault(sig, {})[n] = self._capture(sig, n)
        except BaseException:
            self._graphs.pop(sig, None)
            torch.cuda.synchronize(self.device)
            raise
        finally:
            self.graph_total = sum(len(g) for g in self._graphs.values())

    def _capture(self, sig, n: int) -> "_Graph":
        """Capture the forward pass of ``n`` rows of ``sig`` (static zero inputs), on a stream of its own and
        thread-local: the serving thread goes on launching (NOTE [graphs captured off the serving thread])."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()  # one pool: graphs replay in turn
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode(), torch.cuda.stream(side):
            from .engine import _as_list, _torch_dtype
            inputs = [torch.zeros((n, *item), dtype=_torch_dtype(d), device=self.device)
                      for item, d, _ in sig]
            names = None if sig[0][2] is None else tuple(name for _, _, name in sig)

            def step():
                return self._forward([self._cast(x) for x in inputs], names)

            for _ in range(3):  # lazy initialisation (cuDNN plans, allocator) outside the capture
                step()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._graph_pool, capture_error_mode="thread_local")
            try:
                outs, structure = _as_list(step())
            finally:
                graph.capture_end()
        side.synchronize()
        return _Graph(graph, [x.reshape(-1).view(torch.uint8) for x in inputs], outs, structure)


@dataclass
class _Graph:
    graph: Any
    inputs_u8: List[torch.Tensor]   # flat byte views of the static inputs (DMA targets)
    outputs: List[torch.Tensor]
    structure: Any   # engine.Structure


class _Capturer:
    """NOTE [graphs captured off the serving thread]: capturing a CUDA graph means running the new size
    eagerly first (its cuDNN plans, 30-50 ms for ResNet-50 on an H200), then recording it. Between
    batches that stalled every caller queued behind; waiting for an idle moment, a busy process never
    captured, and its small batches stayed eager and launch-bound (the 75-90% load tail). So one thread
    per model process captures, on its own stream in thread-local capture mode, and the serving thread
    takes each finished graph between two batches. Captures share one memory pool and run one at a time;
    only the serving thread replays, so graphs never run concurrently (the pool's condition). Costs: the
    model is called from two threads at once (inference only), and warm-up runs take GPU time."""

    def __init__(self, engine):
        self._engine = engine
        self._todo: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: List[tuple] = []      # (signature, rows, _Graph or the exception, seconds)
        self.finished = False             # unlocked read: a hint checked before every batch
        self._thread = threading.Thread(target=self._run, name="simpledbi-graph-capture", daemon=True)
        self._thread.start()

    def submit(self, sig, n: int) -> None:
        self._todo.put((sig, n))

    def take(self) -> List[tuple]:
        with self._lock:
            done, self._done, self.finished = self._done, [], False
        return done

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)   # captures take < 1 s each; a stuck one ends with the process

    def _run(self) -> None:
        engine = self._engine
        torch.cuda.set_device(engine.device)   # the current device is per thread
        while True:
            item = self._todo.get()
            if item is None:
                return
            sig, n = item
            t0 = time.perf_counter()
            try:
                graph = engine._capture(sig, n)
            except Exception as e:  # noqa: BLE001 - reported to the serving thread: eager stays
                graph = e
            with self._lock:
                self._done.append((sig, n, graph, time.perf_counter() - t0))
                self.finished = True


