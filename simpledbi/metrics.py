"""Prometheus metrics of a running runtime (optional extra: ``pip install simpledbi[metrics]``).

A ``prometheus_client`` *custom collector* reads, per scrape, the counters and histograms the model
processes keep anyway (status.py): no per-request cost, no multiprocess-mode directory, nothing to clean
up. Names follow Triton's (a dashboard built for one reads the other with a rename); ``_FAMILIES`` lists
them. Labels: ``reason`` is model_error | bad_request | process_died for failures, deadline | queue for
refusals."""
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
_INF = float("inf")
assert _BATCH_BOUNDS[-1] == BATCH_HIST_MAX   # key 0 counts the larger batches: only in +Inf
_C, _G, _H = CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
# kind, name, help, labels after "model", and a model's samples: (label values, value), for a
# histogram (label values, buckets, sum) -- exported in this order
_FAMILIES = (
    (_C, "simpledbi_request_success", "Requests answered with a result", (),
     lambda m: [((), m.requests - m.errors)]),
    (_C, "simpledbi_request_failure", "Requests that failed", ("reason",),
     lambda m: [(("model_error",), m.errors), (("bad_request",), m.bad_requests),
                (("process_died",), m.died)]),
    (_C, "simpledbi_inference_count", "Rows computed", (), lambda m: [((), m.rows)]),
    (_C, "simpledbi_batch", "Forward passes (batches)", (), lambda m: [((), m.batches)]),
    (_C, "simpledbi_over_target", "Answers later than the model's latency_target", (),
     lambda m: [((), m.over_target)]),
    (_C, "simpledbi_rejected", "Requests refused with Overloaded (never run), by reason", ("reason",),
     lambda m: [((reason,), count) for reason, count in m.rejected.items()]),
    (_C, "simpledbi_abandoned", "Requests whose caller stopped waiting before their batch ran (never run)",
     ("reason",), lambda m: [(("expired",), m.expired), (("withdrawn",), m.withdrawn)]),
    (_H, "simpledbi_batch_size", "Rows per batch", (), lambda m: [((), _buckets(
        ((k or _INF, v) for k, v in m.batch_sizes.items()), _BATCH_BOUNDS, str), m.rows)]),
    (_H, "simpledbi_request_duration_seconds", "Per request: publish to answer", (),
     lambda m: [_latency(m.latency)]),
    (_H, "simpledbi_queue_duration_seconds", "Per request: publish to the start of its batch", (),
     lambda m: [_latency(m.queue)]),
    (_H, "simpledbi_compute_duration_seconds", "Per batch: start to answered", (),
     lambda m: [_latency(m.compute)]),
    (_G, "simpledbi_queued_requests", "Requests waiting for an answer", (), lambda m: [((), m.queued)]),
    (_G, "simpledbi_attached_clients", "Client slots attached", (), lambda m: [((), m.attached_clients)]),
    (_G, "simpledbi_model_ready", "1 while the model serves", (), lambda m: [((), 1 if m.ready else 0)]),
    (_G, "simpledbi_instance_up", "1 while a model process is ready", ("instance", "device"),
     lambda m: [((str(i.index), i.device), 1 if i.alive and i.state == "ready" else 0)
                for i in m.instances]),
    (_C, "simpledbi_instance_restarts", "Restarts of a model process", ("instance",),
     lambda m: [((str(i.index),), i.restarts) for i in m.instances]),
)


class RuntimeCollector:
    """Collects the metrics of the runtime named ``runtime`` (or at ``namespace``) per scrape."""

    def __init__(self, runtime: Optional[str] = None, *, namespace: Optional[str] = None):
        self.runtime, self.namespace = runtime, namespace

    def describe(self):
        return []  # metric names depend on nothing fixed; skip the registration-time collect

    def collect(self):
        # always exported: a runtime that is down, or a name that was never one, scrapes as 0, not as
        # nothing (an alert on a missing series is easy to get wrong: helper-48)
        up = GaugeMetricFamily("simpledbi_runtime_up", "1 while the runtime is found and its main process "
                               "alive", labels=["runtime"])
        label = self.runtime or self.namespace or ""
        try:
            info = inspect(self.runtime, namespace=self.namespace)
        except LookupError:
            up.add_metric([label], 0)
            yield up
            return
        up.add_metric([label], 1 if info.alive else 0)
        yield up
        for kind, name, text, labels, samples in _FAMILIES:
            family = kind(name, text, labels=["model", *labels])
            for m in info.models:
                for values, *sample in samples(m):
                    family.add_metric([m.name, *values], *sample)
            yield family


def _buckets(counts, bounds, label):
    """Cumulative buckets for Prometheus, (label(bound), count) at each of ``bounds`` and +Inf,
    from (upper bound, count) pairs (inf: the unbounded bucket)."""
    counts = list(counts)
    return [(label(bound), sum(n for upper, n in counts if upper <= bound)) for bound in bounds] + [
        ("+Inf", sum(n for _, n in counts))]


def _latency(h: Histogram):
    return (), _buckets(zip((*h.bounds, _INF), h.counts), _EXPORT_BOUNDS, lambda b: repr(float(b))), h.sum


def start_metrics_server(port: int, runtime: Optional[str] = None, *,
                         namespace: Optional[str] = None, addr: str = "0.0.0.0"):
    """Serve ``/metrics`` for one runtime on ``addr:port`` from a daemon thread (prometheus_client's
    own server); returns its (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(runtime, namespace=namespace))
    return start_http_server(port, addr=addr, registry=registry)
