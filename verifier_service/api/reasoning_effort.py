"""How much a reasoning model should think, as its chat template's variables: what OpenAI's
`reasoning_effort` (chat), `reasoning.effort` (Responses) and Anthropic's `thinking` and
`output_config.effort` ask of an open model.

An open model learns how much to think from its chat template, which reads variables of its own:
Qwen3's switch `enable_thinking` turns the thinking on or off, gpt-oss's `reasoning_effort` says how
much. As vLLM does, an OpenAI effort sets both: `reasoning_effort` as sent, and `enable_thinking`
false for "none", true for any other. Anthropic's `thinking` sets the switch ("disabled" false,
"enabled" true, "adaptive" the template's own default) and its `output_config.effort` the effort
alone, as Anthropic's effort also governs answers without thinking. A template that reads neither
variable renders the chat as it would without them, and the request's own `chat_template_kwargs` win:
a variable the client spells out is what the template gets.
"""

from __future__ import annotations

from typing import Any, Literal

# The efforts OpenAI's clients send (their ReasoningEffort), and Anthropic's (its output_config's).
OpenAIEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
AnthropicEffort = Literal["low", "medium", "high", "xhigh", "max"]
SWITCH, EFFORT = "enable_thinking", "reasoning_effort"


def openai_variables(effort: str | None) -> dict[str, Any]:
    """The template variables an OpenAI effort sets (none where it is left out)."""
    return {} if effort is None else {EFFORT: effort, SWITCH: effort != "none"}


def anthropic_variables(thinking: str | None, effort: str | None) -> dict[str, Any]:
    """The template variables Anthropic's `thinking.type` and `output_config.effort` set."""
    variables: dict[str, Any] = {} if effort is None else {EFFORT: effort}
    if thinking in ("enabled", "disabled"):
        variables[SWITCH] = thinking == "enabled"
    return variables


def with_explicit(variables: dict[str, Any], explicit: dict[str, Any] | None) -> dict[str, Any]:
    """`variables` with the request's own chat_template_kwargs (`explicit`) over them."""
    return {**variables, **(explicit or {})}
