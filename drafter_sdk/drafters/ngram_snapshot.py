"""The n-gram drafter's public pool as bytes, so that a restarted replica (or a new one, from a peer) starts warm.

A public pool is its token arena (each recorded pattern + continuation, copied once) and, per pattern
size, the offsets of its entries in the arena (with is_keep_all and not is_use_oldest, also of every
distinct window seen). The hash tables themselves are not kept: Python salts its hashes per process, so
restoring inserts the offsets again. What the offsets mean depends on the pool's shape (pattern sizes,
continuation length, the keep-all knobs): a drafter of another shape refuses the snapshot.

Layout, every integer little-endian: MAGIC, the header's length (4 bytes), the header (JSON: version,
shape, the arena's length, each table's entry count), then the arena and each table's offsets (int32),
in the header's order.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from drafter_sdk.drafters import snapshot_format

MAGIC = b"splitspec ngram pool\n"
VERSION = 1


@dataclass(frozen=True)
class Shape:
    """What a pool's entries mean: a drafter restores only a pool of its own shape."""

    max_matching_ngram_size: int
    max_draft_len: int
    is_keep_all: bool
    is_use_oldest: bool


@dataclass
class PoolSnapshot:
    shape: Shape
    arena: array  # int32: every recorded pattern + continuation, as the pool copied them
    patterns: list[array]  # per pattern size 1..k: the arena offsets of its entries
    windows: list[array] | None  # per pattern size, with is_keep_all and not is_use_oldest: every window seen


def encode(snapshot: PoolSnapshot) -> bytes:
    s = snapshot.shape
    header = {
        "max_matching_ngram_size": s.max_matching_ngram_size, "max_draft_len": s.max_draft_len,
        "is_keep_all": s.is_keep_all, "is_use_oldest": s.is_use_oldest,
        "arena": len(snapshot.arena), "patterns": [len(t) for t in snapshot.patterns],
        "windows": None if snapshot.windows is None else [len(t) for t in snapshot.windows],
    }
    parts = [snapshot.arena, *snapshot.patterns, *(snapshot.windows or [])]
    return snapshot_format.pack(MAGIC, VERSION, header, parts)


def decode(data: bytes) -> PoolSnapshot:
    """ValueError for anything but a whole snapshot of this version whose offsets lie in its arena."""
    def parse(header: dict) -> tuple[Shape, int, list[int], list[int] | None]:
        return (Shape(int(header["max_matching_ngram_size"]), int(header["max_draft_len"]),
                      bool(header["is_keep_all"]), bool(header["is_use_oldest"])),
                int(header["arena"]), [int(n) for n in header["patterns"]],
                None if header["windows"] is None else [int(n) for n in header["windows"]])

    (shape, arena_len, pattern_counts, window_counts), reader = snapshot_format.unpack(
        data, MAGIC, VERSION, "an n-gram pool snapshot", parse)
    sizes = shape.max_matching_ngram_size
    if len(pattern_counts) != sizes or (window_counts is not None and len(window_counts) != sizes):
        raise ValueError("a damaged snapshot: a table per pattern size")
    arena = reader.take(arena_len)
    patterns = [reader.take(n) for n in pattern_counts]
    windows = None if window_counts is None else [reader.take(n) for n in window_counts]
    if reader.left:
        raise ValueError("a damaged snapshot: longer than its header says")
    for tables in (patterns, windows or []):  # an entry is a pattern and its whole continuation
        for width, offsets in enumerate(tables, 1 + shape.max_draft_len):
            _check_within(offsets, width, arena_len)
    return PoolSnapshot(shape, arena, patterns, windows)


def _check_within(offsets: array, width: int, arena_len: int) -> None:
    if offsets and (min(offsets) < 0 or max(offsets) + width > arena_len):
        raise ValueError("a damaged snapshot: an entry outside its arena")
