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


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_chunks_beside_decode_and_verify_rows_run_as_a_graph_per_row_length(device: str) -> None:
    """Padded to the chunk's length, one graph of all rows would be over max_tokens (32): the decode and
    verify rows replay as one graph, the chunk as another, and their logits and committed K/V equal the
    packed step's, across chunk sizes, windows, the order of the rows and token trees beside a chunk."""
    rng = random.Random(1)
    eager, graphed = runner(False, device), runner(True, device)
    close = functools.partial(torch.allclose, atol=1e-5 if device == "cpu" else 1e-4)
    committed, last = [0, 0, 0, 0], [0, 0, 0, 0]
    for slot in range(3):  # three running sequences
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(5, 20))]
        logits = eager.forward(ForwardBatch(prompt, [slot], [0], [len(prompt)], [len(prompt) - 1]))
        graphed.forward(ForwardBatch(prompt, [slot], [0], [len(prompt)], [len(prompt) - 1]))
        committed[slot], last[slot] = len(prompt), int(logits[0].argmax())
    long_prompt = [rng.randrange(1, 400) for _ in range(CAPACITY - 40)]
    replays_before = graphed.graphs.replays
    step = 0
    while committed[3] < len(long_prompt):  # slot 3's prompt in chunks of 9 to 16 tokens
        chunk = min(rng.randint(9, 16), len(long_prompt) - committed[3])
        trees = step % 3 == 2  # the drafts random trees (chains among them); the chunk a chain
        step += 1
        rows = [0, 1, 2, 3]  # the chunk's row anywhere among the others
        rng.shuffle(rows)
        drafts = {s: [rng.randrange(1, 400) for _ in range(rng.choice([0, 0, 3]))] for s in rows if s != 3}
        ids, lengths, logit_index, parents, first = [], [], [], [], {}  # first: a slot's first logits row
        for s in rows:
            new = long_prompt[committed[3]:committed[3] + chunk] if s == 3 else [last[s], *drafts[s]]
            first[s] = len(logit_index)
            logit_index += [len(ids) + len(new) - 1] if s == 3 else range(len(ids), len(ids) + len(new))
            parents += range(-1, len(new) - 1) if s == 3 else [-1] + [rng.randrange(i) for i in range(1, len(new))]
            ids += new
            lengths.append(len(new))
        batch = ForwardBatch(ids, rows, [committed[s] for s in rows], lengths, logit_index,
                             parents=parents if trees else [])
        expected = eager.forward(batch)
        for _ in range(2):  # eager at a shape's first sighting, then as its graphs (writing the same K/V)
            assert close(graphed.forward(batch), expected), committed[3]
        committed[3] += chunk
        for s in drafts:
            accepted = 0 if trees else rng.randint(0, len(drafts[s]))  # of a tree, its root (no K/V moves)
            committed[s] += 1 + accepted
            last[s] = int(expected[first[s] + accepted].argmax())
    for s in range(4):
        for cache in ("k", "v"):
            want = getattr(eager.kv_cache, cache)[:, s, :, :committed[s] - 1]
            assert close(getattr(graphed.kv_cache, cache)[:, s, :, :committed[s] - 1], want)
    assert graphed.graphs.replays - replays_before >= 2 * 20  # most steps' two forwards ran as two graphs each


def test_the_graphs_of_a_step_whose_rows_pad_past_max_tokens_group_rows_by_length() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=8, capacity=CAPACITY), model.dtype, model.device)
    graphs = StepGraphs(lambda ids, step: ids, cache, max_tokens=64, capture=False)
    assert graphs.groups([0, 1], [10, 20], [1, 3], []) == [(GraphKey(2, 8, MIN_WINDOW), [0, 1])]  # one graph fits
    # A 40-token chunk beside three decode rows (run as four: rows pad to a power of two): 4 rows of 64
    # tokens would be over 64.
    assert graphs.groups([4, 0, 1, 2], [0, 50, 60, 270], [40, 1, 1, 1], []) == [
        (GraphKey(4, 1, CAPACITY), [1, 2, 3]), (GraphKey(1, 64, MIN_WINDOW), [0])]
    # Decode and verify rows stay together while they fit; a token tree's chunk is a chain, not a tree key.
    tree = [*range(-1, 39), -1, -1, 0, 0, 1, -1]
    assert graphs.groups([4, 0, 1, 2], [0, 50, 60, 70], [40, 1, 4, 1], tree) == [
        (GraphKey(4, 8, MIN_WINDOW, tree=True), [1, 3, 2]), (GraphKey(1, 64, MIN_WINDOW), [0])]
    assert graphs.groups([4, 0, 1, 2], [0, 50, 60, 70], [40, 1, 4, 1], [*range(-1, 39), -1, -1, 0, 1, 2, -1]) == [
        (GraphKey(4, 8, MIN_WINDOW), [1, 3, 2]), (GraphKey(1, 64, MIN_WINDOW), [0])]
    assert graphs.groups([4, 0], [0, 50], [65, 1], []) is None  # a chunk of 65 pads to 128: over 64
    assert graphs.groups(list(range(8)), [0] * 8, [40, 9, 9, 9, 9, 9, 9, 9], []) is None  # 7 rows of 16, as 8: over 64


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


def test_steps_are_captured_ahead_in_one_borrowed_slot_given_back() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=2, capacity=1024), model.dtype, model.device)
    graphs = StepGraphs(lambda ids, step: torch.zeros(1, ids.shape[1], 3), cache, max_tokens=64, max_graphs=4,
                        capture=False)
    shapes = graphs.capture_ahead([(1, n, False) for n in range(1, 10)] + [(1, 5, True), (1, 13, True), (2, 1, False),
                                   (4, 5, False)], max_window=512)
    # windows 256, 512; a row of 1, 8, 16; trees of 8, 16; 2 rows of 1, 4 rows of 8
    assert shapes == 2 * 7 and cache.num_free_slots == 2
    assert graphs.max_graphs == 2 * shapes  # room for them all, kept
    # A first step at one of those shapes, in any slots, runs as its graph.
    for start in (10, 300):
        for n, tree in ((1, False), (2, False), (9, False), (5, True), (13, True)):
            parents = [-1, *range(n - 1)] if tree else []
            assert graphs.hidden_states([1] * n, [1], [start], [n], [n - 1], parents) is not None, (start, n, tree)
        assert graphs.hidden_states([1, 2], [1, 0], [start, start + 5], [1, 1], [0, 1], []) is not None
        assert graphs.hidden_states([1] * 9, [0, 1, 0], [start] * 3, [2, 3, 4], [0, 2, 5], []) is not None
    assert graphs.hidden_states([1], [1], [600], [1], [0], []) is None  # window 1024, not ahead: first sighting


def test_a_verifier_captures_its_batches_plain_and_draft_steps_and_one_sequences_trees_and_chunks_ahead() -> None:
    settings = ServerSettings(max_model_len=600, max_num_seqs=2, max_draft_nodes=12,
                              speculative=spec_config("NGRAM", 4))
    runner = make_runner(tiny_model(), settings, settings.max_model_len)
    runner.graphs = StepGraphs(runner._run_body, runner.kv_cache, settings.cuda_graph_max_tokens, capture=False)
    try:
        capture_graphs_ahead(runner, settings, 64)
        for start in (10, 300):  # windows 256 and 512 (the slots hold 600 tokens)
            # plain, 4 drafts, a tree, prompt chunks of 16, 32 and 64 tokens
            for n, parents in ((1, []), (5, []), (13, [-1, 0, 0, *range(1, 11)]), (9, []), (30, []), (64, [])):
                assert runner.graphs.hidden_states([1] * n, [0], [start], [n], [n - 1], parents) is not None
            for n in (1, 5):  # both sequences decoding, and drafting
                assert runner.graphs.hidden_states([1] * 2 * n, [1, 0], [start, start], [n, n], [n - 1, 2 * n - 1],
                                                   []) is not None
        assert runner.kv_cache.num_free_slots == runner.kv_cache.num_slots
    finally:
        runner.close()


def test_graph_keys() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=8, capacity=CAPACITY), model.dtype, model.device)
    graphs = StepGraphs(lambda ids, step: ids, cache, max_tokens=16, capture=False)
    assert graphs.key([3, 1], [10, 20], [1, 3]) == GraphKey(2, MIN_DRAFT_STEP_LENGTH, MIN_WINDOW)
    assert graphs.key([0], [10], [1]) == GraphKey(1, 1, MIN_WINDOW)  # plain decoding: one token a row
    assert graphs.key([0, 1, 2], [10] * 3, [1] * 3) == GraphKey(4, 1, MIN_WINDOW)  # rows padded to a power of two
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
            capture_graphs_ahead(runner, ServerSettings(speculative=spec_config("NGRAM", 4)), None)
            ahead = graphs.replays
            assert ahead > 0 and runner.kv_cache.num_free_slots == runner.kv_cache.num_slots
            responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, 24),
                                                                 timeout=WAIT_S) for p in prompts])
            assert [list(resp.output.token_ids) for resp in responses] == refs
            assert graphs.replays > ahead

    asyncio.run(main())


def test_a_verifier_prefilling_long_prompts_in_chunks_at_graph_shapes_gives_plain_decodings_outputs() -> None:
    """Long prompts arrive while four sequences decode, under a step budget of the graphs' tokens: their
    chunks run beside the decode rows as a graph per row length, and every output is plain decoding's."""
    rng = random.Random(3)
    short = [repetitive_prompt(s) for s in LOOPING_SEEDS[:4]]
    long = [[rng.randrange(1, 400) for _ in range(n)] for n in (200, 190)]
    refs = [reference_greedy(tiny_model(), p, 40) for p in short + long]

    async def main() -> None:
        async with run_verifier(max_num_seqs=8, max_num_batched_tokens=48) as v:
            engine = engine_of(v)
            graphs = run_at_graph_shapes(engine, max_tokens=64)
            grouped = 0  # steps run as more than one graph
            hidden_states = graphs.hidden_states

            def counted(input_ids: list[int], slots: list[int], starts: list[int], lengths: list[int],
                        logit_index: list[int], parents: list[int]) -> torch.Tensor | None:
                nonlocal grouped
                out = hidden_states(input_ids, slots, starts, lengths, logit_index, parents)
                groups = graphs.groups(slots, starts, lengths, parents)
                grouped += out is not None and groups is not None and len(groups) > 1
                return out

            graphs.hidden_states = counted  # type: ignore[method-assign]

            def generate(p: list[int]) -> asyncio.Future:
                return asyncio.ensure_future(v.stub.Generate(token_request(p, 40), timeout=WAIT_S))

            calls = [generate(p) for p in short]
            while engine.scheduler.num_running < len(short):
                await asyncio.sleep(0.002)
            calls += [generate(p) for p in long]
            responses = await asyncio.gather(*calls)
            assert [list(resp.output.token_ids) for resp in responses] == refs
            # Chunk steps beside the decoding rows once their shapes had been seen (6-7 of about 9 here).
            assert grouped >= 4, grouped

    asyncio.run(main())
