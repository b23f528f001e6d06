"""Prometheus metrics of one verifier, in its own registry (no global registry state).

Names follow vLLM's (`vllm:spec_decode_num_drafts`, `vllm:e2e_request_latency_seconds`,
...) with the `splitspec:` prefix, so dashboards and PromQL written for vLLM port
by swapping the prefix:

    acceptance rate        rate(splitspec:spec_decode_num_accepted_tokens_total[5m])
                         / rate(splitspec:spec_decode_num_draft_tokens_total[5m])
    mean acceptance length 1 + rate(splitspec:spec_decode_num_accepted_tokens_total[5m])
                             / rate(splitspec:spec_decode_num_drafts_total[5m])
    per-position rate      rate(splitspec:spec_decode_num_accepted_tokens_per_pos_total[5m])
                         / ignoring(position) group_left rate(splitspec:spec_decode_num_drafts_total[5m])
    prefix cache hit rate  rate(splitspec:prefix_cache_hits_total[5m])
                         / rate(splitspec:prefix_cache_queries_total[5m])

The engine reports each decode step (`observe_decode`), the gRPC servicer each
request (`RequestTimer`), and the queue / running / KV gauges are read at scrape
time (`track`). Everything arrives as plain numbers and callables, so this module
imports nothing of the verifier: the engine and the front depend on it, not back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Set
from collections.abc import Sequence as Seq

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drafter_sdk.server.metrics import (
    LATENCY_BUCKETS,  # drafter calls, timed with the same buckets at either end
    add_process_metrics,
)

PREFIX = "splitspec:"
# vLLM's buckets (seconds), trimmed to what a CPU or single-GPU server sees.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
# Engine step overhead (seconds): fine around the 1 ms target.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.0025, 0.003, 0.004,
                    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISHED_REASONS = ("stop", "length", "abort", "error")


class VerifierMetrics:
    """Every verifier metric, registered in `registry` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        p = PREFIX
        # --- speculative decoding (per decode step, summed over the batch's sequences)
        self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Sequence-steps that verified a non-empty draft",
                                  registry=r)
        self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens",
                                        "Draft tokens verified (a token tree counted by its depth)", registry=r)
        self.num_draft_nodes = Counter(f"{p}spec_decode_num_draft_nodes",
                                       "Draft tokens verified, every node of a token tree counted", registry=r)
        self.num_accepted_tokens = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            f"{p}spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 = first)", ["position"], registry=r)
        self.auto_disabled = Counter(
            f"{p}spec_decode_auto_disabled", "Requests whose drafting the acceptance-based policy turned off",
            registry=r)
        # --- drafter calls
        self.drafter_call_latency = Histogram(
            f"{p}drafter_call_latency_seconds", "PrepareDraftTokens round trip as the verifier sees it, of the "
            "calls a step waited for, failed and timed-out calls included", buckets=LATENCY_BUCKETS, registry=r)
        self.drafter_call_failures = Counter(
            f"{p}drafter_call_failures", "Drafter calls that failed, timed out or returned invalid drafts "
            "(each costs that step's drafts, never a request)", registry=r)
        self.drafter_calls_skipped = Counter(
            f"{p}drafter_calls_skipped", "Decode steps without a drafter call because the circuit breaker was open",
            registry=r)
        self.drafter_calls_saved = Counter(
            f"{p}drafter_calls_saved", "Decode steps without a drafter call because, at its measured cost, no "
            "draft would pay and no shadow draft was due (adaptive draft lengths)", registry=r)
        self.drafter_calls_overlapped = Counter(
            f"{p}drafter_calls_overlapped", "Drafter calls a decode step did not wait for: it verified what was left "
            "of the drafter's previous chain, and the call was answered during its forward", registry=r)
        self.drafter_resyncs = Counter(
            f"{p}drafter_resyncs", "Sequences the drafter answered RESYNC_REQUIRED (full context resent)", registry=r)
        self.drafter_finished_announced = Counter(
            f"{p}drafter_finished_announced", "Finished requests told to each replica of a drafter that learns "
            "from them (user_provided.share_finished): one per request and replica", registry=r)
        self.drafter_up: Gauge | None = None  # registered by `track` when there is a drafter
        self.drafter_call_cost: Gauge | None = None  # registered by `track` when calls are priced
        # --- calls by their final status: every front's, refusals included (what the request metrics below,
        # of the requests that started, cannot show: 400s, 401s, 429s when the queue is full, 503s while loading)
        self.grpc_requests = Counter(f"{p}grpc_requests", "VerifierService calls by method and final status code",
                                     ["method", "code"], registry=r)
        self.http_requests = Counter(f"{p}http_requests", "HTTP responses by route (its path template: "
                                     "'unmatched' for none), method and status", ["handler", "method", "status"],
                                     registry=r)
        # --- requests (observed by the gRPC servicer)
        self.request_success = Counter(
            f"{p}request_success", "Finished requests by reason: stop, length, abort (client cancelled or "
            "went away), error", ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.request_success.labels(reason)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated", registry=r)
        self.e2e_latency = Histogram(
            f"{p}e2e_request_latency_seconds", "Arrival to last token of requests that finished (stop or length)",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{p}request_queue_time_seconds", "Arrival to first admission into a KV slot "
                                    "(time spent waiting), of requests that got a first token",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            f"{p}time_per_output_token_seconds",
            "Per finished request: (last token - first token) / (generated tokens - 1)", buckets=TPOT_BUCKETS,
            registry=r)
        self.request_prompt_tokens = Histogram(f"{p}request_prompt_tokens", "Prompt tokens per finished request",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            f"{p}request_generation_tokens", "Generated tokens per finished request", buckets=TOKEN_BUCKETS,
            registry=r)
        self.outputs_joined = Counter(
            f"{p}outputs_joined", "Steps' outputs that queued while the servers' event loop was busy and went "
            "out joined with the next: a front behind the engine", registry=r)
        # --- scheduler and KV cache (read at scrape time once `track` is called)
        self.num_preemptions = Counter(
            f"{p}num_preemptions", "Running sequences sent back to wait for one of higher priority "
            "(--scheduling-policy priority); each recomputes its KV when readmitted", registry=r)
        self.num_requests_running = Gauge(f"{p}num_requests_running", "Sequences holding a KV slot", registry=r)
        self.num_requests_waiting = Gauge(f"{p}num_requests_waiting", "Requests queued for a KV slot", registry=r)
        self.kv_cache_usage = Gauge(f"{p}kv_cache_usage_perc",
                                    "Share of the KV cache's token capacity holding live entries (0 to 1)", registry=r)
        # --- prefix caching, in tokens, as vLLM counts them
        self.prefix_cache_queries = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied",
                                         registry=r)
        self._prefix_seen = (0, 0)  # queries, hits at the last observation
        # --- engine
        self.step_overhead = Histogram(
            f"{p}engine_step_overhead_seconds", "Per step of a busy engine: the step period minus its forward "
            "(scheduling, drafter call, hand-offs to and from the model thread, sampling, emitting)",
            buckets=OVERHEAD_BUCKETS, registry=r)
        # --- the Responses API's stored responses and conversations (read at scrape time, once track_responses runs)
        self.responses_stored = Gauge(f"{p}responses_stored", "Responses kept for GET /v1/responses/{id} and "
                                      "previous_response_id", registry=r)
        self.conversations_stored = Gauge(f"{p}conversations_stored", "Conversations kept for the Conversations "
                                          "API and `conversation` (in the same store)", registry=r)
        self.responses_store_bytes = Gauge(f"{p}responses_store_bytes", "Bytes the stored responses and "
                                           "conversations are charged (at most --responses-store-mb)", registry=r)
        self.responses_in_background = Gauge(f"{p}responses_in_background", "Background responses running (not "
                                             "yet stored)", registry=r)
        add_process_metrics(r)
        self._drafter_seen = (0, 0, 0, 0, 0, 0)  # calls, failures, skipped, resyncs, overlapped, announced
        self._disabled: set[str] = set()  # auto-disabled request ids among the last step's sequences

    # --- wiring -------------------------------------------------------------------------------------

    def track(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float],
              drafter_healthy: Callable[[], bool] | None = None, max_draft_len: int = 0,
              call_cost: Callable[[], float] | None = None) -> None:
        """Read queue, running and KV usage (and drafter health, and the drafter call's price) at scrape
        time; show every draft position up to max_draft_len from the start (0 until accepted), as vLLM does."""
        for pos in range(max_draft_len):
            self.num_accepted_tokens_per_pos.labels(str(pos))
        # Read on the scrape thread: what the event loop changes meanwhile is read, at worst, a step stale.
        self.num_requests_running.set_function(running)
        self.num_requests_waiting.set_function(waiting)
        self.kv_cache_usage.set_function(kv_usage)
        if drafter_healthy is not None and self.drafter_up is None:
            self.drafter_up = Gauge(f"{PREFIX}drafter_up", "1 while the drafter circuit breaker is closed, "
                                    "0 while open (absent without a drafter)", registry=self.registry)
            self.drafter_up.set_function(lambda: 1.0 if drafter_healthy() else 0.0)
        if call_cost is not None and self.drafter_call_cost is None:
            self.drafter_call_cost = Gauge(
                f"{PREFIX}drafter_call_cost_forwards", "What a step waits for a drafter call, in one-token "
                "forwards, as the draft planner prices it (a decayed average; 0 until measured; absent without "
                "adaptive draft lengths)", registry=self.registry)
            self.drafter_call_cost.set_function(call_cost)

    def track_responses(self, stored: Callable[[], float], conversations: Callable[[], float],
                        charged_bytes: Callable[[], float], in_background: Callable[[], float]) -> None:
        """Read the response store's size, and how many background responses run, at scrape time."""
        self.responses_stored.set_function(stored)
        self.conversations_stored.set_function(conversations)
        self.responses_store_bytes.set_function(charged_bytes)
        self.responses_in_background.set_function(in_background)

    def count_grpc_call(self, method: str, code: str) -> None:
        self.grpc_requests.labels(method, code).inc()

    def count_http_response(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()

    # --- engine -------------------------------------------------------------------------------------

    def observe_decode(self, drafted: Seq[int], accepted: Seq[int], auto_disabled: Set[str],
                       drafter_totals: tuple[int, int, int, int, int, int] | None = None,
                       call_latency_s: float | None = None, draft_nodes: Seq[int] | None = None) -> None:
        """One decode step: per sequence, the draft length verified (a token tree's depth) and how many
        were accepted; the ids of the step's sequences whose drafting is auto-disabled; the drafter
        client's running totals (calls, failures, skipped, resyncs, overlapped, announced) and the latency of this
        step's call, if it waited for one; per sequence, the draft tokens verified counting every tree
        node (None: as drafted)."""
        for n, a, nodes in zip(drafted, accepted, drafted if draft_nodes is None else draft_nodes):
            if n == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(n)
            self.num_draft_nodes.inc(nodes)
            self.num_accepted_tokens.inc(a)
            for pos in range(a):
                self.num_accepted_tokens_per_pos.labels(str(pos)).inc()
        self.auto_disabled.inc(len(auto_disabled - self._disabled))
        self._disabled = set(auto_disabled)  # a disabled sequence decodes every step until it ends
        if drafter_totals is not None:
            calls, failures, skipped, resyncs, overlapped, announced = (
                now - before for now, before in zip(drafter_totals, self._drafter_seen))
            self._drafter_seen = drafter_totals
            if calls and call_latency_s is not None:
                self.drafter_call_latency.observe(call_latency_s)
            self.drafter_call_failures.inc(failures)
            self.drafter_calls_skipped.inc(skipped)
            self.drafter_resyncs.inc(resyncs)
            self.drafter_calls_overlapped.inc(overlapped)
            self.drafter_finished_announced.inc(announced)


    def observe_prefix_cache(self, queries_total: int, hits_total: int) -> None:
        """The prefix cache's running totals (tokens queried, tokens hit)."""
        queries, hits = queries_total - self._prefix_seen[0], hits_total - self._prefix_seen[1]
        self._prefix_seen = (queries_total, hits_total)
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)


class RequestTimer:
    """Times one request from arrival (construction) through its outputs to its end, into `metrics`
    where there are some (its times are read by the request's trace too)."""

    def __init__(self, metrics: VerifierMetrics | None, prompt_tokens: int, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self._done = False

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def time_in_queue(self, admitted_at: float) -> float:
        """Arrival to the first admission into a KV slot (perf_counter `admitted_at`)."""
        return max(0.0, admitted_at - self.arrival)

    def tokens(self, count: int, admitted_at: float | None = None) -> None:
        """`count` generated tokens reached the servicer; `admitted_at`: when the request first got a KV
        slot (perf_counter), read with its first token."""
        if not count:
            return
        now = time.perf_counter()
        first = self.first_token is None
        if first:
            self.first_token = now
        self.last_token = now
        self.num_tokens += count
        m = self.metrics
        if m is None:
            return
        if first:
            m.ttft.observe(self.time_to_first_token)
            if admitted_at is not None:
                m.queue_time.observe(self.time_in_queue(admitted_at))
            m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(count)

    def finish(self, reason: str) -> None:
        """The request ended: reason is stop, length, abort or error. Later calls do nothing."""
        if self._done or self.metrics is None:
            return
        self._done = True
        m = self.metrics
        m.request_success.labels(reason).inc()
        if reason not in ("stop", "length"):
            return
        end = time.perf_counter()
        m.e2e_latency.observe(end - self.arrival)
        m.request_prompt_tokens.observe(self.prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if self.num_tokens > 1 and self.first_token is not None and self.last_token is not None:
            m.tpot.observe((self.last_token - self.first_token) / (self.num_tokens - 1))
