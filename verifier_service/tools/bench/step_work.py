"""`splitspec bench --engine-sections step-work`: the engine's own work in a step, by batch size.

On a GPU a small model's forward costs a few milliseconds whatever the batch, while the step's Python
around it (schedule, verify, commit: detokenizing, stop strings, stats, each request's output) grows with
the batch, so at a hundred sequences it is a share of the step that a CPU's forward hides. This runs
`Engine.step` in this process on plain decoding of B sequences, with a stand-in for the forward (logits
whose argmax is the next token of a real text, HumanEval's: no model runs, and its own time is left out)
and the model's own tokenizer (detokenizing costs what it costs in service), the prefix cache on as in
service: milliseconds a step and microseconds a sequence, the median of ROUNDS rounds. Verifying includes
each row's argmax over the vocabulary, on the CPU here. No drafter and no front: what a front costs a
streamed token is `splitspec bench-http`'s.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from verifier_service.engine.detokenizer import CONTEXT_TOKENS, Detokenizer
from verifier_service.engine.engine import Engine
from verifier_service.engine.model_thread import ModelThread
from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.engine.sampler import SamplingParams
from verifier_service.engine.scheduler import Scheduler
from verifier_service.engine.sequence import Sequence, StoppingParams
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ForwardBatch, ModelRunner
from verifier_service.spec_decode.policy import SpecState, SpeculationParams, SpeculationPolicy
from verifier_service.tools.bench import workloads

BATCHES = (1, 16, 64, 128)
PROMPT_TOKENS = 48
ROUNDS, STEPS = 5, 40  # rounds of steps timed, after a prefill step and two decode steps


class StandInRunner:
    """The runner's interface without a model: the token at position i of every sequence is `text[i]`
    (a real text's tokens, so that detokenizing meets whole words and characters as it does in service)."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int, text: list[int], num_slots: int, capacity: int) -> None:
        self.vocab_size = vocab_size
        self.text = text
        self.forward_s = 0.0  # its own time, all calls: not the engine's
        # The smallest KV cache of the slots' shape: the engine only allocates and frees slots.
        self.kv_cache = KVCache(KVCacheShape(1, 1, 1, num_slots, capacity), torch.float32, self.device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        started = time.perf_counter()
        position = [start + i for start, n in zip(batch.starts, batch.lengths) for i in range(n)]  # packed
        following = torch.tensor([self.text[(position[p] + 1) % len(self.text)] for p in batch.logit_index])
        logits = torch.zeros(len(following), self.vocab_size)  # [rows, vocab]
        logits.scatter_(1, following[:, None], 1.0)
        self.forward_s += time.perf_counter() - started
        return logits

    def close(self) -> None:
        return None


def measure(tokenizer: PreTrainedTokenizerBase, batches: tuple[int, ...] = BATCHES) -> list[dict]:
    text = tokenizer("\n".join(t for _, t in workloads.code(20)))["input_ids"]
    return [asyncio.run(_batch(tokenizer, text, b)) for b in batches]


async def _batch(tokenizer: PreTrainedTokenizerBase, text: list[int], batch: int) -> dict:
    vocab, length = len(tokenizer), PROMPT_TOKENS + 4 + ROUNDS * STEPS
    runner = StandInRunner(vocab, text, batch, length + 8)
    scheduler = Scheduler(runner.kv_cache, SpeculationPolicy(max_draft_len=0), max_num_seqs=batch,
                          max_queue_len=batch, max_model_len=length + 4, prefix_cache=PrefixCache(runner.kv_cache))
    thread = ModelThread()  # the engine's, idle: its loop is not started, steps are driven from here
    engine = Engine(cast(ModelRunner, runner), scheduler, None, thread)
    sequences = [Sequence(request_id=str(i), prompt_ids=text[:PROMPT_TOKENS],
                          sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=length),
                          detokenizer=Detokenizer(tokenizer, context=text[:PROMPT_TOKENS][-CONTEXT_TOKENS:]),
                          spec=SpecState(SpeculationParams(disable=True)))
                 for i in range(batch)]
    for seq in sequences:
        engine.submit(seq)

    async def step() -> None:
        await engine.step()
        for seq in sequences:  # what a front would take off each request's queue
            while not seq.outputs.empty():
                seq.outputs.get_nowait()

    rounds = []
    try:
        for _ in range(3):  # the prefill and two decode steps, untimed
            await step()
        for _ in range(ROUNDS):
            started, forward_s = time.perf_counter(), runner.forward_s
            for _ in range(STEPS):
                await step()
            rounds.append((time.perf_counter() - started - (runner.forward_s - forward_s)) / STEPS)
    finally:
        thread.shutdown(wait=True)
    step_s = statistics.median(rounds)
    return {"batch": batch, "step_ms": step_s * 1e3, "us_per_sequence": step_s / batch * 1e6}


def print_table(rows: list[dict], tokenizer: PreTrainedTokenizerBase) -> None:
    print(f"\nThe engine's own work a step, plain decoding with a stand-in forward ({len(tokenizer)}-token "
          f"vocabulary; median of {ROUNDS} rounds of {STEPS} steps)")
    print(f"{'sequences':>10}{'ms a step':>11}{'us a sequence':>15}")
    for r in rows:
        print(f"{r['batch']:>10}{r['step_ms']:>11.3f}{r['us_per_sequence']:>15.1f}")
