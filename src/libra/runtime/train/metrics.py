"""The driver's Prometheus metrics: served on `metrics_port` while the run lasts, saved at its end."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server


class DriverMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step = Gauge("libra_train_step", "Training steps done.", registry=r)
        self.version = Gauge("libra_train_weight_version", "Weight version the engines serve.", registry=r)
        self.success = Gauge(
            "libra_train_success", "Success rate of the last step's trajectories.", registry=r
        )
        self.reward = Gauge("libra_train_reward", "Mean reward of the last step's trajectories.", registry=r)
        self.step_s = Histogram(
            "libra_train_step_seconds", "Wall time of a training step.", ["phase"], registry=r
        )
        self.trained = Counter("libra_train_trajectories_trained", "Trajectories trained.", registry=r)
        self.dropped = Counter("libra_train_trajectories_dropped", "Trajectories dropped, by reason.", ["reason"], registry=r)  # fmt: skip
        self.tokens = Counter(
            "libra_train_tokens", "Tokens trained (all, and the model's own).", ["kind"], registry=r
        )

    def serve(self, port: int) -> int | None:
        """Serve /metrics on `port` (0: any free port); returns the port, or None when disabled."""
        if port < 0:
            return None
        server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return server.server_port

    def text(self) -> bytes:
        return generate_latest(self.registry)
