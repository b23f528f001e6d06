"""A loaded verifier: model, KV cache, scheduler, policy and drafter wired into an engine."""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verifier_service.spec.drafter_client import DrafterClient
from verifier_service.spec.config import validate
from verifier_service.engine.detokenizer import Detokenizer
from verifier_service.spec.drafters import build_drafter_client
from verifier_service.engine.engine import Engine
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.metrics import VerifierMetrics
from verifier_service.model.runner import ModelRunner
from verifier_service.api.request_parsing import Limits, ParsedRequest
from verifier_service.engine.scheduler import Scheduler
from verifier_service.engine.sequence import Sequence
from verifier_service.settings import ServerSettings
from verifier_service.spec.policy import SpeculationPolicy

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    model_name: str
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    limits: Limits
    settings: ServerSettings
    verifier_id: str
    drafter_name: str = ""
    drafter_version: str = ""

    @property
    def drafter(self) -> DrafterClient | None:
        return self.engine.drafter

    def new_sequence(self, parsed: ParsedRequest) -> Sequence:
        generator = None
        if not parsed.sampling.greedy:
            generator = torch.Generator(device=self.engine.runner.device)
            if parsed.sampling.seed is not None:
                generator.manual_seed(parsed.sampling.seed)
            else:
                generator.seed()
        return Sequence(
            request_id=uuid.uuid4().hex, prompt_ids=parsed.prompt_ids, sampling=parsed.sampling,
            stopping=parsed.stopping, speculation=parsed.speculation,
            detokenizer=Detokenizer(self.tokenizer, parsed.stopping.stop), generator=generator)


def kv_cache_for(model: PreTrainedModel, settings: ServerSettings, max_model_len: int,
                 max_draft_len: int) -> KVCache:
    """Size the cache: each slot holds a full context plus a draft; the memory
    budget decides how many slots (sequences) run at once."""
    shape = KVCacheShape.for_model(model.config, num_slots=1, capacity=max_model_len + max_draft_len + 1)
    per_slot = shape.bytes_per_slot(model.dtype)
    budget = int(settings.kv_cache_memory_gb * 2**30)
    slots = min(settings.max_num_seqs, budget // per_slot)
    if slots < 1:
        raise ValueError(f"--kv-cache-memory-gb {settings.kv_cache_memory_gb} is too small: one sequence of "
                         f"{max_model_len} tokens needs {per_slot / 2**30:.2f} GiB; raise it or lower --max-model-len")
    shape = replace(shape, num_slots=slots)
    log.info("KV cache: %d slots x %d tokens, %.2f GiB", slots, shape.capacity, slots * per_slot / 2**30)
    return KVCache(shape, model.dtype, model.device)


async def build_runtime(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: ServerSettings,
                        model_name: str, metrics: VerifierMetrics | None = None) -> Runtime:
    """Must run inside the event loop that will drive the engine."""
    spec = validate(settings.speculative)
    settings.speculative = spec
    cfg = model.config.get_text_config()
    max_model_len = min(settings.max_model_len, getattr(cfg, "max_position_embeddings", settings.max_model_len))
    # Every torch op of the verifier runs on this one thread, KV allocation and weight packing included:
    # on CPU, one OpenMP parallel region on the event loop's (main) thread made every later forward
    # on another thread about 2x slower (SmolLM2 one-token step 30 -> 60 ms, measured).
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    runner = await asyncio.get_running_loop().run_in_executor(model_thread, lambda: ModelRunner(
        model, kv_cache_for(model, settings, max_model_len, spec.max_draft_len), settings.prepack_weights))
    verifier_id = uuid.uuid4().hex
    drafter = build_drafter_client(spec, verifier_id, runner.vocab_size)
    scheduler = Scheduler(runner.kv_cache, runner.kv_cache.shape.num_slots, settings.max_queue_len)
    engine = Engine(runner, scheduler, SpeculationPolicy.from_config(spec), drafter, max_model_len, model_thread,
                    metrics=metrics)
    if metrics is not None:
        metrics.track(scheduler, runner.kv_cache, drafter, spec.max_draft_len)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = tokenizer.eos_token_id if eos is None else eos
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    limits = Limits(vocab_size=runner.vocab_size, max_model_len=max_model_len,
                    default_max_new_tokens=settings.default_max_new_tokens, eos_token_ids=eos_ids,
                    max_prompt_chars=max_prompt_chars(tokenizer, max_model_len))
    return Runtime(model_name, tokenizer, engine, limits, settings, verifier_id)


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """Characters past which a prompt cannot fit the context: no token spells more characters than
    its vocabulary entry, so more than max_model_len * longest-entry characters mean more than
    max_model_len tokens (doubled, for normalizers that fold characters together). 0: unknown."""
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: no early check
        return 0
    return 2 * max_model_len * longest if longest else 0
