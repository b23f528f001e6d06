"""The verifier's stats lines (stats_log.py): vLLM's wording, figures that are differences of the /metrics
counters (checked against the requests' own speculation stats), and quiet while idle."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    shared_model,
    wait_until,
)

from verifier_service.api.cli import parser, settings_from_args
from verifier_service.stats_log import COUNTERS, Reading, lines

INTERVAL_S = 0.2


def reading(at: float, per_pos: tuple[float, ...] = (), calls: float = 0.0, call_seconds: float = 0.0,
            running: float = 0.0, waiting: float = 0.0, **totals: float) -> Reading:
    return Reading(at, {name: totals.get(name, 0.0) for name in COUNTERS}, per_pos, calls, call_seconds, running,
                   waiting, 0.25)


def test_the_lines_are_vllms_figures_of_the_interval() -> None:
    before = reading(100.0, (10.0, 4.0), calls=5, call_seconds=0.005, prompt_tokens=50, generation_tokens=20,
                     spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=14)
    now = reading(110.0, (30.0, 14.0, 2.0), calls=25, call_seconds=0.045, running=2, waiting=1, prompt_tokens=1050,
                  generation_tokens=520, spec_decode_num_drafts=50, spec_decode_num_draft_tokens=200,
                  spec_decode_num_accepted_tokens=46, prefix_cache_queries=1000, prefix_cache_hits=750,
                  drafter_call_failures=1)
    assert lines(before, now) == [
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 50.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%",
        "SpecDecoding metrics: Mean acceptance length: 1.80, Accepted throughput: 3.20 tokens/s, Drafted "
        "throughput: 16.00 tokens/s, Accepted: 32 tokens, Drafted: 160 tokens, Per-position acceptance rate: "
        "0.500, 0.250, 0.050, Avg Draft acceptance rate: 20.0%",
        "Drafter calls waited for: 20, mean round trip: 2.00 ms, failed: 1, skipped while the drafter was down: 0"]
    # Plain decoding: one line; nothing ran and nothing waits: none.
    assert len(lines(reading(0.0), reading(10.0, generation_tokens=5))) == 1
    assert lines(now, reading(120.0, (30.0, 14.0, 2.0), **now.totals)) == []


def test_the_log_adds_up_to_the_requests_and_goes_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="verifier_service.stats_log")

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), log_stats_interval_s=INTERVAL_S) as v:
            replies = await asyncio.gather(*(v.stub.Generate(token_request(repetitive_prompt(seed), 40),
                                                             timeout=WAIT_S) for seed in LOOPING_SEEDS[:2]))
            await wait_until(lambda: not engine_of(v).scheduler.running, "the requests done")

            def logged() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.name == "verifier_service.stats_log"]

            # The interval that saw the last tokens is logged; then quiet.
            await wait_until(lambda: sum(int(n) for line in logged()
                                         for n in re.findall(r"Accepted: (\d+) tokens", line)) ==
                             sum(r.output.stats.num_accepted_tokens for r in replies), "the lines to add up")
            settled = len(logged())
            await asyncio.sleep(5 * INTERVAL_S)
            assert len(logged()) == settled, logged()[settled:]
            text = "\n".join(logged())
            assert sum(r.output.stats.num_accepted_tokens for r in replies) > 0
            assert sum(int(n) for n in re.findall(r"Drafted: (\d+) tokens", text)) == \
                sum(r.output.stats.num_draft_tokens for r in replies)
            assert "Avg generation throughput" in text and "Per-position acceptance rate" in text

    asyncio.run(main())


def test_flags() -> None:
    assert settings_from_args(parser().parse_args([])).log_stats_interval_s == 10.0
    assert settings_from_args(parser().parse_args(["--log-stats-interval-s", "2.5"])).log_stats_interval_s == 2.5
    assert settings_from_args(parser().parse_args(["--disable-log-stats"])).log_stats_interval_s == 0.0
