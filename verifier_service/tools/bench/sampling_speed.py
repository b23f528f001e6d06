"""`splitspec bench --engine-sections sampling`: what verifying a sampled row costs the step.

One sequence's verify rows (a chain of 0, 4 or 16 draft tokens) on the model's vocabulary and the bench's
device, for the sampling a request may ask or a model recommend: temperature alone, top-p alone, and
Qwen3's temperature 0.6 / top-p 0.95 / top-k 20. The engine's sampler (engine/sampler.py: an exponential
race, a uniform per vocabulary token a draw; top-p ranking only the tokens it may keep) is timed against the
textbook one (top-p over the whole vocabulary sorted, torch.multinomial), which draws from the same
distribution; the two take turns, call by call, and the medians are compared. No model and no service.
"""

from __future__ import annotations

import statistics

import torch

from verifier_service.engine.sampler import SamplingParams, VerifyRow, target_probs, verify_sampled
from verifier_service.tools.bench.logits_speed import CALLS, DRAFTS, time_ms

CASES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "Qwen3's (0.6, 0.95, 20)": SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
}


def textbook_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The same distribution as engine/sampler.py's target_probs (for CASES: no min-p), with the whole
    vocabulary sorted for top-p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if 0 < params.top_k < probs.shape[-1]:
        top = torch.topk(probs, params.top_k, dim=-1)
        probs = torch.zeros_like(probs).scatter_(-1, top.indices, top.values)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if 0.0 < params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def textbook_verify(logits: torch.Tensor, row: VerifyRow) -> list[int]:
    """verify_sampled's rule, drawing with torch.multinomial from textbook_probs."""
    probs = textbook_probs(logits, row.params)
    out: list[int] = []
    for j in range(len(row.draft) + 1):
        out.append(int(torch.multinomial(probs[j], 1, generator=row.generator)))
        if j == len(row.draft) or out[-1] != row.draft[j]:
            break
    return out


def measure(vocab: int, device: torch.device, calls: int = CALLS) -> list[dict]:
    rows = []
    for name, params in CASES.items():
        for k in DRAFTS:
            # Logits as peaked as a model's; drafts of its likeliest tokens, so that some are accepted.
            logits = torch.randn(k + 1, vocab, device=device, generator=torch.Generator(device).manual_seed(k)) * 4
            draft = logits[:k].argmax(dim=-1).tolist()
            assert torch.allclose(target_probs(logits, params), textbook_probs(logits, params), atol=1e-6)
            engine = VerifyRow(draft, params, torch.Generator(device).manual_seed(0))
            textbook = VerifyRow(draft, params, torch.Generator(device).manual_seed(0))
            times: dict[str, list[float]] = {"engine": [], "textbook": []}
            for _ in range(calls):
                times["engine"].append(time_ms(lambda: verify_sampled(logits, engine), device))
                times["textbook"].append(time_ms(lambda: textbook_verify(logits, textbook), device))
            engine_ms, textbook_ms = statistics.median(times["engine"]), statistics.median(times["textbook"])
            rows.append({"sampling": name, "draft_tokens": k, "engine_ms": engine_ms, "textbook_ms": textbook_ms,
                         "ratio": textbook_ms / engine_ms})
    return rows


def print_table(rows: list[dict], vocab: int, device: torch.device) -> None:
    print(f"\nVerifying one sampled row (vocabulary {vocab}, {device}; median ms of {CALLS} calls each)")
    print(f"{'sampling':<26}{'draft':>6}{'engine ms':>11}{'textbook ms':>13}{'textbook/engine':>17}")
    for r in rows:
        print(f"{r['sampling']:<26}{r['draft_tokens']:>6}{r['engine_ms']:>11.3f}{r['textbook_ms']:>13.3f}"
              f"{r['ratio']:>16.1f}x")
    print("engine: an exponential race (a uniform per vocabulary token a draw), top-p ranking only the tokens it "
          "may keep; textbook: the whole vocabulary sorted for top-p, torch.multinomial")
