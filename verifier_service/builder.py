"""From a loaded model to a ready engine: KV cache -> runner -> calibration -> policy -> drafter -> engine.

Calibration happens here, once, before the engine exists: on CPU it chooses the
runner's linear layout for each token count, and it measures the forward-cost
curve the draft planner is constructed with (model/step_costs.py) and the
default step token budget of chunked prefill is read from, and a chunk after a
long context, which prices a late prompt token's attention in that budget; what an
earlier start on the same machine measured is taken from the timing cache
(model/timing_cache.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint
from verifier_service.engine.engine import Engine
from verifier_service.engine.model_thread import ModelThread
from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.engine.reasoning import PARSERS, Reasoning, ReasoningUnavailable
from verifier_service.engine.scheduler import FLAT, PromptTokenCost, Scheduler
from verifier_service.engine.structured_output import Grammars
from verifier_service.metrics import VerifierMetrics
from verifier_service.model import architecture_check, rotary_pinning, step_costs, tensor_parallel
from verifier_service.model.cuda_graphs import MIN_DRAFT_STEP_LENGTH, batch_rows, padded_length
from verifier_service.model.generation_config import SamplingDefaults
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ModelRunner, Peers
from verifier_service.model.timing_cache import TimingCache
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import ConfigError
from verifier_service.spec_decode.drafter_client import DrafterClient
from verifier_service.spec_decode.drafters import build_drafter_client
from verifier_service.spec_decode.planner import DraftPlanner
from verifier_service.spec_decode.policy import SpeculationPolicy

log = logging.getLogger(__name__)

# Default chunked-prefill budget: a step may cost this many one-token steps, so the running
# streams' longest gap during a long prefill stays within ~3x their usual one.
PREFILL_STEP_COST = 2.5
CHUNK_PROBE_TOKENS = 64  # the cost curve is measured this far (at least) when the budget is derived
# A chunk of CHUNK_PROBE_TOKENS is also timed after up to this many cached tokens, to price a prompt
# token's attention to the context before it; contexts too short to tell (under twice the curve's
# own) are priced flat.
LONG_CONTEXT = 2048
MAX_DEFAULT_BATCHED_TOKENS = 2048
# With CUDA graphs, steps are captured at start-up for contexts up to this long
# (cuda_graphs.StepGraphs.capture_ahead): the windows of 256 to 2,048 keys.
CAPTURE_AHEAD_WINDOW = 2048


@dataclass
class Runtime:
    """A verifier's loaded model and engine, and the facts about them its fronts need."""

    model_name: str
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    settings: ServerSettings
    verifier_id: str  # namespace of its request ids at drafters
    max_model_len: int
    eos_token_ids: frozenset[int]
    tokenizer_fingerprint: str  # drafters reporting another one get no calls
    grammars: Grammars  # compiles requests' structured-output constraints
    reasoning: Reasoning | None = None  # --reasoning-parser's markers in this model's vocabulary
    # What a request's left-out sampling fields take (the model's generation config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def default_max_new_tokens(self) -> int | None:
        """A request's max_new_tokens when it sets none: the flag's, else the generation config's, else None:
        the rest of the context."""
        return self.settings.default_max_new_tokens or self.sampling_defaults.max_new_tokens

    @property
    def drafter(self) -> DrafterClient | None:
        return self.engine.drafter

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.vocab_size


def reasoning_of(settings: ServerSettings, tokenizer: PreTrainedTokenizerBase) -> Reasoning | None:
    """--reasoning-parser's markers in this tokenizer's vocabulary. Raises ConfigError."""
    if settings.reasoning_parser is None:
        return None
    try:
        return Reasoning.of(PARSERS[settings.reasoning_parser], tokenizer)
    except ReasoningUnavailable as e:
        raise ConfigError(str(e)) from None


def model_len(config: PretrainedConfig, settings: ServerSettings) -> int:
    """The longest prompt + generation served: the setting, within the model's positions."""
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return settings.max_model_len if positions is None else min(settings.max_model_len, positions)


def kv_cache_shape(config: PretrainedConfig, dtype: torch.dtype, settings: ServerSettings,
                   max_model_len: int) -> KVCacheShape:
    """Size the cache: each slot holds a full context plus a draft; the memory budget decides
    how many slots (sequences) run at once. Sharded, the budget is each rank's, and a rank's slot
    holds only its share of the KV heads. Needs only the config, so that a budget too small for
    one sequence is refused before the weights load (api/cli.py): raises ConfigError."""
    max_draft_len = max(settings.speculative.max_draft_len, settings.max_draft_nodes)  # a chain's or a tree's
    shape = KVCacheShape.for_model(config, num_slots=1, capacity=max_model_len + max_draft_len + 1,
                                   tensor_parallel_size=settings.tensor_parallel_size)
    per_slot = shape.bytes_per_slot(dtype)
    slots = min(settings.max_num_seqs, int(settings.kv_cache_memory_gb * 2**30) // per_slot)
    if slots < 1:
        raise ConfigError(f"--kv-cache-memory-gb {settings.kv_cache_memory_gb} is too small: one sequence of "
                          f"{max_model_len} tokens needs {per_slot / 2**30:.2f} GiB; raise it or lower --max-model-len")
    return replace(shape, num_slots=slots)


def kv_cache_for(model: PreTrainedModel, settings: ServerSettings, max_model_len: int) -> KVCache:
    shape = kv_cache_shape(model.config, model.dtype, settings, max_model_len)
    per_rank = f" per rank ({shape.num_kv_heads} KV heads each)" if settings.tensor_parallel_size > 1 else ""
    log.info("KV cache: %d slots x %d tokens, %.2f GiB%s", shape.num_slots, shape.capacity,
             shape.num_slots * shape.bytes_per_slot(model.dtype) / 2**30, per_rank)
    return KVCache(shape, model.dtype, model.device)


def make_runner(model: PreTrainedModel, settings: ServerSettings, max_model_len: int,
                peers: Peers | None = None) -> ModelRunner:
    """The same runner on every rank of a sharded model (rank 0 passes the other ranks as `peers`); an
    unsharded model's packed forward first held to its own (raises architecture_check.UnsupportedModel)."""
    # Sharded, every rank runs eagerly: a rank capturing a step would run its collectives once more than the
    # others (the warm-up before the capture).
    graph_tokens = settings.cuda_graph_max_tokens if settings.tensor_parallel_size == 1 else 0
    for pinned in rotary_pinning.pin_rotary_frequencies(model, max_model_len):
        log.info("%s: a token's logits do not depend on its batch (model/rotary_pinning.py)", pinned)
    runner = ModelRunner(model, kv_cache_for(model, settings, max_model_len), settings.prepack_weights, peers,
                         graph_tokens)
    if settings.tensor_parallel_size == 1:
        architecture_check.check_packed_forward(runner, model)
    if runner.graphs is not None:
        log.info("CUDA graphs: steps of up to %d tokens replay as graphs, the usual ones captured at start-up, "
                 "other shapes the second time they are seen (--enforce-eager: never)", runner.graphs.max_tokens)
    if runner.batch_invariant:
        log.info("batch-invariant %s: a verified token gets the bits plain decoding gives it (chains; token trees "
                 "up to rounding)", runner.dtype)
    elif runner.dtype != torch.float32:
        log.info("%s on %s: speculative outputs equal plain decoding's up to its rounding", runner.dtype,
                 runner.device.type)
    if settings.tensor_parallel_size > 1 and runner.layouts is not None:
        tensor_parallel.rewrap_sharded_linears(model)
    return runner


@dataclass(frozen=True)
class StepBudget:
    """Tokens one step's forward carries (scheduler.py): `tokens` while sequences decode, `idle`
    in a step where none does (None: `tokens` too); what a prompt token counts for against `tokens`."""

    tokens: int | None
    idle: int | None = None
    prompt_token_cost: PromptTokenCost = FLAT


def calibrate(runner: ModelRunner, settings: ServerSettings,
              max_model_len: int) -> tuple[DraftPlanner | None, StepBudget]:
    """On the model thread, before serving: choose each token count's linear layout (CPU) and
    measure the forward-cost curve the planner weighs drafts against (adaptive draft lengths)
    and the default step token budget is read from. Returns (planner, step token budget).
    A budget given (--max-num-batched-tokens) caps every step, as in vLLM; the default one
    applies where sequences decode, and a step with none prefills up to
    MAX_DEFAULT_BATCHED_TOKENS at once. With CUDA graphs the default is --cuda-graph-max-tokens in every step."""
    spec = settings.speculative
    adaptive = spec.policy.adaptive_draft_len and spec.max_draft_len > 0
    budget = settings.max_num_batched_tokens
    idle = min(max_model_len, MAX_DEFAULT_BATCHED_TOKENS)
    if budget is None and runner.graphs is not None:
        # A step of up to the graphs' tokens replays as graphs, a prompt's chunk beside decode rows too
        # (a graph for each length of row, cuda_graphs.py), where a larger one runs eagerly, at the host's
        # pace whatever its size (on an H200 an eager one-token forward of a SmolLM2-sized model took 30.4
        # ms, its graph 2.45 ms). So prompts go in chunks of that size, in every step.
        budget = runner.graphs.max_tokens
        log.info("chunked prefill: --max-num-batched-tokens %d (CUDA graphs: a step of up to "
                 "--cuda-graph-max-tokens replays as graphs, a prompt's chunk included)", budget)
    if not adaptive and runner.layouts is None and budget is not None:
        return None, StepBudget(budget)
    batch_tokens = runner.kv_cache.num_slots * (spec.max_draft_len + 1)
    points = step_costs.probe_points(spec.max_draft_len,
                                     batch_tokens if budget is not None else max(batch_tokens, CHUNK_PROBE_TOKENS))
    if settings.max_draft_nodes > spec.max_draft_len:  # a full token tree's forward, measured, not extrapolated
        points = sorted({*points, settings.max_draft_nodes + 1})
    seconds = _measure(runner, points, settings)
    costs = step_costs.CostCurve.from_seconds(seconds)
    log.info("forward cost by tokens (x one token, %.1f ms): %s", 1000 * seconds[min(seconds)], costs.describe())
    if adaptive and all(costs(k + 1) >= k + 1 for k in range(1, spec.max_draft_len + 1)):
        log.warning("on these forward costs no draft pays, even if every token were accepted (%d tokens cost "
                    "%.2fx one): the planner will not draft. Timed on a busy machine? Restart the verifier alone "
                    "with --timing-cache refresh", 2, costs(2))
    planner = DraftPlanner(costs, seconds[min(seconds)]) if adaptive else None
    if budget is not None:
        return planner, StepBudget(budget)
    budget = batched_tokens(costs, idle)
    cost = _prompt_token_cost(runner, settings, seconds, costs, budget)
    late = min(max_model_len, LONG_CONTEXT)
    log.info("chunked prefill: --max-num-batched-tokens %d while sequences decode (a step of %d tokens costs "
             "%.2fx a one-token step, at most %.1fx; a prompt token after %d cached ones counts as %.2f); up to "
             "%d when none does", budget, budget, costs(budget), PREFILL_STEP_COST, late, cost(late), idle)
    return planner, StepBudget(budget, idle, cost)


def capture_graphs_ahead(runner: ModelRunner, settings: ServerSettings, step_tokens: int | None) -> None:
    """On the model thread, before serving: capture the decode and draft steps of every batch size up to
    the KV cache's sequences, one sequence's token trees, and its prompt's chunks of every padded length
    up to `step_tokens` (the step budget) (cuda_graphs.py): a capture in the middle of a request would
    stall it."""
    graphs = runner.graphs
    assert graphs is not None
    started = time.perf_counter()
    shapes = [(rows, n, False) for rows in _powers_of_two(batch_rows(runner.kv_cache.num_slots))
              for n in range(1, settings.speculative.max_draft_len + 2)]
    shapes += [(1, n, True) for n in range(2, settings.max_draft_nodes + 2)] if settings.max_draft_nodes else []
    longest_chunk = min(padded_length(step_tokens), graphs.max_tokens) if step_tokens else 0
    shapes += [(1, n, False) for n in _powers_of_two(longest_chunk) if n > MIN_DRAFT_STEP_LENGTH]
    captured = graphs.capture_ahead(shapes, CAPTURE_AHEAD_WINDOW)
    log.info("CUDA graphs: %d shapes captured ahead (decode and draft steps of up to %d sequences, one "
             "sequence's trees and prompt chunks), for contexts up to %d tokens, in %.1f s", captured,
             runner.kv_cache.num_slots, CAPTURE_AHEAD_WINDOW, time.perf_counter() - started)


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    return [1 << i for i in range(limit.bit_length())]


def _measure(runner: ModelRunner, points: list[int], settings: ServerSettings) -> dict[int, float]:
    """step_costs.tune_and_measure, with what the timing cache holds of it."""
    points, context_len = step_costs.fitting(runner, points)  # what is timed is all that is kept
    measured = _timed(runner, settings, context_len,
                      lambda known: step_costs.measure_layouts(runner, points, context_len, known=known))
    return step_costs.choose_layouts(runner, measured)


def _timed(runner: ModelRunner, settings: ServerSettings, context_len: int,
           measure: Callable[[step_costs.Measurements], step_costs.Measurements]) -> step_costs.Measurements:
    """`measure(known)`: the timings after `context_len` cached tokens, given those the timing cache
    holds (none for a sharded model, whose ranks time their forwards together); what it measured is
    kept."""
    cache = (TimingCache.for_runner(runner, context_len, step_costs.REPEATS)
             if settings.timing_cache != "off" and settings.tensor_parallel_size == 1 else None)
    if cache is None:
        return measure({})
    with cache.turn():
        known = cache.load() if settings.timing_cache == "on" else {}
        measured = measure(known)
        cached = sum(t in known.get(layout, {}) for layout, seconds in measured.items() for t in seconds)
        total = sum(len(seconds) for seconds in measured.values())
        log.info("timing cache %s: %d of %d forward timings found, %d measured", cache.path, cached, total,
                 total - cached)
        if cached < total:
            cache.save({layout: {**known.get(layout, {}), **seconds} for layout, seconds in measured.items()})
    return measured


def _prompt_token_cost(runner: ModelRunner, settings: ServerSettings, seconds: dict[int, float],
                       costs: step_costs.CostCurve, budget: int) -> PromptTokenCost:
    """Price a prompt token's attention for the default budget: a chunk of CHUNK_PROBE_TOKENS timed
    after a long context, against the same chunk after the cost curve's own context."""
    tokens, short = CHUNK_PROBE_TOKENS, step_costs.CONTEXT_LEN
    long = min(LONG_CONTEXT, runner.kv_cache.shape.capacity - tokens)
    if long < 2 * short:
        return FLAT
    by_context = _chunk_seconds(runner, tokens, [short, long], settings)
    per_key_s = max(0.0, (by_context[long] - by_context[short]) / (tokens * (long - short)))
    return PromptTokenCost(per_key_s / token_seconds(costs, budget, seconds[min(seconds)]), short)


def token_seconds(costs: step_costs.CostCurve, budget: int, one_token_s: float) -> float:
    """Seconds one more token adds to a step of about `budget` tokens: the curve's slope over the
    budget's upper half, or over the whole budget where that is steeper (a flat stretch of the
    curve must not make a token look free)."""
    half = max(1, budget // 2)
    upper = (costs(budget) - costs(half)) / (budget - half) if budget > half else 0.0
    whole = (costs(budget) - costs(1)) / (budget - 1) if budget > 1 else 1.0
    return one_token_s * max(upper, whole, 1e-9)


def _chunk_seconds(runner: ModelRunner, tokens: int, contexts: list[int],
                   settings: ServerSettings) -> dict[int, float]:
    """Seconds of a forward of `tokens` after each of `contexts` cached tokens, in the layout already
    chosen for that many, timed one right after the other (the pair is compared; a point timed at
    another start, on another day's load, would not compare), the contexts left uncomputed (only
    their length counts). Kept in a timing cache file of its own, by "<layout> after <context>"."""
    layout = runner.layouts.layout_for(tokens).value if runner.layouts is not None else ""
    names = {c: f"{layout} after {c}" for c in contexts}

    def measure(known: step_costs.Measurements) -> step_costs.Measurements:
        if all(tokens in known.get(name, {}) for name in names.values()):
            return {name: {tokens: known[name][tokens]} for name in names.values()}
        return {names[c]: step_costs.measure(runner, [tokens], c, step_costs.REPEATS, prefill_context=False)
                for c in contexts}

    measured = _timed(runner, settings, max(contexts), measure)
    return {c: measured[name][tokens] for c, name in names.items()}


def batched_tokens(costs: step_costs.CostCurve, limit: int) -> int:
    """The most tokens a step carries within PREFILL_STEP_COST one-token steps (16 to `limit`)."""
    tokens = min(16, limit)
    while tokens < limit and costs(tokens + 1) <= PREFILL_STEP_COST:
        tokens += 1
    return tokens


async def build_runtime(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: ServerSettings,
                        model_name: str, metrics: VerifierMetrics | None = None,
                        leader: tensor_parallel.Leader | None = None,
                        model_thread: ModelThread | None = None,
                        sampling_defaults: SamplingDefaults | None = None) -> Runtime:
    """Must run inside the event loop that will drive the engine. With a sharded model,
    `leader` is rank 0's side of the group: the runner tells it every forward."""
    reasoning = reasoning_of(settings, tokenizer)
    max_model_len = model_len(model.config, settings)
    if max_model_len < settings.max_model_len:
        log.warning("--max-model-len %d is more than the model's %d positions: serving %d", settings.max_model_len,
                    max_model_len, max_model_len)
    # Every torch op of the verifier runs on this one thread, KV allocation and weight packing included,
    # and so does the engine's step loop (engine/model_thread.py). A server passes the thread it loaded the
    # model on.
    model_thread = model_thread or ModelThread()
    loop = asyncio.get_running_loop()
    runner = await loop.run_in_executor(model_thread, make_runner, model, settings, max_model_len, leader)
    if leader is not None:
        await loop.run_in_executor(model_thread, leader.connect, runner.layouts, model_thread)
    planner, step_budget = await loop.run_in_executor(model_thread, calibrate, runner, settings, max_model_len)
    if runner.graphs is not None:
        await loop.run_in_executor(model_thread, capture_graphs_ahead, runner, settings, step_budget.tokens)
    spec = settings.speculative
    verifier_id = uuid.uuid4().hex
    fingerprint = tokenizer_fingerprint(tokenizer)


    async def connect_drafter() -> DrafterClient | None:
        # On the model thread's loop, where the engine calls it: its gRPC channel belongs to that loop.
        client = build_drafter_client(spec, verifier_id, runner.vocab_size, fingerprint, model_name,
                                      target_device=str(runner.device),
                                      target_dtype=str(runner.dtype).removeprefix("torch."),
                                      model_thread=model_thread)
        if client is not None:
            await client.connect()
        return client

    drafter = await asyncio.wrap_future(model_thread.run_coroutine(connect_drafter()))
    scheduler = Scheduler(runner.kv_cache, SpeculationPolicy.from_config(spec, planner, settings.max_draft_nodes),
                          max_num_seqs=runner.kv_cache.num_slots, max_queue_len=settings.max_queue_len,
                          max_model_len=max_model_len, max_num_batched_tokens=step_budget.tokens,
                          max_idle_batched_tokens=step_budget.idle,
                          prompt_token_cost=step_budget.prompt_token_cost,
                          by_priority=settings.by_priority,
                          # Tensor-parallel followers do not replay copies: reuse by reference only.
                          prefix_cache=PrefixCache(runner.kv_cache, settings.enable_prefix_caching,
                                                   allow_copy=settings.tensor_parallel_size == 1))
    log.info("prefix caching: %s", "on" if settings.enable_prefix_caching else "off (--no-prefix-caching)")
    log.info("scheduling: %s", "by priority, with preemption" if settings.by_priority
             else "first come, first served (--scheduling-policy priority: by request priority)")
    engine = Engine(runner, scheduler, drafter, model_thread, metrics)
    if metrics is not None:
        metrics.track(lambda: scheduler.num_running, lambda: scheduler.num_waiting, scheduler.kv_usage,
                      (lambda: drafter.healthy) if drafter is not None else None, spec.max_draft_len,
                      (lambda: engine.step_price.call) if drafter is not None and planner is not None else None)
    # The tokenizer's end of sequence and the generation config's (one id or a list): vLLM stops at each.
    config_eos = model.generation_config.eos_token_id if model.generation_config else None
    listed = config_eos if isinstance(config_eos, list) else [config_eos]
    eos_ids = frozenset(token for token in [*listed, tokenizer.eos_token_id] if token is not None)
    rt = Runtime(model_name, tokenizer, engine, settings, verifier_id, max_model_len, eos_ids, fingerprint,
                 Grammars(tokenizer, runner.vocab_size, eos_ids), reasoning, sampling_defaults or SamplingDefaults())
    if rt.sampling_defaults.sampling:
        log.info("sampling defaults of requests that leave them out: %s (from %s; --generation-config vllm: none)",
                 rt.sampling_defaults.describe(), rt.sampling_defaults.origin)
    else:
        log.info("sampling defaults: none, a request without a temperature is greedy (--generation-config)")
    if rt.default_max_new_tokens is None:
        log.info("default max_new_tokens: the rest of the context (--default-max-new-tokens sets one)")
    else:
        log.info("default max_new_tokens: %d", rt.default_max_new_tokens)
    return rt
