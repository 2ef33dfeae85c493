"""A FastAPI app whose web workers share one batched model through simpledbi.

    simpledbi serve --config examples/fastapi_app/serve.toml &
    SIMPLEDBI_RUNTIME=fastapi-demo uvicorn examples.fastapi_app.app:app --workers 4

Each uvicorn worker process attaches to the runtime by name once, at its first request (so the
app starts, and answers 503, before the runtime does or while it loads); every request handler
awaits ``forward_async``, so concurrent requests of all workers are batched together. Errors map
to HTTP: 400 bad input, 500 the model raised, 503 the model or runtime is down or not started yet
-- or overloaded: refused at once, with ``Retry-After`` (README "Overload"), or more requests in
flight than the model's ``max_clients`` slots --, 504 timeout.
"""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from typing import List, Optional

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import simpledbi
from simpledbi import (ModelError, ModelProcessDied, Overloaded, RuntimeStopped, RuntimeUnavailable, SharedModel,
                       SlotsExhausted)

MODEL = os.environ.get("SIMPLEDBI_MODEL", "mlp")
MAX_ROWS = 16
TIMEOUT = float(os.environ.get("SIMPLEDBI_TIMEOUT", "10"))
#: How long a request waits for the runtime to be there before it is answered 503: a web worker that
#: waited out each request's timeout for a runtime still loading (or one never started) would hold
#: its connections that long; a load balancer retries a 503.
ATTACH_WAIT = float(os.environ.get("SIMPLEDBI_ATTACH_WAIT", "2"))


class PredictRequest(BaseModel):
    inputs: List[List[float]]          # rows of 16 features
    timeout: Optional[float] = None    # seconds; default SIMPLEDBI_TIMEOUT
    priority: int = 0                  # higher runs first past capacity (-1000..1000)


class PredictResponse(BaseModel):
    outputs: List[List[float]]
    worker_pid: int                    # which web worker served it
    batch_rows: int                    # rows in the batch this request was computed in
    batch_closed: float                # when that batch started (time.monotonic, host-wide)


@asynccontextmanager
async def lifespan(app: FastAPI):
    app.state.model = app.state.attaching = None
    yield
    if app.state.model is not None:
        app.state.model.close()


app = FastAPI(title="simpledbi FastAPI example", lifespan=lifespan)


async def attached() -> SharedModel:
    """This web worker's handle, made at a request (attached, it re-attaches by itself when the
    runtime restarts). One attempt at a time: the requests that come meanwhile share its outcome,
    rather than each waiting ATTACH_WAIT in turn for a runtime that is not there."""
    if app.state.model is None:
        if app.state.attaching is None:   # (connect_async waits for the runtime in a thread)
            app.state.attaching = asyncio.ensure_future(SharedModel.connect_async(
                MODEL, (MAX_ROWS, 16), connect_timeout=ATTACH_WAIT))
            app.state.attaching.add_done_callback(_attach_done)
        return await asyncio.shield(app.state.attaching)
    return app.state.model


def _attach_done(attempt: asyncio.Future) -> None:
    app.state.attaching = None
    if not attempt.cancelled() and attempt.exception() is None:
        app.state.model = attempt.result()


def http_error(e: BaseException) -> HTTPException:
    """How simpledbi's exceptions read over HTTP."""
    if isinstance(e, (ValueError, TypeError)):
        return HTTPException(400, str(e))
    if isinstance(e, ModelError):
        return HTTPException(500, str(e))
    if isinstance(e, Overloaded):   # before TimeoutError: it is one
        return HTTPException(503, str(e), headers={"Retry-After": str(max(1, round(e.retry_after)))})
    if isinstance(e, SlotsExhausted):   # more calls in flight than ModelConfig.max_clients: retry
        return HTTPException(503, str(e), headers={"Retry-After": "1"})
    if isinstance(e, RuntimeUnavailable):   # before RuntimeStopped and TimeoutError: it is both
        return HTTPException(503, str(e), headers={"Retry-After": str(max(1, round(ATTACH_WAIT)))})
    if isinstance(e, (ModelProcessDied, RuntimeStopped)):
        return HTTPException(503, str(e))
    if isinstance(e, TimeoutError):
        return HTTPException(504, str(e))
    return HTTPException(500, f"{type(e).__name__}: {e}")


@app.post("/predict", response_model=PredictResponse)
async def predict(req: PredictRequest) -> PredictResponse:
    try:
        model = await attached()
        try:
            x = np.asarray(req.inputs, dtype=np.float32)
        except ValueError:
            raise ValueError(f"inputs: expected 1..{MAX_ROWS} rows of 16 numbers, got rows of "
                             f"lengths {[len(r) for r in req.inputs][:MAX_ROWS]}") from None
        if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != 16:
            raise ValueError(f"inputs: expected 1..{MAX_ROWS} rows of 16 numbers, got shape {x.shape}")
        y = await model.forward_async(x, timeout=TIMEOUT if req.timeout is None else req.timeout,
                                      priority=req.priority)
    except Exception as e:  # noqa: BLE001 - mapped to a status code
        raise http_error(e) from e
    t = model.last_timing()
    return PredictResponse(outputs=y.tolist(), worker_pid=os.getpid(), batch_rows=t["batch_rows"],
                           batch_closed=t["batch_closed"])


@app.get("/health")
def health():
    """200 while the model serves, 503 otherwise (for a load balancer's probe)."""
    try:
        info = simpledbi.inspect()   # ($SIMPLEDBI_RUNTIME)
    except LookupError as e:
        raise HTTPException(503, str(e)) from e
    if not info.ready:
        raise HTTPException(503, "not ready: " + ", ".join(f"{m.name} {m.state}" for m in info.models))
    return {"ready": True, "models": {m.name: {"requests": m.requests, "mean_batch_size":
                                               round(m.mean_batch_size, 2)} for m in info.models}}
