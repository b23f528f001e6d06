"""Logit bias, allowed token ids, bad words, the stops held until min_new_tokens, and the frequency,
presence and repetition penalties: each verify row is processed with its own prefix (a chain's draft prefix,
a tree node's path), so speculation stays exact: greedy and seeded outputs equal plain decoding's
with the same settings, and transformers' generate() with its repetition penalty and suppressed
tokens. (min_p: test_verifier_sampling;
min_new_tokens end to end: test_verifier_stopping.)"""

from __future__ import annotations

import asyncio
import collections
import functools
import random

import grpc
import httpx
import pytest
import torch
from test_tree_verification import TreeOracle
from tiny_model import tiny_tokenizer
from transformers import RepetitionPenaltyLogitsProcessor
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    OracleDrafter,
    engine_of,
    in_process_drafter,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    serve_drafter,
    shared_model,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.engine.logits_processors import cut_banned, process_logits
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.sampler import SamplingParams, VerifyRow

PENALTIES = {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.3}
PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:8]]
N = 24


def expected_row(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> torch.Tensor:
    """One position's processed logits, from the definitions: the bias, then transformers' repetition
    penalty over everything before it, then OpenAI's frequency and presence penalties over the
    generated tokens."""
    logits = logits.clone()
    for token, bias in p.logit_bias:
        logits[token] += bias
    x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + generated]), logits[None])[0]
    for token in set(generated):
        x[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return x


def test_each_row_is_penalised_with_its_own_prefix() -> None:
    rng = random.Random(0)
    vocab = 40
    p = SamplingParams(**PENALTIES, logit_bias=((3, -2.5), (8, 4.0)))
    prompt, output = [rng.randrange(vocab) for _ in range(12)], [rng.randrange(vocab) for _ in range(9)]
    chain = [3, 3, 7, 1]
    tree, parents = [5, 3, 5, 5, 9], [-1, -1, 0, 1, 2]  # paths: 5 | 3 | 5 5 | 3 5 | 5 5 9
    plain = VerifyRow([], SamplingParams(), None)  # no penalty: its rows stay as they are
    rows = [VerifyRow(chain, p, None, [], prompt, output), plain,
            VerifyRow(tree, p, None, parents, prompt, output), VerifyRow([], p, None, [], prompt, [])]
    logits = torch.randn(len(chain) + 1 + 1 + len(tree) + 1 + 1, vocab, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = process_logits(logits, rows)
    assert torch.equal(logits, before), "the raw logits stay for the log-probabilities"
    want = [expected_row(logits[j], prompt, output + chain[:j], p) for j in range(len(chain) + 1)]
    want.append(logits[5])
    paths = [[], [5], [3], [5, 5], [3, 5], [5, 5, 9]]
    want += [expected_row(logits[6 + r], prompt, output + path, p) for r, path in enumerate(paths)]
    want.append(expected_row(logits[12], prompt, [], p))  # a prompt's first token: repetition only
    assert torch.allclose(out, torch.stack(want), atol=1e-6)
    # bfloat16 logits (CUDA) are processed in float32 and written back.
    assert torch.allclose(process_logits(logits.bfloat16(), rows).float(), out, rtol=1e-2, atol=1e-2)
    assert process_logits(logits, [plain] * len(logits)) is logits


def test_state_kept_between_steps_gives_the_bits_of_a_fresh_one() -> None:
    """A sequence's LogitsState grows with its output, step by step (new tokens, some never seen before;
    chains and trees of drafts): every step's rows equal those built from scratch, bit for bit, and the
    seen tokens are the prompt's and the output's."""
    rng = random.Random(3)
    vocab = 300
    p = SamplingParams(**PENALTIES, logit_bias=((3, -2.5),), allowed_token_ids=tuple(range(0, vocab, 2)))
    prompt, output, state = [rng.randrange(100) for _ in range(30)], [], LogitsState()
    for step in range(12):
        output += [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]  # what the last step committed
        if step % 2:
            draft, parents = [rng.randrange(vocab) for _ in range(5)], [-1, 0, 0, 2, -1]
        else:
            draft, parents = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))], []
        logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(step))
        kept = process_logits(logits, [VerifyRow(draft, p, None, parents, prompt, list(output), state=state)])
        fresh = process_logits(logits, [VerifyRow(draft, p, None, parents, prompt, list(output))])
        assert torch.equal(kept, fresh), step
    seen, counts = state.penalty_view(prompt, output, vocab, torch.device("cpu"))
    assert sorted(seen.tolist()) == sorted({*prompt, *output}) and len(seen) == len(set(seen.tolist()))
    assert counts.tolist() == [output.count(t) for t in range(vocab)]


def test_drafts_lose_the_tokens_allowed_ids_and_bad_words_ban() -> None:
    """What process_logits would mask is cut from the draft before the forward: a chain at its first banned
    token, a tree without its banned nodes and all below them; a bad word is banned only where the tokens
    before it (the output's last ones, then the draft's path) spell the rest of it."""
    state = LogitsState()
    allowed = SamplingParams(allowed_token_ids=(1, 2, 3, 4))
    assert cut_banned([1, 2, 9, 3], [], allowed, [7], state) == ([1, 2], [])
    assert cut_banned([1, 9, 2, 3, 9], [-1, -1, 0, 2, 3], allowed, [7], state) == ([1, 2, 3], [-1, 0, 1])
    words = SamplingParams(bad_words=((5, 6), (8,)))
    assert cut_banned([5, 6, 1], [], words, [], LogitsState()) == ([5], [])
    assert cut_banned([6, 1, 8], [], words, [5], LogitsState()) == ([], [])  # the output ends with 5
    assert cut_banned([6, 1], [], words, [4], LogitsState()) == ([6, 1], [])
    # tree: 5 -> 6 (banned), 5 -> 7 -> 6 (fine), 6 at the root (fine: nothing before it here)
    assert cut_banned([5, 6, 7, 6, 6], [-1, 0, 0, 2, -1], words, [], LogitsState()) == (
        [5, 7, 6, 6], [-1, 0, 1, -1])
    free = SamplingParams()
    assert cut_banned([9, 9], [], free, [], LogitsState()) == ([9, 9], [])


def generate_all(v, prompts, fields) -> asyncio.Future:  # noqa: ANN001
    return run_together(v, [functools.partial(v.stub.Generate, token_request(p, N, **fields), timeout=WAIT_S)
                            for p in prompts])


async def through_oracle_chains(outputs: list[list[int]], sampling: verifier_pb2.SamplingParams, seed: int) -> list:
    """Every prompt again with an oracle drafter of `outputs`, corrupted, so that every draft position
    is accepted somewhere and rejected somewhere; checks the verifier's feedback to it."""
    bans = bool(sampling.allowed_token_ids or sampling.bad_words)  # refused draft tokens are cut
    oracle = OracleDrafter({tuple(p): out for p, out in zip(PROMPTS, outputs)}, corrupt=0.2, seed=seed, cut_ok=bans)
    async with serve_drafter(oracle) as drafter:
        spec = spec_config("USER_PROVIDED", 5, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
        async with run_verifier(spec, model=shared_model()) as v:
            responses = await generate_all(v, PROMPTS, {"sampling": sampling})
    assert not oracle.feedback_errors, oracle.feedback_errors[:3]
    assert set(oracle.accepted_at) == set(range(5)) and len(oracle.rejected_at) > 0
    if sampling.allowed_token_ids:  # most wrong tokens are outside the set: those drafts were verified in part
        assert oracle.cuts > 0
    return responses


async def same_through_chains_and_trees(plain: list[list[int]], sampling: verifier_pb2.SamplingParams,
                                        seed: int) -> None:
    """Greedy `plain` again, drafted by oracle chains that err, then by oracle token trees whose correct
    path is not always the first branch: the same tokens each time."""
    chained = await through_oracle_chains(plain, sampling, seed=seed)
    assert [list(r.output.token_ids) for r in chained] == plain
    trees = TreeOracle({tuple(p): out for p, out in zip(PROMPTS, plain)}, ("path", "deep", "all-wrong"), seed=seed)
    async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_draft_nodes=10) as v:
        engine = engine_of(v)
        in_process_drafter(engine, trees)
        await engine.drafter.connect()
        treed = await generate_all(v, PROMPTS, {"sampling": sampling})
    assert [list(r.output.token_ids) for r in treed] == plain
    assert trees.trees > 0 and sum(r.output.stats.num_accepted_tokens for r in treed) > 0


def test_greedy_with_penalties_and_a_bias_is_exact_with_chains_and_trees() -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            unprocessed = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {})]
            banned = collections.Counter(t for out in unprocessed for t in out).most_common(1)[0][0]
            sampling = verifier_pb2.SamplingParams(**PENALTIES, logit_bias={banned: -100.0})
            plain = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {"sampling": sampling})]
        assert plain != unprocessed, "the penalties changed nothing: the test would prove nothing"
        assert all(banned not in out for out in plain)
        await same_through_chains_and_trees(plain, sampling, seed=5)

    asyncio.run(main())


def test_allowed_token_ids_equal_transformers_generate_and_hold_against_wrong_drafts() -> None:
    """vLLM's allowed_token_ids: greedy output is transformers' with every other token suppressed, and
    drafts that know that output but err (often with a token outside the set), chains and trees,
    change none of it; seeded sampling keeps to the set too."""
    model = shared_model()

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=model) as v:
            free = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {})]
            allowed = sorted({t for out in free for t in out})[::2]  # half of what they would write
            sampling = verifier_pb2.SamplingParams(allowed_token_ids=allowed)
            plain = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {"sampling": sampling})]
            sampled = await generate_all(v, PROMPTS[:3], {"sampling": verifier_pb2.SamplingParams(
                allowed_token_ids=allowed, temperature=1.0, seed=3)})
        assert plain != free and all(set(out) <= set(allowed) for out in plain)
        assert all(set(r.output.token_ids) <= set(allowed) for r in sampled)
        suppressed = sorted(set(range(model.config.vocab_size)) - set(allowed))
        for prompt, got in zip(PROMPTS, plain):
            x = torch.tensor([prompt])
            assert got == model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                                         suppress_tokens=suppressed)[0, len(prompt):].tolist()
        await same_through_chains_and_trees(plain, sampling, seed=11)

    asyncio.run(main())


def test_bad_words_are_never_generated_and_hold_against_wrong_drafts() -> None:
    """vLLM's bad_words: words the free outputs write (two tokens each, and their form after a space) never
    appear in what is generated with them banned, and drafts that know that output but err, chains and
    trees, change none of it."""
    tok = tiny_tokenizer()

    def two_token_words(outputs: list[list[int]]) -> list[str]:
        words = []
        for out in outputs:
            for pair in zip(out, out[1:]):
                text = tok.decode(list(pair))
                if text == text.strip() and "\ufffd" not in text and tuple(tok(text, add_special_tokens=False)[
                        "input_ids"]) == pair and text not in words:
                    words.append(text)
        return words[:3]

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            free = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {})]
            words = two_token_words(free)
            sampling = verifier_pb2.SamplingParams(bad_words=words)
            plain = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {"sampling": sampling})]
        assert len(words) == 3 and plain != free
        forms = [tok(w, add_special_tokens=False)["input_ids"] for w in words]
        forms += [ids for w in words if len(ids := tok(" " + w, add_special_tokens=False)["input_ids"]) == 2]
        assert all(out[i:i + len(f)] != f for out in plain for f in forms for i in range(len(out)))
        await same_through_chains_and_trees(plain, sampling, seed=13)

    asyncio.run(main())


def test_repetition_penalty_equals_transformers_generate() -> None:
    model = shared_model()

    async def main() -> list[list[int]]:
        async with run_verifier(spec_config("NGRAM", 4), model=model) as v:
            responses = await generate_all(v, PROMPTS[:4], {"sampling": verifier_pb2.SamplingParams(
                repetition_penalty=1.5)})
        return [list(r.output.token_ids) for r in responses]

    for prompt, got in zip(PROMPTS[:4], asyncio.run(main())):
        x = torch.tensor([prompt])
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                              repetition_penalty=1.5)[0, len(prompt):].tolist()
        assert got == want


def test_a_seed_with_penalties_gives_the_same_output_with_and_without_speculation() -> None:
    sampling = verifier_pb2.SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=7, **PENALTIES)

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            plain = [list(r.output.token_ids) for r in await generate_all(v, PROMPTS, {"sampling": sampling})]
        # Drafts of the sampled output: with the seed's draws, exactly their matching prefixes pass.
        speculated = await through_oracle_chains(plain, sampling, seed=9)
        assert [list(r.output.token_ids) for r in speculated] == plain

    asyncio.run(main())


@pytest.mark.parametrize(("field", "value", "words"), [
    ("frequency_penalty", 2.5, "frequency_penalty must be within [-2, 2]"),
    ("presence_penalty", -3.0, "presence_penalty must be within [-2, 2]"),
    ("presence_penalty", float("nan"), "presence_penalty must be a finite number"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("min_p", 1.5, "min_p must be within [0, 1]"),
    ("logit_bias", {5: 101.0}, "logit_bias must be within [-100, 100], not 101 (token 5)"),
    ("logit_bias", {100000: 1.0}, "logit_bias: token id 100000 is outside the vocabulary"),
    ("allowed_token_ids", [5, 100000], "allowed_token_ids: token id 100000 is outside the vocabulary"),
    ("bad_words", ["a", " "], "bad_words must not be empty or only spaces"),
    ("bad_words", ["a"] * 129, "at most 128 bad_words, got 129"),
])
def test_bad_settings_fail_alone_over_grpc_and_http(field: str, value: object, words: str) -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await v.stub.Generate(token_request([5, 6], 2, sampling=verifier_pb2.SamplingParams(**{field: value})),
                                      timeout=WAIT_S)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in bad.value.details()
            # A bad request fails alone: the server answers the next one.
            assert len((await v.stub.Generate(token_request([5, 6], 2), timeout=WAIT_S)).output.token_ids) == 2
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{v.running.http_port}", timeout=WAIT_S) as h:
                if value == value:  # NaN is not JSON: the HTTP front's own check (tested there) refuses it
                    r = await h.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, field: value})
                    assert r.status_code == 400 and words in r.json()["error"]["message"]
                # The same penalties through HTTP are the same request as through gRPC.
                r = await h.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, **PENALTIES,
                                                          "logit_bias": {"7": 3.0}})
                grpc_reply = await v.stub.Generate(token_request(PROMPTS[0], 8, sampling=verifier_pb2.SamplingParams(
                    **PENALTIES, logit_bias={7: 3.0})), timeout=WAIT_S)
                assert r.json()["choices"][0]["splitspec"]["token_ids"] == list(grpc_reply.output.token_ids)

    asyncio.run(main())


def test_stops_are_held_at_every_position_short_of_the_minimum() -> None:
    """min_new_tokens: a row whose position lies fewer tokens past the committed ones than the
    sequence still lacks cannot end it; the rows at or past the minimum are left as they are."""
    vocab = 12
    tree, parents = [5, 3, 5, 9], [-1, -1, 0, 2]  # depths 1, 1, 2, 3
    rows = [VerifyRow([4, 5, 6], SamplingParams(), None, [], [1], [2, 3], held_for=2, held=(0, 7)),
            VerifyRow(tree, SamplingParams(), None, parents, [1], [2], held_for=2, held=(7,))]
    logits = torch.randn(4 + 5, vocab, generator=torch.Generator().manual_seed(2))
    out = process_logits(logits, rows)
    held = {0: (0, 7), 1: (0, 7), 4: (7,), 5: (7,), 6: (7,)}  # chain rows at depth 0-1; the tree's root, depth-1 nodes
    for r in range(len(logits)):
        want = logits[r].clone()
        want[list(held.get(r, ()))] = -torch.inf
        assert torch.equal(out[r], want), r
