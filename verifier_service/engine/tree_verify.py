"""Verifying a token tree: walk from the root along the children the target agrees with.

Row 0 of a tree's logits is the target's next-token distribution after the
last committed token (the root); row 1 + i is its distribution after node i's
path (model/tree_attention.py gives node i exactly the context of that path).
The walk takes one target token per visited node, greedy or sampled
(sampler.py `verify_tree`, where the proof that the sampled walk is lossless
lives), and moves to the child carrying it, or stops there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from drafter_sdk.tree import ROOT, accepted_path, depths
from verifier_service.model.tree_attention import path_moves


def walk(tokens: Sequence[int], parents: Sequence[int], pick: Callable[[int], int]) -> list[int]:
    """From the root: `pick(row)` the target's token at a node (row 0 = the root, 1 + i = node i),
    emit it, move to the child carrying it or stop -> accepted path tokens plus one."""
    children = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    out: list[int] = []
    at: int | None = ROOT
    while at is not None:
        token = pick(at + 1)
        out.append(token)
        at = children.get((at, token))
    return out


def row_parents(draft_parents: Sequence[int]) -> list[int]:
    """Row-local parents of a decode row: the root (last committed token), then the tree's nodes."""
    return [-1, *(p + 1 for p in draft_parents)]


def depth(draft: Sequence[int], parents: Sequence[int]) -> int:
    """Draft tokens the draft could have had accepted: a chain's length, a tree's depth."""
    return max(depths(parents), default=0) if parents else len(draft)


def draft_paths(draft: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The draft tokens up to and including each draft token: a chain's prefixes, a tree node's
    path from the root. Draft row 1 + i stands right after draft_paths(...)[i]."""
    if not parents:
        return [list(draft[:j + 1]) for j in range(len(draft))]
    paths: list[list[int]] = []
    for token, parent in zip(draft, parents):
        paths.append((paths[parent] if parent != ROOT else []) + [token])
    return paths


def cut_draft(draft: list[int], parents: list[int], refused: Callable[[list[int]], bool]
              ) -> tuple[list[int], list[int]]:
    """The draft without the tokens that could never be accepted, `refused(path)` telling for each one,
    its path from the root ending with it: a chain up to its first refused token, a tree without its
    refused nodes and everything below them."""
    if not parents:
        return next((draft[:j] for j, path in enumerate(draft_paths(draft, parents)) if refused(path)), draft), parents
    kept: dict[int, int] = {}  # node -> its index in the cut tree
    tokens: list[int] = []
    new_parents: list[int] = []
    for node, path in enumerate(draft_paths(draft, parents)):
        parent = parents[node]
        if parent != ROOT and parent not in kept:
            continue
        if not refused(path):
            kept[node] = len(tokens)
            tokens.append(draft[node])
            new_parents.append(ROOT if parent == ROOT else kept[parent])
    return tokens, new_parents


def accepted_moves(num_cached: int, draft: Sequence[int], parents: Sequence[int],
                   new_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """The K/V copies (from, to) that put a tree's accepted path where plain decoding writes it;
    none for a chain. `num_cached`: the sequence's cached tokens when the tree was verified."""
    if not parents:
        return []
    return path_moves(num_cached, accepted_path(draft, parents, new_tokens[:-1]))
