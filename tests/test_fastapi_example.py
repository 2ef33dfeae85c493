"""The FastAPI example end to end, over real HTTP: `simpledbi serve` + `uvicorn --workers 4`."""
from __future__ import annotations

import asyncio
import collections
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from .conftest import stderr_lines  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_lines(proc: subprocess.Popen, word: str, count: int = 1, timeout: float = 180) -> None:
    """Read ``proc``'s stderr until ``word`` appeared ``count`` times (a bound, not a pause: four
    web workers starting beside another test suite on 2 cores once took over 90 s)."""
    lines = stderr_lines(proc)
    seen, log = 0, []
    deadline = time.monotonic() + timeout
    while seen < count:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            break
        if line is None:
            break
        log.append(line)
        seen += word in line
    if seen < count:
        raise AssertionError(f"{word!r} came {seen}/{count} times; log:\n{''.join(log)}")


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


@pytest.mark.timeout(300)
def test_fastapi_example_batches_across_web_workers_over_http():
    sys.path.insert(0, ROOT)
    from examples.fastapi_app.model import build
    import torch

    name = f"web{os.getpid()}-{secrets.token_hex(3)}"
    port = _free_port()
    env = {**os.environ, "SIMPLEDBI_RUNTIME": name, "SIMPLEDBI_TIMEOUT": "30"}
    web = serve = None
    try:
        # The web app first: it starts, and answers 503 with Retry-After, before the runtime does
        # (it attached at start-up, waiting 60 s, then every web worker exited).
        web = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.fastapi_app.app:app",
                                "--workers", str(WORKERS), "--host", "127.0.0.1", "--port", str(port),
                                # idle pooled connections stay open for the whole test: uvicorn's 5 s
                                # default could close one as the client reuses it (httpx.ReadError
                                # on a loaded CI machine), which is not what this test is about
                                "--timeout-keep-alive", "120"],
                               cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
        _wait_lines(web, "Application startup complete", WORKERS)
        url = f"http://127.0.0.1:{port}"
        early = httpx.post(f"{url}/predict", json={"inputs": [[1.0] * 16]}, timeout=60)
        assert early.status_code == 503 and "Retry-After" in early.headers, early.text
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        serve = subprocess.Popen([sys.executable, "-m", "simpledbi", "serve", "--config",
                                  "examples/fastapi_app/serve.toml", "--name", name, "--device", "cpu"],
                                 cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
        _wait_lines(serve, "ready")

        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(400)]

        async def send_all():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                answers = await asyncio.gather(*[client.post("/predict", json={"inputs": x.tolist()})
                                                 for x in xs])
                bad = await asyncio.gather(
                    client.post("/predict", json={"inputs": [[1.0] * 17]}),             # 400
                    client.post("/predict", json={"inputs": [[-999.0] * 16]}),          # 500
                    client.post("/predict", json={"inputs": [[1.0] * 16], "timeout": 0}),  # 504
                    client.get("/health"))
                return answers, bad

        answers, (wrong_shape, model_error, timed_out, health) = asyncio.run(send_all())
        model = build()
        with torch.no_grad():
            for x, r in zip(xs, answers):
                assert r.status_code == 200, r.text
                expected = model(torch.from_numpy(x)).numpy()
                np.testing.assert_allclose(np.asarray(r.json()["outputs"], np.float32), expected,
                                           rtol=1e-5, atol=1e-5)
        assert wrong_shape.status_code == 400 and "expected 1..16 rows of 16 numbers" in wrong_shape.text
        assert model_error.status_code == 500 and "the model refuses -999" in model_error.text
        assert timed_out.status_code == 504, timed_out.text
        assert health.status_code == 200 and health.json()["ready"]

        # Requests with one batch_closed stamp were computed in one forward pass: some of them
        # came from different web workers.
        bodies = [r.json() for r in answers]
        batches = collections.defaultdict(set)
        for b in bodies:
            batches[b["batch_closed"]].add(b["worker_pid"])
        assert len({b["worker_pid"] for b in bodies}) > 1
        assert max(b["batch_rows"] for b in bodies) > 1
        assert any(len(pids) > 1 for pids in batches.values()), "no batch mixed web workers"

        assert _stop(serve) == 0          # the model goes away: the app answers 503
        down = httpx.post(f"{url}/predict", json={"inputs": [[1.0] * 16], "timeout": 1}, timeout=30)
        assert down.status_code == 503, down.text
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
    finally:
        if web is not None:
            _stop(web, signal.SIGINT)
        if serve is not None:
            _stop(serve)


def test_the_example_answers_overloaded_with_503_and_retry_after():
    sys.path.insert(0, ROOT)
    from examples.fastapi_app.app import http_error
    from simpledbi import Overloaded
    e = http_error(Overloaded("model 'mlp' is overloaded: ...", "deadline", expected_wait=2.6, timeout=1.0))
    assert e.status_code == 503 and e.headers == {"Retry-After": "2"} and "overloaded" in e.detail
    assert http_error(TimeoutError("slow")).status_code == 504
    from simpledbi import SlotsExhausted   # more calls in flight than max_clients: retry, not a bug
    e = http_error(SlotsExhausted("model 'mlp': all 512 client slots of this model are in use"))
    assert e.status_code == 503 and e.headers == {"Retry-After": "1"}
