"""--enable-log-requests: a real verifier logs one line per request as it ends, with the ids, token counts and
speculation figures its answer reports (metadata only), and under --log-format json every attribute of its
trace span as fields of the record; off by default."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import WAIT_S, one_torch_thread, repetitive_prompt, shared_model  # noqa: F401 - autouse fixture

from drafter_sdk.service.logs import _JsonFormatter
from verifier_service.api import cli

LOGGER = "verifier_service.api.generation"


def test_each_request_ends_with_a_line_of_what_its_answer_reports(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    prompt = repetitive_prompt(48)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), log_requests=True) as v:
            reply = await v.stub.Generate(token_request(prompt, 12), metadata=(("x-request-id", "req-42"),),
                                          timeout=WAIT_S)
            async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as quiet:
                await quiet.stub.Generate(token_request(prompt, 12), timeout=WAIT_S)
        (record,) = [r for r in caplog.records if r.name == LOGGER]
        stats = reply.output.stats
        assert record.getMessage().startswith(
            f"request req-42 length: {len(prompt)} prompt tokens (0 cached), 12 generated; queued ")
        assert f"mean acceptance length {stats.mean_acceptance_length:.2f}, drafter wait " in record.getMessage()
        entry = json.loads(_JsonFormatter({}).format(record))
        fields = entry["request"]
        assert entry["message"] == record.getMessage() and fields["gen_ai.request.id"] == "req-42"
        assert (fields["gen_ai.usage.completion_tokens"], fields["splitspec.speculation.num_accepted_tokens"],
                fields["splitspec.finish_reason"]) == (12, stats.num_accepted_tokens, "length")
        assert fields["gen_ai.latency.e2e"] >= fields["gen_ai.latency.time_to_first_token"] > 0

    asyncio.run(main())


def test_flag() -> None:
    assert cli.settings_from_args(cli.parser().parse_args([])).log_requests is False
    assert cli.settings_from_args(cli.parser().parse_args(["--enable-log-requests"])).log_requests is True
