"""JSON from clients, read only where every string in it is text.

JSON may spell half of a UTF-16 surrogate pair alone (`"\\ud800"`), and Python decodes that into a `str`
that is not Unicode text: protobuf refuses to encode it, a tokenizer to read it, and a JSON response to
write it back. Left in a request, it would fail deep inside, as a server error that also costs the client
its connection. It is refused where the JSON is read, by the path of the string that holds it.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # where one could come from in text: its escape
_SURROGATE = re.compile("[\ud800-\udfff]")  # a pair is decoded into one character; what is left is alone


class NotText(ValueError):
    """A string of the JSON holds a lone surrogate; `path` names it as pydantic names a field
    ("messages.0.content"; "" for the JSON itself)."""

    def __init__(self, path: str, code_point: int) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}a lone UTF-16 surrogate (\\u{code_point:04x}) is not text; send the character as "
                         "UTF-8, or a character outside the BMP as its pair of escapes")
        self.path = path


def loads(data: str | bytes | bytearray) -> Any:
    """`json.loads(data)`; raises ValueError where it is not JSON, NotText where it holds a lone surrogate.
    Bytes are decoded strictly: `json.loads` would let an encoded surrogate through ("surrogatepass")."""
    text = data if isinstance(data, str) else data.decode(json.detect_encoding(data))
    try:
        value = json.loads(text)
    except RecursionError:  # the decoder recurses once a level: a ValueError like any other mistake
        raise ValueError("nested deeper than Python's recursion limit") from None
    if _ESCAPED_SURROGATE.search(text):  # else no string can hold one: the walk is skipped
        _check(value)
    return value


def _check(value: Any) -> None:
    """Every string of `value` (keys included) is text; walked without recursion, as deep as JSON came."""
    pending: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if found := _SURROGATE.search(item):
                raise NotText(".".join(path), ord(found.group()))
        elif isinstance(item, dict):
            # A key is named by the object that holds it. Reversed: the first mistake is the one named.
            for key, child in reversed(item.items()):
                pending += [(child, (*path, key)), (key, path)]
        elif isinstance(item, list):
            pending += [(child, (*path, str(i))) for i, child in reversed(list(enumerate(item)))]
