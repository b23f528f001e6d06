"""vLLM's --speculative-config, read as this verifier's SpeculativeConfig, so that a vLLM command line
moves over as it is: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'`.

Where vLLM's technique is served here, its keys map onto the config (config.py fills in the rest):

    method "ngram" (or model "ngram")          NGRAM; prompt_lookup_max -> ngram.max_matching_ngram_size
                                               (5 when left out, as vLLM)
    method "suffix"                            SUFFIX; suffix_decoding_max_tree_depth, _max_cached_requests,
                                               _max_spec_factor, _min_token_prob -> suffix.*
    method "draft_model", or a model alone     DRAFT_TARGET; model -> draft_model.model
    num_speculative_tokens                     max_draft_len
    num_speculative_tokens_per_batch_size      policy.draft_len_schedule ([start, end, n] ranges, inclusive)

The n-gram drafter matches the longest suffix from max_matching_ngram_size down to one token, as
TensorRT-LLM's does; vLLM's prompt_lookup_min (prompt_lookup_max by default) has no counterpart, so one
given above 1 is logged, not kept: shorter matches cost speed at worst, never a token. Techniques that read the target's
hidden states or extra heads (eagle, eagle3, medusa, mlp_speculator, mtp, ...) are refused, naming how to
bring one (a USER_PROVIDED drafter service). The keys that tune vLLM's own loading, kernels or sampling
are refused unless left at the value that changes nothing (enforce_eager is taken: the draft model follows
the verifier's own CUDA graphs); an unknown key is refused, naming the known.
Every refusal is a ValueError whose message says why (config.py reports it as a ConfigError).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from drafter_sdk.proto import speculative_pb2

log = logging.getLogger(__name__)

Mode = speculative_pb2.SpeculativeDecodingMode
METHODS = {"ngram": Mode.SPECULATIVE_DECODING_MODE_NGRAM, "suffix": Mode.SPECULATIVE_DECODING_MODE_SUFFIX,
           "draft_model": Mode.SPECULATIVE_DECODING_MODE_DRAFT_TARGET}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, where neither prompt_lookup_max nor _min is given
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": "max_tree_depth",
               "suffix_decoding_max_cached_requests": "max_cached_requests",
               "suffix_decoding_max_spec_factor": "max_spec_factor",
               "suffix_decoding_min_token_prob": "min_token_prob"}
# vLLM's keys that change nothing here at these values (None: left out).
NEUTRAL = {"draft_tensor_parallel_size": 1, "tensor_parallel_size": None, "quantization": None, "revision": None,
           "code_revision": None, "max_model_len": None, "kv_cache_dtype": None, "moe_backend": None,
           "attention_backend": None, "disable_padded_drafter_batch": False,
           "disable_eagle_block_drop": False, "use_local_argmax_reduction": False,
           "use_heterogeneous_vocab": False, "parallel_drafting": False, "rejection_sample_method": "standard",
           "draft_sample_method": "greedy", "enable_adaptive_verification": False, "draft_load_config": None}
IGNORED = {"enforce_eager"}  # the draft model's CUDA graphs: here it follows the verifier's own setting
KNOWN = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "prompt_lookup_max",
         "prompt_lookup_min", *SUFFIX_KEYS, *NEUTRAL, *IGNORED}


def is_vllm(data: Mapping[str, Any]) -> bool:
    """Whether a config object is vLLM's (this verifier's own has no such keys)."""
    return any(key in data for key in ("method", "model", "num_speculative_tokens"))


def translate(data: Mapping[str, Any]) -> speculative_pb2.SpeculativeConfig:
    """vLLM's speculative config as a SpeculativeConfig; raises ValueError naming what cannot be served."""
    unknown = sorted(set(data) - KNOWN)
    if unknown:
        raise ValueError(f"vLLM speculative config: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(KNOWN))}")
    for key, neutral in NEUTRAL.items():
        if data.get(key, neutral) not in (neutral, None):
            raise ValueError(f"vLLM speculative config: {key} {data[key]!r} is not served here (leave it out"
                             f"{'' if neutral is None else f' or send {neutral!r}'})")
    method, model = data.get("method"), data.get("model")
    if method is None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
    if method == "[ngram]":
        method = "ngram"
    if method not in METHODS:
        raise ValueError(f"vLLM speculative config: method {method!r} is not served in-process here (served: "
                         f"{', '.join(METHODS)}); a technique that reads the target's hidden states or heads runs "
                         "as a drafter service: --speculative-mode user_provided --drafter-target HOST:PORT")
    config = speculative_pb2.SpeculativeConfig(mode=METHODS[method])
    config.max_draft_len = _whole(data, "num_speculative_tokens", 1) or 0
    if method == "ngram":
        _ngram(data, config.ngram)
    else:
        _only_for(data, "ngram", ("prompt_lookup_max", "prompt_lookup_min"))
    if method == "suffix":
        for key, field_name in SUFFIX_KEYS.items():
            if key in data:
                setattr(config.suffix, field_name, data[key])
    else:
        _only_for(data, "suffix", tuple(SUFFIX_KEYS))
    if method == "draft_model" and model:
        config.draft_model.model = str(model)
    schedule = data.get("num_speculative_tokens_per_batch_size")
    if schedule is not None:
        config.policy.draft_len_schedule.extend(_schedule(schedule))
    return config


def _whole(data: Mapping[str, Any], key: str, least: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"vLLM speculative config: {key} must be a whole number >= {least}, not {value!r}")
    return value


def _only_for(data: Mapping[str, Any], method: str, keys: tuple[str, ...]) -> None:
    given = [key for key in keys if key in data]
    if given:
        raise ValueError(f"vLLM speculative config: {', '.join(given)} apply to method {method!r} only, not "
                         f"{data.get('method', 'draft_model')!r}")


def _ngram(data: Mapping[str, Any], ngram: speculative_pb2.NgramConfig) -> None:
    """vLLM's defaults: both left out, 5; one left out, the other's value. A prompt_lookup_min given above
    1 is logged (vLLM's own default, prompt_lookup_max, is not kept either, silently: it is no choice)."""
    most, least = _whole(data, "prompt_lookup_max", 1), _whole(data, "prompt_lookup_min", 1)
    most = most or least or DEFAULT_PROMPT_LOOKUP
    if least is not None and least > most:
        raise ValueError(f"vLLM speculative config: prompt_lookup_min {least} is above prompt_lookup_max {most}")
    ngram.max_matching_ngram_size = most
    if least is not None and least > 1:
        log.warning("vLLM speculative config: prompt_lookup_min %d is not kept: the n-gram drafter matches the "
                    "longest suffix of up to %d tokens down to one token, as TensorRT-LLM's does", least, most)


def _schedule(ranges: Any) -> list[speculative_pb2.DraftLengthRule]:
    """[start, end, n] ranges of batch sizes, inclusive, from 1 on without a gap: each end is a rule's bound
    (the draft length of larger batches is the last range's, as here beyond the largest bound)."""
    rules, start_expected = [], 1
    for entry in ranges if isinstance(ranges, list) else [None]:
        if not (isinstance(entry, list) and len(entry) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)):
            raise ValueError("vLLM speculative config: num_speculative_tokens_per_batch_size is a list of "
                             f"[start, end, num_speculative_tokens] ranges of whole numbers, not {ranges!r}")
        start, end, length = entry
        if start != start_expected or end < start:
            raise ValueError(f"vLLM speculative config: num_speculative_tokens_per_batch_size's ranges must run "
                             f"from batch size 1 on without a gap or an overlap; [{start}, {end}] does not")
        rules.append(speculative_pb2.DraftLengthRule(max_batch_size=end, draft_len=length))
        start_expected = end + 1
    return rules
