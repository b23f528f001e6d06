"""PrepareDraftTokens / ReleaseRequests over a real gRPC server: deltas, resync, namespacing, trimming, release."""

import asyncio

import pytest

from drafter_sdk.drafter import CACHE_SALT, LEARNS_FROM_FINISHED, STREAM_RELEASES
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server.servicer import DrafterServicer
from sdk_support import RecordingDrafter, seq, serving, until

OK = pb.DRAFT_STATUS_OK
RESYNC = pb.DRAFT_STATUS_RESYNC_REQUIRED


def test_deltas_rebuild_the_full_history_for_the_drafter():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", seq("r", 0, [10, 11, 12], prompt_len=2, draft_len=2,
                                     sampling=pb.SamplingHints(temperature=0.5, top_k=7)))
            response = await c.prepare("v", seq("r", 3, [13, 14], prompt_len=2, draft_len=3,
                                                last_num_drafted=2, last_num_accepted=1))
        seen = drafter.calls[-1][0]
        assert seen.tokens == [10, 11, 12, 13, 14]
        assert (seen.prompt_len, seen.draft_len, seen.last_num_drafted, seen.last_num_accepted) == (2, 3, 2, 1)
        first = drafter.calls[0][0]
        # top_p unset on the wire means "no nucleus filtering".
        assert (first.temperature, first.top_p, first.top_k) == (0.5, 1.0, 7)
        [result] = response.results
        assert (result.request_id, result.status, list(result.draft_tokens)) == ("r", OK, [14, 13, 12])

    asyncio.run(body())


def test_prompt_and_generated_token_views():
    async def body():
        views = []

        def propose(r):
            views.append((list(r.prompt_tokens), list(r.generated_tokens), r.key))
            return []

        async with serving(RecordingDrafter(propose)) as c:
            await c.prepare("v", seq("r", 0, [1, 2, 3, 4, 5], prompt_len=3))
        assert views == [([1, 2, 3], [4, 5], ("v", "r"))]

    asyncio.run(body())


def test_unknown_key_gap_and_inconsistent_delta_require_resync_then_full_context_recovers():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            unknown = await c.prepare("v", seq("r", 3, [4]))
            assert [(x.request_id, x.status, list(x.draft_tokens)) for x in unknown.results] == [("r", RESYNC, [])]
            assert drafter.calls == []  # nothing in sync: the user's code is not called

            await c.prepare("v", seq("r", 0, [1, 2, 3]))
            gap = await c.prepare("v", seq("r", 5, [6]))  # positions 3 and 4 are missing
            assert gap.results[0].status == RESYNC
            assert drafter.released == []  # a gap leaves the held prefix alone

            # An overlapping delta: [2, 3] are held already, [4, 5] are appended.
            overlap = await c.prepare("v", seq("r", 1, [2, 3, 4, 5], draft_len=2))
            assert overlap.results[0].status == OK and list(overlap.results[0].draft_tokens) == [5, 4]
            assert drafter.calls[-1][0].tokens == [1, 2, 3, 4, 5]

            inconsistent = await c.prepare("v", seq("r", 1, [2, 3]))  # ends before the 5 held tokens
            assert inconsistent.results[0].status == RESYNC
            assert drafter.released == [("v", "r")]  # the drafter is told to drop what it derived
            # The stale state is gone: even a delta that fitted before needs the full context now.
            assert (await c.prepare("v", seq("r", 5, [6]))).results[0].status == RESYNC

            recovered = await c.prepare("v", seq("r", 0, [1, 2, 3, 4], draft_len=2))
            assert recovered.results[0].status == OK and list(recovered.results[0].draft_tokens) == [4, 3]

    asyncio.run(body())


def test_a_restarted_server_has_no_state_and_asks_for_a_resync():
    async def body():
        async with serving(RecordingDrafter()) as c:
            await c.prepare("v", seq("r", 0, [1, 2, 3]))
            assert (await c.prepare("v", seq("r", 3, [4]))).results[0].status == OK
        async with serving(RecordingDrafter()) as c:  # the replacement process
            assert (await c.prepare("v", seq("r", 4, [5]))).results[0].status == RESYNC
            result = (await c.prepare("v", seq("r", 0, [1, 2, 3, 4, 5], draft_len=1))).results[0]
            assert result.status == OK and list(result.draft_tokens) == [5]

    asyncio.run(body())


def test_results_follow_request_order_with_mixed_statuses():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", seq("b", 0, [5, 6]))
            response = await c.prepare("v", seq("a", 0, [1, 2], draft_len=1), seq("x", 9, [1]),
                                       seq("b", 2, [7], draft_len=2))
        assert [(x.request_id, x.status, list(x.draft_tokens)) for x in response.results] == [
            ("a", OK, [2]), ("x", RESYNC, []), ("b", OK, [7, 6])]
        assert [s.key for s in drafter.calls[-1]] == [("v", "a"), ("v", "b")]

    asyncio.run(body())


def test_request_ids_are_namespaced_by_verifier():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            await c.prepare("v1", seq("r", 0, [1, 1]))
            await c.prepare("v2", seq("r", 0, [2, 2, 2]))
            one = await c.prepare("v1", seq("r", 2, [3], draft_len=8))
            two = await c.prepare("v2", seq("r", 3, [4], draft_len=8))
            assert list(one.results[0].draft_tokens) == [3, 1, 1]
            assert list(two.results[0].draft_tokens) == [4, 2, 2, 2]

            released = await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v1", request_ids=["r"]))
            assert released.released == 1 and drafter.released == [("v1", "r")]
            assert (await c.prepare("v1", seq("r", 3, [5]))).results[0].status == RESYNC
            assert (await c.prepare("v2", seq("r", 4, [5]))).results[0].status == OK

    asyncio.run(body())


def test_release_counts_held_requests_and_calls_on_release():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", seq("a", 0, [1]), seq("b", 0, [2]))
            response = await c.stub.ReleaseRequests(
                pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["a", "never-seen", "b"]))
            assert response.released == 2
            assert drafter.released == [("v", "a"), ("v", "b")]
            assert (await c.prepare("v", seq("a", 1, [3]))).results[0].status == RESYNC

    asyncio.run(body())


def test_replacing_a_context_tells_the_drafter_to_forget_the_old_one():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            await c.prepare("v", seq("r", 0, [1, 2]))
            await c.prepare("v", seq("r", 0, [9]))
        assert drafter.released == [("v", "r")]
        assert drafter.calls[-1][0].tokens == [9]

    asyncio.run(body())


def test_idle_sequences_are_evicted_and_released():
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter, idle_timeout_s=0.2) as c:
            await c.prepare("v", seq("r", 0, [1, 2]))
            await until(lambda: drafter.released == [("v", "r")])
            assert len(c.running.servicer.store) == 0
            assert (await c.prepare("v", seq("r", 2, [3]))).results[0].status == RESYNC

    asyncio.run(body())


def test_drafts_are_trimmed_to_draft_len_and_max_draft_len():
    async def body():
        drafter = RecordingDrafter(lambda r: list(range(100, 110)))
        async with serving(drafter) as c:
            response = await c.prepare("v", seq("a", 0, [1], draft_len=3), seq("b", 0, [1], draft_len=20))
            assert [list(x.draft_tokens) for x in response.results] == [[100, 101, 102], list(range(100, 110))]
            drafter.max_draft_len = 2
            response = await c.prepare("v", seq("a", 1, [2], draft_len=3))
            assert list(response.results[0].draft_tokens) == [100, 101]

    asyncio.run(body())


def test_draft_len_zero_keeps_the_drafter_informed_but_returns_no_draft():
    async def body():
        drafter = RecordingDrafter(lambda r: [42, 43])
        async with serving(drafter) as c:
            response = await c.prepare("v", seq("r", 0, [1, 2], draft_len=0))
        assert response.results[0].status == OK and list(response.results[0].draft_tokens) == []
        assert drafter.calls[0][0].draft_len == 0 and drafter.calls[0][0].tokens == [1, 2]

    asyncio.run(body())


@pytest.mark.parametrize("n", [0, 1])
def test_empty_or_all_resync_steps_do_not_call_the_drafter(n):
    async def body():
        drafter = RecordingDrafter()
        async with serving(drafter) as c:
            response = await c.prepare("v", *[seq(f"r{i}", 3, [1]) for i in range(n)])
        assert len(response.results) == n and drafter.calls == []

    asyncio.run(body())


def test_info_describes_the_drafter():
    class Described(RecordingDrafter):
        version = "2.1"
        max_draft_len = 6
        vocab_size = 49152
        tokenizer = "HuggingFaceTB/SmolLM2-135M-Instruct"
        capabilities = ("sampling-aware",)

    async def body():
        async with serving(Described()) as c:
            info = await c.stub.GetDrafterInfo(pb.GetDrafterInfoRequest())
        assert (info.name, info.version, info.max_draft_len, info.vocab_size, info.tokenizer,
                list(info.capabilities)) == ("Described", "2.1", 6, 49152, "HuggingFaceTB/SmolLM2-135M-Instruct",
                                            ["sampling-aware", CACHE_SALT, STREAM_RELEASES])  # it learns nothing

    asyncio.run(body())


def test_cache_salt_is_advertised_for_a_drafter_only_where_nothing_it_learns_crosses_requests():
    """The SDK adds CACHE_SALT for a drafter that keeps nothing to save and asks for no finished outputs; one
    that does either is served salted requests only if it lists CACHE_SALT itself (PROTOCOL.md §7)."""
    class Saves(RecordingDrafter):
        def save_learned(self) -> bytes:
            return b""

    class Finished(RecordingDrafter):
        capabilities = (LEARNS_FROM_FINISHED,)

    class Says(Finished):
        capabilities = (LEARNS_FROM_FINISHED, CACHE_SALT)

    for drafter, advertised in ((RecordingDrafter, True), (Saves, False), (Finished, False), (Says, True)):
        capabilities = list(DrafterServicer(drafter()).info().capabilities)
        assert (CACHE_SALT in capabilities, capabilities.count(CACHE_SALT) <= 1) == (advertised, True), drafter
