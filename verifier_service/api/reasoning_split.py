"""A reasoning model's output, split into its thinking and its answer, for the HTTP fronts.

Under `--reasoning-parser` (engine/reasoning.py), a chat answer carries its thinking as `reasoning`
(vLLM's field), a response of the Responses API as a reasoning item, an Anthropic message as a
thinking block; tool calls are read from the answer alone. The split follows engine/reasoning.py's
rule, on the text: the output starts in the phase its prompt's tokens decide, then the markers, as
the text spells them, open and close the thinking. Streamed, text that may be the start of a marker
is held back until a later output decides it, as a stop string's start is; markers never reach the
client.
"""

from __future__ import annotations

from collections.abc import Sequence

from verifier_service.engine.detokenizer import partial_start
from verifier_service.engine.reasoning import Phase, Reasoning


class ThoughtSplit:
    """One output's text, fed as it comes: `feed` returns the thinking and the answer it releases."""

    def __init__(self, reasoning: Reasoning, prompt_ids: Sequence[int]) -> None:
        self._start, self._end = reasoning.parser.start, reasoning.parser.end
        self._phase = reasoning.phase_after(prompt_ids)
        self._thought = False  # some thinking has gone out (a start marker after that is thinking's text)
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) released by `text`; `final`: the output ends here, nothing is held back."""
        text, self._held = self._held + text, ""
        thought = ""
        while text and self._phase is not Phase.ANSWER:
            if self._phase is Phase.FIRST or not self._thought:  # a start marker may open the output
                if not final and len(text) < len(self._start) and self._start.startswith(text):
                    self._held = text
                    return thought, ""
                if text.startswith(self._start):
                    text, self._phase = text[len(self._start):], Phase.THINKING
                    continue
                if self._phase is Phase.FIRST:
                    self._phase = Phase.ANSWER
                    break
            self._thought = True
            end = text.find(self._end)
            if end >= 0:
                thought += text[:end]
                text, self._phase = text[end + len(self._end):], Phase.ANSWER
                break
            keep = 0 if final else partial_start(text, self._end)
            thought += text[:len(text) - keep]
            self._held = text[len(text) - keep:]
            return thought, ""
        return thought, text


def split(reasoning: Reasoning, prompt_ids: Sequence[int], text: str) -> tuple[str, str]:
    """(thinking, answer) of a whole output's text."""
    return ThoughtSplit(reasoning, prompt_ids).feed(text, final=True)
