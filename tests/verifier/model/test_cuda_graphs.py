"""The CUDA-graph step (model/cuda_graphs.py): rows padded to a power of two, attention over a
window of each row's slot (an input, as its start is), padding K/V written past a row's real
tokens, token trees' positions and ancestor matrices as inputs. Through prompt chunks and a
speculative decode with rejections, its logits and the KV each sequence commits equal the packed
step's: on the CPU at the graphs' shapes without capture, on CUDA captured and replayed
(`.ci/gpu-check` runs the CUDA-marked tests). A verifier running every step it can that way gives
plain decoding's outputs, and the graphs' keys decide what runs eagerly. Prefix hits and a steady
batch of trees at graph shapes are in tests/verifier/engine (test_prefix_cache.py,
test_tree_verification.py)."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch
from tiny_model import tiny_model
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_at_graph_shapes,
    run_together,
)

from verifier_service.api.cli import parser, settings_from_args
from verifier_service.builder import capture_graphs_ahead, make_runner
from verifier_service.model.cuda_graphs import MIN_DRAFT_STEP_LENGTH, MIN_WINDOW, GraphKey, StepGraphs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.settings import ServerSettings

CAPACITY = 300
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def runner(graphs: bool, device: str, slots: int = 4) -> ModelRunner:
    model = tiny_model().to(device)  # seeded: every call has the same weights
    shape = KVCacheShape.for_model(model.config, num_slots=slots, capacity=CAPACITY)
    r = ModelRunner(model, KVCache(shape, model.dtype, model.device), prepack_weights=False)
    if graphs:
        r.graphs = StepGraphs(r._run_body, r.kv_cache, max_tokens=32, capture=device == "cuda")
    return r


@pytest.mark.parametrize("device", DEVICES)
def test_graph_steps_give_the_packed_steps_logits_and_committed_kv_through_rejections(device: str) -> None:
    """Prompts in chunks, then chains, and every third step token trees, rejected at random positions."""
    rng = random.Random(0)
    eager, graphed = runner(False, device), runner(True, device)
    close = functools.partial(torch.allclose, atol=1e-5 if device == "cpu" else 1e-4)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    committed, last = [], []
    for slot, prompt in enumerate(prompts):  # each prefilled in two chunks, the first with no logits
        cut = len(prompt) // 2
        for batch in (ForwardBatch(prompt[:cut], [slot], [0], [cut], []),
                      ForwardBatch(prompt[cut:], [slot], [cut], [len(prompt) - cut], [len(prompt) - cut - 1])):
            logits = eager.forward(batch)
            for _ in range(2):  # eager at its shape's first sighting, then as its graph (writing the same K/V)
                assert close(graphed.forward(batch), logits)
        committed.append(len(prompt))
        last.append(int(logits[0].argmax()))
    for step in range(60):
        # A changing subset of the sequences, in a changing order: a graph of so many rows serves
        # other slots in its later replays; some keys repeat, some do not.
        rows = [s for s in range(4) if rng.random() < 0.7 or step % 10 < 5] or [0]
        rng.shuffle(rows)
        drafts = {s: [rng.randrange(1, 400) for _ in range(rng.choice([0, 1, 3, 4]))] for s in rows}
        ids, lengths, parents = [], [], []
        trees = step % 3 == 2
        for s in rows:
            ids += [last[s], *drafts[s]]
            lengths.append(1 + len(drafts[s]))
            parents += [-1] + [rng.randrange(i) for i in range(1, lengths[-1])]  # random trees, chains among them
        batch = ForwardBatch(ids, rows, [committed[s] for s in rows], lengths, list(range(len(ids))),
                             parents=parents if trees else [])
        expected = eager.forward(batch)
        assert close(graphed.forward(batch), expected), f"step {step}"
        offset = 0
        for s, n in zip(rows, lengths):
            # Drafts kept, the rest rolled back by length alone; of a tree, its root (no K/V moves).
            accepted = 0 if trees else rng.randint(0, n - 1)
            committed[s] += 1 + accepted
            last[s] = int(expected[offset + accepted].argmax())
            offset += n
        for s in range(4):
            for cache in ("k", "v"):
                want = getattr(eager.kv_cache, cache)[:, s, :, :committed[s] - 1]
                assert close(getattr(graphed.kv_cache, cache)[:, s, :, :committed[s] - 1], want)
    assert graphed.graphs is not None and graphed.graphs.replays > 20
    assert (graphed.graphs.captures > 0) == (device == "cuda")


def test_a_step_runs_as_a_graph_from_its_shapes_second_sighting_and_the_most_recent_are_kept() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=4, capacity=CAPACITY), model.dtype, model.device)
    calls: list[int] = []

    def body(ids: torch.Tensor, step: object) -> torch.Tensor:
        calls.append(ids.shape[1])
        return torch.arange(ids.shape[1], dtype=torch.float32).repeat(3, 1).T[None]  # hidden = padded index

    graphs = StepGraphs(body, cache, max_tokens=16, max_graphs=2, capture=False)

    def run(slots: list[int], lengths: list[int]) -> torch.Tensor | None:
        ids = list(range(sum(lengths)))
        return graphs.hidden_states(ids, slots, [5] * len(slots), lengths, list(range(len(ids))), [])

    assert run([0, 1], [1, 3]) is None  # first sighting: eager
    hidden = run([0, 1], [1, 3])
    assert hidden is not None and calls == [16]  # rows padded to 8 tokens
    assert hidden[:, 0].tolist() == [0, 8, 9, 10]  # packed positions map to row r's padded r*8 + i
    # The same key: other slots, draft lengths changed within a row length.
    assert run([3, 0], [2, 4]) is not None and calls == [16, 16]
    assert run([2], [1]) is None  # a new key: one row
    assert run([3], [1]) is not None  # its graph, in another slot
    assert run([0], [5]) is None and run([0], [5]) is not None  # a third key (one row of 8 tokens)
    assert run([0, 1], [1, 3]) is None  # evicted: two graphs kept, the one-row ones the most recent


def test_one_sequences_steps_are_captured_ahead_and_its_slot_given_back() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=2, capacity=1024), model.dtype, model.device)
    graphs = StepGraphs(lambda ids, step: torch.zeros(1, ids.shape[1], 3), cache, max_tokens=64, capture=False)
    shapes = graphs.capture_ahead(list(range(1, 10)), [5, 13], max_window=512)
    assert shapes == 2 * 5 and cache.num_free_slots == 2  # windows 256, 512; rows of 1, 8, 16; trees of 8, 16
    # A sequence's first step at one of those shapes, in any slot, runs as its graph.
    for start in (10, 300):
        for n, tree in ((1, False), (2, False), (9, False), (5, True), (13, True)):
            parents = [-1, *range(n - 1)] if tree else []
            assert graphs.hidden_states([1] * n, [1], [start], [n], [n - 1], parents) is not None, (start, n, tree)
    assert graphs.hidden_states([1], [1], [600], [1], [0], []) is None  # window 1024, not ahead: first sighting


def test_a_verifier_captures_one_sequences_plain_draft_and_tree_steps_ahead() -> None:
    settings = ServerSettings(max_model_len=600, max_num_seqs=2, max_draft_nodes=12,
                              speculative=spec_config("NGRAM", 4))
    runner = make_runner(tiny_model(), settings, settings.max_model_len)
    runner.graphs = StepGraphs(runner._run_body, runner.kv_cache, settings.cuda_graph_max_tokens, capture=False)
    try:
        capture_graphs_ahead(runner, settings)
        for start in (10, 300):  # windows 256 and 512 (the slots hold 600 tokens)
            for n, parents in ((1, []), (5, []), (13, [-1, 0, 0, *range(1, 11)])):  # plain, 4 drafts, a tree
                assert runner.graphs.hidden_states([1] * n, [0], [start], [n], [n - 1], parents) is not None
        assert runner.kv_cache.num_free_slots == runner.kv_cache.num_slots
    finally:
        runner.close()


def test_graph_keys() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=8, capacity=CAPACITY), model.dtype, model.device)
    graphs = StepGraphs(lambda ids, step: ids, cache, max_tokens=16, capture=False)
    assert graphs.key([3, 1], [10, 20], [1, 3]) == GraphKey(2, MIN_DRAFT_STEP_LENGTH, MIN_WINDOW)
    assert graphs.key([0], [10], [1]) == GraphKey(1, 1, MIN_WINDOW)  # plain decoding: one token a row
    assert graphs.key([0], [10], [2]) == graphs.key([0], [10], [7])  # draft lengths share a graph
    assert graphs.key([0], [200], [5]) == GraphKey(1, 8, 256)
    assert graphs.key([0], [260], [5]) == GraphKey(1, 8, CAPACITY)  # window 512, capped at the slot
    assert graphs.key(list(range(5)), [1] * 5, [1, 1, 1, 1, 4]) is None  # 5 rows of 4 padded tokens: over 16
    assert graphs.key([0], [CAPACITY - 7], [3]) is None  # its padding would write past the slot
    assert graphs.key([0], [CAPACITY - 8], [3]) == GraphKey(1, 8, CAPACITY)
    assert graphs.key([3, 1], [10, 20], [1, 3], tree=True) == GraphKey(2, 8, MIN_WINDOW, tree=True)
    wide = StepGraphs(lambda ids, step: ids, cache, max_tokens=512, capture=False)
    assert wide.key([0], [1], [64], tree=True) is not None
    assert wide.key([0], [1], [65], tree=True) is None  # a tree row's ancestor matrix over 64 x 64
    assert wide.key([0], [1], [65]) is not None


def test_enforce_eager_is_no_graphs() -> None:
    assert settings_from_args(parser().parse_args([])).cuda_graph_max_tokens == 512
    assert settings_from_args(parser().parse_args(["--enforce-eager"])).cuda_graph_max_tokens == 0
    assert settings_from_args(parser().parse_args(["--cuda-graph-max-tokens", "64"])).cuda_graph_max_tokens == 64


def test_a_verifier_running_its_steps_at_graph_shapes_gives_plain_decodings_outputs() -> None:
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:6]]
    refs = [reference_greedy(tiny_model(), p, 24) for p in prompts]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), max_num_seqs=8) as v:
            runner = engine_of(v).runner
            graphs = run_at_graph_shapes(engine_of(v))
            # As at start-up on CUDA: its garbage K/V, left in a slot a request then takes, change nothing.
            capture_graphs_ahead(runner, ServerSettings(speculative=spec_config("NGRAM", 4)))
            ahead = graphs.replays
            assert ahead > 0 and runner.kv_cache.num_free_slots == runner.kv_cache.num_slots
            responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, 24),
                                                                 timeout=WAIT_S) for p in prompts])
            assert [list(resp.output.token_ids) for resp in responses] == refs
            assert graphs.replays > ahead

    asyncio.run(main())
