"""LongRoPE's frequencies fixed for the server's life, so that a token's logits never depend on its batch.

transformers' LongRoPE (Phi-3 and Phi-3.5 128k, Phi-4-mini) takes its short or its long frequencies from the
largest position in each forward. In a packed step that is the longest sequence of the batch (vLLM and SGLang
switch per batch the same way), and in a verify row its last draft token: a token's logits would depend on what
it was batched with and on whether it was drafted, and speculation would no longer give plain decoding's tokens.
So the verifier fixes them once, for the length it serves (--max-model-len): the long frequencies where that
passes the model's original context, the short ones where it does not, transformers' own choice for a sequence of
that length. A server kept to the original context gives every prompt transformers' choice; one that serves past
it gives short prompts the long frequencies too. (Dynamic NTK scaling changes its frequencies only past the
model's positions, which the verifier never serves.)
"""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

PINNED = "longrope, pinned"  # a rope type transformers' per-forward update does not act on


def pin_rotary_frequencies(model: PreTrainedModel, max_model_len: int) -> list[str]:
    """Fix every LongRoPE rotary embedding's frequencies for `max_model_len`; what was fixed, for the log."""
    pinned = []
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        # One rope type, or one per kind of layer (then each its own buffers, prefixed with the kind).
        kinds: dict[str | None, object] = dict(rope_types) if isinstance(rope_types, dict) else {None: rope_types}
        for kind, rope_type in kinds.items():
            prefix = f"{kind}_" if kind is not None else ""
            buffer = getattr(module, f"{prefix}inv_freq", None)
            if buffer is None or rope_type != "longrope":
                continue
            config = getattr(module, "config")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, buffer.device, seq_len=max_model_len,
                                                                **({"layer_type": kind} if kind is not None else {}))
            buffer.copy_(inv_freq)
            setattr(module, f"{prefix}attention_scaling", scaling)
            if isinstance(rope_types, dict):
                rope_types[kind] = PINNED
            else:
                setattr(module, "rope_type", PINNED)
            parameters = config.rope_parameters
            original = (parameters[kind] if kind is not None else parameters)["original_max_position_embeddings"]
            which = "long" if max_model_len > original else "short"
            pinned.append(f"LongRoPE{f' ({kind})' if kind else ''}: its {which} frequencies for every sequence "
                          f"(served length {max_model_len}, original {original})")
    return pinned
