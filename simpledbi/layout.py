"""The shared layouts, as types: numpy structured dtypes and structs over a model's control block,
a client's slot segment and the request datagram. Who may write what is part of each definition:

====================  ========================================  ============================
what                  contents                                   writers
====================  ========================================  ============================
``<m>.ctl`` (memfd)   HEADER, INSTANCE rows, per instance the    runtime + model processes;
                      requests it holds (HELD rows), COUNTERS,   clients map it read-only
                      the batch ring, a message, the model's
                      declared inputs (SPEC, JSON)
``<m>.sock``          the model's request socket: one datagram   clients send; the kernel
                      per request (REQ_PREFIX + its layout)      says who sent each
client slot (memfd)   two words (ticket, done: futex.py), the    client: request inputs,
                      published seq, who claimed it, RESPONSE    PUB_SEQ; model: the rest
                      header + RESP_SEQ, error text, inputs,
                      outputs
====================  ========================================  ============================

Both memory objects are sealed memfds (shm.py). Everything a client writes is input to a model process,
validated there (slots.py); nothing a model process must trust lives where a client writes.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .shm import Segment, ns_path

MAGIC = 0x31494244535F  # "_SDBI1"
VERSION = 11   # the control block and the request datagram (11: REQ_PREFIX's last field 64 bits)
MAX_IO = 8          # inputs and outputs per request
MAX_NAMES = 48      # input names a model declares: bits 0..47 of a request's ``flags``
MAX_NDIM = 8        # dimensions of one item (an input or output row)
MAX_DIM = 2**31     # largest single dimension accepted from a client
MAX_PRIORITY = 1000  # a call's priority: -MAX_PRIORITY..MAX_PRIORITY (model processes clamp a scribbled one)

DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64")
_DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(DTYPES)}
_CODE_DTYPE = tuple(np.dtype(n) for n in DTYPES)


def dtype_code(dtype) -> int:
    if str(dtype).startswith("torch."):   # torch.float16 and the like: the numpy dtype of that name
        dtype = str(dtype)[6:]
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
    """A CRC of a request's item shapes, dtypes and input names (``names``: its ``flags`` mask, 0 for
    positional inputs), from its validated layout: what batch costs are learned by. A client can make
    keys collide: requests share a batch only if their Layout.kind, compared exactly, is equal."""
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
    ("held_cap", "<i8"),    # HELD rows per instance: the most requests a model process holds
    ("sock_ino", "<i8"),    # the inode of the model's request socket (clients check it)
    ("default_timeout", "<f8"),   # ModelConfig.default_timeout (0: none): clients apply it
    ("max_queue", "<i8"),   # ModelConfig.max_queue (-1: none): clients refuse by it (NOTE [overload])
])
# Instance rows come in two banks of model_num: a rolling reload starts the new processes in the
# other bank (while the current ones serve), then switches ``bank`` and retires the old ones.
# ``held``: requests the process took and has not answered; ``clients``: client slots it knows
# (batching counts who may still send from them; status shows them). ``queued``: requests held
# and not in a batch yet (``max_queue`` counts them across the model's processes);
# ``newcomer_wait``: seconds a new request of default priority from a client with nothing waiting
# would wait here (NOTE [overload]; status shows it); ``lowest``: the lowest priority waiting.
INSTANCE = np.dtype([
    ("pid", "<i8"), ("state", "<i8"), ("device", "<i8"), ("restarts", "<i8"), ("t_start", "<f8"),
    ("graphs", "<i8"), ("free", "<i8"), ("held", "<i8"), ("clients", "<i8"), ("queued", "<i8"),
    ("newcomer_wait", "<f8"), ("lowest", "<i8"), ("reserved", "<i8", (4,)),
])
# One per request a model process holds (its own rows, HEADER.held_cap of them): whose request,
# so that the supervisor can answer its caller at once if the process dies. ``pid`` 0 = unused;
# written last when taken, first when released.
HELD = np.dtype([("fd", "<i8"), ("token", "<u8"), ("seq", "<i8"), ("pid", "<i8")])
COUNTERS = np.dtype([
    ("requests", "<i8"), ("batches", "<i8"), ("rows", "<i8"), ("errors", "<i8"),
    ("ring_head", "<i8"), ("isolated", "<i8"), ("bad_requests", "<i8"), ("over_target", "<i8"),
    ("withdrawn", "<i8"), ("expired", "<i8"), ("shed_deadline", "<i8"), ("shed_queue", "<i8"),
    ("died", "<i8"),              # answered ModelProcessDied by the supervisor (the process is gone)
    ("reserved", "<i8", (3,)),   # 128 bytes a row
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


#: The most requests a control block has HELD rows for per process, and the most processes a model
#: may have: what attach() accepts as a real control block (so ModelConfig's bounds are these).
MAX_HELD, MAX_MODEL_NUM = 2**20, 4096


def held_cap(max_batch: int) -> int:
    """Requests one model process may hold at once: two batches in flight (pipelining) and as many again
    collected or set aside, and room to see every waiting client when the model is past capacity (NOTE
    [overload]: fair turns and refusals need the waiting requests in view); past that it takes no more
    from the socket (the kernel queue and the clients' sends hold the rest)."""
    return 4 * max_batch + 240


def _parts(held: int, rows: int):
    def part(dtype, shape):
        return dtype, shape, align(int(np.prod(shape)) * np.dtype(dtype).itemsize, 64)
    return {
        "header": part(HEADER, (1,)),
        "all_instances": part(INSTANCE, (rows,)),
        "held": part(HELD, (rows, held)),
        "counters": part(COUNTERS, (rows,)),
        "ring": part(np.float64, (rows, RING, len(B_FIELDS))),
        "hist": part(np.int64, (rows, 3, H_SUM + 1)),
        "batch_hist": part(np.int64, (rows, BATCH_HIST_MAX + 1)),
        "msg": part(np.uint8, (MSG_BYTES,)),
        "spec": part(np.uint8, (SPEC_BYTES,)),
    }


_HDR_STATE, _HDR_BANK = (HEADER.fields[n][1] // 8 for n in ("state", "bank"))
_I_ROW = INSTANCE.itemsize // 8
_I_STATE, _I_QUEUED, _I_NEWCOMER, _I_LOWEST = (INSTANCE.fields[n][1] // 8
                                              for n in ("state", "queued", "newcomer_wait", "lowest"))


def words(arr: np.ndarray, fmt: str = "q") -> memoryview:
    """A contiguous array's memory as one flat memoryview (int64 words by default; "B" bytes,
    "Q" unsigned, "d" float64): an element read or written as a plain Python number costs a
    fraction of a numpy scalar. Release it before the segment under it closes."""
    assert arr.flags.c_contiguous  # else reshape would copy: writes would go nowhere
    raw = memoryview(arr.reshape(-1).view(np.uint8))
    return raw if fmt == "B" else raw.cast(fmt)


class ControlBlock:
    """Views into one model's control block (``<ns>/<m>.ctl``, a memfd of the runtime's main process:
    shm.py); clients map it read-only."""

    def __init__(self, seg: Segment, held: int, model_num: int):
        self.seg = seg
        self.model_num = model_num
        off = 0
        for k, (dtype, shape, nbytes) in _parts(held, 2 * model_num).items():
            setattr(self, k, seg.ndarray(off, dtype, shape))
            off += nbytes
        self.hdr = self.header.reshape(())   # 0-d record: hdr["state"] reads and writes in place
        # the header's int64 words: ``state`` is read on every call, as a plain int
        self._hdr_words = words(self.header)
        self._inst_words = words(self.all_instances)
        self._inst_floats = words(self.all_instances, "d")

    @staticmethod
    def size(held: int, model_num: int) -> int:
        return sum(p[2] for p in _parts(held, 2 * model_num).values())

    @classmethod
    def create(cls, namespace: str, model: str, model_num: int, max_batch: int,
               wait_time: float, supervisor_pid: int, max_clients: int = 0,
               default_timeout: Optional[float] = None, max_queue: Optional[int] = None) -> "ControlBlock":
        held = held_cap(max_batch)
        seg = Segment.create_memfd(f"sdbi-{model}.ctl", cls.size(held, model_num),
                                   link=ctl_path(namespace, model))
        ctl = cls(seg, held, model_num)
        h = ctl.hdr
        h["version"], h["state"], h["held_cap"], h["max_slots"] = VERSION, STARTING, held, max_clients
        h["model_num"], h["max_batch"], h["wait_time"] = model_num, max_batch, wait_time
        h["supervisor_pid"], h["default_timeout"] = supervisor_pid, default_timeout or 0.0
        h["max_queue"] = -1 if max_queue is None else max_queue
        h["magic"] = MAGIC  # last: attachers check it
        return ctl

    @classmethod
    def attach(cls, namespace: str, model: str, readonly: bool = True, fd: Optional[int] = None) -> "ControlBlock":
        """Map the control block of ``model``: through its link in the namespace (clients), or
        the descriptor ``fd`` the runtime handed a child (model processes: a link a client
        replaced cannot keep them from starting)."""
        seg = Segment.attach(ctl_path(namespace, model), readonly=readonly) if fd is None else \
            Segment.from_fd(fd, ctl_path(namespace, model), readonly=readonly)
        head = seg.ndarray(0, HEADER, (1,))[0]
        magic, version = int(head["magic"]), int(head["version"])
        held, model_num = int(head["held_cap"]), int(head["model_num"])
        del head
        if magic != MAGIC or version != VERSION or not (
                0 < held <= MAX_HELD and 0 < model_num <= MAX_MODEL_NUM and seg.size >= cls.size(held, model_num)):
            seg.close()
            raise RuntimeError(f"{seg.path} is not a simpledbi v{VERSION} control block")
        return cls(seg, held, model_num)

    @property
    def default_timeout(self) -> Optional[float]:
        """ModelConfig.default_timeout: the timeout of a call that gives none (None: none)."""
        value = float(self.hdr["default_timeout"])
        return value if value > 0 else None

    @property
    def max_queue(self) -> Optional[int]:
        """ModelConfig.max_queue: requests that may wait across the model's processes (None: any)."""
        value = int(self.hdr["max_queue"])
        return value if value >= 0 else None

    @property
    def max_slots(self) -> int:
        """ModelConfig.max_clients: client slots one model process maps at most."""
        return int(self.hdr["max_slots"])

    @property
    def rows(self) -> int:
        """Instance rows: two banks of ``model_num`` (see INSTANCE)."""
        return self.all_instances.shape[0]

    def active_rows(self) -> range:
        bank = self._hdr_words[_HDR_BANK] & 1
        return range(bank * self.model_num, (bank + 1) * self.model_num)

    @property
    def instances(self) -> np.ndarray:
        """The INSTANCE rows of the serving bank (``model_num`` of them); ``all_instances`` has
        both banks, indexed by a model process's row."""
        r = self.active_rows()
        return self.all_instances[r.start:r.stop]

    @property
    def state(self) -> int:
        return self._hdr_words[_HDR_STATE]

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

    def write_spec(self, names: Sequence[str], required: Sequence[str], shapes, dtypes) -> None:
        """Publish the model's declared inputs (the runtime, once, before the model is RUNNING; clients
        trust it): input names, those the forward requires, item shapes and dtypes (None: undeclared)."""
        data = json.dumps({"names": list(names), "shapes": shapes and [list(s) for s in shapes],
                           "dtypes": dtypes and list(dtypes), "required": list(required)}).encode()
        if len(data) > SPEC_BYTES:
            raise ValueError(f"the declared inputs take {len(data)} bytes; at most {SPEC_BYTES} fit")
        self.spec[:len(data)] = np.frombuffer(data, np.uint8)
        self.hdr["spec_len"] = len(data)  # last: readers see all of it or nothing

    def declared(self) -> Tuple[tuple, tuple, tuple, Tuple[str, ...]]:
        """(input names, item shapes, dtypes, the names the forward requires) the runtime
        published; empty where none are."""
        n = int(self.hdr["spec_len"])
        if not 0 < n <= SPEC_BYTES:
            return (), (), (), ()
        d = json.loads(bytes(self.spec[:n]))
        return (tuple(d["names"]), tuple(tuple(s) for s in d["shapes"] or ()),
                tuple(d["dtypes"] or ()), tuple(d.get("required", ())))

    def backlog(self) -> Optional[Tuple[int, float, int]]:
        """What waits at the serving model processes, as each last published it, when every one of them
        has requests waiting (else None: one starts a newcomer in its next batch): (requests waiting in
        all, the least of their ``newcomer_wait``, the lowest priority waiting): NOTE [overload]."""
        w, f = self._inst_words, self._inst_floats
        waiting, best, lowest = 0, None, None
        for r in self.active_rows():
            b = r * _I_ROW
            if w[b + _I_STATE] != INST_READY:
                continue
            if w[b + _I_QUEUED] <= 0:
                return None
            waiting += w[b + _I_QUEUED]
            if best is None or f[b + _I_NEWCOMER] < best:
                best = f[b + _I_NEWCOMER]
            if lowest is None or w[b + _I_LOWEST] < lowest:
                lowest = w[b + _I_LOWEST]
        return None if best is None else (waiting, best, lowest)

    def close(self) -> None:
        for view in (self._hdr_words, self._inst_words, self._inst_floats):
            if view is not None:
                view.release()
        for k in (*_parts(0, 0), "hdr", "_hdr_words", "_inst_words", "_inst_floats"):
            setattr(self, k, None)
        self.seg.close()


# ---------------------------------------------------------------- client slot (a sealed memfd)
# Byte offsets in a client's slot. The client writes SEG_MAGIC and its token once, inputs and
# PUB_SEQ per request; model processes write the claim words, the response and RESP_SEQ (last).
SEG_MAGIC_OFF = 0                  # MAGIC, then the slot's token (8 bytes each)
DONE_OFF = 128                     # a 4-byte word (futex.py): the seq answered last
# The claim tickets (4-byte words, futex.py), one per seq modulo TICKETS: a model process that
# reads the datagram of a request its client withdrew looks only at that request's own ticket,
# so it never holds, even for an instant, the ticket of the request published after it (a peer
# reading that one's datagram meanwhile would have found it taken, and dropped it: a lost call).
TICKETS_OFF, TICKETS = 512, 64
PUB_SEQ_OFF = 192                  # the seq of the request the client published last
CLOSED_OFF = 200                   # 1 once the client detached (model processes drop the slot)
ABANDON_OFF = 208                  # the seq of a request taken whose caller stopped waiting (timed
#                                    out, cancelled, closed): it is dropped at its batch's close
CLAIM_OFF = 256                    # (instance, pid, seq) of the model process that took a request
# Written by the model process; RESP_SEQ is written after it, last of all. A dict or namedtuple
# answer's keys follow the header, at NAMES_OFF (``names_len`` bytes, encode_names).
RESPONSE = np.dtype([
    ("status", "<i8"), ("n_out", "<i8"), ("structure", "<i8"), ("names_len", "<i8"), ("err_len", "<i8"),
    ("claimer", "<i8"), ("batch_rows", "<i8"), ("needed", "<i8"), ("t_close", "<f8"),
    ("t_done", "<f8"), ("dtype", "<i8", (MAX_IO,)), ("ndim", "<i8", (MAX_IO,)),
    ("offset", "<i8", (MAX_IO,)), ("dims", "<i8", (MAX_IO, MAX_NDIM + 1)),
])
RESP_OFF, RESP_SEQ_OFF = 1024, 4088
NAMES_OFF = RESP_OFF + RESPONSE.itemsize      # right after the header: one write writes both
NAMES_BYTES = RESP_SEQ_OFF - NAMES_OFF


# ---------------------------------------------------------------- the request datagram
# One datagram per request, sent to ``<m>.sock``: REQ_PREFIX, then its *layout* (what stays the
# same while a client sends alike requests: model processes validate a layout once and keep it):
# out_offset, flags, n_in, then per input dtype code, ndim, offset in the slot and the item dims
# (all int64). ``flags``: 0 for positional inputs; else a mask of the model's declared input
# names (bit j: name j) -- the inputs are those names, in ascending j. ``fd``: the client's
# descriptor of its slot (a model process opens /proc/<sender pid>/fd/<fd> once: the pid is
# the kernel's word); a client that cannot be opened that way sends the descriptor itself.
REQ_MAGIC = 0x5344_4232        # "SDB2": a request
WAKE_MAGIC = 0x5344_4257       # "SDBW": from the runtime itself: look at the model's state
# "SDBF": a request handed back by a model process of the model for another one to take (it
# holds more than it can start soon while a peer is idle): FWD_PREFIX (magic, the client's pid
# as the kernel gave it to the sender), then the request's datagram. Honoured only when the
# kernel says the sender is a model process of this model.
FWD_MAGIC = 0x5344_4246
FWD_PREFIX = struct.Struct("<Iiq")       # magic, 0, client pid
# ``refused``: calls this slot's client ended itself since its previous datagram, without sending
# them, 16 bits each: refused (every serving process published a wait past their deadline, bits
# 0-15; or max_queue was reached, 16-31: NOTE [overload]), and withdrawn (cancelled, closed or timed
# out while the model's queue was full, 32-47); the process that takes this datagram counts them.
REQ_PREFIX = struct.Struct("<IiQqqddiq")  # magic, fd, token, seq, rows, t_publish, deadline,
#                                           priority, refused
LAYOUT_HEAD = struct.Struct("<qqq")      # out_offset, flags, n_in
INPUT_HEAD = struct.Struct("<qqq")       # dtype code, ndim, offset
MAX_DATAGRAM = REQ_PREFIX.size + LAYOUT_HEAD.size + MAX_IO * (INPUT_HEAD.size + 8 * MAX_NDIM)

# field name -> index of its first 8-byte word: a response read as int64 words is decoded by indexing
RESP_WORD = {n: RESPONSE.fields[n][1] // 8 for n in RESPONSE.names}
assert all(RESPONSE.fields[n][0].base.itemsize == 8 for n in RESPONSE.names)
ERR_OFF, ERR_BYTES = 4096, 8192
DATA_OFFSET = ERR_OFF + ERR_BYTES
assert NAMES_BYTES >= 2048 and RESP_SEQ_OFF + 8 <= ERR_OFF

# response status
ST_OK, ST_MODEL_ERROR, ST_BAD_REQUEST, ST_STOPPED, ST_INTERNAL, ST_DIED, ST_FULL, ST_EXPIRED, \
    ST_OVERLOADED = range(9)
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


def socket_path(namespace: str, model: str) -> str:
    return ns_path(namespace, f"{model}.sock")
