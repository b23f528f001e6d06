"""SuffixDecoding through the verifier: in-process (SUFFIX mode) and as a remote drafter, exact against
plain decoding; finished outputs of one verifier draft for another that shares the drafter, unless the
cache is scoped to the request or the requests' cache salts differ; only finished requests are learned."""

from __future__ import annotations

import asyncio
import functools
import socket

import pytest
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    cached_reference,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
    wait_until,
)

from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import drafter_pb2, speculative_pb2, verifier_pb2
from verifier_service.spec_decode.config import SUFFIX, ConfigError, suffix_drafter, validate
from verifier_service.tools.local_services import LocalService, script

# Looping prompts (the request's own tree drafts) and non-looping ones (only learning helps).
PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:6]] + [repetitive_prompt(s) for s in range(300, 306)]
LENGTHS = [32] * len(PROMPTS)
FRESH_PROMPT = repetitive_prompt(301)  # its greedy output does not repeat itself


def suffix_config(k: int, **suffix: object) -> speculative_pb2.SpeculativeConfig:
    config = spec_config("SUFFIX", k)
    for name, value in suffix.items():
        setattr(config.suffix, name, value)
    return config


def remote_config(k: int, port: int) -> speculative_pb2.SpeculativeConfig:
    return spec_config("USER_PROVIDED", k, drafter_target=f"127.0.0.1:{port}", deadline_ms=30000)


def replicas_config(ports: list[int], share: bool = True) -> speculative_pb2.SpeculativeConfig:
    """One target for several replicas' addresses, as a headless Service's name resolves to its pods."""
    config = spec_config("USER_PROVIDED", 8, drafter_target="ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports),
                         deadline_ms=30000)
    config.user_provided.share_finished = share
    return config


async def generate_all(v, prompts, lengths) -> list[verifier_pb2.GenerateResponse]:  # noqa: ANN001
    return await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n), timeout=WAIT_S)
                                  for p, n in zip(prompts, lengths)])


def check_exact(responses, prompts, lengths) -> None:  # noqa: ANN001
    for i, (r, p, n) in enumerate(zip(responses, prompts, lengths)):
        assert list(r.output.token_ids) == list(cached_reference(tuple(p), n)), f"prompt {i} differs from plain"


def test_config_fills_vllm_defaults_and_refuses_bad_knobs() -> None:
    config = validate(speculative_pb2.SpeculativeConfig(mode=SUFFIX))
    sx = config.suffix
    assert (sx.max_tree_depth, sx.max_cached_requests, sx.max_spec_factor, sx.max_spec_offset) == (24, 10000, 1.0, 0.0)
    assert sx.min_token_prob == pytest.approx(0.1) and sx.own_spec_factor == 8.0 and sx.prefer_longer_match
    assert sx.cache_scope == speculative_pb2.SUFFIX_CACHE_SCOPE_GLOBAL
    assert sx.max_cached_mib == 256.0 and suffix_drafter(sx).max_cached_mib == 256.0  # not in vLLM
    assert suffix_drafter(sx).prefer_longer_match and sx.learn_choice and suffix_drafter(sx).learn_choice
    explicit = speculative_pb2.SpeculativeConfig(mode=SUFFIX)
    explicit.suffix.max_cached_requests = 0  # set to 0: no global tree, as in vLLM (not the default)
    explicit.suffix.prefer_longer_match = False  # vLLM's rule: the higher score wins
    explicit.suffix.learn_choice = False
    explicit.suffix.max_cached_mib = 64.0
    assert validate(explicit).suffix.max_cached_requests == 0
    assert suffix_drafter(validate(explicit).suffix).max_cached_mib == 64.0
    drafter = suffix_drafter(validate(explicit).suffix)
    assert not drafter.prefer_longer_match and not drafter.learn_choice
    for field, value in (("max_tree_depth", 1), ("min_token_prob", 1.5), ("max_spec_factor", -1.0),
                         ("own_spec_factor", -1.0), ("max_cached_mib", 0.0)):
        bad = speculative_pb2.SpeculativeConfig(mode=SUFFIX)
        setattr(bad.suffix, field, value)
        with pytest.raises(ConfigError, match=field):
            validate(bad)
    wrong = speculative_pb2.SpeculativeConfig(mode=SUFFIX)
    wrong.ngram.max_matching_ngram_size = 3
    with pytest.raises(ConfigError, match="does not take a `ngram` section"):
        validate(wrong)


def test_suffix_in_process_and_remote_equal_plain_decoding() -> None:
    async def main() -> None:
        async with run_verifier(suffix_config(8), model=shared_model()) as v:
            accepted = []
            for _ in range(2):  # the second round drafts from the first round's finished outputs too
                responses = await generate_all(v, PROMPTS, LENGTHS)
                check_exact(responses, PROMPTS, LENGTHS)
                accepted.append(sum(r.output.stats.num_accepted_tokens for r in responses))
                await wait_until(lambda: not engine_of(v).drafter._background, "the releases")
            assert accepted[0] > 100 and accepted[1] > accepted[0] + 100, accepted
            assert engine_of(v).drafter.stats.failures == 0
        async with serve_drafter(SuffixDrafter()) as drafter:
            async with run_verifier(remote_config(8, drafter.port), model=shared_model()) as v:
                for _ in range(2):
                    responses = await generate_all(v, PROMPTS, LENGTHS)
                    check_exact(responses, PROMPTS, LENGTHS)
                assert sum(r.output.stats.num_accepted_tokens for r in responses) > 100
                assert sum(r.output.stats.num_drafter_failures for r in responses) == 0

    asyncio.run(main())


def test_suffix_trees_in_process_and_remote_equal_plain_decoding() -> None:
    """With a node budget the suffix drafter answers speculation trees, branched where its trees saw
    more than one continuation; every output is still plain decoding's."""
    def branched(responses: list[verifier_pb2.GenerateResponse]) -> bool:
        stats = [r.output.stats for r in responses]  # a tree's draft tokens count its depth only
        return sum(s.num_draft_nodes for s in stats) > sum(s.num_draft_tokens for s in stats) > 0

    async def main() -> None:
        async with run_verifier(suffix_config(6), model=shared_model(), max_draft_nodes=12) as v:
            for _ in range(2):  # the second round also grows trees from the first round's outputs
                responses = await generate_all(v, PROMPTS, LENGTHS)
                check_exact(responses, PROMPTS, LENGTHS)
                await wait_until(lambda: not engine_of(v).drafter._background, "the releases")
            assert branched(responses)
        async with serve_drafter(SuffixDrafter()) as drafter:
            async with run_verifier(remote_config(6, drafter.port), model=shared_model(), max_draft_nodes=12) as v:
                responses = await generate_all(v, PROMPTS, LENGTHS)
                check_exact(responses, PROMPTS, LENGTHS)
                assert branched(responses)
                assert sum(r.output.stats.num_drafter_failures for r in responses) == 0

    asyncio.run(main())


async def _second_verifier_run(scope: str) -> tuple[verifier_pb2.GenerateResponse, SuffixDrafter]:
    """Verifier A runs FRESH_PROMPT to the end; then verifier B, sharing the drafter, runs it again."""
    drafter = SuffixDrafter(cache_scope=scope)
    async with serve_drafter(drafter) as running:
        async with run_verifier(remote_config(8, running.port), model=shared_model()) as a:
            first = await a.stub.Generate(token_request(FRESH_PROMPT, 48), timeout=WAIT_S)
            await wait_until(lambda: not running.servicer.store, "A's release")
        if scope != "request":
            # The whole output, its last step's tokens included (sent before the release).
            [tree] = drafter._global.values()
            assert tree.tokens() == list(first.output.token_ids)
        async with run_verifier(remote_config(8, running.port), model=shared_model()) as b:
            second = await b.stub.Generate(token_request(FRESH_PROMPT, 48), timeout=WAIT_S)
    assert list(first.output.token_ids) == list(second.output.token_ids) == list(cached_reference(
        tuple(FRESH_PROMPT), 48))
    return second, drafter


def test_a_finished_request_on_one_verifier_drafts_for_another() -> None:
    second, drafter = asyncio.run(_second_verifier_run("global"))
    assert drafter.cached_requests == 2  # A's output, then B's
    assert second.output.stats.mean_acceptance_length >= 4.0, second.output.stats


def test_cache_scope_request_learns_nothing_across_requests() -> None:
    second, drafter = asyncio.run(_second_verifier_run("request"))
    assert drafter.cached_requests == 0
    assert second.output.stats.mean_acceptance_length < 2.0, second.output.stats


def test_cache_scope_verifier_keeps_verifiers_apart() -> None:
    second, drafter = asyncio.run(_second_verifier_run("verifier"))
    assert drafter.cached_requests == 2  # each in its own verifier's tree: B never drafts from A's
    assert second.output.stats.mean_acceptance_length < 2.0, second.output.stats


@pytest.mark.parametrize("remote", [True, False], ids=["remote", "in-process"])
def test_a_cache_salt_keeps_what_the_drafter_learns_to_requests_of_that_salt(remote: bool) -> None:
    """The verifier's cache_salt reaches the drafter as an id (a digest, not the salt): a salted output
    drafts for its salt's next request alone, not for another salt's nor an unsalted one."""
    async def run(v, servicer) -> list[verifier_pb2.GenerationOutput]:  # noqa: ANN001
        outputs = []
        for salt in ("tenant-a", "tenant-b", "", "tenant-a"):
            request = token_request(FRESH_PROMPT, 48, cache_salt=salt)
            outputs.append((await v.stub.Generate(request, timeout=WAIT_S)).output)
            await wait_until(lambda: not servicer.store, "the release")
        return outputs

    async def main() -> tuple[list[verifier_pb2.GenerationOutput], SuffixDrafter]:
        if not remote:
            async with run_verifier(suffix_config(8), model=shared_model()) as v:
                servicer = engine_of(v).drafter.transport._servicer
                return await run(v, servicer), servicer.drafter
        drafter = SuffixDrafter()
        async with serve_drafter(drafter) as running:
            async with run_verifier(remote_config(8, running.port), model=shared_model()) as v:
                return await run(v, running.servicer), drafter

    outputs, drafter = asyncio.run(main())
    for out in outputs:
        assert list(out.token_ids) == list(cached_reference(tuple(FRESH_PROMPT), 48))
    assert [o.stats.mean_acceptance_length >= 4.0 for o in outputs] == [False, False, False, True], [
        o.stats for o in outputs]
    scopes = sorted(drafter._global)
    assert len(scopes) == 3 and scopes[0] == "" and all(s.startswith("\0") and len(s) == 33 for s in scopes[1:])
    assert not any("tenant" in s for s in scopes)


def test_behind_two_replicas_the_drafting_replica_learns_every_finished_request() -> None:
    """Issue 12's replicas: the verifier drafts over its stream on one replica, and its final syncs and
    releases go there too, so that replica learns every output it drafted for and drafts it again (the
    other replicas' share of it is off here: the next test has it)."""
    async def main() -> list[verifier_pb2.GenerateResponse]:
        drafters = [SuffixDrafter(), SuffixDrafter()]
        async with serve_drafter(drafters[0]) as a, serve_drafter(drafters[1]) as b:
            async with run_verifier(replicas_config([a.port, b.port], share=False), model=shared_model()) as v:
                runs = []
                for _ in range(3):
                    runs.append(await v.stub.Generate(token_request(FRESH_PROMPT, 48), timeout=WAIT_S))
                    await wait_until(lambda: not a.servicer.store and not b.servicer.store, "the release")
        assert sorted(d.cached_requests for d in drafters) == [0, 3]
        return runs

    runs = asyncio.run(main())
    for run in runs:
        assert list(run.output.token_ids) == list(cached_reference(tuple(FRESH_PROMPT), 48))
    assert runs[0].output.stats.mean_acceptance_length < 2.0, runs[0].output.stats
    assert all(r.output.stats.mean_acceptance_length >= 4.0 for r in runs[1:]), [r.output.stats for r in runs]


@pytest.mark.parametrize("share", [True, False])
def test_every_replica_learns_each_finished_request_once(share: bool) -> None:
    """Two suffix drafter replicas behind one target, as a headless Service's pods: a request finished
    through one of them is learned by both, once each (the one that served it hears of it twice), so a
    verifier that reaches either drafts it again at MAL >= 4; with share_finished off, only the replica
    that served it learns."""
    async def main() -> list[float]:
        drafters = [SuffixDrafter(), SuffixDrafter()]
        async with serve_drafter(drafters[0]) as a, serve_drafter(drafters[1]) as b:
            async with run_verifier(replicas_config([a.port, b.port], share), model=shared_model()) as v:
                client = engine_of(v).drafter
                await run_exact(v, FRESH_PROMPT, 48)
                await wait_until(lambda: not client._background, "the release and the announcement")
                assert client.stats.announced == (2 if share else 0)
            learned = [1, 1] if share else [0, 1]
            await wait_until(lambda: sorted(d.cached_requests for d in drafters) == learned, f"learned {learned}")
            again = []
            for replica in (a, b):  # a verifier that reaches this replica alone
                async with run_verifier(remote_config(8, replica.port), model=shared_model()) as alone:
                    again.append((await run_exact(alone, FRESH_PROMPT, 48)).output.stats.mean_acceptance_length)
            return again

    again = asyncio.run(main())
    assert (min(again) >= 4.0) if share else (max(again) >= 4.0 > min(again)), again


def test_a_replica_that_is_down_misses_the_announcement_and_nothing_else() -> None:
    """One of the two replicas behind the target never answers: the other serves, learns the request once
    and drafts it again; the output stays plain decoding's."""
    async def main() -> float:
        drafter = SuffixDrafter()
        with socket.socket() as gone:  # a port with nothing listening
            gone.bind(("127.0.0.1", 0))
            async with serve_drafter(drafter) as alive:
                ports = [alive.port, gone.getsockname()[1]]
                async with run_verifier(replicas_config(ports), model=shared_model()) as v:
                    client = engine_of(v).drafter
                    await run_exact(v, FRESH_PROMPT, 48)
                    await wait_until(lambda: not client._background, "the release and the announcement")
                    assert client.stats.announced == 1 and drafter.cached_requests == 1
                    return (await run_exact(v, FRESH_PROMPT, 48)).output.stats.mean_acceptance_length

    assert asyncio.run(main()) >= 4.0


def test_cancelled_requests_are_not_learned() -> None:
    async def main() -> None:
        drafter = SuffixDrafter()
        async with serve_drafter(drafter) as running:
            async with run_verifier(remote_config(8, running.port), model=shared_model()) as v:
                call = v.stub.Generate(token_request(FRESH_PROMPT, 200), timeout=WAIT_S)
                await wait_until(lambda: len(running.servicer.store) == 1, "the request at the drafter")
                call.cancel()
                await wait_until(lambda: not running.servicer.store, "the release")
                await v.stub.Generate(token_request(FRESH_PROMPT, 8), timeout=WAIT_S)
                await wait_until(lambda: drafter.cached_requests == 1, "the finished request learned")
        assert drafter.cached_requests == 1  # the finished one only

    asyncio.run(main())


def test_release_reasons_reach_the_drafter() -> None:
    """The verifier says why: FINISHED for a completed request, CANCELLED for one the client dropped."""
    seen: list[drafter_pb2.ReleaseRequestsRequest] = []

    async def main() -> None:
        async with serve_drafter(SuffixDrafter()) as running:
            release = running.servicer.release

            def spy(request: drafter_pb2.ReleaseRequestsRequest, caller: str) -> drafter_pb2.ReleaseRequestsResponse:
                seen.append(request)
                return release(request, caller)

            running.servicer.release = spy
            async with run_verifier(remote_config(4, running.port), model=shared_model()) as v:
                await v.stub.Generate(token_request(FRESH_PROMPT, 8), timeout=WAIT_S)
                await wait_until(lambda: len(seen) == 1, "the release")
                call = v.stub.Generate(token_request(FRESH_PROMPT, 200), timeout=WAIT_S)
                await wait_until(lambda: len(running.servicer.store) == 1, "the request at the drafter")
                call.cancel()
                await wait_until(lambda: len(seen) == 2, "the second release")

    asyncio.run(main())
    assert [list(r.reasons) for r in seen] == [[drafter_pb2.RELEASE_REASON_FINISHED],
                                                [drafter_pb2.RELEASE_REASON_CANCELLED]]


async def run_exact(v, prompt: list[int], n: int) -> verifier_pb2.GenerateResponse:  # noqa: ANN001
    response = await v.stub.Generate(token_request(prompt, n), timeout=WAIT_S)
    assert list(response.output.token_ids) == list(cached_reference(tuple(prompt), n))
    return response


async def until_drafter_back(v, client, prompt: list[int]) -> None:  # noqa: ANN001
    """Run short requests until one is drafted for by a restarted drafter with no call failing (the first
    calls may find the old connection gone, and the breaker closes on the first call answered)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        calls, failures = client.stats.calls, client.stats.failures
        await run_exact(v, prompt, 8)
        if client.healthy and client.stats.calls > calls and client.stats.failures == failures:
            break
    await wait_until(lambda: client.healthy and not client._background, "the drafter back")


def test_a_restarted_suffix_drafter_process_loses_its_cache_and_nothing_else() -> None:
    """`splitspec-drafter suffix` as a real process: it learns a finished request; SIGKILLed in the middle
    of another one and restarted on its port, it has forgotten what it learned, every output stays plain
    decoding's, and it learns again."""
    other = repetitive_prompt(303)

    async def main() -> None:
        with LocalService([script("splitspec-drafter"), "suffix", "--log-level", "WARNING",
                           "--grace-period-s", "0"], name="suffix-drafter") as drafter:
            async with run_verifier(remote_config(8, drafter.port), model=shared_model()) as v:
                client = engine_of(v).drafter
                client.breaker.max_backoff_s = 0.5  # probe the restarted drafter soon (backoff is tested elsewhere)
                await run_exact(v, FRESH_PROMPT, 48)
                await wait_until(lambda: not client._background, "the release")
                assert (await run_exact(v, FRESH_PROMPT, 48)).output.stats.mean_acceptance_length >= 4.0
                middle = asyncio.ensure_future(run_exact(v, other, 150))
                calls = client.stats.calls
                await wait_until(lambda: client.stats.calls > calls + 2, "drafting for the long request", middle)
                drafter.process.kill()  # SIGKILL: no goodbye
                await asyncio.to_thread(drafter.process.wait)
                await asyncio.to_thread(drafter.start)  # the same port, nothing learned
                await middle
                await until_drafter_back(v, client, other)
                failures = client.stats.failures
                after = await run_exact(v, FRESH_PROMPT, 48)
                assert client.stats.failures == failures  # the drafter answered every call ...
                assert after.output.stats.mean_acceptance_length < 2.0, after.output.stats  # ... from an empty cache
                await wait_until(lambda: not client._background, "the release")
                again = await run_exact(v, FRESH_PROMPT, 48)
                assert again.output.stats.mean_acceptance_length >= 4.0, again.output.stats  # and it learns again

    asyncio.run(main())


def test_a_suffix_drafter_process_keeps_what_it_learned_in_its_state_file_across_a_restart(tmp_path) -> None:  # noqa: ANN001
    """With `--learned-state-file`, a `splitspec-drafter suffix` stopped as Kubernetes stops a pod (SIGTERM)
    and started again drafts a request that finished before the restart from that request's first step,
    and every output stays plain decoding's."""
    other = repetitive_prompt(303)

    async def main() -> None:
        with LocalService([script("splitspec-drafter"), "suffix", "--log-level", "WARNING", "--grace-period-s", "0",
                           "--learned-state-file", str(tmp_path / "suffix.state")], name="suffix-drafter") as drafter:
            async with run_verifier(remote_config(8, drafter.port), model=shared_model()) as v:
                client = engine_of(v).drafter
                client.breaker.max_backoff_s = 0.5  # probe the restarted drafter soon (backoff is tested elsewhere)
                first = await run_exact(v, FRESH_PROMPT, 48)
                assert first.output.stats.mean_acceptance_length < 2.0, first.output.stats  # nothing learned yet
                await wait_until(lambda: not client._background, "the release")
                # Sent, not yet answered: the drafter answers its stream in order, so once another request's
                # calls on it are answered, it has learned the first one.
                calls = client.stats.calls
                await run_exact(v, other, 8)
                assert client.stats.calls > calls
                assert await asyncio.to_thread(drafter.stop) == 0  # SIGTERM: drains, saves, exits
                await asyncio.to_thread(drafter.start)  # the same port
                await until_drafter_back(v, client, other)
                failures = client.stats.failures
                after = await run_exact(v, FRESH_PROMPT, 48)
                assert client.stats.failures == failures
                assert after.output.stats.mean_acceptance_length >= 4.0, after.output.stats  # from the saved cache

    asyncio.run(main())
