"""Runs the target model over one packed step of many sequences.

Every sequence's new tokens (a prompt, or the last token plus its draft) are
packed into one row, so the projections and MLP see exactly the tokens that
need computing, with no padding between sequences of different draft lengths.
Attention is the only per-sequence part: each sequence's new keys are written
into its KV slot and its queries attend over a view of that slot.

The packed attention is registered with transformers' AttentionInterface and
falls back to SDPA when called without a splitspec step, so the same model
object still works with transformers' own generate().
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from drafter_sdk.loading import layer_attention
from verifier_service.model import invariant_attention
from verifier_service.model.cuda_graphs import StaticStep, StepGraphs
from verifier_service.model.kv_cache import KVCache
from verifier_service.model.linear_layout import LinearLayouts
from verifier_service.model.logits_head import LogitsHead
from verifier_service.model.tree_attention import apply_kv_moves, is_chain_row, tree_mask

ATTENTION = "splitspec_packed"
STEP_KWARG = "splitspec_step"
# A 4D mask makes transformers skip building its own; packed attention needs none.
_NO_MASK = torch.empty(1, 1, 0, 0)


@dataclass
class ForwardBatch:
    """Row r holds lengths[r] new tokens of the sequence in KV slot slots[r], at positions starts[r]...

    `logit_index` selects the packed positions whose next-token logits are
    needed; the vocabulary projection runs only there.
    """

    input_ids: list[int]
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    logit_index: list[int]
    # (src slot, dst slot, n): copy a cached prefix's first n positions before the forward.
    # Not sent to tensor-parallel followers: with TP the scheduler plans none.
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    # Token trees (model/tree_attention.py): per packed token, the row-local index of the token it
    # follows, -1 for a row's first; empty when no row is a tree. Chain rows keep causal attention.
    parents: list[int] = field(default_factory=list)
    # (slot, from, to) K/V positions to copy before this step writes: earlier accepted tree paths.
    kv_moves: list[tuple[int, int, int]] = field(default_factory=list)


class PackedStep:
    """What the attention layers of one forward need: where to write keys and what to attend to."""

    def __init__(self, cache: KVCache, batch: ForwardBatch, device: torch.device, invariant: bool = False) -> None:
        self.cache = cache
        self.device = device
        self.invariant = invariant  # batch-invariant attention (model/invariant_attention.py)
        self.rows: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        # Computed at a row's first layer that needs them, by (row, sliding window or None): its queries'
        # view of the slot's keys, and where invariant its query blocks.
        self._visible: dict[tuple[int, int | None], torch.Tensor] = {}
        self._query_blocks: dict[tuple[int, int | None], list[invariant_attention.QueryBlock]] = {}
        positions: list[int] = []
        offset = 0
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths):
            if start + n > cache.shape.capacity:
                raise ValueError(f"slot {slot} would hold {start + n} tokens, above its capacity")
            mask = None
            tree = batch.parents[offset:offset + n]
            if tree and not is_chain_row(tree):  # a token tree: context plus own ancestors
                mask, row_positions = tree_mask(tree, start, device)
                positions += row_positions
            else:
                # Queries see keys up to their own position (bottom-right aligned causal). A whole prompt
                # from position 0 needs no mask: SDPA's own causal attention skips the masked blocks (an
                # 1,800-token prompt's attention took half the time, same bits).
                if n > 1 and start > 0 and not invariant:
                    mask = layer_attention.chain_visible(start, n, None, device)
                positions += range(start, start + n)
            self.rows.append((offset, n, slot, start, mask))
            offset += n
        self.positions = torch.tensor([positions], device=device)

    def visible(self, row: int, window: int | None) -> torch.Tensor:
        """[n, start + n] bool: which of its slot's keys each of the row's n queries sees."""
        if (row, window) not in self._visible:
            offset, n, _, start, mask = self.rows[row]
            binding = layer_attention.binding(window, start + n)
            if mask is None:  # causal, left to SDPA
                visible = layer_attention.chain_visible(start, n, binding, self.device)
            elif binding is None:
                visible = mask
            else:  # by position: a tree's node sits at its depth, not at its K/V index
                queries = self.positions[0, offset:offset + n]
                visible = mask & layer_attention.in_window(
                    queries, layer_attention.key_positions(start, queries, start + n), binding)
            self._visible[row, window] = visible
        return self._visible[row, window]

    def query_blocks(self, row: int, window: int | None) -> list[invariant_attention.QueryBlock]:
        if (row, window) not in self._query_blocks:
            offset, n, _, start, mask = self.rows[row]
            binding = layer_attention.binding(window, start + n)
            windowed = (binding, self.positions[0, offset:offset + n]) if binding is not None else None
            self._query_blocks[row, window] = invariant_attention.query_blocks(
                start, n, mask, self.cache.shape.capacity, self.device, windowed)
        return self._query_blocks[row, window]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, attention: layer_attention.LayerAttention = layer_attention.PLAIN
               ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        window = attention.window
        outputs = []
        for i, (offset, n, slot, start, mask) in enumerate(self.rows):
            # A slice copy per sequence: much cheaper than one advanced-index scatter for all.
            k_cache[slot, :, start:start + n] = key[0, :, offset:offset + n]
            v_cache[slot, :, start:start + n] = value[0, :, offset:offset + n]
            if self.invariant:
                outputs.append(invariant_attention.attend(query[0, :, offset:offset + n], k_cache[slot],
                                                          v_cache[slot], self.query_blocks(i, window), scaling,
                                                          attention)[None])
                continue
            if not attention.fused:
                outputs.append(layer_attention.attend(
                    query[:, :, offset:offset + n], k_cache[slot:slot + 1, :, :start + n],
                    v_cache[slot:slot + 1, :, :start + n], self.visible(i, window),
                    scaling if scaling is not None else query.shape[-1] ** -0.5, attention))
                continue
            if layer_attention.binding(window, start + n) is not None:
                mask = self.visible(i, window)
            outputs.append(F.scaled_dot_product_attention(
                query[:, :, offset:offset + n], k_cache[slot:slot + 1, :, :start + n],
                v_cache[slot:slot + 1, :, :start + n], attn_mask=mask, is_causal=mask is None and n > 1,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1]))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return out.transpose(1, 2)  # [1, N, heads, D], as transformers expects


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return step.attend(module.layer_idx, query, key, value, scaling, layer_attention.from_kwargs(kwargs)), None


def _register() -> None:
    # transformers keeps attention functions in a process-wide registry; these
    # entries are pure functions, so registering them again is harmless.
    AttentionInterface.register(ATTENTION, _packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class Peers(Protocol):
    """The other ranks of a tensor-parallel group, seen from rank 0 (model/tensor_parallel.py)."""

    def step(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        """Around each forward: the other ranks run the same batch on their shards."""

    def close(self) -> None:
        """The runner is done: the other ranks stop."""


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv_cache: KVCache, prepack_weights: bool = True,
                 peers: Peers | None = None, cuda_graph_max_tokens: int = 0) -> None:
        _register()
        self.peers = peers
        model.set_attn_implementation(ATTENTION)
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.dtype = model.dtype
        self._base = model.base_model
        self.head = LogitsHead.of(model)
        self._no_mask = _NO_MASK.to(self.device, self.dtype)
        # Where this machine's products allow it (bfloat16 on CPU), every row gets the bits plain
        # decoding gives it: speculation is exact, not only up to the dtype's precision.
        self.batch_invariant = invariant_attention.gemm_is_row_invariant(self.dtype, self.device.type)
        # GPU BLAS handles few-row products well; on CPU the layout is measured (step_costs).
        self.layouts = (LinearLayouts(model, prepack_weights, single_row_alone=not self.batch_invariant)
                        if self.device.type == "cpu" else None)
        # CUDA: steps whose shapes repeat replay as graphs (model/cuda_graphs.py).
        self.graphs = (StepGraphs(self._run_body, kv_cache, cuda_graph_max_tokens)
                       if self.device.type == "cuda" and cuda_graph_max_tokens > 0 else None)

    def close(self) -> None:
        """Give the model back with its own linear layers (it stays usable, e.g. by generate());
        a sharded model's other ranks stop."""
        if self.layouts is not None:
            self.layouts.uninstall()
        if self.peers is not None:
            self.peers.close()

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Return float32 logits [len(logit_index), vocab]."""
        if self.peers is None:
            return self._forward(batch)
        with self.peers.step(batch):
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        apply_kv_moves(self.kv_cache, batch.kv_moves)
        for src, dst, n in batch.copies:
            self.kv_cache.copy_prefix(src, dst, n)
        hidden = (self.graphs.hidden_states(batch.input_ids, batch.slots, batch.starts, batch.lengths,
                                            batch.logit_index, batch.parents)
                  if self.graphs is not None else None)
        if hidden is None:
            step = PackedStep(self.kv_cache, batch, self.device, self.batch_invariant)
            ids = torch.tensor([batch.input_ids], device=self.device)
            # long: may be empty (only mid-prompt chunks this step)
            index = torch.tensor(batch.logit_index, dtype=torch.long, device=self.device)
            hidden = self._run_body(ids, step)[0].index_select(0, index)
        return self.head(hidden)

    def _run_body(self, input_ids: torch.Tensor, step: PackedStep | StaticStep) -> torch.Tensor:
        """The model without its head over packed ids [1, N]: last hidden states [1, N, hidden]."""
        out = self._base(input_ids=input_ids, position_ids=step.positions, attention_mask=self._no_mask,
                         use_cache=False, **{STEP_KWARG: step})
        return out.last_hidden_state
