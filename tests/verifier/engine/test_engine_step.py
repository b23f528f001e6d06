"""Engine.step driven directly, with a fake runner and a fake drafter: no gRPC, no model.

The fake runner is a counting model (the next token after t is t + 1), so the
expected output of every step is known, and it records each packed batch; the
fake drafter proposes scripted drafts and records what it was asked and told.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from drafter_sdk.proto import drafter_pb2
from verifier_service.engine.detokenizer import Detokenizer
from verifier_service.engine.engine import Engine
from verifier_service.engine.model_thread import ModelThread
from verifier_service.engine.sampler import SamplingParams
from verifier_service.engine.scheduler import Scheduler
from verifier_service.engine.sequence import (
    FinishReason,
    Output,
    Sequence,
    StoppingParams,
)
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch
from verifier_service.spec_decode.drafter_client import DraftQuery, DraftReply, ReleasedRequest
from verifier_service.spec_decode.policy import SpecState, SpeculationParams, SpeculationPolicy

VOCAB = 64
MAX_MODEL_LEN = 48


class CountingRunner:
    """Logits whose argmax after token t is (t + 1) % VOCAB; every batch is recorded."""

    device = torch.device("cpu")
    vocab_size = VOCAB

    def __init__(self, num_slots: int = 4, fail: bool = False) -> None:
        shape = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=2, num_slots=num_slots,
                             capacity=MAX_MODEL_LEN + 8)
        self.kv_cache = KVCache(shape, torch.float32, self.device)
        self.batches: list[ForwardBatch] = []
        self.fail = fail

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of memory (fake)")
        self.batches.append(batch)
        logits = torch.zeros(len(batch.logit_index), VOCAB)
        for row, position in enumerate(batch.logit_index):
            logits[row, (batch.input_ids[position] + 1) % VOCAB] = 1.0
        return logits

    def close(self) -> None:
        return None


@dataclass
class FakeDrafter:
    """Proposes `propose(query)` for each sequence; records queries, released ids and why."""

    propose_fn: object = None
    queries: list[list[DraftQuery]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    supports_trees: bool = False
    looks_ahead: bool = False  # asked for 2k + 1; its calls are all waited for here (no `send`)

    async def propose(self, queries: list[DraftQuery]) -> DraftReply:
        self.queries.append(queries)
        drafts = [list(self.propose_fn(q))[:q.draft_len] if q.draft_len else [] for q in queries]
        return DraftReply(drafts, [False] * len(queries))

    def release(self, released: list[ReleasedRequest]) -> None:
        self.released += [r.request_id for r in released]
        self.reasons += [r.reason for r in released]

    def sees(self, cache_salt_id: str) -> bool:
        return True

    async def close(self) -> None:
        return None


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def counting(q: DraftQuery) -> list[int]:
    """The counting model's own continuation: every draft token is accepted."""
    return [(q.tokens[-1] + j) % VOCAB for j in range(1, q.draft_len + 1)]


def wrong_after(n: int):  # noqa: ANN201
    """Right for the first n draft tokens, then wrong."""
    return lambda q: counting(q)[:n] + [(q.tokens[-1] + 40) % VOCAB] * q.draft_len


def make_engine(runner: CountingRunner, drafter: FakeDrafter | None, max_draft_len: int = 4,
                **scheduler_options: object) -> Engine:
    policy = SpeculationPolicy(max_draft_len=max_draft_len if drafter else 0)
    options = {"max_num_seqs": runner.kv_cache.num_slots, **scheduler_options}
    scheduler = Scheduler(runner.kv_cache, policy, max_queue_len=8, max_model_len=MAX_MODEL_LEN, **options)
    return Engine(runner, scheduler, drafter, ModelThread())


def sequence(request_id: str, prompt: list[int], max_new_tokens: int, disable: bool = False) -> Sequence:
    return Sequence(request_id=request_id, prompt_ids=prompt, sampling=SamplingParams(),
                    stopping=StoppingParams(max_new_tokens=max_new_tokens),
                    detokenizer=Detokenizer(CharTokenizer()), spec=SpecState(SpeculationParams(disable=disable)))


def drain(seq: Sequence) -> list[Output]:
    outputs = []
    while not seq.outputs.empty():
        outputs.append(seq.outputs.get_nowait())
    return outputs


async def run_steps(engine: Engine, steps: int) -> None:
    for _ in range(steps):
        await engine.step()


def test_plain_decoding_prefills_then_decodes_one_token_per_step() -> None:
    async def main() -> None:
        runner = CountingRunner()
        engine = make_engine(runner, drafter=None)
        seq = sequence("a", [3, 4, 5], max_new_tokens=4)
        engine.submit(seq)
        await run_steps(engine, 4)
        assert seq.output_ids == [6, 7, 8, 9] and seq.finish_reason is FinishReason.LENGTH
        first, second = runner.batches[:2]
        assert (first.input_ids, first.starts, first.lengths, first.logit_index) == ([3, 4, 5], [0], [3], [2])
        # The last committed token goes in at the position after what the slot holds.
        assert (second.input_ids, second.starts, second.lengths) == ([6], [3], [1])
        assert seq.slot is None and runner.kv_cache.num_free_slots == 4
        assert "".join(o.text for o in drain(seq)) == CharTokenizer().decode([6, 7, 8, 9])

    asyncio.run(main())


def test_accepted_drafts_commit_draft_plus_bonus_in_one_forward() -> None:
    async def main() -> None:
        runner, drafter = CountingRunner(), FakeDrafter(counting)
        engine = make_engine(runner, drafter, max_draft_len=4)
        seq = sequence("a", [1, 2], max_new_tokens=11)
        engine.submit(seq)
        await run_steps(engine, 3)  # prefill (1 token), then 5 + 5
        assert seq.output_ids == list(range(3, 14)) and seq.finished
        decode = runner.batches[1]
        assert decode.input_ids == [3, 4, 5, 6, 7] and decode.starts == [2] and decode.lengths == [5]
        assert decode.logit_index == [0, 1, 2, 3, 4]
        assert seq.stats.num_drafts == 2 and seq.stats.num_accepted_tokens == 8
        # Feedback to the drafter: what the previous draft earned.
        assert (drafter.queries[1][0].last_num_drafted, drafter.queries[1][0].last_num_accepted) == (4, 4)
        assert drafter.released == ["a"] and drafter.reasons == [drafter_pb2.RELEASE_REASON_FINISHED]

    asyncio.run(main())


@pytest.mark.parametrize("right", [0, 1, 3])
def test_a_rejected_draft_keeps_the_accepted_prefix_and_the_target_token(right: int) -> None:
    async def main() -> None:
        runner = CountingRunner()
        engine = make_engine(runner, FakeDrafter(wrong_after(right)), max_draft_len=4)
        seq = sequence("a", [10], max_new_tokens=20)
        engine.submit(seq)
        await run_steps(engine, 2)
        assert seq.output_ids == list(range(11, 11 + 1 + right + 1))
        # The next forward starts right after the committed tokens: the rejected positions are overwritten.
        cached = seq.num_cached_tokens
        assert cached == 1 + right + 1
        await engine.step()
        assert runner.batches[2].starts == [cached] and runner.batches[2].input_ids[0] == seq.output_ids[right + 1]

    asyncio.run(main())


def test_a_newcomer_is_prefilled_in_the_same_forward_as_running_decodes() -> None:
    async def main() -> None:
        runner = CountingRunner()
        engine = make_engine(runner, FakeDrafter(counting), max_draft_len=2)
        a, b = sequence("a", [1, 2, 3], 8), sequence("b", [20, 21], 8)
        engine.submit(a)
        await engine.step()
        engine.submit(b)
        await engine.step()
        joint = runner.batches[1]
        # Prefill rows first, then decode rows: b's prompt, then a's last token + its 2-token draft.
        assert joint.input_ids == [20, 21, 4, 5, 6] and joint.lengths == [2, 3]
        assert joint.slots == [b.slot, a.slot] and joint.starts == [0, 3]
        assert joint.logit_index == [1, 2, 3, 4]
        assert a.output_ids == [4, 5, 6, 7] and b.output_ids == [22]

    asyncio.run(main())


def test_a_cancelled_request_frees_its_slot_and_drafter_state_at_the_next_boundary() -> None:
    async def main() -> None:
        runner, drafter = CountingRunner(num_slots=1), FakeDrafter(counting)
        engine = make_engine(runner, drafter)
        a, b = sequence("a", [1], 40), sequence("b", [30], 2)
        engine.submit(a)
        engine.submit(b)  # waits: one slot
        await engine.step()
        assert runner.kv_cache.num_free_slots == 0 and engine.scheduler.num_waiting == 1
        engine.cancel(a)
        await engine.step()  # frees a, admits b in the same boundary
        assert drafter.released == ["a"] and a.slot is None and b.slot is not None
        assert drafter.reasons == [drafter_pb2.RELEASE_REASON_CANCELLED]
        assert runner.batches[-1].input_ids == [30]
        assert a.finish_reason is FinishReason.CANCELLED

    asyncio.run(main())


@pytest.mark.parametrize("looks_ahead", [False, True])
def test_a_disabled_request_is_not_drafted_for_beside_one_that_is(looks_ahead: bool) -> None:
    """A drafter that looks ahead is asked for 2k + 1 tokens (k = 3 verified), never for a disabled request."""
    async def main() -> None:
        runner, drafter = CountingRunner(), FakeDrafter(counting, looks_ahead=looks_ahead)
        engine = make_engine(runner, drafter, max_draft_len=3)
        a, b = sequence("a", [1], 9), sequence("b", [5], 9, disable=True)
        engine.submit(a)
        engine.submit(b)
        await run_steps(engine, 2)
        assert [q.draft_len for q in drafter.queries[0]] == ([7, 0] if looks_ahead else [3, 0])
        assert runner.batches[1].lengths == [4, 1]

    asyncio.run(main())


def test_a_failing_forward_fails_the_running_requests_and_frees_everything() -> None:
    async def main() -> None:
        runner, drafter = CountingRunner(fail=True), FakeDrafter(counting)
        engine = make_engine(runner, drafter)
        seq = sequence("a", [1, 2], 5)
        engine.submit(seq)
        engine.start()
        output = await asyncio.wait_for(seq.outputs.get(), 10)
        assert output.error and seq.slot is None and runner.kv_cache.num_free_slots == 4
        assert drafter.released == ["a"] and not engine.scheduler.has_work()
        assert drafter.reasons == [drafter_pb2.RELEASE_REASON_EVICTED]  # failed, not finished
        await engine.stop()

    asyncio.run(main())


def test_the_default_budget_chunks_prompts_only_beside_decoding_sequences() -> None:
    """A lone prompt goes in whole (no stream to protect); once a sequence decodes, a new prompt is
    chunked to the budget beside its decode row; an explicit budget (no idle one) caps every step."""
    async def main(idle: int | None) -> list[ForwardBatch]:
        runner = CountingRunner()
        engine = make_engine(runner, drafter=None)
        engine.scheduler.max_num_batched_tokens, engine.scheduler.max_idle_batched_tokens = 4, idle
        first = sequence("a", list(range(1, 11)), max_new_tokens=8)
        engine.submit(first)
        await engine.step()
        engine.submit(sequence("b", list(range(1, 11)), max_new_tokens=2))
        await run_steps(engine, 3)
        return runner.batches

    default = asyncio.run(main(idle=32))
    assert default[0].lengths == [10]  # alone: the whole prompt in one step
    # b's chunks (prompts get the budget, however many decode rows; at most 16) beside a's decode row.
    assert [b.lengths for b in default[1:4]] == [[4, 1], [4, 1], [2, 1]]
    explicit = asyncio.run(main(idle=None))
    assert explicit[0].lengths == [4]
