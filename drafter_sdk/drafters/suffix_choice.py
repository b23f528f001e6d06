"""Which of the suffix drafter's two trees drafts: the longer-match rule, corrected by what was accepted.

The longer match wins between a request's own tree and the global one (suffix.py), and that is
right more often than vLLM's higher score, but not everywhere. In templated answers the global tree
often matches a long run of shared boilerplate that ends in the first token of something only this
request knows (a name it wrote three lines up): there a three-token match in its own context drafted
6.0 accepted tokens on average where the global tree's match of four or more drafted 1.3 (replayed
against greedy outputs of 40 templated prompts; BENCHMARKS.md). So wherever both trees draft, the drafter
keeps both drafts as a Trial, and once the committed tokens show how many tokens of each the verifier
would have accepted, the pair of match lengths they followed learns the difference (ChoiceTable). The
choice then goes to the tree that drafted better after such pairs, the longer-match rule deciding
until evidence outweighs it.

The untried draft's count is as sound as the tried one's: the committed tokens do not depend on which
draft was verified, under greedy decoding and under lossless sampling alike (each emitted token is
drawn from the target's distribution; a draft only decides how many are drawn in one step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Evidence, in accepted tokens, that a difference of one token between the two matches' lengths
# stands for: a tree whose match is d tokens shorter wins once its drafts have been accepted
# PRIOR_TOKENS * d tokens more, in total, than the other's after such pairs of matches.
PRIOR_TOKENS = 4.0
# Weight left to a pair's earlier evidence at each new trial: the table follows what the traffic drafts
# now (about the last twenty trials of each pair). Replayed, 0.999 learned as well from one workload, but
# after 24 recurring questions (where the global tree wins) the templated answers that followed gained
# 1.244x the n-gram drafter's modelled tokens/s against 1.259x at 0.95.
DECAY = 0.95
# Where the table says one tree's draft wins against any match the other tree holds, the other is not
# searched (as without learning), except on one drafting step in this many: so a pair the table has
# settled keeps being checked, at a sixteenth of the cost of searching both trees every step.
RECHECK_EVERY = 16
# After a global match this long (a recurring answer) the own tree is searched only where it holds a
# match that could win: in the replays no own draft beat such a global one, and skipping the search kept 16
# sequences' drafting at 1.82 ms p50 (the speed bench) where searching the own tree after every global
# draft took 2.67 ms. After shorter global matches it is always searched: its drafts there are what the
# table learns from.
LONG_MATCH = 16
# Trials a request keeps waiting for their tokens: a draft is settled within its own length in
# committed tokens, so a few steps' worth; more only where tokens come one at a time.
MAX_PENDING = 32


def bucket(match_len: int) -> int:
    """Match lengths are told apart exactly up to 4 tokens, then as 5-7, 8-15 and 16 or more."""
    return match_len if match_len <= 4 else 5 if match_len < 8 else 8 if match_len < 16 else 16


def accepted(draft: Sequence[int], tokens: Sequence[int], at: int) -> int | None:
    """How many of `draft`'s tokens a verifier accepts where the context continued as tokens[at:];
    None until the committed tokens decide it."""
    n = min(len(draft), len(tokens) - at)
    for i in range(n):
        if draft[i] != tokens[at + i]:
            return i
    return n if n == len(draft) else None


@dataclass
class Trial:
    """Both trees' drafts at one step, until the committed tokens settle them."""

    at: int  # the context's length then: both drafts predict tokens[at:]
    pair: tuple[int, int]  # (own, global) match lengths, bucketed
    own: list[int]
    shared: list[int]

    def nbytes(self) -> int:
        """Estimated memory held: the object, its two lists and an int object per token."""
        return 200 + 36 * (len(self.own) + len(self.shared))


def pending_trials() -> deque[Trial]:
    """A request's trials waiting for their tokens, at most MAX_PENDING (the oldest dropped)."""
    return deque(maxlen=MAX_PENDING)


@dataclass
class ChoiceTable:
    """Per pair of bucketed match lengths (own, global): how many more tokens the own tree's drafts
    were accepted than the global tree's, summed over settled trials (decayed)."""

    gains: dict[tuple[int, int], float] = field(default_factory=dict)
    # shortest_rival's answers by its arguments, until the gains change: every request asks at every step.
    _rivals: dict[tuple[int, bool, int], int] = field(default_factory=dict, init=False, repr=False)

    def own_wins(self, own_len: int, shared_len: int, own_scores_as_much: bool) -> bool:
        """The longer-match rule (between equal matches, the higher score; the own tree on a tie),
        overruled where the evidence for this pair outweighs PRIOR_TOKENS per token of difference."""
        rule = PRIOR_TOKENS * (own_len - shared_len) if own_len != shared_len else (
            PRIOR_TOKENS / 2 if own_scores_as_much else -PRIOR_TOKENS / 2)
        return self.gains.get((bucket(own_len), bucket(shared_len)), 0.0) + rule >= 0

    def shortest_rival(self, length: int, own: bool, longest: int) -> int:
        """The shortest match (at most `longest` tokens) after which the other tree's draft could win
        against a draft after `length` tokens of the own tree (`own`) or of the global one; longest + 1
        where none could. Between equal matches the other is assumed to score more."""
        key = (length, own, longest)
        rival = self._rivals.get(key)
        if rival is None:
            rival = self._rivals[key] = next(
                (other for other in range(1, longest + 1)
                 if ((not self.own_wins(length, other, False)) if own else self.own_wins(other, length, True))),
                longest + 1)
        return rival

    def learn(self, pending: deque[Trial], tokens: Sequence[int]) -> None:
        """Learns from the trials the committed `tokens` settle, and drops them from `pending`."""
        for _ in range(len(pending)):
            trial = pending.popleft()
            own, shared = accepted(trial.own, tokens, trial.at), accepted(trial.shared, tokens, trial.at)
            if own is None or shared is None:
                pending.append(trial)
            else:
                self.gains[trial.pair] = self.gains.get(trial.pair, 0.0) * DECAY + own - shared
                self._rivals.clear()
