"""Prometheus metrics of the verify service, on a registry of its own (several servers per process
can each export theirs, e.g. in tests).

Metrics hold counts, sizes and times only: never token ids, text or session ids.

    splitspec_draft_tokens_total            draft-tree nodes received by fresh Verify steps
    splitspec_accepted_tokens_total         draft tokens accepted
    splitspec_verify_steps_total            fresh Verify steps (replays excluded)
    splitspec_refusals_total{method,code}   calls refused, by gRPC status code
    splitspec_accept_length                 histogram: accepted draft tokens per step
    splitspec_step_latency_seconds{phase}   histogram: queue (arrival -> model work), forward, total
    splitspec_forward_batch_size            histogram: Verify steps scored per target forward
    splitspec_sessions                      open sessions
    splitspec_kv_tokens / splitspec_kv_bytes  KV cache held + reserved (server/limits.py estimate; a
        session's step buffers and last reply's features count as KV tokens of the same bytes)
"""
from __future__ import annotations

import collections
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

ACCEPT_LENGTH_BUCKETS = tuple(range(0, 17)) + (24, 32, 64)
BATCH_SIZE_BUCKETS = tuple(range(1, 17)) + (24, 32, 64)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    """The verify service's metrics. `registry`: where they live (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.draft_tokens = Counter("splitspec_draft_tokens", "Draft-tree nodes received by fresh Verify steps",
                                    registry=r)
        self.accepted_tokens = Counter("splitspec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.steps = Counter("splitspec_verify_steps", "Fresh Verify steps (replays excluded)", registry=r)
        self.refusals = Counter("splitspec_refusals", "Calls refused, by method and gRPC status code",
                                ["method", "code"], registry=r)
        self.accept_length = Histogram("splitspec_accept_length", "Accepted draft tokens per Verify step",
                                       buckets=ACCEPT_LENGTH_BUCKETS, registry=r)
        self.step_latency = Histogram("splitspec_step_latency_seconds",
                                      "Verify step latency on the server: queue, forward, total",
                                      ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("splitspec_forward_batch_size", "Verify steps scored per target forward",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.sessions = Gauge("splitspec_sessions", "Open sessions", registry=r)
        self.kv_tokens = Gauge("splitspec_kv_tokens", "KV-cache tokens held by sessions plus reserved (with each "
                               "session's step buffers and last reply's features as tokens of the same bytes)", registry=r)
        self.kv_bytes = Gauge("splitspec_kv_bytes", "KV-cache bytes held plus reserved (estimate)", registry=r)
        self._http = None

    def track(self, sessions: Callable[[], float], kv_tokens: Callable[[], float],
              kv_bytes: Callable[[], float]) -> None:
        """Read the gauges from these callables at each scrape."""
        self.sessions.set_function(sessions)
        self.kv_tokens.set_function(kv_tokens)
        self.kv_bytes.set_function(kv_bytes)

    def refused(self, method: str, code_name: str) -> None:
        self.refusals.labels(method=method.rsplit("/", 1)[-1], code=code_name).inc()

    def step(self, drafted: int, accepted: int, queue_ms: float, forward_ms: float, total_ms: float) -> None:
        """Record one fresh Verify step (times in ms)."""
        self.steps.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.accept_length.observe(accepted)
        for phase, ms in (("queue", queue_ms), ("forward", forward_ms), ("total", total_ms)):
            self.step_latency.labels(phase=phase).observe(ms / 1e3)

    def forward(self, steps: int) -> None:
        """Record one target forward that scored `steps` Verify steps (1 = unbatched)."""
        self.batch_size.observe(steps)

    def batch_size_counts(self) -> collections.Counter[int]:
        """Target forwards by Verify steps scored, read back from the `splitspec_forward_batch_size`
        histogram: {steps: forwards}. Exact for 1-16 steps (one bucket each); a larger batch counts
        under its bucket's upper bound (24, 32 or 64)."""
        counts: collections.Counter[int] = collections.Counter()
        below = 0.0
        for bound in BATCH_SIZE_BUCKETS:
            cumulative = self.registry.get_sample_value("splitspec_forward_batch_size_bucket", {"le": f"{float(bound)}"})
            if cumulative is None:  # the histogram was never observed in this registry
                return counts
            if cumulative > below:
                counts[bound] = int(cumulative - below)
            below = cumulative
        return counts

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Export /metrics over HTTP on host:port (port 0 picks a free one); returns the port.

        Raises:
            OSError: the port cannot be bound.
        """
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
