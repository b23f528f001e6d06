"""Architectures beside Llama: splitspec's packed forwards give what each model's own forward gives.

A step runs the base model with splitspec's attention and the head apart (model/runner.py), so what a
model's layers pass its attention (a sliding window, a cap on the scores, sink logits:
drafter_sdk/loading/layer_attention.py) and what its forward does after the head (scaled or capped logits:
model/logits_head.py) are computed here. Checked against transformers' own forward with eager attention,
for tiny random models of each architecture, through every row a step carries (prompt chunks, decode,
verify, a token tree) on every attention path (SDPA, batch-invariant, the CUDA graphs' shapes), with
contexts well past the window; a verifier speculating on them gives their own greedy output, and so does
the SDK's draft model (its own packed forward) draft it. LongRoPE's frequencies are fixed so that batching
and drafting change no token (model/rotary_pinning.py). A model that computes something else (a recurrent
hybrid, a forward of its own) is refused at start-up (model/architecture_check.py), saying why.
"""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch
import transformers
from tiny_model import tiny_tokenizer
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    OracleDrafter,
    one_torch_thread,  # noqa: F401 - autouse fixture
    run_together,
    serve_drafter,
)

from drafter_sdk.drafter import DraftRequest, SamplingHints
from drafter_sdk.drafters.model import ModelDrafter
from drafter_sdk.loading.layer_attention import UnsupportedAttention, from_kwargs
from verifier_service.model import architecture_check
from verifier_service.model.architecture_check import UnsupportedModel, check_config
from verifier_service.model.cuda_graphs import StepGraphs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.rotary_pinning import pin_rotary_frequencies
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.model.tree_attention import is_chain_row
from verifier_service.settings import DEFAULTS

VOCAB = len(tiny_tokenizer())
WINDOW = 8  # sliding windows far shorter than the contexts: most keys are out of them
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
              eos_token_id=tiny_tokenizer().eos_token_id, bos_token_id=None, pad_token_id=None)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral (sliding window)": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2 (sliding window above layer 1)": (transformers.Qwen2Config, {
        "sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    "phi3 (sliding window)": (transformers.Phi3Config, {"sliding_window": WINDOW}),
    "gemma2 (window, capped scores and logits)": (transformers.Gemma2Config, {
        "sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3 (window)": (transformers.Gemma3TextConfig, {"sliding_window": WINDOW}),
    "cohere (scaled logits)": (transformers.CohereConfig, {"logit_scale": 0.5}),
    "granite (scaled logits)": (transformers.GraniteConfig, {"logits_scaling": 4.0}),
    "gpt-oss (sink logits, window, experts)": (transformers.GptOssConfig, {
        "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek-v3 (latent attention: values narrower than keys)": (transformers.DeepseekV3Config, {
        "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}),
}


def tiny(architecture: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, fields = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**SHAPES, **fields}),
                                                          attn_implementation="eager").eval()
    model.generation_config.eos_token_id = SHAPES["eos_token_id"]
    return model


def own_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """The model's own forward over `ids` (transformers' eager attention): logits [len(ids), vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root (indices into the row)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


@pytest.mark.parametrize("path", ["sdpa", "batch-invariant", "graph shapes"])
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_packed_forward_gives_the_models_own_logits_through_every_kind_of_row(architecture: str,
                                                                                  path: str) -> None:
    check_every_kind_of_row(architecture, path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("architecture", ["gemma2 (window, capped scores and logits)",
                                          "gpt-oss (sink logits, window, experts)",
                                          "deepseek-v3 (latent attention: values narrower than keys)"])
def test_captured_cuda_graphs_give_the_models_own_logits(architecture: str) -> None:
    """Windows, capped scores, sinks and narrower values inside captured graphs (three models: .ci/gpu-check
    gives its CUDA tests 90 s)."""
    check_every_kind_of_row(architecture, "cuda graphs")


def check_every_kind_of_row(architecture: str, path: str) -> None:
    device = torch.device("cuda" if path == "cuda graphs" else "cpu")
    model = tiny(architecture)
    reference = copy.deepcopy(model)  # keeps transformers' eager attention, on the CPU
    model.to(device)
    runner = ModelRunner(model, KVCache(KVCacheShape.for_model(model.config, num_slots=2, capacity=300),
                                        torch.float32, device))
    runner.batch_invariant = path == "batch-invariant"  # its math is the dtype's own on any dtype
    if "graph" in path:  # on a CPU at the graphs' shapes without capture (tests/verifier/model/test_cuda_graphs.py)
        runner.graphs = StepGraphs(runner._run_body, runner.kv_cache, DEFAULTS.cuda_graph_max_tokens,
                                   capture=device.type == "cuda")
    rng = random.Random(1)
    seqs = [[rng.randrange(1, VOCAB) for _ in range(30)], [rng.randrange(1, VOCAB) for _ in range(26)]]
    committed = [0, 0]

    def step(rows: list[tuple[int, list[int]]], parents: list[list[int]] | None = None) -> None:
        """Rows of (slot, new tokens), every token's logits checked against the model's own forward
        over its path; chain rows then commit their tokens."""
        ids = [t for _, new in rows for t in new]
        batch = ForwardBatch(ids, [s for s, _ in rows], [committed[s] for s, _ in rows], [len(n) for _, n in rows],
                             list(range(len(ids))), parents=[p for ps in parents for p in ps] if parents else [])
        got = runner.forward(batch)
        if runner.graphs is not None:  # first sighting eager, then at its graph's shapes (the same K/V again)
            assert torch.allclose(runner.forward(batch), got, atol=1e-5)
        got = got.cpu()
        offset = 0
        for r, (slot, new) in enumerate(rows):
            context = seqs[slot][:committed[slot]]
            if parents and not is_chain_row(parents[r]):
                paths = tree_paths(parents[r])
                expected = torch.stack([own_logits(reference, context + [new[i] for i in p])[-1] for p in paths])
            else:
                expected = own_logits(reference, context + new)[-len(new):]
                seqs[slot][committed[slot]:committed[slot] + len(new)] = new
                committed[slot] += len(new)
            assert torch.allclose(got[offset:offset + len(new)], expected, atol=1e-4), \
                f"row {r}: off by {(got[offset:offset + len(new)] - expected).abs().max():.2e}"
            offset += len(new)

    step([(0, seqs[0][:12]), (1, seqs[1][:20])])  # prompts, the first in chunks
    step([(0, seqs[0][12:28]), (1, seqs[1][20:21])])  # a chunk beside a decode row
    step([(0, seqs[0][28:29]), (1, seqs[1][21:26])])  # decode beside verify
    step([(0, [seqs[0][29], 5, 6, 7, 8, 9]), (1, [11, 12])],  # a token tree beside a verify row
         parents=[[-1, 0, 0, 1, 2, 3], [-1, 0]])
    if runner.graphs is not None:
        assert runner.graphs.replays >= 4 and (runner.graphs.captures > 0) == (device.type == "cuda")


@pytest.mark.parametrize("architecture", ["mistral (sliding window)", "gemma2 (window, capped scores and logits)",
                                          "gpt-oss (sink logits, window, experts)",
                                          "deepseek-v3 (latent attention: values narrower than keys)"])
def test_a_verifier_speculating_on_the_model_gives_its_own_greedy_output(architecture: str) -> None:
    """Drafts from an oracle that corrupts some, over contexts five times the window."""
    model = tiny(architecture)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(12, 20))] for _ in range(4)]
    refs = [reference_greedy(model, p, 24) for p in prompts]  # before the verifier takes the model
    oracle = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, corrupt=0.3, seed=5, vocab_size=VOCAB)

    async def main() -> list[list[int]]:
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=model) as v:
                calls = [lambda p=p: v.stub.Generate(token_request(p, 24), timeout=WAIT_S) for p in prompts]
                responses = await run_together(v, calls)
        return [list(r.output.token_ids) for r in responses]

    assert asyncio.run(main()) == refs
    assert oracle.accepted_at and oracle.rejected_at and not oracle.feedback_errors


@pytest.mark.parametrize("architecture", ["mistral (sliding window)", "gemma2 (window, capped scores and logits)",
                                          "gpt-oss (sink logits, window, experts)",
                                          "deepseek-v3 (latent attention: values narrower than keys)"])
def test_the_sdks_draft_model_drafts_the_models_own_greedy_continuation(architecture: str) -> None:
    """The SDK's draft model runs a packed forward of its own (drafter_sdk/drafters/model.py), past the window
    too: prompts in one forward, then a context that left its draft (rolled back, caught up from mid-row)."""
    model = tiny(architecture)
    reference = copy.deepcopy(model)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (20, 13, 30)]
    drafter = ModelDrafter(loaded=(model, tiny_tokenizer()), max_draft_len=6, draft_ahead=False)
    drafter.load()

    def ask(contexts: list[list[int]]) -> list[list[int]]:
        return drafter.prepare_draft_tokens([DraftRequest("v", str(i), c, len(prompts[i]), 6, 0, 0, SamplingHints())
                                             for i, c in enumerate(contexts)])

    try:
        drafts = ask(prompts)
        assert drafts == [reference_greedy(reference, p, 6) for p in prompts]
        left = [p + d[:3] + [(d[3] + 1) % VOCAB] for p, d in zip(prompts, drafts)]  # the 4th draft token rejected
        assert ask(left) == [reference_greedy(reference, c, 6) for c in left]
    finally:
        drafter.close()


def test_longrope_frequencies_are_fixed_so_that_a_tokens_logits_never_depend_on_its_batch() -> None:
    """Phi-3's LongRoPE switches to long frequencies once a forward's largest position passes the original
    context (16 here, against the 256 served): batched with a longer sequence, or verified in a draft that
    crosses it, a token would get other logits than alone. Fixed at the long ones (model/rotary_pinning.py),
    each request alone, all together and all speculated give transformers' generate() with those."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
        **SHAPES, original_max_position_embeddings=16, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 8, "long_factor": [8.0] * 8})).eval()
    reference = copy.deepcopy(model)
    assert pin_rotary_frequencies(reference, 256) == [
        "LongRoPE: its long frequencies for every sequence (served length 256, original 16)"]
    rng = random.Random(3)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (6, 10, 30, 12)]
    refs = [reference_greedy(reference, p, 24) for p in prompts]
    oracle = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, corrupt=0.3, seed=5, vocab_size=VOCAB)

    async def main() -> tuple[list[list[int]], ...]:
        async def together(v) -> list[list[int]]:  # noqa: ANN001
            calls = [lambda p=p: v.stub.Generate(token_request(p, 24), timeout=WAIT_S) for p in prompts]
            return [list(r.output.token_ids) for r in await run_together(v, calls)]

        async with run_verifier(model=model) as v:
            alone = [list((await v.stub.Generate(token_request(p, 24), timeout=WAIT_S)).output.token_ids)
                     for p in prompts]
            batched = await together(v)
        async with serve_drafter(oracle) as drafter:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=f"127.0.0.1:{drafter.port}", deadline_ms=30000)
            async with run_verifier(spec, model=model) as v:
                speculated = await together(v)
        return alone, batched, speculated

    assert all(outputs == refs for outputs in asyncio.run(main()))
    assert oracle.accepted_at and oracle.rejected_at


class ScaledLlama(transformers.LlamaForCausalLM):
    """A forward of its own: logits tripled after the head, which the packed forward cannot know."""

    def forward(self, *args: object, **kwargs: object) -> transformers.modeling_outputs.CausalLMOutputWithPast:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


def hybrid_config() -> transformers.PretrainedConfig:
    """A Mamba layer under an attention layer (Granite 4's hybrid shape)."""
    shapes = {k: v for k, v in SHAPES.items() if k != "head_dim"}  # its own rule: hidden size / heads
    return transformers.GraniteMoeHybridConfig(**shapes, layer_types=["mamba", "attention"], mamba_d_head=16,
                                               mamba_n_heads=8, mamba_d_state=16, num_local_experts=2,
                                               num_experts_per_tok=1)


def hybrid() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hybrid_config()).eval()


@pytest.mark.parametrize(("make", "reason"), [
    (hybrid, "it has linear_attention layers; splitspec's packed attention computes full and sliding-window"),
    (lambda: ScaledLlama(transformers.LlamaConfig(**SHAPES)).eval(), "other logits than the model's own"),
    (lambda: transformers.AutoModelForCausalLM.from_config(transformers.StableLmConfig(**SHAPES)).eval(),
     "its layers fail under splitspec's packed attention"),
], ids=["recurrent hybrid", "own forward", "attention that needs its mask"])
def test_a_model_that_computes_something_else_is_refused_at_start_up_saying_why(make, reason: str) -> None:  # noqa: ANN001
    async def main() -> None:
        with pytest.raises(UnsupportedModel, match=reason):
            async with run_verifier(model=make()):
                pass

    asyncio.run(main())


def test_the_probe_alone_refuses_a_recurrent_hybrid_naming_the_layers_that_never_attend(monkeypatch) -> None:  # noqa: ANN001
    """A hybrid whose config did not list its layers: its Mamba layer's state is lost between the probe's rows."""
    monkeypatch.setattr(architecture_check, "COMPUTED_LAYER_TYPES",
                        architecture_check.COMPUTED_LAYER_TYPES | {"linear_attention"})

    async def main() -> None:
        with pytest.raises(UnsupportedModel, match=r"other logits than the model's own .*; layers \[0\] never "
                                                   "attend: a recurrent layer's state is not kept between steps"):
            async with run_verifier(model=hybrid()):
                pass

    asyncio.run(main())


class MlpOnlyLayer(torch.nn.Module):
    """In place of a layer's attention: adds nothing and never calls the attention function (Nemotron-H's
    MLP-only layers, whose `layer_types` the config check does not accept, are this with a list)."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


def test_a_layer_that_never_attends_but_keeps_no_state_is_served_exactly() -> None:
    model = tiny("llama")
    model.model.layers[0].self_attn = MlpOnlyLayer()
    reference = copy.deepcopy(model)
    prompt = [5, 9, 13, 17, 21, 25]

    async def main() -> list[int]:
        async with run_verifier(model=model) as v:
            return list((await v.stub.Generate(token_request(prompt, 12), timeout=WAIT_S)).output.token_ids)

    assert asyncio.run(main()) == reference_greedy(reference, prompt, 12)


def test_layer_kinds_the_packed_step_does_not_compute_are_refused_from_the_config_alone() -> None:
    """Llama 4's chunked attention lives in its mask alone: no argument of the attention function says it."""
    llama4 = transformers.Llama4TextConfig(**{**SHAPES, "num_hidden_layers": 4})
    with pytest.raises(UnsupportedModel, match="llama4 cannot be served: it has chunked_attention layers"):
        check_config(llama4, "llama4")
    check_config(transformers.Gemma3TextConfig(**SHAPES, sliding_window=WINDOW), "gemma3")  # full and sliding


def test_an_attention_argument_not_computed_is_refused_and_inert_ones_are_not() -> None:
    with pytest.raises(UnsupportedAttention, match="chunk_size"):
        from_kwargs({"sliding_window": None, "chunk_size": 64})
    attention = from_kwargs({"position_ids": torch.zeros(3), "use_cache": False, "sliding_window": 8, "softcap": None})
    assert (attention.window, attention.softcap, attention.sinks, attention.fused) == (8, None, None, True)
