"""A request's predicted output (OpenAI's Predicted Outputs), as a draft source of its own.

A prediction is text the answer is expected to largely repeat: a file the model rewrites with a
few changes, a document it corrects. The verifier drafts from it itself, ahead of any drafter
(engine.py): while the output follows the prediction, the draft is the prediction's next tokens.
Where the output leaves it (an edit), drafting stops until the output's last RESYNC tokens are
found in the prediction again: first after where it left (a deletion skips ahead, an insertion
comes back to the same place), else at their last place before it (a repeat of earlier text),
never at the very place that just failed, and goes on from there. Each output token is read once,
and finding the way back is one dictionary lookup, so a step costs the same whatever the
prediction's length.

Every draft is verified, so a prediction that is wrong, or tokenized otherwise than the model
writes it, costs speed, never a token.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

RESYNC = 2  # output tokens that must match the prediction again before it drafts after an edit


class Prediction:
    """Where a sequence's output stands in its prediction (`tokens`)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self._cursor: int | None = 0  # the position of the output's next expected token; None: lost
        self._left_at = 0  # where the output last left the prediction
        self._read = 0  # output tokens read so far
        # Every RESYNC tokens of the prediction: the positions just after them, ascending.
        self._after: dict[tuple[int, ...], list[int]] = {}
        for end in range(RESYNC, len(self.tokens) + 1):
            self._after.setdefault(tuple(self.tokens[end - RESYNC:end]), []).append(end)

    def draft(self, output: Sequence[int], k: int) -> list[int]:
        """The prediction's next `k` tokens after `output` (the tokens generated so far); [] where the
        output has left the prediction and not come back, or has used it up."""
        self._read_output(output)
        return [] if self._cursor is None else self.tokens[self._cursor:self._cursor + k]

    def drafts(self, output: Sequence[int]) -> bool:
        """Whether it has a draft after `output`: the output follows it, and has not used it up."""
        self._read_output(output)
        return self._cursor is not None and self._cursor < len(self.tokens)

    def _read_output(self, output: Sequence[int]) -> None:
        for i in range(self._read, len(output)):
            at = self._cursor
            if at is not None and at < len(self.tokens) and self.tokens[at] == output[i]:
                self._cursor = at + 1
                continue
            if at is not None:
                self._left_at = at
            self._cursor = self._way_back(output[max(0, i + 1 - RESYNC):i + 1])
        self._read = len(output)

    def _way_back(self, last: Sequence[int]) -> int | None:
        """The position after `last` (the output's last RESYNC tokens) in the prediction: the first after
        where the output left it, else the last before; None where there is neither."""
        ends = self._after.get(tuple(last)) if len(last) == RESYNC else None
        if not ends:
            return None
        j = bisect_right(ends, self._left_at)
        if j < len(ends):
            return ends[j]
        j = bisect_left(ends, self._left_at)
        return ends[j - 1] if j else None
