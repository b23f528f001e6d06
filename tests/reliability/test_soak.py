"""Every feature at once, against plain decoding.

Each seeded round starts a verifier with a random configuration (draft length, token trees, a
chunked-prefill budget, the adaptive planner, calls overlapped with the forward or not, a KV cache
of a few slots or many, priority scheduling, under which requests of random priorities preempt
each other, a reasoning model whose thinking budgets and constraints after the thinking are kept)
behind a drafter that misbehaves at random (raises, answers past its deadline, sends
out-of-vocabulary tokens, over-long drafts, invalid trees, too few drafts), and sends it a random
mix of concurrent requests: shared prefixes, greedy and seeded sampling, penalties, stop tokens,
min_new_tokens, logprobs, speculation disabled, predicted outputs (the plain answer, or it edited),
cache salts (to a drafter that keeps them apart, or to one that must be sent nothing salted), streams
cancelled midway. Every request that is
not cancelled must get what a plain verifier gives it (the same tokens, or the same error code),
and afterwards the engine holds nothing. Each feature has its own tests; this looks for their
interactions.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from reliability_support import FIGURES, WAIT_S, idle
from thinking_model import thinking_model, thinking_tokenizer
from tiny_model import tiny_tokenizer
from verifier_harness import VerifierHandle, run_verifier, spec_config, token_request
from verifier_support import repetitive_prompt, serve_drafter, shared_model

from drafter_sdk import LOOKAHEAD, Drafter, DraftRequest
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2 as pb
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree

DEADLINE_MS = 200
VOCAB = 400  # the tiny model's (and repetitive_prompt's)
FAULTS = ("raise", "late", "out_of_vocab", "too_long", "invalid_tree", "too_few")


class ChaosDrafter(Drafter):
    """Chains from an oracle (each request's plain output, a token corrupted now and then, so drafts
    are mostly accepted and sometimes rejected midway), trees from the n-gram drafter, looking ahead;
    on a random share of calls, a fault instead."""

    name = "chaos"
    version = "1"
    capabilities = (TREE_CAPABILITY, LOOKAHEAD)

    def __init__(self, seed: int, fault_rate: float, oracle: dict[tuple[int, ...], list[int]],
                 keeps_salts_apart: bool = True) -> None:
        self.ngram = NgramDrafter(max_draft_len=17)
        self.oracle = oracle  # prompt -> its plain output
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        self.faults = 0
        self.keeps_salts_apart = keeps_salts_apart
        self.salts_seen: set[str] = set()

    @property
    def learns_across_requests(self) -> bool:
        """Saying so, and not that it keeps cache salts apart, it must be sent nothing of a salted request."""
        return not self.keeps_salts_apart

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        self.salts_seen.update(r.cache_salt_id for r in requests if r.cache_salt_id)
        drafts = [self.ngram.prepare_draft_tokens([r])[0] if r.max_draft_nodes else self.oracle_draft(r)
                  for r in requests]
        if self.rng.random() >= self.fault_rate:
            return drafts
        self.faults += 1
        fault = self.rng.choice(FAULTS)
        if fault == "raise":
            raise RuntimeError("chaos")
        if fault == "late":
            time.sleep(2 * DEADLINE_MS / 1000)
        elif fault == "out_of_vocab":
            return [[self.rng.randrange(-5, VOCAB + 100) for _ in range(self.rng.randint(1, 9))] for _ in requests]
        elif fault == "too_long":
            return [list(range(1, 200)) for _ in requests]
        elif fault == "invalid_tree":
            return [DraftTree([1, 2, 3], [0, -1, 5]) for _ in requests]
        elif fault == "too_few":
            return drafts[:-1]
        return drafts

    def oracle_draft(self, r: DraftRequest) -> list[int]:
        output = self.oracle.get(tuple(r.tokens[:r.prompt_len]), [])
        done = len(r.tokens) - r.prompt_len
        if list(r.tokens[r.prompt_len:]) != output[:done]:
            return []
        return [t if self.rng.random() > 0.1 else (t + 1) % VOCAB for t in output[done:done + r.draft_len]]

    def on_release(self, key: tuple[str, str]) -> None:
        self.ngram.on_release(key)


def random_requests(rng: random.Random, reasoning: bool = False) -> list[pb.GenerateRequest]:
    """`reasoning`: for the thinking model under a reasoning parser: prompts that may open or close its
    thinking, thinking budgets and constraints that hold the answer after it."""
    bases = [repetitive_prompt(s) for s in rng.sample(range(300), 4)]
    start, end = thinking_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    requests = []
    for _ in range(rng.randint(4, 10)):
        prompt = list(rng.choice(bases))
        if rng.random() < 0.5:  # a shared prefix with a tail of its own
            prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.3:
            prompt *= rng.randint(2, 5)
        prompt = prompt[:180]
        if reasoning and rng.random() < 0.6:  # a template that opened the thinking, or closed it
            prompt += rng.choice([[start], [start, 5, end]])
        request = token_request(prompt, rng.randint(1, 40))
        params = request.params
        if rng.random() < 0.4:
            params.sampling.CopyFrom(pb.SamplingParams(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1 << 30),
                                                       top_p=rng.choice([0.0, 0.9]), top_k=rng.choice([0, 20])))
        if rng.random() < 0.2:
            params.sampling.repetition_penalty = 1.3
        if rng.random() < 0.2:
            params.sampling.frequency_penalty = 0.5
        if rng.random() < 0.3:
            params.stopping.stop_token_ids.extend(rng.sample(range(1, VOCAB), 3))
        if rng.random() < 0.2:
            params.stopping.min_new_tokens = rng.randint(0, min(5, params.stopping.max_new_tokens))
        if rng.random() < 0.2:
            params.logprobs = 2
        if rng.random() < 0.15:
            params.speculation.disable = True
        if reasoning and rng.random() < 0.4:
            params.thinking_token_budget = rng.randint(0, 12)
        if reasoning and rng.random() < 0.25:  # refused beside min_new_tokens, by both verifiers alike
            params.structured_output.regex = "(fox|dog)+ [0-9]{3}"
        requests.append(request)
    return requests


async def outcome(v: VerifierHandle, request: pb.GenerateRequest) -> tuple[list[int] | str, int]:
    """(the tokens or the error code, draft tokens accepted)."""
    try:
        output = (await v.stub.Generate(request, timeout=WAIT_S)).output
    except grpc.aio.AioRpcError as e:
        return e.code().name, 0
    return list(output.token_ids), output.stats.num_accepted_tokens


async def cancel_midway(v: VerifierHandle, request: pb.GenerateRequest) -> None:
    call = v.stub.GenerateStream(pb.GenerateStreamRequest(params=request.params), timeout=WAIT_S)
    try:
        async for _ in call:
            call.cancel()
            break
    except grpc.aio.AioRpcError:  # refused, or over before its first message: nothing to cancel
        pass


@pytest.mark.parametrize("seed", range(12))
def test_every_feature_at_once_gives_plain_decodings_outputs_and_leaks_nothing(seed: int) -> None:
    rng = random.Random(seed)
    reasoning = rng.random() < 0.4
    requests = random_requests(rng, reasoning)
    salting = random.Random(seed + 2000)  # its own draws: the rounds' other choices stay as they were
    for request in requests:
        if salting.random() < 0.3:
            request.params.cache_salt = salting.choice(["tenant-a", "tenant-b"])
    keeps_salts_apart = salting.random() < 0.5
    cancelled = [rng.random() < 0.15 for _ in requests]
    k, nodes = rng.randint(1, 8), rng.choice([0, 0, 8])
    fault_rate = rng.choice([0.0, 0.1, 0.3])
    settings = {"max_draft_nodes": nodes, "kv_cache_memory_gb": rng.choice([0.25, 0.002, 0.001]),
                "max_num_seqs": rng.choice([2, 4, 16])}
    model = {"model": shared_model()}
    if reasoning:
        model = {"model": thinking_model(), "tokenizer": thinking_tokenizer(),
                 "reasoning_parser": rng.choice(["qwen3", "deepseek_r1"])}
    if budget := rng.choice([None, 8, 24]):
        settings["max_num_batched_tokens"] = budget
    sent = requests  # to the verifier under test; the plain one is sent them without priorities
    if rng.random() < 0.5:
        settings["scheduling_policy"] = "priority"
        sent = [pb.GenerateRequest(params=r.params) for r in requests]
        for request in sent:
            request.params.priority = rng.randint(-2, 2)

    async def main() -> tuple[dict, int, int]:
        async with run_verifier(spec_config(), **model) as plain:
            want = [(await outcome(plain, request))[0] for request in requests]
        oracle = {tuple(r.params.token_ids.ids): w for r, w in zip(requests, want) if isinstance(w, list)}
        predicting = random.Random(seed + 1000)  # its own draws: the rounds' other choices stay as they were
        tokenizer = thinking_tokenizer() if reasoning else tiny_tokenizer()
        for request, w in zip(sent, want):
            if isinstance(w, list) and w and predicting.random() < 0.3:  # the plain answer, or it edited
                edit = [predicting.randrange(1, VOCAB) for _ in range(3)]
                half = len(w) // 2
                request.params.prediction = tokenizer.decode(w if predicting.random() < 0.5 else
                                                             w[:half] + edit + w[half + 2:])
        drafter = ChaosDrafter(seed, fault_rate, oracle, keeps_salts_apart)
        async with serve_drafter(drafter) as d:
            spec = spec_config("USER_PROVIDED", k, drafter_target=f"127.0.0.1:{d.port}", deadline_ms=DEADLINE_MS)
            spec.policy.adaptive_draft_len = rng.random() < 0.5
            spec.user_provided.overlap_calls = rng.random() < 0.8
            async with run_verifier(spec, **model, **settings) as v:
                async def one(i: int) -> tuple[list[int] | str | None, int]:
                    await asyncio.sleep(rng.random() * 0.05)  # arrivals spread over the first steps
                    if cancelled[i]:
                        return await cancel_midway(v, sent[i]), 0
                    return await outcome(v, sent[i])

                got = await asyncio.gather(*(one(i) for i in range(len(requests))))
                for i, request in enumerate(requests):
                    if not cancelled[i]:
                        assert got[i][0] == want[i], (i, request)
                deadline = time.monotonic() + WAIT_S  # cancellations are noticed at the next step
                while any((left := idle(v)).values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return left, drafter.faults, sum(accepted for _, accepted in got), drafter.salts_seen

    left, faults, accepted, salts_seen = asyncio.run(main())
    assert not any(left.values()), left
    assert keeps_salts_apart or not salts_seen, salts_seen
    FIGURES.append({"soak": seed, "requests": len(requests), "cancelled": sum(cancelled), "drafter_faults": faults,
                    "accepted": accepted, "k": k, "tree_nodes": nodes, "kv_cache_gb": settings["kv_cache_memory_gb"],
                    "scheduling": settings.get("scheduling_policy", "fcfs"),
                    "salted": sum(bool(r.params.cache_salt) for r in requests), "salts_sent": len(salts_seen),
                    "reasoning": model.get("reasoning_parser", "none")})
