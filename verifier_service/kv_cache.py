"""Slot-based KV cache: many sequences, per-row appends, O(1) rollback.

Storage is one preallocated tensor per K and V, shaped
[layers, slots, kv_heads, capacity, head_dim]. A running sequence owns one
slot; its valid length is a number, so rolling back rejected draft positions is
setting that number (nothing is copied or freed). Live sequences are kept in
slots 0..n-1 (the last one moves into a freed hole), so a step's batch reads a
contiguous slice and attention gets views, never gathered copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    capacity: int  # tokens per slot

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        elements = 2 * self.num_layers * self.num_kv_heads * self.capacity * self.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        size = (shape.num_layers, shape.num_slots, shape.num_kv_heads, shape.capacity, shape.head_dim)
        # Zero-filled: masked positions are still multiplied, and NaN garbage
        # from uninitialised memory would survive the mask.
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self._owners: list[str] = []  # slot i holds sequence _owners[i]
        self._lengths: list[int] = []

    @property
    def num_active(self) -> int:
        return len(self._owners)

    @property
    def num_free_slots(self) -> int:
        return self.shape.num_slots - len(self._owners)

    def used_tokens(self) -> int:
        return sum(self._lengths)

    def usage(self) -> float:
        """Share of the cache's token capacity holding live entries."""
        return self.used_tokens() / (self.shape.num_slots * self.shape.capacity)

    def allocate(self, seq_id: str) -> int:
        if self.num_free_slots == 0:
            raise RuntimeError("KV cache has no free slot")
        self._owners.append(seq_id)
        self._lengths.append(0)
        return len(self._owners) - 1

    def slot_of(self, seq_id: str) -> int:
        return self._owners.index(seq_id)

    def order(self) -> list[str]:
        """Sequence ids in slot order (batch rows must follow it)."""
        return list(self._owners)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        """Commit `length` valid positions; positions beyond are dropped (rollback)."""
        if not 0 <= length <= self.shape.capacity:
            raise ValueError(f"length {length} outside slot capacity {self.shape.capacity}")
        self._lengths[slot] = length

    def release(self, seq_id: str) -> None:
        slot = self._owners.index(seq_id)
        last = len(self._owners) - 1
        if slot != last:
            n = self._lengths[last]
            self.k[:, slot, :, :n] = self.k[:, last, :, :n]
            self.v[:, slot, :, :n] = self.v[:, last, :, :n]
            self._owners[slot] = self._owners[last]
            self._lengths[slot] = n
        self._owners.pop()
        self._lengths.pop()

    def step_view(self, first_slot: int, starts: torch.Tensor, query_len: int) -> "StepCache":
        """Cache view for one forward over slots first_slot..first_slot+len(starts)-1.

        Row b writes its query_len new positions at starts[b].. and attends to
        positions < max(starts) + query_len (the attention mask narrows it per row).
        """
        rows = starts.shape[0]
        if first_slot + rows > self.num_active:
            raise ValueError("step covers slots that are not allocated")
        if int(starts.max()) + query_len > self.shape.capacity:
            raise ValueError("step writes past a slot's capacity")
        return StepCache(self, first_slot, starts, query_len)


class StepCache:
    """Duck-types the transformers `Cache.update` used by attention layers."""

    def __init__(self, cache: KVCache, first_slot: int, starts: torch.Tensor, query_len: int) -> None:
        rows = starts.shape[0]
        self._k = cache.k[:, first_slot:first_slot + rows]
        self._v = cache.v[:, first_slot:first_slot + rows]
        self._rows = torch.arange(rows, device=starts.device)[:, None].expand(rows, query_len)
        self._pos = starts[:, None] + torch.arange(query_len, device=starts.device)[None, :]
        self.kv_len = int(starts.max()) + query_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._k[layer_idx], self._v[layer_idx]
        # [B, H, T, D] -> [B, T, H, D] to match the advanced-indexed destination.
        k[self._rows, :, self._pos] = key_states.transpose(1, 2).to(k.dtype)
        v[self._rows, :, self._pos] = value_states.transpose(1, 2).to(v.dtype)
        return k[:, :, :self.kv_len], v[:, :, :self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len
