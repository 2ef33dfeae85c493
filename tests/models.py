"""Model factories for the tests. Module-level so spawned model processes can unpickle them."""
from __future__ import annotations

import collections
import faulthandler
import logging
import os
import time

from typing import Dict

import posix_ipc
import torch
from torch import nn

GATE = -1000.0        # an input holding this value blocks in forward until the test opens the gate
RAISE = -7.0          # ... makes forward raise ValueError
WRONG_ROWS = -8.0     # ... makes forward return one row too few
NOT_A_TENSOR = -9.0   # ... makes forward return a string
SEGFAULT = -11.0      # ... crashes the model process
LOG_ME = -12.0        # ... makes the Loud model log an error

Pair = collections.namedtuple("Pair", "logits pooled")  # NamedOut's output


class Affine(nn.Module):
    """y = 2x + 1: any float shape in, same shape out; a crossed or lost result cannot pass."""

    def forward(self, x):
        return x * 2 + 1


class Concat4(nn.Module):
    """Four 1-D inputs, y = 2 * concat(a, b, c, d) + 1: every byte of every input reaches the answer."""

    def forward(self, a, b, c, d):
        return torch.cat([a, b, c, d], dim=1) * 2 + 1


class Gated(nn.Module):
    def __init__(self, gate_name: str):
        super().__init__()
        self.gate = posix_ipc.Semaphore(gate_name)
        self.entered = posix_ipc.Semaphore(gate_name + ".in")

    def forward(self, x):
        if bool((x == GATE).any()):
            self.entered.release()
            while True:   # (a forward pass goes on through a SIGTERM to the group: serve drains)
                try:
                    self.gate.acquire(60)  # bounded: a broken test fails instead of hanging
                    break
                except posix_ipc.SignalError:   # sem_timedwait is never restarted after a handler
                    continue
        return x * 2 + 1


class Faulty(Gated):
    """Raises for a ``RAISE`` input (and misbehaves for the other markers); ``seconds``: each forward
    pass takes that long more (sleeping), so that a bisection's retries take a while."""

    def __init__(self, gate_name: str = "", seconds: float = 0.0):
        nn.Module.__init__(self)
        if gate_name:
            Gated.__init__(self, gate_name)
        self.seconds = seconds

    def forward(self, x):
        if self.seconds:
            time.sleep(self.seconds)
        if bool((x == GATE).any()):
            return Gated.forward(self, x)
        if bool((x == RAISE).any()):
            raise ValueError("poisoned input")
        if bool((x == WRONG_ROWS).any()):
            return x[1:] if x.shape[0] > 1 else x[:0]
        if bool((x == NOT_A_TENSOR).any()):
            return "not a tensor"
        if bool((x == SEGFAULT).any()):
            faulthandler._sigsegv()
        return x * 2 + 1


class MultiIO(nn.Module):
    """(a float32 [r, n], b int64 [r, m]) -> (a * 2, (b.sum(1) + a.sum(1)) as float64 [r, 1])."""

    def forward(self, a, b):
        total = b.sum(dim=1, keepdim=True).double() + a.sum(dim=1, keepdim=True).double()
        return a * 2, total


class ChannelMean(nn.Module):
    """(r, c, h, w) -> (r, c): output size independent of the spatial size of the request."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


class Barrier(nn.Module):
    """The first forward of each instance announces itself on ``<prefix>.arrived`` and blocks on
    ``<prefix>.go`` until the test, having seen every instance arrive, opens it. Passes only if the
    runtime really dispatches concurrent batches to several model processes. Outputs carry the pid."""

    def __init__(self, prefix: str):
        super().__init__()
        self.arrived = posix_ipc.Semaphore(prefix + ".arrived")
        self.go = posix_ipc.Semaphore(prefix + ".go")
        self.first = True

    def forward(self, x):
        if self.first and bool((x != 0).all()):  # not for the warm-up or probe (zeros)
            self.first = False
            self.arrived.release()
            self.go.acquire(60)
        return torch.cat([x * 2 + 1, torch.full((x.shape[0], 1), float(os.getpid()))], dim=1)


class Slow(nn.Module):
    """Matrix products sized to take a while on a CPU: lets requests pile up under load."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x):
        y = x
        for _ in range(20):
            y = torch.tanh(y @ self.w)
        return x * 2 + 1 + 0 * y[:, :1]


def affine():
    return Affine()


def few_descriptors(spare: int):
    """An Affine in a model process that may open only ``spare`` more descriptors than it holds
    now (a host whose hard limit is low, or a factory that lowers it)."""
    _lower_descriptor_limit(spare)
    return Affine()


def _lower_descriptor_limit(spare: int) -> None:
    import resource
    n = len(os.listdir("/proc/self/fd")) + spare
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


class Leaky(Affine):
    """Opens ``leak`` descriptors at its first forward pass and keeps them (a model that opens files
    lazily), in a process that may open only ``spare`` more than it held when it was built."""

    def __init__(self, spare: int, leak: int):
        super().__init__()
        _lower_descriptor_limit(spare)
        self.leak, self.kept = leak, []

    def forward(self, x):
        while len(self.kept) < self.leak:
            self.kept.append(open(os.devnull))
        return super().forward(x)


def leaky(spare: int, leak: int):
    return Leaky(spare, leak)


def concat4():
    return Concat4()


def gated(gate_name: str):
    return Gated(gate_name)


def faulty(gate_name: str = "", seconds: float = 0.0):
    return Faulty(gate_name, seconds)


def multi_io():
    return MultiIO()


def channel_mean():
    return ChannelMean()


def barrier(prefix: str):
    return Barrier(prefix)


def slow():
    return Slow()


class LaunchBound(nn.Module):
    """A fixed cost per batch, whatever its size (like a launch-bound GPU model): 20 ms."""

    def forward(self, x):
        time.sleep(0.02)
        return x * 2 + 1


def launch_bound():
    return LaunchBound()


class Heavy(nn.Module):
    """y = 2x + 1 after a 4096 x 4096 matrix product on the device: a forward pass that takes
    far longer to run than to enqueue (not launch-bound)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 4096), requires_grad=False)

    def forward(self, x):
        big = self.w @ self.w
        return x * 2 + 1 + big[0, 0] * 0


def heavy():
    return Heavy()


class Syncing(nn.Module):
    """Reads a value back to the host inside forward: CUDA graph capture must fail on it."""

    def forward(self, x):
        if float(x.sum()) > 1e30:
            return x
        return x * 2 + 1


def syncing():
    return Syncing()


class Expand(nn.Module):
    """(r, n) -> (r, 64 n): outputs much larger than the request."""

    def forward(self, x):
        return x.repeat_interleave(64, dim=1)


def expand():
    return Expand()


COMPLEX = -21.0       # ... makes forward return complex128
TOO_MANY_DIMS = -22.0  # ... makes forward return 11 dimensions
BAD_STR = -23.0       # ... makes forward raise an exception whose __str__ raises


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


class Weird(nn.Module):
    """Outputs the runtime cannot describe, on markers; 2x + 1 otherwise."""

    def forward(self, x):
        if bool((x == COMPLEX).any()):
            return x.to(torch.complex128)
        if bool((x == TOO_MANY_DIMS).any()):
            return x.reshape(x.shape[0], *([1] * 9), -1)
        if bool((x == BAD_STR).any()):
            raise _Unprintable()
        return x * 2 + 1


def weird():
    return Weird()


def gated_from_env():
    """For `simpledbi serve`, whose factories take no arguments: the gate named by $SDBI_TEST_GATE."""
    return Gated(os.environ["SDBI_TEST_GATE"])


def loud():
    """Logs while loading and on every batch of a LOG_ME row: model-process logs reach the parent."""
    logging.getLogger("tests.loud").warning("loading the loud model")
    return Loud()


class Loud(nn.Module):
    def forward(self, x):
        if bool((x == LOG_ME).any()):
            logging.getLogger("tests.loud").error("saw a row asking to be logged")
        return x * 2 + 1
class HFLike(nn.Module):
    """A HuggingFace-style model: int64 ``input_ids``, optional ``attention_mask`` and
    ``token_type_ids`` by keyword, a dict out (None values dropped, like ModelOutput):
    ``logits`` = 2 * ids * mask, ``hidden`` = ids + 1, ``mask_used`` only when a mask came,
    ``types`` only when token types came -- so requests batched under the wrong names get wrong
    keys. ``input_ids`` holding GATE blocks on the gate, if there is one."""

    def __init__(self, gate_name: str = ""):
        super().__init__()
        self.gate = Gated(gate_name) if gate_name else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        assert input_ids.dtype == torch.int64, input_ids.dtype
        if self.gate is not None and bool((input_ids == GATE).any()):
            self.gate.entered.release()
            self.gate.gate.acquire(60)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out = {"logits": (input_ids * 2 * mask).float(), "hidden": input_ids + 1,
               "mask_used": None if attention_mask is None else attention_mask.sum(1, keepdim=True)}
        if token_type_ids is not None:
            out["types"] = token_type_ids * 3
        return out


def hf_like(gate_name: str = ""):
    return HFLike(gate_name)


class Scriptable(nn.Module):
    """For torch.jit.script: keyword inputs found in its TorchScript schema, a dict out."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"logits": (input_ids * attention_mask).float(), "ids": input_ids + 1}


class NamedOut(nn.Module):
    """(input_ids, attention_mask) -> a namedtuple (logits, pooled)."""

    def forward(self, input_ids, attention_mask):
        return Pair((input_ids * attention_mask).float(), input_ids.sum(1, keepdim=True))


def named_out():
    return NamedOut()


class Nested(nn.Module):
    """Returns a dict with a nested tuple, like HF's past_key_values: not carried."""

    def forward(self, x):
        return {"logits": x, "past": (x, x)}


def nested():
    return Nested()


class RowsRun(nn.Module):
    """Every output row is the number of rows the forward pass ran with (padding shows)."""

    def forward(self, x):
        return x[:, :1] * 0 + x.shape[0]


def rows_run():
    return RowsRun()


def armed(marker: str):
    """y = 2x + 1 -- until ``marker + ".v2"`` exists: then y = 3x + 1, except that the one load
    that removes ``marker`` (if it exists) fails after 2 s; and a load while ``marker + ".slow"``
    exists takes 3 s. For reloads that fail half-way, and slow restarts."""
    if os.path.exists(marker + ".slow"):
        time.sleep(3)
    if not os.path.exists(marker + ".v2"):
        return Affine()
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return Triple()
    time.sleep(2)
    raise RuntimeError("armed: this load fails")


class Triple(nn.Module):
    def forward(self, x):
        return x * 3 + 1


class ManyLines(nn.Module):
    """Raises like TorchScript does: the cause on the last line of a long message."""

    def forward(self, x):
        raise RuntimeError("The following operation failed in the TorchScript interpreter.\n"
                           "Traceback of TorchScript (most recent call last):\n  File \"<x>\", line 1\n"
                           "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x5 and 8x4)\n")


def many_lines():
    return ManyLines()


def slow_to_load():
    """An Affine whose loading takes 3 s; it touches $SDBI_TEST_LOADING first (if set)."""
    import time
    path = os.environ.get("SDBI_TEST_LOADING")
    if path:
        open(path, "a").close()
    time.sleep(3.0)
    return Affine()


SLOW, SLOW_SECONDS = -7.0, 1.0


class Sleepy(nn.Module):
    """Takes ``seconds`` per batch whatever its size, sleeping (as a device would, leaving the
    CPU to the clients): a model of known capacity, max_batch_size / seconds rows per second.
    A row whose first value is ``GATE`` waits for the gate as Gated does; a batch with a
    ``SLOW`` value takes ``SLOW_SECONDS`` more (a cold first batch, a stall)."""

    def __init__(self, seconds: float, gate_name: str = ""):
        super().__init__()
        self.seconds = seconds
        self.gate = Gated(gate_name) if gate_name else None

    def forward(self, x):
        if self.gate is not None and bool((x == GATE).any()):
            self.gate.forward(x)
        time.sleep(self.seconds + (SLOW_SECONDS if bool((x == SLOW).any()) else 0.0))
        return x * 2 + 1


def sleepy(seconds: float = 0.01, gate_name: str = ""):
    return Sleepy(seconds, gate_name)


def term_children():
    """An affine model whose factory stops children of its own with SIGTERM, as a
    multiprocessing.Pool's exit does: one it started with exec, one it forked."""
    import signal
    import subprocess
    import sys
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    helper.terminate()
    assert helper.wait(30) == -signal.SIGTERM
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the model process's SIGTERM handler, copied
        try:
            os.write(w, b"x")   # (CPython drops a signal that comes before its after-fork reset)
            time.sleep(60)
        finally:
            os._exit(0)
    os.read(r, 1)
    os.close(r)
    os.close(w)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    return Affine()


def slow_exit(seconds: float = 4.0):
    """The affine model, in a process whose exit takes ``seconds`` more (an atexit sleep: slower than
    torch's teardown, measured 0.15-0.5 s idle and up to 1.4 s under 4 busy loops on 2 cores)."""
    import atexit
    atexit.register(time.sleep, seconds)
    return Affine()


def linear16():
    """A model that needs its declared item shape exactly: (16,) -> (4,)."""
    torch.manual_seed(0)
    return nn.Linear(16, 4)
