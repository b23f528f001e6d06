"""Values of the benchmarks' flags, checked when parsed: a bad one fails before minutes of work."""

from __future__ import annotations

import argparse


def positive_ints(value: str) -> list[int]:
    """A comma list of integers of at least 1 ("1,4,16"); "" is the empty list."""
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {value!r}") from None
    if any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"every value must be at least 1: {value!r}")
    return numbers
