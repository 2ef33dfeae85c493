"""Shared-memory layouts: the model's control block and each client's request slot.

NOTE [slot protocol]
--------------------
One *slot* per client thread. The client owns its data segment(s); the model's control block
holds a one-row-per-slot table that every model process can scan with numpy::

      client (one thread)                         model processes (model_num of them)
      -------------------                         -----------------------------------
      write inputs + request header
      table.state[s] = PUBLISHED   (hint)
      ready[s].post() -------------------------->  scan: state == PUBLISHED, oldest first
      doorbell.post() -------------------------->  wake; ready[s].trywait() == claim
                                                   (exactly one process wins: the kernel's
                                                    semaphore is the only arbiter, no lock)
                                                   table.state[s] = CLAIMED, claimer = me
                                                   gather -> forward -> write outputs
                                                   response header, state[s] = DONE
      done[s].wait(timeout) <---------------------  done[s].post()
      read outputs, state[s] = IDLE

The table's ``state`` is only a hint that lets the scan skip idle slots; ownership of a request
is decided by ``ready[s]`` alone, so a stale hint costs one failed trywait, never a duplicate.
Each field has one writer at a time (client before publish and after done, the claimer in
between), so the client side needs no lock and nothing is ever held across a crash.

Slot states (hint)::

    FREE --attach--> NEW --publish--> PUBLISHED --claim--> CLAIMED --respond--> DONE --read--> IDLE
                                ^            | withdraw (timeout before a claim)        |
                                +------------+-------------<--publish---------------------+

A batch waits for more requests only while some client is IDLE or DONE (it has sent before and
may send again). A NEW client -- attached, never used, like the slot of the thread that built a
SharedModel and then handed it to others -- does not hold batches back.

A client that times out after its request was claimed keeps the slot "stale" and drains the
late response (checked by sequence number) before its next request, so a late result can never
be returned to a later call.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from .shm import Segment

MAGIC = 0x5344424931  # "SDBI1"
MAX_IO = 8
MAX_NDIM = 8
DESC_WORDS = 4 + MAX_NDIM  # dtype code, ndim, offset, capacity, dims[MAX_NDIM]

# slot states (hint, see NOTE [slot protocol])
FREE, IDLE, PUBLISHED, CLAIMED, DONE, NEW = 0, 1, 2, 3, 4, 5
# control block states
STARTING, RUNNING, STOPPING, BROKEN = 0, 1, 2, 3
# instance states
INST_LOADING, INST_READY, INST_DEAD = 0, 1, 2
# response status
ST_OK, ST_MODEL_ERROR, ST_BAD_REQUEST, ST_STOPPED = 0, 1, 2, 3
# request flags
FLAG_PROBE = 1

DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64")
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(DTYPES)}


def dtype_code(dtype) -> int:
    try:
        return _DTYPE_CODE[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}") from None


def code_dtype(code: int) -> np.dtype:
    return np.dtype(DTYPES[int(code)])


def align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------- control block
# table rows (int64), one column per slot
T_GEN, T_ATTACHED, T_OWNER, T_STATE, T_SEQ, T_ROWS, T_KEY, T_CLAIMER = range(8)
T_ROWS_COUNT = 8
# header words
H_MAGIC, H_STATE, H_MAX_SLOTS, H_MODEL_NUM, H_MAX_BATCH, H_BROKEN_CODE, H_MSG_LEN = range(7)
# instance words
I_PID, I_STATE, I_DEVICE = range(3)
I_WORDS = 8
# output-spec table: key, n_out, is_tuple, valid, then MAX_IO descriptors
N_SPEC = 32
SPEC_WORDS = 4 + MAX_IO * DESC_WORDS
# statistics: per-instance counters and a ring of per-batch records
C_REQUESTS, C_BATCHES, C_ROWS, C_ERRORS, C_RING_HEAD = range(5)
N_COUNTERS = 8
# batch record fields (seconds unless noted); the breakdown of where a batch's time went
B_FIELDS = ("t_close", "rows", "requests", "queue_wait", "gather", "h2d", "forward", "d2h",
            "scatter", "runtime", "t_end")
RING = 4096
MSG_BYTES = 4096


@dataclass
class ControlBlock:
    """Views into one model's control segment."""

    seg: Segment
    header: np.ndarray      # int64[16]
    fheader: np.ndarray     # float64[8]: wait_time
    instances: np.ndarray   # int64[model_num, I_WORDS]
    table: np.ndarray       # int64[T_ROWS_COUNT, max_slots]
    t_publish: np.ndarray   # float64[max_slots]
    specs: np.ndarray       # int64[model_num, N_SPEC, SPEC_WORDS]
    counters: np.ndarray    # float64[model_num, N_COUNTERS]
    ring: np.ndarray        # float64[model_num, RING, len(B_FIELDS)]
    msg: np.ndarray         # uint8[MSG_BYTES]

    @staticmethod
    def size(max_slots: int, model_num: int) -> int:
        return sum(_ctl_parts(max_slots, model_num)[k][2] for k in _CTL_ORDER)

    @classmethod
    def create(cls, name: str, max_slots: int, model_num: int, max_batch: int,
               wait_time: float) -> "ControlBlock":
        seg = Segment(name, cls.size(max_slots, model_num), create=True)
        ctl = cls._views(seg, max_slots, model_num)
        ctl.header[H_STATE] = STARTING
        ctl.header[H_MAX_SLOTS] = max_slots
        ctl.header[H_MODEL_NUM] = model_num
        ctl.header[H_MAX_BATCH] = max_batch
        ctl.fheader[0] = wait_time
        ctl.header[H_MAGIC] = MAGIC  # last: attachers check it
        return ctl

    @classmethod
    def attach(cls, name: str) -> "ControlBlock":
        seg = Segment(name, 0, create=False)
        head = seg.ndarray(0, np.int64, (16,))
        if int(head[H_MAGIC]) != MAGIC:
            del head
            seg.close()
            raise RuntimeError(f"{name} is not a simpledbi control block (or not ready yet)")
        max_slots, model_num = int(head[H_MAX_SLOTS]), int(head[H_MODEL_NUM])
        del head
        return cls._views(seg, max_slots, model_num)

    @classmethod
    def _views(cls, seg: Segment, max_slots: int, model_num: int) -> "ControlBlock":
        parts = _ctl_parts(max_slots, model_num)
        off, views = 0, {}
        for k in _CTL_ORDER:
            dtype, shape, nbytes = parts[k]
            views[k] = seg.ndarray(off, dtype, shape)
            off += nbytes
        return cls(seg=seg, **views)

    @property
    def max_slots(self) -> int:
        return self.table.shape[1]

    @property
    def model_num(self) -> int:
        return self.instances.shape[0]

    @property
    def state(self) -> int:
        return int(self.header[H_STATE])

    def message(self) -> str:
        n = int(self.header[H_MSG_LEN])
        return bytes(self.msg[:n]).decode("utf-8", "replace")

    def set_state(self, state: int, message: str = "", code: int = 0) -> None:
        if message:
            data = message.encode("utf-8")[:MSG_BYTES]
            self.msg[:len(data)] = np.frombuffer(data, np.uint8)
            self.header[H_MSG_LEN] = len(data)
            self.header[H_BROKEN_CODE] = code
        self.header[H_STATE] = state

    def close(self) -> None:
        for k in _CTL_ORDER:
            setattr(self, k, None)
        self.seg.close()


_CTL_ORDER = ("header", "fheader", "instances", "table", "t_publish", "specs", "counters", "ring",
              "msg")


def _ctl_parts(max_slots: int, model_num: int):
    def part(dtype, shape):
        return (dtype, shape, align(int(np.prod(shape)) * np.dtype(dtype).itemsize, 64))
    return {
        "header": part(np.int64, (16,)),
        "fheader": part(np.float64, (8,)),
        "instances": part(np.int64, (model_num, I_WORDS)),
        "table": part(np.int64, (T_ROWS_COUNT, max_slots)),
        "t_publish": part(np.float64, (max_slots,)),
        "specs": part(np.int64, (model_num, N_SPEC, SPEC_WORDS)),
        "counters": part(np.float64, (model_num, N_COUNTERS)),
        "ring": part(np.float64, (model_num, RING, len(B_FIELDS))),
        "msg": part(np.uint8, (MSG_BYTES,)),
    }


# ---------------------------------------------------------------- client slot segment
HDR_WORDS = 256
# request words
R_SEQ, R_ROWS, R_NIN, R_FLAGS = 0, 1, 2, 3
R_DESC = 8
# response words
P_BASE = 128
P_SEQ, P_STATUS, P_NOUT, P_TUPLE, P_ERRLEN, P_CLAIMER, P_OUT_BYTES = (P_BASE + i for i in range(7))
P_DESC = P_BASE + 8
# float words (seconds, time.monotonic clock)
F_PUBLISH, F_CLOSE, F_DONE, F_BATCH_ROWS = range(4)
F_WORDS = 16
ERR_BYTES = 8192
DATA_OFFSET = align(HDR_WORDS * 8 + F_WORDS * 8 + ERR_BYTES)


def desc_view(words: np.ndarray, base: int, i: int) -> np.ndarray:
    return words[base + i * DESC_WORDS: base + (i + 1) * DESC_WORDS]


def write_desc(d: np.ndarray, dtype_c: int, shape: Sequence[int], offset: int = -1,
               capacity: int = -1) -> None:
    d[0] = dtype_c
    d[1] = len(shape)
    if offset >= 0:
        d[2] = offset
        d[3] = capacity
    d[4:4 + len(shape)] = shape
    d[4 + len(shape):] = 0


def read_desc(d: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...], int, int]:
    ndim = int(d[1])
    return code_dtype(d[0]), tuple(int(x) for x in d[4:4 + ndim]), int(d[2]), int(d[3])


def shape_key(dtype_codes: Sequence[int], item_shapes: Sequence[Sequence[int]], flags: int) -> int:
    """Requests with equal keys have equal item shapes and dtypes (up to CRC collisions, which the
    model process checks against the real descriptors)."""
    words: List[int] = [flags, len(item_shapes)]
    for c, s in zip(dtype_codes, item_shapes):
        words += [c, len(s), *s]
    return zlib.crc32(np.asarray(words, np.int64).tobytes()) + 1


def slot_name(namespace: str, model: str, slot: int, gen: int, part: str) -> str:
    return f"/{namespace}.{model}.s{slot}.g{gen}.{part}"


def ctl_name(namespace: str, model: str) -> str:
    return f"/{namespace}.{model}.ctl"


def doorbell_name(namespace: str, model: str) -> str:
    return f"/{namespace}.{model}.door"


def sem_name(namespace: str, model: str, slot: int, which: str) -> str:
    return f"/{namespace}.{model}.s{slot}.{which}"


class SlotViews:
    """Header views of one client slot's input segment (shared by client and model code)."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.words = seg.ndarray(0, np.int64, (HDR_WORDS,))
        self.floats = seg.ndarray(HDR_WORDS * 8, np.float64, (F_WORDS,))
        self.err = seg.ndarray(HDR_WORDS * 8 + F_WORDS * 8, np.uint8, (ERR_BYTES,))

    def set_error(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[:ERR_BYTES]
        self.err[:len(data)] = np.frombuffer(data, np.uint8)
        self.words[P_ERRLEN] = len(data)

    def error_text(self) -> str:
        n = int(self.words[P_ERRLEN])
        return bytes(self.err[:n]).decode("utf-8", "replace")

    def release(self) -> None:
        self.words = self.floats = self.err = None
