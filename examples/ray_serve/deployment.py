"""A Ray Serve deployment whose replicas batch through the simpledbi runtime of their own node.

Ray Serve does what it is good at across hosts -- HTTP ingress, routing, replica placement,
autoscaling -- and simpledbi batches the requests of all replicas (and of anything else) on each
host into one model process group there, without an RPC hop to a model server.

    # on every node, once (a node-local service: systemd, a DaemonSet, or `start_runtime` below)
    simpledbi serve --config examples/fastapi_app/serve.toml --name ray-demo
    # anywhere in the cluster
    serve run examples.ray_serve.deployment:app

Every replica attaches to the runtime named ``SIMPLEDBI_RUNTIME`` (default ``ray-demo``) on the
node it was placed on: `/dev/shm` is per host, so the name always means the local runtime.
"""
from __future__ import annotations

import os
from typing import List

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from simpledbi import ModelError, ModelProcessDied, RuntimeStopped, SharedModel

RUNTIME = os.environ.get("SIMPLEDBI_RUNTIME", "ray-demo")
MODEL = os.environ.get("SIMPLEDBI_MODEL", "mlp")
FEATURES, MAX_ROWS = 16, 16


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=256)
class Classifier:
    def __init__(self, runtime: str = RUNTIME, model: str = MODEL):
        # One handle per replica process, attached to this node's runtime by name; it waits for
        # the runtime to come up and re-attaches if it restarts.
        self.model = SharedModel(model, (MAX_ROWS, FEATURES), runtime=runtime, connect_timeout=60)

    async def predict(self, rows: List[List[float]]) -> dict:
        """For DeploymentHandle callers: rows of 16 floats -> outputs and where they were computed."""
        x = np.asarray(rows, dtype=np.float32)
        if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != FEATURES:
            raise ValueError(f"expected 1..{MAX_ROWS} rows of {FEATURES} numbers, got shape {x.shape}")
        y = await self.model.forward_async(x, timeout=30)
        t = self.model.last_timing()
        return {"outputs": y.tolist(), "replica_pid": os.getpid(), "batch_rows": t["batch_rows"],
                "batch_closed": t["batch_closed"]}

    async def __call__(self, request: Request):
        """HTTP: POST {"inputs": [[...16 floats...], ...]}."""
        try:
            body = await request.json()
            return JSONResponse(await self.predict(body["inputs"]))
        except (ValueError, TypeError, KeyError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except ModelError as e:
            return JSONResponse({"error": str(e)}, status_code=500)
        except (ModelProcessDied, RuntimeStopped) as e:
            return JSONResponse({"error": str(e)}, status_code=503)
        except TimeoutError as e:
            return JSONResponse({"error": str(e)}, status_code=504)


app = Classifier.bind()
