"""Past one host: the Ray Serve example on a local Ray instance -- replicas attach to the node's
simpledbi runtime, requests come through a Serve handle and over HTTP, batches mix replicas."""
from __future__ import annotations

import asyncio
import collections
import os
import secrets
import signal
import subprocess
import sys

import numpy as np
import pytest

from .test_fastapi_example import ROOT, _free_port, _stop, _wait_lines

ray = pytest.importorskip("ray", reason="the Ray Serve integration needs the extra simpledbi[ray]")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")


@pytest.fixture
def local_ray():
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    except Exception as e:  # noqa: BLE001 - a machine where Ray cannot run: say why
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {e}")
    try:
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.mark.timeout(420)
def test_ray_serve_replicas_batch_through_the_nodes_runtime(local_ray):
    sys.path.insert(0, ROOT)
    import torch
    from examples.fastapi_app.model import build
    from examples.ray_serve.deployment import Classifier

    name = f"ray{os.getpid()}-{secrets.token_hex(3)}"
    runtime = subprocess.Popen([sys.executable, "-m", "simpledbi", "serve", "--config",
                                "examples/fastapi_app/serve.toml", "--name", name, "--device", "cpu",
                                # batches wait up to 20 ms for any attached client: on a loaded
                                # 2-core machine requests of both replicas then always meet
                                "--batching", "fixed", "--wait-time", "0.02"],
                               cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_lines(runtime, "ready")
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = serve.run(Classifier.options(num_replicas=2).bind(runtime=name), name="sdbi",
                           route_prefix="/predict")
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(200)]
        via_handle = [r.result(timeout_s=120) for r in [handle.predict.remote(x.tolist()) for x in xs]]

        async def over_http():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
                return await asyncio.gather(*[c.post("/predict", json={"inputs": x.tolist()}) for x in xs])

        via_http = asyncio.run(over_http())
        bad = httpx.post(f"http://127.0.0.1:{port}/predict", json={"inputs": [[1.0] * 17]}, timeout=60)
        assert bad.status_code == 400 and "rows of 16 numbers" in bad.text

        model = build()
        answers = via_handle + [r.json() for r in via_http]
        assert all(r.status_code == 200 for r in via_http)
        with torch.no_grad():
            for x, a in zip(xs + xs, answers):
                np.testing.assert_allclose(np.asarray(a["outputs"], np.float32),
                                           model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
        replicas = {a["replica_pid"] for a in answers}
        assert len(replicas) == 2, replicas
        batches = collections.defaultdict(set)
        for a in answers:
            batches[a["batch_closed"]].add(a["replica_pid"])
        assert any(len(p) > 1 for p in batches.values()), "no batch mixed the two replicas"
        serve.delete("sdbi")
    finally:
        assert _stop(runtime, signal.SIGTERM) == 0
