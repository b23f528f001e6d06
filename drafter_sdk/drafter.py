"""The API a drafter author implements: subclass `Drafter`, fill in `prepare_draft_tokens`."""

from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from drafter_sdk.proto import drafter_pb2
from drafter_sdk.tree import DraftTree

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

TOKEN_TYPECODE = "i"  # the `array` type of DraftRequest.tokens: int32, as token ids travel on the wire

Key = tuple[str, str]
"""(verifier_id, request_id): request ids are only unique within one verifier."""

Drafts = Sequence[Sequence[int] | DraftTree]
"""What `Drafter.prepare_draft_tokens` returns: one draft per request, in the requests' order."""

LEARNS_FROM_FINISHED = "learns-from-finished"
"""A capability tag (put it in `Drafter.capabilities`): before releasing a finished request, the
verifier sends its last tokens in a sync-only call, so the drafter holds the whole output."""

LOOKAHEAD = "lookahead"
"""A capability tag (put it in `Drafter.capabilities`) for a drafter whose longer drafts cost it
next to nothing (a lookup, not a model's forwards): the verifier then asks for about twice the
draft it verifies, sends each step's call before its forward and reads the answer after it. What
a step accepted is stripped from the front of that answer, and the rest, if long enough, is the
next step's draft, verified without waiting for a call."""

CACHE_SALT = "cache-salt"
"""A capability tag (put it in `Drafter.capabilities`) for a drafter that learns across requests and
keeps what a salted request taught to requests of the same salt (`DraftRequest.cache_salt_id`): the
verifier sends salted requests only to such drafters. The SDK's server advertises it itself for a
drafter that learns nothing across requests: `learns_across_requests` false and no LEARNS_FROM_FINISHED
in `capabilities`. A drafter that learns across requests some other way (from requests still running)
says so by overriding `learns_across_requests`."""

STREAM_RELEASES = "stream-releases"
"""A capability tag the SDK's server advertises itself: it takes releases on
PrepareDraftTokensStream too, so they reach the replica that holds the state (PROTOCOL.md §2a)."""


class ReleaseReason(enum.IntEnum):
    """Why a drafter forgets a sequence (the wire's ReleaseReason, same values).

    Only FINISHED means the history is a whole, ended output; a drafter that learns from
    outputs ingests those alone. The SDK also says EVICTED when it drops a sequence itself
    (idle, or a context that was replaced or found inconsistent)."""

    UNSPECIFIED = drafter_pb2.RELEASE_REASON_UNSPECIFIED
    FINISHED = drafter_pb2.RELEASE_REASON_FINISHED
    CANCELLED = drafter_pb2.RELEASE_REASON_CANCELLED
    EVICTED = drafter_pb2.RELEASE_REASON_EVICTED


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
    # on the wire. It is the SDK's own compact buffer (an int32 `array`, no copy per
    # step): treat it as a read-only sequence (index, slice, len), not as a list.
    tokens: Sequence[int]
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
    # Its request's cache salt, as an opaque id ("": unsalted). A drafter advertising CACHE_SALT drafts
    # for it only from its own context and what requests of the same id taught, and teaches only them.
    cache_salt_id: str = ""

    @property
    def key(self) -> Key:
        return (self.verifier_id, self.request_id)

    @property
    def prompt_tokens(self) -> Sequence[int]:
        return self.tokens[: self.prompt_len]

    @property
    def generated_tokens(self) -> Sequence[int]:
        return self.tokens[self.prompt_len:]


class Drafter(ABC):
    """Base class of every drafter served by the SDK.

    All user code (`load`, `prepare_draft_tokens`, `on_release`, the `*state_bytes` and
    `*_learned` hooks) runs one call at a time, so drafter state needs no locks: in one
    dedicated worker thread, or, for a `runs_inline` drafter once it has loaded, on the
    server's event loop. (`register_metrics` runs once, before any of them.)

    `prepare_draft_tokens` (and `load`) may be `async def`, for a drafter that awaits other services
    through asyncio clients (a retrieval index, a remote model): the server awaits it on its event loop,
    where the drafter's other hooks then run too (keep them quick, as a `runs_inline` drafter's). Calls
    still run one at a time, each from its deltas to its answer, so state still needs no locks; health
    checks are answered while a call awaits.
    """

    name: str  # defaults to the class name, see __init_subclass__
    version: str = "0.0.0"
    max_draft_len: int = 0  # longest draft this drafter proposes; 0 = no limit
    vocab_size: int = 0  # vocabulary its token ids assume; 0 = any
    tokenizer: str = ""  # tokenizer identity it expects, e.g. a model name; "" = any
    # drafter_sdk.loading.tokenizer_fingerprint of the tokenizer its ids come from; "" = not reported.
    # A verifier with a different one turns speculation off for this drafter.
    tokenizer_fingerprint: str = ""
    capabilities: tuple[str, ...] = ()
    # True for a drafter whose calls take a few milliseconds at most and never wait on I/O (the
    # n-gram and suffix drafters): they then run on the event loop that serves gRPC, which saves a
    # thread hop each way (0.16 ms a call, BENCHMARKS.md), but a slow call stalls health checks and
    # every other call while it runs. `load()` runs on the worker thread either way.
    runs_inline: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    @property
    def is_async(self) -> bool:
        """Whether `prepare_draft_tokens` is `async def`: the server then awaits it on its event loop."""
        return inspect.iscoroutinefunction(self.prepare_draft_tokens)

    def load(self) -> Awaitable[None] | None:
        """Heavy initialisation (weights, indexes, clients). Health reports NOT_SERVING until it returns.
        May be `async def` (awaited on the server's event loop)."""
        return None

    @abstractmethod
    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> Drafts | Awaitable[Drafts]:
        """Return one draft per request, in the same order: a sequence of token ids (a chain: a list,
        or a slice of `tokens`), or, where `max_draft_nodes` allows, a `DraftTree`. May be `async def`
        (see the class's docstring).

        Drafts longer than a request's `draft_len` (or the drafter's
        `max_draft_len`) are trimmed by the SDK, trees to `max_draft_nodes`
        nodes and `draft_len` depth; a tree for a request that wants a chain
        becomes its first branch. An empty list means "no draft".
        """

    def state_bytes(self, key: Key) -> int:
        """Bytes this drafter holds for the sequence `key` (0 by default).

        The SDK adds it to the sequence's held tokens to enforce the memory budget
        (`--max-state-mib`), asking after each draft for the sequences drafted: keep it
        cheap (a running count, not a deep walk). A sequence over the whole budget gets
        `on_release` and no more drafts.
        """
        return 0

    def shared_state_bytes(self) -> int:
        """Bytes held for no single sequence (a public pool, a global index; 0 by default).

        Counted against the budget, so that sequences are evicted to make room for it;
        the drafter itself must keep it bounded.
        """
        return 0

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Where the server exports metrics (`--metrics-port`), called once before it serves: create the
        drafter's own metrics in `registry` (prometheus_client's Counter, Gauge, ... with
        `registry=registry`; the SDK's own are named `splitspec_drafter_*`) and update them from your calls.
        Not called without metrics, nor in-process inside a verifier: leave them unset there."""

    @property
    def learns_across_requests(self) -> bool:
        """Whether `save_learned` has anything to keep; the SDK refuses `--learned-state-file` and `--peers`
        for a drafter that learns nothing from one request for the next. By default: whether the class
        overrides `save_learned`; a drafter that learns only in some configurations says which."""
        return type(self).save_learned is not Drafter.save_learned

    def save_learned(self) -> bytes | None:
        """What this drafter learned across requests (a global index, a public pool) as bytes that
        `restore_learned` takes back in a later process; None (the default): nothing worth keeping.

        With a learned-state file (`--learned-state-file`), the SDK calls it every
        `--save-learned-every-s` seconds and once more at shutdown, and writes what it returns to the
        file; with `--peers`, whenever a starting replica asks for it. Like every hook it runs one call
        at a time, so a `runs_inline` drafter holds the event loop meanwhile: copy what you hold, don't
        compress it here.
        """
        return None

    def restore_learned(self, data: bytes) -> None:
        """Take back what `save_learned` returned, in place of what the drafter holds: in a new process
        after `load()` and before any call, from a file or a peer replica's answer (`--peers`).

        Raise ValueError for data this drafter cannot use (another format, a configuration it does not
        fit): the SDK logs why and the drafter starts empty, which costs speed only.
        """
        raise ValueError(f"{self.name} keeps nothing across requests to restore")

    def on_release(self, key: Key, reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        """Forget any state kept for `key`.

        Called when the verifier released the request (`reason` as it said: FINISHED,
        CANCELLED, EVICTED, or UNSPECIFIED from an older verifier), when it was evicted
        after idling or to keep within the memory budget, and when its context was
        replaced or dropped for a resync (all EVICTED; the next request for the key then
        carries the whole history again).
        An override may leave out `reason` (`def on_release(self, key)`): the SDK then
        calls it with the key alone.
        """

