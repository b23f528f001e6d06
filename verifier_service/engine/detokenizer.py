"""Incremental detokenization with stop strings, safe for streaming.

Text is released only when it ends on a whole character (a multi-byte
character split over tokens decodes to U+FFFD until complete), and text that
could be the start of a stop string is held back until it is decided. The text
ends where the stop string begins, or where it ends when it is to be kept (vLLM's
include_stop_str_in_output); nothing after it is released either way.

A request's text is decoded after its prompt's last tokens (CONTEXT_TOKENS), as vLLM primes its
detokenizer: a SentencePiece tokenizer (Llama 2, Mistral) drops the space a word's token carries where a
decode starts ("▁Paris" alone is "Paris", after "▁is" it is " Paris"), so a text decoded alone would
lose the space between the prompt and its first word.

Each token costs one or two decodes of a few ids. A fast tokenizer's `decode` wraps its
Rust decode in Python (argument conversion, batching checks, the clean-up switch) that
cost 7x the decode itself, a fifth of a 64-sequence step's work outside the forward
(BENCHMARKS.md), so where that wrapper would add nothing the Rust decode is called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text
CONTEXT_TOKENS = 5  # the prompt's last tokens a request's text is decoded after (vLLM's initial offset)


def decoder(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """`tokenizer.decode` as a function of a list of ids: the fast tokenizer's own decode where the
    tokenizer's class keeps transformers' `decode` and `_decode` and cleans up no spaces (then they
    return exactly that), else `tokenizer.decode` itself."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer.backend_tokenizer
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: str(tokenizer.decode(ids, skip_special_tokens=skip))  # one list: one str


def partial_start(text: str, marker: str) -> int:
    """How many of the text's last characters could be the start of `marker` (a proper prefix of it):
    text a stream holds back until what follows decides (the HTTP fronts' tool-call tags and reasoning
    markers, as this module holds back a stop string's start)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class Detokenizer:
    """The text of the tokens added, released as it is decided. `context`: the tokens it follows (a prompt's
    last CONTEXT_TOKENS), which are not part of it; one that ends inside a character is not used."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = (), min_tokens: int = 0,
                 include_stop_str: bool = False, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self._decoder = decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._include_stop_str = include_stop_str
        self._min_tokens = min_tokens  # a stop string counts only where it starts after their text
        self._ids = list(context)
        # The decode of ids[_prefix:_read], kept until they move (one decode per token): first, the context's.
        self._before: str | None = self._decode(self._ids) if self._ids else None
        if self._before is not None and self._before.endswith("\ufffd"):
            self._ids, self._before = [], None
        self._num_context = len(self._ids)
        self._prefix = 0  # decode from here for context (merging spaces)
        self._read = self._num_context  # ids before this are already in _text (or are the context)
        self._text = ""  # decided text, up to the stop string (or through it, when kept)
        self._released = 0  # chars of _text handed out
        self._searched = 0  # stop strings cannot start before this index
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self._skip_special_tokens)

    def add(self, token: int) -> None:
        """Append one token; sets `stopped_by` when a stop string completes."""
        self._ids.append(token)
        before = self._decoded_before()
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            self._before = None
            self._find_stop()

    def _decoded_before(self) -> str:
        if self._before is None:
            self._before = self._decode(self._ids[self._prefix:self._read])
        return self._before

    def flush(self) -> None:
        """At the end: release whatever is left, even an incomplete character."""
        if self._read < len(self._ids) and self.stopped_by is None:
            before = self._decoded_before()
            self._text += self._decode(self._ids[self._prefix:])[len(before):]
            self._read = len(self._ids)
            self._before = None
            self._find_stop()

    def _find_stop(self) -> None:
        if not self._stop or self.stopped_by is not None:
            return
        if len(self._ids) - self._num_context <= self._min_tokens:
            self._searched = len(self._text)
            return
        hits = [(i, s) for s in self._stop if (i := self._text.find(s, self._searched)) >= 0]
        if hits:
            index, stop = min(hits)
            self._text = self._text[:index + len(stop) if self._include_stop_str else index]
            self.stopped_by = stop
            return
        self._searched = max(0, len(self._text) - max(len(s) for s in self._stop) + 1)

    def _held_back(self) -> int:
        """Length of the text's tail that is a proper prefix of some stop string."""
        if self.stopped_by is not None or not self._stop:
            return 0
        for n in range(min(len(self._text) - self._searched, max((len(s) for s in self._stop), default=0)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) and s != tail for s in self._stop):
                return n
        return 0

    def take(self, final: bool = False) -> str:
        """Text decided since the last call (everything left when final)."""
        end = len(self._text) if final else len(self._text) - self._held_back()
        if end <= self._released:
            return ""
        out = self._text[self._released:end]
        self._released = end
        return out

    @property
    def text(self) -> str:
        return self._text
