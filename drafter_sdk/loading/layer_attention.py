"""What a model's attention layer asks of a packed attention beyond causal softmax(Q K^T * scale) V.

transformers' attention modules pass it as keyword arguments to the attention function
(AttentionInterface), layer by layer: a sliding window (Mistral 7B v0.1, Phi-3, Gemma 2 and 3's local
layers, Qwen2 with `use_sliding_window`, gpt-oss), a tanh cap on the scores (Gemma 2) and a sink logit
per head (gpt-oss). Ignored, each of them changes the logits once a context passes the window, or at
once. Both packed forwards apply them: the verifier's (every attention path of its step: runner,
invariant_attention, cuda_graphs) and the SDK's draft model's (drafters/model.py). An argument this
module does not know raises UnsupportedAttention: the verifier then refuses the model at start-up
(verifier_service/model/architecture_check.py), never serving other tokens.

A sliding window keeps the whole context's K/V; only what a query sees changes. Multi-head latent
attention (DeepSeek V2 and V3) reaches the attention function decompressed, as keys and values of
different sizes (`kv_head_dims`), and is cached so: far more memory than its latent form, but exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# Arguments that do not change the attention's result (inputs the packed step has its own way of giving).
_INERT = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "output_router_logits"})


def kv_head_dims(config: PretrainedConfig) -> tuple[int, int]:
    """The sizes of one head's key and value as a model's attention layers write them: `head_dim` (or
    hidden size / heads) for both, or for multi-head latent attention keys of its no-rope and rope parts
    and values of their own size."""
    cfg = config.get_text_config()
    if getattr(cfg, "qk_nope_head_dim", None) and getattr(cfg, "v_head_dim", None):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return head_dim, head_dim


class UnsupportedAttention(ValueError):
    """An attention layer asked for something the packed attention does not compute."""


@dataclass(frozen=True)
class LayerAttention:
    window: int | None = None  # a query sees the keys less than `window` positions before its own
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the mask
    sinks: torch.Tensor | None = None  # [heads]: a logit per head that joins the softmax's denominator only

    @property
    def fused(self) -> bool:
        """Whether SDPA computes it (its masks carry the window); a cap or sinks need the scores."""
        return self.softcap is None and self.sinks is None


PLAIN = LayerAttention()


def from_kwargs(kwargs: Mapping[str, object]) -> LayerAttention:
    """The layer's attention from what transformers passed the attention function. Raises
    UnsupportedAttention for an argument that would change the result and is not computed here."""
    if kwargs.keys() <= _INERT:  # most models' every layer, every step: kept to a set comparison
        return PLAIN
    unknown = sorted(k for k, v in kwargs.items()
                     if k not in _INERT and k not in ("sliding_window", "softcap", "s_aux") and v is not None)
    if unknown:
        raise UnsupportedAttention(f"the attention layers ask for {', '.join(unknown)}, which splitspec's packed "
                                   "attention does not compute")
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        return PLAIN
    return LayerAttention(int(window) if window is not None else None,  # type: ignore[call-overload]
                          float(softcap) if softcap is not None else None,  # type: ignore[arg-type]
                          sinks if isinstance(sinks, torch.Tensor) else None)


def binding(window: int | None, end: int) -> int | None:
    """`window` where it hides some keys from some queries of a row whose last position is end - 1; None
    where it hides none (then the causal mask alone is the row's)."""
    return window if window is not None and end > window else None


def key_positions(start: int, queries: torch.Tensor, length: int) -> torch.Tensor:
    """[length]: the positions of a slot's first `length` keys, their indices but for the row's new
    tokens from `start`, which sit at their queries' positions (a token tree's nodes at their depth)."""
    keys = torch.arange(length, device=queries.device)
    keys[start:start + len(queries)] = queries[:length - start]
    return keys


def chain_visible(start: int, n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, start + n] bool: which keys the n queries of a row at positions start.. see (causal, and within
    `window` where one is set)."""
    keys = torch.arange(start + n, device=device)
    queries = start + torch.arange(n, device=device)
    visible = keys[None, :] <= queries[:, None]
    return visible & in_window(queries, keys, window) if window is not None else visible


def in_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., queries, keys] bool: the keys within `window` of each query (transformers' sliding-window
    overlay, by position: a token tree's nodes sit at their depth, not at their K/V index)."""
    return key_positions[..., None, :] > query_positions[..., :, None] - window


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap on attention scores, in place where one is set."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension of masked float32 scores, where `sink` (each head's sink logit,
    shaped to broadcast against scores[..., :1]) adds a term of its own to the denominator (gpt-oss).
    The keys' sum is the plain softmax's reduction, with one term added after it."""
    if sink is None:
        return torch.softmax(scores, -1)
    sink = sink.float()
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    weights = (scores - top).exp_()
    return weights.div_(weights.sum(-1, keepdim=True) + (sink - top).exp())


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
           scale: float, attention: LayerAttention) -> torch.Tensor:
    """Attention computed from its scores, for layers SDPA cannot run (a cap, sinks): queries [B, heads,
    n, D] over keys and values [B, kv_heads, L, D] where `visible` [n, L] (or broadcast to [B, 1, n, L])."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = capped(torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale), attention.softcap)
    sink = attention.sinks.view(1, -1, 1, 1) if attention.sinks is not None else None
    probs = softmax(scores.masked_fill_(~visible, float("-inf")), sink)
    return torch.matmul(probs.to(values.dtype), values)
