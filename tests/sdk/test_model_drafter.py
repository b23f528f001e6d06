"""The SDK's ModelDrafter on the tiny draft/target pair: drafts are the draft model's greedy
continuation, its KV stays what a fresh prefill computes, one forward per draft position for a
whole batch, drafting ahead, bounded KV memory, and the `splitspec-drafter model` process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sdk_support import DRAFTER_SCRIPT
from tiny_model import tiny_draft_pair, tiny_tokenizer

from drafter_sdk.drafter import DraftRequest, SamplingHints
from drafter_sdk.drafters.model import ModelDrafter
from drafter_sdk.loading import causal_lm
from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server import cli
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer

torch.set_num_threads(1)
PROMPTS = [[5, 17, 230, 41], [99, 3, 3, 12, 7, 150, 61], [300]]


def greedy(model, tokens: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False)
    return out[0, len(tokens):].tolist()


def request(rid: str, tokens: list[int], draft_len: int = 4) -> DraftRequest:
    return DraftRequest("v", rid, tokens, 1, draft_len, 0, 0, SamplingHints())


@pytest.fixture
def draft_model():
    return tiny_draft_pair()[0]


def make(draft_model, **options) -> ModelDrafter:
    options.setdefault("max_draft_len", 4)
    drafter = ModelDrafter(loaded=(draft_model, tiny_tokenizer()), **options)
    drafter.load()
    return drafter


def test_dtype_auto_is_float32_on_a_cpu_bfloat16_on_a_gpu_that_computes_it_else_float16(monkeypatch) -> None:
    """As vLLM falls back on a T4 or a V100 (compute capability below 8.0). Only the device's capability is
    stood in for: no GPU is needed."""
    assert causal_lm.pick_dtype("auto", torch.device("cpu")) == torch.float32
    gpus = {0: (7, 5), 1: (9, 0)}  # a T4 beside an H100: the capability is the device's, not the current one's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpus[torch.device(device).index])
    for index, dtype in ((0, torch.float16), (1, torch.bfloat16)):
        assert causal_lm.pick_dtype("auto", torch.device("cuda", index)) == dtype
        assert causal_lm.pick_dtype("bfloat16", torch.device("cuda", index)) == torch.bfloat16  # asked: as asked


def test_drafts_are_the_draft_models_greedy_continuation_with_one_forward_per_position(draft_model):
    drafter = make(draft_model, draft_ahead=False)
    reference = tiny_draft_pair()[0]
    drafts = drafter.prepare_draft_tokens([request(str(i), p) for i, p in enumerate(PROMPTS)])
    assert drafts == [greedy(reference, p, 4) for p in PROMPTS]
    # One packed forward for every sequence's context, then one per further draft position.
    assert drafter.stats.forwards == 4 and drafter.stats.catch_up_tokens == sum(map(len, PROMPTS))
    assert drafter.vocab_size == len(tiny_tokenizer())
    assert drafter.tokenizer_fingerprint == tokenizer_fingerprint(tiny_tokenizer())
    drafter.close()


def test_after_a_rejection_the_kv_equals_a_fresh_prefill(draft_model):
    drafter = make(draft_model)
    prompt = PROMPTS[1]
    first = drafter.prepare_draft_tokens([request("a", prompt)])[0]
    # The target accepted one draft token and chose another one than the draft's second.
    context = prompt + first[:1] + [(first[1] + 1) % 300 + 3]
    second = drafter.prepare_draft_tokens([request("a", context)])[0]
    drafter.wait_idle()
    tokens, k, v = drafter.kv_of(("v", "a"))
    assert tokens[:len(context)] == context
    fresh = make(tiny_draft_pair()[0], draft_ahead=False)
    assert fresh.prepare_draft_tokens([request("a", context)])[0] == second == greedy(tiny_draft_pair()[0], context, 4)
    fresh_tokens, fresh_k, fresh_v = fresh.kv_of(("v", "a"))
    n = len(context)
    assert fresh_tokens[:n] == context
    torch.testing.assert_close(k[:, :, :n], fresh_k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v[:, :, :n], fresh_v[:, :, :n], atol=1e-5, rtol=1e-5)
    drafter.close()
    fresh.close()


@pytest.mark.parametrize("ahead", [True, False])
def test_drafting_ahead_answers_a_fully_accepted_step_without_a_forward(draft_model, ahead):
    drafter = make(draft_model, draft_ahead=ahead)
    reference = tiny_draft_pair()[0]
    contexts = [list(p) for p in PROMPTS]
    for _ in range(3):
        drafts = drafter.prepare_draft_tokens([request(str(i), c) for i, c in enumerate(contexts)])
        drafter.wait_idle()
        for c, d in zip(contexts, drafts):
            assert d == greedy(reference, c, 4)
            c += greedy(reference, c, 5)  # every draft token accepted, and the bonus is the draft's own choice
    forwards = drafter.stats.forwards
    assert drafter.stats.hits == (2 * len(PROMPTS) if ahead else 0)
    # With drafting ahead, only the first call ran forwards while answering.
    assert forwards == (4 if ahead else 12)
    assert (drafter.stats.ahead_forwards > 0) == ahead
    drafter.close()


def test_mixed_calls_release_and_a_sequence_wanting_no_draft(draft_model):
    drafter = make(draft_model)
    reference = tiny_draft_pair()[0]
    a, b = list(PROMPTS[0]), list(PROMPTS[1])
    drafter.prepare_draft_tokens([request("a", a)])
    a += [7]  # a rejection right away
    drafts = drafter.prepare_draft_tokens([request("a", a, 3), request("b", b, 0)])
    assert drafts == [greedy(reference, a, 3), []]
    assert drafter.state_bytes(("v", "b")) == 0  # no draft wanted: nothing computed or held
    held = drafter.kv_bytes_used
    assert held == drafter.state_bytes(("v", "a")) > 0 and drafter.shared_state_bytes() == 0
    drafter.on_release(("v", "a"))
    assert drafter.kv_bytes_used == 0 and drafter.state_bytes(("v", "a")) == 0
    assert drafter.prepare_draft_tokens([request("a", a, 2)]) == [greedy(reference, a, 2)]  # from scratch
    drafter.close()


def test_kv_memory_is_bounded_and_a_sequence_that_does_not_fit_gets_no_draft(draft_model):
    per_token = 2 * 1 * 2 * 16 * 4  # K and V x 1 layer x 2 KV heads x 16 dims x float32
    drafter = make(draft_model, kv_cache_memory_gb=150 * per_token / 2**30)  # room for 2 blocks of 64
    drafts = drafter.prepare_draft_tokens([request("a", PROMPTS[0]), request("b", PROMPTS[1]),
                                           request("c", PROMPTS[2])])
    assert [bool(d) for d in drafts] == [True, True, False]
    assert drafter.stats.no_room == 1
    assert drafter.kv_bytes_used <= drafter.kv_budget_bytes
    long = list(range(3, 200))  # more positions than the budget holds: no draft, no error
    assert drafter.prepare_draft_tokens([request("d", long)]) == [[]]
    drafter.on_release(("v", "a"))
    assert drafter.prepare_draft_tokens([request("c", PROMPTS[2])])[0]  # room again
    drafter.close()


def test_splitspec_drafter_model_serves_once_loaded_and_reports_its_tokenizer(tmp_path):
    draft, _ = tiny_draft_pair()
    draft.save_pretrained(tmp_path / "draft")
    tiny_tokenizer().save_pretrained(tmp_path / "draft")
    port_file = tmp_path / "port"
    process = subprocess.Popen([str(DRAFTER_SCRIPT), "model", "--model", str(tmp_path / "draft"), "--device", "cpu",
                                "--dtype", "float32", "--max-draft-len", "3", "--port", "0",
                                "--port-file", str(port_file), "--log-level", "WARNING"],
                               env={**os.environ, "OMP_NUM_THREADS": "1"})

    async def body():
        deadline = time.monotonic() + 300  # a generous bound on start-up and loading, not a timing check
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port_file.read_text().strip()}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            while (await health.Check(health_pb2.HealthCheckRequest())).status != serving:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            info = await stub.GetDrafterInfo(pb.GetDrafterInfoRequest())
            reply = await stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[
                pb.DraftSequence(request_id="r", context_len=0, new_tokens=PROMPTS[1], prompt_len=2, draft_len=8)]))
            return info, reply

    try:
        info, reply = asyncio.run(body())
    finally:
        process.terminate()
        process.wait(30)
    assert info.name == "model" and info.max_draft_len == 3 and info.vocab_size == len(tiny_tokenizer())
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(tiny_tokenizer())
    assert list(reply.results[0].draft_tokens) == greedy(tiny_draft_pair()[0], PROMPTS[1], 3)


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/missing"], "model path {tmp}/missing does not exist"),
    pytest.param(["--device", "cuda"], "sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")),
    (["--dtype", "float8"], "unknown dtype 'float8'; choose auto, float32"),
])
def test_splitspec_drafter_model_refuses_what_it_cannot_load_before_serving(tmp_path, capsys, args, message):
    """A usage error (status 2, one line), not a traceback from `load()` once the server listens."""
    port_file = tmp_path / "port"
    with pytest.raises(SystemExit) as exited:
        cli.main(["model", *(a.format(tmp=tmp_path) for a in args), "--port", "0", "--port-file", str(port_file)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err and not port_file.exists()


def test_the_sdk_and_its_cli_import_without_torch():
    code = ("import sys, drafter_sdk, drafter_sdk.server.cli, drafter_sdk.loading.tokenizer_fingerprint; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_through_the_sdk_servicer_namespacing_resync_and_idle_eviction(draft_model):
    """The SDK's protocol logic in front of the model drafter: per-verifier state, a delta the drafter
    cannot place asks for a resync, and idle eviction frees the KV memory."""
    now = [0.0]
    servicer = DrafterServicer(make(draft_model, draft_ahead=False), SequenceStore(idle_timeout_s=10,
                                                                                   clock=lambda: now[0]))
    servicer.loaded = True
    drafter = servicer.drafter
    reference = tiny_draft_pair()[0]

    def call(verifier: str, context_len: int, tokens: list[int]) -> pb.DraftResult:
        return servicer.prepare(pb.PrepareDraftTokensRequest(verifier_id=verifier, sequences=[pb.DraftSequence(
            request_id="r", context_len=context_len, new_tokens=tokens, prompt_len=1, draft_len=3)])).results[0]

    a, b = PROMPTS[0], PROMPTS[1]
    assert list(call("v1", 0, a).draft_tokens) == greedy(reference, a, 3)
    assert list(call("v2", 0, b).draft_tokens) == greedy(reference, b, 3)  # same request id, another verifier
    assert drafter.state_bytes(("v1", "r")) > 0 and drafter.state_bytes(("v2", "r")) > 0
    assert list(call("v1", len(a), [9]).draft_tokens) == greedy(reference, a + [9], 3)
    assert call("v1", len(a) + 5, [9]).status == pb.DRAFT_STATUS_RESYNC_REQUIRED  # a gap: resync, state kept
    assert list(call("v1", 0, a + [9, 4]).draft_tokens) == greedy(reference, a + [9, 4], 3)
    now[0] = 100.0
    assert servicer.evict_idle() == 2
    assert drafter.kv_bytes_used == 0
    drafter.close()
