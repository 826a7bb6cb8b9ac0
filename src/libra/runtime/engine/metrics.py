"""Prometheus metrics of one engine, in its own registry (several engines can share a process).

Names follow Prometheus conventions and the `libra_engine_` prefix; docs/engine.md defines each.
`peak_running_seqs` exists because a scrape only sees the running count at one instant, and tests
(and operators) want to know whether continuous batching ever actually batched.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "libra_engine_http_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.seqs_finished = Counter(
            "libra_engine_sequences_finished", "Sequences finished, by finish reason.", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("libra_engine_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("libra_engine_generation_tokens", "Tokens generated.", registry=r)
        self.preemptions = Counter(
            "libra_engine_preemptions", "Sequences preempted for KV blocks.", registry=r
        )
        self.running = Gauge("libra_engine_running_seqs", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("libra_engine_waiting_seqs", "Sequences waiting for admission.", registry=r)
        self.peak_running = Gauge(
            "libra_engine_peak_running_seqs", "Most sequences ever in one step.", registry=r
        )
        self.kv_usage = Gauge(
            "libra_engine_kv_cache_usage_ratio", "Fraction of KV blocks in use.", registry=r
        )
        self.step_seconds = Histogram(
            "libra_engine_step_seconds", "Wall time of one engine step.", buckets=STEP_BUCKETS, registry=r
        )
        # CPU seconds of the engine thread inside its steps (thread time, not wall time): beside the
        # process's CPU, what a step costs and what serving it over HTTP costs
        # (`libra costmodel profile --model builtin-tiny --device cpu`).
        self.step_cpu = Counter(
            "libra_engine_step_cpu_seconds", "CPU seconds of the engine thread in steps.", registry=r
        )
        # The whole process's, read at each scrape (CLOCK_PROCESS_CPUTIME_ID: finer than /proc's ticks).
        self.process_cpu = Gauge(
            "libra_engine_process_cpu_seconds", "CPU seconds of the engine process so far.", registry=r
        )
        self.process_cpu.set_function(time.process_time)
        self.step_batch = Histogram(
            "libra_engine_step_batch_size",
            "Sequences computed in one step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "libra_engine_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
