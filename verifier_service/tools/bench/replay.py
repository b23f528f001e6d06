"""`splitspec bench --replay`: acceptance without timing, for machines too busy to time anything.

Each prompt's greedy output comes from transformers' generate() (once per distinct prompt, in the
bench's order; an agentic turn is built from the previous turn's output). Then every drafter is
replayed against those outputs as a verifier would drive it, through the SDK's servicer (the code a
`splitspec-drafter` runs): each step sends the new tokens and asks for max_draft_len tokens, the
draft's prefix that matches the output is accepted plus one target token, and a finished request is
synced to its end and released FINISHED, so that a learning drafter takes it in. Requests run one
after the other, in the same order for every drafter. Greedy verification accepts exactly the
matching prefix, so these acceptance figures are what `splitspec bench` would measure; speed is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.drafter import Drafter
from drafter_sdk.proto import drafter_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.tools.bench.workloads import Prompt


@dataclass
class ReplayResult:
    drafter: str
    workload: str
    prompts: int
    steps: int  # target forwards after the first token
    drafts: int
    draft_tokens: int
    accepted: int

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0


def greedy_outputs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt],
                   max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, follow-up turns rendered from the output they follow."""
    done: dict[tuple[int, ...], list[int]] = {}
    answers: dict[str, str] = {}
    out = []
    for prompt in prompts:
        ids = prompt.render(answers[prompt.follows], tokenizer) if prompt.follows else prompt.token_ids
        if tuple(ids) not in done:
            x = torch.tensor([ids], device=model.device)
            generated = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False,
                                       attention_mask=torch.ones_like(x))
            done[tuple(ids)] = generated[0, len(ids):].tolist()
        output = done[tuple(ids)]
        answers[prompt.name] = tokenizer.decode(output, skip_special_tokens=True)
        out.append((ids, output))
    return out


def replay(name: str, make: Callable[[], Drafter], prompts: list[Prompt],
           outputs: list[tuple[list[int], list[int]]], draft_len: int) -> list[ReplayResult]:
    """One drafter over every request in order; results per workload."""
    servicer = DrafterServicer(make(), SequenceStore())
    servicer.load()
    results: dict[str, ReplayResult] = {}
    for n, (prompt, (ids, output)) in enumerate(zip(prompts, outputs)):
        r = results.setdefault(prompt.workload, ReplayResult(name, prompt.workload, 0, 0, 0, 0, 0))
        r.prompts += 1
        rid = f"r{n}"
        sent, done = 0, 1  # the prefill produced output[0]
        while done < len(output):
            context = ids + output[:done]
            k = min(draft_len, len(output) - done - 1)
            response = servicer.prepare(_call(rid, sent, context, len(ids), k))
            sent = len(context)
            draft = list(response.results[0].draft_tokens)
            truth = output[done:done + len(draft)]
            accepted = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(draft))
            r.steps += 1
            if draft:
                r.drafts += 1
                r.draft_tokens += len(draft)
                r.accepted += accepted
            done += accepted + 1
        servicer.prepare(_call(rid, sent, ids + output, len(ids), 0))  # the verifier's last sync
        servicer.release(drafter_pb2.ReleaseRequestsRequest(verifier_id="replay", request_ids=[rid],
                                                            reasons=[drafter_pb2.RELEASE_REASON_FINISHED]))
    return list(results.values())


def _call(rid: str, sent: int, context: list[int], prompt_len: int, k: int) -> drafter_pb2.PrepareDraftTokensRequest:
    return drafter_pb2.PrepareDraftTokensRequest(verifier_id="replay", sequences=[drafter_pb2.DraftSequence(
        request_id=rid, context_len=sent, new_tokens=context[sent:], prompt_len=prompt_len, draft_len=k)])


def print_results(results: list[ReplayResult]) -> None:
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        print(f"\n== replay: {workload} ({rows[0].prompts} prompts) ==")
        print(f"{'drafter':<12} {'mean acc len':>12} {'tokens/step':>11} {'acc rate':>8} {'drafts':>7}")
        for r in rows:
            rate = r.accepted / r.draft_tokens if r.draft_tokens else 0.0
            print(f"{r.drafter:<12} {r.mean_acceptance_length:>12.2f} {r.tokens_per_step:>11.2f} {rate:>8.2f} "
                  f"{r.drafts:>7}")


def as_dicts(results: list[ReplayResult]) -> list[dict]:
    return [{**dataclasses.asdict(r), "mean_acceptance_length": r.mean_acceptance_length,
             "tokens_per_step": r.tokens_per_step} for r in results]
