"""Token trees: verified in one packed forward, exactly.

At the runner: a tree packed beside a prefill and a chain gives, at every node, the logits
plain decoding gives after that node's path, and after acceptance the slot's K/V equal plain
decoding's (tensors compared). Through the servers: greedy outputs equal generate() with
trees whose correct path is not the first branch, trees with every branch wrong, and chains,
in batches with prefills; invalid trees of every kind are discarded and change nothing;
sampling keeps the target's distribution (chi-square, adversarial trees) and a seed's output.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import random

import pytest
import torch
from test_verifier_sampling import (
    ALPHA,
    PARAMS,
    TRANS,
    V,
    chi_square_p,
    exact_joint,
    sampled_request,
)
from tiny_model import tiny_tokenizer
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    cached_reference,
    engine_of,
    in_process_drafter,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_at_graph_shapes,
    run_together,
    shared_model,
    wait_until,
)

from drafter_sdk import Drafter, DraftRequest
from drafter_sdk.proto import drafter_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree, accepted_path
from verifier_service.engine import tree_verify
from verifier_service.engine.sampler import SamplingParams, VerifyRow, verify_batch, verify_tree
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.model.tree_attention import apply_kv_moves
from verifier_service.spec_decode.config import ConfigError, validate
from verifier_service.spec_decode.drafter_client import DeltaHistory, DrafterClient, DraftQuery
from verifier_service.spec_decode.transport import InProcessTransport

GREEDY = SamplingParams()


def wrong(token: int, k: int = 1) -> int:
    return (token + 7 * k) % len(tiny_tokenizer())


def tree_around(truth: list[int], shape: str, rng: random.Random) -> DraftTree:
    """A tree holding `truth` as one path (or not at all), with decoy branches."""
    tokens: list[int] = []
    parents: list[int] = []

    def add(token: int, parent: int) -> int:
        tokens.append(token)
        parents.append(parent)
        return len(tokens) - 1

    if shape == "all-wrong":
        for j in range(3):
            node = add(wrong(truth[0], j + 1), -1)
            add(wrong(truth[1] if len(truth) > 1 else 0, j + 5), node)
        return DraftTree(tokens, parents)
    at = -1
    for depth, token in enumerate(truth):  # a decoy first at every level, then the true child
        decoy = add(wrong(token), at)
        if rng.random() < 0.5:
            add(wrong(token, 3), decoy)
        at = add(token, at)
    if shape == "cut":  # the true path's last node is wrong: accepted up to its parent
        tokens[at] = wrong(tokens[at], 2)
    return DraftTree(tokens, parents)


# --- at the runner: logits and K/V -----------------------------------------------------------

def plain_steps(runner: ModelRunner, slot: int, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding in `slot`: n tokens and the logits each was chosen from."""
    logits = runner.forward(ForwardBatch(prompt, [slot], [0], [len(prompt)], [len(prompt) - 1]))
    tokens, rows = [int(logits[0].argmax())], [logits[0]]
    for _ in range(n - 1):
        start = len(prompt) + len(tokens) - 1
        logits = runner.forward(ForwardBatch([tokens[-1]], [slot], [start], [1], [0]))
        tokens.append(int(logits[0].argmax()))
        rows.append(logits[0])
    return tokens, rows


def test_tree_rows_in_a_mixed_forward_match_plain_decoding_and_leave_its_kv() -> None:
    torch.manual_seed(0)
    model = shared_model()
    shape = KVCacheShape.for_model(model.config, num_slots=4, capacity=96)
    runner = ModelRunner(model, KVCache(shape, model.dtype, model.device), prepack_weights=False)
    cache = runner.kv_cache
    try:
        prompt = repetitive_prompt(LOOPING_SEEDS[1])[:20]
        ref, ref_logits = plain_steps(runner, 0, prompt, 6)
        # Slot 1 holds the prompt; its tree (true path = 2nd branch at every level) goes in one forward
        # with a chain in slot 2 and a new prompt in slot 3.
        for slot in (1, 2):
            runner.forward(ForwardBatch(prompt, [slot], [0], [len(prompt)], [len(prompt) - 1]))
        tree = tree_around(ref[1:5], "path", random.Random(1))
        chain = ref[1:3] + [wrong(ref[3])]
        other = repetitive_prompt(LOOPING_SEEDS[2])[:9]
        start = len(prompt) - 1
        root = [ref[0]]
        row_tree = tree_verify.row_parents(tree.parents)
        ids = other + root + list(tree.tokens) + root + chain
        n_tree = len(tree.tokens) + 1
        batch = ForwardBatch(
            ids, [3, 1, 2], [0, start + 1, start + 1], [len(other), n_tree, len(chain) + 1],
            [len(other) - 1, *range(len(other), len(other) + n_tree),
             *range(len(other) + n_tree, len(ids))],
            parents=[*range(-1, len(other) - 1), *row_tree, *range(-1, len(chain))])
        logits = runner.forward(batch)
        rows = [VerifyRow([], GREEDY, None), VerifyRow(list(tree.tokens), GREEDY, None, list(tree.parents)),
                VerifyRow(chain, GREEDY, None)]
        out = verify_batch(logits, rows)
        assert out[1] == ref[1:6], "the tree's true path and the bonus token"
        assert out[2] == ref[1:4], "the chain row beside it"
        path = accepted_path(tree.tokens, tree.parents, out[1][:-1])
        assert [tree.tokens[i] for i in path] == ref[1:5] and path != list(range(4))
        for depth, node in enumerate([-1, *path]):
            assert torch.allclose(logits[1 + 1 + node], ref_logits[1 + depth], atol=1e-4), f"depth {depth}"
        # The accepted path's K/V moved (copying the path only) equal plain decoding's K/V.
        moves = tree_verify.accepted_moves(start + 1, tree.tokens, tree.parents, out[1])
        assert 0 < len(moves) <= len(path)
        apply_kv_moves(cache, [(1, a, b) for a, b in moves])
        valid = len(prompt) + 5  # prompt, the root and the 4 accepted tokens: what slot 0 wrote one by one
        assert torch.allclose(cache.k[:, 1, :, :valid], cache.k[:, 0, :, :valid], atol=1e-4)
        assert torch.allclose(cache.v[:, 1, :, :valid], cache.v[:, 0, :, :valid], atol=1e-4)
        assert not torch.allclose(cache.k[:, 1, :, valid - 1], cache.k[:, 1, :, valid], atol=1e-4)
    finally:
        runner.close()


def test_the_walk_on_a_chain_equals_chain_verification() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    target = logits.argmax(-1).tolist()
    for draft in ([target[0], target[1], 5, 6], target[:4], [wrong(target[0])]):
        chain_parents = list(range(-1, len(draft) - 1))
        rows = logits[:len(draft) + 1]
        assert verify_tree(rows, VerifyRow(draft, GREEDY, None, chain_parents)) == \
            verify_batch(rows, [VerifyRow(draft, GREEDY, None)])[0]


# --- through the servers ---------------------------------------------------------------------

class TreeOracle(Drafter):
    """Knows each prompt's greedy continuation; answers trees of the shapes cycled through (and
    a chain for every third prompt), each within the budget it is given."""

    capabilities = (TREE_CAPABILITY,)

    def __init__(self, references: dict[tuple[int, ...], list[int]], shapes: tuple[str, ...], seed: int = 0) -> None:
        self.references = references
        # Not by request id: ids are random, and so would be how many trees a test sees.
        self.chains = {prompt: i % 3 == 2 for i, prompt in enumerate(references)}
        self.shapes = shapes
        self.rng = random.Random(seed)
        self.budgets: list[int] = []
        self.trees = 0

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for r in requests:
            prompt = tuple(r.tokens[:r.prompt_len])
            ref = self.references[prompt]
            truth = ref[len(r.tokens) - r.prompt_len:][:r.draft_len]
            self.budgets.append(r.max_draft_nodes)
            if not r.draft_len or not truth:
                out.append([])
            elif self.chains[prompt] or not r.max_draft_nodes:
                out.append(truth[:-1] + [wrong(truth[-1])])
            else:
                self.trees += 1
                out.append(tree_around(truth, self.rng.choice(self.shapes), self.rng))
        return out


PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:6]] + [repetitive_prompt(s) for s in range(300, 306)]


def test_greedy_trees_in_mixed_batches_equal_generate() -> None:
    lengths = [random.Random(i).randint(5, 26) for i in range(len(PROMPTS))]
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(PROMPTS, lengths)]
    oracle = TreeOracle({tuple(p): r for p, r in zip(PROMPTS, refs)}, ("path", "all-wrong", "cut"), seed=5)

    async def main() -> list:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_draft_nodes=12) as v:
            engine = engine_of(v)
            in_process_drafter(engine, oracle)
            await engine.drafter.connect()
            # Staggered: later requests are prefilled while earlier ones verify trees and chains.
            calls = [v.stub.Generate(token_request(p, n), timeout=WAIT_S) for p, n in zip(PROMPTS, lengths)]
            first = [asyncio.ensure_future(c) for c in calls[:6]]
            await wait_until(lambda: engine.decode_steps >= 2, "a few decode steps", *first)
            rest = [asyncio.ensure_future(c) for c in calls[6:]]
            return list(await asyncio.gather(*first, *rest))

    responses = asyncio.run(main())
    for i, (r, ref) in enumerate(zip(responses, refs)):
        assert list(r.output.token_ids) == ref, f"prompt {i}"
    assert oracle.trees > 10 and set(oracle.budgets) >= {12}
    stats = [r.output.stats for r in responses]
    assert sum(s.num_draft_nodes for s in stats) > sum(s.num_draft_tokens for s in stats), "trees counted by node"
    assert sum(s.num_accepted_tokens for s in stats) > 10


class AlternatingOracle(TreeOracle):
    """Every prompt drafts trees and chains by turns, all at once: steps of trees, then of chains only."""

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        chains = not next(iter(self.chains.values()))
        self.chains = dict.fromkeys(self.chains, chains)
        return super().prepare_draft_tokens(requests)


def test_steps_of_trees_and_of_chains_at_cuda_graph_shapes_equal_generate() -> None:
    """A steady batch whose steps' shapes repeat, trees and chains by turns, at CUDA-graph shapes
    (model/cuda_graphs.py, without capture): most steps run padded as their graph would, trees with
    their positions and ancestor matrices as inputs, and the K/V moves of a step's accepted paths land
    before the next step writes its padding."""
    prompts = PROMPTS[:4]
    refs = [list(cached_reference(tuple(p), 48)) for p in prompts]
    oracle = AlternatingOracle({tuple(p): r for p, r in zip(prompts, refs)}, ("all-wrong", "cut"), seed=3)

    async def main() -> tuple[list, int]:
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_draft_nodes=12) as v:
            engine = engine_of(v)
            graphs = run_at_graph_shapes(engine)
            in_process_drafter(engine, oracle)
            await engine.drafter.connect()
            responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, 48),
                                                                 timeout=WAIT_S) for p in prompts])
            return responses, graphs.replays

    responses, replays = asyncio.run(main())
    assert [list(r.output.token_ids) for r in responses] == refs
    assert oracle.trees > 10 and replays >= 4


class Corrupting(InProcessTransport):
    """An in-process drafter whose answers are rewritten into invalid trees, one kind per call."""

    KINDS = ("parent-out-of-range", "parent-after-child", "too-deep", "too-many-nodes", "same-token-siblings",
             "length-mismatch", "tree-for-a-chain")

    def __init__(self, servicer: DrafterServicer) -> None:
        super().__init__(servicer)
        self.calls = 0

    async def prepare(self, request, timeout_s):  # noqa: ANN001, ANN201
        response = await super().prepare(request, timeout_s)
        self.calls += 1
        kind = self.KINDS[self.calls % len(self.KINDS)]
        for seq, result in zip(request.sequences, response.results):
            d = seq.draft_len or 1
            tokens = [5, 6] + [7] * d
            parents = {"parent-out-of-range": [-1, 9] + [0] * d, "parent-after-child": [1, -1] + [0] * d,
                       "too-deep": list(range(-1, d + 1)), "same-token-siblings": [-1, -1] + [0] * d,
                       "length-mismatch": [-1], "tree-for-a-chain": [-1, -1] + [0] * d,
                       "too-many-nodes": [-1, -1] + [0] * d}[kind]
            if kind == "same-token-siblings":
                tokens[1] = 5
            if kind == "too-many-nodes":
                tokens = [5, 6] + list(range(10, 10 + 40))
                parents = [-1, -1] + [0] * 40
            if kind == "tree-for-a-chain":
                seq.max_draft_nodes = 0
            del result.draft_tokens[:], result.draft_parents[:]
            result.draft_tokens.extend(tokens)
            result.draft_parents.extend(parents)
        return response


def test_invalid_trees_of_every_kind_are_discarded_and_change_nothing() -> None:
    prompts, lengths = PROMPTS[:4], [14] * 4
    refs = [list(cached_reference(tuple(p), n)) for p, n in zip(prompts, lengths)]

    async def main() -> tuple[list, DrafterClient, Corrupting]:
        async with run_verifier(spec_config("NGRAM", 3), model=shared_model(), max_draft_nodes=8) as v:
            engine = engine_of(v)
            servicer = DrafterServicer(TreeOracle({tuple(p): r for p, r in zip(prompts, refs)}, ("path",)),
                                       SequenceStore())
            servicer.load()
            transport = Corrupting(servicer)
            client = DrafterClient(transport, "v", engine.drafter.vocab_size, deadline_s=float("inf"),
                                   overlap_steps=1)
            client.breaker.record_failure = lambda: None  # keep asking: every call brings another kind
            await client.connect()
            engine.drafter = client
            responses = await run_together(v, [functools.partial(v.stub.Generate, token_request(p, n),
                                                                 timeout=WAIT_S) for p, n in zip(prompts, lengths)])
            return responses, client, transport

    responses, client, transport = asyncio.run(main())
    for r, ref in zip(responses, refs):
        assert list(r.output.token_ids) == ref
        assert r.output.stats.num_accepted_tokens == 0 and r.output.stats.num_drafter_failures > 0
    assert transport.calls >= len(Corrupting.KINDS)
    assert client.stats.invalid_trees > 0 and client.stats.failures >= transport.calls - 1


@pytest.mark.parametrize("kind", ["parent-out-of-range", "parent-after-child", "too-deep", "too-many-nodes",
                                  "same-token-siblings", "tree-for-a-chain", "length-mismatch"])
def test_the_client_discards_each_kind_of_invalid_tree(kind: str) -> None:
    tokens, parents, nodes = [5, 6, 7], [-1, -1, 0], 4
    if kind == "parent-out-of-range":
        parents = [-1, 5, 0]
    elif kind == "parent-after-child":
        parents = [-1, 2, 0]
    elif kind == "too-deep":
        tokens, parents = [5, 6, 7, 8], [-1, 0, 1, 2]  # depth 4 > draft_len 3
    elif kind == "too-many-nodes":
        tokens, parents = [5, 6, 7, 8, 9], [-1, -1, 0, 0, 1]
    elif kind == "same-token-siblings":
        tokens = [5, 5, 7]
    elif kind == "tree-for-a-chain":
        nodes = 0
    elif kind == "length-mismatch":
        parents = [-1, -1]

    class Fixed:
        target = "fixed"
        one_replica = True
        splits_calls = False

        async def prepare(self, request, timeout_s):  # noqa: ANN001, ANN202
            return drafter_pb2.PrepareDraftTokensResponse(results=[drafter_pb2.DraftResult(
                request_id="r", status=drafter_pb2.DRAFT_STATUS_OK, draft_tokens=tokens, draft_parents=parents)])

        def start(self, request, timeout_s):  # noqa: ANN001, ANN202
            return None  # prepare makes the call

    async def main() -> tuple[list[list[int]], list[bool], DrafterClient]:
        client = DrafterClient(Fixed(), "v", 400, deadline_s=1.0, overlap_steps=1)
        reply = await client.propose([DraftQuery("r", [1, 2, 3], 3, 3, DeltaHistory(), max_draft_nodes=nodes)])
        return reply.drafts, reply.failed, client

    drafts, failed, client = asyncio.run(main())
    assert drafts == [[]] and failed == [True]
    assert client.stats.invalid_trees == 1
    assert "invalid token tree" in client.stats.last_error


# --- sampling ----------------------------------------------------------------------------------

def markov_tree_samples(params: SamplingParams, make_tree, n_samples: int,  # noqa: ANN001
                        n_tokens: int = 3) -> collections.Counter:
    """The Markov model of test_verifier_sampling, verified through trees: a node's row is the
    next-token logits after its own token (the root's after the last emitted one)."""
    counts: collections.Counter = collections.Counter()
    gen = torch.Generator().manual_seed(4321)
    for _ in range(n_samples):
        out: list[int] = []
        while len(out) < n_tokens:
            last = out[-1] if out else 0
            tokens, parents = make_tree(last)
            logits = TRANS[[last, *tokens]]
            out += verify_tree(logits, VerifyRow(tokens, params, gen, parents))
        counts[tuple(out[:n_tokens])] += 1
    return counts


def likely_tree(last: int) -> tuple[list[int], list[int]]:
    """The two likeliest children of the root, each with its two likeliest children."""
    top = TRANS[last].topk(2).indices.tolist()
    tokens, parents = [], []
    for t in top:
        tokens.append(t)
        parents.append(-1)
        me = len(tokens) - 1
        for c in TRANS[t].topk(2).indices.tolist():
            tokens.append(c)
            parents.append(me)
    return tokens, parents


def adversarial_tree(last: int) -> tuple[list[int], list[int]]:
    """Every token but the likeliest at the root, then always token 0: built to bias the walk."""
    best = int(TRANS[last].argmax())
    tokens = [t for t in range(V) if t != best]
    parents = [-1] * len(tokens)
    for i in range(len(tokens)):
        tokens.append(0)
        parents.append(i)
    return tokens, parents


TREES = {"likely": likely_tree, "adversarial": adversarial_tree}
COMBOS = [("adversarial", p) for p in PARAMS] + [("likely", PARAMS[0]), ("likely", PARAMS[3])]


@pytest.mark.parametrize(("tree", "params"), COMBOS, ids=[f"{t}-t{p.temperature}-k{p.top_k}" for t, p in COMBOS])
def test_tree_walk_keeps_the_target_distribution(tree: str, params: SamplingParams) -> None:
    counts = markov_tree_samples(params, TREES[tree], 2000)
    assert chi_square_p(counts, exact_joint(params, 0, 3)) > ALPHA


def test_chi_square_detects_a_walk_that_follows_the_first_child() -> None:
    """Negative control: a walk that moves to the first child whenever the draw misses biases it."""
    params = PARAMS[0]

    def biased(logits: torch.Tensor, row: VerifyRow) -> list[int]:
        out = verify_tree(logits, row)
        return out if len(out) > 1 else [row.draft[0]]

    counts: collections.Counter = collections.Counter()
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        out: list[int] = []
        while len(out) < 3:
            last = out[-1] if out else 0
            tokens, parents = adversarial_tree(last)
            out += biased(TRANS[[last, *tokens]], VerifyRow(tokens, params, gen, parents))
        counts[tuple(out[:3])] += 1
    assert chi_square_p(counts, exact_joint(params, 0, 3)) < ALPHA


def test_a_seed_gives_the_same_output_with_trees_as_without_speculation() -> None:
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:4]]
    params = SamplingParams(temperature=0.9, top_p=0.9)
    refs = {tuple(p): list(cached_reference(tuple(p), 40)) for p in prompts}

    async def main() -> tuple[list, list, TreeOracle]:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            plain = [await v.stub.Generate(sampled_request(p, 11, params, 16), timeout=WAIT_S) for p in prompts]
        oracle = TreeOracle(refs, ("path", "all-wrong"), seed=2)
        async with run_verifier(spec_config("NGRAM", 4), model=shared_model(), max_draft_nodes=10) as v:
            engine = engine_of(v)
            in_process_drafter(engine, oracle)
            await engine.drafter.connect()
            treed = await run_together(v, [functools.partial(v.stub.Generate, sampled_request(p, 11, params, 16),
                                                             timeout=WAIT_S) for p in prompts])
        return plain, treed, oracle

    plain, treed, oracle = asyncio.run(main())
    for a, b in zip(plain, treed):
        assert list(a.output.token_ids) == list(b.output.token_ids)
    assert oracle.trees > 0


def test_in_process_ngram_tree_min_prob_verifies_fewer_nodes_and_changes_no_token() -> None:
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:4]]
    refs = [list(cached_reference(tuple(p), 24)) for p in prompts]

    async def run(floor: float) -> list:
        config = spec_config("NGRAM", 6)
        config.ngram.tree_min_prob = floor
        async with run_verifier(config, model=shared_model(), max_draft_nodes=12) as v:
            return [await v.stub.Generate(token_request(p, 24), timeout=WAIT_S) for p in prompts]

    full, floored = asyncio.run(run(0.0)), asyncio.run(run(0.3))
    for responses in (full, floored):
        assert [list(r.output.token_ids) for r in responses] == refs
    nodes = [sum(r.output.stats.num_draft_nodes for r in responses) for responses in (full, floored)]
    assert 0 < nodes[1] < nodes[0]
    bad = spec_config("NGRAM", 6)
    bad.ngram.tree_min_prob = 1.5
    with pytest.raises(ConfigError, match="tree_min_prob"):
        validate(bad)
