"""Attention whose every query row gets the same bits however many rows share its forward.

Speculative decoding is exact only if a token verified as row i of a draft gets
the logits plain decoding computes for it alone. In float32 SDPA's kernels for
one query and for seventeen differ in the last bits, too little to flip a
choice in any run here. In bfloat16 they differ by whole rounding steps, and
about half of the speculative outputs left plain decoding's at a near tie.

On a CPU whose bfloat16 matrix products give a row the same bits whatever the
number of rows (`gemm_is_row_invariant` checks, once per process), attention
built from those products is invariant too: scores as one bfloat16 product,
the softmax in float32 over keys padded to a multiple of KEY_BLOCK (masked: a
row's sum only ever gains exact zeros, in whole blocks), and the values as a
second product. The linear layers do their part by never multiplying a
single row (linear_layout.py), the one product that takes another kernel.
Long prompts are computed QUERY_BLOCK queries at a time, each block against
the keys it can see, which bounds the score matrix and skips most masked
blocks.

Chains, chunked prefill and prefix-cache hits are invariant. A token tree is
not: a node's ancestors sit at other key positions than in plain decoding
(siblings between them), and the reductions group their terms by position.
A bench run put one of two code prompts off plain decoding under trees; their
nodes stay exact only up to bfloat16's rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from drafter_sdk.loading import layer_attention

KEY_BLOCK = 64
QUERY_BLOCK = 256


@functools.cache
def gemm_is_row_invariant(dtype: torch.dtype, device_type: str) -> bool:
    """Whether this machine's matrix products of `dtype` give each row the same bits for 1-17 rows
    (1 computed as 2) and for key lengths padded with zeros: the condition of this module."""
    if device_type != "cpu" or dtype != torch.bfloat16:
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 17, 64, generator=gen).to(dtype)
    k = torch.randn(3, 300, 64, generator=gen).to(dtype)
    w = torch.randn(576, 64, generator=gen).to(dtype)
    full = torch.matmul(q, k.transpose(-1, -2))
    probs = torch.softmax(full.float(), -1).to(dtype)
    probs[..., 250:] = 0
    out = torch.matmul(probs, k)
    linear = torch.nn.functional.linear(q[0], w)
    for rows in (2, 3, 8):
        if not (torch.equal(torch.matmul(q[:, :rows], k.transpose(-1, -2)), full[:, :rows])
                and torch.equal(torch.matmul(probs[:, :rows], k), out[:, :rows])
                and torch.equal(torch.nn.functional.linear(q[0, :rows], w), linear[:rows])):
            return False
    return torch.equal(torch.matmul(probs[:, :, :256], k[:, :256]), out)


@dataclass(frozen=True)
class QueryBlock:
    """Queries first..last of a row and the keys they attend to, laid out once per forward for every
    layer."""

    first: int
    last: int
    length: int  # keys multiplied: those visible, padded to a whole KEY_BLOCK (within the slot)
    visible: torch.Tensor  # [rows, length] bool; a lone query's row twice, as the query goes in twice


def query_blocks(start: int, n: int, tree: torch.Tensor | None, capacity: int, device: torch.device,
                 windowed: tuple[int, torch.Tensor] | None = None) -> list[QueryBlock]:
    """The blocks of `n` new queries at positions start.. in a slot of `capacity` keys: causal, or for
    a token tree the mask `tree` [n, start + n]; with `windowed`, (a sliding window, the queries'
    positions [n]), only the keys within the window too."""
    out = []
    for first in range(0, n, QUERY_BLOCK):
        last = min(first + QUERY_BLOCK, n)
        length = min(-(-(start + last) // KEY_BLOCK) * KEY_BLOCK, capacity)
        if tree is None:
            positions = torch.arange(length, device=device)
            visible = positions[None, :] <= start + torch.arange(first, last, device=device)[:, None]
        else:
            visible = torch.zeros(last - first, length, dtype=torch.bool, device=device)
            width = min(tree.shape[1], length)  # a node sees no key after its own
            visible[:, :width] = tree[first:last, :width]
        if windowed is not None:
            window, positions = windowed
            keys = layer_attention.key_positions(start, positions, length)
            visible = visible & layer_attention.in_window(positions[first:last], keys, window)
        if last - first == 1:  # one query alone would take another kernel: computed twice
            visible = visible.expand(2, -1)
        out.append(QueryBlock(first, last, length, visible))
    return out


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: list[QueryBlock],
           scaling: float | None, attention: layer_attention.LayerAttention = layer_attention.PLAIN) -> torch.Tensor:
    """Attention of `n` new queries [heads, n, D] over a KV slot's keys [kv_heads, capacity, D] and
    values [kv_heads, capacity, Dv] (the new ones written), block by block (`query_blocks`, which carry
    a sliding window). Returns [heads, n, Dv]."""
    heads, n, dim = query.shape
    kv_heads = keys.shape[0]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    grouped = query.view(kv_heads, heads // kv_heads, n, dim)  # the query heads that share each KV head
    sink = attention.sinks.view(kv_heads, heads // kv_heads, 1, 1) if attention.sinks is not None else None
    out = []
    for block in blocks:
        length, rows = block.length, block.visible.shape[0]
        q = grouped[:, :, block.first:block.last].expand(-1, -1, rows, -1)
        scores = torch.matmul(q.reshape(kv_heads, -1, dim), keys[:, :length].transpose(-1, -2))
        scores = scores.float().mul_(scale).view(kv_heads, -1, rows, length)
        scores = layer_attention.capped(scores, attention.softcap).masked_fill_(~block.visible, float("-inf"))
        probs = layer_attention.softmax(scores, sink).to(values.dtype)
        result = torch.matmul(probs.view(kv_heads, -1, length), values[:, :length])
        out.append(result.view(kv_heads, -1, rows, values.shape[-1])[:, :, :block.last - block.first])
    result = out[0] if len(out) == 1 else torch.cat(out, dim=2)
    return result.reshape(heads, n, values.shape[-1])
