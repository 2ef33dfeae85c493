"""The floor for the echo round trip in Python: the least a shared-memory request can cost.

    python experiments/roundtrip_floor.py [--n 3000] [--no-torch]

A client writes a (1, 4) float32 row and a seq into a shared segment and posts a semaphore; a
server process wakes, reads the header and the row with pread, runs ``torch.nn.Identity`` (unless
``--no-torch``), writes the row and the seq back with pwrite and posts another semaphore. No
slot protocol, no validation, no batching, no bookkeeping: what simpledbi's echo round trip
(experiments/roundtrip.py) would cost if its Python work per request were nearly nothing.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--no-torch", action="store_true", help="echo the row without calling torch")
    a = ap.parse_args()
    ts = floor_roundtrip(a.n, not a.no_torch)
    p50, p90, p99 = np.percentile(ts, [50, 90, 99])
    what = "no torch" if a.no_torch else "torch.nn.Identity"
    print(f"floor round trip ({what})   p50 {p50:7.1f} us   p90 {p90:7.1f} us   p99 {p99:7.1f} us")


if __name__ == "__main__":
    main()
