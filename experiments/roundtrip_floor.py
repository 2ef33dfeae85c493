"""The floor for the echo round trip in Python: the least a shared-memory request can cost.

    python experiments/roundtrip_floor.py [--n 3000] [--no-torch] [--workers 8 --seconds 4]

A client writes a (1, 4) float32 row and a seq into a shared segment and posts a semaphore; a
server process wakes, reads the header and the row with pread, runs ``torch.nn.Identity`` (unless
``--no-torch``), writes the row and the seq back with pwrite and posts another semaphore. No
slot protocol, no validation, no batching, no bookkeeping: what simpledbi's echo round trip
(experiments/roundtrip.py) would cost if its Python work per request were nearly nothing.

``--workers N`` adds the same floor for throughput: N client processes in a closed loop, one
server that sleeps on a doorbell, takes every ready row at once (one numpy pass over the
clients' seq words), runs one identity forward on the batch, writes each answer straight into
the shared segment and posts each client's semaphore. What simpledbi's 8-worker echo figure
would be with no protocol, validation or bookkeeping at all.
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import struct
import time

import numpy as np
import posix_ipc

_HDR, _ROW, _OUT, _SEQ = 0, 64, 128, 160   # byte offsets in the segment


def _server(prefix: str, n: int, use_torch: bool) -> None:
    import torch
    torch.set_num_threads(1)
    door, done = posix_ipc.Semaphore(prefix + ".d"), posix_ipc.Semaphore(prefix + ".o")
    fd = os.open("/dev/shm" + prefix, os.O_RDWR)
    model = torch.nn.Identity()
    buf = bytearray(16)
    with torch.inference_mode():
        for _ in range(n):
            door.acquire()
            seq, rows = struct.unpack("<qq", os.pread(fd, 16, _HDR))
            os.preadv(fd, [buf], _ROW)
            x = np.frombuffer(buf, np.float32).reshape(rows, 4)
            y = model(torch.from_numpy(x)).numpy() if use_torch else x
            os.pwrite(fd, y, _OUT)
            os.pwrite(fd, struct.pack("<q", seq), _SEQ)
            done.release()


def floor_roundtrip(n: int, use_torch: bool = True, warmup: int = 500) -> np.ndarray:
    """Round-trip times in microseconds (``n`` of them, after ``warmup``)."""
    prefix = f"/sdbi_floor_{os.getpid()}"
    door = posix_ipc.Semaphore(prefix + ".d", posix_ipc.O_CREX)
    done = posix_ipc.Semaphore(prefix + ".o", posix_ipc.O_CREX)
    fd = os.open("/dev/shm" + prefix, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        seg = np.frombuffer(mm, np.uint8)
        hdr, row = seg[_HDR:_HDR + 16].view(np.int64), seg[_ROW:_ROW + 16].view(np.float32).reshape(1, 4)
        out, seq = seg[_OUT:_OUT + 16].view(np.float32).reshape(1, 4), seg[_SEQ:_SEQ + 8].view(np.int64)
        p = mp.get_context("spawn").Process(target=_server, args=(prefix, n + warmup, use_torch))
        p.start()
        x, ts = np.ones((1, 4), np.float32), []
        for i in range(n + warmup):
            t = time.perf_counter()
            np.copyto(row, x)
            hdr[0], hdr[1] = i + 1, 1
            door.release()
            done.acquire()
            if seq[0] != i + 1:
                raise RuntimeError("answer out of order")
            out.copy()
            if i >= warmup:
                ts.append(time.perf_counter() - t)
        p.join(30)
        del hdr, row, out, seq, seg
        mm.close()
        return np.array(ts) * 1e6
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + prefix)
        for s in (door, done):
            s.unlink()
            s.close()


_STRIDE = 64   # bytes per client in the batching floor: seq, answered, 4 float32 in, 4 out


def _batch_server(prefix: str, workers: int, stop_at: float, use_torch: bool) -> None:
    import torch
    torch.set_num_threads(1)
    door = posix_ipc.Semaphore(prefix + ".d")
    done = [posix_ipc.Semaphore(f"{prefix}.o{w}") for w in range(workers)]
    fd = os.open("/dev/shm" + prefix, os.O_RDWR)
    mm = mmap.mmap(fd, workers * _STRIDE)
    rows = np.frombuffer(mm, np.uint8).reshape(workers, _STRIDE)
    seq, answered = rows[:, 0:8].view(np.int64)[:, 0], rows[:, 8:16].view(np.int64)[:, 0]
    x_in, y_out = rows[:, 16:32].view(np.float32), rows[:, 32:48].view(np.float32)
    model = torch.nn.Identity()
    batches = 0
    with torch.inference_mode():
        while time.monotonic() < stop_at:
            try:
                door.acquire(0.1)
            except posix_ipc.BusyError:
                continue
            s = seq.copy()
            ready = np.flatnonzero(s > answered)
            if not len(ready):
                continue
            x = x_in[ready]
            y = model(torch.from_numpy(x)).numpy() if use_torch else x
            y_out[ready] = y
            answered[ready] = s[ready]
            for w in ready.tolist():
                done[w].release()
            batches += 1
    os.close(fd)


def _batch_client(prefix: str, w: int, start: float, stop_at: float, q) -> None:
    door, done = posix_ipc.Semaphore(prefix + ".d"), posix_ipc.Semaphore(f"{prefix}.o{w}")
    fd = os.open("/dev/shm" + prefix, os.O_RDWR)
    mm = mmap.mmap(fd, (w + 1) * _STRIDE)
    row = np.frombuffer(mm, np.uint8)[w * _STRIDE:(w + 1) * _STRIDE]
    seq, answered = row[0:8].view(np.int64), row[8:16].view(np.int64)
    x_in, y_out = row[16:32].view(np.float32).reshape(1, 4), row[32:48].view(np.float32).reshape(1, 4)
    x, n, k = np.full((1, 4), w, np.float32), 0, 0
    while True:
        now = time.monotonic()
        if now >= stop_at:
            break
        np.copyto(x_in, x)
        k += 1
        seq[0] = k
        door.release()
        done.acquire()
        if answered[0] != k or y_out[0, 0] != w:
            raise RuntimeError("crossed answer")
        y_out.copy()
        if now >= start:
            n += 1
    q.put(n)
    del seq, answered, x_in, y_out, row
    mm.close()
    os.close(fd)


def floor_throughput(workers: int, seconds: float, use_torch: bool = True) -> float:
    """Requests per second of ``workers`` closed-loop clients against the batching floor."""
    prefix = f"/sdbi_floorb_{os.getpid()}"
    sems = [posix_ipc.Semaphore(prefix + ".d", posix_ipc.O_CREX)]
    sems += [posix_ipc.Semaphore(f"{prefix}.o{w}", posix_ipc.O_CREX) for w in range(workers)]
    fd = os.open("/dev/shm" + prefix, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    ctx = mp.get_context("spawn")
    try:
        os.ftruncate(fd, workers * _STRIDE)
        start = time.monotonic() + 2.0 + 0.3 * workers     # after every process has started
        stop_at = start + seconds
        q = ctx.Queue()
        procs = [ctx.Process(target=_batch_server, args=(prefix, workers, stop_at + 1.0, use_torch))]
        procs += [ctx.Process(target=_batch_client, args=(prefix, w, start, stop_at, q))
                  for w in range(workers)]
        for p in procs:
            p.start()
        n = sum(q.get(timeout=stop_at - time.monotonic() + 30) for _ in range(workers))
        for p in procs:
            p.join(30)
        return n / seconds
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + prefix)
        for s in sems:
            s.unlink()
            s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--no-torch", action="store_true", help="echo the row without calling torch")
    ap.add_argument("--workers", type=int, default=0, help="closed-loop clients for the batching "
                    "floor's throughput (0: skip it)")
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    ts = floor_roundtrip(a.n, not a.no_torch)
    p50, p90, p99 = np.percentile(ts, [50, 90, 99])
    what = "no torch" if a.no_torch else "torch.nn.Identity"
    print(f"floor round trip ({what})   p50 {p50:7.1f} us   p90 {p90:7.1f} us   p99 {p99:7.1f} us")
    if a.workers:
        rps = floor_throughput(a.workers, a.seconds, not a.no_torch)
        print(f"batching floor ({what}), {a.workers} closed-loop clients: {rps:.0f} requests/s")


if __name__ == "__main__":
    main()
