"""Runs the target model over a batch of rows that share one KV-cache step."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from verifier_service.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """Rows are KV slots first_slot.. in order; row b's tokens go to positions starts[b]..

    Rows are right-padded to one length; logits are computed only at
    `logit_index` (flat indices into rows*length), the positions whose next
    token is needed, which saves the vocabulary projection everywhere else.
    """

    first_slot: int
    input_ids: torch.Tensor  # [B, T] int64
    starts: torch.Tensor  # [B] int64
    logit_index: torch.Tensor  # [N] int64


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.dtype = model.dtype
        self._base = model.base_model
        self._head = model.get_output_embeddings()
        params = inspect.signature(self._base.forward).parameters
        # transformers renamed past_key_values to cache in 5.x.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def vocab_size(self) -> int:
        return self._head.out_features

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Return float32 logits [N, vocab] for batch.logit_index."""
        rows, length = batch.input_ids.shape
        step = self.kv_cache.step_view(batch.first_slot, batch.starts, length)
        positions = batch.starts[:, None] + torch.arange(length, device=self.device)[None, :]
        out = self._base(
            input_ids=batch.input_ids,
            position_ids=positions,
            attention_mask=self._mask(positions, step.kv_len),
            use_cache=True,
            **{self._cache_arg: step},
        )
        hidden = out.last_hidden_state.reshape(rows * length, -1).index_select(0, batch.logit_index)
        return self._head(hidden).float()

    def _mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Additive [B, 1, T, S] mask: a query at position p sees keys at positions <= p."""
        keys = torch.arange(kv_len, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]
