"""Prometheus metrics of a running runtime (optional extra: ``pip install simpledbi[metrics]``).

A ``prometheus_client`` *custom collector*: each scrape reads the shared-memory counters and
histograms that the model processes keep anyway (status.py), so there is no per-request cost,
no multiprocess-mode directory and nothing to clean up. Names follow Triton's metrics (a
dashboard built for one reads the other with a rename)::

    simpledbi_request_success_total{model}            requests answered with a result
    simpledbi_request_failure_total{model,reason}     model_error | bad_request
    simpledbi_inference_count_total{model}            rows computed
    simpledbi_batch_total{model}                      forward passes (batches)
    simpledbi_batch_size{model}                       histogram of rows per batch
    simpledbi_request_duration_seconds{model}         histogram, publish -> answer, per request
    simpledbi_queue_duration_seconds{model}           histogram, publish -> batch start
    simpledbi_compute_duration_seconds{model}         histogram, batch start -> answered
    simpledbi_over_target_total{model}                answers later than latency_target
    simpledbi_rejected_total{model,reason}            refused with Overloaded: deadline | queue
    simpledbi_queued_requests{model}, simpledbi_attached_clients{model}, simpledbi_model_ready{model}
    simpledbi_instance_up{model,instance,device}, simpledbi_instance_restarts_total{model,instance}
"""
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
        m_ok = CounterMetricFamily("simpledbi_request_success", "Requests answered with a result",
                                   labels=["model"])
        m_fail = CounterMetricFamily("simpledbi_request_failure", "Requests that failed",
                                     labels=["model", "reason"])
        m_rows = CounterMetricFamily("simpledbi_inference_count", "Rows computed", labels=["model"])
        m_batches = CounterMetricFamily("simpledbi_batch", "Forward passes (batches)",
                                        labels=["model"])
        m_over = CounterMetricFamily("simpledbi_over_target",
                                     "Answers later than the model's latency_target", labels=["model"])
        m_size = HistogramMetricFamily("simpledbi_batch_size", "Rows per batch", labels=["model"])
        m_lat = HistogramMetricFamily("simpledbi_request_duration_seconds",
                                      "Per request: publish to answer", labels=["model"])
        m_queue = HistogramMetricFamily("simpledbi_queue_duration_seconds",
                                        "Per request: publish to the start of its batch",
                                        labels=["model"])
        m_compute = HistogramMetricFamily("simpledbi_compute_duration_seconds",
                                          "Per batch: start to answered", labels=["model"])
        m_rejected = CounterMetricFamily("simpledbi_rejected",
                                         "Requests refused with Overloaded (never run), by reason",
                                         labels=["model", "reason"])
        g_queued = GaugeMetricFamily("simpledbi_queued_requests", "Requests waiting for an answer",
                                     labels=["model"])
        g_clients = GaugeMetricFamily("simpledbi_attached_clients", "Client slots attached",
                                      labels=["model"])
        g_ready = GaugeMetricFamily("simpledbi_model_ready", "1 while the model serves",
                                    labels=["model"])
        g_up = GaugeMetricFamily("simpledbi_instance_up", "1 while a model process is ready",
                                 labels=["model", "instance", "device"])
        m_restarts = CounterMetricFamily("simpledbi_instance_restarts",
                                         "Restarts of a model process", labels=["model", "instance"])
        for m in info.models:
            n = [m.name]
            m_ok.add_metric(n, m.requests - m.errors)
            m_fail.add_metric(n + ["model_error"], m.errors)
            m_fail.add_metric(n + ["bad_request"], m.bad_requests)
            m_rows.add_metric(n, m.rows)
            m_batches.add_metric(n, m.batches)
            m_over.add_metric(n, m.over_target)
            for reason, count in m.rejected.items():
                m_rejected.add_metric(n + [reason], count)
            m_size.add_metric(n, *_batch_buckets(m.batch_sizes, m.rows))
            for fam, h in ((m_lat, m.latency), (m_queue, m.queue), (m_compute, m.compute)):
                fam.add_metric(n, *_latency_buckets(h))
            g_queued.add_metric(n, m.queued)
            g_clients.add_metric(n, m.attached_clients)
            g_ready.add_metric(n, 1 if m.ready else 0)
            for i in m.instances:
                up = i.alive and i.state == "ready"
                g_up.add_metric(n + [str(i.index), i.device], 1 if up else 0)
                m_restarts.add_metric(n + [str(i.index)], i.restarts)
        yield from (m_ok, m_fail, m_rows, m_batches, m_over, m_rejected, m_size, m_lat, m_queue, m_compute,
                    g_queued, g_clients, g_ready, g_up, m_restarts)


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
    total = sum(sizes.values())
    out = []
    for bound in _BATCH_BOUNDS:
        out.append((str(bound), sum(v for k, v in sizes.items() if 0 < k <= bound)))
    assert _BATCH_BOUNDS[-1] == BATCH_HIST_MAX
    out.append(("+Inf", total))
    return out, rows


def start_metrics_server(port: int, runtime: Optional[str] = None, *,
                         namespace: Optional[str] = None, addr: str = "0.0.0.0"):
    """Serve ``/metrics`` for one runtime on ``addr:port`` from a daemon thread (prometheus_client's
    own server); returns its (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(runtime, namespace=namespace))
    return start_http_server(port, addr=addr, registry=registry)
