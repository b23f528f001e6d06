"""What a drafter learned, kept across restarts: the suffix drafter's snapshot (drafts, caps, scopes and
refusals), and the server restoring it before it serves, saving it periodically and at shutdown, and
setting aside a file it cannot use."""

from __future__ import annotations

import asyncio
import random

import pytest
from sdk_support import seq, serving
from test_sdk_metrics import scrape, value
from test_sdk_suffix import finish, request

from drafter_sdk.drafters import suffix_snapshot
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server import cli
from drafter_sdk.server.serve import start_server


def outputs(n: int, seed: int = 0, length: int = 60) -> list[list[int]]:
    """Outputs that share phrases (so drafts depend on counts, not only on one copy)."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(500) for _ in range(6)] for _ in range(8)]
    return [[t for _ in range(length // 6) for t in rng.choice(phrases)] for _ in range(n)]


def learned(drafter: SuffixDrafter, texts: list[list[int]], verifiers: str = "v") -> SuffixDrafter:
    for i, text in enumerate(texts):
        finish(drafter, f"r{i}", [900, 901], text, verifier=verifiers[i % len(verifiers)])
    return drafter


def drafts(drafter: SuffixDrafter, contexts: list[list[int]], verifiers: str = "v") -> list:
    return [drafter.prepare_draft_tokens([request(f"q{i}", c, verifier=v)])[0]
            for i, c in enumerate(contexts) for v in verifiers]


def contexts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [text[:rng.randrange(3, 40)] for text in outputs(30, seed)]


@pytest.mark.parametrize("scope", ["global", "verifier"])
def test_a_restored_suffix_drafter_drafts_what_the_saved_one_did(scope: str) -> None:
    saved = learned(SuffixDrafter(cache_scope=scope), outputs(40), verifiers="AB")
    saved._choices[next(iter(saved._choices))].gains[(2, 4)] = 3.5  # a learned choice travels with its scope
    restored = SuffixDrafter(cache_scope=scope)
    restored.restore_learned(saved.save_learned())
    assert restored.cached_requests == saved.cached_requests == 40
    assert restored.shared_state_bytes() == saved.shared_state_bytes()
    assert {s: t.gains for s, t in restored._choices.items()} == {s: t.gains for s, t in saved._choices.items()}
    probes = contexts(1)
    assert drafts(restored, probes, "AB") == drafts(saved, probes, "AB")
    assert any(drafts(restored, probes, "AB"))
    # It goes on learning and evicting as if it had never stopped.
    assert restored.save_learned() == saved.save_learned()


def test_a_restoring_drafter_keeps_within_its_own_caps_the_oldest_evicted() -> None:
    texts = [[i * 100 + j for j in range(30)] for i in range(10)]  # nothing shared: each drafts only itself
    saved = learned(SuffixDrafter(), texts)
    small = SuffixDrafter(max_cached_requests=3)
    small.restore_learned(saved.save_learned())
    assert small.cached_requests == 3
    # The newest three draft (as far as their 5-token match allows), the older seven are gone.
    assert drafts(small, [t[:5] for t in texts]) == [[] for _ in texts[:7]] + [t[5:10] for t in texts[7:]]
    none = SuffixDrafter(max_cached_requests=0)
    none.restore_learned(saved.save_learned())
    assert none.cached_requests == 0 and none.shared_state_bytes() == 0


def test_an_empty_drafter_saves_a_snapshot_that_restores_empty() -> None:
    restored = learned(SuffixDrafter(), outputs(3))
    restored.restore_learned(SuffixDrafter().save_learned())  # replaces, does not add
    assert restored.cached_requests == 0 and restored.shared_state_bytes() == 0


@pytest.mark.parametrize("damage, message", [
    (lambda data: b"something else" + data, "not a suffix drafter snapshot"),
    (lambda data: data[:-3], "shorter than its header says"),
    (lambda data: data + b"\0\0\0\0", "its outputs do not match its header"),
    (lambda data: data[:-4] + b"\xff\xff\xff\xff", "the tokens of the global scope do not match"),
    (lambda data: data[:-4] + b"\xfe\xff\xff\xff", "the tokens of the global scope do not match"),
    (lambda data: data[:len(suffix_snapshot.MAGIC) + 10], "damaged snapshot header"),
    (lambda data: data.replace(b'"version": 1', b'"version": 9'), "snapshot version 9, this drafter reads 1"),
])
def test_a_damaged_snapshot_is_refused_and_changes_nothing(damage, message) -> None:  # noqa: ANN001
    data = learned(SuffixDrafter(), outputs(5)).save_learned()
    drafter = learned(SuffixDrafter(), outputs(2, seed=7))
    before = drafter.save_learned()
    with pytest.raises(ValueError, match=message):
        drafter.restore_learned(damage(data))
    assert drafter.save_learned() == before


def test_a_snapshot_of_another_cache_scope_is_refused() -> None:
    """Outputs learned per verifier must not become everyone's, nor shared ones sit where none looks."""
    per_verifier = learned(SuffixDrafter(cache_scope="verifier"), outputs(5), verifiers="AB").save_learned()
    with pytest.raises(ValueError, match="cache scope 'verifier', this drafter's is 'global'"):
        SuffixDrafter().restore_learned(per_verifier)


async def release_finished(c, rid: str, prompt: list[int], output: list[int]) -> None:  # noqa: ANN001
    await c.prepare("v", seq(rid, 0, prompt + output, prompt_len=len(prompt), draft_len=0))
    await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=[rid],
                                                           reasons=[pb.RELEASE_REASON_FINISHED]))


async def draft_for(c, rid: str, context: list[int]) -> list[int]:  # noqa: ANN001
    response = await c.prepare("v", seq(rid, 0, context, prompt_len=len(context), draft_len=8))
    return list(response.results[0].draft_tokens)


TEXT = list(range(100, 160))


def test_the_server_restores_before_serving_and_saves_at_shutdown(tmp_path) -> None:  # noqa: ANN001
    state = tmp_path / "suffix.state"

    async def body() -> None:
        async with serving(SuffixDrafter(), learned_state_file=state, save_learned_every_s=3600) as c:
            assert await draft_for(c, "q", TEXT[:5]) == []
            await release_finished(c, "a", [1, 2], TEXT)
            await c.running.stop()
        assert state.exists()  # no periodic save came in an hour: this is the one at shutdown
        async with serving(SuffixDrafter(), learned_state_file=state) as c:
            assert c.running.servicer.drafter.cached_requests == 1
            assert await draft_for(c, "q", TEXT[:8]) == TEXT[8:16]
            # The restored state counts against the budget from the first call on.
            assert c.running.servicer.state_stats().shared_bytes == c.running.servicer.drafter.shared_state_bytes()

    asyncio.run(body())


def test_the_server_saves_periodically_with_metrics(tmp_path) -> None:  # noqa: ANN001
    """What a crash would leave: the last periodic save, written whole."""
    state = tmp_path / "suffix.state"

    async def body() -> None:
        async with serving(SuffixDrafter(), learned_state_file=state, save_learned_every_s=0.05,
                           metrics_port=0) as c:
            await release_finished(c, "a", [1, 2], TEXT)
            deadline = asyncio.get_running_loop().time() + 10
            restored = SuffixDrafter()
            while asyncio.get_running_loop().time() < deadline:
                if state.exists():
                    restored.restore_learned(state.read_bytes())
                    if restored.cached_requests:
                        break
                await asyncio.sleep(0.02)
            assert restored.prepare_draft_tokens([request("q", TEXT[:8])]) == [TEXT[8:16]]
            metrics = await scrape(c.running.metrics_port)
            assert value(metrics, "learned_state_saves_total", outcome="ok") >= 1
            assert value(metrics, "learned_state_bytes") > 0
            assert value(metrics, "learned_state_last_save_timestamp_seconds") > 0
            assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind

    asyncio.run(body())


def test_a_file_the_drafter_cannot_use_is_set_aside_and_it_serves_empty(tmp_path, caplog) -> None:  # noqa: ANN001
    state = tmp_path / "suffix.state"
    state.write_bytes(b"not a snapshot at all")

    async def body() -> None:
        async with serving(SuffixDrafter(), learned_state_file=state, save_learned_every_s=3600) as c:
            assert c.running.servicer.drafter.cached_requests == 0
            await release_finished(c, "a", [1, 2], TEXT)
            assert await draft_for(c, "q", TEXT[:8]) == TEXT[8:16]
            await c.running.stop()

    asyncio.run(body())
    assert (tmp_path / "suffix.state.rejected").read_bytes() == b"not a snapshot at all"
    assert "cannot restore the learned state" in caplog.text
    restored = SuffixDrafter()
    restored.restore_learned(state.read_bytes())  # the shutdown's save replaced it
    assert restored.cached_requests == 1


def test_only_a_drafter_that_learns_across_requests_takes_a_state_file(tmp_path, capsys) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="keeps nothing across requests"):
        asyncio.run(start_server(NgramDrafter(), port=0, learned_state_file=tmp_path / "x"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["ngram", "--learned-state-file", str(tmp_path / "x")])
    assert exited.value.code == 2
    assert "--learned-state-file: the ngram drafter keeps nothing across requests" in capsys.readouterr().err


def test_a_state_file_no_save_could_be_written_to_is_refused_at_start(tmp_path, capsys) -> None:  # noqa: ANN001
    for path, message in [(tmp_path / "missing" / "x", "no directory"), (tmp_path, "is a directory")]:
        with pytest.raises(ValueError, match=message):
            asyncio.run(start_server(SuffixDrafter(), port=0, learned_state_file=path))
        with pytest.raises(SystemExit) as exited:
            cli.main(["suffix", "--learned-state-file", str(path)])
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_save_a_crash_cut_short_is_cleaned_up_at_start(tmp_path) -> None:  # noqa: ANN001
    state = tmp_path / "suffix.state"
    state.write_bytes(learned(SuffixDrafter(), outputs(3)).save_learned())
    stale = tmp_path / ".suffix.state.abc123.tmp"
    stale.write_bytes(b"half a save")

    async def body() -> None:
        async with serving(SuffixDrafter(), learned_state_file=state) as c:
            assert c.running.servicer.drafter.cached_requests == 3

    asyncio.run(body())
    assert not stale.exists()
