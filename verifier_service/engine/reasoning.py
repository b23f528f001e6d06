"""Reasoning models: where the thinking ends and the answer begins.

Models such as DeepSeek-R1 and Qwen3 think before they answer, between `<think>` and `</think>`,
each one token of their vocabulary. With `--reasoning-parser` (vLLM's flag and names), the verifier
knows these markers, and two things follow from the one rule below:
- a structured-output constraint, and so a tool choice that calls, holds the answer and not the
  thinking: the model thinks freely, then answers in the form asked for, as in vLLM and SGLang
  (engine/structured_output.py, ReasoningGate);
- the HTTP fronts return the thinking apart from the answer (api/reasoning_split.py).

The rule. The prompt's last turn decides where the output starts: a chat template that opened the
thinking (its last marker is `<think>`: DeepSeek-R1, Qwen3's thinking models) starts it in thought;
one that closed it (its last marker is `</think>`: Qwen3 with `enable_thinking` false) starts it in
the answer. Where the last turn has neither, `deepseek_r1` starts in thought (R1 may think without
writing `<think>`) and `qwen3` leaves it to the first token: `<think>` opens the thinking, anything
else begins the answer. In thought, `</think>` ends it. The markers are neither thought nor answer.
The last turn is what follows the prompt's last special token (a chat template's turn marker, such
as Qwen3's `<|im_start|>`): the markers of an earlier assistant turn, whose thinking a tool loop
sends back, say nothing about this one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the verifier's flags are checked before transformers loads
    from transformers import PreTrainedTokenizerBase


class Phase(enum.Enum):
    THINKING = "thinking"
    ANSWER = "answer"
    FIRST = "first"  # qwen3, a prompt without markers: the first token decides


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_unopened: bool  # a prompt without markers starts the output in thought
    start: str = "<think>"
    end: str = "</think>"


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", thinks_unopened=True),
                               ReasoningParser("qwen3", thinks_unopened=False))}


class ReasoningUnavailable(ValueError):
    """The model's tokenizer does not spell the parser's markers as single tokens."""


@dataclass(frozen=True)
class Reasoning:
    """A parser resolved against one model's tokenizer."""

    parser: ReasoningParser
    start_id: int
    end_id: int
    turn_ids: frozenset[int] = frozenset()  # the tokenizer's special tokens: where a prompt's turns begin and end

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer: PreTrainedTokenizerBase) -> Reasoning:
        """Raises ReasoningUnavailable: the markers must be single tokens, and written in answers' text
        (the fronts split the text), which special tokens are not."""
        ids = []
        special = frozenset(tokenizer.all_special_ids)
        for marker in (parser.start, parser.end):
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ReasoningUnavailable(f"--reasoning-parser {parser.name}: this model's tokenizer has no single "
                                           f"token for {marker!r} (it spells it as {len(encoded)} tokens)")
            if encoded[0] in special:
                raise ReasoningUnavailable(f"--reasoning-parser {parser.name}: this model's tokenizer marks {marker!r} "
                                           "as a special token, which answers leave out of their text")
            ids.append(encoded[0])
        return cls(parser, *ids, special)

    def phase_after(self, prompt_ids: Sequence[int]) -> Phase:
        """Where the output of this prompt starts (module docstring)."""
        for token in reversed(prompt_ids):  # from the end: most prompts stop at their last turn's start
            if token == self.end_id:
                return Phase.ANSWER
            if token == self.start_id:
                return Phase.THINKING
            if token in self.turn_ids:
                break
        return Phase.THINKING if self.parser.thinks_unopened else Phase.FIRST

    def step(self, phase: Phase, token: int) -> tuple[Phase, bool]:
        """(the phase after `token`, emitted in `phase`; whether `token` is part of the answer)."""
        if phase is Phase.ANSWER:
            return phase, True
        if phase is Phase.THINKING:
            return (Phase.ANSWER if token == self.end_id else phase), False
        return (Phase.THINKING, False) if token == self.start_id else (Phase.ANSWER, True)

    def walk(self, phase: Phase, tokens: Iterable[int]) -> tuple[Phase, list[int], int]:
        """(the phase after `tokens`, which follow `phase`; those of them that are the answer's, in order:
        a suffix of `tokens`, since the answer, once begun, lasts; how many of them are thinking, the
        `<think>` that opens it and the `</think>` that closes it not counted: what a thinking budget counts)."""
        answer, thought = [], 0
        for token in tokens:
            before = phase
            phase, answered = self.step(phase, token)
            if answered:
                answer.append(token)
            elif before is Phase.THINKING and phase is Phase.THINKING:
                thought += 1
        return phase, answer, thought

    def thought_tokens(self, prompt_ids: Sequence[int], output_ids: list[int]) -> int:
        """How many of the output's tokens are not the answer's: thought and markers (OpenAI's reasoning_tokens)."""
        return len(output_ids) - len(self.walk(self.phase_after(prompt_ids), output_ids)[1])
