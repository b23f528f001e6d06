"""vLLM's --speculative-config read as this verifier's config: each served technique's keys land on the
same fields a SpeculativeConfig file would set (and the flags still override them), vLLM's defaults where
keys are left out; what is not served is refused at start-up naming why; and a verifier configured from
vLLM's JSON serves exactly what plain decoding does."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, token_request
from verifier_support import (  # noqa: F401 - one_torch_thread: autouse fixture
    cached_reference,
    one_torch_thread,
    repetitive_prompt,
    shared_model,
)

from drafter_sdk.proto import speculative_pb2
from verifier_service.api import cli
from verifier_service.spec_decode.config import DRAFT_TARGET, NGRAM, SUFFIX, ConfigError, load, validate


def settings(*argv: str) -> speculative_pb2.SpeculativeConfig:
    return cli.settings_from_args(cli.parser().parse_args(list(argv))).speculative


def test_each_served_method_lands_on_the_fields_a_config_file_sets(tmp_path: Path) -> None:
    ngram = settings("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    same = tmp_path / "spec.yaml"
    same.write_text("mode: NGRAM\nmaxDraftLen: 5\nngram: {maxMatchingNgramSize: 4}\n")
    assert ngram == settings("--speculative-config", str(same))
    assert (ngram.mode, ngram.max_draft_len, ngram.ngram.max_matching_ngram_size) == (NGRAM, 5, 4)
    # vLLM's defaults: prompt lookup 5 where neither bound is given; num_speculative_tokens left out: ours.
    assert load('{"method": "ngram", "num_speculative_tokens": 3}').ngram.max_matching_ngram_size == 5
    assert load('{"model": "ngram", "num_speculative_tokens": 3}').mode == NGRAM
    assert validate(load('{"method": "ngram"}')).max_draft_len == 8
    # Flags override it, as they override a file.
    assert settings("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}',
                    "--max-draft-len", "2").max_draft_len == 2

    suffix = validate(load(json.dumps({"method": "suffix", "num_speculative_tokens": 16,
                                       "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0,
                                       "suffix_decoding_max_spec_factor": 2.0,
                                       "suffix_decoding_min_token_prob": 0.25})))
    sx = suffix.suffix
    assert (suffix.mode, suffix.max_draft_len, sx.max_tree_depth, sx.max_cached_requests, sx.max_spec_factor,
            sx.min_token_prob) == (SUFFIX, 16, 32, 0, 2.0, 0.25)
    assert validate(load('{"method": "suffix"}')).suffix.max_tree_depth == 24  # vLLM's default, unchanged

    draft = load('{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": 4}')
    assert (draft.mode, draft.draft_model.model, draft.max_draft_len) == (
        DRAFT_TARGET, "HuggingFaceTB/SmolLM2-135M-Instruct", 4)
    scheduled = load('{"method": "ngram", "num_speculative_tokens": 6, '
                     '"num_speculative_tokens_per_batch_size": [[1, 4, 6], [5, 16, 3], [17, 64, 0]]}')
    assert [(r.max_batch_size, r.draft_len) for r in scheduled.policy.draft_len_schedule] == [(4, 6), (16, 3),
                                                                                               (64, 0)]
    # Its own keys still mean a file of this verifier's, inline too.
    assert load('{"mode": "SUFFIX", "maxDraftLen": 3}').mode == SUFFIX


def test_prompt_lookup_min_has_no_counterpart_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = load('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                      '"prompt_lookup_min": 2}')
    assert config.ngram.max_matching_ngram_size == 4
    assert "prompt_lookup_min 2 is not kept" in caplog.text


@pytest.mark.parametrize("given, words", [
    ({"method": "eagle3", "model": "heads", "num_speculative_tokens": 3},
     ["method 'eagle3' is not served in-process", "--speculative-mode user_provided"]),
    ({"method": "mtp", "num_speculative_tokens": 1}, ["method 'mtp'"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens must be a whole number >= 1"]),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, ["prompt_lookup_min 3 is above"]),
    ({"method": "suffix", "prompt_lookup_max": 2}, ["prompt_lookup_max apply to method 'ngram' only, not 'suffix'"]),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, ["apply to method 'suffix' only"]),
    ({"model": "draft", "quantization": "fp8"}, ["quantization 'fp8' is not served here", "leave it out"]),
    ({"model": "draft", "draft_tensor_parallel_size": 2}, ["draft_tensor_parallel_size 2", "or send 1"]),
    ({"method": "ngram", "disable_by_batch_size": 4}, ["unknown key(s) disable_by_batch_size", "known:"]),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}, ["from batch size 1 on"]),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 4]]}, ["[start, end, num_speculative"]),
])
def test_what_is_not_served_is_refused_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   given: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        validate(load(json.dumps(given)))
    assert all(w in str(refused.value) for w in words), refused.value
    assert cli.main(["--speculative-config", json.dumps(given), "--model", str(tmp_path / "never-loaded")]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_a_verifier_configured_from_vllms_json_is_exact() -> None:
    prompts = [repetitive_prompt(seed) for seed in (3, 57)] + [tiny_tokenizer()("The quick brown fox")["input_ids"]]

    async def main() -> None:
        config = load('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}')
        async with run_verifier(config, model=shared_model()) as v:
            outs = await asyncio.gather(*(v.stub.Generate(token_request(p, 24)) for p in prompts))
        for prompt, out in zip(prompts, outs):
            assert list(out.output.token_ids) == list(cached_reference(tuple(prompt), 24))
        assert sum(o.output.stats.num_accepted_tokens for o in outs) > 0  # it drafted, and drafts were kept

    asyncio.run(main())
