"""The shared-memory layouts, as types: numpy structured dtypes viewed over the files in a
namespace's directory. Who may write what is part of each layout's definition:

=================  ==========================================  ===========================
file               contents                                     writers
=================  ==========================================  ===========================
``<m>.ctl``        HEADER, INSTANCE rows, CLAIM rows (one per     runtime + model processes;
                   slot), COUNTERS, the batch ring, a message,    clients map it read-only
                   the model's declared inputs (SPEC, JSON)
``<m>.table``      SLOT rows: one per slot, *hints* for the       each client its own row (the
                   model processes' scan                          reaper once it is dead)
``<m>.s<i>.lock``  empty; a POSIX lock on it = slot i is taken    its client
``<m>.s<i>.<tok>`` REQUEST header, RESPONSE header + RESP_SEQ,    client: request + inputs;
                   error text, input regions, output regions      model: the rest, by pwrite
=================  ==========================================  ===========================

Everything a client can write is input to a model process and is validated there
(:mod:`simpledbi.slots`); nothing a model process must trust lives where a client can write it.
"""
from __future__ import annotations

import json
import zlib
from typing import List, Sequence, Tuple

import numpy as np

from .shm import Segment, ns_path

MAGIC = 0x31494244535F  # "_SDBI1"
VERSION = 6
MAX_IO = 8          # inputs and outputs per request
MAX_NAMES = 48      # input names a model declares: bits 0..47 of a request's ``flags``
MAX_NDIM = 8        # dimensions of one item (an input or output row)
MAX_DIM = 2**31     # largest single dimension accepted from a client

DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64")
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(DTYPES)}
_CODE_DTYPE = tuple(np.dtype(n) for n in DTYPES)


def dtype_code(dtype) -> int:
    try:
        return _DTYPE_CODE[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}") from None


def code_dtype(code: int) -> np.dtype:
    """The dtype of a code; raises ValueError for a code out of range (it may come from a client)."""
    if not 0 <= code < len(_CODE_DTYPE):
        raise ValueError(f"unknown dtype code {code}")
    return _CODE_DTYPE[code]


def align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


def shape_key(dtype_codes: Sequence[int], item_shapes: Sequence[Sequence[int]], names: int = 0) -> int:
    """Requests with equal keys have equal item shapes, dtypes and input names (``names``: the
    request's ``flags`` mask, 0 for positional inputs). The model process recomputes the key from
    the validated request header; a client's key hint only orders the scan."""
    words: List[int] = [len(item_shapes), names]
    for c, s in zip(dtype_codes, item_shapes):
        words += [c, len(s), *s]
    return zlib.crc32(np.asarray(words, np.int64).tobytes()) + 1


# ---------------------------------------------------------------- control block (<m>.ctl)
# model states. DRAINING (numbered after the others: clients refuse new requests at state >=
# STOPPING) lets model processes finish what was published before the runtime stops.
STARTING, RUNNING, STOPPING, BROKEN, DRAINING = 0, 1, 2, 3, 4
STATE_NAMES = {STARTING: "starting", RUNNING: "running", STOPPING: "stopping", BROKEN: "broken",
               DRAINING: "draining"}
# instance states
# RETIRING (written by the runtime, a rolling reload): claim nothing new, answer what is held, exit.
INST_LOADING, INST_READY, INST_DEAD, INST_RESTARTING, INST_RETIRING = 0, 1, 2, 3, 4
INST_STATE_NAMES = {INST_LOADING: "loading", INST_READY: "ready", INST_DEAD: "dead",
                    INST_RESTARTING: "restarting", INST_RETIRING: "retiring"}

HEADER = np.dtype([
    ("magic", "<u8"), ("version", "<i8"), ("state", "<i8"), ("max_slots", "<i8"),
    ("model_num", "<i8"), ("max_batch", "<i8"), ("wait_time", "<f8"), ("supervisor_pid", "<i8"),
    ("broken_code", "<i8"), ("msg_len", "<i8"), ("bank", "<i8"), ("spec_len", "<i8"),
    ("deaths", "<i8"),      # model processes of this model found dead so far (by the supervisor)
    ("reserved", "<i8", (3,)),
])
# Instance rows come in two banks of model_num: a rolling reload starts the new processes in the
# other bank (while the current ones serve), then switches ``bank`` and retires the old ones.
INSTANCE = np.dtype([
    ("pid", "<i8"), ("state", "<i8"), ("device", "<i8"), ("restarts", "<i8"), ("t_start", "<f8"),
    ("graphs", "<i8"), ("free", "<i8"), ("reserved", "<i8"),
])
# Written by the model process that claimed the slot's request: pid and instance first, then
# token and seq (a client trusts a claim only when token and seq are its own); ``done`` = seq
# once answered (until its client reads the answer, it counts as a client that may send again).
CLAIM = np.dtype([("token", "<u8"), ("seq", "<i8"), ("instance", "<i8"), ("pid", "<i8"),
                  ("done", "<i8"), ("reserved", "<i8", (3,))])
COUNTERS = np.dtype([
    ("requests", "<i8"), ("batches", "<i8"), ("rows", "<i8"), ("errors", "<i8"),
    ("ring_head", "<i8"), ("isolated", "<i8"), ("bad_requests", "<i8"), ("over_target", "<i8"),
    ("claims_missed", "<i8"), ("reserved", "<i8", (7,)),   # 128 bytes a row
])
# batch record fields (seconds unless noted): where a batch's time went
B_FIELDS = ("t_close", "rows", "requests", "queue_wait", "gather", "h2d", "forward", "d2h",
            "scatter", "runtime", "t_end")
RING = 4096
MSG_BYTES = 4096
# Histograms kept by each model process (status, Prometheus): per request latency (publish to
# answer) and queue time (publish to batch close), per batch compute time (close to answered),
# all in LAT_BOUNDS buckets (upper bounds, seconds; then a +inf bucket, then the sum of the
# observations in nanoseconds at H_SUM); and batch sizes, exact up to BATCH_HIST_MAX rows (index n
# = n rows; index 0 = larger batches).
LAT_BOUNDS = tuple(round(1e-4 * 2 ** (k / 2), 7) for k in range(0, 40))   # 100 us .. 74 s
H_LATENCY, H_QUEUE, H_COMPUTE = 0, 1, 2
H_SUM = len(LAT_BOUNDS) + 1
BATCH_HIST_MAX = 128
SPEC_BYTES = 16384


def _parts(max_slots: int, rows: int):
    def part(dtype, shape):
        return dtype, shape, align(int(np.prod(shape)) * np.dtype(dtype).itemsize, 64)
    return {
        "header": part(HEADER, (1,)),
        "all_instances": part(INSTANCE, (rows,)),
        "claims": part(CLAIM, (max_slots,)),
        "counters": part(COUNTERS, (rows,)),
        "ring": part(np.float64, (rows, RING, len(B_FIELDS))),
        "hist": part(np.int64, (rows, 3, H_SUM + 1)),
        "batch_hist": part(np.int64, (rows, BATCH_HIST_MAX + 1)),
        "msg": part(np.uint8, (MSG_BYTES,)),
        "spec": part(np.uint8, (SPEC_BYTES,)),
    }


_HDR_STATE, _HDR_DEATHS = HEADER.fields["state"][1] // 8, HEADER.fields["deaths"][1] // 8


def words(arr: np.ndarray, fmt: str = "q") -> memoryview:
    """A contiguous array's memory as one flat memoryview (int64 words by default; "B" bytes,
    "Q" unsigned, "d" float64): an element read or written as a plain Python number costs a
    fraction of a numpy scalar. Release it before the segment under it closes."""
    assert arr.flags.c_contiguous  # else reshape would copy: writes would go nowhere
    raw = memoryview(arr.reshape(-1).view(np.uint8))
    return raw if fmt == "B" else raw.cast(fmt)


class ControlBlock:
    """Views into one model's control file. Clients attach it read-only."""

    PARTS = ("header", "all_instances", "claims", "counters", "ring", "hist", "batch_hist", "msg",
             "spec")

    def __init__(self, seg: Segment, max_slots: int, model_num: int):
        self.seg = seg
        self._model_num = model_num
        off = 0
        for k, (dtype, shape, nbytes) in _parts(max_slots, 2 * model_num).items():
            setattr(self, k, seg.ndarray(off, dtype, shape))
            off += nbytes
        self.hdr = self.header.reshape(())   # 0-d record: hdr["state"] reads and writes in place
        # the header's int64 words: ``state`` is read on every call, as a plain int
        self._hdr_words = words(self.header)

    @staticmethod
    def size(max_slots: int, model_num: int) -> int:
        return sum(p[2] for p in _parts(max_slots, 2 * model_num).values())

    @classmethod
    def create(cls, namespace: str, model: str, max_slots: int, model_num: int, max_batch: int,
               wait_time: float, supervisor_pid: int) -> "ControlBlock":
        seg = Segment(ctl_path(namespace, model), cls.size(max_slots, model_num), create=True)
        ctl = cls(seg, max_slots, model_num)
        h = ctl.hdr
        h["version"], h["state"], h["max_slots"] = VERSION, STARTING, max_slots
        h["model_num"], h["max_batch"], h["wait_time"] = model_num, max_batch, wait_time
        h["supervisor_pid"] = supervisor_pid
        h["magic"] = MAGIC  # last: attachers check it
        return ctl

    @classmethod
    def attach(cls, namespace: str, model: str, readonly: bool = True) -> "ControlBlock":
        seg = Segment(ctl_path(namespace, model), readonly=readonly)
        head = seg.ndarray(0, HEADER, (1,))[0]
        magic, version = int(head["magic"]), int(head["version"])
        max_slots, model_num = int(head["max_slots"]), int(head["model_num"])
        del head
        if magic != MAGIC or version != VERSION or not (
                0 < max_slots <= 65536 and 0 < model_num <= 4096
                and seg.size >= cls.size(max_slots, model_num)):
            seg.close()
            raise RuntimeError(f"{seg.path} is not a simpledbi v{VERSION} control block")
        return cls(seg, max_slots, model_num)

    @property
    def max_slots(self) -> int:
        return self.claims.shape[0]

    @property
    def model_num(self) -> int:
        """Model processes configured (one bank of instance rows)."""
        return self._model_num

    @property
    def rows(self) -> int:
        """Instance rows: two banks (see HEADER)."""
        return self.all_instances.shape[0]

    def active_rows(self) -> range:
        bank = int(self.hdr["bank"]) & 1
        return range(bank * self._model_num, (bank + 1) * self._model_num)

    @property
    def instances(self) -> np.ndarray:
        """The INSTANCE rows of the serving bank (``model_num`` of them); ``all_instances`` has
        both banks, indexed by a model process's row."""
        r = self.active_rows()
        return self.all_instances[r.start:r.stop]

    @property
    def state(self) -> int:
        return self._hdr_words[_HDR_STATE]

    @property
    def deaths(self) -> int:
        """How many of the model's processes the supervisor has found dead so far."""
        return self._hdr_words[_HDR_DEATHS]

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, str(self.state))

    def message(self) -> str:
        n = min(max(int(self.hdr["msg_len"]), 0), MSG_BYTES)
        return bytes(self.msg[:n]).decode("utf-8", "replace")

    def set_state(self, state: int, message: str = "", code: int = 0) -> None:
        if message:
            data = message.encode("utf-8")[:MSG_BYTES]
            self.msg[:len(data)] = np.frombuffer(data, np.uint8)
            self.hdr["msg_len"] = len(data)
            self.hdr["broken_code"] = code
        self.hdr["state"] = state

    def write_spec(self, names: Sequence[str], shapes, dtypes) -> None:
        """Publish the model's declared inputs (the runtime, once, before the model is RUNNING):
        input names, item shapes and dtypes (``None`` where not declared). Clients trust it."""
        data = json.dumps({"names": list(names), "shapes": shapes and [list(s) for s in shapes],
                           "dtypes": dtypes and list(dtypes)}).encode()
        if len(data) > SPEC_BYTES:
            raise ValueError(f"the declared inputs take {len(data)} bytes; at most {SPEC_BYTES} fit")
        self.spec[:len(data)] = np.frombuffer(data, np.uint8)
        self.hdr["spec_len"] = len(data)  # last: readers see all of it or nothing

    def declared(self) -> Tuple[Tuple[str, ...], Tuple[Tuple[int, ...], ...], Tuple[str, ...]]:
        """(input names, item shapes, dtypes) the runtime published; empty where none are."""
        n = int(self.hdr["spec_len"])
        if not 0 < n <= SPEC_BYTES:
            return (), (), ()
        d = json.loads(bytes(self.spec[:n]))
        return (tuple(d["names"]), tuple(tuple(s) for s in d["shapes"] or ()),
                tuple(d["dtypes"] or ()))

    def close(self) -> None:
        if self._hdr_words is not None:
            self._hdr_words.release()
        for k in self.PARTS + ("hdr", "_hdr_words"):
            setattr(self, k, None)
        self.seg.close()


# ---------------------------------------------------------------- slot table (<m>.table)
# slot states (hints written by the slot's client; see NOTE [slot protocol] in slots.py)
FREE, IDLE, PUBLISHED, NEW = 0, 1, 2, 3
SLOT = np.dtype([
    ("seq", "<i8"), ("rows", "<i8"), ("key", "<i8"), ("token", "<u8"), ("t_publish", "<f8"),
])


class SlotTable:
    """The client-writable table of hints: one SLOT row per slot index, then every slot's state
    in one contiguous int64 column (a model process scans it for each batch: a strided column
    of 512 rows cost two 5-10 us numpy passes, the contiguous one a fraction of that)."""

    def __init__(self, seg: Segment, max_slots: int):
        self.seg = seg
        self.rows = seg.ndarray(0, SLOT, (max_slots,))
        self.state = seg.ndarray(self.state_offset(max_slots), np.int64, (max_slots,))
        # column views, made once: the hot paths index them directly
        self.seq, self.nrows = self.rows["seq"], self.rows["rows"]
        self.key, self.token, self.t_publish = self.rows["key"], self.rows["token"], self.rows["t_publish"]
        # the same rows as raw bytes, for struct.pack_into (a client writes its row in one call)
        self.raw = words(self.rows, "B")

    @staticmethod
    def state_offset(max_slots: int) -> int:
        return align(max_slots * SLOT.itemsize, 64)

    @classmethod
    def size(cls, max_slots: int) -> int:
        return cls.state_offset(max_slots) + align(max_slots * 8, 64)

    @classmethod
    def create(cls, namespace: str, model: str, max_slots: int) -> "SlotTable":
        return cls(Segment(table_path(namespace, model), cls.size(max_slots), create=True), max_slots)

    @classmethod
    def attach(cls, namespace: str, model: str, max_slots: int) -> "SlotTable":
        seg = Segment(table_path(namespace, model))
        if seg.size < cls.size(max_slots):
            seg.close()
            raise RuntimeError(f"{seg.path} is smaller than its control block says")
        return cls(seg, max_slots)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.release()
        self.rows = self.state = self.seq = self.nrows = self.key = self.token = self.t_publish = None
        self.raw = None
        self.seg.close()


# ---------------------------------------------------------------- slot segment (<m>.s<i>.<tok>)
# Written by the client before publishing; read by a model process with one pread into private
# memory, then validated field by field. ``flags``: 0 for positional inputs; else a mask of the
# model's declared input names (bit j: name j) -- the inputs are those names, in ascending j.
REQUEST = np.dtype([
    ("magic", "<u8"), ("slot", "<i8"), ("token", "<u8"), ("seq", "<i8"), ("rows", "<i8"),
    ("n_in", "<i8"), ("flags", "<i8"), ("out_offset", "<i8"), ("t_publish", "<f8"),
    ("dtype", "<i8", (MAX_IO,)), ("ndim", "<i8", (MAX_IO,)), ("offset", "<i8", (MAX_IO,)),
    ("dims", "<i8", (MAX_IO, MAX_NDIM)),
])
# Written by the model process with pwrite; RESP_SEQ is written after it, last of all. A dict or
# namedtuple answer's keys follow the header, at NAMES_OFF (``names_len`` bytes, encode_names).
RESPONSE = np.dtype([
    ("status", "<i8"), ("n_out", "<i8"), ("structure", "<i8"), ("names_len", "<i8"), ("err_len", "<i8"),
    ("claimer", "<i8"), ("batch_rows", "<i8"), ("needed", "<i8"), ("t_close", "<f8"),
    ("t_done", "<f8"), ("dtype", "<i8", (MAX_IO,)), ("ndim", "<i8", (MAX_IO,)),
    ("offset", "<i8", (MAX_IO,)), ("dims", "<i8", (MAX_IO, MAX_NDIM + 1)),
])
REQ_OFF, RESP_OFF, RESP_SEQ_OFF = 0, 1024, 4088
NAMES_OFF = RESP_OFF + RESPONSE.itemsize      # right after the header: one pwrite writes both
NAMES_BYTES = RESP_SEQ_OFF - NAMES_OFF


def _word_index(dtype: np.dtype) -> dict:
    """Field name -> index of its first 8-byte word (every field of these records is 8 bytes
    wide), so a record read as ``int64`` words is decoded with plain list indexing."""
    assert all(dtype.fields[n][0].base.itemsize == 8 for n in dtype.names)
    return {n: dtype.fields[n][1] // 8 for n in dtype.names}


REQ_WORD = _word_index(REQUEST)
RESP_WORD = _word_index(RESPONSE)
ERR_OFF, ERR_BYTES = 4096, 8192
DATA_OFFSET = ERR_OFF + ERR_BYTES
assert REQUEST.itemsize <= RESP_OFF and NAMES_BYTES >= 2048 and RESP_SEQ_OFF + 8 <= ERR_OFF

# response status
ST_OK, ST_MODEL_ERROR, ST_BAD_REQUEST, ST_STOPPED, ST_INTERNAL = 0, 1, 2, 3, 4
# output structure: a tensor, a tuple (or list), a dict (keys in the names), a namedtuple (type
# name and fields in the names)
OUT_TENSOR, OUT_TUPLE, OUT_DICT, OUT_NAMEDTUPLE = 0, 1, 2, 3


def encode_names(type_name: str, keys: Sequence[str]) -> bytes:
    """The NAMES text of a dict / namedtuple answer (written by model processes)."""
    data = json.dumps([type_name, list(keys)]).encode()
    if len(data) > NAMES_BYTES:
        raise ValueError(f"the output names take {len(data)} bytes; at most {NAMES_BYTES} fit")
    return data


def decode_names(data: bytes) -> Tuple[str, Tuple[str, ...]]:
    type_name, keys = json.loads(data)
    return type_name, tuple(keys)


# ---------------------------------------------------------------- names
def ctl_path(namespace: str, model: str) -> str:
    return ns_path(namespace, f"{model}.ctl")


def table_path(namespace: str, model: str) -> str:
    return ns_path(namespace, f"{model}.table")


def lock_path(namespace: str, model: str, slot: int) -> str:
    return ns_path(namespace, f"{model}.s{slot}.lock")


def segment_path(namespace: str, model: str, slot: int, token: int) -> str:
    return ns_path(namespace, f"{model}.s{slot}.{token:016x}")


def doorbell_name(namespace: str, model: str) -> str:
    return f"/{namespace}.{model}.door"


def sem_name(namespace: str, model: str, slot: int, token: int, which: str) -> str:
    return f"/{namespace}.{model}.s{slot}.{token:016x}.{which}"
