"""The API a drafter author implements: subclass `Drafter`, fill in `prepare_draft_tokens`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from drafter_sdk.tree import DraftTree

Key = tuple[str, str]
"""(verifier_id, request_id): request ids are only unique within one verifier."""


@dataclass(frozen=True)
class SamplingHints:
    """How the verifier samples this sequence (temperature 0 is greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class DraftRequest:
    """One sequence of a verifier step, as a drafter sees it."""

    verifier_id: str
    request_id: str
    # The full committed history, prompt first, rebuilt by the SDK from the deltas
    # on the wire. It is the SDK's own buffer (no copy per step): treat it as read-only.
    tokens: list[int]
    prompt_len: int
    # Draft tokens wanted now. 0 means "no draft this step": the request is still
    # passed so a drafter can keep its own state in step, but its draft is dropped.
    draft_len: int
    # Of the previous draft for this sequence: how many tokens were proposed and accepted.
    last_num_drafted: int
    last_num_accepted: int
    sampling: SamplingHints
    # Largest token tree (in nodes) the verifier checks for this sequence; 0: chains only.
    # A tree's depth stays within draft_len. Nonzero only for drafters that list
    # TREE_CAPABILITY in `capabilities`.
    max_draft_nodes: int = 0

    @property
    def key(self) -> Key:
        return (self.verifier_id, self.request_id)

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def generated_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Drafter(ABC):
    """Base class of every drafter served by the SDK.

    All user code (`load`, `prepare_draft_tokens`, `on_release`) runs in one
    dedicated worker thread, one call at a time, so drafter state needs no locks.
    """

    name: str  # defaults to the class name, see __init_subclass__
    version: str = "0.0.0"
    max_draft_len: int = 0  # longest draft this drafter proposes; 0 = no limit
    vocab_size: int = 0  # vocabulary its token ids assume; 0 = any
    tokenizer: str = ""  # tokenizer identity it expects, e.g. a model name; "" = any
    capabilities: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def load(self) -> None:
        """Heavy initialisation (weights, indexes). Health reports NOT_SERVING until it returns."""

    @abstractmethod
    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        """Return one draft per request, in the same order: a list of token ids (a chain), or,
        where `max_draft_nodes` allows, a `DraftTree`.

        Drafts longer than a request's `draft_len` (or the drafter's
        `max_draft_len`) are trimmed by the SDK, trees to `max_draft_nodes`
        nodes and `draft_len` depth; a tree for a request that wants a chain
        becomes its first branch. An empty list means "no draft".
        """

    def on_release(self, key: Key) -> None:
        """Forget any state kept for `key`.

        Called when the verifier released the request, when it was evicted
        after idling, and when its context was replaced or dropped for a resync
        (the next request for the key then carries the whole history again).
        """
