"""Client mistakes get the right status and a message a person can act on; the server keeps serving.

One verifier (in-process, real gRPC) takes every bad request, over both Generate and
GenerateStream; afterwards it still answers health SERVING, holds no KV, and decodes a
normal request exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import socket
import subprocess
import textwrap

import grpc
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_support import VerifierThread, idle, reference
from tiny_model import tiny_model, tiny_tokenizer
from transformers import PreTrainedTokenizerFast
from verifier_harness import spec_config, token_request

from drafter_sdk.errors import ListenError
from drafter_sdk.loading import causal_lm
from drafter_sdk.proto import verifier_pb2 as pb
from drafter_sdk.proto import verifier_pb2_grpc
from verifier_service.api import cli, vllm_flags
from verifier_service.api.server import start_server
from verifier_service.settings import ServerSettings
from verifier_service.tools.local_services import script

pytestmark = pytest.mark.timeout(120)

VOCAB = len(tiny_tokenizer())
MAX_MODEL_LEN = 256
MAX_MESSAGE_BYTES = 1 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def req(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(params=pb.GenerationParams(**fields))


def tokens(ids: list[int], max_new_tokens: int = 4, **fields: object) -> pb.GenerateRequest:
    return token_request(ids, max_new_tokens, **fields)


def sampled(**sampling: object) -> pb.GenerateRequest:
    return tokens([5, 6, 7], sampling=pb.SamplingParams(**sampling))


def stopping(**criteria: object) -> pb.GenerateRequest:
    return req(token_ids=pb.TokenIds(ids=[5, 6, 7]), stopping=pb.StoppingCriteria(**criteria))


def chat(*messages: tuple[str, str]) -> pb.GenerateRequest:
    return req(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))


# (case, request, expected status, words the message must contain)
CASES = [
    ("no input", req(), INVALID, "prompt, chat or token_ids"),
    ("empty prompt", req(prompt=""), INVALID, "prompt is empty"),
    ("empty token_ids", req(token_ids=pb.TokenIds()), INVALID, "token_ids is empty"),
    ("empty chat", req(chat=pb.ChatMessages()), INVALID, "no messages"),
    ("unknown chat role", chat(("wizard", "hi")), INVALID, "role 'wizard'"),
    ("prompt beyond the context", tokens([5] * MAX_MODEL_LEN), INVALID, f"context is {MAX_MODEL_LEN} tokens"),
    ("prompt text far beyond the context", req(prompt="lorem ipsum " * 40_000), INVALID, "characters"),
    ("truncate_prompt_tokens 0", tokens([5, 6], truncate_prompt_tokens=0), INVALID, "truncate_prompt_tokens must be"),
    ("truncate_prompt_tokens below -1", tokens([5, 6], truncate_prompt_tokens=-2), INVALID, "at least 1, not -2"),
    ("truncated prompt still beyond the context", tokens([5] * 300, truncate_prompt_tokens=MAX_MODEL_LEN), INVALID,
     f"context is {MAX_MODEL_LEN} tokens"),
    ("no room for max_new_tokens after -1", tokens([5] * 300, MAX_MODEL_LEN, truncate_prompt_tokens=-1), INVALID,
     "at most 255 new tokens fit"),
    ("token id past the vocabulary", tokens([5, VOCAB]), INVALID, f"token id {VOCAB} is outside"),
    ("negative token id", tokens([5, -3]), INVALID, "token id -3 is outside"),
    ("NaN temperature", sampled(temperature=math.nan), INVALID, "temperature must be a finite number"),
    ("infinite temperature", sampled(temperature=math.inf), INVALID, "temperature must be a finite number"),
    ("negative temperature", sampled(temperature=-0.5), INVALID, "temperature must be within"),
    ("absurd temperature", sampled(temperature=1e30), INVALID, "temperature must be within"),
    ("NaN top_p", sampled(temperature=1.0, top_p=math.nan), INVALID, "top_p must be a finite number"),
    ("negative top_p", sampled(temperature=1.0, top_p=-0.1), INVALID, "top_p must be within"),
    ("top_p above 1", sampled(temperature=1.0, top_p=1.5), INVALID, "top_p must be within"),
    ("negative top_k", sampled(temperature=1.0, top_k=-1), INVALID, "top_k must be >= 0"),
    ("max_new_tokens 0", stopping(max_new_tokens=0), INVALID, "max_new_tokens must be >= 1"),
    ("max_new_tokens enormous", stopping(max_new_tokens=2**32 - 1), INVALID, "new tokens fit"),
    ("empty stop string", stopping(stop=["ok", ""]), INVALID, "stop strings must not be empty"),
    ("overlong stop string", stopping(stop=["x" * 513]), INVALID, "at most 512 characters"),
    ("too many stop strings", stopping(stop=[f"s{i}" for i in range(33)]), INVALID, "at most 32 stop strings"),
    ("stop token id past the vocabulary", stopping(stop_token_ids=[VOCAB + 1]), INVALID, "stop token id"),
    ("too many stop token ids", stopping(stop_token_ids=list(range(1025))), INVALID, "at most 1024 stop token ids"),
    ("overlong request_id", tokens([5, 6], request_id="r" * 300), INVALID, "request_id is longer"),
    ("message over the size limit", req(prompt="x" * (MAX_MESSAGE_BYTES + 10)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


@pytest.fixture(scope="module")
def verifier():
    # A drafter in the loop too (n-gram, in-process): bad input must never reach it.
    with VerifierThread(spec_config("NGRAM", 4), max_model_len=MAX_MODEL_LEN,
                        max_message_bytes=MAX_MESSAGE_BYTES) as v:
        yield v


def stream_request(request: pb.GenerateRequest) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest.FromString(request.SerializeToString())  # same fields, same numbers


def call(stub: verifier_pb2_grpc.VerifierServiceStub, request: pb.GenerateRequest, stream: bool) -> object:
    if stream:
        return list(stub.GenerateStream(stream_request(request), timeout=60))
    return stub.Generate(request, timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["Generate", "GenerateStream"])
def test_bad_requests_get_the_right_status_and_an_actionable_message(verifier, stream):
    with grpc.insecure_channel(verifier.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        wrong = []
        for name, request, code, words in CASES:
            with pytest.raises(grpc.RpcError) as info:
                call(stub, request, stream)
            if info.value.code() != code or words not in info.value.details():
                wrong.append(f"{name}: {info.value.code().name}: {info.value.details()}")
        assert not wrong, "\n".join(wrong)
        # Still serving, nothing held, and a good request is decoded exactly.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        good = stub.Generate(tokens([5, 6, 7], 16), timeout=60)
        assert list(good.output.token_ids) == list(reference((5, 6, 7), 16))
    assert set(verifier.on_loop(idle).values()) == {0}


def test_undecodable_bytes_are_invalid_argument_not_unknown(verifier):
    with grpc.insecure_channel(verifier.address) as channel:
        for method in ("Generate", "GenerateStream"):
            path = f"/splitspec.v1.VerifierService/{method}"
            # params.prompt with invalid UTF-8; a bad tag; a length past the end
            for raw in (b"\x0a\x04\x12\x02\xff\xfe", b"\xff\xff\xff\xff", b"\x0a\x05\x0a\x09"):
                rpc = channel.unary_stream(path) if method == "GenerateStream" else channel.unary_unary(path)
                with pytest.raises(grpc.RpcError) as info:
                    result = rpc(raw, timeout=30)
                    if method == "GenerateStream":
                        list(result)
                assert info.value.code() == INVALID, (method, raw, info.value.details())
                assert "not a valid protobuf message" in info.value.details()


def test_odd_but_valid_sampling_parameters_are_served(verifier):
    """Edge values that are legal must not be refused, nor break the step for everyone else."""
    with grpc.insecure_channel(verifier.address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        # A temperature so small that logits / temperature would overflow: greedy, as in vLLM.
        tiny = stub.Generate(sampled(temperature=1e-30), timeout=60)
        assert list(tiny.output.token_ids) == list(reference((5, 6, 7), 4))
        for params in ({"temperature": 100.0, "seed": 2**64 - 1}, {"temperature": 0.7, "top_k": 2**31 - 1},
                       {"temperature": 1.0, "top_p": 1e-30, "seed": 0}):
            reply = stub.Generate(sampled(**params), timeout=60)
            assert len(reply.output.token_ids) == 4 and reply.output.finish_reason == pb.FINISH_REASON_LENGTH, params
        spec = stub.Generate(tokens([5, 6, 7], 8, speculation=pb.SpeculationOverrides(max_draft_len=2**32 - 1)),
                             timeout=60)
        assert list(spec.output.token_ids) == list(reference((5, 6, 7), 8))
        # A prompt longer than the context, cut to its last tokens: the answer those get alone.
        cut = stub.Generate(tokens([9] * 400 + [5, 6, 7], 8, truncate_prompt_tokens=3), timeout=60)
        assert list(cut.output.token_ids) == list(reference((5, 6, 7), 8)) and cut.output.prompt_tokens == 3
        fit = stub.Generate(tokens([9] * 400 + [5, 6, 7], 8, truncate_prompt_tokens=-1), timeout=60)
        assert fit.output.prompt_tokens == MAX_MODEL_LEN - 8 and len(fit.output.token_ids) == 8


def test_chat_without_a_chat_template_is_failed_precondition():
    plain = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().backend_tokenizer, eos_token="<eos>")
    assert not plain.chat_template
    with VerifierThread(tokenizer=plain) as v, grpc.insecure_channel(v.address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(chat(("user", "hello")), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no chat template" in info.value.details() and "plain prompt" in info.value.details()
        assert len(stub.Generate(req(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=3)),
                                 timeout=30).output.token_ids) == 3


def test_queue_and_concurrency_limits_answer_resource_exhausted():
    """Past --max-queue-len and --max-concurrent-rpcs: RESOURCE_EXHAUSTED, and the others complete."""
    long = req(token_ids=pb.TokenIds(ids=[5, 6, 7]), stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
    for limit in ({"max_num_seqs": 1, "max_queue_len": 1}, {"max_concurrent_rpcs": 2}):
        with VerifierThread(**limit) as v, grpc.insecure_channel(v.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(stub.Generate, long, timeout=120) for _ in range(6)]
                codes = []
                for f in futures:
                    try:
                        codes.append(("OK", len(f.result().output.token_ids)))
                    except grpc.RpcError as exc:
                        codes.append((exc.code().name, exc.details()))
            refused = [c for c in codes if c[0] != "OK"]
            assert refused and all(c[0] == "RESOURCE_EXHAUSTED" for c in refused), (limit, codes)
            assert all(c[1] == 200 for c in codes if c[0] == "OK") and len(refused) < 6, (limit, codes)
            if "max_queue_len" in limit:
                assert all("retry later" in c[1] for c in refused), codes
            assert set(v.on_loop(idle).values()) == {0}


@pytest.mark.parametrize("config, words", [
    ("mode: TURBO\n", ["unknown speculation mode 'TURBO'", "known modes", "USER_PROVIDED"]),
    ("mode: EAGLE3\ndraft_model: {model: heads}\n", ["EAGLE3 is not supported", "NONE, NGRAM, SUFFIX, USER_PROVIDED, DRAFT_TARGET"]),
    ("mode: NGRAM\nuser_provided: {drafter_target: 'x:1'}\n", ["mode NGRAM does not take a `user_provided`"]),
    ("mode: USER_PROVIDED\n", ["needs user_provided.drafter_target"]),
    ("mode: NGRAM\nmax_draft_len: 1000\n", ["max_draft_len 1000 is above the limit"]),
    ("mode: NGRAM\nbogus_field: 1\n", ["bogus_field"]),
    ("[1, 2]\n", ["must hold a SpeculativeConfig object"]),
    ("mode: USER_PROVIDED\nuser_provided: {drafter_target: 'x:1', auth_token_file: /nonexistent/token}\n",
     ["auth_token_file /nonexistent/token: no such file"]),
    ("mode: DRAFT_TARGET\ndraft_model: {model: /nonexistent/draft}\n",
     ["draft_model.model /nonexistent/draft: no such file or folder"]),
    ("mode: DRAFT_TARGET\ndraft_model: {dtype: float8}\n", ["draft_model.dtype must be one of", "'float8'"]),
])
def test_bad_config_file_is_refused_at_start_up(tmp_path, capsys, config, words):
    path = tmp_path / "speculative.yaml"
    path.write_text(textwrap.dedent(config))
    assert cli.main(["--speculative-config", str(path), "--model", str(tmp_path / "never-loaded")]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("args, words", [
    (["--speculative-mode", "suffix", "--drafter-target", "x:1"],
     ["mode SUFFIX does not take a `user_provided` section", "--drafter-target", "belongs to mode USER_PROVIDED"]),
    (["--speculative-mode", "ngram", "--draft-model", "x"], ["--draft-model", "belongs to mode DRAFT_TARGET"]),
    (["--speculative-mode", "user_provided", "--drafter-target", "x:1", "--max-matching-ngram-size", "2"],
     ["--max-matching-ngram-size", "belongs to mode NGRAM"]),
])
def test_a_flag_of_another_mode_is_refused_with_the_mode_it_belongs_to(tmp_path, capsys, args, words):
    assert cli.main([*args, "--model", str(tmp_path / "never-loaded")]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_a_vllm_flag_it_does_not_take_fails_with_what_does_its_work_and_no_secret_repeated(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["my-model", "--api-key", "sk-secret", "--gpu-memory-utilization=0.93", "--bogus"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--api-key: no secret is taken as a flag value" in err and "--auth-token-file" in err, err
    assert "--gpu-memory-utilization: the KV cache is given in GB per rank" in err, err
    assert err.rstrip().endswith("unrecognized arguments: --bogus"), err
    assert "sk-secret" not in err and "0.93" not in err
    with pytest.raises(SystemExit):
        cli.main(["--bogus", "value"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --bogus")  # argparse's own
    assert cli.parser().parse_args(["-tp", "2"]).tensor_parallel_size == 2  # vLLM's short form
    assert [cli.parser().parse_args(["--dtype", name]).dtype for name in ("half", "float", "bfloat16")] == [
        "float16", "float32", "bfloat16"]  # vLLM's names


def test_every_flag_a_vllm_hint_names_is_one_the_verifier_takes():
    taken = {option for action in cli.parser()._actions for option in action.option_strings}
    named = {flag for hint in vllm_flags.HINTS.values() for flag in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", hint)}
    assert len(named) > 10 and named <= taken, named - taken
    assert not set(vllm_flags.HINTS) & taken  # a hint never stands in for a flag the parser takes


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")


@pytest.mark.parametrize("args, words", [
    (["--model", "{tmp}/missing"], ["model path {tmp}/missing does not exist"]),
    (["--model", "{tmp}/weights.bin"], ["{tmp}/weights.bin is a file but not a .gguf"]),
    (["--model", "{tmp}/empty"], ["{tmp}/empty has no config.json and not exactly one .gguf file"]),
    (["--model", "{tmp}/broken.gguf"], ["cannot load broken from {tmp}/broken.gguf", "GGUF magic bytes"]),
    pytest.param(["--device", "cuda"], ["device 'cuda'", "sees no CUDA device"], marks=NO_CUDA),
    (["--device", "tpu"], ["unknown device 'tpu'"]),
    # The embedded model's config, read from its GGUF's header: one 2,048-token sequence needs 0.09 GiB.
    (["--kv-cache-memory-gb", "0.001"], ["--kv-cache-memory-gb 0.001 is too small", "lower --max-model-len"]),
    # A config alone, no weights: a recurrent hybrid (tests/verifier/model/test_architectures.py).
    (["--model", "{tmp}/hybrid"], ["hybrid cannot be served: it has linear_attention layers"]),
    # A model that needs code of its own: refused, never asked on a terminal whether to run it.
    (["--model", "{tmp}/custom"], ["cannot load custom from {tmp}/custom: it needs code of its own (its config's "
                                   "auto_map), which splitspec does not run"]),
])
def test_a_model_that_cannot_be_served_as_asked_is_refused_before_serving(tmp_path, capsys, args, words):
    """One line and status 2, before any port is bound or any weight loads: no port file appears."""
    (tmp_path / "weights.bin").write_bytes(b"\0")
    (tmp_path / "broken.gguf").write_bytes(b"not a GGUF file")
    (tmp_path / "empty").mkdir()
    transformers.GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"]).save_pretrained(
        tmp_path / "hybrid")
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "config.json").write_text(json.dumps({
        "model_type": "internlm2", "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}}))
    port_file = tmp_path / "port"
    assert cli.main([*(a.format(tmp=tmp_path) for a in args), "--port", "0", "--port-file", str(port_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitspec-verifier: ") and all(w.format(tmp=tmp_path) in err for w in words), err
    assert "Traceback" not in err and not port_file.exists()


def test_a_hub_name_that_cannot_be_fetched_is_refused_before_serving(tmp_path, capsys, monkeypatch):
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(causal_lm.AutoConfig, "from_pretrained", offline)
    assert cli.main(["--model", "someorg/somemodel", "--port", "0", "--port-file", str(tmp_path / "port")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitspec-verifier: cannot load someorg/somemodel") and "couldn't connect" in err, err
    assert not (tmp_path / "port").exists()


def test_weights_that_cannot_load_end_the_verifier_with_one_line(tmp_path):
    """The config loads, so the servers start; the weights are missing: status 2 and one line, no traceback."""
    tiny_model().config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    done = subprocess.run([script("splitspec-verifier"), "--model", str(tmp_path), "--port", "0", "--http-port", "0",
                           "--max-model-len", str(MAX_MODEL_LEN)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(f"splitspec-verifier: cannot load {tmp_path.name}"), done.stderr
    assert "no file named model.safetensors" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("setting, what", [("port", "gRPC"), ("http_port", "HTTP API")])
def test_a_taken_port_fails_start_up_naming_it(setting, what):
    """A second verifier on a port already in use: a ListenError naming the port and what it is for
    (the CLI prints it in one line, status 2), not gRPC's bare RuntimeError or the OS's error."""
    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            settings = {"port": 0, "http_port": 0, setting: port}
            with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port} \\({what}\\)"):
                await start_server(ServerSettings(host="127.0.0.1", **settings))

    asyncio.run(main())
