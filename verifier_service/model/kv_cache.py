"""Slot-based KV cache: many sequences, per-token writes, O(1) rollback.

Storage is one preallocated tensor per K and V, shaped
[layers, slots, kv_heads, capacity, head_dim] (V's last dimension is v_head_dim where a model's values
are narrower than its keys: DeepSeek's multi-head latent attention, kept decompressed). A running sequence owns one
slot; its valid length is its committed length, so rolling back rejected draft
positions costs nothing: the next step writes over them (nothing is copied or
freed). Attention reads a slot's prefix as a view, so no step gathers or copies
cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from drafter_sdk.loading import layer_attention


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    capacity: int  # tokens per slot
    v_head_dim: int | None = None  # the values' head size (narrower than the keys' in latent attention); None: head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @classmethod
    def for_model(cls, config: PretrainedConfig, num_slots: int, capacity: int,
                  tensor_parallel_size: int = 1) -> "KVCacheShape":
        """The shape a transformers model's attention layers write (GQA heads, explicit head_dim; for
        multi-head latent attention, keys of its no-rope and rope parts and values of their own size);
        sharded, each rank writes its KV heads / tensor_parallel_size."""
        cfg = config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim, v_head_dim = layer_attention.kv_head_dims(cfg)
        return cls(num_layers=cfg.num_hidden_layers,
                   num_kv_heads=(getattr(cfg, "num_key_value_heads", None) or heads) // tensor_parallel_size,
                   head_dim=head_dim, num_slots=num_slots, capacity=capacity, v_head_dim=v_head_dim)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elements = self.num_layers * self.num_kv_heads * self.capacity * (self.head_dim + self.value_dim)
        return elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """The storage and its free slots; a sequence keeps the slot it was given (Sequence.slot)
    and how many positions of it are valid (its committed tokens but the last)."""

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        size = (shape.num_layers, shape.num_slots, shape.num_kv_heads, shape.capacity)
        # Zero-filled so that no slot ever holds NaN garbage from uninitialised memory.
        self.k = torch.zeros(*size, shape.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*size, shape.value_dim, dtype=dtype, device=device)
        self._free = list(range(shape.num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.shape.num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.shape.num_slots - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.shape.num_slots * self.shape.capacity

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache has no free slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of slot src into slot dst, every layer at once (prefix caching by copy)."""
        self.k[:, dst, :, :n].copy_(self.k[:, src, :, :n])
        self.v[:, dst, :, :n].copy_(self.v[:, src, :, :n])
