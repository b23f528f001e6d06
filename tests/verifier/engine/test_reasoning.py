"""Reasoning models (engine/reasoning.py, api/reasoning_split.py): the prompt decides where the output starts,
a structured-output constraint holds the answer after the thinking and never the thinking, speculation
changes no token of either (chains, trees, a drafter that knows the answer), and the text splits into
thinking and answer the same however it is streamed."""

from __future__ import annotations

import asyncio
import copy
import random
import re

import grpc
import pytest
from thinking_model import THINKING_CHAT, thinking_model, thinking_tokenizer
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import OracleDrafter, one_torch_thread, serve_drafter  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2 as pb
from verifier_service.api.reasoning_split import ThoughtSplit, split
from verifier_service.engine.reasoning import PARSERS, Phase, Reasoning, ReasoningUnavailable
from verifier_service.engine.structured_output import Constraint, Grammars, ReasoningGate
from verifier_service.settings import ServerSettings
from verifier_service.spec_decode.config import ConfigError

REGEX = r"(fox|dog)+ [0-9]{3}"
NEW_TOKENS = 40


def reasoning(name: str = "deepseek_r1") -> Reasoning:
    return Reasoning.of(PARSERS[name], thinking_tokenizer())


def chat_ids(**template_kwargs: object) -> list[int]:
    return thinking_tokenizer().apply_chat_template(THINKING_CHAT, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True, **template_kwargs)["input_ids"]


def test_the_prompt_decides_where_the_output_starts_and_the_markers_move_it() -> None:
    r1, qwen3 = reasoning("deepseek_r1"), reasoning("qwen3")
    opened, closed, unmarked = chat_ids(), chat_ids(enable_thinking=False), chat_ids(open_thinking=False)
    for r in (r1, qwen3):
        assert r.phase_after(opened) is Phase.THINKING and r.phase_after(closed) is Phase.ANSWER
    assert r1.phase_after(unmarked) is Phase.THINKING  # R1 may think without writing <think>
    assert qwen3.phase_after(unmarked) is Phase.FIRST
    a, b = 5, 6  # any two tokens but the markers
    turn = thinking_tokenizer().eos_token_id  # a special token: where a chat template's turns meet
    # Only the last turn's markers count: an earlier assistant turn's thinking, sent back, says nothing of this one.
    assert r1.phase_after([a, r1.start_id, b, r1.end_id, turn, a]) is Phase.THINKING
    assert qwen3.phase_after([a, qwen3.start_id, b, qwen3.end_id, turn, a]) is Phase.FIRST
    assert qwen3.phase_after([a, qwen3.end_id, turn, qwen3.start_id, b]) is Phase.THINKING
    s, e = r1.start_id, r1.end_id
    # (phase after, the answer's tokens, the thinking's tokens without the markers)
    assert r1.walk(Phase.THINKING, [a, s, b, e, a, e, b]) == (Phase.ANSWER, [a, e, b], 3)  # a later </think> is text
    assert qwen3.walk(Phase.FIRST, [s, a, e, b]) == (Phase.ANSWER, [b], 1)
    assert qwen3.walk(Phase.FIRST, [a, s]) == (Phase.ANSWER, [a, s], 0)  # no <think> first: all answer
    assert r1.thought_tokens(opened, [a, b, e, a]) == 3


def test_a_parser_needs_its_markers_as_single_tokens_and_a_known_name() -> None:
    with pytest.raises(ReasoningUnavailable, match="no single token for '<think>'"):
        Reasoning.of(PARSERS["qwen3"], tiny_tokenizer())
    special = copy.deepcopy(tiny_tokenizer())
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    with pytest.raises(ReasoningUnavailable, match="marks '<think>' as a special token"):
        Reasoning.of(PARSERS["qwen3"], special)
    with pytest.raises(ConfigError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerSettings(reasoning_parser="r1")

    async def start() -> None:
        async with run_verifier(reasoning_parser="qwen3"):  # the tiny tokenizer has no <think>
            pass

    with pytest.raises(ConfigError, match="--reasoning-parser qwen3: this model's tokenizer has no single token"):
        asyncio.run(start())


def test_the_gate_leaves_thinking_free_and_holds_the_answer() -> None:
    tok, r = thinking_tokenizer(), reasoning("qwen3")
    grammars = Grammars(tok, len(tok), frozenset({tok.eos_token_id}))
    answer_start = grammars.compile(Constraint("regex", REGEX)).allowed_after([])
    gate = ReasoningGate(r, Phase.FIRST, len(tok), grammars.compile(Constraint("regex", REGEX)))
    first = gate.row_masks([], [])[0].numpy()
    assert first[r.start_id] and (first.sum() == answer_start.sum() + 1)  # the answer's start, or <think>
    x = tok("1")["input_ids"][0]  # free in thought; refused right after "fox"
    fox = tok("fox")["input_ids"]
    draft = [r.start_id, x, r.end_id, *fox]
    rows = gate.row_masks(draft, []).numpy()
    assert rows[1].all() and rows[2].all()  # in thought: anything
    assert (rows[3] == answer_start).all()  # after </think>: the answer's start
    assert not rows[3 + len(fox)].all()  # held within the answer
    assert gate.cut(draft + [x], [])[0] == draft  # thought is never cut; the refused answer token is
    gate.commit([r.start_id, x, r.end_id])
    assert (gate.row_masks([], [])[0].numpy() == answer_start).all()


def test_thinking_is_free_the_answer_is_held_and_speculation_changes_no_token() -> None:
    """qwen3 on prompts whose template opened, closed or left out the thinking (the model, which never writes
    <think>, then answers at once); greedy and seeded; plain
    decoding, n-gram chains and trees, and a drafter that knows the answers and errs a third of the time."""
    tok = thinking_tokenizer()
    prompts = {"opened": chat_ids(), "closed": chat_ids(enable_thinking=False),
               "unmarked": chat_ids(open_thinking=False)}
    regex = pb.StructuredOutput(regex=REGEX)
    reqs = [token_request(ids, NEW_TOKENS, structured_output=regex, sampling=sampling)
            for ids in prompts.values()
            for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=3))]
    model = thinking_model()

    async def answers(spec, reqs: list[pb.GenerateRequest], **settings: object) -> list[pb.GenerationOutput]:  # noqa: ANN001
        async with run_verifier(spec, model=model, tokenizer=tok, reasoning_parser="qwen3", **settings) as v:
            return [r.output for r in await asyncio.gather(*(v.stub.Generate(q, timeout=120) for q in reqs))]

    async def main() -> None:
        plain = await answers(spec_config("NONE"), reqs)
        free = await answers(spec_config("NONE"), [token_request(list(q.params.token_ids.ids), NEW_TOKENS)
                                                    for q in reqs[::2]])
        r = reasoning("qwen3")
        for (name, ids), held, unheld in zip(prompts.items(), plain[::2], free):
            thought, answer = split(r, ids, held.text)
            assert re.fullmatch(REGEX, answer), (name, held.text)
            assert held.finish_reason == pb.FINISH_REASON_STOP
            if name != "opened":
                assert thought == "" and r.end_id not in held.token_ids
            else:  # the thinking is the unconstrained model's, up to and with its </think>
                end = list(held.token_ids).index(r.end_id)
                assert end > 3 and list(held.token_ids)[:end + 1] == list(unheld.token_ids)[:end + 1]
                assert thought == tok.decode(held.token_ids[:end])
        for name, spec, settings in (("chains", spec_config("NGRAM", 4), {}),
                                     ("trees", spec_config("NGRAM", 4), {"max_draft_nodes": 8})):
            assert [list(o.token_ids) for o in await answers(spec, reqs, **settings)] == \
                [list(o.token_ids) for o in plain], name
        greedy = [q for q in reqs if not q.params.sampling.temperature]
        references = {tuple(q.params.token_ids.ids): list(o.token_ids) for q, o in zip(reqs, plain)
                      if not q.params.sampling.temperature}
        oracle = OracleDrafter(references, corrupt=0.3, vocab_size=len(tok), cut_ok=True)
        async with serve_drafter(oracle) as drafter:
            told = await answers(spec_config("USER_PROVIDED", 6, f"127.0.0.1:{drafter.port}", deadline_ms=5000),
                                 greedy)
        assert [list(o.token_ids) for o in told] == [references[tuple(q.params.token_ids.ids)] for q in greedy]
        assert sum(o.stats.num_accepted_tokens for o in told) > 0
        assert not [e for e in oracle.feedback_errors if "left the reference" in e]

    asyncio.run(main())


def test_a_thinking_budget_ends_the_thinking_where_it_is_spent_and_speculation_changes_no_token() -> None:
    """vLLM's thinking_token_budget: the first `budget` thinking tokens are the model's own, then `</think>`;
    a budget the thinking stays within changes nothing; with a constraint, the answer after it is held.
    Chains and trees give the same tokens, greedy and seeded; a request it cannot be kept for fails alone."""
    tok, r = thinking_tokenizer(), reasoning("qwen3")
    ids = chat_ids()
    model = thinking_model()
    reqs = [token_request(ids, NEW_TOKENS, thinking_token_budget=budget, sampling=sampling, **constraint)
            for budget in (0, 3, 30)
            for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=5))
            for constraint in ({}, {"structured_output": pb.StructuredOutput(regex=REGEX)})]

    async def answers(spec, reqs: list[pb.GenerateRequest], **settings: object) -> list[pb.GenerationOutput]:  # noqa: ANN001
        async with run_verifier(spec, model=model, tokenizer=tok, reasoning_parser="qwen3", **settings) as v:
            return [r.output for r in await asyncio.gather(*(v.stub.Generate(q, timeout=120) for q in reqs))]

    async def main() -> None:
        plain = await answers(spec_config("NONE"), reqs)
        free = list((await answers(spec_config("NONE"), [token_request(ids, NEW_TOKENS)]))[0].token_ids)
        natural = free.index(r.end_id)  # the model's own thinking, 9 tokens
        for q, out in zip(reqs, plain):
            budget, got = q.params.thinking_token_budget, list(out.token_ids)
            thought = min(budget, natural) if not q.params.sampling.temperature else got.index(r.end_id)
            assert got.index(r.end_id) == thought <= budget
            if not q.params.sampling.temperature:
                assert got[:thought] == free[:thought]
                if budget >= natural and not q.params.HasField("structured_output"):
                    assert got == free  # a budget not reached changes nothing
                if q.params.HasField("structured_output"):
                    assert out.finish_reason == pb.FINISH_REASON_STOP
            if q.params.HasField("structured_output") and out.finish_reason == pb.FINISH_REASON_STOP:
                assert re.fullmatch(REGEX, split(r, ids, out.text)[1]), out.text
        assert [list(o.token_ids) for o in await answers(spec_config("NGRAM", 4), reqs)] == \
            [list(o.token_ids) for o in plain]
        assert [list(o.token_ids) for o in await answers(spec_config("NGRAM", 4), reqs, max_draft_nodes=8)] == \
            [list(o.token_ids) for o in plain]
        async with run_verifier(model=model, tokenizer=tok, reasoning_parser="qwen3") as v:
            for fields, message in (({"sampling": pb.SamplingParams(allowed_token_ids=[5, 6])}, "allowed_token_ids"),
                                    ({"sampling": pb.SamplingParams(bad_words=["a</think>"])}, "bad word")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await v.stub.Generate(token_request(ids, 4, thinking_token_budget=2, **fields), timeout=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
        async with run_verifier() as v:  # no reasoning parser
            with pytest.raises(grpc.aio.AioRpcError, match="needs a verifier started with --reasoning-parser"):
                await v.stub.Generate(token_request([5, 6], 4, thinking_token_budget=2), timeout=60)

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(20))
def test_the_text_splits_the_same_however_it_is_streamed(seed: int) -> None:
    rng = random.Random(seed)
    r = reasoning(rng.choice(["deepseek_r1", "qwen3"]))
    prompt = rng.choice([chat_ids(), chat_ids(enable_thinking=False), chat_ids(open_thinking=False)])
    parts = [rng.choice(["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n", "</thin", "<th"])
             for _ in range(rng.randint(0, 14))]
    text = "".join(parts)
    whole = split(r, prompt, text)
    streaming, thought, answer, i = ThoughtSplit(r, prompt), "", "", 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 4))
        t, a = streaming.feed(text[i:j], final=j == len(text))
        thought, answer, i = thought + t, answer + a, j
    if not text:
        thought, answer = streaming.feed("", final=True)
    assert (thought, answer) == whole
    phase = r.phase_after(prompt)
    if phase is Phase.ANSWER:
        assert whole == ("", text)
    elif "</think>" in text and (phase is Phase.THINKING or text.startswith("<think>")):
        assert "</think>" not in whole[0]
        assert whole[1] == text.split("</think>", 1)[1]
