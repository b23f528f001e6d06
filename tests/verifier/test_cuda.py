"""On a CUDA device: the verifier's packed forward, KV rollback and sampler give what they give
on the CPU (greedy outputs equal transformers' generate() on the same device, with and without
speculation, with CUDA graphs and without, token trees too; seeded sampling equal with and without
speculation; the sampler's distributions and draws; penalties and allowed tokens with their state kept on
the device). Skipped without CUDA;
run by `.ci/gpu-check` on a GPU machine."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from chi_square import goodness_of_fit_p
from tiny_model import tiny_model
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    ScriptedDrafter,
    engine_of,
    in_process_drafter,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
)

from drafter_sdk import Drafter, DraftRequest
from drafter_sdk.proto import verifier_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree
from verifier_service.engine.logits_processors import process_logits
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.sampler import SamplingParams, VerifyRow
from verifier_service.spec_decode.drafter_client import DrafterClient
from verifier_service.spec_decode.transport import InProcessTransport

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [repetitive_prompt(s) for s in LOOPING_SEEDS[:8]] + [repetitive_prompt(s) for s in range(300, 308)]
NEW_TOKENS = 32


@functools.cache
def cuda_model() -> torch.nn.Module:
    return tiny_model().to("cuda")


def generate_reference(prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    return cuda_model().generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()


async def generate_all(v, requests: list[verifier_pb2.GenerateRequest]) -> list[list[int]]:  # noqa: ANN001
    responses = await run_together(v, [functools.partial(v.stub.Generate, r, timeout=WAIT_S) for r in requests])
    return [list(r.output.token_ids) for r in responses]


def test_greedy_on_cuda_equals_generate_plain_and_speculative() -> None:
    refs = [generate_reference(p) for p in PROMPTS]
    requests = [token_request(p, NEW_TOKENS) for p in PROMPTS]

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=cuda_model()) as v:
            assert engine_of(v).runner.device.type == "cuda"
            assert await generate_all(v, requests) == refs
            assert engine_of(v).runner.graphs.replays > 0  # CUDA graphs are on by default
        async with run_verifier(spec_config("NGRAM", 4), model=cuda_model()) as v:
            assert await generate_all(v, requests) == refs
            assert engine_of(v).drafter.stats.calls > 0
            assert engine_of(v).runner.graphs.replays > 0
        async with run_verifier(spec_config("NGRAM", 4), model=cuda_model(), cuda_graph_max_tokens=0) as v:
            assert engine_of(v).runner.graphs is None
            assert await generate_all(v, requests) == refs

    asyncio.run(main())


class ForkingOracle(Drafter):
    """Knows each prompt's greedy continuation. By turns, for every sequence at once: a tree that
    forks at each of two depths, a wrong sibling before the right child (so the accepted path's K/V
    must move into place), or that path alone as a chain."""

    capabilities = (TREE_CAPABILITY,)

    def __init__(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self.references = references
        self.calls = self.trees = 0

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        self.calls += 1
        out: list[list[int] | DraftTree] = []
        for r in requests:
            ref = self.references[tuple(r.tokens[:r.prompt_len])]
            truth = ref[len(r.tokens) - r.prompt_len:][:min(r.draft_len, 2)]  # short: many steps
            if self.calls % 2 or not r.max_draft_nodes:
                out.append(truth)
                continue
            tokens: list[int] = []
            parents: list[int] = []
            for token in truth[:r.max_draft_nodes // 2]:
                parent = len(tokens) - 1 if tokens else -1
                tokens += [(token + 7) % cuda_model().config.vocab_size, token]
                parents += [parent, parent]
            self.trees += bool(tokens)
            out.append(DraftTree(tokens, parents))
        return out


def test_token_trees_on_cuda_run_as_graphs_and_equal_generate() -> None:
    prompts = PROMPTS[:4]
    refs = [generate_reference(p) for p in prompts]
    oracle = ForkingOracle({tuple(p): r for p, r in zip(prompts, refs)})
    tree_replays: list[bool] = []

    async def main() -> list[list[int]]:
        async with run_verifier(spec_config("NGRAM", 4), model=cuda_model(), max_draft_nodes=8) as v:
            engine = engine_of(v)
            graphs = engine.runner.graphs
            hidden_states = graphs.hidden_states

            def recording(*batch: list[int]) -> torch.Tensor | None:
                hidden = hidden_states(*batch)
                tree_replays.append(bool(batch[-1]) and hidden is not None)  # batch[-1]: the parents
                return hidden

            graphs.hidden_states = recording
            in_process_drafter(engine, oracle)
            await engine.drafter.connect()
            return await generate_all(v, [token_request(p, NEW_TOKENS) for p in prompts])

    assert asyncio.run(main()) == refs
    assert oracle.trees > 10 and sum(tree_replays) >= 2, "tree steps ran as CUDA graphs"


def test_seeded_sampling_on_cuda_is_the_same_with_and_without_speculation() -> None:
    """The coupled rule draws once per emitted token from the request's generator (on the
    device), so a seed gives the same tokens whether drafts were accepted, rejected or absent."""
    prompt = PROMPTS[0]
    seeds = range(24)
    drafter = ScriptedDrafter(lambda r: [prompt[-1]] * r.draft_len)

    def request(seed: int) -> verifier_pb2.GenerateRequest:
        return token_request(prompt, 12, sampling=verifier_pb2.SamplingParams(temperature=1.5, top_k=5, seed=seed))

    async def sample(speculate: bool) -> list[list[int]]:
        async with run_verifier(spec_config("NGRAM", 3) if speculate else spec_config("NONE"),
                                model=cuda_model(), max_num_seqs=32) as v:
            if speculate:
                engine = engine_of(v)
                servicer = DrafterServicer(drafter, SequenceStore())
                servicer.load()
                engine.drafter = DrafterClient(InProcessTransport(servicer), engine.drafter.verifier_id,
                                               engine.drafter.vocab_size, deadline_s=float("inf"), overlap_steps=1)
            return await generate_all(v, [request(s) for s in seeds])

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        return await sample(True), await sample(False)

    with_spec, without = asyncio.run(main())
    assert any(d for c in drafter.calls for d in c.drafts), "the drafter was not consulted"
    assert with_spec == without
    assert len({tuple(t) for t in without}) > 1, "the seeds did not change the samples"


def test_penalties_and_allowed_tokens_on_cuda_keep_state_on_the_device_and_equal_plain() -> None:
    """Penalties (counts kept on the device between steps) and allowed_token_ids (draft tokens outside the
    set cut before the forward): greedy outputs with the n-gram drafter equal plain decoding's on CUDA, and
    a sequence's kept LogitsState gives the bits of a fresh one there too."""
    vocab = cuda_model().config.vocab_size
    allowed = list(range(0, vocab, 3))
    sampling = verifier_pb2.SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3,
                                           allowed_token_ids=allowed)
    requests = [token_request(p, NEW_TOKENS, sampling=sampling) for p in PROMPTS[:8]]

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=cuda_model()) as v:
            plain = await generate_all(v, requests)
        async with run_verifier(spec_config("NGRAM", 4), model=cuda_model()) as v:
            assert await generate_all(v, requests) == plain
            assert engine_of(v).drafter.stats.calls > 0
        assert all(set(out) <= set(allowed) for out in plain)

    asyncio.run(main())
    params = SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3)
    state, output = LogitsState(), []
    for step in range(6):
        output += [(7 * step + i) % vocab for i in range(3)]
        draft, parents = [(5 * step + i) % vocab for i in range(5)], ([-1, 0, 0, 2, -1] if step % 2 else [])
        logits = torch.randn(len(draft) + 1, vocab, device="cuda")
        kept = process_logits(logits, [VerifyRow(draft, params, None, parents, PROMPTS[0], list(output), state=state)])
        fresh = process_logits(logits, [VerifyRow(draft, params, None, parents, PROMPTS[0], list(output))])
        assert torch.equal(kept, fresh)


def test_the_sampler_on_cuda_draws_as_on_the_cpu() -> None:
    """target_probs on the device equals the CPU's (the top-p probe and the whole-vocabulary fallback alike);
    draws from the device's generator are seeded, at their rates, and never a token without mass."""
    from verifier_service.engine.sampler import NUCLEUS_PROBE, _sample, target_probs

    for scale in (8.0, 0.05):  # the nucleus within the probe, and a flat row that sorts the vocabulary
        logits = torch.randn(3, 4 * NUCLEUS_PROBE, generator=torch.Generator().manual_seed(1)) * scale
        for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.6, top_k=20,
                                                                                   top_p=0.95)):
            assert torch.allclose(target_probs(logits.cuda(), params).cpu(), target_probs(logits, params), atol=1e-6)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0], device="cuda")
    gen, twin = torch.Generator("cuda").manual_seed(3), torch.Generator("cuda").manual_seed(3)
    draws = [_sample(probs, gen) for _ in range(3000)]
    assert draws == [_sample(probs, twin) for _ in range(3000)]
    counts = [draws.count(token) for token in range(6)]
    assert counts[0] == counts[2] == counts[5] == 0
    assert goodness_of_fit_p([counts[1], counts[3], counts[4]], [1500, 600, 900]) > 1e-3
