"""The frame of the built-in drafters' snapshots of what they learned (suffix_snapshot.py, ngram_snapshot.py).

A snapshot is its MAGIC, the header's length (4 bytes), the header (JSON: the format's version and what
the drafter says of its arrays), then int32 arrays in the order the header gives; every integer is
little-endian, so a snapshot taken on one machine restores on any other.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def pack(magic: bytes, version: int, header: dict[str, Any], arrays: Iterable[array]) -> bytes:
    encoded = json.dumps({"version": version, **header}).encode()
    return b"".join([magic, len(encoded).to_bytes(4, "little"), encoded, *(little(a) for a in arrays)])


def unpack(data: bytes, magic: bytes, version: int, what: str, parse: Callable[[dict[str, Any]], T]
           ) -> tuple[T, Reader]:
    """`parse` of the header, and a Reader of the arrays after it; ValueError for data that is not `what`
    (e.g. "a suffix drafter snapshot"), another version, or a header `parse` cannot read."""
    if not data.startswith(magic):
        raise ValueError(f"not {what}")
    start = len(magic) + 4
    size = int.from_bytes(data[len(magic):start], "little")
    try:
        header = json.loads(data[start:start + size])
        if header["version"] != version:
            raise ValueError(f"snapshot version {header['version']}, this drafter reads {version}")
        parsed = parse(header)
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a damaged snapshot header ({type(exc).__name__}: {exc})") from None
    return parsed, Reader(memoryview(data)[start + size:])


def little(values: array) -> bytes:
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


class Reader:
    """Takes int32 arrays off `data` in order; ValueError past its end."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> array:
        values = array("i")
        end = self.at + 4 * n
        if n < 0 or end > len(self.data):
            raise ValueError("a damaged snapshot: shorter than its header says")
        values.frombytes(self.data[self.at:end])
        self.at = end
        if sys.byteorder != "little":
            values.byteswap()
        return values

    @property
    def left(self) -> int:
        return len(self.data) - self.at
