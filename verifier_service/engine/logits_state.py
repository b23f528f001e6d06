"""What a sequence's logits processors (engine/logits_processors.py) keep on the device between steps.

Rebuilt every step, a penalised request's counts and the set of tokens it has seen cost its whole
context, built in Python and copied to the device. Kept here, a step costs only what changed: the
tokens committed since the last step are counted and, where new, added to the seen tokens; the
allowed tokens' mask and the logit bias are built once. Each penalised sequence holds one float32
count per vocabulary token (196 KiB for a 49,152-token vocabulary), freed with the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class LogitsState:
    _banned: torch.Tensor | None = None  # [V] bool: not among allowed_token_ids
    _allowed: frozenset[int] | None = None  # allowed_token_ids, for cutting drafts
    _bias: tuple[torch.Tensor, torch.Tensor] | None = None  # [b] token ids, [b] their biases
    _counts: torch.Tensor | None = None  # [V] float32: each token's count among the first `_counted` generated
    _counted: int = 0
    _seen: set[int] = field(default_factory=set)  # the prompt's tokens and the generated ones counted
    _seen_ids: torch.Tensor | None = None  # [m] the same, on the device (in no particular order)

    def banned(self, allowed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        """[V] bool: the tokens allowed_token_ids leaves out."""
        if self._banned is None:
            self._banned = torch.ones(vocab, dtype=torch.bool, device=device)
            self._banned[torch.tensor(allowed, device=device)] = False
        return self._banned

    def allowed_set(self, allowed: Sequence[int]) -> frozenset[int]:
        if self._allowed is None:
            self._allowed = frozenset(allowed)
        return self._allowed

    def bias(self, logit_bias: Sequence[tuple[int, float]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([b] token ids, [b] biases) of logit_bias."""
        if self._bias is None:
            tokens, biases = zip(*logit_bias)
            self._bias = torch.tensor(tokens, device=device), torch.tensor(biases, device=device)
        return self._bias

    def penalty_view(self, prompt: Sequence[int], generated: Sequence[int], vocab: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([m] the tokens of the prompt and of `generated`, [V] float32 each token's count among `generated`),
        `generated` being the sequence's output, which only grows."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, device=device)
            self._seen = set(prompt)
            self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
        if len(generated) > self._counted:
            new = generated[self._counted:]
            self._counts.index_add_(0, torch.tensor(new, device=device), torch.ones(len(new), device=device))
            self._counted = len(generated)
            unseen = set(new) - self._seen
            if unseen:
                self._seen |= unseen
                self._seen_ids = torch.cat([self._seen_ids, torch.tensor(sorted(unseen), device=device)])
        return self._seen_ids, self._counts
