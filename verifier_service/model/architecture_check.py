"""At start-up, the packed forward is held to the model's own: the same logits, or the model is refused.

splitspec runs a model's base and head itself (runner.py): packed rows, its own attention over the KV
slots (layer_attention.py: what a layer may ask of it), the head's transforms (logits_head.py). Any
transformers causal LM loads, and most compute exactly that, but one that does something else would be
served other tokens, silently: a layer that is not attention (a Mamba or linear-attention hybrid, whose
state the KV slots do not keep), an attention argument or a logits transform not known here, a forward
of its own. vLLM refuses an architecture it does not list; here every model is put to the test instead.

The probe: a short prompt through the packed forward as the engine runs one (two chunks, a decode row,
a verify row) against the model's own forward with transformers' eager attention over the same tokens.
Every layer must write its keys, and the logits must agree within the dtype's rounding. The probe is
shorter than any sliding window; windows are computed by their own rule, tested against the models'
forwards (tests/verifier/model/test_architectures.py). A sharded model is not probed (its ranks run
every forward together); transformers' tensor-parallel plans cover plain decoder architectures.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from drafter_sdk.errors import ModelLoadError
from verifier_service.model.layer_attention import UnsupportedAttention
from verifier_service.model.runner import ForwardBatch, ModelRunner

# The probe's rows: (first token, tokens); logits from PROBE_LOGITS_FROM on.
PROBE_ROWS = ((0, 5), (5, 3), (8, 1), (9, 3))
PROBE_TOKENS = 12
PROBE_LOGITS_FROM = 5
# Largest logit difference allowed, as a fraction of the largest logit: far above rounding (float32
# agreed to within 1e-5 of it on SmolLM2 and every architecture tested, SmolLM2's batch-invariant
# bfloat16 to the bit) and far below a transform left out (Granite's and Cohere's scale logits by factors).
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}


class UnsupportedModel(ModelLoadError):
    """The packed forward does not compute what the model's own forward computes."""


def check_packed_forward(runner: ModelRunner, model: PreTrainedModel) -> None:
    """Raises UnsupportedModel, naming what differs, unless the packed forward gives the model's own logits."""
    vocab = runner.vocab_size
    ids = [(7 + 7919 * i) % vocab for i in range(PROBE_TOKENS)]  # varied, and the same every start
    arch = ", ".join(model.config.architectures or [type(model).__name__])
    refused = f"{model.name_or_path or 'the model'} ({arch}) cannot be served: "
    expected = _own_logits(model, ids, runner.device)[PROBE_LOGITS_FROM:]
    cache = runner.kv_cache
    slot = cache.allocate()
    try:
        cache.k[:, slot].zero_()
        got = []
        for start, n in PROBE_ROWS:
            logit_index = list(range(max(PROBE_LOGITS_FROM - start, 0), n))
            got.append(runner.forward(ForwardBatch(ids[start:start + n], [slot], [start], [n], logit_index)))
        silent = [layer for layer in range(cache.shape.num_layers) if not cache.k[layer, slot, :, :PROBE_TOKENS].any()]
    except UnsupportedAttention as e:
        raise UnsupportedModel(refused + str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever the model's own code raises under the packed step
        raise UnsupportedModel(refused + f"its layers fail under splitspec's packed attention "
                                         f"({type(e).__name__}: {e})") from e
    finally:
        cache.free(slot)
    if silent:
        raise UnsupportedModel(refused + f"layers {silent} keep no keys (not attention layers: a recurrent or "
                                         "linear-attention hybrid keeps state the KV slots do not hold)")
    logits = torch.cat(got)
    if logits.shape != expected.shape:
        raise UnsupportedModel(refused + f"its forward gives logits of shape {tuple(expected.shape)}, "
                                         f"its head {tuple(logits.shape)}")
    difference = float((logits - expected).abs().max())
    allowed = RELATIVE_TOLERANCE.get(runner.dtype, 5e-2) * float(expected.abs().max())
    if not difference <= allowed:  # NaN fails too
        raise UnsupportedModel(refused + f"splitspec's packed forward gives other logits than the model's own "
                                         f"(by up to {difference:.3g}, above {allowed:.3g}): its layers or head "
                                         "compute something splitspec does not")


def _own_logits(model: PreTrainedModel, ids: list[int], device: torch.device) -> torch.Tensor:
    """The model's own forward over `ids`, with transformers' eager attention: float32 [len(ids), vocab]."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(implementation)
