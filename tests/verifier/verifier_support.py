"""Shared helpers of the verifier engine tests: scripted models, drafters that
record / misbehave / know the answer, spies on the engine, references."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pytest
import torch
from tiny_model import tiny_model, tiny_tokenizer
from verifier_harness import reference_greedy

from drafter_sdk import Drafter, DraftRequest
from drafter_sdk.proto import verifier_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.serve import RunningDrafter, start_server
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.model.cuda_graphs import StepGraphs
from verifier_service.settings import DEFAULTS
from verifier_service.spec_decode.drafter_client import DrafterClient
from verifier_service.spec_decode.transport import InProcessTransport

WAIT_S = 60.0  # generous bound on anything awaited (never a timing assertion)
T = TypeVar("T")



@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, and on a shared machine
    spinning thread pools make it ~20x slower: one thread while our tests run
    (imported by every test module here; other folders keep their setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- models -------------------------------------------------------------------------------------

@functools.cache
def shared_model() -> torch.nn.Module:
    """The harness's tiny random Llama, built once (read-only in every test)."""
    return tiny_model()


@functools.cache
def cached_reference(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(reference_greedy(shared_model(), list(prompt), n))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_token_ids(text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (the tokenizer's single-byte tokens)."""
    tok = tiny_tokenizer()
    table = _bytes_to_unicode()
    ids = tok.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])
    assert None not in ids and tok.unk_token_id not in ids
    return ids


def scripted_model(chain: list[int], scale: float = 20.0, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama whose greedy next token after chain[i] is chain[i + 1] (cyclic).

    Attention and MLP outputs are zeroed, so the last hidden state is the
    token's own embedding; the LM head maps each embedding to its successor.
    `chain` must hold distinct ids.
    """
    assert len(set(chain)) == len(chain), "chain ids must be distinct"
    model = tiny_model(seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        g = torch.Generator().manual_seed(seed)
        emb.copy_(torch.randn(emb.shape, generator=g))
        for i, token in enumerate(chain):
            head[chain[(i + 1) % len(chain)]] = emb[token] / emb[token].norm() * scale
    return model


# Words for text_chain: many distinct tokens of the tiny tokenizer.
CHAIN_WORDS = ("the target model checks every draft in one forward pass and keeps tokens decoding drafts quick brown "
               "fox jumps over lazy dog while seven wizards quietly hex many bold jugglers").split()


@functools.cache
def text_chain() -> tuple[int, ...]:
    """Distinct tokens of CHAIN_WORDS (51) whose text tokenizes back to them, every prefix of it: a chain for
    scripted_model to write a text that a client could send back as text (a prediction)."""
    tok, ids = tiny_tokenizer(), []
    for word in CHAIN_WORDS:
        for t in tok(" " + word, add_special_tokens=False)["input_ids"]:
            if t not in ids and tok(tok.decode([*ids, t]), add_special_tokens=False)["input_ids"] == [*ids, t]:
                ids.append(t)
    return tuple(ids)


# --- drafters -----------------------------------------------------------------------------------

@dataclass
class Call:
    """A snapshot of one PrepareDraftTokens call as the drafter saw it."""

    request_ids: list[str]
    draft_lens: list[int]
    lengths: list[int]
    feedback: list[tuple[int, int]]  # (last_num_drafted, last_num_accepted)
    drafts: list[list[int]] = field(default_factory=list)


class ScriptedDrafter(Drafter):
    """Drafts `propose(request)` and records every call (thread-safe enough for tests)."""

    def __init__(self, propose: Callable[[DraftRequest], list[int]] | None = None) -> None:
        self.propose_fn = propose or (lambda r: [])
        self.calls: list[Call] = []
        self.released: list[tuple[str, str]] = []

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = [list(self.propose(r))[: r.draft_len] if r.draft_len else [] for r in requests]
        self.calls.append(Call([r.request_id for r in requests], [r.draft_len for r in requests],
                               [len(r.tokens) for r in requests],
                               [(r.last_num_drafted, r.last_num_accepted) for r in requests], drafts))
        return drafts

    def propose(self, r: DraftRequest) -> list[int]:
        return self.propose_fn(r)

    def on_release(self, key: tuple[str, str]) -> None:
        self.released.append(key)


class OracleDrafter(ScriptedDrafter):
    """Knows each prompt's greedy continuation and proposes it, corrupting each draft
    position with probability `corrupt` (per prompt overrides in `corrupt_by_prompt`).

    It checks the verifier's feedback: after a draft, the next call for the request
    must report exactly the accepted prefix length greedy verification implies. With `cut_ok`
    (a request whose logits processors ban tokens), the verifier may have verified less of a draft
    than was proposed, never less than was accepted: it cuts what could never be accepted.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], corrupt: float = 0.3, seed: int = 0,
                 corrupt_by_prompt: dict[tuple[int, ...], float] | None = None, vocab_size: int = 400,
                 cut_ok: bool = False) -> None:
        super().__init__()
        self.cut_ok = cut_ok
        self.cuts = 0  # drafts the verifier verified only in part
        self.references = references
        self.corrupt = corrupt
        self.corrupt_by_prompt = corrupt_by_prompt or {}
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.expected: dict[tuple[str, str], tuple[int, int]] = {}  # key -> (drafted, accepted) implied
        self.feedback_errors: list[str] = []
        self.accepted_at: list[int] = []  # positions accepted (0-based) over all drafts
        self.rejected_at: list[int] = []  # position of the first rejection, per draft

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        for r in requests:
            want = self.expected.pop(r.key, None)
            if want is None:
                continue
            cut = self.cut_ok and r.last_num_accepted == want[1] <= r.last_num_drafted < want[0]
            self.cuts += cut
            if not cut and want != (r.last_num_drafted, r.last_num_accepted):
                self.feedback_errors.append(f"{r.request_id}: expected {want}, verifier said "
                                            f"{(r.last_num_drafted, r.last_num_accepted)}")
        return super().prepare_draft_tokens(requests)

    def propose(self, r: DraftRequest) -> list[int]:
        prompt = tuple(r.tokens[: r.prompt_len])
        ref = self.references[prompt]
        done = len(r.tokens) - r.prompt_len
        if list(r.tokens[r.prompt_len:]) != ref[:done]:
            self.feedback_errors.append(f"{r.request_id}: committed tokens left the reference")
            return []
        truth = ref[done:done + r.draft_len]
        rate = self.corrupt_by_prompt.get(prompt, self.corrupt)
        draft = [(t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab if self.rng.random() < rate else t
                 for t in truth]
        accepted = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(draft))
        self.accepted_at.extend(range(accepted))
        if accepted < len(draft):
            self.rejected_at.append(accepted)
        if draft:
            self.expected[r.key] = (len(draft), accepted)
        return draft


@contextlib.asynccontextmanager
async def serve_drafter(drafter: Drafter, port: int = 0) -> AsyncIterator[RunningDrafter]:
    running = await start_server(drafter, host="127.0.0.1", port=port, grace_period_s=0.0)
    try:
        await running.wait_loaded()
        yield running
    finally:
        await running.stop(0)


def in_process_drafter(engine, drafter) -> None:  # noqa: ANN001
    """Swap the engine's drafter for an SDK Drafter run in-process (no network in the loop)."""
    servicer = DrafterServicer(drafter, SequenceStore())
    servicer.load()
    engine.drafter = DrafterClient(InProcessTransport(servicer), engine.drafter.verifier_id,
                                   engine.drafter.vocab_size, deadline_s=float("inf"), overlap_steps=1)


# --- spies on a running engine ------------------------------------------------------------------

@dataclass
class StepRecord:
    forwards: list[tuple[int, int, int]] = field(default_factory=list)  # (rows, width, logits)
    prepares: list[int] = field(default_factory=list)  # sequences per PrepareDraftTokens call
    admitted: int = 0
    prefills: int = 0  # sequences with a prompt chunk in the step (admitted now or earlier)


class EngineSpy:
    """Wraps engine.step, runner.forward and the drafter transport to record each step.

    With `gate` cleared, forward passes block until it is set again (for
    deterministic batch composition); nothing here measures time.
    """

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.current: StepRecord | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.prepare_requests: list = []
        step, forward = engine.step, engine.runner.forward

        schedule = engine.scheduler.schedule

        async def spy_step() -> None:
            self.current = StepRecord()
            await step()
            self.steps.append(self.current)

        def spy_schedule(*price):  # noqa: ANN002, ANN202
            plan = schedule(*price)
            if self.current is not None:
                # Admitted this step: a first chunk (a later chunk of a long prompt starts past its cached part).
                self.current.prefills += len(plan.prefills)
                self.current.admitted += sum(s.num_prefilled == s.cached_prompt_tokens for s in plan.prefills)
            return plan

        def spy_forward(batch):  # noqa: ANN001, ANN202
            assert self.gate.wait(WAIT_S), "test gate never opened"
            if self.current is not None:
                self.current.forwards.append((len(batch.slots), max(batch.lengths), len(batch.logit_index)))
            return forward(batch)

        engine.step = spy_step
        engine.scheduler.schedule = spy_schedule
        engine.runner.forward = spy_forward
        if engine.drafter is not None:
            transport = engine.drafter.transport
            prepare = transport.prepare

            async def spy_prepare(request, timeout_s):  # noqa: ANN001, ANN202
                self.prepare_requests.append(request)
                if self.current is not None:
                    self.current.prepares.append(len(request.sequences))
                return await prepare(request, timeout_s)

            transport.prepare = spy_prepare


async def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` on `loop`: e.g. restart a drafter server of the test's loop from a hook that runs
    on the engine's loop (the model thread)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def wait_until(predicate: Callable[[], bool], what: str, *watch: asyncio.Future,
                     timeout_s: float = WAIT_S) -> None:
    """Poll `predicate`; fail early when a watched call ends with an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        for fut in watch:
            if fut.done() and fut.exception() is not None:
                raise AssertionError(f"a call failed while waiting for {what}") from fut.exception()
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def engine_of(v):  # noqa: ANN001, ANN201
    return v.running.runtime.engine


def run_at_graph_shapes(engine, max_tokens: int = DEFAULTS.cuda_graph_max_tokens) -> StepGraphs:  # noqa: ANN001
    """The CUDA-graph steps without capture (a CPU has none): every step whose shape repeats runs padded
    to its graph's rows and window (model/cuda_graphs.py), as a GPU replays it."""
    runner = engine.runner
    runner.graphs = StepGraphs(runner._run_body, runner.kv_cache, max_tokens, capture=False)
    return runner.graphs


async def stream_all(stub, request: verifier_pb2.GenerateStreamRequest  # noqa: ANN001
                     ) -> list[verifier_pb2.GenerateStreamResponse]:
    return [msg async for msg in stub.GenerateStream(request, timeout=WAIT_S)]


def stream_request(ids: list[int] | None = None, n: int = 16, prompt: str | None = None,
                   **fields: object) -> verifier_pb2.GenerateStreamRequest:
    stopping = fields.pop("stopping", None) or verifier_pb2.StoppingCriteria(max_new_tokens=n)
    source = {"prompt": prompt} if prompt is not None else {"token_ids": verifier_pb2.TokenIds(ids=ids)}
    return verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(**source, stopping=stopping,
                                                                                   **fields))


# Seeds of repetitive_prompt() whose greedy continuation on shared_model() loops,
# so the n-gram drafter gets drafts accepted (found by simulating it offline).
LOOPING_SEEDS = (4, 65, 57, 48, 205, 22, 229, 157, 14, 270, 218, 170, 86, 145, 150, 175)


def repetitive_prompt(seed: int, vocab: int = 400) -> list[int]:
    """A short token pattern repeated 2-6 times."""
    r = random.Random(seed)
    pattern = [r.randrange(1, vocab) for _ in range(r.randint(1, 4))]
    return pattern * r.randint(2, 6)


async def run_together(v, calls: list[Callable[[], asyncio.Future]],  # noqa: ANN001
                       spy: EngineSpy | None = None) -> list:
    """Start every call while the engine is held at its first forward pass, so all
    of them are in the engine (queued or running) before decoding goes on: the
    batch composition no longer depends on how fast the event loop is."""
    engine = engine_of(v)
    spy = spy or EngineSpy(engine)
    spy.gate.clear()
    tasks = [asyncio.ensure_future(call()) for call in calls]
    try:
        await wait_until(lambda: engine.scheduler.num_waiting + engine.scheduler.num_running >= len(calls)
                         or any(t.done() for t in tasks), "all requests to reach the engine")
    finally:
        spy.gate.set()
    return list(await asyncio.gather(*tasks))


class MethodLog(grpc.aio.ServerInterceptor):
    """Records the method of every call a drafter server receives; with `refuse_stream`, serves
    the drafter as one from before PrepareDraftTokensStream (UNIMPLEMENTED)."""

    def __init__(self, refuse_stream: bool = False) -> None:
        self.refuse_stream = refuse_stream
        self.methods: list[str] = []

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method.rsplit("/", 1)[-1]
        self.methods.append(method)
        if self.refuse_stream and method == "PrepareDraftTokensStream":
            return None
        return await continuation(handler_call_details)

    def count(self, method: str) -> int:
        return self.methods.count(method)
