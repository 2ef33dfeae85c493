"""Answering, in a model process: each requester's rows written and it woken, and a failed batch (poison
isolation, ``ModelConfig.isolate_errors``: only the requests that make the model fail get ``ModelError``)."""
from __future__ import annotations

import logging
import time
import traceback
from typing import Callable, List, Sequence

import numpy as np

from .layout import MAX_NDIM, ST_BAD_REQUEST, ST_MODEL_ERROR, dtype_code
from .slots import Request

logger = logging.getLogger(__name__)


class Answers:
    """Answers requests into their clients' slots (``release``: Intake.release; ``count``: Accounting.add)."""

    def __init__(self, tag: str, row: int, engine, gather: Callable, release: Callable[[Request], None],
                 count: Callable[[str, int], None], isolate: bool):
        self.tag, self.row, self.engine, self.isolate = tag, row, engine, isolate
        self._gather, self._release, self._count = gather, release, count
        self.fatal = False   # the CUDA context is unusable: the process must be replaced

    def batch(self, batch: List[Request], result, t_close: float, total: int, before_wake=None) -> None:
        """Write every answer first, then wake the callers: a woken caller often takes this CPU at once, and
        should not delay the answers of the rest of its batch. ``before_wake`` runs in between: counters a
        caller reads after its answer already include it. The wake-ups are made here, the GIL held (a futex
        wake of a sleeping process: 5.4 us on an H200 host). A thread of their own, with the GIL released
        in each syscall, served 11% less on the fast command (run 40): each wake then waited for the serving
        thread's next release of the GIL: a batch's last caller woke ~0.5 ms after its answer was written."""
        structure = result.structure
        code, names, row, release = structure.code, structure.names, self.row, self._release
        # each output's first row and bytes per row: a request's rows are one memmove each
        outs = [o if o.flags.c_contiguous else np.ascontiguousarray(o) for o in result.outputs]
        per_out = [(o.ctypes.data, o.strides[0] if o.shape[0] > 1 else o.nbytes, o.dtype, o.shape[1:])
                   for o in outs]
        sigs: dict = {}   # rows -> the outputs' (dtype, shape, ...) of a request of that many
        answered, offset, t_done = [], 0, time.monotonic()
        try:
            for r in batch:
                n = r.rows
                if not r.answered:
                    sig = sigs.get(n)
                    if sig is None:
                        sig = sigs[n] = tuple(x for _, _, dt, item in per_out for x in (dt, (n, *item)))
                    r.answered = True
                    peer = r.peer
                    try:
                        peer.answer(r.seq, [(ptr + offset * step, n * step) for ptr, step, _, _ in per_out],
                                    sig, r.layout.out_offset, code, names, row, t_close, t_done, total)
                    except Exception as e:  # noqa: BLE001 - a slot it cannot write (the client's doing)
                        peer.respond(r.seq, ST_BAD_REQUEST, f"could not write the outputs into the "
                                     f"client's slot: {e}", row, t_close, total, wake=False)
                    answered.append(r)
                    peer.answered_at, peer.answered_seq = t_done, r.seq   # its turnaround starts (_took)
                    release(r)   # its HELD row goes
                offset += n
            if before_wake is not None:
                before_wake()
        finally:
            for r in answered:
                r.peer.wake(r.seq)

    def failure(self, batch: List[Request], error: BaseException, t_close: float) -> None:
        """A batch failed: answer the error, with isolation only to the requests that make the model fail
        (halves of the batch are retried until each request is answered). Parts are answered and woken
        as they are found: the caller counts the batch first, and the errors are counted before their
        callers wake, so a caller's stats() after its answer includes them."""
        fatal = self.engine.cuda and _is_cuda_fatal(error)
        if fatal or len(batch) == 1 or not self.isolate:
            text = error_text(error)
            logger.error("%s forward failed for a batch of %d requests (%d rows): %s", self.tag,
                         len(batch), sum(r.rows for r in batch), text.split("\n", 2)[1])
            self._count("errors", len(batch))   # before fail() wakes them: see ModelServer._complete
            self.fail(batch, ST_MODEL_ERROR, text)
            if fatal:
                logger.error("%s the CUDA context is broken; exiting to be restarted", self.tag)
                self.fatal = True
            return
        self._count("isolated", 1)
        culprits, todo = 0, [batch[:len(batch) // 2], batch[len(batch) // 2:]]
        while todo:
            part = todo.pop()
            if not part:
                continue
            total = sum(r.rows for r in part)
            try:
                result = self.engine.run_simple(self._gather(part))
                check_outputs(result.outputs, total)
            except Exception as e:  # noqa: BLE001
                if len(part) == 1:
                    self._count("errors", 1)   # before fail() wakes it
                    self.fail(part, ST_MODEL_ERROR, error_text(e))
                    culprits += 1
                else:
                    todo += [part[:len(part) // 2], part[len(part) // 2:]]
                continue
            self.batch(part, result, t_close, total)
        logger.error("%s forward failed for a batch of %d requests; isolated %d culprit(s)",
                     self.tag, len(batch), culprits)

    def fail(self, requests: Sequence[Request], status: int, text: str) -> None:
        """Answer each request not answered yet with an error ``status`` and wake it."""
        for r in requests:
            if r.answered:
                continue
            r.answered = True
            peer = r.peer
            try:
                peer.respond(r.seq, status, text, self.row)
            except Exception:  # noqa: BLE001 - a slot we cannot write: its client is gone
                logger.debug("%s answering a request of process %d failed", self.tag, peer.pid, exc_info=True)
            peer.answered_at, peer.answered_seq = time.monotonic(), r.seq
            self._release(r)


def check_outputs(outputs, total: int) -> None:
    """Outputs must split back into per-request rows and fit the response layout (engine._as_list,
    which every output passes, allows at most MAX_IO of them)."""
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


def safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        return f"<{type(e).__name__} whose message could not be formatted>"


def error_text(e: BaseException) -> str:
    try:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # noqa: BLE001
        tb = ""
    return f"{type(e).__name__}\n{_one_line(safe_str(e))}\n{tb}"


def _one_line(message: str, most: int = 600) -> str:
    """The caller's error message is one line. A message of several (TorchScript's: "The following
    operation failed in the TorchScript interpreter. ... RuntimeError: mat1 and mat2 shapes cannot be
    multiplied") keeps its first and last line, where the cause is; the remote traceback has it all."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1:
        message = f"{lines[0]} ... {lines[-1]}"
    elif lines:
        message = lines[0]
    return message if len(message) <= most else message[:most - 3] + "..."


def _is_cuda_fatal(e: BaseException) -> bool:
    """Errors after which the CUDA context is unusable (a device-side assert, an illegal address)."""
    text = safe_str(e)
    return isinstance(e, RuntimeError) and ("device-side assert" in text or "illegal memory access" in text
                                            or "CUDA error: an illegal" in text)
