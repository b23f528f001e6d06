"""Slot-based KV cache: many sequences, per-token writes, O(1) rollback.

Storage is one preallocated tensor per K and V, shaped
[layers, slots, kv_heads, capacity, head_dim]. A running sequence owns one
slot; its valid length is a number, so rolling back rejected draft positions is
setting that number (nothing is copied or freed). Attention reads a slot's
prefix as a view, so no step gathers or copies cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    capacity: int  # tokens per slot

    @classmethod
    def for_model(cls, config: PretrainedConfig, num_slots: int, capacity: int) -> "KVCacheShape":
        """The shape a transformers model's attention layers write (GQA heads, explicit head_dim)."""
        cfg = config.get_text_config()
        heads = cfg.num_attention_heads
        return cls(num_layers=cfg.num_hidden_layers,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   num_slots=num_slots, capacity=capacity)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elements = 2 * self.num_layers * self.num_kv_heads * self.capacity * self.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        size = (shape.num_layers, shape.num_slots, shape.num_kv_heads, shape.capacity, shape.head_dim)
        # Zero-filled so that no slot ever holds NaN garbage from uninitialised memory.
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self._free = list(range(shape.num_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self._lengths = [0] * shape.num_slots

    @property
    def num_active(self) -> int:
        return len(self._slots)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def used_tokens(self) -> int:
        return sum(self._lengths[s] for s in self._slots.values())

    def usage(self) -> float:
        """Share of the cache's token capacity holding live entries."""
        return self.used_tokens() / (self.shape.num_slots * self.shape.capacity)

    def allocate(self, seq_id: str) -> int:
        if not self._free:
            raise RuntimeError("KV cache has no free slot")
        slot = self._free.pop()
        self._slots[seq_id] = slot
        self._lengths[slot] = 0
        return slot

    def slot_of(self, seq_id: str) -> int:
        return self._slots[seq_id]

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        """Commit `length` valid positions; positions beyond are dropped (rollback)."""
        if not 0 <= length <= self.shape.capacity:
            raise ValueError(f"length {length} outside slot capacity {self.shape.capacity}")
        self._lengths[slot] = length

    def release(self, seq_id: str) -> None:
        slot = self._slots.pop(seq_id)
        self._lengths[slot] = 0
        self._free.append(slot)
