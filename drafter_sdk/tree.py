"""Token trees: several candidate continuations in one draft.

A chain draft dies at its first wrong token. A tree lets a drafter that is
unsure between continuations propose them all; the verifier checks every
branch in the same forward pass and keeps the longest path the target agrees
with. On the wire a tree is `draft_tokens` plus `draft_parents` (PROTOCOL.md):
node i's parent is `parents[i]`, -1 for a child of the last committed token,
and parents come before their children, so any prefix of the nodes is itself a
valid tree (trimming to a node budget is a slice).

Both sides use this module: the SDK to check and trim what a drafter returns,
the verifier to refuse what a remote drafter sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TREE_CAPABILITY = "token-tree"
"""GetDrafterInfo capability of a drafter that may answer trees."""

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    """A token tree returned by `Drafter.prepare_draft_tokens` (a plain list is a chain).

    `parents[i]`: index in `tokens` of node i's parent (earlier than i), or -1 for a child of
    the sequence's last committed token. Siblings must carry different tokens.
    """

    tokens: Sequence[int]
    parents: Sequence[int]

    def __len__(self) -> int:
        """Its nodes: an empty tree is falsy, like an empty chain."""
        return len(self.tokens)

    @classmethod
    def from_branches(cls, branches: Iterable[Sequence[int]]) -> DraftTree:
        """Candidate continuations, best first, merged where they share a prefix: the first branch's
        nodes, then each later branch's new ones. So the tree's first nodes are the best candidates'
        (what the verifier's planner assumes) and siblings never repeat a token."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in branches:
            at = ROOT
            for token in branch:
                node = child.get((at, token))
                if node is None:
                    node = child[(at, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(at)
                at = node
        return cls(tokens, parents)


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 for a child of the root); parents must come before children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def tree_problem(tokens: Sequence[int], parents: Sequence[int], max_depth: int, max_nodes: int) -> str:
    """Why this tree cannot be verified ("" if it can): a parent out of range or not before its
    child, a node deeper than `max_depth`, more than `max_nodes` nodes, or siblings sharing a token."""
    if len(parents) != len(tokens):
        return f"{len(parents)} parents for {len(tokens)} draft tokens"
    if len(tokens) > max_nodes:
        return f"{len(tokens)} nodes, above the budget of {max_nodes}"
    depth: list[int] = []
    children: set[tuple[int, int]] = set()
    for i, (token, p) in enumerate(zip(tokens, parents)):
        if not ROOT <= p < i:
            return f"node {i}: parent {p} is not -1 or an earlier node"
        depth.append(1 if p == ROOT else depth[p] + 1)
        if depth[-1] > max_depth:
            return f"node {i}: depth {depth[-1]}, above draft_len {max_depth}"
        if (p, token) in children:
            return f"node {i}: parent {p} already has a child with token {token}"
        children.add((p, token))
    return ""


def trim(tokens: Sequence[int], parents: Sequence[int], max_depth: int,
         max_nodes: int) -> tuple[list[int], list[int]]:
    """The first nodes of a well-formed tree up to `max_nodes`, without those deeper than
    `max_depth` (their descendants go with them); parents renumbered."""
    keep: dict[int, int] = {}  # old index -> new index
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for i, (token, p, d) in enumerate(zip(tokens, parents, depths(parents))):
        if len(out_tokens) == max_nodes:
            break
        if d > max_depth or (p != ROOT and p not in keep):
            continue
        keep[i] = len(out_tokens)
        out_tokens.append(token)
        out_parents.append(ROOT if p == ROOT else keep[p])
    return out_tokens, out_parents


def first_branch(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The chain that follows each node's first child: what a tree reduces to for a verifier
    that asked for a chain."""
    chain: list[int] = []
    at = ROOT
    for i, p in enumerate(parents):
        if p == at:
            chain.append(tokens[i])
            at = i
    return chain


def accepted_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """Node indices of the path that spells `emitted` from the root, as far as it goes (siblings
    carry distinct tokens, so there is at most one such path)."""
    path: list[int] = []
    at = ROOT
    for token in emitted:
        nxt = next((i for i in range(at + 1, len(tokens)) if parents[i] == at and tokens[i] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        at = nxt
    return path
