"""Prometheus metrics of one drafter server, in its own registry (no global registry state)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from drafter_sdk.proto import drafter_pb2

# Drafter calls last milliseconds (verifier deadlines default to 50 ms); the verifier times them with these too.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class DrafterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, prefix = self.registry, "splitspec_drafter_"
        self.calls = Counter(f"{prefix}calls", "PrepareDraftTokens and ReleaseRequests calls",
                             ["method", "code"], registry=r)
        self.errors = Counter(f"{prefix}errors", "Calls answered with a non-OK status",
                              ["method", "code"], registry=r)
        self.call_latency = Histogram(f"{prefix}call_latency_seconds",
                                      "Time from receiving a call to answering it, worker queueing included",
                                      ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.sequences = Counter(f"{prefix}sequences", "Sequences in answered PrepareDraftTokens calls",
                                 registry=r)
        self.resyncs = Counter(f"{prefix}resyncs", "Sequences answered DRAFT_STATUS_RESYNC_REQUIRED", registry=r)
        self.draft_tokens = Counter(f"{prefix}draft_tokens", "Draft tokens proposed (after trimming)", registry=r)
        self.evictions = Counter(f"{prefix}evictions", "Sequences forgotten after idling", registry=r)
        self.held_sequences = Gauge(f"{prefix}held_sequences", "Sequences whose context the drafter holds",
                                    registry=r)
        self.shared_state_bytes = Gauge(f"{prefix}shared_state_bytes", "Bytes the drafter holds for no one "
                                        "sequence (e.g. a global suffix tree), as it estimates them", registry=r)
        ProcessCollector(registry=r)

    def track_held(self, count: Callable[[], int]) -> None:
        """Read the held-sequence count at scrape time."""
        self.held_sequences.set_function(count)

    def track_shared_state(self, size: Callable[[], int]) -> None:
        """Read the drafter's shared state size at scrape time."""
        self.shared_state_bytes.set_function(size)

    def record_call(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.calls.labels(method, code.name).inc()
        self.call_latency.labels(method).observe(seconds)
        if code is not grpc.StatusCode.OK:
            self.errors.labels(method, code.name).inc()

    def record_drafts(self, response: drafter_pb2.PrepareDraftTokensResponse) -> None:
        results = response.results
        resyncs = sum(1 for r in results if r.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED)
        self.sequences.inc(len(results))
        self.resyncs.inc(resyncs)
        self.draft_tokens.inc(sum(len(r.draft_tokens) for r in results))


@dataclass
class MetricsServer:
    """The /metrics HTTP endpoint, served from a daemon thread."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    # prometheus_client wants a bare IPv6 address ("::"), gRPC a bracketed one ("[::]").
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsServer(server, thread)
