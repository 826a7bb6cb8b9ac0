"""The gateway's Prometheus metrics (`GET /metrics`).

Counters and histograms are updated on the request path, so their labelled children are looked
up once and cached: `labels()` takes a lock and builds a key on every call, which on a path that
must stay well under a millisecond is worth avoiding. Gauges that describe state (outstanding
requests per instance, instance health, active sessions) are not updated per request at all: a
collector reads them from the pool and the session tracker when Prometheus scrapes.

Metric names (all prefixed `libra_gateway_`):

- `requests_total{endpoint,status}`, `request_seconds{endpoint}`: every HTTP request, end to end
  (a stream until its last byte);
- `overhead_seconds{endpoint}`: time spent in the gateway itself, i.e. the request's time minus
  the time waiting on the backend (what the benchmark calls added latency);
- `upstream_seconds{bucket}`: from sending a request to a backend to its full response;
- `decisions_total{bucket}`: routing decisions by the bucket the turn was placed in (above the
  router's choice when it spilled);
- `migrations_total{from_bucket,to_bucket,reason}`: a session changed instance; reason `policy`
  (the router moved it) or `failover` (its instance failed under a request);
- `retries_total{bucket}`, `upstream_errors_total{instance,kind}`;
- `sessions_finished_total{reason}`: `client`, `idle` or `evicted`;
- `tree_saves_total`, `tree_nodes`;
- `outstanding{instance,bucket}`, `instance_up{instance,bucket,state}`, `active_sessions`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _StateCollector:
    """Reads instance and session state at scrape time."""

    def __init__(self, gateway) -> None:
        self.gw = gateway

    def collect(self):
        out = GaugeMetricFamily("libra_gateway_outstanding", "Requests in flight per instance.", labels=["instance", "bucket"])  # fmt: skip
        up = GaugeMetricFamily("libra_gateway_instance_up", "1 when the instance is routable.", labels=["instance", "bucket", "state"])  # fmt: skip
        for inst in self.gw.pool.live():
            out.add_metric([inst.id, inst.bucket_name], inst.view.outstanding)
            state = f"{inst.state.name.lower()}/{inst.health.name.lower()}"
            up.add_metric([inst.id, inst.bucket_name, state], 1.0 if inst.view.healthy else 0.0)
        yield out
        yield up
        yield GaugeMetricFamily(
            "libra_gateway_active_sessions", "Sessions being tracked.", value=len(self.gw.tracker)
        )
        tree = getattr(self.gw.router, "tree", None)
        if tree is not None and hasattr(tree, "node_count"):
            yield GaugeMetricFamily(
                "libra_gateway_tree_nodes", "Nodes of the causal tree.", value=tree.node_count()
            )


class GatewayMetrics:
    def __init__(self, gateway, bucket_names: list[str]):
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "libra_gateway_requests", "HTTP requests.", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram("libra_gateway_request_seconds", "Request time, end to end.", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.overhead = Histogram("libra_gateway_overhead_seconds", "Request time minus time waiting on the backend.", ["endpoint"], buckets=OVERHEAD_BUCKETS, registry=r)  # fmt: skip
        self.upstream = Histogram("libra_gateway_upstream_seconds", "Backend time per request.", ["bucket"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.decisions = Counter("libra_gateway_decisions", "Routing decisions by the bucket the turn was placed in.", ["bucket"], registry=r)  # fmt: skip
        self.migrations = Counter("libra_gateway_migrations", "Sessions moved to another instance.", ["from_bucket", "to_bucket", "reason"], registry=r)  # fmt: skip
        self.retries = Counter("libra_gateway_retries", "Requests retried on another instance.", ["bucket"], registry=r)  # fmt: skip
        self.errors = Counter("libra_gateway_upstream_errors", "Failed upstream requests.", ["instance", "kind"], registry=r)  # fmt: skip
        self.finished = Counter("libra_gateway_sessions_finished", "Sessions ended.", ["reason"], registry=r)
        self.tree_saves = Counter("libra_gateway_tree_saves", "Causal tree saves.", registry=r)
        r.register(_StateCollector(gateway))
        self.names = bucket_names
        self._cache: dict[tuple, object] = {}
        for name in bucket_names:  # every bucket shows up from the first scrape, at zero
            self.decisions.labels(name)

    def _child(self, metric, *labels):
        key = (id(metric), labels)
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = metric.labels(*labels)
        return c

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        self._child(self.requests, endpoint, str(status)).inc()
        self._child(self.latency, endpoint).observe(seconds)

    def overhead_of(self, endpoint: str, seconds: float) -> None:
        self._child(self.overhead, endpoint).observe(max(0.0, seconds))

    def upstream_time(self, bucket: int, seconds: float) -> None:
        self._child(self.upstream, self.names[bucket]).observe(seconds)

    def decision(self, bucket: int) -> None:
        self._child(self.decisions, self.names[bucket]).inc()

    def migration(self, src: int | None, dst: int, reason: str) -> None:
        src_name = self.names[src] if src is not None and 0 <= src < len(self.names) else "none"
        self._child(self.migrations, src_name, self.names[dst], reason).inc()

    def retry(self, bucket: int) -> None:
        self._child(self.retries, self.names[bucket]).inc()

    def error(self, instance: str, kind: str) -> None:
        self._child(self.errors, instance, kind).inc()

    def session_finished(self, reason: str) -> None:
        self._child(self.finished, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
