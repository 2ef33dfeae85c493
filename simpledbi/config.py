"""Configuration: frozen, picklable dataclasses, validated in ``__post_init__`` (TypeError/ValueError
saying what was expected and what came), so a mistake surfaces in the parent before any process starts."""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["ModelConfig", "RuntimeOptions"]

from .layout import DTYPES, MAX_HELD, MAX_MODEL_NUM, MAX_NAMES, held_cap
from .naming import NAME_RE as MODEL_NAME_RE   # what a model (like a runtime) may be called

_PRECISIONS = ("float32", "float16", "bfloat16")
_GATHER_MODES = ("auto", "host", "device")
_MPS_MODES = ("auto", "on", "off")
_AUTO_GRAPH_MAX_ROWS = 8


def _check_type(name: str, value: Any, types, expected: str) -> None:
    if not isinstance(value, types) or isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def _check_range(name: str, value: Any, types, expected: str, ok: Callable[[Any], bool], wanted: str) -> None:
    """``_check_type``, then ValueError "<name>: expected <wanted>, got <value>" unless ``ok``."""
    _check_type(name, value, types, expected)
    if not ok(value):
        raise ValueError(f"{name}: expected {wanted}, got {value}")


def _normalize_devices(device) -> Tuple[str, ...]:
    devices = [device] if isinstance(device, str) else device
    if not isinstance(devices, (list, tuple)) or not devices:
        raise TypeError(f"device: expected a str or a non-empty list of str, got {device!r}")
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"device: expected str entries, got {type(d).__name__} {d!r}")
        if not (d in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", d)):
            raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or 'auto', got {d!r}")
    return tuple(devices)


#: The largest max_batch_size whose HELD rows fit a control block (held_cap is linear: 262084).
_MAX_BATCH = (MAX_HELD - held_cap(0)) // (held_cap(1) - held_cap(0))


@dataclass(frozen=True)
class ModelConfig:
    """One named model served by ``model_num`` model processes.

    Give either ``path`` (a TorchScript file, or a ``torch.export`` ``.pt2`` file) or ``factory`` (a
    picklable callable, called once in each model process, returning an ``nn.Module`` or any callable
    taking tensors). A request is batched with others of the same item shape; a batch closes at
    ``max_batch_size`` rows, at once when no attached client could send another request, and otherwise
    when waiting longer would not pay (NOTE [adaptive batching]): ``wait_time`` only bounds that wait."""

    name: str
    path: Optional[str] = None
    factory: Optional[Callable[[], Any]] = None
    max_batch_size: int = 32
    model_num: int = 1
    #: Upper bound, in seconds (at most 1), on how long a request waits for others to join its batch.
    wait_time: float = 0.003
    #: Seconds: keep p99 latency (publish to answer) under this where load allows, by capping
    #: waits and batch sizes; answers later than it are counted in stats()["over_target"].
    latency_target: Optional[float] = None
    #: "adaptive" (default): wait only as long as the learned costs say it pays; "fixed": wait up
    #: to wait_time whenever an attached client may still send (the policy of simpledbi 0.1).
    batching: str = "adaptive"
    device: Union[str, Sequence[str]] = "auto"
    #: Item shapes (without the batch dimension) to warm the model up with at load time (and capture CUDA
    #: graphs for). One tuple per input; positional requests with another input count are rejected.
    #: Published to clients: ``SharedModel(name)`` then needs no ``max_shape``.
    input_shapes: Optional[Sequence[Sequence[int]]] = None
    #: numpy dtype names of the inputs (one per ``input_shapes`` entry), for the warm-up; float32 when
    #: omitted, and then requests of any dtype are taken. When given, requests of other dtypes are
    #: rejected with "expected <dtype>", by clients before they send.
    input_dtypes: Optional[Sequence[str]] = None
    #: The names clients may pass inputs by (``forward(input_ids=x)``); the model is then called with
    #: those keywords. Default: the parameters of the model's ``forward`` (its signature, or its
    #: TorchScript schema), at most 48. When given with ``input_shapes``, one name per shape.
    input_names: Optional[Sequence[str]] = None
    #: Cast parameters and floating inputs to this precision on the device.
    precision: str = "float32"
    #: torch intra-op threads per model process (CPU); None: cores / CPU model processes.
    num_threads: Optional[int] = None
    #: How a batch reaches the device: "host" = np.concatenate into a pinned staging buffer and one copy;
    #: "device" = one DMA per request from registered shared memory; "auto": device on CUDA.
    gather: str = "auto"
    #: CUDA graphs: "auto" (default: on CUDA, batches of up to 8 rows, captured per item shape that
    #: arrives, off the serving thread; eager meanwhile, and for good if capture fails), True (all sizes),
    #: False, or the batch sizes. With ``input_shapes`` they are captured at load time (True / sizes:
    #: failure is an error). A batch is padded up to the next captured size: like batching, this assumes
    #: independent rows (eval-mode networks).
    cuda_graphs: Union[bool, str, Sequence[int]] = "auto"
    #: Client slots one model process maps at once: a slot per call in flight of each handle; idle ones
    #: are unmapped to make room (README: max_clients).
    max_clients: int = 512
    #: Seconds a model process may take to load and warm up before Run gives up.
    load_timeout: float = 300.0
    #: When a forward pass raises for a batch of several requests, retry halves of it until the requests
    #: that make the model fail are found: only they get ModelError.
    isolate_errors: bool = True
    #: A dead model process is restarted after ``restart_backoff`` seconds, doubling per failure (at most
    #: 10 s); after more than ``max_restarts`` failures within ``restart_window`` seconds the model is
    #: marked broken and every caller gets ModelProcessDied.
    max_restarts: int = 5
    restart_window: float = 60.0
    restart_backoff: float = 0.1
    #: Past capacity (NOTE [overload]): at most this many requests wait across the model's processes; a
    #: newcomer beyond it gets ``Overloaded`` at once (unless it outranks a waiting one). 0: nothing waits
    #: (a batch or a refusal). None: no bound but the deadlines.
    max_queue: Optional[int] = None
    #: Seconds: the timeout of a call that gives none. A request that cannot be answered within
    #: its timeout, given the queue ahead and the learned cost, is refused at once (Overloaded).
    default_timeout: Optional[float] = None

    def __post_init__(self):
        _check_type("name", self.name, str, "str")
        if not MODEL_NAME_RE.match(self.name):
            raise ValueError(f"name: expected 1-48 letters, digits, '_' or '-', got {self.name!r}")
        if (self.path is None) == (self.factory is None):
            raise ValueError(f"model {self.name!r}: expected exactly one of path= or factory=, got "
                             f"path={self.path!r}, factory={self.factory!r}")
        if self.path is not None:
            _check_type("path", self.path, (str, os.PathLike), "a file path")
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.factory is not None and not callable(self.factory):
            raise TypeError(f"factory: expected a callable, got {type(self.factory).__name__}")
        _check_range("max_batch_size", self.max_batch_size, int, "int", lambda v: 1 <= v <= _MAX_BATCH,
                     f"1..{_MAX_BATCH}")
        _check_range("model_num", self.model_num, int, "int", lambda v: 1 <= v <= MAX_MODEL_NUM,
                     f"1..{MAX_MODEL_NUM}")
        _check_range("wait_time", self.wait_time, (int, float), "a number of seconds",   # above 1: ms typed as s
                     lambda v: 0 <= v <= 1, "0 <= seconds <= 1 (e.g. wait_time=0.003 for 3 ms)")
        object.__setattr__(self, "wait_time", float(self.wait_time))
        if self.latency_target is not None:
            _check_range("latency_target", self.latency_target, (int, float), "seconds or None",
                         lambda v: 0 < v <= 3600, "0 < seconds <= 3600")
            object.__setattr__(self, "latency_target", float(self.latency_target))
        if self.batching not in ("adaptive", "fixed"):
            raise ValueError(f"batching: expected 'adaptive' or 'fixed', got {self.batching!r}")
        object.__setattr__(self, "device", _normalize_devices(self.device))
        if self.input_shapes is not None:
            try:
                shapes = tuple(tuple(int(d) for d in s) for s in self.input_shapes)
            except TypeError:   # (16,) for [(16,)]: a shape, not a list of them
                shapes = ()
            if not shapes or any(d < 1 for s in shapes for d in s):
                raise ValueError(f"input_shapes: expected a list of item shapes of positive ints, one "
                                 f"per input, e.g. [(3, 224, 224)], got {self.input_shapes!r}")
            object.__setattr__(self, "input_shapes", shapes)
        if self.input_dtypes is not None:
            if self.input_shapes is None or len(self.input_dtypes) != len(self.input_shapes):
                raise ValueError("input_dtypes: expected one dtype per entry of input_shapes, got "
                                 f"{self.input_dtypes!r}")
            for d in self.input_dtypes:
                with contextlib.suppress(TypeError):   # not a dtype at all
                    if np.dtype(d).name in DTYPES:
                        continue
                raise ValueError(f"input_dtypes: expected numpy dtypes of {', '.join(DTYPES)}, got {d!r}")
            object.__setattr__(self, "input_dtypes", tuple(np.dtype(d).name for d in self.input_dtypes))
        if self.input_names is not None:
            if not isinstance(self.input_names, (list, tuple)):
                raise TypeError(f"input_names: expected a list of str, got {self.input_names!r}")
            names = tuple(self.input_names)
            if not 1 <= len(names) <= MAX_NAMES or len(set(names)) != len(names) or not all(
                    isinstance(n, str) and n.isidentifier() for n in names):
                raise ValueError(f"input_names: expected 1..{MAX_NAMES} unique identifiers, got "
                                 f"{self.input_names!r}")
            if self.input_shapes is not None and len(self.input_shapes) != len(names):
                raise ValueError(f"input_names: expected one name per entry of input_shapes "
                                 f"({len(self.input_shapes)}), got {len(names)}")
            object.__setattr__(self, "input_names", names)
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision: expected one of {_PRECISIONS}, got {self.precision!r}")
        if self.num_threads is not None:
            _check_range("num_threads", self.num_threads, int, "int or None", lambda v: v >= 1, ">= 1")
        if self.gather not in _GATHER_MODES:
            raise ValueError(f"gather: expected one of {_GATHER_MODES}, got {self.gather!r}")
        if isinstance(self.cuda_graphs, str) and self.cuda_graphs != "auto":
            raise ValueError(f"cuda_graphs: expected 'auto', True, False or batch sizes, got "
                             f"{self.cuda_graphs!r}")
        if self.cuda_graphs is True:
            object.__setattr__(self, "cuda_graphs", self._default_graph_sizes())
        elif self.cuda_graphs is not False and self.cuda_graphs != "auto":
            try:
                sizes = {int(n) for n in self.cuda_graphs} | {self.max_batch_size}
            except TypeError:
                raise TypeError(f"cuda_graphs: expected True or a list of batch sizes, got "
                                f"{self.cuda_graphs!r}") from None
            sizes = tuple(sorted(n for n in sizes if 1 <= n <= self.max_batch_size))
            object.__setattr__(self, "cuda_graphs", sizes)
        _check_range("max_clients", self.max_clients, int, "int", lambda v: 1 <= v <= 65536, "1..65536")
        _check_type("load_timeout", self.load_timeout, (int, float), "seconds")
        _check_type("isolate_errors", self.isolate_errors, bool, "bool")
        if self.max_queue is not None:
            _check_range("max_queue", self.max_queue, int, "int or None", lambda v: 0 <= v <= 2**31,
                         "0..2**31 requests or None")
        if self.default_timeout is not None:
            _check_range("default_timeout", self.default_timeout, (int, float), "seconds or None",
                         lambda v: 0 < v <= 86400, "0 < seconds <= 86400")
            object.__setattr__(self, "default_timeout", float(self.default_timeout))
        _check_range("max_restarts", self.max_restarts, int, "int", lambda v: v >= 0, ">= 0")
        for field_name in ("restart_window", "restart_backoff"):
            _check_range(field_name, getattr(self, field_name), (int, float), "seconds",
                         lambda v: 0 <= v <= 3600, "0..3600 seconds")

    def _default_graph_sizes(self) -> Tuple[int, ...]:
        step = max(1, self.max_batch_size // 8)
        sizes = {1, 2, 4, self.max_batch_size} | set(range(step, self.max_batch_size + 1, step))
        return tuple(sorted(n for n in sizes if n <= self.max_batch_size))

    def graph_batch_sizes(self, launch_bound: bool = False) -> Tuple[int, ...]:
        """The batch sizes to capture CUDA graphs for (empty: none). "auto" captures small batches (up to
        8 rows), where launching the kernels costs as much as running them, and larger ones only for a
        model whose forward pass proved ``launch_bound`` (graphs.LAUNCH_BOUND): elsewhere padding a batch
        up to a bucket costs more than it saves (ResNet-50, 128 workers / max batch 32: 1.09x of plain
        PyTorch without them, 0.99x with), while a fast model's eager batches leave the device waiting
        on the CPU (ResNet-18 at 112x112 on an H200: 0.52x without them, 0.76x with, run 38)."""
        if self.cuda_graphs is False:
            return ()
        if self.cuda_graphs == "auto":
            return tuple(n for n in self._default_graph_sizes() if launch_bound or n <= _AUTO_GRAPH_MAX_ROWS)
        return tuple(self.cuda_graphs)

    def device_of(self, instance: int) -> str:
        """The device string of model process ``instance`` (devices are dealt round-robin)."""
        return self.device[instance % len(self.device)]

    def gpu_ordinal(self, instance: int) -> int:
        """Among the instances dealt the same ``device`` entry, which one this is: instances on
        an unindexed "cuda" / "auto" entry are spread over every visible GPU by it."""
        return instance // len(self.device)


@dataclass(frozen=True)
class RuntimeOptions:
    """Knobs of the runtime itself, shared by ``Run`` and its children. ``poll_interval`` bounds every
    wait on another process: after it a sleeper checks that the other side is alive, so nothing waits
    forever on a dead process (an idle runtime wakes once per interval per process)."""

    poll_interval: float = 0.5
    #: How long shutdown waits for a process it asked to stop before it kills it: a model process
    #: first finishes the batch it runs (seconds, for a large model on a slow device).
    join_timeout: float = 10.0
    #: CUDA MPS: "auto" starts a private MPS control daemon when two or more model processes share a
    #: CUDA device, "on" always (an error if it cannot be started), "off" never (mps.py).
    mps: str = "auto"

    def __post_init__(self):
        _check_range("poll_interval", self.poll_interval, (int, float), "seconds",
                     lambda v: 0.001 <= v <= 60, "0.001..60 s")
        _check_type("join_timeout", self.join_timeout, (int, float), "seconds")
        _check_type("mps", self.mps, str, f"one of {_MPS_MODES}")
        if self.mps not in _MPS_MODES:
            raise ValueError(f"mps: expected one of {_MPS_MODES}, got {self.mps!r}")
