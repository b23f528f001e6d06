"""`splitspec generate`: each flag becomes the GenerationParams field it names, so the command's answer is a
Generate call's with those fields; a number the field cannot hold, or a file that cannot be read, is the command
line's error, and a value the verifier refuses is printed as its status, with exit code 1."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from verifier_harness import run_verifier, spec_config
from verifier_support import one_torch_thread, shared_model  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2 as pb
from verifier_service.tools import cli

PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox"


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_generate(parser.add_subparsers())
    return parser.parse_args(["generate", PROMPT, *flags])


def test_each_flag_sets_the_field_it_names() -> None:
    args = parse("--raw", "--max-new-tokens", "12", "--min-new-tokens", "2", "--stop", "fox", "--stop-token-id", "7",
                 "--stop-token-id", "9", "--ignore-eos", "--bad-word", "lazy dog", "--bad-word", "quick",
                 "--truncate-prompt-tokens", "-1", "--max-draft-len", "2", "--temperature", "0.5", "--top-p", "0.9",
                 "--seed", "3")
    expected = pb.GenerationParams(
        prompt=PROMPT,
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, seed=3, bad_words=["lazy dog", "quick"]),
        stopping=pb.StoppingCriteria(max_new_tokens=12, min_new_tokens=2, stop=["fox"], stop_token_ids=[7, 9],
                                     ignore_eos=True),
        speculation=pb.SpeculationOverrides(max_draft_len=2),
        truncate_prompt_tokens=-1)
    assert cli.build_params(args) == expected
    # Left out, none of them is sent: the verifier's defaults hold.
    plain = cli.build_params(parse("--raw"))
    assert not plain.HasField("truncate_prompt_tokens") and not plain.speculation.HasField("max_draft_len")
    assert not plain.sampling.bad_words and not plain.stopping.stop_token_ids and not plain.stopping.ignore_eos
    # The model's generation config (or greedy) and the server's default length apply.
    assert not any(plain.sampling.HasField(name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                              "repetition_penalty"))
    assert not plain.stopping.HasField("max_new_tokens")


def test_a_prediction_file_is_sent_as_the_prediction(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    predicted = tmp_path / "predicted.txt"
    predicted.write_text("the lazy dog and the quick brown fox\n")
    assert cli.build_params(parse("--prediction", str(predicted))).prediction == predicted.read_text()
    assert not cli.build_params(parse()).prediction
    for flag in ("--prediction", "--json-schema"):  # a file that is not there: the command line's error
        args = parse(flag, str(tmp_path / "missing"))
        assert args.func(args) == 2 and "No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key"])
def test_a_client_certificate_without_its_key_or_a_key_alone_is_the_command_lines_error(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(flag, "client.pem", "--target", "127.0.0.1:1")  # refused before any connection is tried
    assert args.func(args) == 2
    assert capsys.readouterr().err == "splitspec: --tls-cert and --tls-key go together\n"


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--max-draft-len", "-1", "must be within [0, 4294967295], not -1"),
    ("--max-new-tokens", "-1", "must be within [0, 4294967295], not -1"),
    ("--min-new-tokens", "2.5", "not a whole number: '2.5'"),
    ("--stop-token-id", "-3", "must be within [0, 2147483647], not -3"),
    ("--truncate-prompt-tokens", str(2**31), "must be within [-2147483648, 2147483647], not 2147483648"),
    ("--top-k", str(2**40), "must be within [-2147483648, 2147483647]"),
    ("--seed", "-1", "must be within [0, 18446744073709551615], not -1"),
    # gRPC would read an explicit 0 as no filtering, not as the narrowest nucleus.
    ("--top-p", "0", "must be within (0, 1] (1 = no filtering), not 0"),
    ("--top-p", "1.5", "must be within (0, 1] (1 = no filtering), not 1.5"),
    ("--top-p", "half", "not a number: 'half'"),
])
def test_a_number_its_field_cannot_hold_is_the_command_lines_error(flag: str, value: str, words: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(flag, value)
    assert exited.value.code == 2 and f"argument {flag}: {words}" in capsys.readouterr().err


def test_the_answer_is_generates_and_a_refused_value_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--raw", "--max-new-tokens", "10", "--truncate-prompt-tokens", "6", "--bad-word", "quick",
             "--max-draft-len", "2", "--ignore-eos"]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model()) as v:
            args = parse(*flags, "--target", v.address)
            assert await asyncio.to_thread(args.func, args) == 0  # the client blocks: off the server's loop
            printed = capsys.readouterr()
            asked = await v.stub.Generate(pb.GenerateRequest(params=cli.build_params(args)), timeout=60)
            assert printed.out == asked.output.text + "\n"
            assert asked.output.prompt_tokens == 6  # the prompt cut to its last 6 tokens
            # At most 2 draft tokens a step: acceptance is counted at two positions at most.
            per_position = json.loads(printed.err.split("per_position=")[1].rstrip().removesuffix("]"))
            assert 1 <= len(per_position) <= 2 and asked.output.stats.num_drafts
            refused = parse("--raw", "--truncate-prompt-tokens", "0", "--target", v.address)
            assert await asyncio.to_thread(refused.func, refused) == 1
            assert "INVALID_ARGUMENT" in capsys.readouterr().err

    asyncio.run(main())
