"""Sampling: temperature / top-k / top-p as transformers applies them, seeds, and the
point-mass verification rule keeping the output distribution exactly the target's
whatever the drafter proposes (chi-square tests at fixed seeds, with a negative
control showing the test detects a biased rule)."""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools

import pytest
import torch
from chi_square import goodness_of_fit_p, independence_p
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import (
    LOOPING_SEEDS,
    WAIT_S,
    ScriptedDrafter,
    cached_reference,
    engine_of,
    in_process_drafter,
    one_torch_thread,  # noqa: F401 - autouse fixture
    repetitive_prompt,
    run_together,
    shared_model,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.engine.sampler import (
    NUCLEUS_PROBE,
    SamplingParams,
    VerifyRow,
    _sample,
    target_probs,
    verify_batch,
    verify_sampled,
)

ALPHA = 1e-3  # fixed seeds make every test deterministic; this only guards against a bad seed choice
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, top_k=4, top_p=0.7),
          SamplingParams(temperature=1.2, min_p=0.2)]


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("params", PARAMS + [SamplingParams(temperature=0.5, top_k=10, top_p=0.5),
                                             SamplingParams(temperature=2.0, top_k=2, top_p=0.9),
                                             SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
                                             SamplingParams(temperature=0.8, min_p=0.05),
                                             SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.1)])
def test_target_probs_match_transformers_warpers(params: SamplingParams) -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 2
    assert torch.allclose(target_probs(logits, params), hf_probs(logits, params), atol=1e-6)


@pytest.mark.parametrize("scale", [8.0, 0.05], ids=["nucleus-in-the-probe", "flat-whole-vocabulary"])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(scale: float) -> None:
    """Top-p ranks the NUCLEUS_PROBE most likely tokens where they hold its mass, else the whole vocabulary."""
    logits = torch.randn(4, 5 * NUCLEUS_PROBE, generator=torch.Generator().manual_seed(0)) * scale
    params = SamplingParams(temperature=1.0, top_p=0.9)
    kept = (target_probs(logits, params) > 0).sum(dim=-1)
    assert bool((kept < NUCLEUS_PROBE).all()) if scale > 1 else bool((kept > NUCLEUS_PROBE).all())
    assert torch.allclose(target_probs(logits, params), hf_probs(logits, params), atol=1e-6)


def test_a_draw_is_a_uniform_per_token_and_never_a_token_without_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exponential race: each draw takes one uniform per vocabulary token from the generator, whose
    sequence then goes on as if torch.rand had been called once over them all; tokens of probability 0
    (at the ends too) never win, not even where every uniform is 0, and the others win at their rates."""
    probs = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    gen, twin = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    draws = [_sample(probs, gen) for _ in range(3000)]
    torch.rand(3000 * len(probs), generator=twin)
    assert float(torch.rand((), generator=gen)) == float(torch.rand((), generator=twin))
    counts = collections.Counter(draws)
    assert set(counts) == {2, 4, 5}
    assert goodness_of_fit_p([counts[2], counts[4], counts[5]], [1500, 600, 900]) > ALPHA
    assert _sample(probs * 7.0, torch.Generator().manual_seed(3)) == _sample(probs, torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch, "rand", lambda size, **options: torch.zeros(size))
    assert _sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), None) == 2


def inverse_cdf_draw(probs: torch.Tensor, seed: int) -> int:
    """The control: one uniform through the inverse CDF over the vocabulary, as the sampler drew before."""
    cdf = probs.double().cumsum(-1)
    draw = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * cdf[-1]
    return int(torch.searchsorted(cdf, draw, right=True))


def test_logits_that_differ_in_their_last_bits_change_almost_no_draw() -> None:
    """A verify row's logits may differ from plain decoding's one-row forward in their last bits (on the
    embedded model, by up to 4e-5). Over a 49,152-token vocabulary at temperature 1 the race then changes
    a draw only where two tokens nearly tie; the inverse CDF, which moves each token's interval by the
    sum of the differences before it, changed 45 of the same 2,000 draws."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(49152, generator=gen) * 3  # a likeliest token of 0.18, and a long tail
    plain, verified = (torch.softmax(x, -1) for x in (logits, logits + torch.randn(49152, generator=gen) * 3e-5))
    race = sum(_sample(plain, torch.Generator().manual_seed(s)) != _sample(verified, torch.Generator().manual_seed(s))
               for s in range(2000))
    inverse = sum(inverse_cdf_draw(plain, s) != inverse_cdf_draw(verified, s) for s in range(2000))
    assert race <= 1
    assert inverse >= 20


# --- vocabulary-level simulation of speculative sampling on a Markov "model" ---

V = 6
TRANS = torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.5  # logits of the next token


def exact_joint(params: SamplingParams, start: int, n: int) -> dict[tuple[int, ...], float]:
    probs = target_probs(TRANS, params).double()
    joint: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(V), repeat=n):
        p, last = 1.0, start
        for t in seq:
            p *= float(probs[last, t])
            last = t
        if p > 0:
            joint[seq] = p
    return joint


def speculative_samples(params: SamplingParams, drafter, n_samples: int, n_tokens: int = 3, k: int = 3,  # noqa: ANN001
                        start: int = 0, rule=verify_sampled) -> collections.Counter:  # noqa: ANN001
    counts: collections.Counter = collections.Counter()
    gen = torch.Generator().manual_seed(1234)
    for _ in range(n_samples):
        out: list[int] = []
        while len(out) < n_tokens:
            last = out[-1] if out else start
            draft = drafter(last)[:k]
            logits = TRANS[[last, *draft]]  # row j: the next token's logits after [last, *draft][:j+1]
            out += rule(logits, VerifyRow(draft, params, gen))
        counts[tuple(out[:n_tokens])] += 1
    return counts


def chi_square_p(counts: collections.Counter, expected: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit; cells expecting fewer than 5 draws are pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(expected), f"impossible outputs drawn: {set(counts) - set(expected)}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in expected.items():
        if n * p >= 5:
            obs.append(counts[cell])
            exp.append(n * p)
        else:
            pool_o += counts[cell]
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    total = sum(exp)
    return goodness_of_fit_p(obs, [e * n / total for e in exp])


def greedy_chain(last: int) -> list[int]:
    out = []
    for _ in range(3):
        last = int(TRANS[last].argmax())
        out.append(last)
    return out


DRAFTERS = {
    "none": lambda last: [],
    "constant-0": lambda last: [0, 0, 0],  # adversarial: always the same token
    "constant-likely": lambda last: [int(TRANS[0].argmax())] * 3,
    "greedy-chain": greedy_chain,
}


COMBOS = [("constant-0", p) for p in PARAMS] + [("constant-likely", PARAMS[0]), ("constant-likely", PARAMS[3]),
                                                ("none", PARAMS[3]), ("greedy-chain", PARAMS[3])]


@pytest.mark.parametrize(("drafter", "params"), COMBOS,
                         ids=[f"{d}-t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}" for d, p in COMBOS])
def test_point_mass_rule_keeps_the_target_distribution(drafter: str, params: SamplingParams) -> None:
    counts = speculative_samples(params, DRAFTERS[drafter], 2000)
    assert chi_square_p(counts, exact_joint(params, 0, 3)) > ALPHA


def test_chi_square_detects_a_biased_acceptance_rule() -> None:
    """Negative control: accepting with probability p(x) but resampling from the
    full p (not p without x) over-produces drafted tokens; the same test catches it."""

    def biased(logits: torch.Tensor, row: VerifyRow) -> list[int]:
        probs = target_probs(logits, row.params)
        out = []
        for j, token in enumerate(row.draft):
            if float(torch.rand((), generator=row.generator)) < float(probs[j, token]):
                out.append(token)
                continue
            out.append(int(torch.multinomial(probs[j], 1, generator=row.generator)))
            return out
        return out + [int(torch.multinomial(probs[len(row.draft)], 1, generator=row.generator))]

    params = PARAMS[0]
    counts = speculative_samples(params, DRAFTERS["constant-likely"], 2000, rule=biased)
    assert chi_square_p(counts, exact_joint(params, 0, 3)) < 1e-6


def test_verify_batch_mixes_greedy_and_sampled_rows() -> None:
    logits = TRANS[[0, 1, 2, 3, 4, 5]]
    argmax = logits.argmax(-1).tolist()
    greedy = VerifyRow([argmax[0], (argmax[argmax[0]] + 1) % V], SamplingParams(), None)
    sampled = VerifyRow([0, 1, 2], SamplingParams(temperature=1.0, top_k=1), None)  # top_k 1 is greedy too
    out = verify_batch(torch.cat([TRANS[[0, argmax[0], 5]], TRANS[[0, 0, 1, 2]]]), [greedy, sampled])
    assert out[0] == [argmax[0], int(TRANS[argmax[0]].argmax())]
    assert out[1][0] == int(TRANS[0].argmax())


# --- through the real engine ---

def model_joint(prompt: list[int], params: SamplingParams, n: int = 3) -> dict[tuple[int, ...], float]:
    """The model's exact joint distribution of its next n sampled tokens."""
    model = shared_model()
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n):
            prefixes = list(joint)
            probs = target_probs(model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float(),
                                 params)
            joint = {(*prefix, t): joint[prefix] * float(probs[i, t])
                     for i, prefix in enumerate(prefixes) for t in probs[i].nonzero().flatten().tolist()}
    return joint


def sampled_request(prompt: list[int], seed: int, params: SamplingParams, n: int = 3,
                    **fields: object) -> verifier_pb2.GenerateRequest:
    return token_request(prompt, n, sampling=verifier_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=seed),
        **fields)


def test_engine_sampling_matches_the_model_distribution_with_an_adversarial_drafter() -> None:
    """Three sampled tokens per request through the real engine and gRPC, at fixed
    seeds: with speculation (a drafter that always proposes the same token: the
    second token's likeliest value, so it is accepted and rejected often) and
    without, each matches the model's own joint distribution (chi-square), and
    the two agree with each other."""
    prompt = repetitive_prompt(LOOPING_SEEDS[0])
    params = SamplingParams(temperature=2.5, top_k=3)
    expected = model_joint(prompt, params)
    second = collections.Counter()
    for (_, b, _), p in expected.items():
        second[b] += p
    likely = max(second, key=second.get)
    n = 600
    drafter = ScriptedDrafter(lambda r: [likely] * r.draft_len)

    async def sample(spec, seeds) -> collections.Counter:  # noqa: ANN001
        counts: collections.Counter = collections.Counter()
        async with run_verifier(spec, model=shared_model(), max_num_seqs=64, max_model_len=64, max_queue_len=512) as v:
            if spec.max_draft_len:
                in_process_drafter(engine_of(v), drafter)
            for chunk in range(0, len(seeds), 150):
                responses = await asyncio.gather(*[v.stub.Generate(sampled_request(prompt, s, params), timeout=WAIT_S)
                                                   for s in seeds[chunk:chunk + 150]])
                counts.update(tuple(r.output.token_ids) for r in responses)
        return counts

    async def main() -> tuple[collections.Counter, collections.Counter]:
        with_spec = await sample(spec_config("NGRAM", 2), list(range(n)))
        without = await sample(spec_config("NONE"), list(range(n, 2 * n)))
        return with_spec, without

    with_spec, without = asyncio.run(main())
    assert sum(1 for c in drafter.calls for d in c.drafts if d) >= n // 2, "the drafter was not consulted"
    assert chi_square_p(with_spec, expected) > ALPHA
    assert chi_square_p(without, expected) > ALPHA
    cells = sorted(set(with_spec) | set(without))
    table = [[with_spec[c] for c in cells], [without[c] for c in cells]]
    assert independence_p(table) > ALPHA


def test_same_seed_same_output_whatever_the_batch_and_the_drafts() -> None:
    """A seeded request gives one output: twice in a row, inside a batch whose draft
    lengths follow a batch-size schedule, and with speculation off. Different
    seeds give different outputs."""
    prompts = [repetitive_prompt(s) for s in LOOPING_SEEDS[:5]]
    params = SamplingParams(temperature=0.9, top_p=0.9)
    schedule = {"draftLenSchedule": [{"maxBatchSize": 1, "draftLen": 4}, {"maxBatchSize": 3, "draftLen": 2},
                                     {"maxBatchSize": 64, "draftLen": 1}]}

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model()) as v:
            plain = [await v.stub.Generate(sampled_request(p, 7, params, 20), timeout=WAIT_S) for p in prompts]
        async with run_verifier(spec_config("NGRAM", 4, **schedule), model=shared_model()) as v:
            alone = [await v.stub.Generate(sampled_request(p, 7, params, 20), timeout=WAIT_S) for p in prompts]
            again = [await v.stub.Generate(sampled_request(p, 7, params, 20), timeout=WAIT_S) for p in prompts]
            # Greedy requests share the batch: they stay exact, the sampled ones unchanged.
            mixed = [sampled_request(p, 7, params, 20) for p in prompts] + [token_request(p, 20) for p in prompts]
            together = await run_together(v, [functools.partial(v.stub.Generate, r, timeout=WAIT_S) for r in mixed])
            batch, greedy = together[:len(prompts)], together[len(prompts):]
            other = [await v.stub.Generate(sampled_request(p, 8, params, 20), timeout=WAIT_S) for p in prompts]
        for i in range(len(prompts)):
            assert list(alone[i].output.token_ids) == list(again[i].output.token_ids), f"prompt {i}: same seed, new output"
            assert list(batch[i].output.token_ids) == list(alone[i].output.token_ids), f"prompt {i}: batch changed the output"
            assert list(plain[i].output.token_ids) == list(alone[i].output.token_ids), f"prompt {i}: speculation changed it"
        assert sum(r.output.stats.num_draft_tokens for r in alone) > 0
        for p, g in zip(prompts, greedy):
            assert list(g.output.token_ids) == list(cached_reference(tuple(p), 20))
        assert any(list(o.output.token_ids) != list(a.output.token_ids) for o, a in zip(other, alone))

    asyncio.run(main())
