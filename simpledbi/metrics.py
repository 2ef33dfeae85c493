"""Prometheus metrics of a running runtime (optional extra: ``pip install simpledbi[metrics]``).

A ``prometheus_client`` *custom collector*: each scrape reads the shared-memory counters and
histograms that the model processes keep anyway (status.py), so there is no per-request cost,
no multiprocess-mode directory and nothing to clean up. Names follow Triton's metrics (a
dashboard built for one reads the other with a rename); ``_FAMILIES`` below lists them, with their
labels: ``reason`` is model_error | bad_request for failures, deadline | queue for refusals."""
from __future__ import annotations

from typing import Optional

from .layout import BATCH_HIST_MAX, LAT_BOUNDS
from .status import Histogram, inspect

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("simpledbi.metrics needs prometheus_client: pip install 'simpledbi[metrics]'") from e

__all__ = ["RuntimeCollector", "start_metrics_server"]

# Exported latency buckets: every other internal bound (100 us .. 52 s); Prometheus buckets are
# cumulative, so merging internal ones loses nothing but resolution.
_EXPORT_BOUNDS = LAT_BOUNDS[::2]
_BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)
assert _BATCH_BOUNDS[-1] == BATCH_HIST_MAX   # key 0 counts the larger batches: only in +Inf
_C, _G, _H = CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
_FAMILIES = (   # key, kind, name, help, labels after "model" -- exported in this order
    ("ok", _C, "simpledbi_request_success", "Requests answered with a result", ()),
    ("fail", _C, "simpledbi_request_failure", "Requests that failed", ("reason",)),
    ("rows", _C, "simpledbi_inference_count", "Rows computed", ()),
    ("batches", _C, "simpledbi_batch", "Forward passes (batches)", ()),
    ("over", _C, "simpledbi_over_target", "Answers later than the model's latency_target", ()),
    ("rejected", _C, "simpledbi_rejected", "Requests refused with Overloaded (never run), by reason",
     ("reason",)),
    ("size", _H, "simpledbi_batch_size", "Rows per batch", ()),
    ("latency", _H, "simpledbi_request_duration_seconds", "Per request: publish to answer", ()),
    ("queue", _H, "simpledbi_queue_duration_seconds", "Per request: publish to the start of its batch",
     ()),
    ("compute", _H, "simpledbi_compute_duration_seconds", "Per batch: start to answered", ()),
    ("queued", _G, "simpledbi_queued_requests", "Requests waiting for an answer", ()),
    ("clients", _G, "simpledbi_attached_clients", "Client slots attached", ()),
    ("ready", _G, "simpledbi_model_ready", "1 while the model serves", ()),
    ("up", _G, "simpledbi_instance_up", "1 while a model process is ready", ("instance", "device")),
    ("restarts", _C, "simpledbi_instance_restarts", "Restarts of a model process", ("instance",)),
)


class RuntimeCollector:
    """Collects the metrics of the runtime named ``runtime`` (or at ``namespace``) per scrape."""

    def __init__(self, runtime: Optional[str] = None, *, namespace: Optional[str] = None):
        self.runtime, self.namespace = runtime, namespace

    def describe(self):
        return []  # metric names depend on nothing fixed; skip the registration-time collect

    def collect(self):
        try:
            info = inspect(self.runtime, namespace=self.namespace)
        except LookupError:
            return
        fam = {key: kind(name, text, labels=["model", *labels])
               for key, kind, name, text, labels in _FAMILIES}
        for m in info.models:
            n = [m.name]
            fam["ok"].add_metric(n, m.requests - m.errors)
            fam["fail"].add_metric(n + ["model_error"], m.errors)
            fam["fail"].add_metric(n + ["bad_request"], m.bad_requests)
            fam["rows"].add_metric(n, m.rows)
            fam["batches"].add_metric(n, m.batches)
            fam["over"].add_metric(n, m.over_target)
            for reason, count in m.rejected.items():
                fam["rejected"].add_metric(n + [reason], count)
            fam["size"].add_metric(n, *_batch_buckets(m.batch_sizes, m.rows))
            for key, h in (("latency", m.latency), ("queue", m.queue), ("compute", m.compute)):
                fam[key].add_metric(n, *_latency_buckets(h))
            fam["queued"].add_metric(n, m.queued)
            fam["clients"].add_metric(n, m.attached_clients)
            fam["ready"].add_metric(n, 1 if m.ready else 0)
            for i in m.instances:
                up = i.alive and i.state == "ready"
                fam["up"].add_metric(n + [str(i.index), i.device], 1 if up else 0)
                fam["restarts"].add_metric(n + [str(i.index)], i.restarts)
        yield from fam.values()


def _latency_buckets(h: Histogram):
    out, cum, k = [], 0, 0
    for bound in _EXPORT_BOUNDS:
        while k < len(h.bounds) and h.bounds[k] <= bound:
            cum += h.counts[k]
            k += 1
        out.append((repr(float(bound)), cum))
    out.append(("+Inf", h.count))
    return out, h.sum


def _batch_buckets(sizes: dict, rows: int):
    out = [(str(bound), sum(v for k, v in sizes.items() if 0 < k <= bound)) for bound in _BATCH_BOUNDS]
    return out + [("+Inf", sum(sizes.values()))], rows


def start_metrics_server(port: int, runtime: Optional[str] = None, *,
                         namespace: Optional[str] = None, addr: str = "0.0.0.0"):
    """Serve ``/metrics`` for one runtime on ``addr:port`` from a daemon thread (prometheus_client's
    own server); returns its (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(runtime, namespace=namespace))
    return start_http_server(port, addr=addr, registry=registry)
