"""The suffix drafter's learned outputs as bytes, so that a restarted drafter starts warm.

What a snapshot holds is what the drafter learned, not how it indexes it: every cached output's
tokens with the scope it was learned in, oldest first, and each scope's learned choice between the
trees (suffix_choice.ChoiceTable). Restoring adds the outputs again in order, so the index may change
between versions without making old snapshots unreadable, and the restoring drafter's own caps
(`max_cached_requests`, `max_cached_mib`) evict the oldest as they would have at the time.

Taking one runs on the drafter's event loop (it serves `runs_inline`), so it copies each scope's
token buffer whole (its outputs as they lie there, separated by -1) instead of output by output:
10,000 outputs of 500 tokens in about 35 ms, most of it allocating the result. Layout, every integer
little-endian: MAGIC, the header's length (4 bytes), the header (JSON: version, cache scope, scope
names, outputs, choice gains), each output's scope index and length (int32 each), then each scope's
buffer (int32), in the header's order.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from drafter_sdk.drafters import snapshot_format

MAGIC = b"splitspec suffix cache\n"
VERSION = 1
SEP = -1  # between a scope's outputs (suffix_index.SEP)


@dataclass
class Scope:
    name: str
    tokens: array  # int32: its outputs, oldest first, each followed by SEP but the last
    lengths: array  # int32: each output's length
    gains: dict[tuple[int, int], float]  # ChoiceTable.gains


@dataclass
class Snapshot:
    cache_scope: str
    scopes: list[Scope]
    order: array  # int32: the scope index of every output, oldest first

    def outputs(self) -> Iterator[tuple[str, array]]:
        """(scope name, tokens) of every output, oldest first."""
        offsets = [0] * len(self.scopes)
        taken = [0] * len(self.scopes)
        for i in self.order:
            scope = self.scopes[i]
            n = scope.lengths[taken[i]]
            yield scope.name, scope.tokens[offsets[i]:offsets[i] + n]
            offsets[i] += n + 1
            taken[i] += 1


def encode(snapshot: Snapshot) -> bytes:
    header = {
        "cache_scope": snapshot.cache_scope, "outputs": len(snapshot.order),
        "scopes": [{"name": s.name, "outputs": len(s.lengths), "tokens": len(s.tokens),
                    "gains": [[own, shared, gain] for (own, shared), gain in s.gains.items()]}
                   for s in snapshot.scopes],
    }
    parts = [snapshot.order, *(s.lengths for s in snapshot.scopes), *(s.tokens for s in snapshot.scopes)]
    return snapshot_format.pack(MAGIC, VERSION, header, parts)


def decode(data: bytes) -> Snapshot:
    """ValueError for anything but a whole snapshot of this version."""
    def parse(header: dict) -> tuple[str, int, list[tuple[str, int, int, dict[tuple[int, int], float]]]]:
        return str(header["cache_scope"]), int(header["outputs"]), [
            (str(s["name"]), int(s["outputs"]), int(s["tokens"]),
             {(int(own), int(shared)): float(gain) for own, shared, gain in s["gains"]})
            for s in header["scopes"]]

    (cache_scope, count, shapes), reader = snapshot_format.unpack(data, MAGIC, VERSION,
                                                                 "a suffix drafter snapshot", parse)
    order = reader.take(count)
    lengths = [reader.take(outputs) for _, outputs, _, _ in shapes]
    scopes = [Scope(name, reader.take(tokens), n, gains) for (name, _, tokens, gains), n in zip(shapes, lengths)]
    if reader.left or any(i < 0 or i >= len(scopes) for i in order) or sorted(order) != sorted(
            i for i, s in enumerate(scopes) for _ in s.lengths):
        raise ValueError("a damaged snapshot: its outputs do not match its header")
    for scope in scopes:
        if not _separated(scope):
            where = f"scope {scope.name!r}" if scope.name else "the global scope"
            raise ValueError(f"a damaged snapshot: the tokens of {where} do not match its outputs")
    return Snapshot(cache_scope, scopes, order)


def _separated(scope: Scope) -> bool:
    """Whether the scope's tokens are its outputs, of their lengths, with SEP between them and nowhere else,
    and no other negative id."""
    tokens, lengths = scope.tokens, scope.lengths
    if any(n <= 0 for n in lengths) or len(tokens) != sum(lengths) + len(lengths) - 1:
        return False
    if tokens.count(SEP) != len(lengths) - 1 or (tokens and min(tokens) < SEP):
        return False
    offset = 0
    for n in lengths[:-1]:
        if tokens[offset + n] != SEP:
            return False
        offset += n + 1
    return True
