"""`splitspec bench --engine-sections logits`: what a request's logits processors cost a step.

One sequence's verify rows (a chain of 0, 4 or 16 draft tokens) after a 2,000-token prompt and 500
generated tokens, on the model's vocabulary and the bench's device, for each kind of request that
rewrites its logits: penalties, allowed_token_ids, logit_bias, bad_words. Each is timed with the
sequence's LogitsState kept from step to step, as the engine keeps it, and with a fresh one, which
rebuilds every tensor from the whole context as each step did before; the two take turns, call by
call, and the medians are compared. No model and no service: the processors alone.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from verifier_service.engine.logits_processors import process_logits
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.sampler import SamplingParams, VerifyRow

PROMPT_TOKENS, OUTPUT_TOKENS = 2000, 500
DRAFTS = (0, 4, 16)
CALLS = 200


def _cases(vocab: int, rng: random.Random) -> dict[str, SamplingParams]:
    allowed, biased = min(1000, vocab // 2), min(300, vocab // 2)  # a small test model's vocabulary too
    return {
        "penalties": SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1),
        f"allowed_token_ids {allowed}": SamplingParams(allowed_token_ids=tuple(rng.sample(range(vocab), allowed))),
        f"logit_bias {biased}": SamplingParams(logit_bias=tuple((t, 1.0) for t in rng.sample(range(vocab), biased))),
        "bad_words 128x3": SamplingParams(bad_words=tuple(tuple(rng.sample(range(vocab), 3)) for _ in range(128))),
    }


def time_ms(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def measure(vocab: int, device: torch.device, calls: int = CALLS) -> list[dict]:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
    output = [rng.randrange(vocab) for _ in range(OUTPUT_TOKENS)]
    rows = []
    for name, params in _cases(vocab, rng).items():
        for k in DRAFTS:
            draft = [rng.randrange(vocab) for _ in range(k)]
            logits = torch.randn(k + 1, vocab, device=device)
            state = LogitsState()

            def kept() -> torch.Tensor:
                return process_logits(logits, [VerifyRow(draft, params, None, [], prompt, output, state=state)])

            def fresh() -> torch.Tensor:
                return process_logits(logits, [VerifyRow(draft, params, None, [], prompt, output)])

            assert torch.equal(kept(), fresh())  # and warm
            times: dict[str, list[float]] = {"kept": [], "fresh": []}
            for _ in range(calls):
                times["kept"].append(time_ms(kept, device))
                times["fresh"].append(time_ms(fresh, device))
            kept_ms, fresh_ms = statistics.median(times["kept"]), statistics.median(times["fresh"])
            rows.append({"request": name, "draft_tokens": k, "kept_ms": kept_ms, "rebuilt_ms": fresh_ms,
                         "ratio": fresh_ms / kept_ms})
    return rows


def print_table(rows: list[dict], vocab: int, device: torch.device) -> None:
    print(f"\nLogits processors per step, one sequence ({PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} generated tokens, "
          f"vocabulary {vocab}, {device}; median ms of {CALLS} calls each)")
    print(f"{'request':<24}{'draft':>6}{'kept ms':>10}{'rebuilt ms':>12}{'rebuilt/kept':>14}")
    for r in rows:
        print(f"{r['request']:<24}{r['draft_tokens']:>6}{r['kept_ms']:>10.3f}{r['rebuilt_ms']:>12.3f}"
              f"{r['ratio']:>13.1f}x")
    print("kept: the sequence's LogitsState carried from step to step (the engine); rebuilt: a fresh one "
          "each step, every tensor built again from the whole context")
