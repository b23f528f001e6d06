"""Structured output: an answer held to a JSON schema, any JSON object, a regular expression, a list of
choices or a grammar, by llguidance's token masks, with speculation on.

A constraint is a matcher over the tokens emitted so far; at each position it allows some tokens.
A verify row stands at one position (engine/logits_processors.py): after the committed tokens and,
for a draft row, the draft tokens on its path. Its logits are masked to what the matcher allows
there, so each row is the constrained target's conditional at its position, and the sampler's
argument (engine/sampler.py) holds as it does for penalties: greedy and seeded requests emit what
constrained plain decoding emits. A draft token the constraint refuses could never be accepted, so
drafts are cut before the forward (a chain at its first refused token, a tree's refused nodes with
everything below them): verification spends nothing on them.

Once the constraint is complete, only end-of-sequence is allowed; that is where the answer ends,
which is why ignore_eos and min_new_tokens are refused beside a constraint (request_parsing.py).
Log-probabilities stay those of the raw logits, as for the other logits processors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from verifier_service.engine.reasoning import Phase, Reasoning
from verifier_service.engine.tree_verify import cut_draft, draft_paths

log = logging.getLogger(__name__)


class ConstraintError(ValueError):
    """The constraint does not compile: the request's mistake."""


class StructuredOutputUnavailable(RuntimeError):
    """This model's tokenizer cannot drive llguidance (it needs a fast, Rust-backed tokenizer)."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # StructuredOutput's oneof: json_schema, json_object, regex, choice or grammar
    text: str = ""  # the schema (JSON), the regex, the choices (a JSON list) or the grammar; "" for json_object

    def grammar(self) -> str:
        """llguidance's grammar of this constraint."""
        if self.kind == "json_object":
            return llguidance.grammar_from("json_schema", json.dumps({"type": "object"}))
        return llguidance.grammar_from(self.kind, self.text)


class Grammars:
    """Compiles constraints for one model's tokenizer and vocabulary. The tokenizer's llguidance form
    is built on first use (0.36 s for SmolLM2's 49,152 tokens here), not at start-up: a model whose
    tokenizer llguidance cannot read still serves everything else."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            try:
                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=self._eos or None)
            except (ValueError, TypeError) as e:
                raise StructuredOutputUnavailable(f"structured output is not available for this model's "
                                                  f"tokenizer ({e})") from None
        return self._ll

    def compile(self, constraint: Constraint) -> Grammar:
        """A fresh matcher at the answer's start. Raises ConstraintError or StructuredOutputUnavailable."""
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"structured_output.{constraint.kind}: {e}") from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if matcher.is_error():
            raise ConstraintError(f"structured_output.{constraint.kind}: {matcher.get_error()}")
        # One that compiles may still match nothing ("start: start", a regex of an empty class, a schema that
        # is only its own $ref): llguidance finds out at the first mask, then allows only the end, which
        # would answer an empty text as if it had matched. Refused here instead.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ConstraintError(f"structured_output.{constraint.kind}: matches no text (no first token "
                                  "can begin a match)")
        return Grammar(matcher, self.vocab_size, self._eos)


class Constrained(Protocol):
    """What the engine asks of a request's compiled constraint, at its committed tokens."""

    def row_masks(self, draft: Sequence[int], parents: Sequence[int]) -> torch.Tensor: ...

    def cut(self, draft: list[int], parents: list[int]) -> tuple[list[int], list[int]]: ...

    def commit(self, tokens: Sequence[int]) -> None: ...


class Grammar:
    """One request's constraint, at the position after its committed tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)

    def _allowed(self) -> np.ndarray:
        """bool [V]: the tokens allowed next. Should the matcher allow none (it never should), the
        end-of-sequence tokens, so that the request ends instead of sampling from nothing."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if not allowed.any():
            log.warning("structured output: the constraint allows no token (%s); ending the answer",
                        self._matcher.get_error() or "no error")
            allowed[self._eos] = True
        return allowed

    def allowed_after(self, path: Sequence[int]) -> np.ndarray:
        """bool [V]: the tokens allowed after `path`, tokens beyond the committed ones. Where no emitted
        token can come from there (the path holds a refused token, or ends with end-of-sequence), everything."""
        if not path:
            return self._allowed()
        if path[-1] in self._eos or self.accepted(path) < len(path):
            return np.ones(self.vocab_size, dtype=bool)
        self._matcher.consume_tokens(path)
        allowed = self._allowed()
        self._matcher.rollback(len(path))
        return allowed

    def accepted(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, beyond the committed ones, the constraint allows before it refuses one."""
        return self._matcher.validate_tokens(tokens)

    def row_masks(self, draft: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """bool [len(draft) + 1, V]: the tokens allowed at each verify row (the root's, then each
        draft token's row, after its path)."""
        return torch.from_numpy(np.stack([self.allowed_after(path) for path in [[], *draft_paths(draft, parents)]]))

    def cut(self, draft: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        """The draft without the tokens the constraint refuses: a chain up to its first refused
        token, a tree without its refused nodes and everything below them."""
        if not draft:
            return draft, parents
        if not parents:  # one call for the whole chain
            return draft[:self.accepted(draft)], parents
        return cut_draft(draft, parents, lambda path: self.accepted(path) < len(path))

    def commit(self, tokens: Sequence[int]) -> None:
        """The request emitted these tokens (each allowed where it was sampled). Past the constraint's
        end the matcher has stopped: what follows is the end-of-sequence token, which ends the request."""
        for token in tokens:
            if self._matcher.is_stopped():
                return
            if not self._matcher.consume_token(token):
                log.warning("structured output: emitted token %d was refused (%s)", token, self._matcher.get_error())
                return


class ReasoningGate:
    """What a reasoning model's request is held to (engine/reasoning.py): its thinking is free, but for a
    budget (vLLM's thinking_token_budget: past that many thinking tokens, only `</think>`), and its answer
    is held to its structured-output constraint, where it has one. A verify row in thought allows
    everything (only `</think>` once the budget is spent); a row where the first token decides allows the
    answer's first tokens and `<think>`; a row in the answer is masked as the constraint is after the
    answer's tokens on its path. Each row depends on its own path alone, as Grammar's do, so speculation
    stays lossless; draft tokens no row would allow are cut. The interface is Grammar's."""

    def __init__(self, reasoning: Reasoning, phase: Phase, vocab_size: int, grammar: Grammar | None = None,
                 budget: int | None = None) -> None:
        self._reasoning = reasoning
        self._vocab_size = vocab_size
        self._grammar = grammar
        self._budget = budget
        self._phase = phase  # at the committed tokens
        self._thought = 0  # thinking tokens committed (markers not counted)

    def _walk(self, path: Sequence[int]) -> tuple[Phase, int, list[int]]:
        """(phase, thinking tokens, the answer's tokens on `path`) after the committed tokens and `path`."""
        phase, answer, thought = self._reasoning.walk(self._phase, path)
        return phase, self._thought + thought, answer

    def _spent(self, phase: Phase, thought: int) -> bool:
        return phase is Phase.THINKING and self._budget is not None and thought >= self._budget

    def _allowed_after(self, path: Sequence[int]) -> np.ndarray:
        phase, thought, answer = self._walk(path)
        allowed = np.ones(self._vocab_size, dtype=bool)
        if self._spent(phase, thought):
            allowed[:] = False
            allowed[self._reasoning.end_id] = True
        elif phase is not Phase.THINKING and self._grammar is not None:
            allowed = self._grammar.allowed_after(answer)
            if phase is Phase.FIRST:
                allowed = allowed.copy()
                allowed[self._reasoning.start_id] = True
        return allowed

    def _refused(self, path: list[int]) -> bool:
        if path[-1] != self._reasoning.end_id and self._spent(*self._walk(path[:-1])[:2]):
            return True
        answer = self._walk(path)[2]
        return self._grammar is not None and self._grammar.accepted(answer) < len(answer)

    def row_masks(self, draft: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """bool [len(draft) + 1, V], as Grammar.row_masks."""
        return torch.from_numpy(np.stack([self._allowed_after(path) for path in [[], *draft_paths(draft, parents)]]))

    def cut(self, draft: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        return cut_draft(draft, parents, self._refused) if draft else (draft, parents)

    def commit(self, tokens: Sequence[int]) -> None:
        self._phase, self._thought, answer = self._walk(tokens)
        if self._grammar is not None:
            self._grammar.commit(answer)
