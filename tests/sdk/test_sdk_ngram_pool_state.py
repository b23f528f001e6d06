"""The n-gram drafter's public pool kept across restarts and handed to a starting replica: restored, it drafts
what the saved one did and goes on learning as it would have; a pool of another shape, or a damaged one, is
refused; a drafter without a public pool keeps nothing."""

from __future__ import annotations

import asyncio
import random

import pytest
from sdk_support import serving
from test_sdk_peers import nobody

from drafter_sdk.drafters import ngram_snapshot
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.server.peers import Peers


def texts(n: int, seed: int, vocab: int = 40, length: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def taught(drafter: NgramDrafter, seed: int = 0) -> NgramDrafter:
    for i, text in enumerate(texts(20, seed)):
        drafter.draft(("v", f"t{seed}-{i}"), text, drafter.max_draft_len)
    return drafter


def drafts(drafter: NgramDrafter, seed: int) -> list[list[int]]:
    """Drafts for new requests' short contexts (each also records into the pool, as serving does)."""
    return [drafter.draft(("v", f"p{seed}-{i}"), text[:30], drafter.max_draft_len)
            for i, text in enumerate(texts(40, seed))]


def same_pool(a: NgramDrafter, b: NgramDrafter) -> bool:
    """The same entries (slot order follows each process's hash salt and insertion history)."""
    x, y = (ngram_snapshot.decode(d.save_learned()) for d in (a, b))
    return x.shape == y.shape and x.arena == y.arena and all(
        sorted(p) == sorted(q) for p, q in zip(x.patterns + (x.windows or []), y.patterns + (y.windows or [])))


@pytest.mark.parametrize("knobs", [dict(), dict(is_use_oldest=False), dict(is_keep_all=False)])
def test_a_restored_pool_drafts_what_the_saved_one_did_and_learns_on_alike(knobs: dict) -> None:
    saved = taught(NgramDrafter(is_public_pool=True, **knobs))
    restored = NgramDrafter(is_public_pool=True, **knobs)
    restored.restore_learned(saved.save_learned())
    assert same_pool(restored, saved)
    assert restored.shared_state_bytes() > 0
    cold = drafts(NgramDrafter(is_public_pool=True, **knobs), 1)
    for seed in (1, 2):  # each round of drafts records more: both pools grow alike
        first = drafts(saved, seed)
        assert drafts(restored, seed) == first
    assert same_pool(restored, saved)
    assert drafts(taught(NgramDrafter(is_public_pool=True, **knobs)), 1) != cold  # what it learned drafts


def test_a_pool_of_another_shape_a_damaged_one_or_no_public_pool_is_refused() -> None:
    data = taught(NgramDrafter(is_public_pool=True)).save_learned()
    for other in (NgramDrafter(is_public_pool=True, max_draft_len=4), NgramDrafter(
            is_public_pool=True, max_matching_ngram_size=2), NgramDrafter(is_public_pool=True, is_use_oldest=False)):
        with pytest.raises(ValueError, match="the pool was learned as"):
            other.restore_learned(data)
    with pytest.raises(ValueError, match="no public pool"):
        NgramDrafter().restore_learned(data)
    snapshot = ngram_snapshot.decode(data)
    snapshot.patterns[0].append(len(snapshot.arena))
    for damaged, message in [(data[:-4], "shorter than its header"), (data + b"\0" * 4, "longer than its header"),
                             (ngram_snapshot.encode(snapshot), "outside its arena"), (b"junk", "not an n-gram")]:
        drafter = taught(NgramDrafter(is_public_pool=True), seed=5)
        before = drafter.save_learned()
        with pytest.raises(ValueError, match=message):
            drafter.restore_learned(damaged)
        assert drafter.save_learned() == before  # refused before anything changed


def test_only_a_public_pool_learns_across_requests() -> None:
    assert not NgramDrafter().learns_across_requests and NgramDrafter().save_learned() is None
    assert NgramDrafter(is_public_pool=True).learns_across_requests


def test_the_server_keeps_the_pool_in_its_file_and_gives_it_to_a_starting_replica(tmp_path) -> None:  # noqa: ANN001
    state = tmp_path / "ngram.state"
    first = taught(NgramDrafter(is_public_pool=True))
    expected = drafts(taught(NgramDrafter(is_public_pool=True)), 3)

    async def body() -> None:
        async with serving(first, learned_state_file=state, save_learned_every_s=3600):
            pass  # saved at shutdown
        async with serving(NgramDrafter(is_public_pool=True), learned_state_file=state,
                           peers=Peers(nobody())) as restarted:
            assert same_pool(restarted.running.servicer.drafter, first)
            async with serving(NgramDrafter(is_public_pool=True), peers=Peers(
                    f"ipv4:127.0.0.1:{restarted.running.port}")) as added:
                assert same_pool(added.running.servicer.drafter, first)
                assert drafts(added.running.servicer.drafter, 3) == expected

    asyncio.run(body())
