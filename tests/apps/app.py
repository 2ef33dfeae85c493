"""A small application run as a separate process by test_lifecycle.py.

    python -m tests.apps.app MODE

MODE: ok | worker_raises | worker_dies | busy (loops until signalled; prints READY <janitor pid>)
| model_dies (a request segfaults its model process once: it is restarted, the run goes on)
| model_broken (every request segfaults: after max_restarts the model is broken and Run raises)
| slow_load DIR (a factory that touches DIR/loading, then takes minutes; join_timeout 30 s)
| runtime NAME (a started ``Runtime`` named NAME, served once, then idle with no signal handler
of its own: what a notebook kernel holds; prints READY)
| stdin_closed (fd 0 closed, then a ``Runtime`` serves 2 s after it started)
| big_start run|runtime (``Run`` or a bare ``Runtime`` whose factory carries more than a pipe
holds: starting the model process waits until the child reads it)
APP_SLOW_START=DIR: each child, while it starts, creates DIR/<pid> and sleeps 3 s.
"""
import functools
import logging
import os
import sys
import time

import numpy as np

from simpledbi import ModelConfig, ModelProcessDied, Run, RuntimeOptions, SharedModel, WorkerError


if __name__ == "__mp_main__" and os.environ.get("APP_SLOW_START"):
    # a child re-importing this module while it starts: say so, then take a while (as torch does)
    open(os.path.join(os.environ["APP_SLOW_START"], str(os.getpid())), "w").close()
    time.sleep(3)


def affine():
    from tests.models import Affine
    return Affine()


def faulty():
    from tests.models import Faulty
    return Faulty()


def carrying(payload):
    return affine()


def endless_load():
    open(os.path.join(os.environ["APP_LOADING_DIR"], "loading"), "w").close()
    time.sleep(600)


def worker(rank, mode):
    model = SharedModel("m", max_shape=(2, 3))
    x = np.full((2, 3), rank, np.float32)
    if mode == "model_broken":
        while True:  # every call crashes a model process, until the model is declared broken
            try:
                model.forward(np.full((1, 3), -11.0, np.float32))
            except ModelProcessDied:
                continue
    if mode == "model_dies" and rank == 0:
        try:
            model.forward(np.full((1, 3), -11.0, np.float32))  # SEGFAULT marker
            raise AssertionError("the segfaulting request returned")
        except ModelProcessDied as e:
            print(f"CAUGHT {e}", flush=True)
    for i in range(20 if mode != "busy" else 10**9):
        try:
            y = model.forward(x)
        except ModelProcessDied:
            if mode != "model_dies":
                raise
            y = model.forward(x)  # batched with the crashing request: retried, served
        np.testing.assert_array_equal(y, x * 2 + 1)
        if mode == "busy" and i == 0:
            print("READY", flush=True)
    if mode == "worker_raises" and rank == 1:
        raise KeyError("worker one failed on purpose")
    if mode == "worker_dies" and rank == 1:
        os._exit(7)
    return rank


def hold_a_runtime(name, start_method="spawn"):
    from simpledbi import Runtime
    cfg = ModelConfig(name="m", factory=affine, max_batch_size=4, device="cpu", num_threads=1)
    rt = Runtime([cfg], name=name, start_method=start_method)
    rt.start()
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(SharedModel("m", max_shape=(2, 3), runtime=name).forward(x), x * 2 + 1)
    print("READY", flush=True)
    while True:
        time.sleep(60)


def main(mode):
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if mode == "runtime":
        hold_a_runtime(*sys.argv[2:4])
    if mode == "fork_child_exit":   # a pre-fork server's worker: forked, then exits normally
        from simpledbi import Runtime
        cfg = ModelConfig(name="m", factory=affine, max_batch_size=4, device="cpu", num_threads=1)
        with Runtime([cfg]) as rt:
            m = SharedModel("m", max_shape=(2, 3), namespace=rt.namespace)
            x = np.ones((2, 3), np.float32)
            m.forward(x)
            pid = os.fork()
            if pid == 0:
                sys.exit(0)   # atexit handlers run here
            os.waitpid(pid, 0)
            np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
            print("OK", flush=True)
        return 0
    if mode == "raw_fork":   # a fork() in C (no Python at-fork hooks run): the child gets its own slots
        import ctypes
        from simpledbi import Runtime
        cfg = ModelConfig(name="m", factory=affine, max_batch_size=4, device="cpu", num_threads=1)
        with Runtime([cfg]) as rt:
            m = SharedModel("m", max_shape=(2, 3), namespace=rt.namespace)
            x = np.ones((2, 3), np.float32)
            m.forward(x)
            parents = {s.token for s in m._h.idle}
            pid = ctypes.PyDLL(None).fork()   # (PyDLL: the GIL stays held through the call)
            if pid == 0:
                ok = np.array_equal(m.forward(x + 1), (x + 1) * 2 + 1) and \
                    not parents & {s.token for s in m._h.idle}
                os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
            np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
            print("OK" if os.waitstatus_to_exitcode(status) == 0 else "CHILD LENT THE PARENT'S SLOTS", flush=True)
        return 0
    if mode == "stdin_closed":   # a daemon that closed its stdin: a new fd takes number 0
        from simpledbi import Runtime
        os.close(0)
        cfg = ModelConfig(name="m", factory=affine, max_batch_size=4, device="cpu", num_threads=1)
        with Runtime([cfg]) as rt:
            m = SharedModel("m", max_shape=(2, 3), namespace=rt.namespace)
            x = np.ones((2, 3), np.float32)
            time.sleep(2)   # the janitor's start (it read /dev/null for its pipe: it cleaned up at once)
            np.testing.assert_array_equal(m.forward(x), x * 2 + 1)
            print("OK", flush=True)
        return 0
    if mode == "big_start":
        cfg = ModelConfig(name="m", factory=functools.partial(carrying, b"x" * 300_000), device="cpu")
        if sys.argv[2] == "run":
            Run(models=[cfg], worker_num=0)
        else:
            from simpledbi import Runtime
            Runtime([cfg]).start().shutdown()
        return 0
    if mode == "slow_load":
        os.environ["APP_LOADING_DIR"] = sys.argv[2]   # inherited by the model process
        cfg = ModelConfig(name="m", factory=endless_load, device="cpu", load_timeout=900)
        try:
            Run(target=worker, worker_num=1, args=(mode,), models=[cfg],
                options=RuntimeOptions(join_timeout=30.0))
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            return 130
    factory = faulty if mode in ("model_dies", "model_broken") else affine
    cfg = ModelConfig(name="m", factory=factory, max_batch_size=4, model_num=2, wait_time=0.001,
                      device="cpu", num_threads=1, max_restarts=1, restart_backoff=0.05)
    try:
        out = Run(target=worker, worker_num=3, args=(mode,), models=[cfg],
                  options=RuntimeOptions(poll_interval=0.05))
        print("RESULT", out, flush=True)
        return 0
    except WorkerError as e:
        print(f"WORKERERROR rank={e.rank} exitcode={e.exitcode} type={e.remote_type} msg={e}", flush=True)
        return 3
    except ModelProcessDied as e:
        print(f"MODELDIED exitcode={e.exitcode} msg={e}", flush=True)
        return 4
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
