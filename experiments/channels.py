"""Which request channel: two kernel-checked designs for issue 20, measured side by side.

    python experiments/channels.py [--n 4000] [--workers 8] [--seconds 3] [--repeats 3]

Both send each request as one Unix datagram to a socket all model processes of a model read
(the kernel hands each datagram to exactly one reader and, with ``SO_PASSCRED``, says which pid
sent it), keep inputs and outputs in a per-client memfd sealed against shrinking (nobody can make
a mapping of it SIGBUS), take the request with a ticket word and wake the client through a futex
word inside that memfd (simpledbi/futex.py; the figures in docs/CHANNEL.md were taken with
glibc sem_t words, which the library dropped because a client can make sem_post abort). They differ in how the server reaches the client's memory:

* ``proc``: the datagram names the client's descriptor number; the server opens
  ``/proc/<sender pid>/fd/<n>`` (the pid is the kernel's word) once per slot, maps it, and keeps
  the mapping (checked against a token in the segment).
* ``scm``: every datagram carries the descriptor itself (``SCM_RIGHTS``); the server looks the
  slot up by (pid, token) and closes the descriptor it got.

A server takes whatever is queued (up to 8 requests) as one batch, copies each request's row into
a staging array, runs ``torch.nn.Identity`` on it and writes each answer back, then posts. Prints
one client's round trip (p50/p90 us) and the closed-loop throughput of ``--workers`` clients,
medians of ``--repeats`` interleaved runs.
"""
from __future__ import annotations

import argparse
import array
import json
import mmap
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simpledbi import futex  # noqa: E402

_REQ = struct.Struct("<QiqI")          # token, fd, seq, rows
_TICKET, _DONE, _SEQ, _IN, _OUT = 64, 128, 192, 256, 512
_SIZE = 4096
_CREDS = socket.CMSG_SPACE(12)


def _server(path: str, mode: str, ready) -> None:
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Identity()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    ready.set()
    cache = {}
    anc = _CREDS + (socket.CMSG_SPACE(4) if mode == "scm" else 0)
    staging = np.empty((8, 4), np.float32)
    with torch.inference_mode():
        while True:
            batch = []
            flags = 0
            while len(batch) < 8:
                try:
                    data, ancdata, _, _ = sock.recvmsg(64, anc, flags)
                except BlockingIOError:
                    break
                flags = socket.MSG_DONTWAIT
                if not data:
                    return
                token, fd, seq, rows = _REQ.unpack(data)
                pid = 0
                got_fd = None
                for level, kind, blob in ancdata:
                    if kind == socket.SCM_CREDENTIALS:
                        pid = struct.unpack_from("i", blob)[0]
                    elif kind == socket.SCM_RIGHTS:
                        got_fd = struct.unpack_from("i", blob)[0]
                seg = cache.get((pid, token))
                if seg is None:
                    if got_fd is not None:
                        f = got_fd
                        got_fd = None
                    else:
                        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
                    mm = mmap.mmap(f, _SIZE)
                    os.close(f)
                    arr = np.frombuffer(mm, np.uint8)
                    seg = cache[(pid, token)] = (mm, arr, arr.ctypes.data, arr[_IN:_IN + 16].view(np.float32),
                                                 arr[_OUT:_OUT + 16].view(np.float32), arr[_SEQ:_SEQ + 8].view(np.int64))
                if got_fd is not None:
                    os.close(got_fd)
                if not futex.take(seg[2] + _TICKET):
                    continue
                batch.append((seg, seq))
            if not batch:
                continue
            n = len(batch)
            for i, (seg, _) in enumerate(batch):
                staging[i] = seg[3]
            y = model(torch.from_numpy(staging[:n])).numpy()
            for i, (seg, seq) in enumerate(batch):
                seg[4][:] = y[i]
                seg[5][0] = seq
            for seg, seq in batch:
                futex.store_and_wake(seg[2] + _DONE, seq)


class _Client:
    def __init__(self, path: str, mode: str):
        self.mode = mode
        self.fd = os.memfd_create("sdbi-proto", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, _SIZE)
        import fcntl
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.mm = mmap.mmap(self.fd, _SIZE)
        self.arr = np.frombuffer(self.mm, np.uint8)
        base = self.arr.ctypes.data
        self.ticket, self.done = base + _TICKET, base + _DONE
        futex.ticket_init(self.ticket)
        self.x = self.arr[_IN:_IN + 16].view(np.float32)
        self.y = self.arr[_OUT:_OUT + 16].view(np.float32)
        self.rseq = self.arr[_SEQ:_SEQ + 8].view(np.int64)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.connect(path)
        self.token = int.from_bytes(os.urandom(8), "little")
        self.seq = 0
        self.waiter = futex.Waiter()
        self.fds = [array.array("i", [self.fd]).tobytes()]

    def call(self, x: np.ndarray) -> np.ndarray:
        self.seq += 1
        np.copyto(self.x, x.reshape(-1))
        futex.offer(self.ticket)
        msg = _REQ.pack(self.token, self.fd, self.seq, 1)
        if self.mode == "scm":
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, self.fds[0])])
        else:
            self.sock.send(msg)
        while self.rseq[0] != self.seq:
            seen = futex.load(self.done)
            if self.rseq[0] != self.seq:
                self.waiter.wait(self.done, seen, 1.0)
        return self.y.copy()


def _loop(path, mode, seconds, start, out):
    c = _Client(path, mode)
    x = np.arange(4, dtype=np.float32)
    for _ in range(200):
        c.call(x)
    start.wait()
    n, t_end = 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        c.call(x)
        n += 1
    out.put(n)


def run(mode: str, n: int, workers: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="sdbi_chan_", dir="/dev/shm")
    path = os.path.join(d, "m.sock")
    ready = ctx.Event()
    srv = ctx.Process(target=_server, args=(path, mode, ready), daemon=True)
    srv.start()
    ready.wait(60)
    try:
        c = _Client(path, mode)
        x = np.arange(4, dtype=np.float32)
        for _ in range(500):
            c.call(x)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.call(x)
            lat.append(time.perf_counter() - t0)
        lat = np.array(lat) * 1e6
        start, out = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=_loop, args=(path, mode, seconds, start, out)) for _ in range(workers)]
        for p in ps:
            p.start()
        time.sleep(3.0)   # every client imported numpy and warmed up (no timing before this)
        start.set()
        total = sum(out.get(timeout=60 + seconds) for _ in ps)
        for p in ps:
            p.join(10)
        return {"mode": mode, "p50_us": float(np.percentile(lat, 50)), "p90_us": float(np.percentile(lat, 90)),
                "workers": workers, "req_per_s": total / seconds}
    finally:
        srv.kill()
        srv.join()
        try:
            os.unlink(path)
            os.rmdir(d)
        except OSError:
            pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the raw results here")
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        for mode in ("proc", "scm"):
            r = run(mode, a.n, a.workers, a.seconds)
            print(json.dumps(r), flush=True)
            rows.append(r)
    for mode in ("proc", "scm"):
        rs = [r for r in rows if r["mode"] == mode]
        print(f"{mode:5s} one client p50 {np.median([r['p50_us'] for r in rs]):6.1f} us   "
              f"{a.workers} clients {np.median([r['req_per_s'] for r in rs]):8.0f} req/s  (medians of {len(rs)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
