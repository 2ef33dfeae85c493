"""Runs one gathered batch through the model: gather -> (host->device) -> forward -> (device->host).
Only in model processes (it imports torch). The data paths are README's (Architecture, step 5): a slot
is read through its mapping of a sealed memfd, which cannot SIGBUS. Stage times: CUDA events on the
device (no extra synchronisation), ``perf_counter`` on the host."""
from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import ModelConfig
from .graphs import GraphsAndSizes, signature
from .layout import DTYPES, MAX_IO, MAX_NAMES, OUT_DICT, OUT_NAMEDTUPLE, OUT_TENSOR, OUT_TUPLE, encode_names

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove


class BadModelOutput(Exception):
    """The model returned something that cannot be split back into per-request rows."""


@dataclass
class Gather:
    """What one batch reads: ``sources[k][r] = (address, offset, nbytes, dma)``, request r's rows of input k
    in its client's slot mapped at ``address`` (``dma``: that address if registered for DMA, else 0)."""

    rows: int
    items: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[np.dtype, ...]
    sources: List[List[Tuple[int, int, int, int]]]
    names: Optional[Tuple[str, ...]] = None   # keyword inputs: the model is called with these names


def _read_bytes(dst: int, sources) -> None:
    """Copy each source -- ``(slot address, offset, nbytes, _)``: a mapping of a client's sealed
    memfd, the range checked against its size at intake -- to consecutive bytes at ``dst``."""
    for address, offset, nbytes, _ in sources:
        _memmove(dst, address + offset, nbytes)
        dst += nbytes


def resolve_device(device: str, ordinal: int = 0) -> torch.device:
    """``"cuda"`` and ``"auto"`` (with a GPU) mean *every visible GPU*: the ``ordinal``-th
    instance on such an entry gets GPU ``ordinal % device_count`` (CUDA_VISIBLE_DEVICES applies)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch.cuda.is_available() is False")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", ordinal % torch.cuda.device_count())
    return dev


def _parameters(fn):
    """(name, required) of each parameter ``fn`` takes by name (Python signature or TorchScript
    schema); None where that is unknown or any parameter is positional-only."""
    schema = getattr(fn, "schema", None)   # TorchScript methods and functions
    if schema is not None:
        return [(a.name, not a.has_default_value()) for a in schema.arguments if a.name != "self"]
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins, some C extensions
        return None
    if any(p.kind is p.POSITIONAL_ONLY for p in params):
        return None
    return [(p.name, p.default is p.empty) for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def input_names(cfg: ModelConfig, model) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(names clients may pass inputs by, those the forward requires -- a keyword call lacking one
    is refused in the client): ``cfg.input_names``, else the forward's parameters, at most MAX_NAMES."""
    params = _parameters(model.forward if isinstance(model, torch.nn.Module) else model) or []
    names = list(cfg.input_names or [n for n, _ in params if n.isidentifier()])
    if len(names) > MAX_NAMES:
        logger.warning("%s: forward takes %d parameters; only the first %d can be passed by name",
                       cfg.name, len(names), MAX_NAMES)
    names = tuple(names[:MAX_NAMES])
    return names, tuple(n for n, required in params if required and n in names)


def load_model(cfg: ModelConfig, device: torch.device):
    """Build the model from ``cfg.factory`` or load ``cfg.path`` (TorchScript or torch.export)."""
    if cfg.factory is not None:
        model = cfg.factory()
    elif cfg.path.endswith(".pt2"):
        program = torch.export.load(cfg.path)
        _check_batch_dimension(cfg, program)
        model = program.module()
    else:
        model = torch.jit.load(cfg.path, map_location=device)
    if not callable(model):
        raise TypeError(f"model {cfg.name!r}: expected an nn.Module or callable, got "
                        f"{type(model).__name__}")
    if isinstance(model, torch.nn.Module):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            model.eval()  # (torch.export modules refuse .eval(); they were exported in eval mode)
        model.to(device)
        if cfg.precision != "float32":
            model.to(getattr(torch, cfg.precision))
    return model


def _check_batch_dimension(cfg: ModelConfig, program) -> None:
    """A program exported with a fixed number of rows runs no batch of another size: it loaded, and
    the first such batch failed its callers with a guard ("Guard failed: x.size()[0] == 2")."""
    user = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        shape = getattr(node.meta.get("val"), "shape", None) if node.op == "placeholder" else None
        fixed = node.name in user and shape and isinstance(shape[0], int)
        if fixed and not shape[0] == 1 == cfg.max_batch_size:
            raise ValueError(
                f"{cfg.path} was exported with a fixed batch size: input {node.name!r} has {shape[0]} rows, "
                f"and batches of 1 to {cfg.max_batch_size} rows run here. Export it with a dynamic first "
                f"dimension: "
                f"torch.export.export(model, args, dynamic_shapes={{{node.name!r}: {{0: torch.export.Dim("
                f"'batch', max={max(cfg.max_batch_size, 2)})}}}})")


@dataclass
class BatchTimes:
    gather: float = 0.0
    h2d: float = 0.0
    forward: float = 0.0
    d2h: float = 0.0


class Structure(NamedTuple):
    """How a model's outputs are put back together: layout.OUT_* and, for a dict or namedtuple,
    its keys as the response carries them (layout.encode_names)."""

    code: int
    names: bytes = b""


@dataclass
class BatchResult:
    outputs: List[np.ndarray]     # one array per output, batch rows first
    structure: Structure
    times: BatchTimes = field(default_factory=BatchTimes)


class Engine(GraphsAndSizes):
    """The model, its device and the staging buffers of a model process (graphs: graphs.py)."""

    def __init__(self, cfg: ModelConfig, instance: int, model_procs_on_cpu: int = 1):
        self.cfg = cfg
        self.device = resolve_device(cfg.device_of(instance), cfg.gpu_ordinal(instance))
        self.cuda = self.device.type == "cuda"
        threads = cfg.num_threads or (1 if self.cuda else
                                      max(1, (os.cpu_count() or 1) // max(1, model_procs_on_cpu)))
        torch.set_num_threads(threads)
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.model = load_model(cfg, self.device)
        self.input_names, self.required_inputs = input_names(cfg, self.model)
        self.cast = getattr(torch, cfg.precision) if cfg.precision != "float32" else None
        self.gather_mode = cfg.gather if cfg.gather != "auto" else ("device" if self.cuda else "host")
        self._registered = {}                        # address -> size (cudaHostRegister)
        self._init_graphs(cfg)
        # Two sets of staging buffers: batch k+1 is copied in while batch k computes.
        self._sets = [_BufferSet(self.cuda) for _ in range(2 if self.cuda else 1)]
        self._next_set = 0
        self._cpu_views: Dict[tuple, tuple] = {}   # CPU: (input view, its address) by signature
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)        # forward + device->host
            self.copy_stream = torch.cuda.Stream(self.device)   # host->device
            self._dma = _Dma.find()
            # The serving thread's current stream, once: entering a stream context (and each
            # event's look-up of the current stream) cost ~4% of its time at a batch per 2.4 ms.
            torch.cuda.set_stream(self.stream)

    @property
    def wants_mapping(self) -> bool:
        """Whether clients' segments should be mapped and registered for per-request DMA."""
        return self.cuda and self.gather_mode == "device"

    def quiesce(self) -> None:
        """Wait for all device work (after an internal error dropped a batch in flight)."""
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001
                logger.exception("synchronising the device failed")

    # ------------------------------------------------------------ memory registration
    def register(self, address: int, size: int) -> bool:
        """Page-lock a client's shared memory (wants_mapping) so per-request DMAs need no bounce buffer."""
        if address not in self._registered:
            err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
            if int(err) != 0:
                logger.warning("cudaHostRegister(%d bytes) failed with %s; using pinned staging", size, err)
                return False
            self._registered[address] = size
        return True

    def unregister(self, address: int) -> None:
        if self._registered.pop(address, None) is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(address)

    def close(self) -> None:
        if self._capturer is not None:
            self._capturer.close()
        for address in list(self._registered):
            self.unregister(address)

    # ------------------------------------------------------------ staging buffers
    def _host_buf(self, bs: "_BufferSet", k: int, nbytes: int) -> np.ndarray:
        return _grown(bs.host, k, nbytes, (lambda n: _pinned(n).numpy()) if self.cuda else
                      (lambda n: np.empty(n, np.uint8)))

    # ------------------------------------------------------------ one batch
    def run_simple(self, g: Gather) -> BatchResult:
        """Compute a batch synchronously with buffers of its own (poison isolation retries run
        here, beside whatever the pipelined path has in flight)."""
        xs = []
        for k, (item, dt) in enumerate(zip(g.items, g.dtypes)):
            arr = np.empty((g.rows, *item), dt)
            _read_bytes(arr.ctypes.data, g.sources[k])
            xs.append(self._cast(torch.from_numpy(arr).to(self.device)))
        outs, structure = _as_list(self._forward(xs, g.names))
        return BatchResult([_to_numpy(o) for o in outs], structure)

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.cast) if self.cast is not None and x.is_floating_point() else x

    def _forward(self, xs: List[torch.Tensor], names: Optional[Tuple[str, ...]]):
        return self.model(*xs) if names is None else self.model(**dict(zip(names, xs)))

    def finish(self, launched: "Launched") -> BatchResult:
        """Wait for a launched batch and return its outputs (views of pinned memory, valid until
        the buffer set is reused two launches later)."""
        if launched.result is not None:
            return launched.result
        ev = launched.events
        ev["done"].synchronize()
        arrays = [p.numpy().view(_numpy_dtype(dt)).reshape(shape) for p, dt, shape in launched.hosts]
        times = BatchTimes(gather=launched.gather,
                           h2d=ev["start"].elapsed_time(ev["copied"]) / 1e3,
                           forward=ev["fwd_start"].elapsed_time(ev["fwd_end"]) / 1e3,
                           d2h=ev["fwd_end"].elapsed_time(ev["done"]) / 1e3)
        if launched.eager_sig is not None and self._graph_sizes:
            self._saw_eager(launched.eager_sig, launched.rows, launched.launch_cpu, times.forward)
        return BatchResult(arrays, launched.structure, times)

    def _run_cpu(self, g: Gather) -> BatchResult:
        t0 = time.perf_counter()
        xs = []
        host, views = self._sets[0].host, self._cpu_views
        for k, (item, dt) in enumerate(zip(g.items, g.dtypes)):
            # The staging view of this input's rows and its bytes, made once per (input, rows,
            # item, dtype, bytes) while the staging buffer stays the same. (Requests of a batch
            # share a shape key, a CRC a client could forge: the bytes decide what is read.)
            nbytes = sum([src[2] for src in g.sources[k]])
            key = (k, g.rows, item, dt, nbytes)
            view = views.get(key)
            if view is None:
                old = host[k] if k < len(host) else None
                buf = self._host_buf(self._sets[0], k, nbytes)
                if buf is not old or len(views) > 256:   # outgrown: views of the old one would keep it alive
                    views.clear()
                arr = buf[:nbytes].view(dt).reshape((g.rows, *item))
                view = views[key] = (arr, arr.ctypes.data)
            _read_bytes(view[1], g.sources[k])
            xs.append(self._cast(torch.from_numpy(view[0])))
        t1 = time.perf_counter()
        outs, structure = _as_list(self._forward(xs, g.names))  # (under torch.inference_mode())
        t2 = time.perf_counter()
        arrays = [_to_numpy(o) for o in outs]
        times = BatchTimes(gather=t1 - t0, forward=t2 - t1, d2h=time.perf_counter() - t2)
        return BatchResult(arrays, structure, times)

    def stage(self, g: Gather) -> "Launched":
        """Start a batch, first half: claim a buffer set (of two: NOTE [pipelining]) and enqueue
        the host->device copies on the copy stream, overlapping whatever the compute stream runs."""
        if not self.cuda:
            return Launched(gather_in=g)
        bs = self._sets[self._next_set]
        self._next_set ^= 1
        ev = bs.events
        t0 = time.perf_counter()
        rows = g.rows
        staged = []
        copy = self.copy_stream
        ev["start"].record(copy)
        for k, (item, dt) in enumerate(zip(g.items, g.dtypes)):
            sources = g.sources[k]
            nbytes = sum(src[2] for src in sources)
            # Room for max_batch_size rows: a batch may be padded (NOTE [first batch of a size]).
            # Safe to replace: the set's previous batch was synchronised before the set is reused.
            # Zeros, not garbage: rows past a batch may be computed as padding (never NaN from here).
            dev = _grown(bs.dev, k, max(nbytes, nbytes // rows * self.cfg.max_batch_size),
                         lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device))
            if self.gather_mode == "device" and all(src[3] for src in sources):
                self._gather_dma(dev, sources)
            else:
                if bs.host_copied:  # the last copy out of this pinned buffer must be done
                    ev["copied"].synchronize()
                buf = self._host_buf(bs, k, nbytes)[:nbytes]
                _read_bytes(buf.ctypes.data, sources)
                with torch.cuda.stream(copy):
                    dev[:nbytes].copy_(torch.from_numpy(buf), non_blocking=True)
                bs.host_copied = True
            staged.append((dev[:nbytes], dt, item))
        ev["copied"].record(copy)
        return Launched(events=ev, buffers=bs, staged=staged, rows=rows, gather=time.perf_counter() - t0,
                        names=g.names)

    def start(self, launched: "Launched") -> "Launched":
        """Second half: enqueue the forward pass and the device->host copies (CPU: compute it)."""
        if not self.cuda:
            launched.result = self._run_cpu(launched.gather_in)
            launched.gather_in = None
            return launched
        t0 = time.perf_counter()
        self.take_graphs()
        ev, bs, rows = launched.events, launched.buffers, launched.rows
        graph = None
        names = launched.names or (None,) * len(launched.staged)
        sig = tuple((tuple(item), np.dtype(dtype), name)
                    for (_, dtype, item), name in zip(launched.staged, names))
        if self._graph_sizes and rows <= self._graph_sizes[-1]:
            graphs = self._graphs.get(sig, {})
            size = min([n for n in graphs if n >= rows], default=None)   # the smallest graph that fits
            graph = graphs.get(size)
            bucket = min(n for n in self._graph_sizes if n >= rows)
            if (graph is None or size > bucket) and sig not in self._graph_failed \
                    and self._may_capture(sig, bucket):
                self._count_use(sig, bucket)
        stream = self.stream   # the current stream (__init__)
        stream.wait_event(ev["copied"])
        ev["fwd_start"].record(stream)
        if graph is not None:
            for k, (dev, _, _) in enumerate(launched.staged):
                graph.inputs_u8[k][:dev.numel()].copy_(dev)
            graph.graph.replay()
            outs, structure = [o[:rows] for o in graph.outputs], graph.structure
        else:
            ran_before = rows in self._sizes_run.get(sig, ())
            run = self._eager_rows(sig, rows, bs, launched.staged)  # NOTE [first batch of a size]
            # a size's first run (cuDNN choosing its plans, tens of ms on the host and the
            # device alike) says nothing about launching: not learned from
            launched.eager_sig = sig if ran_before or run != rows else None
            xs = []
            for k, (dev, dtype, item) in enumerate(launched.staged):
                if run != rows:
                    dev = bs.dev[k][:dev.numel() // rows * run]
                xs.append(self._cast(dev.view(_torch_dtype(dtype)).view((run, *item))))
            outs, structure = _as_list(self._forward(xs, launched.names))  # under inference_mode
            if run != rows:
                outs = [o[:rows] for o in outs]
        ev["fwd_end"].record(stream)
        hosts = []
        for j, o in enumerate(outs):
            o = o.detach()
            if o.dtype == torch.bfloat16:  # numpy has no bfloat16
                o = o.float()
            if o.device.type != "cuda":
                o = o.to(self.device)
            o = o.contiguous()
            nbytes = o.numel() * o.element_size()
            pinned = _grown(bs.out, j, nbytes, _pinned)[:nbytes]
            pinned.view(o.dtype).view(o.shape).copy_(o, non_blocking=True)
            hosts.append((pinned, o.dtype, tuple(o.shape)))
        ev["done"].record(stream)
        launched.hosts, launched.structure, launched.staged = hosts, structure, None
        launched.launch_cpu = time.perf_counter() - t0
        launched.started = True
        return launched

    def _gather_dma(self, dev: torch.Tensor, sources) -> None:
        """Host->device DMAs of each request's rows, straight from its registered shared memory."""
        if self._dma is not None:
            self._dma.copy(dev.data_ptr(), sources, self.copy_stream.cuda_stream)
            return
        pos = 0
        with torch.cuda.stream(self.copy_stream):
            for _, offset, n, address in sources:
                host = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address + offset))
                dev[pos:pos + n].copy_(torch.from_numpy(host), non_blocking=True)
                pos += n

    def warm_up(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[str], batch_sizes: Sequence[int],
                names: Optional[Tuple[str, ...]] = None) -> None:
        """Run the model on zero batches (inputs by ``names``, if given) so lazy initialisation
        (cuDNN plans, allocator pools, TorchScript profiling runs) is paid before the first request."""
        self._sizes_run.setdefault(signature(shapes, dtypes, names), set()).update(batch_sizes)
        with torch.inference_mode():
            for n in batch_sizes:
                for _ in range(3 if self.cuda else 1):
                    xs = [self._cast(torch.zeros((n, *s), dtype=_torch_dtype(d), device=self.device))
                          for s, d in zip(shapes, dtypes)]
                    for o in _as_list(self._forward(xs, names))[0]:
                        _to_numpy(o)   # as a batch's outputs are (one that cannot be answered fails here)


class _BufferSet:
    """Staging for one batch in flight: device inputs, pinned inputs (host gather), pinned
    outputs, and the events that time its stages."""

    def __init__(self, cuda: bool):
        self.dev, self.host, self.out = [], [], []
        self.host_copied = False
        self.events = ({n: torch.cuda.Event(enable_timing=True)
                        for n in ("start", "copied", "fwd_start", "fwd_end", "done")} if cuda else {})


@dataclass
class Launched:
    """A batch whose device work is enqueued (or, on the CPU, already computed)."""

    result: Optional[BatchResult] = None
    events: dict = field(default_factory=dict)
    buffers: Optional["_BufferSet"] = None
    gather_in: Optional[Gather] = None  # CPU: the inputs, until start() computes the batch
    staged: Optional[list] = None      # CUDA: (device bytes, dtype, item shape) per input
    rows: int = 0
    hosts: list = field(default_factory=list)
    structure: Structure = Structure(OUT_TENSOR)
    names: Optional[Tuple[str, ...]] = None   # keyword inputs
    gather: float = 0.0
    launch_cpu: float = 0.0            # host time spent enqueuing the forward pass
    eager_sig: Optional[tuple] = None  # its item signature, when it ran eagerly at a size run before
    started: bool = False

    def ready(self) -> bool:
        return self.result is not None or (self.started and self.events["done"].query())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _grown(bufs: list, k: int, nbytes: int, make):
    """``bufs[k]`` (a staging buffer), replaced by ``make(nbytes)`` when it is smaller."""
    while len(bufs) <= k:
        bufs.append(None)
    if bufs[k] is None or bufs[k].nbytes < nbytes:
        bufs[k] = make(nbytes)
    return bufs[k]


class _Dma:
    """Host->device copies through the CUDA runtime torch loaded, by ctypes: a few microseconds a request
    instead of a tensor slice, a from_numpy and a dispatch. Where the runtime has ``cudaMemcpyBatchAsync``
    (CUDA 12.8+), one call copies a whole batch's input: one ``cudaMemcpyAsync`` per request was 8% of a
    model process's serving thread on the fast command (run 38)."""

    def __init__(self, lib: ctypes.CDLL, version: int):
        self._one = lib.cudaMemcpyAsync
        self._one.restype = ctypes.c_int
        self._one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if version >= 12080 else None
        if self._batch is not None:
            # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs[, failIdx: 12.8-12.9 only], stream)
            self._batch.restype = ctypes.c_int
            self._batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                                            ctypes.c_size_t] + \
                [ctypes.c_void_p] * (2 if version < 13000 else 1)
            # one cudaMemcpyAttributes for every copy: source read in stream order (1), no location
            # hints (they apply to managed memory only), no flags
            self._attrs = (ctypes.c_uint32 * 6)(1, 0, 0, 0, 0, 0)
            self._attr_index = (ctypes.c_size_t * 1)(0)
            self._tail = (ctypes.byref(ctypes.c_size_t()),) if version < 13000 else ()

    @classmethod
    def find(cls) -> Optional["_Dma"]:
        """The copier of the libcudart torch mapped, or None if there is none."""
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        except OSError:
            return None
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
                version = ctypes.c_int(0)
                lib.cudaRuntimeGetVersion(ctypes.byref(version))
                return cls(lib, version.value)
            except (OSError, AttributeError):
                continue
        return None

    def copy(self, dst: int, sources, stream: int) -> None:
        """Copy each source -- ``(_, offset, nbytes, registered address)`` -- to consecutive device
        bytes at ``dst``, on ``stream``."""
        n = len(sources)
        if self._batch is not None and n > 1:
            sizes = np.fromiter([src[2] for src in sources], np.uint64, n)
            srcs = np.fromiter([src[3] + src[1] for src in sources], np.uint64, n)
            dsts = np.cumsum(sizes)
            dsts += dst
            dsts -= sizes
            err = self._batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, self._attrs,
                              self._attr_index, 1, *self._tail, stream)
            if not err:
                return
            logger.warning("cudaMemcpyBatchAsync failed with error %d; copying request by request", err)
            self._batch = None   # (a copy it did enqueue is made again below: same bytes)
        for _, offset, nbytes, address in sources:
            err = self._one(dst, address + offset, nbytes, 1, stream)  # 1: cudaMemcpyHostToDevice
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed with error {err}")
            dst += nbytes


_TENSOR, _TUPLE = Structure(OUT_TENSOR), Structure(OUT_TUPLE)
_STRUCTURES: Dict[tuple, Structure] = {}   # (code, type name, keys) -> Structure
_EXPECTED = (f"expected a tensor, or a tuple/list/dict/namedtuple of at most {MAX_IO} tensors "
             f"(not nested)")


def _as_list(out: Any) -> Tuple[List[torch.Tensor], Structure]:
    """The model's output as a flat list of tensors and the structure to rebuild it from. A
    dict (HuggingFace ``ModelOutput`` included) drops its None values."""
    if isinstance(out, torch.Tensor):
        return [out], _TENSOR
    if isinstance(out, dict):
        items = [(k, v) for k, v in out.items() if v is not None]
        code, type_name, leaves = OUT_DICT, "", [v for _, v in items]
        keys = tuple(k for k, _ in items)
        if not all(isinstance(k, str) for k in keys):
            raise BadModelOutput(f"{_EXPECTED}; got a {type(out).__name__} with keys of type "
                                 f"{', '.join(sorted({type(k).__name__ for k in keys}))} (expected str)")
    elif isinstance(out, tuple) and hasattr(type(out), "_fields"):
        code, type_name, leaves, keys = OUT_NAMEDTUPLE, type(out).__name__, list(out), tuple(out._fields)
        bad = [n for n in (type_name, *keys) if not (isinstance(n, str) and n.isidentifier())
               or n.startswith("_")]
        if bad:  # the caller rebuilds it with collections.namedtuple, which would refuse these
            raise BadModelOutput(f"{_EXPECTED}; got a namedtuple with names that are not "
                                 f"identifiers: {bad}")
    elif isinstance(out, (tuple, list)):
        code, leaves = OUT_TUPLE, list(out)
    else:
        raise BadModelOutput(f"{_EXPECTED}; got {type(out).__name__}")
    if not leaves or not all(isinstance(o, torch.Tensor) for o in leaves):
        kinds = sorted({type(o).__name__ for o in leaves}) or ["nothing"]
        raise BadModelOutput(f"{_EXPECTED}; got a {type(out).__name__} of {', '.join(kinds)}")
    if len(leaves) > MAX_IO:
        raise BadModelOutput(f"{_EXPECTED}; got a {type(out).__name__} of {len(leaves)} tensors")
    if code == OUT_TUPLE:
        return leaves, _TUPLE
    structure = _STRUCTURES.get((code, type_name, keys))
    if structure is None:
        try:
            names = encode_names(type_name, keys)
        except ValueError as e:
            raise BadModelOutput(f"{type(out).__name__} output: {e}") from None
        if len(_STRUCTURES) > 256:
            _STRUCTURES.clear()
        structure = _STRUCTURES[(code, type_name, keys)] = Structure(code, names)
    return leaves, structure


def _to_numpy(o: torch.Tensor) -> np.ndarray:
    """An output on the host as numpy (bfloat16 becomes float32: numpy has none)."""
    if o.is_cpu and not o.requires_grad and o.dtype in _TORCH_TO_NP:  # the common case, checked cheaply
        return o.contiguous().numpy()
    o = o.detach()
    if o.dtype == torch.bfloat16:
        o = o.float()
    if o.dtype not in _TORCH_TO_NP:
        raise _unsupported(o.dtype)
    return (o.contiguous() if o.device.type == "cpu" else o.cpu()).numpy()


_NP_TO_TORCH = {np.dtype(n): getattr(torch, n) for n in DTYPES}   # the dtypes a slot carries
_TORCH_TO_NP = {v: k for k, v in _NP_TO_TORCH.items()}


def _torch_dtype(dt) -> torch.dtype:
    return _NP_TO_TORCH[np.dtype(dt)]


def _numpy_dtype(dt: torch.dtype) -> np.dtype:
    try:
        return _TORCH_TO_NP[dt]
    except KeyError:
        raise _unsupported(dt) from None


def _unsupported(dt: torch.dtype) -> BadModelOutput:
    return BadModelOutput(f"output dtype {dt} is not supported; expected one of "
                          f"{', '.join(str(d) for d in _TORCH_TO_NP)} (cast it in the model)")
