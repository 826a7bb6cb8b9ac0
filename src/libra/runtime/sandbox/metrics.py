"""Prometheus metrics of the actions service, in a registry of its own (one per app, so several
services and tests in one process never collide on global metric names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# ACT spans a trivial run (tens of ms) to long test runs (minutes).
ACT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class ServiceMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, cores: int):
        self.registry = r = CollectorRegistry()
        self.queue = Gauge("libra_actions_queue_length", "Actions waiting for resources.", registry=r)
        self.running = Gauge("libra_actions_running", "Actions executing now.", registry=r)
        self.cores_busy = Gauge("libra_actions_cores_busy", "Cores held by running actions.", registry=r)
        self.cores_total = Gauge("libra_actions_cores_total", "Cores the service schedules.", registry=r)
        self.sessions = Gauge("libra_actions_sessions", "Open sessions.", registry=r)
        self.act = Histogram("libra_actions_act_seconds", "Action completion time: queueing plus execution.",
                             ["endpoint"], buckets=ACT_BUCKETS, registry=r)  # fmt: skip
        self.queue_time = Histogram("libra_actions_queue_seconds", "Time an action waited for resources.",
                                    ["endpoint"], buckets=ACT_BUCKETS, registry=r)  # fmt: skip
        self.actions = Counter(
            "libra_actions_total", "Finished actions by outcome.", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter(
            "libra_actions_rejected_total", "Requests refused, by reason.", ["reason"], registry=r
        )
        self.cores_total.set(cores)

    def finished(self, endpoint: str, status: str, act_s: float, queue_s: float) -> None:
        self.actions.labels(endpoint, status).inc()
        self.act.labels(endpoint).observe(act_s)
        self.queue_time.labels(endpoint).observe(queue_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
