"""Greedy and lossless rejection sampling for verifying draft tokens.

Drafts are token ids only, so each draft token is a point mass q(x) = 1.
Greedy requests accept while the draft equals the target's argmax. Sampled
requests accept draft token x with probability p(x); on rejection they sample
from p with x removed and renormalised, which is exactly p conditioned on not
x. Either way the output distribution is the target's, whatever was drafted.

The sampled rule is run in its coupled form: draw y ~ p with the request's
generator and accept x iff y == x (probability p(x)); otherwise emit y, which
given y != x is distributed as p without x, renormalised. That is one draw per
emitted token, in order, exactly as plain decoding draws, so a seeded request
gives the same output whatever the drafter proposed, whether its drafts arrived
in time and however the batch around it was drafted.

Token trees (tree_verify.py) are walked from the root: at each node, the
target's token y (argmax, or one draw y ~ p with the request's generator); if
a child of the node carries y, y is accepted and the walk moves to that child,
else y is emitted as the target's own token and the walk stops (at a leaf it
always stops: the bonus token). Greedy, that emits exactly plain decoding's
tokens. Sampled, it is lossless for any tree and any drafter: suppose the walk
is at a node whose path equals the tokens emitted so far. That node's logits
are the target's conditional given the context and those tokens (the tree
mask shows a node its ancestors only, at their plain-decoding positions), and
the next emitted token is a fresh draw from exactly that conditional, whatever
the children carry: they only decide whether the walk continues, at the child
carrying the drawn token, whose row is the conditional given one more emitted
token, or stops. By induction every emitted token is distributed as the
target's conditional given all tokens emitted before it, which is the target's
distribution over sequences. Siblings carry distinct tokens, so at most one
child matches and no choice is left to the drafter; and the walk spends one
draw per emitted token, in order, as plain decoding does, so a seeded request
emits the same tokens with a tree, a chain or no draft. (This is SpecInfer's
multi-step speculative sampling for point-mass drafts: trying sibling x with
acceptance p(x), then the next sibling under p renormalised without x, and so
on, is one draw from p followed by a lookup among the siblings.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from drafter_sdk.tree import accepted_path
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.structured_output import Constrained
from verifier_service.engine.tree_verify import walk

# Top-p without top-k first ranks this many of the most likely tokens (target_probs).
NUCLEUS_PROBE = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: each emitted token's own; N: also the top N
    # engine/logits_processors.py
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    allowed_token_ids: tuple[int, ...] = ()  # sorted; empty: any token
    bad_words: tuple[tuple[int, ...], ...] = ()  # each word's token ids (vLLM's bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def bans_tokens(self) -> bool:
        """Whether some tokens can never come next (engine/logits_processors.py cuts them from drafts)."""
        return bool(self.allowed_token_ids) or bool(self.bad_words)

    @property
    def processes_logits(self) -> bool:
        """Whether its logits change before sampling (engine/logits_processors.py)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_words))


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target and the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token; tokens as likely count ahead of it, as vLLM ranks
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class VerifyRow:
    """One sequence of a step: its draft and how to sample it."""

    draft: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    parents: list[int] = field(default_factory=list)  # a token tree's (drafter_sdk/tree.py); [] = a chain
    # The sequence's committed tokens, which penalties count (engine/logits_processors.py).
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    # min_new_tokens (engine/logits_processors.py): these ids cannot come next at a position fewer
    # than `held_for` tokens past the committed ones.
    held_for: int = 0
    held: tuple[int, ...] = ()
    grammar: Constrained | None = None  # structured output (engine/structured_output.py), at the committed tokens
    state: LogitsState = field(default_factory=LogitsState)  # the sequence's, kept between steps

    @property
    def processes_logits(self) -> bool:
        return self.params.processes_logits or bool(self.held_for and self.held) or self.grammar is not None


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (in that order, as transformers does).

    Top-p ranks only the tokens it could keep: the top-k where there is one, else the NUCLEUS_PROBE most
    likely where they hold top_p's mass (every token past them then has that much mass before it), else the
    whole vocabulary. Sorting a 49,152-token row took 2.8 ms on this CPU, the probe's topk 0.07 ms."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    ranked: tuple[torch.Tensor, torch.Tensor] | None = None  # (probabilities, token ids), most likely first
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        top = torch.topk(probs, params.top_k, dim=-1)
        # Top-p then measures mass within the top-k tokens, as transformers and vLLM do.
        ranked = (top.values / top.values.sum(dim=-1, keepdim=True), top.indices)
    if 0.0 < params.top_p < 1.0:
        values, order = ranked if ranked is not None else _nucleus_candidates(probs, params.top_p)
        # Drop a token once the mass ranked before it already reaches top_p.
        ranked = (torch.where((values.cumsum(-1) - values) >= params.top_p, 0.0, values), order)
    if ranked is not None:
        probs = torch.zeros_like(probs).scatter_(-1, ranked[1], ranked[0])
    if params.min_p > 0.0:  # relative to the most likely token left (which stays), so scale does not matter
        probs = torch.where(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first maximum where tied (torch and numpy agree on that). On CPU through
    numpy: torch's argmax over a vocabulary row measured 73 us per row here, numpy's 3.4 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's tokens top-p may keep, most likely first, with their probabilities."""
    probe = torch.topk(probs, min(NUCLEUS_PROBE, probs.shape[-1]), dim=-1)
    if bool((probe.values.sum(dim=-1) >= top_p).all()):
        return probe.values, probe.indices
    return probs.sort(dim=-1, descending=True)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from the row `probs` by an exponential race: every token i of the vocabulary gets its own
    E_i = -log(U_i) ~ Exp(1), from one vector of uniforms U the request's generator gives per emitted
    token (whatever was drafted), and the token with the largest p_i / E_i wins, which happens with
    probability p_i (the first to ring of independent exponential clocks of rates p_i). Tokens of
    probability 0 never win, and scaling the row changes nothing.

    Each token's ratio turns on its own probability and uniform alone, so logits that differ in their last bits
    (a verify row against plain decoding's one-row forward, a prompt taken from the prefix cache against one
    prefilled afresh, another batch) change a draw only where two tokens' p / E nearly tie. The inverse CDF this
    replaced moved every token's interval by the sum of the differences before it in the vocabulary: on the
    embedded model at temperature 1, 28 of 360 seeded answers left plain decoding's with speculation, and none
    with the race (BENCHMARKS.md). The race costs V uniforms a token: 0.15 ms over a 49,152-token row on this
    CPU, against 0.03 ms (torch.multinomial: 0.76 ms)."""
    uniforms = torch.rand(probs.shape[-1], generator=generator, device=probs.device)
    # A uniform of exactly 0 would be a clock that never rings: where it fell on the one token with mass,
    # every ratio would be 0 and token 0 would win, mass or not. The smallest float rings it late instead.
    clocks = -uniforms.clamp_(min=torch.finfo(uniforms.dtype).tiny).log_()
    return argmax_rows((probs / clocks)[None])[0]


def verify_sampled(logits: torch.Tensor, row: VerifyRow) -> list[int]:
    """logits [len(draft)+1, V] -> accepted draft tokens plus one corrected or bonus token.

    Coupled point-mass rule (see the module docstring): y ~ p at each position;
    the draft token is accepted iff y equals it, else y is the correction.
    """
    probs = target_probs(logits, row.params)
    out: list[int] = []
    for j in range(len(row.draft) + 1):
        token = _sample(probs[j], row.generator)
        out.append(token)
        if j == len(row.draft) or token != row.draft[j]:
            break
    return out


def verify_tree(logits: torch.Tensor, row: VerifyRow) -> list[int]:
    """logits [len(draft)+1, V] (the root, then the tree's nodes) -> accepted path plus one token:
    the tree walk of the module docstring."""
    if row.params.greedy:
        return walk(row.draft, row.parents, argmax_rows(logits).__getitem__)
    probs = target_probs(logits, row.params)
    return walk(row.draft, row.parents, lambda r: _sample(probs[r], row.generator))


def verify_batch(logits: torch.Tensor, rows: list[VerifyRow]) -> list[list[int]]:
    """logits [sum(len(draft)+1), V], rows laid out one after another -> new tokens per row."""
    argmax = argmax_rows(logits) if any(row.params.greedy for row in rows) else []
    out: list[list[int]] = []
    offset = 0
    for row in rows:
        n = len(row.draft) + 1
        if row.parents:
            out.append(verify_tree(logits[offset:offset + n], row))
        elif row.params.greedy:
            target = argmax[offset:offset + n]
            accepted = 0
            while accepted < len(row.draft) and row.draft[accepted] == target[accepted]:
                accepted += 1
            out.append(row.draft[:accepted] + [target[accepted]])
        else:
            out.append(verify_sampled(logits[offset:offset + n], row))
        offset += n
    return out


def token_logprobs(logits: torch.Tensor, rows: list[VerifyRow],
                   tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
    """Log-probabilities of each row's emitted tokens (None for rows that asked for none).

    From the raw logits' log-softmax, before temperature, top-k and top-p (vLLM's default), at the
    positions the tokens were emitted from (a tree's: its accepted path's): an accepted draft
    token's comes from the verify forward, exactly where plain decoding would have computed it.
    """
    out: list[list[TokenLogprob] | None] = []
    offset = 0
    for row, emitted in zip(rows, tokens):
        n = row.params.logprobs
        if n is None:
            out.append(None)
        else:
            if row.parents:  # a tree: token j came from the root's row, then from its path's nodes' rows
                path = accepted_path(row.draft, row.parents, emitted[:-1])
                emitted_from = logits[[offset, *(offset + 1 + node for node in path)]]
            else:
                emitted_from = logits[offset:offset + len(emitted)]
            out.append(logprobs_of(emitted_from, emitted, n))
        offset += len(row.draft) + 1
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: list[list[int] | None],
                          counts: list[int | None]) -> list[list[TokenLogprob] | None]:
    """Per prefill, the log-probabilities of the prompt tokens its chunk's positions predict
    (`targets`: StepPlan.prompt_logprob_targets; `logits`: those positions', in that order), each
    with the `counts` most likely alternatives; None where none were asked for."""
    out: list[list[TokenLogprob] | None] = []
    offset = 0
    for want, n in zip(targets, counts):
        if want is None or n is None:
            out.append(None)
            continue
        out.append(logprobs_of(logits[offset:offset + len(want)], want, n))
        offset += len(want)
    return out


def logprobs_of(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """logits [len(tokens), V] -> each token's log-probability there, with the n most likely alternatives."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])
    ranks = (logp >= chosen).sum(-1).tolist()
    top_v, top_i = logp.topk(n, dim=-1) if n else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(t, lp, rank, tuple(zip(ids, vals)))
            for t, lp, rank, ids, vals in zip(tokens, chosen[:, 0].tolist(), ranks, top_i.tolist(), top_v.tolist())]
