"""A short hash that tells whether two tokenizers map text to the same token ids.

Drafts are token ids: they only mean something to a verifier whose tokenizer
gives every token the same id. The fingerprint hashes the whole vocabulary
(token -> id, added tokens included) and the special tokens, so two copies of
one tokenizer agree wherever they were loaded from (folder or GGUF, drafter or
verifier), and a different or re-trained vocabulary does not. Torch-free: it
only needs a Hugging Face style tokenizer object.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

PREFIX = "sha256:"


class HasVocabulary(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


def tokenizer_fingerprint(tokenizer: HasVocabulary | Any) -> str:
    """`sha256:` and 16 hex digits over the sorted vocabulary and the special tokens with their ids."""
    vocab = tokenizer.get_vocab()
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    specials = {role: _with_ids(value, vocab) for role, value in sorted(special.items())}
    payload = json.dumps({"vocab": sorted(vocab.items(), key=lambda item: item[1]), "special": specials},
                         ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return PREFIX + hashlib.sha256(payload.encode()).hexdigest()[:16]


def _with_ids(value: Any, vocab: dict[str, int]) -> Any:
    if isinstance(value, (list, tuple)):
        return [_with_ids(v, vocab) for v in value]
    token = str(value)
    return [token, vocab.get(token)]
