"""The suffix drafter's learned outputs as bytes, so that a restarted drafter starts warm.

What a snapshot holds is what the drafter learned, not how it indexes it: every cached output's
tokens, oldest first, with the scope it was learned in, and each scope's learned choice between the
trees (suffix_choice.ChoiceTable). Restoring adds the outputs again in order, so the index may change
between versions without making old snapshots unreadable, and the restoring drafter's own caps
(`max_cached_requests`, `max_cached_mib`) evict the oldest as they would have at the time.

Layout: MAGIC, a 4-byte little-endian header length, the header (JSON: version, cache scope, scope
names, each output's scope index and length, each scope's choice gains), then every output's tokens
as little-endian int32, in the header's order.
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import dataclass

MAGIC = b"splitspec suffix cache\n"
VERSION = 1


@dataclass
class Snapshot:
    cache_scope: str
    outputs: list[tuple[str, array]]  # (scope, tokens), oldest first
    gains: dict[str, dict[tuple[int, int], float]]  # by scope: ChoiceTable.gains


def encode(snapshot: Snapshot) -> bytes:
    scopes = list(dict.fromkeys([scope for scope, _ in snapshot.outputs] + list(snapshot.gains)))
    index = {scope: i for i, scope in enumerate(scopes)}
    header = json.dumps({
        "version": VERSION, "cache_scope": snapshot.cache_scope, "scopes": scopes,
        "outputs": [[index[scope], len(tokens)] for scope, tokens in snapshot.outputs],
        "gains": {str(index[scope]): [[own, shared, gain] for (own, shared), gain in gains.items()]
                  for scope, gains in snapshot.gains.items()},
    }).encode()
    tokens = array("i")
    for _, output in snapshot.outputs:
        tokens.extend(output)
    if sys.byteorder != "little":
        tokens.byteswap()
    return b"".join([MAGIC, len(header).to_bytes(4, "little"), header, tokens.tobytes()])


def decode(data: bytes) -> Snapshot:
    """ValueError for anything but a whole snapshot of this version."""
    if not data.startswith(MAGIC):
        raise ValueError("not a suffix drafter snapshot")
    start = len(MAGIC) + 4
    size = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + size])
        version = header["version"]
        if version != VERSION:
            raise ValueError(f"snapshot version {version}, this drafter reads {VERSION}")
        scopes = [str(scope) for scope in header["scopes"]]
        lengths = [(scopes[i], int(n)) for i, n in header["outputs"]]
        gains = {scopes[int(i)]: {(int(own), int(shared)): float(gain) for own, shared, gain in pairs}
                 for i, pairs in header["gains"].items()}
        cache_scope = str(header["cache_scope"])
    except (KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a damaged snapshot header ({type(exc).__name__}: {exc})") from None
    payload = memoryview(data)[start + size:]
    if len(payload) != 4 * sum(n for _, n in lengths) or any(n <= 0 for _, n in lengths):
        raise ValueError("a damaged snapshot: its tokens do not match its header")
    tokens = array("i")
    tokens.frombytes(payload)
    if sys.byteorder != "little":
        tokens.byteswap()
    if tokens and min(tokens) < 0:
        raise ValueError("a damaged snapshot: negative token ids")
    outputs, offset = [], 0
    for scope, n in lengths:
        outputs.append((scope, tokens[offset:offset + n]))
        offset += n
    return Snapshot(cache_scope, outputs, gains)
