"""`splitspec check-drafter`, a real process, against real drafter services: the SDK's n-gram drafter passes
every check, its bearer token included, and so does it served as an async drafter; a raw gRPC drafter that
breaks the protocol on the wire (faulty_drafter_server.py) fails exactly the checks its fault breaks, each
saying what was expected and what came, with exit status 1. (The Node.js example is checked in
tests/examples/test_node_drafter.py.)"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import WAIT_S, RawFaultyDrafter

from drafter_sdk.drafter import DraftRequest, Drafts
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.server.serve import start_server

pytestmark = pytest.mark.timeout(180)

SPLITSPEC = str(Path(sys.executable).with_name("splitspec"))
# The latency check's limit here: the verifier's 50 ms, with room for a suite's other worker on 2 cores.
DEADLINE = ("--deadline-ms", "500")
CHECKS = ("health", "info", "results", "bounds", "deltas", "resync", "no-draft", "namespacing", "release",
          "validation", "stream", "trees", "cache-salt", "latency", "large-message", "auth")


def outcomes(printed: str) -> dict[str, str]:
    """{check: PASS | FAIL | SKIP} from the command's lines."""
    return {name: outcome for outcome, name in re.findall(r"^(PASS|FAIL|SKIP)  (\S+)", printed, re.MULTILINE)}


class AsyncNgram(NgramDrafter):
    """The n-gram drafter, loaded and answering as an async drafter (awaited on the server's event loop)."""

    async def load(self) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().load()

    async def prepare_draft_tokens(self, requests: list[DraftRequest]) -> Drafts:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().prepare_draft_tokens(requests)


@pytest.mark.parametrize("drafter", [NgramDrafter, AsyncNgram])
def test_the_sdk_drafter_passes_every_check(tmp_path: Path, drafter: type[NgramDrafter]) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    async def main() -> None:
        running = await start_server(drafter(), host="127.0.0.1", port=0, grace_period_s=0.0,
                                     auth_token="s3cret")
        try:
            await running.wait_loaded()
            process = await asyncio.create_subprocess_exec(
                SPLITSPEC, "check-drafter", "--target", f"127.0.0.1:{running.port}", "--auth-token-file", str(token),
                *DEADLINE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(process.communicate(), 3 * WAIT_S)
        finally:
            await running.stop(0)
        printed = out.decode()
        assert process.returncode == 0, printed
        assert outcomes(printed) == dict.fromkeys(CHECKS, "PASS"), printed
        assert "16 passed, 0 failed, 0 skipped" in printed

    asyncio.run(main())


@pytest.mark.parametrize(("mode", "failing", "words"), [
    ("ok", {"validation"}, "an empty verifier_id: expected INVALID_ARGUMENT, the call succeeded"),
    ("too_many", {"bounds", "no-draft", "validation"}, "draft_len 1 (max_draft_len any): 4 draft tokens, at most 1"),
    ("out_of_vocab", {"bounds", "no-draft", "validation"}, "draft ids outside [0, 100): [107]"),
    ("unknown_request", {"results", "bounds", "deltas", "resync", "no-draft", "namespacing", "validation"},
     "asked ['a', 'b', 'c'], answered ['not-a', 'not-b', 'not-c']"),
])
def test_a_drafter_that_breaks_the_protocol_fails_the_checks_it_breaks(mode: str, failing: set[str],
                                                                       words: str) -> None:
    with RawFaultyDrafter(vocab_size=100) as d:
        d.start()
        d.set(mode)
        done = subprocess.run([SPLITSPEC, "check-drafter", "--target", d.address, "--skip", "large-message", *DEADLINE],
                              capture_output=True, text=True, timeout=3 * WAIT_S)
    printed = done.stdout + done.stderr
    assert done.returncode == 1, printed
    got = outcomes(printed)
    assert {name for name, outcome in got.items() if outcome == "FAIL"} == failing, printed
    # Optional parts it does not serve or advertise are skipped, not failed.
    assert (got["stream"], got["trees"], got["cache-salt"], got["auth"], got["large-message"]) == ("SKIP",) * 5, printed
    assert words in printed, printed


class Leaky(SuffixDrafter):
    """Says it keeps cache salts apart, and learns every output into one tree whatever its salt."""

    def _scope(self, key: tuple[str, str], salt: str) -> str | None:
        return super()._scope(key, "")


@pytest.mark.parametrize(("drafter", "outcome"), [(SuffixDrafter, "PASS"), (Leaky, "FAIL")])
def test_a_learning_drafter_is_held_to_keeping_cache_salts_apart(drafter: type[SuffixDrafter], outcome: str) -> None:
    async def main() -> str:
        running = await start_server(drafter(), host="127.0.0.1", port=0, grace_period_s=0.0)
        try:
            await running.wait_loaded()
            process = await asyncio.create_subprocess_exec(
                SPLITSPEC, "check-drafter", "--target", f"127.0.0.1:{running.port}", "--skip", "large-message,latency",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(process.communicate(), 3 * WAIT_S)
        finally:
            await running.stop(0)
        return out.decode()

    printed = asyncio.run(main())
    got = outcomes(printed)
    others = {o for n, o in got.items() if n != "cache-salt"}
    assert got["cache-salt"] == outcome and others <= {"PASS", "SKIP"}, printed
    if outcome == "FAIL":
        assert "taught under one cache_salt_id drafted for a sequence with another salt" in printed, printed
