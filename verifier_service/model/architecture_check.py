"""At start-up, the packed forward is held to the model's own: the same logits, or the model is refused.

splitspec runs a model's base and head itself (runner.py): packed rows, its own attention over the KV
slots (layer_attention.py: what a layer may ask of it), the head's transforms (logits_head.py). Any
transformers causal LM loads, and most compute exactly that, but one that does something else would be
served other tokens, silently: a layer that is not attention (a Mamba or linear-attention hybrid, whose
state the KV slots do not keep), an attention argument or a logits transform not known here, a forward
of its own. vLLM refuses an architecture it does not list; here every model is put to the test instead.

Two checks. From the config alone, before any weight loads (api/cli.py): the kinds of layer a config
lists (transformers' `layer_types`) must be full or sliding-window attention; chunked attention (Llama
4), sparse or compressed attention (DeepSeek V3.2 and V4) and recurrent layers live in masks or states
the packed step does not build. Then the probe: a short prompt through the packed forward as the engine
runs one (a prompt, a verify row, a decode row) against the model's own forward with transformers'
eager attention over the same tokens. The logits must agree within the dtype's rounding; where they do
not, a layer that never attended is named as the likely cause (a recurrent layer, whose state no step
keeps). The probe is shorter than any sliding window; windows are computed by their own rule, tested
against the models' forwards (tests/verifier/model/test_architectures.py). A sharded model is not
probed (its ranks run every forward together); transformers' tensor-parallel plans cover plain decoder
architectures.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from drafter_sdk.errors import ModelLoadError
from drafter_sdk.loading.layer_attention import UnsupportedAttention
from verifier_service.model.runner import ForwardBatch, ModelRunner

# The probe's forwards, each one row of (first token, tokens): a prompt from position 0, a verify row
# after it (a chunk is the same row), a decode row. Logits from PROBE_LOGITS_FROM on.
PROBE_ROWS = ((0, 8), (8, 3), (11, 1))
PROBE_TOKENS = 12
PROBE_LOGITS_FROM = 5
# Largest logit difference allowed, as a fraction of the largest logit: far above rounding (float32
# agreed to within 1e-5 of it on SmolLM2 and every architecture tested, SmolLM2's batch-invariant
# bfloat16 on a CPU to the bit; half precision on a GPU, SDPA against eager, is not measured yet, so
# it gets a wide margin) and far below a transform left out (Granite's and Cohere's scale logits by factors).
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.1}


# transformers' `layer_types` whose attention the packed step computes (and its kinds of MLP layer).
COMPUTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "dense", "sparse"})


class UnsupportedModel(ModelLoadError):
    """The packed forward does not compute what the model's own forward computes."""


def check_config(config: PretrainedConfig, model_name: str) -> None:
    """Raises UnsupportedModel where the config lists layers the packed step does not compute."""
    layer_types = getattr(config.get_text_config(), "layer_types", None) or []
    other = sorted(set(layer_types) - COMPUTED_LAYER_TYPES)
    if other:
        raise UnsupportedModel(f"{model_name} cannot be served: it has {', '.join(other)} layers; splitspec's "
                               "packed attention computes full and sliding-window attention")


def check_packed_forward(runner: ModelRunner, model: PreTrainedModel) -> None:
    """Raises UnsupportedModel, naming what differs, unless the packed forward gives the model's own logits."""
    vocab = runner.vocab_size
    ids = [(7 + 7919 * i) % vocab for i in range(PROBE_TOKENS)]  # varied, and the same every start
    arch = ", ".join(model.config.architectures or [type(model).__name__])
    name = f"{model.name_or_path or 'the model'} ({arch})"
    check_config(model.config, name)
    refused = f"{name} cannot be served: "
    try:
        expected = _own_logits(model, ids, runner.device)[PROBE_LOGITS_FROM:]
    except Exception as e:  # noqa: BLE001 - whatever the model's own code raises
        raise UnsupportedModel(refused + f"its own forward fails ({type(e).__name__}: {e})") from e
    cache = runner.kv_cache
    slot = cache.allocate()
    try:
        cache.k[:, slot].zero_()
        got = []
        for start, n in PROBE_ROWS:
            logit_index = list(range(max(PROBE_LOGITS_FROM - start, 0), n))
            got.append(runner.forward(ForwardBatch(ids[start:start + n], [slot], [start], [n], logit_index)))
        # Layers that never attended: harmless where stateless (an MLP-only layer), the likely cause where not.
        silent = [layer for layer in range(cache.shape.num_layers) if not cache.k[layer, slot, :, :PROBE_TOKENS].any()]
    except UnsupportedAttention as e:
        raise UnsupportedModel(refused + str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever the model's own code raises under the packed step
        raise UnsupportedModel(refused + f"its layers fail under splitspec's packed attention "
                                         f"({type(e).__name__}: {e})") from e
    finally:
        cache.free(slot)
    logits = torch.cat(got)
    if logits.shape != expected.shape:
        raise UnsupportedModel(refused + f"its forward gives logits of shape {tuple(expected.shape)}, "
                                         f"its head {tuple(logits.shape)}")
    difference = float((logits - expected).abs().max())
    allowed = RELATIVE_TOLERANCE.get(runner.dtype, 0.1) * float(expected.abs().max())
    if not difference <= allowed:  # NaN fails too
        cause = (f"layers {silent} never attend: a recurrent layer's state is not kept between steps" if silent
                 else "its layers or head compute something splitspec does not")
        raise UnsupportedModel(refused + f"splitspec's packed forward gives other logits than the model's own "
                                         f"(by up to {difference:.3g}, above {allowed:.3g}); {cause}")


def _own_logits(model: PreTrainedModel, ids: list[int], device: torch.device) -> torch.Tensor:
    """The model's own forward over `ids`, with transformers' eager attention: float32 [len(ids), vocab]."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(implementation)
