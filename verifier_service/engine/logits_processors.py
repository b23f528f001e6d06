"""What a request asks to change in the target's logits before sampling: a structured-output mask,
a logit bias, the stops held back until its minimum length, and the frequency, presence and
repetition penalties, applied to every verify row with exactly the tokens before that row's position.

A penalty makes the next-token distribution depend on the tokens already there. A verify row
stands at one position: after the sequence's committed tokens plus, for row j of a chain, the
draft's first j tokens, or, for a tree node's row, the tokens on its path from the root. Each row
penalised with the counts of its own prefix is the penalised target's conditional at that
position, just as the unpenalised row is the target's; the sampler's argument (engine/sampler.py)
holds for any target, so speculation stays lossless, and a greedy or seeded request emits the
tokens plain decoding with the same settings emits.

In the order vLLM applies them, all before temperature, top-k and top-p:
- structured output (engine/structured_output.py): the tokens the request's constraint refuses at a
  row's position get no chance at all (vLLM, too, masks before its sampler's processors);
- `allowed_token_ids` (vLLM): every token not listed gets no chance at all;
- `bad_words` (vLLM): a word's last token gets no chance at all where the generated tokens before the
  row's position (the draft's, for a draft row) end with the rest of the word;
- `logit_bias` (OpenAI): a fixed amount added to each listed token's logit;
- `min_new_tokens` (vLLM's `min_tokens`): at a position fewer tokens past the committed ones than
  the sequence still lacks, its end-of-sequence and stop token ids get no chance at all;
- `repetition_penalty` r (vLLM; transformers' RepetitionPenaltyLogitsProcessor): over the prompt
  and the generated tokens, a token's positive logit is divided by r, a negative one multiplied;
- `frequency_penalty` f, `presence_penalty` p (OpenAI): over the generated tokens only, each
  logit loses f times its token's count, and p once if the token occurs.
Log-probabilities stay those of the raw logits (sampler.token_logprobs), as vLLM reports them by
default. Draft tokens that allowed_token_ids or bad_words ban where they stand could never be
accepted: `cut_banned` takes them out of the draft before the forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from drafter_sdk.tree import depths
from verifier_service.engine.logits_state import LogitsState
from verifier_service.engine.sampler import SamplingParams, VerifyRow
from verifier_service.engine.tree_verify import cut_draft, draft_paths


def process_logits(logits: torch.Tensor, rows: list[VerifyRow]) -> torch.Tensor:
    """logits [sum(len(draft)+1), V], laid out as verify_batch reads them -> the same with the rows of
    every request that asks for it rewritten; `logits` itself is left as it is (a copy, if any is)."""
    if not any(row.processes_logits for row in rows):
        return logits
    out = logits.clone()  # the raw logits stay for the log-probabilities
    offset = 0
    for row in rows:
        n = len(row.draft) + 1
        if row.processes_logits:
            _process(out[offset:offset + n], row)
        offset += n
    return out


def _process(logits: torch.Tensor, row: VerifyRow) -> None:
    """logits [n, V] of one sequence's rows, in place: biased, stops held where the row is short of
    the minimum, then penalised row by row with its own prefix's counts (in float32)."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    _process_float(x, row)
    if x is not logits:
        logits.copy_(x)


def _process_float(x: torch.Tensor, row: VerifyRow) -> None:
    n = x.shape[0]
    device = x.device
    params = row.params
    if row.grammar is not None:  # first: what it refuses stays at -inf through every step below
        x.masked_fill_(~row.grammar.row_masks(row.draft, row.parents).to(device), -torch.inf)
    if params.allowed_token_ids:
        x.masked_fill_(row.state.banned(params.allowed_token_ids, x.shape[1], device), -torch.inf)
    if params.bad_words:
        _ban_words(x, row)
    if params.logit_bias:
        tokens, biases = row.state.bias(params.logit_bias, device)
        x.index_add_(1, tokens, biases.expand(n, -1))
    if row.held:
        short = [r for r, depth in enumerate(_depths(row.draft, row.parents)) if depth < row.held_for]
        x[torch.tensor(short, device=device)[:, None], torch.tensor(row.held, device=device)] = -torch.inf
    if params.frequency_penalty == params.presence_penalty == 0.0 and params.repetition_penalty == 1.0:
        return
    _penalise(x, row)


def _penalise(x: torch.Tensor, row: VerifyRow) -> None:
    """x [n, V], in place: every row penalised with the committed tokens (the prompt's and the output's,
    whose columns and counts the sequence's LogitsState keeps on the device), then the columns of each
    draft row's own path tokens computed again from their values before, with the path counted too.
    Column for column, the same float32 operations in the same order as a row of plain decoding, whose
    output holds that path: the same bits. Only the seen tokens' columns can change."""
    device = x.device
    rp, f, p = row.params.repetition_penalty, row.params.frequency_penalty, row.params.presence_penalty
    seen, counts = row.state.penalty_view(row.prompt_ids, row.output_ids, x.shape[1], device)  # [m], [V]
    on_paths = [(r, token, k) for r, path in enumerate(draft_paths(row.draft, row.parents), start=1)
                for token, k in Counter(path).items()]
    if on_paths:
        rows, tokens, extra = (torch.tensor(column, device=device) for column in zip(*on_paths))
        before = x[rows, tokens]  # [k]
    sub = x[:, seen]  # [n, m]: every seen token is repeated (in the prompt, or generated)
    if rp != 1.0:
        sub = torch.where(sub > 0, sub / rp, sub * rp)
    seen_counts = counts[seen]  # [m]
    x[:, seen] = sub - f * seen_counts - p * (seen_counts > 0).float()
    if on_paths:
        path_counts = counts[tokens] + extra  # [k], each above 0: repeated, and present
        if rp != 1.0:
            before = torch.where(before > 0, before / rp, before * rp)
        x[rows, tokens] = before - f * path_counts - p * (path_counts > 0).float()


def _ban_words(x: torch.Tensor, row: VerifyRow) -> None:
    """x [n, V], in place: at each row, the last token of every bad word whose other tokens end what was
    generated before that row's position (vLLM matches the generated tokens only, not the prompt's)."""
    tail = _tail(row.params.bad_words, row.output_ids)
    before = [tail, *(tail + path for path in draft_paths(row.draft, row.parents))]
    for r, generated in enumerate(before):
        for last in _bad_word_ends(row.params.bad_words, generated):
            x[r, last] = -torch.inf


def _tail(bad_words: Sequence[tuple[int, ...]], output_ids: Sequence[int]) -> list[int]:
    """The generated tokens a bad word's first tokens can reach back to."""
    longest = max(len(word) for word in bad_words) - 1
    return list(output_ids[len(output_ids) - longest:]) if longest else []


def _bad_word_ends(bad_words: Sequence[tuple[int, ...]], generated: list[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end `generated`: banned next."""
    return [last for *rest, last in bad_words
            if len(rest) <= len(generated) and generated[len(generated) - len(rest):] == rest]


def cut_banned(draft: list[int], parents: list[int], params: SamplingParams, output_ids: Sequence[int],
               state: LogitsState) -> tuple[list[int], list[int]]:
    """The draft without the tokens allowed_token_ids or bad_words ban at their position, which
    process_logits would mask and no verification could accept (as structured output cuts a draft,
    tree_verify.cut_draft): they cost no verify row."""
    if not draft or not params.bans_tokens:
        return draft, parents
    allowed = state.allowed_set(params.allowed_token_ids) if params.allowed_token_ids else None
    tail = _tail(params.bad_words, output_ids) if params.bad_words else []

    def refused(path: list[int]) -> bool:
        token = path[-1]
        return ((allowed is not None and token not in allowed)
                or (bool(params.bad_words) and token in _bad_word_ends(params.bad_words, tail + path[:-1])))

    return cut_draft(draft, parents, refused)


def _depths(draft: list[int], parents: list[int]) -> list[int]:
    """Draft tokens before each row's position (the root row first): its depth."""
    return [0, *(depths(parents) if parents else range(1, len(draft) + 1))]
