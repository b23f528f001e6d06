"""OpenAI response bodies and stream chunks, built from the engine's outputs.

Chat (`chat.completion`, `chat.completion.chunk`) and completions (`text_completion`)
differ only in where the text and the log-probabilities go; both carry `usage` and,
under vLLM's names, the speculation stats. What speculation did per token rides in
an extension, `splitspec: {token_ids, drafted, token_text}` on each choice (on each
chunk's choice when streaming): `drafted[i]` says whether token i was an accepted
draft token, and `token_text[i]` is the text it released (their concatenation is the
choice's generated text), so a client can show exactly which characters the drafter supplied;
a chat under a reasoning parser adds `thinking[i]`: whether token i is thinking or a marker,
by engine/reasoning.py's rule (the playground dims those).

A completion with `echo` starts each choice's text with its prompt (as the prompt's tokens
spell it), and with `logprobs` its log-probabilities with the prompt's tokens' first, the
first token's null: nothing precedes it. vLLM's `prompt_logprobs` puts them, in vLLM's shape
(token id -> logprob, rank, decoded_token), in each completion choice, or once in a chat
response: a chat's choices share one prompt.

Under a tool choice (tool_calls.py), a chat answer's message carries its calls; streamed, its
chunks carry them as deltas (tool_calls.CallStream). Under a reasoning parser, a chat answer's
thinking goes in `reasoning` (vLLM's field; api/reasoning_split.py), its message's content and calls
are read from the answer after it, and usage counts the thinking's tokens as OpenAI's reasoning_tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

from transformers import PreTrainedTokenizerBase

from verifier_service.api.reasoning_split import ThoughtSplit, split
from verifier_service.api.tool_calls import Call, CallStream, ToolPlan
from verifier_service.engine.detokenizer import Detokenizer, decoder
from verifier_service.engine.reasoning import Phase, Reasoning
from verifier_service.engine.sampler import TokenLogprob
from verifier_service.engine.sequence import FinishReason, Output, Sequence, joined

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def speculation(seqs: list[Sequence]) -> dict[str, object]:
    """The per-request stats (vLLM's names), summed over the request's choices."""
    per_pos: list[int] = []
    for seq in seqs:
        counts = seq.stats.num_accepted_tokens_per_pos
        per_pos = [a + b for a, b in zip(per_pos + [0] * len(counts), counts + [0] * len(per_pos))]
    drafts = sum(s.stats.num_drafts for s in seqs)
    draft_tokens = sum(s.stats.num_draft_tokens for s in seqs)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    return {
        "num_steps": sum(s.stats.num_steps for s in seqs), "num_drafts": drafts, "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "num_drafter_failures": sum(s.stats.num_drafter_failures for s in seqs),
        "drafter_wait_s": sum(s.stats.drafter_wait_s for s in seqs),
        "auto_disabled": any(s.spec.auto_disabled for s in seqs),
        "accepted_prediction_tokens": sum(s.stats.accepted_prediction_tokens for s in seqs),
        "rejected_prediction_tokens": sum(s.stats.rejected_prediction_tokens for s in seqs),
    }


def usage(seqs: list[Sequence], n: int, prompt_only: bool = False,
          reasoning: Reasoning | None = None) -> dict[str, object]:
    """Each prompt counted once (the choices run prompt by prompt, n for each), every choice's output
    (none shown: none counted); OpenAI's prompt_tokens_details.cached_tokens: the prompts' tokens the
    prefix cache supplied (of each prompt's first choice); under a reasoning parser,
    completion_tokens_details.reasoning_tokens: the outputs' tokens of thinking and its markers; with a
    prediction, its accepted_prediction_tokens and rejected_prediction_tokens (SpeculationStats')."""
    prompt = sum(len(s.prompt_ids) for s in seqs[::n])
    completion = 0 if prompt_only else sum(len(s.output_ids) for s in seqs)
    counts = token_counts(prompt, completion) | {
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_prompt_tokens for s in seqs[::n])}}
    details: dict[str, int] = {}
    if reasoning is not None:
        details["reasoning_tokens"] = sum(reasoning.thought_tokens(s.prompt_ids, s.output_ids) for s in seqs)
    if any(s.prediction is not None for s in seqs):
        details["accepted_prediction_tokens"] = sum(s.stats.accepted_prediction_tokens for s in seqs)
        details["rejected_prediction_tokens"] = sum(s.stats.rejected_prediction_tokens for s in seqs)
    if details:
        counts["completion_tokens_details"] = details
    return counts


def token_counts(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's usage counts."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_name(tokenizer: PreTrainedTokenizerBase, as_ids: bool) -> Callable[[int], str]:
    """How log-probabilities name a token: by its text, or by its id where the request asked (a token
    that is part of a character has no text of its own to tell it apart by)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    decode = decoder(tokenizer)
    return lambda token_id: decode([token_id], False)


def chat_logprob(lp: TokenLogprob, name: Callable[[int], str]) -> dict[str, object]:
    """A token's log-probability and its alternatives' as chat completions (and the Responses API) give
    them; `name`: a token's text as shown."""
    def entry(token_id: int, logprob: float) -> dict[str, object]:
        text = name(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


@dataclass
class Choice:
    """One choice's outputs so far."""

    outputs: list[Output] = field(default_factory=list)

    def add(self, out: Output) -> None:
        self.outputs.append(out)

    def joined(self) -> Output:
        return joined(self.outputs)


@dataclass
class Responder:
    """Builds the bodies of one request: `chat` or completions, for `model`, `n` choices for each prompt;
    with `echo` (completions), each choice's text after its prompt's; with `prompt_only` too, the prompt
    alone (the token generated with it is not shown)."""

    chat: bool
    model: str
    tokenizer: PreTrainedTokenizerBase
    n: int = 1
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each chunk's usage, its choice's so far
    echo: bool = False
    prompt_only: bool = False
    prompt_logprobs: bool = False  # vLLM's field asked for (not only echo's)
    tools: ToolPlan | None = None  # chat: how answers become tool calls (tool_calls.py)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" wherever a token is named
    echoed_message: str = ""  # chat: what each answer's content starts with (vLLM's chat echo)
    reasoning: Reasoning | None = None  # chat under a reasoning parser: answers' thinking split off
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the answer
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _echoed: dict[int, int] = field(default_factory=dict)  # streaming: choice -> characters of its echoed prompt
    _calls: dict[int, CallStream] = field(default_factory=dict)  # streaming under a tool plan, per choice
    _generated: dict[int, int] = field(default_factory=dict)  # streaming: choice -> tokens sent so far
    _thoughts: dict[int, ThoughtSplit] = field(default_factory=dict)  # streaming under a reasoning parser
    _phases: dict[int, Phase] = field(default_factory=dict)  # streaming under a reasoning parser: per choice

    @property
    def _id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def _head(self, obj: str) -> dict[str, object]:
        return {"id": self._id, "object": obj, "created": self.created, "model": self.model}

    @cached_property
    def _token(self) -> Callable[[int], str]:
        """A token's name in log-probabilities (token_name), made once for the request."""
        return token_name(self.tokenizer, self.tokens_as_ids)

    def _logprobs(self, out: Output, offset: int) -> dict[str, object] | None:
        if not out.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in out.logprobs]}
        return self._completion_logprobs(out.token_ids, out.logprobs, out.pieces, offset)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob | None], pieces: list[str],
                             offset: int) -> dict[str, list]:
        """Completions' log-probabilities of tokens (None: a token without one) that released `pieces`,
        the first `offset` characters into the choice's text. Each position's `top_logprobs` holds the most
        likely tokens and the token there, up to logprobs + 1 entries, as OpenAI defines them and vLLM answers
        (the token there last: where another token spells the same text, the entry is the token's own)."""
        return {"tokens": [self._token(t) for t in token_ids],
                "token_logprobs": [lp and lp.logprob for lp in logprobs],
                "top_logprobs": [lp and {self._token(t): v for t, v in (*lp.top, (token, lp.logprob))}
                                 for token, lp in zip(token_ids, logprobs, strict=True)],
                "text_offset": list(accumulate((len(p) for p in pieces[:-1]), initial=offset))}

    def _prompt(self, seq: Sequence, out: Output) -> tuple[str, dict[str, list] | None]:
        """What `echo` puts first: the prompt's text, as its tokens spell it, and (when the request asked
        for prompt log-probabilities) its tokens' completions-style log-probabilities."""
        detokenizer = Detokenizer(self.tokenizer)
        pieces = []
        for token in seq.prompt_ids:
            detokenizer.add(token)
            pieces.append(detokenizer.take())
        detokenizer.flush()
        pieces[-1] += detokenizer.take(final=True)
        text = "".join(pieces)
        if seq.prompt_logprobs is None:
            return text, None
        return text, self._completion_logprobs(seq.prompt_ids, [None, *out.prompt_logprobs], pieces, 0)

    def _completion(self, seq: Sequence, out: Output, offset: int, echo: bool) -> tuple[str, dict[str, list] | None]:
        """A completion choice's text and log-probabilities from `out`, whose text starts `offset` characters
        into the choice's; with `echo`, after the prompt's."""
        if not echo:
            return out.text, self._logprobs(out, offset)
        text, logprobs = self._prompt(seq, out)
        generated = self._logprobs(out, offset + len(text))
        if logprobs is not None and generated is not None:
            for key, values in generated.items():
                logprobs[key] += values
        return text + out.text, logprobs or generated

    def _vllm_prompt_logprobs(self, out: Output) -> list[dict[str, dict[str, object]] | None]:
        """vLLM's prompt_logprobs: per prompt token, null for the first (nothing precedes it), else
        {token id: {logprob, rank, decoded_token}} for the token itself, then the alternatives asked for."""
        def ranked(token_id: int, logprob: float, rank: int) -> dict[str, object]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)}

        entries: list[dict[str, dict[str, object]] | None] = [None]
        for lp in out.prompt_logprobs:
            entry = {str(lp.token_id): ranked(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, logprob) in enumerate(lp.top, 1):
                entry.setdefault(str(token_id), ranked(token_id, logprob, rank))
            entries.append(entry)
        return entries

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, object]:
        return chat_logprob(lp, self._token)

    def _shown(self, out: Output) -> Output:
        """What the client sees of an output: all of it, or with `prompt_only` none of its token (it ends
        as "length", for the max_tokens 0 it was asked for)."""
        if not self.prompt_only:
            return out
        return Output([], "", out.finish_reason and FinishReason.LENGTH, prompt_logprobs=out.prompt_logprobs)

    def _extension(self, out: Output, index: int, seq: Sequence) -> dict[str, object]:
        ext: dict[str, object] = {"token_ids": out.token_ids, "drafted": out.drafted, "token_text": out.pieces}
        if self.reasoning is not None:  # each token's phase, from where the choice's tokens so far left it
            phase = self._phases.get(index) or self.reasoning.phase_after(seq.prompt_ids)
            self._phases[index], answer, _ = self.reasoning.walk(phase, out.token_ids)
            thought = len(out.token_ids) - len(answer)  # the answer is a suffix
            ext["thinking"] = [True] * thought + [False] * len(answer)
        return ext

    def response(self, seqs: list[Sequence], choices: list[Choice]) -> dict[str, object]:
        """The whole answer (not streaming)."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = []
        for i, (seq, choice) in enumerate(zip(seqs, choices)):
            out = self._shown(choice.joined())
            c: dict[str, object] = {"index": i}
            finish = FINISH.get(out.finish_reason)
            if self.chat:
                thought, answer = (None, out.text) if self.reasoning is None else split(self.reasoning,
                                                                                        seq.prompt_ids, out.text)
                message, finish = self._message(answer, finish, thought)
                if self.echoed_message:
                    message["content"] = self.echoed_message + (message["content"] or "")
                c |= {"message": message, "logprobs": self._logprobs(out, 0)}
            else:
                c["text"], c["logprobs"] = self._completion(seq, out, 0, self.echo)
            c |= {"finish_reason": finish,
                  "stop_reason": out.stop_reason or None,
                  "splitspec": self._extension(out, i, seq) | {"speculation": speculation([seq])}}
            if self.prompt_logprobs and not self.chat:
                c["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
            body["choices"].append(c)
        if self.prompt_logprobs and self.chat:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choices[0].joined())
        body["usage"] = usage(seqs, self.n, self.prompt_only, self.reasoning)
        body["speculation"] = speculation(seqs)
        return body

    def _calling(self) -> bool:
        return self.tools is not None and self.tools.makes_calls

    def _message(self, text: str, finish: str | None, thought: str | None) -> tuple[dict[str, object], str | None]:
        """A whole chat answer's message and finish_reason: its text, or its content and tool calls, and
        its thinking (`thought`: None without a reasoning parser; an answer that is all thought has no content)."""
        content: str | None = text
        calls: list[Call] = []
        if self._calling():
            content, calls, finish = self.tools.answer(text, finish)
        message: dict[str, object] = {"role": "assistant", "content": None if thought and not content else content}
        if thought is not None and self.include_reasoning:
            message["reasoning"] = thought or None
        if calls:
            message["tool_calls"] = [call.message() for call in calls]
        return message, finish

    def role_chunk(self, index: int, seq: Sequence) -> str:
        """Chat streams open each choice with the assistant's role, as OpenAI's do (and with the echoed
        message, where one is)."""
        return self._sse({"index": index, "delta": {"role": "assistant", "content": self.echoed_message},
                          "logprobs": None, "finish_reason": None}, seq)

    def chunk(self, index: int, out: Output, offset: int, seq: Sequence) -> str:
        """One output of one choice; `offset`: characters of this choice sent before it."""
        out = self._shown(out)
        c: dict[str, object] = {"index": index}
        finish = FINISH.get(out.finish_reason)
        if self.chat:
            answer = out.text
            delta: dict[str, object] = {"content": answer}
            if self.reasoning is not None:  # the thinking, and the answer after it
                thoughts = self._thoughts.setdefault(index, ThoughtSplit(self.reasoning, seq.prompt_ids))
                thought, answer = thoughts.feed(out.text, final=out.finish_reason is not None)
                delta["content"] = answer
                if thought and self.include_reasoning:
                    delta["reasoning"] = thought
            if self._calling():  # content up to where a call may begin, and the calls' deltas
                calls = self._calls.setdefault(index, CallStream(self.tools))
                content, deltas, finish = calls.advance(answer, out.finish_reason is not None, finish)
                delta["content"] = content
                if deltas:
                    delta["tool_calls"] = deltas
            c |= {"delta": delta, "logprobs": self._logprobs(out, offset)}
        else:
            echo = self.echo and index not in self._echoed  # the prompt goes first, in the choice's first chunk
            c["text"], c["logprobs"] = self._completion(seq, out, offset + self._echoed.get(index, 0), echo)
            if echo:
                self._echoed[index] = len(c["text"]) - len(out.text)
        c["finish_reason"] = finish
        ext = self._extension(out, index, seq)
        if out.finish_reason is not None:
            c["stop_reason"] = out.stop_reason or None
            ext["speculation"] = speculation([seq])
        c["splitspec"] = ext
        self._generated[index] = self._generated.get(index, 0) + len(out.token_ids)
        return self._sse(c, seq)

    def usage_chunk(self, seqs: list[Sequence]) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body |= {"choices": [], "usage": usage(seqs, self.n, self.prompt_only, self.reasoning),
                 "speculation": speculation(seqs)}
        return sse(body)

    def _sse(self, choice: dict[str, object], seq: Sequence) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        if self.continuous_usage:  # the choice's prompt and what it has been sent, as vLLM counts them
            body["usage"] = token_counts(len(seq.prompt_ids), self._generated.get(choice["index"], 0))
        elif self.include_usage:
            body["usage"] = None
        return sse(body)


def sse(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def event_sse(event: dict[str, object]) -> str:
    """A Server-Sent Event named by its body's type, as the Responses and Messages APIs stream them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
