"""Soak test: the runtime under hostile-but-ordinary client behaviour, audited at the end.

    python experiments/soak.py --seconds 600 [--clients 12] [--threads 3] [--seed 1] [--json out.json]

One ``Runtime`` (model "affine": y = 2x + 1, two CPU model processes) lives in this process for
the whole run. ``--clients`` spawned client processes attach with ``SharedModel`` and loop, several
threads per process sharing one handle: random item shapes and row counts, random timeouts (none,
0.5-10 ms, or a few seconds), handles closed and re-created at random (also while other threads
have calls in flight). Every answer is checked exactly against 2x + 1, so a crossed result
cannot pass. A call must end in its result or in TimeoutError (only when it had a timeout),
ModelProcessDied or RuntimeStopped (only when its handle was closed); anything else is a failure.

Meanwhile this process, at random intervals, SIGKILLs a random client (and starts a replacement)
and a random model process (the runtime restarts it by itself). It watches for hung callers
(every client thread publishes the start of its call in flight in shared memory) and samples RSS
and open file descriptors of itself, the janitor and the model processes. It looks at model
processes through /proc only: ``Process.is_alive()`` would reap them under the runtime's feet.
An untimed call is hung after 30 + 10 s during which some model process was serving; a call with
a timeout, 10 s after its timeout.

At the end: clients are stopped and joined (one that does not exit is a hang), a lone client
measures its latency again (against the same measure taken before the chaos), the runtime is
shut down, and /dev/shm is checked for anything of the run's namespace. The audit table is
printed; the exit code is 0 when every check passes, 1 when one fails, 2 on a harness error, and
3 when the library's sources changed during the run (the figures then mean nothing).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from simpledbi import ModelConfig, ModelProcessDied, RuntimeOptions, RuntimeStopped, SharedModel  # noqa: E402
from simpledbi.runtime import Runtime  # noqa: E402

MODEL = "affine"
MAX_SHAPE = (4, 3, 5)
NO_TIMEOUT_GRACE = 30.0      # a call without timeout may take this long while the model is up
HANG_MARGIN = 10.0           # ... plus this, or its timeout plus this, before it counts as hung
REPORT_EVERY = 1.0           # seconds between a client's reports
RSS_GROWTH_LIMIT_MB = 50.0
LATENCY_CALLS = 200
MODEL_DOWN_LIMIT = 30.0      # a killed model process must be serving again within this


# ====================================================================== the model
def affine():
    """y = 2x + 1 (module-level so spawned model processes can unpickle it; torch only there)."""
    import torch

    class Affine(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    return Affine()


# ====================================================================== /proc helpers
def proc_usage(pid: int):
    """(RSS in MB, open fds) of ``pid``, or (None, None) if it is gone."""
    try:
        rss = None
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024.0
                    break
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds
    except (OSError, ValueError):
        return None, None


def pid_running(pid: int) -> bool:
    """Is ``pid`` running (not a zombie)? Reads /proc only: unlike ``Process.is_alive()`` it
    never reaps a child, so watching the model processes does not disturb the runtime's own
    supervision of them."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def source_fingerprint() -> dict:
    """sha1 of every source file of the library: restarted model processes import it afresh, so
    a run during which it changed tested a mix of versions and proves nothing."""
    import hashlib
    out = {}
    pkg = os.path.join(ROOT, "simpledbi")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                out[name] = hashlib.sha1(f.read()).hexdigest()
    return out


def namespace_entries(namespace: str) -> list:
    """Every /dev/shm entry of the namespace: its directory, its files and its semaphores."""
    out = []
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return out
    for e in entries:
        if namespace in e:
            out.append(e)
            path = os.path.join("/dev/shm", e)
            if os.path.isdir(path):
                try:
                    out.extend(f"{e}/{f}" for f in os.listdir(path))
                except OSError:
                    pass
    return sorted(out)


def slot_objects(namespace: str) -> list:
    """Entries of the namespace that are not the runtime's own (each model's control-block link
    and request socket): there should be none -- client slots are memfds, not files."""
    out = []
    for e in namespace_entries(namespace):
        base = e.rsplit("/", 1)[-1]
        if base.endswith((".ctl", ".sock")) or e == namespace:
            continue
        out.append(e)
    return out


# ====================================================================== client process
class _Holder:
    """The handle the threads of one client share; re-created at random."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.lock = threading.Lock()
        self.closed = weakref.WeakSet()      # handles this client closed on purpose
        self.h = None

    def create(self):
        return SharedModel(MODEL, max_shape=MAX_SHAPE, namespace=self.namespace)

    def ensure(self) -> None:
        """Make a handle if there is none open (a creation failed after a close)."""
        with self.lock:
            if self.h is None or self.h in self.closed:
                self.h = self.create()

    def recycle(self, close_first: bool) -> None:
        """Close the current handle and make a new one (in either order)."""
        with self.lock:
            old = self.h
            if close_first or old is None:
                if old is not None:
                    self.closed.add(old)
                    old.close()
                self.h = self.create()
            else:
                new = self.create()
                self.h = new
                self.closed.add(old)
                old.close()


def _new_counts() -> dict:
    return {"requests": 0, "ok": 0, "TimeoutError": 0, "ModelProcessDied": 0, "RuntimeStopped": 0,
            "wrong": 0, "other": 0, "wrong_type": 0, "recreates": 0, "closes_in_flight": 0,
            "attach_errors": 0, "max_timeout_overshoot_s": 0.0, "max_untimed_call_s": 0.0}


def client_main(slot: int, gen: int, namespace: str, seed: int, conn, stop, inflight, threads: int,
                think: float, close_every: float, parent_pid: int) -> None:
    """One client process: ``threads`` callers on one shared handle plus a closer thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the parent asks for stacks of a hang
    base = slot * (threads + 1)
    counts = [_new_counts() for _ in range(threads + 1)]      # one per thread; [threads]: admin
    samples = []                                              # texts of failures (a few)
    holder = _Holder(namespace)
    admin = counts[threads]

    def note(kind: str, text: str) -> None:
        if len(samples) < 8:
            samples.append(f"{kind}: {text}")

    def track(k: int, timeout):
        inflight[2 * (base + k) + 1] = -1.0 if timeout is None else float(timeout)
        inflight[2 * (base + k)] = time.monotonic()

    def untrack(k: int):
        inflight[2 * (base + k)] = 0.0

    def admin_recycle(close_first) -> bool:
        track(threads, None)
        try:
            if close_first is None:
                holder.ensure()
            else:
                holder.recycle(close_first)
                admin["recreates"] += 1
            return True
        except (RuntimeStopped, ModelProcessDied) as e:
            admin["attach_errors"] += 1
            note("close/re-create", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - counted: closing or creating a handle must not fail
            admin["attach_errors"] += 1
            admin["other"] += 1
            note("close/re-create", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
        finally:
            untrack(threads)
        return False

    def caller(k: int) -> None:
        rng = np.random.default_rng([seed, k])
        c = counts[k]
        while not stop.value:
            h = holder.h
            if h is None or h in holder.closed:
                time.sleep(0.01)
                if holder.h is h:           # not replaced (yet, or its creation failed)
                    admin_recycle(None)
                continue
            rows, a, b = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 6))
            x = rng.standard_normal((rows, a, b), dtype=np.float32)
            u = rng.random()
            timeout = None if u < 0.35 else (float(rng.uniform(0.0005, 0.01)) if u < 0.7
                                             else float(rng.uniform(2.0, 6.0)))
            c["requests"] += 1
            track(k, timeout)
            t0 = time.monotonic()
            try:
                y = h.forward(x, timeout=timeout)
            except TimeoutError as e:
                took = time.monotonic() - t0
                if timeout is None:
                    c["wrong_type"] += 1
                    note("TimeoutError without timeout", str(e))
                else:
                    c["TimeoutError"] += 1
                    c["max_timeout_overshoot_s"] = max(c["max_timeout_overshoot_s"], took - timeout)
            except ModelProcessDied:
                c["ModelProcessDied"] += 1
            except RuntimeStopped as e:
                if h in holder.closed:
                    c["RuntimeStopped"] += 1
                else:
                    c["wrong_type"] += 1
                    note("RuntimeStopped on an open handle", str(e))
            except Exception as e:  # noqa: BLE001 - counted
                c["other"] += 1
                note("other", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
            else:
                if timeout is None:
                    c["max_untimed_call_s"] = max(c["max_untimed_call_s"], time.monotonic() - t0)
                if isinstance(y, np.ndarray) and y.dtype == np.float32 and np.array_equal(y, 2 * x + 1):
                    c["ok"] += 1
                else:
                    c["wrong"] += 1
                    note("wrong", describe_wrong(x, y))
            finally:
                untrack(k)
            if rng.random() < 0.003:                 # this thread closes the shared handle
                admin_recycle(bool(rng.random() < 0.5))
            if think:
                time.sleep(float(rng.exponential(think)))

    def closer() -> None:
        """Close the handle while calls are in flight on other threads."""
        rng = random.Random(seed * 7 + 1)
        while not stop.value:
            end = time.monotonic() + rng.uniform(0.3, 2 * close_every)
            while time.monotonic() < end and not stop.value:
                time.sleep(0.05)
            for _ in range(200):                    # wait (up to ~0.2 s) for a call in flight
                if stop.value or any(inflight[2 * (base + k)] for k in range(threads)):
                    break
                time.sleep(0.001)
            if stop.value:
                break
            busy = any(inflight[2 * (base + k)] for k in range(threads))
            if admin_recycle(bool(rng.random() < 0.5)) and busy:
                admin["closes_in_flight"] += 1

    def report(final: bool) -> None:
        total = _new_counts()
        for c in counts:
            for key, v in c.items():
                total[key] = max(total[key], v) if key.startswith("max_") else total[key] + v
        conn.send(("final" if final else "report", slot, gen, total, list(samples)))

    try:
        track(threads, None)
        holder.h = holder.create()
    except Exception as e:  # noqa: BLE001 - counted; the callers retry
        admin["attach_errors"] += 1
        admin["other"] += 1
        note("attach", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
    finally:
        untrack(threads)
    pool = [threading.Thread(target=caller, args=(k,), name=f"caller-{k}") for k in range(threads)]
    pool.append(threading.Thread(target=closer, name="closer"))
    for t in pool:
        t.start()
    next_report = time.monotonic() + REPORT_EVERY
    while not stop.value:
        time.sleep(0.05)
        if os.getppid() != parent_pid:   # the soak's parent is gone: do not outlive it
            os._exit(3)
        if time.monotonic() >= next_report:
            report(False)
            next_report = time.monotonic() + REPORT_EVERY
    for t in pool:
        t.join(NO_TIMEOUT_GRACE + HANG_MARGIN)
    stuck = [t.name for t in pool if t.is_alive()]
    if stuck:
        note("stuck", f"threads still running at stop: {stuck}")
    track(threads, None)
    try:
        if holder.h is not None:
            holder.closed.add(holder.h)
            holder.h.close()
    except Exception as e:  # noqa: BLE001 - counted: close() must not fail
        admin["attach_errors"] += 1
        admin["other"] += 1
        note("close at exit", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
    finally:
        untrack(threads)
    report(True)
    conn.close()
    # a stuck non-daemon thread keeps this process alive: the parent counts it as a hang


def describe_wrong(x: np.ndarray, y) -> str:
    """What came back instead of 2x + 1 (whose result it is, if it is another shape's)."""
    want = 2 * x + 1
    try:
        if not isinstance(y, np.ndarray):
            return f"x {x.shape}: got a {type(y).__name__}"
        text = f"x {x.shape} float32: got {y.shape} {y.dtype}"
        if y.shape == want.shape:
            bad = np.flatnonzero(y.ravel() != want.ravel())
            text += (f", {bad.size} of {want.size} values differ (first at {int(bad[0])}: "
                     f"{y.ravel()[bad[0]]!r} != {want.ravel()[bad[0]]!r})")
        return text
    except Exception as e:  # noqa: BLE001 - a description must never fail
        return f"x {x.shape}: unprintable result ({type(e).__name__})"


def lone_latency(namespace: str, n: int, conn) -> None:
    """One client alone: ``n`` sequential tiny calls; sends back the durations (seconds)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        model = SharedModel(MODEL, max_shape=MAX_SHAPE, namespace=namespace)
        x = np.full((1, 1, 1), 0.5, np.float32)
        wrong = 0
        for _ in range(20):
            model.forward(x, timeout=5)
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            y = model.forward(x, timeout=5)
            ts.append(time.perf_counter() - t)
            wrong += not np.array_equal(y, 2 * x + 1)
        model.close()
        conn.send((ts, wrong, ""))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(([], 0, f"{type(e).__name__}: {e}"))
    conn.close()


def latency_similar(before: dict, after: dict) -> bool:
    """Lone-client p50 after the chaos at most 3x (or 1 ms above) the one before. A slot left
    attached by a dead client would make every batch wait ``wait_time`` (2 ms) for it."""
    return bool(before.get("ok") and after.get("ok") and not before.get("wrong") and
                not after.get("wrong") and
                after["p50_us"] <= max(3 * before["p50_us"], before["p50_us"] + 1000))


# ====================================================================== the parent
class _LogCounter(logging.Handler):
    """Counts the runtime's log records; keeps the unexpected ones."""

    def __init__(self, verbose: bool):
        super().__init__(logging.INFO)
        self.verbose = verbose
        self.reaped = 0
        self.restarted = 0
        self.unexpected = []

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        if "exited without closing it" in msg:
            self.reaped += 1
        elif "restarted (pid" in msg:
            self.restarted += 1
        elif record.levelno >= logging.WARNING and "restarting it in" not in msg:
            text = msg + ("\n" + "".join(traceback.format_exception(*record.exc_info))
                          if record.exc_info else "")
            self.unexpected.append(text)
            print(f"[soak] unexpected runtime log: {text}", file=sys.stderr, flush=True)
            return
        if self.verbose:
            print(f"[soak] runtime log: {msg}", file=sys.stderr, flush=True)


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.ctx = mp.get_context("spawn")
        self.threads = a.threads
        self.max_slots = a.clients
        self.inflight = self.ctx.RawArray("d", 2 * self.max_slots * (self.threads + 1))
        self.stop = self.ctx.RawValue("i", 0)
        self.clients = {}            # slot -> dict(proc, conn, gen, seed)
        self.reports = {}            # (slot, gen) -> last counts
        self.samples = {}            # (slot, gen) -> failure texts
        self.final = set()           # (slot, gen) that sent their final report
        self.killed = set()          # (slot, gen) killed by us
        self.crashed = []            # clients that exited on their own
        self.hung_calls = {}         # (index, start) -> description
        self.hung_clients = []
        self.clients_killed = 0
        self.models_killed = 0
        self.last_degraded = time.monotonic()
        self.down_since = {}         # model instance -> since when it is not serving
        self.max_downtime = 0.0
        self.resources = []
        self.events = []
        self.log = _LogCounter(a.verbose)
        self.t0 = time.monotonic()
        self.rt = None

    def say(self, text: str) -> None:
        if not self.a.quiet:
            print(f"[soak {time.monotonic() - self.t0:7.1f}s] {text}", flush=True)

    # -------------------------------------------------------------- clients
    def start_client(self, slot: int, gen: int) -> None:
        for i in range(2 * slot * (self.threads + 1), 2 * (slot + 1) * (self.threads + 1)):
            self.inflight[i] = 0.0
        parent_end, child_end = self.ctx.Pipe(duplex=False)
        seed = self.a.seed * 1_000_003 + slot * 10_007 + gen
        proc = self.ctx.Process(
            target=client_main, name=f"soak-client-{slot}.{gen}",
            args=(slot, gen, self.rt.namespace, seed, child_end, self.stop, self.inflight,
                  self.threads, self.a.think, self.a.close_every, os.getpid()))
        proc.start()
        child_end.close()
        self.clients[slot] = {"proc": proc, "conn": parent_end, "gen": gen}

    def drain(self, conn) -> bool:
        """Read every complete report waiting on ``conn``; False once it is closed."""
        try:
            while conn.poll():
                kind, slot, gen, counts, samples = conn.recv()
                self.reports[(slot, gen)] = counts
                self.samples[(slot, gen)] = samples
                if kind == "final":
                    self.final.add((slot, gen))
        except (EOFError, OSError):
            return False
        except Exception as e:  # noqa: BLE001 - a message cut short by SIGKILL
            self.events.append(f"unreadable report: {type(e).__name__}: {e}")
            return False
        return True

    def retire(self, slot: int) -> None:
        c = self.clients.pop(slot)
        c["proc"].join(10)
        if c["proc"].is_alive():
            c["proc"].kill()
            c["proc"].join()
        self.drain(c["conn"])
        c["conn"].close()
        c["proc"].close()

    def kill_client(self) -> None:
        slot = self.rng.choice(sorted(self.clients))
        c = self.clients[slot]
        try:
            os.kill(c["proc"].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.killed.add((slot, c["gen"]))
        self.clients_killed += 1
        self.retire(slot)
        self.start_client(slot, c["gen"] + 1)

    def check_clients(self) -> None:
        for slot in list(self.clients):
            c = self.clients[slot]
            self.drain(c["conn"])
            if c["proc"].exitcode is not None:
                self.crashed.append({"slot": slot, "gen": c["gen"], "pid": c["proc"].pid,
                                     "exitcode": c["proc"].exitcode})
                self.say(f"client {slot}.{c['gen']} exited on its own with {c['proc'].exitcode}")
                self.retire(slot)
                self.start_client(slot, c["gen"] + 1)

    # -------------------------------------------------------------- models
    def models_ready(self) -> bool:
        return all(pid_running(m.proc.pid) and not m.loading for m in self.rt.model_procs) and \
            not self.rt._restart_at

    def kill_model(self) -> None:
        alive = [m for m in self.rt.model_procs if pid_running(m.proc.pid) and not m.loading]
        if not alive:
            return
        m = self.rng.choice(alive)
        try:
            os.kill(m.proc.pid, signal.SIGKILL)
            self.models_killed += 1
        except ProcessLookupError:
            pass

    def wait_models(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_hangs()
            if self.models_ready():
                return True
            time.sleep(0.05)
        return False

    # -------------------------------------------------------------- hangs
    def check_hangs(self) -> None:
        now = time.monotonic()
        if not any(pid_running(m.proc.pid) and not m.loading for m in self.rt.model_procs):
            self.last_degraded = now    # no model process serves: untimed calls may wait
        for m in self.rt.model_procs:
            up = pid_running(m.proc.pid) and not m.loading
            since = self.down_since.get(m.instance)
            if up:
                self.down_since.pop(m.instance, None)
            elif since is None:
                self.down_since[m.instance] = now
            else:
                self.max_downtime = max(self.max_downtime, now - since)
        per = self.threads + 1
        for slot, c in self.clients.items():
            for k in range(per):
                i = slot * per + k
                start, timeout = self.inflight[2 * i], self.inflight[2 * i + 1]
                if not start:
                    continue
                if timeout >= 0:
                    over = now - start - (timeout + HANG_MARGIN)
                else:
                    over = now - max(start, self.last_degraded) - (NO_TIMEOUT_GRACE + HANG_MARGIN)
                key = (i, start)
                if over > 0 and key not in self.hung_calls:
                    what = "admin (create/close)" if k == self.threads else f"thread {k}"
                    desc = (f"client {slot}.{c['gen']} (pid {c['proc'].pid}) {what}: call in flight "
                            f"{now - start:.1f} s, timeout {'none' if timeout < 0 else f'{timeout:g} s'}")
                    self.hung_calls[key] = desc
                    self.say("HUNG CALLER: " + desc + " (stacks dumped to stderr)")
                    try:
                        os.kill(c["proc"].pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass

    # -------------------------------------------------------------- resources
    def sample(self, label: str, record: bool = True) -> dict:
        t = time.monotonic() - self.t0
        rss, fds = proc_usage(os.getpid())
        s = {"label": label, "t": round(t, 2), "main": {"pid": os.getpid(), "rss_mb": rss, "fds": fds},
             "models": [], "attached_slots": None, "slot_objects": len(slot_objects(self.rt.namespace))}
        if self.rt._janitor is not None:
            jr, jf = proc_usage(self.rt._janitor.pid)
            s["janitor"] = {"pid": self.rt._janitor.pid, "rss_mb": jr, "fds": jf}
        for m in self.rt.model_procs:
            r, f = proc_usage(m.proc.pid)
            s["models"].append({"instance": m.instance, "pid": m.proc.pid, "rss_mb": r, "fds": f,
                                "ready": bool(pid_running(m.proc.pid) and not m.loading)})
        ctl = self.rt.ctls.get(MODEL)
        if ctl is not None:   # client slots the model processes still map
            s["attached_slots"] = int(ctl.instances["clients"].max())
        if record:
            self.resources.append(s)
        return s

    def quiet_sample(self, label: str) -> dict:
        """A sample taken while every model process is up; the smallest fd count of a few tries
        (a restart in progress holds a few pipes for a moment)."""
        self.wait_models(10)
        best = None
        for _ in range(5):
            s = self.sample(label, record=False)
            if best is None or (s["main"]["fds"] or 0) < (best["main"]["fds"] or 0):
                best = s
            time.sleep(0.1)
        self.resources.append(best)
        return best

    # -------------------------------------------------------------- latency
    def latency(self, label: str) -> dict:
        parent_end, child_end = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=lone_latency, args=(self.rt.namespace, LATENCY_CALLS, child_end),
                             name=f"soak-latency-{label}")
        p.start()
        child_end.close()
        out = {"ok": False}
        if parent_end.poll(120):
            try:
                ts, wrong, error = parent_end.recv()
                if error:
                    out["error"] = error
                else:
                    ts = np.array(ts) * 1e6
                    out = {"ok": True, "calls": len(ts), "wrong": int(wrong),
                           "p50_us": float(np.percentile(ts, 50)),
                           "p90_us": float(np.percentile(ts, 90)),
                           "p99_us": float(np.percentile(ts, 99))}
            except (EOFError, OSError):
                pass
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
        out["exitcode"] = p.exitcode
        p.close()
        parent_end.close()
        return out

    # -------------------------------------------------------------- the run
    def run(self) -> dict:
        a = self.a
        logger = logging.getLogger("simpledbi")
        logger.addHandler(self.log)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        # the spawn context's resource tracker holds one pipe for good: start it before counting
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
        fds_before_runtime = proc_usage(os.getpid())[1]
        sources_before = source_fingerprint()
        cfg = ModelConfig(name=MODEL, factory=affine, device="cpu", num_threads=1, model_num=2,
                          max_batch_size=8, wait_time=0.002, max_restarts=1000, restart_window=1.0,
                          load_timeout=120)
        self.rt = rt = Runtime([cfg], RuntimeOptions(poll_interval=0.05))
        namespace = None
        try:
            rt.start()
            namespace = rt.namespace
            self.say(f"runtime up: namespace {namespace}, model pids "
                     f"{[m.proc.pid for m in rt.model_procs]}")
            idle_start = self.quiet_sample("idle_start")
            lat_before = self.latency("before")
            self.say(f"lone latency before: {lat_before}")
            for slot in range(a.clients):
                self.start_client(slot, 0)
            deadline = time.monotonic() + 120     # every client up and calling before the chaos
            while time.monotonic() < deadline and \
                    any((s, c["gen"]) not in self.reports for s, c in self.clients.items()):
                wait([c["conn"] for c in self.clients.values()], timeout=0.2)
                self.check_clients()
            time.sleep(min(3.0, max(1.0, a.seconds / 20)))
            chaos_start = self.quiet_sample("chaos_start")
            self.say(f"{a.clients} clients x {self.threads} threads running; chaos for {a.seconds:g} s")
            t_end = time.monotonic() + a.seconds
            sample_every = max(5.0, a.seconds / 30)
            next_sample = time.monotonic() + sample_every
            next_client_kill = time.monotonic() + self.rng.uniform(0.5, 2 * a.client_kill_every)
            next_model_kill = time.monotonic() + self.rng.uniform(0.5, 2 * a.model_kill_every)
            next_status = time.monotonic() + 10
            while time.monotonic() < t_end:
                conns = [c["conn"] for c in self.clients.values()]
                wait(conns, timeout=0.2)
                self.check_clients()
                self.check_hangs()
                now = time.monotonic()
                if now >= next_client_kill:
                    self.kill_client()
                    next_client_kill = now + self.rng.uniform(0.5, 2 * a.client_kill_every)
                if now >= next_model_kill:
                    self.kill_model()
                    next_model_kill = now + self.rng.uniform(0.5, 2 * a.model_kill_every)
                if now >= next_sample:
                    self.sample("during")
                    next_sample = now + sample_every
                if now >= next_status:
                    t = self.totals()
                    self.say(f"requests {t['requests']}, ok {t['ok']}, timeouts {t['TimeoutError']}, "
                             f"died {t['ModelProcessDied']}, stopped {t['RuntimeStopped']}, "
                             f"wrong {t['wrong']}, other {t['other'] + t['wrong_type']}; killed "
                             f"{self.clients_killed} clients, {self.models_killed} model procs")
                    next_status = now + 10
            # ---- the end of the chaos: let the model come back, measure, stop the clients
            recovered_chaos_end = self.wait_models(MODEL_DOWN_LIMIT)
            chaos_end = self.quiet_sample("chaos_end")
            self.say("stopping clients")
            self.stop.value = 1
            deadline = time.monotonic() + NO_TIMEOUT_GRACE + HANG_MARGIN + 5
            while time.monotonic() < deadline and any(c["proc"].is_alive() for c in self.clients.values()):
                wait([c["conn"] for c in self.clients.values()], timeout=0.2)
                for c in self.clients.values():
                    self.drain(c["conn"])
                self.check_hangs()
            hung = [slot for slot, c in self.clients.items() if c["proc"].is_alive()]
            for slot in hung:
                c = self.clients[slot]
                self.hung_clients.append(f"client {slot}.{c['gen']} (pid {c['proc'].pid}) did "
                                         f"not exit within {NO_TIMEOUT_GRACE + HANG_MARGIN + 5:g} s")
                self.say("HUNG CLIENT: " + self.hung_clients[-1] + " (stacks dumped to stderr)")
                try:
                    os.kill(c["proc"].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            if hung:
                time.sleep(1.0)
            for slot in list(self.clients):
                c = self.clients[slot]
                if slot in hung:
                    c["proc"].kill()
                elif c["proc"].exitcode != 0:
                    self.crashed.append({"slot": slot, "gen": c["gen"], "pid": c["proc"].pid,
                                         "exitcode": c["proc"].exitcode})
                elif (slot, c["gen"]) not in self.final:
                    self.drain(c["conn"])
                self.retire(slot)
            missing_final = sorted(f"{s}.{g}" for (s, g) in self.reports
                                   if (s, g) not in self.final and (s, g) not in self.killed)
            # ---- no client left: every slot must be freed, every slot object removed
            recovered = self.wait_models(10)
            time.sleep(max(0.5, 10 * rt.options.poll_interval))   # several maintenance passes
            attached_after = int(rt.ctls[MODEL].instances["clients"].max())
            objects_after = slot_objects(namespace)
            lat_after = self.latency("after")
            for _ in range(2):   # other load on the machine is noise: a real regression stays
                if latency_similar(lat_before, lat_after) or not lat_after.get("ok"):
                    break
                self.say(f"lone latency after: {lat_after}; measuring again")
                again = self.latency("after")
                if again.get("ok"):
                    lat_after = min(lat_after, again, key=lambda r: r["p50_us"])
            self.say(f"lone latency after: {lat_after}")
            time.sleep(0.5)
            idle_end = self.quiet_sample("idle_end")
            from simpledbi import stats as _stats
            model_stats = _stats.summarize(rt.ctls[MODEL])
            restarts = int(rt.ctls[MODEL].instances["restarts"].sum())
            broken = dict(rt.broken)
        finally:
            self.stop.value = 1
            for slot in list(self.clients):
                try:
                    self.clients[slot]["proc"].kill()
                except Exception:  # noqa: BLE001
                    pass
                self.retire(slot)
            rt.shutdown()
        leftover = namespace_entries(namespace) if namespace else []
        children_left = [p.name for p in mp.active_children()]
        # shutdown() leaves the sentinels of its processes (janitor, model processes) open until
        # the Runtime object is collected: count both ways, check the latter
        fds_after_shutdown_held = proc_usage(os.getpid())[1]
        self.rt = rt = None
        gc.collect()
        fds_after_shutdown = proc_usage(os.getpid())[1]
        sources_after = source_fingerprint()
        return self.audit(locals())

    # -------------------------------------------------------------- the audit
    def totals(self) -> dict:
        total = _new_counts()
        for counts in self.reports.values():
            for k, v in counts.items():
                total[k] = max(total[k], v) if k.startswith("max_") else total[k] + v
        return total

    def audit(self, v: dict) -> dict:
        a = self.a
        t = self.totals()
        checks = []

        def check(name, value, ok, note=""):
            checks.append({"check": name, "value": value, "ok": bool(ok), "note": note})

        typed = t["TimeoutError"] + t["ModelProcessDied"] + t["RuntimeStopped"]
        check("requests", t["requests"], t["requests"] > 0 and t["ok"] > 0, "some calls must succeed")
        check("ok", t["ok"], True)
        check("typed errors: TimeoutError", t["TimeoutError"], True)
        check("typed errors: ModelProcessDied", t["ModelProcessDied"], True)
        check("typed errors: RuntimeStopped", t["RuntimeStopped"], True)
        check("crossed / wrong results", t["wrong"], t["wrong"] == 0, "must be 0")
        check("other exceptions", t["other"], t["other"] == 0, "must be 0")
        check("wrong error type", t["wrong_type"], t["wrong_type"] == 0,
              "TimeoutError without a timeout, RuntimeStopped on an open handle")
        unaccounted = t["requests"] - t["ok"] - typed - t["wrong"] - t["other"] - t["wrong_type"]
        check("calls without an outcome in reports", unaccounted, True,
              "calls in flight at a client's last report (killed clients)")
        check("hung callers", len(self.hung_calls), not self.hung_calls, "must be 0")
        check("hung clients (did not exit on stop)", len(self.hung_clients), not self.hung_clients)
        check("clients that crashed", len(self.crashed), not self.crashed, "exited on their own")
        check("clients without a final report", len(v["missing_final"]), not v["missing_final"])
        check("handle re-creations (clients)", t["recreates"], True)
        check("closes with calls in flight", t["closes_in_flight"], True)
        check("errors closing / creating a handle", t["attach_errors"], t["attach_errors"] == 0)
        check("max overshoot of a timeout (s)", round(t["max_timeout_overshoot_s"], 3),
              t["max_timeout_overshoot_s"] < HANG_MARGIN)
        check("longest call without timeout (s)", round(t["max_untimed_call_s"], 3), True)
        check("clients killed", self.clients_killed, True)
        check("model processes killed", self.models_killed, True)
        check("model process restarts", v["restarts"], v["restarts"] == self.models_killed,
              "must equal the kills (else a model process died on its own)")
        check("longest model instance downtime (s)", round(self.max_downtime, 1),
              self.max_downtime < MODEL_DOWN_LIMIT, f"a killed instance serves again within {MODEL_DOWN_LIMIT:g} s")
        check("model recovered at the end", v["recovered"] and v["recovered_chaos_end"],
              v["recovered"] and v["recovered_chaos_end"])
        check("model marked broken", bool(v["broken"]), not v["broken"])
        check("dead clients' slots freed by the reaper (log)", self.log.reaped, True)
        check("unexpected runtime log records", len(self.log.unexpected), not self.log.unexpected)
        check("slots attached after every client left", v["attached_after"], v["attached_after"] == 0)
        check("slot objects left after every client left", len(v["objects_after"]),
              not v["objects_after"], "segments / semaphores of detached or dead clients")
        check("/dev/shm entries left after shutdown", len(v["leftover"]), not v["leftover"], "must be 0")
        check("child processes left after shutdown", len(v["children_left"]), not v["children_left"])
        # resources
        cs, ce = v["chaos_start"]["main"], v["chaos_end"]["main"]
        check("main fds chaos start -> end", f"{cs['fds']} -> {ce['fds']}", ce["fds"] <= cs["fds"],
              "must be flat")
        check("main fds before runtime -> after shutdown",
              f"{v['fds_before_runtime']} -> {v['fds_after_shutdown']}",
              v["fds_after_shutdown"] <= v["fds_before_runtime"],
              f"must be flat (with the Runtime object still referenced: {v['fds_after_shutdown_held']})")
        grow = ce["rss_mb"] - cs["rss_mb"]
        check("main RSS chaos start -> end (MB)", f"{cs['rss_mb']:.1f} -> {ce['rss_mb']:.1f}",
              grow < RSS_GROWTH_LIMIT_MB, f"growth {grow:+.1f} MB (limit {RSS_GROWTH_LIMIT_MB:g})")
        js, je = v["idle_start"].get("janitor"), v["idle_end"].get("janitor")
        if js and je and js["fds"] is not None and je["fds"] is not None:
            check("janitor fds / RSS start -> end",
                  f"{js['fds']} -> {je['fds']} / {js['rss_mb']:.1f} -> {je['rss_mb']:.1f} MB",
                  je["fds"] <= js["fds"] and je["rss_mb"] - js["rss_mb"] < RSS_GROWTH_LIMIT_MB)
        by_inst_s = {m["instance"]: m for m in v["idle_start"]["models"]}
        for m in v["idle_end"]["models"]:
            s = by_inst_s.get(m["instance"])
            if s and s["fds"] is not None and m["fds"] is not None:
                check(f"model {m['instance']} fds idle start -> idle end",
                      f"{s['fds']} (pid {s['pid']}) -> {m['fds']} (pid {m['pid']})",
                      m["fds"] <= s["fds"], "no client attached at either point: must be flat")
        for pid, first, last in self.long_lived_models():
            grow = last["rss_mb"] - first["rss_mb"]
            check(f"model pid {pid} RSS over {last['t'] - first['t']:.0f} s (MB)",
                  f"{first['rss_mb']:.1f} -> {last['rss_mb']:.1f}", grow < RSS_GROWTH_LIMIT_MB,
                  f"growth {grow:+.1f} MB; fds {first['fds']} -> {last['fds']}")
        lb, la = v["lat_before"], v["lat_after"]
        lat_ok = latency_similar(lb, la)
        check("lone-client p50 before -> after (us)",
              f"{lb.get('p50_us', float('nan')):.0f} -> {la.get('p50_us', float('nan')):.0f}",
              lat_ok, "similar: at most 3x or +1 ms")
        changed = sorted(k for k in set(v["sources_before"]) | set(v["sources_after"])
                         if v["sources_before"].get(k) != v["sources_after"].get(k))
        check("library sources unchanged during the run", ", ".join(changed) or "yes", not changed,
              "else the run mixed versions (restarted model processes load the new one): invalid")
        passed = all(c["ok"] for c in checks)
        failures = {f"{s}.{g}": texts for (s, g), texts in self.samples.items() if texts}
        return {
            "passed": passed,
            "invalid": bool(changed),
            "sources_changed": changed,
            "config": {k: getattr(a, k) for k in vars(a)},
            "seconds_run": round(time.monotonic() - self.t0, 1),
            "totals": t,
            "checks": checks,
            "hung_calls": list(self.hung_calls.values()),
            "hung_clients": self.hung_clients,
            "crashed_clients": self.crashed,
            "failure_samples": failures,
            "unexpected_logs": self.log.unexpected,
            "leftover_after_shutdown": v["leftover"],
            "slot_objects_after_clients": v["objects_after"],
            "latency_before": lb,
            "latency_after": la,
            "model_stats": v["model_stats"],
            "resources": self.resources,
            "events": self.events,
        }

    def long_lived_models(self):
        """(pid, first, last) samples of model processes seen in at least two samples 20 s apart
        (the first sample is taken once the process has been up a while)."""
        seen = {}
        for s in self.resources:
            for m in s["models"]:
                if m["ready"] and m["rss_mb"] is not None:
                    seen.setdefault(m["pid"], []).append(dict(m, t=s["t"]))
        out = []
        for pid, ms in seen.items():
            if len(ms) >= 2 and ms[-1]["t"] - ms[0]["t"] >= 20:
                out.append((pid, ms[0], ms[-1]))
        return out


def print_report(r: dict) -> None:
    print()
    print(f"simpledbi soak audit: {r['config']['clients']} clients x {r['config']['threads']} "
          f"threads, {r['config']['seconds']:g} s of chaos (seed {r['config']['seed']})")
    w = max(len(c["check"]) for c in r["checks"])
    vw = max(len(str(c["value"])) for c in r["checks"])
    print(f"  {'check':<{w}}  {'value':>{vw}}  result  note")
    for c in r["checks"]:
        print(f"  {c['check']:<{w}}  {str(c['value']):>{vw}}  {'ok  ' if c['ok'] else 'FAIL'}    {c['note']}")
    ms = r["model_stats"]
    print(f"  model counters: {ms['requests']} requests in {ms['batches']} batches "
          f"(mean batch {ms['mean_batch_size']:.2f} rows), restarts {ms['restarts']}")
    for what in ("hung_calls", "hung_clients", "crashed_clients", "unexpected_logs",
                 "leftover_after_shutdown", "slot_objects_after_clients"):
        if r[what]:
            print(f"  {what}:")
            for item in r[what][:10]:
                print(f"    {item}")
    if r["failure_samples"]:
        print("  failure samples:")
        for who, texts in list(r["failure_samples"].items())[:10]:
            for text in texts[:3]:
                print(f"    client {who}: {text.strip()}")
    if r["invalid"]:
        print(f"AUDIT INVALID: the library's sources changed during the run ({', '.join(r['sources_changed'])})")
    else:
        print(f"AUDIT {'PASSED' if r['passed'] else 'FAILED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="length of the chaos phase")
    ap.add_argument("--clients", type=int, default=12, help="client processes at any time")
    ap.add_argument("--threads", type=int, default=3, help="caller threads per client process")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="", help="write every figure to this file")
    ap.add_argument("--think", type=float, default=0.004,
                    help="mean pause between a thread's calls (s); keeps the CPU load reasonable")
    ap.add_argument("--close-every", type=float, default=1.5,
                    help="mean seconds between a client's close-while-in-flight")
    ap.add_argument("--client-kill-every", type=float, default=4.0, help="mean seconds between SIGKILLs of a client")
    ap.add_argument("--model-kill-every", type=float, default=6.0,
                    help="mean seconds between SIGKILLs of a model process")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if a.clients < 1 or a.threads < 1 or a.seconds <= 0:
        ap.error("--clients, --threads and --seconds must be positive")
    soak = Soak(a)
    try:
        report = soak.run()
    except Exception:  # noqa: BLE001 - the harness itself failed
        traceback.print_exc()
        print("AUDIT ERROR (harness)")
        return 2
    print_report(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if report["invalid"]:
        return 3
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
