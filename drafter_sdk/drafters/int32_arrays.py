"""int32 arrays as little-endian bytes and back, for the built-in drafters' snapshots of what they learned
(suffix_snapshot.py, ngram_snapshot.py): a snapshot taken on one machine restores on any other."""

from __future__ import annotations

import sys
from array import array


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
