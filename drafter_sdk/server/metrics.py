"""Prometheus metrics of one drafter server, in its own registry (no global registry state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from drafter_sdk.proto import drafter_pb2

# Drafter calls last milliseconds (verifier deadlines default to 50 ms); the verifier times them with these too.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def add_process_metrics(registry: CollectorRegistry) -> None:
    """The process's own metrics, as Prometheus' default registry (and so vLLM) exports them: process_* (CPU,
    resident memory, open files) and python_gc_* (the garbage collector's passes by generation)."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)


@dataclass(frozen=True)
class StateStats:
    """The memory budget's figures at one moment (plain numbers, read at scrape time)."""

    budget_bytes: int | None  # None: no budget
    bytes_by_namespace: dict[str, int]  # held sequences, by verifier_id
    shared_bytes: int  # drafter state tied to no sequence
    held_tokens: int  # tokens of the histories held
    evictions: dict[str, int]  # sequences dropped, by cause: budget, idle, release, oversize
    eviction_resyncs: int  # resyncs answered to sequences evicted for the budget or for idling


class _StateCollector(Collector):
    def __init__(self, stats: Callable[[], StateStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s, prefix = self._stats(), "splitspec_drafter_"
        # Not `namespace`: under a ServiceMonitor, the pod's Kubernetes namespace takes that label.
        held = GaugeMetricFamily(f"{prefix}state_bytes", "Bytes of sequence state held, by verifier namespace",
                                 labels=["verifier_namespace"])
        for namespace, size in sorted(s.bytes_by_namespace.items()):
            held.add_metric([namespace], size)
        yield held
        yield GaugeMetricFamily(f"{prefix}held_tokens", "Tokens of the sequence histories held",
                                value=s.held_tokens)
        yield GaugeMetricFamily(f"{prefix}shared_state_bytes", "Bytes of drafter state tied to no sequence",
                                value=s.shared_bytes)
        yield GaugeMetricFamily(f"{prefix}state_budget_bytes", "The state budget (--max-state-mib); 0: none",
                                value=s.budget_bytes or 0)
        evictions = CounterMetricFamily(f"{prefix}state_evictions", "Sequences whose state was dropped, by cause",
                                        labels=["cause"])
        for cause in ("budget", "idle", "release", "oversize"):
            evictions.add_metric([cause], s.evictions.get(cause, 0))
        yield evictions
        yield CounterMetricFamily(f"{prefix}eviction_resyncs",
                                  "Resyncs answered to sequences evicted for the budget or for idling",
                                  value=s.eviction_resyncs)


@dataclass
class DrafterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, prefix = self.registry, "splitspec_drafter_"
        self.calls = Counter(f"{prefix}calls", "DrafterService calls but GetDrafterInfo",
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
        self.held_sequences = Gauge(f"{prefix}held_sequences", "Sequences whose context the drafter holds",
                                    registry=r)
        self.learned_saves = Counter(f"{prefix}learned_state_saves",
                                     "Saves of what the drafter learned to --learned-state-file, by outcome",
                                     ["outcome"], registry=r)
        self.learned_bytes = Gauge(f"{prefix}learned_state_bytes", "Size of the last saved learned state",
                                   registry=r)
        self.learned_saved_at = Gauge(f"{prefix}learned_state_last_save_timestamp_seconds",
                                      "When the learned state was last saved (Unix time; 0: never)", registry=r)
        self.learned_restores = Counter(f"{prefix}learned_state_restores",
                                        "Where the drafter's learned state came from when it started: a peer "
                                        "replica, --learned-state-file, or none", ["source"], registry=r)
        add_process_metrics(r)

    def track_held(self, count: Callable[[], int]) -> None:
        """Read the held-sequence count at scrape time."""
        self.held_sequences.set_function(count)

    def track_state(self, stats: Callable[[], StateStats]) -> None:
        """Read the memory budget's figures at scrape time."""
        self.registry.register(_StateCollector(stats))

    def record_call(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.calls.labels(method, code.name).inc()
        self.call_latency.labels(method).observe(seconds)
        if code is not grpc.StatusCode.OK:
            self.errors.labels(method, code.name).inc()

    def record_learned_save(self, size: int | None) -> None:
        """A save of the learned state: its size, or None where it failed."""
        self.learned_saves.labels("failed" if size is None else "ok").inc()
        if size is not None:
            self.learned_bytes.set(size)
            self.learned_saved_at.set_to_current_time()

    def record_learned_restore(self, source: str) -> None:
        """Where the learned state came from at start: "peer", "file" or "none"."""
        self.learned_restores.labels(source).inc()

    def record_drafts(self, response: drafter_pb2.PrepareDraftTokensResponse) -> None:
        results = response.results
        resyncs = sum(1 for r in results if r.status == drafter_pb2.DRAFT_STATUS_RESYNC_REQUIRED)
        self.sequences.inc(len(results))
        self.resyncs.inc(resyncs)
        self.draft_tokens.inc(sum(len(r.draft_tokens) for r in results))
