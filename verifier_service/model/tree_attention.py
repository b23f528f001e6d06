"""Token trees in the packed forward: where each node sits and what it may attend to.

A sequence's tree is packed after its last committed token (the root) in
node order, so its keys land in the KV slot at packed order, not at their
positions. Each node gets position id = committed length + its depth (its
rotary position is the one it would have in plain decoding of its path) and
attends to the committed context and to its own ancestors only, never to a
sibling branch. After verification only the accepted path survives: its keys
and values are copied to the contiguous positions plain decoding would have
written (`kv_moves`), which with that position id makes the slot exactly what
plain decoding of the same tokens leaves. Nothing else moves: rejected nodes
lie past the sequence's valid length and are written over by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifier_service.model.kv_cache import KVCache


def is_chain_row(parents: Sequence[int]) -> bool:
    """Row-local parents of a row that is a plain chain (causal attention)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def ancestors(parents: Sequence[int]) -> tuple[list[list[bool]], list[int]]:
    """(seen [n][n]: token i sees token j, its ancestor or itself; each token's depth) for a row of n
    tokens whose row-local parents are `parents` (-1 for the row's first token, the root)."""
    n = len(parents)
    seen: list[list[bool]] = []
    depth: list[int] = []
    for i, p in enumerate(parents):
        row = [False] * n if p < 0 else list(seen[p])
        row[i] = True
        seen.append(row)
        depth.append(0 if p < 0 else depth[p] + 1)
    return seen, depth


def tree_mask(parents: Sequence[int], start: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(mask [n, start + n] bool, position ids) for a row of n tokens whose row-local parents are
    `parents`, written to slot positions start...

    Every token sees the `start` cached tokens and its ancestors (itself included)."""
    seen, depth = ancestors(parents)
    own = torch.tensor(seen, dtype=torch.bool, device=device)
    mask = torch.cat([torch.ones(len(parents), start, dtype=torch.bool, device=device), own], dim=1)
    return mask, [start + d for d in depth]


def path_moves(start: int, path: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) slot positions that put an accepted path in place: `path` lists the accepted
    nodes' indices in the draft, root first excluded; node i was written at start + 1 + i, and
    the node at depth d belongs at start + d. Nodes already in place are not copied."""
    return [(start + 1 + node, start + d) for d, node in enumerate(path, 1) if node + 1 != d]


def apply_kv_moves(cache: KVCache, moves: Sequence[tuple[int, int, int]]) -> None:
    """Copy K/V of every layer from one slot position to another, per (slot, from, to).

    Sources never lie before their destinations and a path's later sources lie after its
    earlier destinations, but the gather happens before the scatter anyway."""
    by_slot: dict[int, tuple[list[int], list[int]]] = {}
    for slot, src, dst in moves:
        srcs, dsts = by_slot.setdefault(slot, ([], []))
        srcs.append(src)
        dsts.append(dst)
    for slot, (srcs, dsts) in by_slot.items():
        src = torch.tensor(srcs, device=cache.k.device)
        dst = torch.tensor(dsts, device=cache.k.device)
        for store in (cache.k, cache.v):
            store[:, slot, :, dst] = store[:, slot, :, src]
