"""Structured output (engine/structured_output.py): every constraint kind is obeyed, speculation changes
no token (greedy and seeded; chains, trees and a drafter that knows the answer), draft tokens the
constraint refuses are cut before the forward, bad constraints fail alone with INVALID_ARGUMENT, the
servers keep serving while a constraint compiles, and `splitspec generate` asks for each kind."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading

import grpc
import pytest
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    OracleDrafter,
    ScriptedDrafter,
    byte_token_ids,
    one_torch_thread,  # noqa: F401 - autouse fixture
    serve_drafter,
    shared_model,
)

from drafter_sdk.proto import verifier_pb2 as pb
from verifier_service.engine.structured_output import Constraint, Grammars, StructuredOutputUnavailable
from verifier_service.tools import cli

# Compact JSON: llguidance's default allows any whitespace between items, where a random model would wander.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"(fox|dog)+ [0-9]{3}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
CONSTRAINTS = {
    "json_schema": pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "json_object": pb.StructuredOutput(json_object=True),
    "regex": pb.StructuredOutput(regex=REGEX),
    "choice": pb.StructuredOutput(choice=pb.StructuredOutputChoices(choices=CHOICES)),
    "grammar": pb.StructuredOutput(grammar=GRAMMAR),
}
PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Speculative decoding drafts"]
NEW_TOKENS = 48


def obeys(kind: str, text: str) -> bool:
    """The whole answer is what the constraint allows (for an answer that ended by itself)."""
    if kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"name", "n"} and len(value["name"]) <= 6 and value["n"] in range(1000)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text) is not None


def requests() -> list[tuple[str, pb.GenerateRequest]]:
    """Every constraint on every prompt (each prompt naming its constraint, so that no two constraints
    share one), greedy and seeded."""
    tok = tiny_tokenizer()
    out = []
    for kind, constraint in CONSTRAINTS.items():
        for i, prompt in enumerate(PROMPTS):
            ids = tok(f"{prompt} {kind}")["input_ids"]
            for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=7 + i)):
                out.append((kind, token_request(ids, NEW_TOKENS, structured_output=constraint, sampling=sampling)))
    return out


async def answers(spec, reqs: list[pb.GenerateRequest], **settings: object) -> list[pb.GenerationOutput]:  # noqa: ANN001
    """All requests at once, as a batch would run them."""
    async with run_verifier(spec, model=shared_model(), **settings) as v:
        replies = await asyncio.gather(*(v.stub.Generate(r, timeout=120) for r in reqs))
    return [r.output for r in replies]


def test_every_constraint_is_obeyed_and_speculation_changes_no_token() -> None:
    kinds, reqs = zip(*requests())
    tok = tiny_tokenizer()

    async def main() -> None:
        plain = await answers(spec_config("NONE"), list(reqs))
        references = {tuple(r.params.token_ids.ids): list(out.token_ids)
                      for r, out in zip(reqs, plain) if not r.params.sampling.temperature}
        for kind, out in zip(kinds, plain):
            if out.finish_reason == pb.FINISH_REASON_STOP:
                assert obeys(kind, tok.decode(out.token_ids, skip_special_tokens=True)), (kind, out.text)
        assert sum(out.finish_reason == pb.FINISH_REASON_STOP for out in plain) >= len(plain) // 2
        chains = await answers(spec_config("NGRAM", 4), list(reqs))
        trees = await answers(spec_config("NGRAM", 4), list(reqs), max_draft_nodes=8)
        for name, outs in (("chains", chains), ("trees", trees)):
            for kind, got, want in zip(kinds, outs, plain):
                assert list(got.token_ids) == list(want.token_ids), (name, kind)
        assert sum(out.stats.num_accepted_tokens for out in chains) > 0
        assert sum(out.stats.num_draft_nodes for out in trees) > sum(out.stats.num_draft_tokens for out in trees)
        # A drafter that knows the greedy answers (with a third of its tokens wrong) is cut or refused
        # wherever it errs, and what it gets right is accepted. (Its feedback counts what was verified,
        # the draft as cut: not what it proposed, which the oracle checks for.)
        greedy = [(k, r) for k, r in zip(kinds, reqs) if not r.params.sampling.temperature]
        oracle = OracleDrafter({p: references[p] for p in references}, corrupt=0.3)
        async with serve_drafter(oracle) as drafter:
            told = await answers(spec_config("USER_PROVIDED", 6, f"127.0.0.1:{drafter.port}", deadline_ms=5000),
                                 [r for _, r in greedy])
        assert [list(out.token_ids) for out in told] == [references[tuple(r.params.token_ids.ids)] for _, r in greedy]
        assert sum(out.stats.num_accepted_tokens for out in told) > 0
        assert not [e for e in oracle.feedback_errors if "left the reference" in e]
        proposed = sum(len(d) for call in oracle.calls for d in call.drafts)
        assert sum(out.stats.num_draft_tokens for out in told) < proposed

    asyncio.run(main())


def test_refused_draft_tokens_are_cut_before_the_forward() -> None:
    """A drafter proposing only what the constraint refuses gets nothing verified; the answer is unchanged."""
    refused = byte_token_ids("zzzz")
    tok = tiny_tokenizer()
    request = token_request(tok(PROMPTS[0])["input_ids"], NEW_TOKENS, structured_output=CONSTRAINTS["choice"])

    async def main() -> None:
        (plain,) = await answers(spec_config("NONE"), [request])
        drafter = ScriptedDrafter(lambda r: refused)
        async with serve_drafter(drafter) as running:
            (out,) = await answers(spec_config("USER_PROVIDED", 4, f"127.0.0.1:{running.port}", deadline_ms=5000),
                                   [request])
        assert list(out.token_ids) == list(plain.token_ids) and out.text in CHOICES
        assert drafter.calls and out.stats.num_draft_tokens == 0 and out.stats.num_drafter_failures == 0

    asyncio.run(main())


def test_a_tree_is_cut_below_its_refused_nodes_and_each_row_masked_after_its_path() -> None:
    ids = {c: byte_token_ids(c)[0] for c in "abcdx"}
    grammars = Grammars(tiny_tokenizer(), len(tiny_tokenizer()), frozenset({tiny_tokenizer().eos_token_id}))
    grammar = grammars.compile(Constraint("regex", "(ab|ac)d"))
    # a -> b -> d, a -> x (refused) -> d, a -> c
    tokens = [ids["a"], ids["b"], ids["x"], ids["d"], ids["c"], ids["d"]]
    parents = [-1, 0, 0, 2, 0, 1]
    cut_tokens, cut_parents = grammar.cut(tokens, parents)
    assert (cut_tokens, cut_parents) == ([ids["a"], ids["b"], ids["c"], ids["d"]], [-1, 0, 0, 1])
    assert grammar.cut([ids["a"], ids["x"], ids["d"]], []) == ([ids["a"]], [])
    masks = grammar.row_masks(cut_tokens, cut_parents)
    for row, path in enumerate([[], [ids["a"]], [ids["a"], ids["b"]], [ids["a"], ids["c"]],
                                [ids["a"], ids["b"], ids["d"]]]):
        fresh = grammars.compile(Constraint("regex", "(ab|ac)d"))
        fresh.commit(path)
        assert masks[row].tolist() == fresh.row_masks([], [])[0].tolist(), row
    assert masks[2].nonzero().flatten().tolist() == [ids["d"]]  # after "ab": only "d"
    assert masks[4].nonzero().flatten().tolist() == [tiny_tokenizer().eos_token_id]  # complete: only the end


def test_a_tokenizer_llguidance_cannot_read_makes_structured_output_unavailable() -> None:
    not_fast = object()  # llguidance reads only fast (Rust-backed) tokenizers
    with pytest.raises(StructuredOutputUnavailable, match="not available for this model's tokenizer"):
        Grammars(not_fast, 400, frozenset()).compile(Constraint("regex", "a"))


@pytest.mark.parametrize(("constraint", "stopping", "words"), [
    (pb.StructuredOutput(json_schema='{"type": "nonsense"}'), {}, "structured_output.json_schema: "),
    (pb.StructuredOutput(json_schema="{"), {}, "json_schema is not valid JSON"),
    (pb.StructuredOutput(regex="(unclosed"), {}, "structured_output.regex: "),
    (pb.StructuredOutput(regex=""), {}, "structured_output.regex is empty"),
    (pb.StructuredOutput(json_object=False), {}, "json_object must be true"),
    (pb.StructuredOutput(choice=pb.StructuredOutputChoices(choices=["a", ""])), {}, "none of them empty"),
    (pb.StructuredOutput(grammar="start: missing"), {}, "structured_output.grammar: "),
    (pb.StructuredOutput(), {}, "set one of json_schema"),
    (pb.StructuredOutput(regex="a+"), {"ignore_eos": True}, "cannot be combined with ignore_eos"),
    (pb.StructuredOutput(regex="a+"), {"min_new_tokens": 2}, "or min_new_tokens"),
])
def test_a_bad_constraint_fails_alone(constraint: pb.StructuredOutput, stopping: dict, words: str) -> None:
    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            request = token_request([5, 6, 7], 8, structured_output=constraint)
            request.params.stopping.MergeFrom(pb.StoppingCriteria(max_new_tokens=8, **stopping))
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await v.stub.Generate(request, timeout=30)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in bad.value.details()
            ok = await v.stub.Generate(token_request([5, 6, 7], 8, structured_output=CONSTRAINTS["choice"]),
                                       timeout=30)
            assert ok.output.text in CHOICES

    asyncio.run(main())


def test_splitspec_generate_asks_for_a_structured_answer(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    parser = argparse.ArgumentParser()
    cli.add_generate(parser.add_subparsers())

    async def main() -> list[tuple[int, str]]:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            runs = []
            for flags in (["--json-schema", str(schema)], ["--regex", REGEX], ["--choice", "yes", "--choice", "no"]):
                args = parser.parse_args(["generate", PROMPTS[0], "--raw", "--max-new-tokens", str(NEW_TOKENS),
                                          "--target", v.address, *flags])
                code = await asyncio.to_thread(args.func, args)  # the client blocks: off the server's loop
                runs.append((code, capsys.readouterr().out.strip()))
            return runs

    (c1, as_json), (c2, as_regex), (c3, as_choice) = asyncio.run(main())
    assert c1 == c2 == c3 == 0
    assert obeys("json_schema", as_json) and re.fullmatch(REGEX, as_regex) and as_choice in ("yes", "no")
    with pytest.raises(SystemExit):  # one kind at a time
        parser.parse_args(["generate", "x", "--json", "--regex", "a"])


def test_the_servers_keep_serving_while_a_constraint_compiles() -> None:
    """A constraint compiles on a worker thread: while one is held mid-compile, another request is
    served from start to end, and the held one then runs as usual."""
    release = threading.Event()

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            grammars = v.running.runtime.grammars
            compile_now = grammars.compile

            def held(constraint: Constraint):  # noqa: ANN202
                assert release.wait(60), "never released"
                return compile_now(constraint)

            grammars.compile = held
            structured = asyncio.ensure_future(v.stub.Generate(
                token_request([5, 6, 7], 8, structured_output=CONSTRAINTS["choice"]), timeout=60))
            free = await v.stub.Generate(token_request([5, 6, 7], 8), timeout=60)
            assert len(free.output.token_ids) == 8 and not structured.done()
            release.set()
            assert (await structured).output.text in CHOICES

    asyncio.run(main())
