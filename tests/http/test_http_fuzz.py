"""Property-based fuzzing of the HTTP fronts (hypothesis), as tests/reliability/test_fuzz.py does for gRPC.

Whatever JSON (or bytes) a client POSTs to the OpenAI (input token counts and conversations
included), Anthropic and tokenizer routes, the server never answers 5xx: a request is served (a stream
to its end), or refused with a 4xx in the error shape of its API that says why. Fields are drawn from
what each route reads, with values that are right, nearly right or of any JSON type, so both sides are
reached. Afterwards the server still serves, exactly, and holds nothing: no sequence, KV slot or
drafter state of a request left behind.
The same holds for a reasoning model's server (thinking_model.py, --reasoning-parser), whose answers are
split, whose constraints wait for the thinking to end and whose thinking budgets are kept.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from thinking_model import thinking_model, thinking_tokenizer
from tiny_model import tiny_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(300)

EXAMPLES = {False: 250, True: 150}  # by whether the server reads a reasoning model's thinking
VOCAB = len(tiny_tokenizer())
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
INPUT_TOKENS, CONVERSATIONS = "/v1/responses/input_tokens", "/v1/conversations"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
ANTHROPIC = {MESSAGES, COUNT_TOKENS}

# Any JSON value (non-finite floats included: Python's json writes and reads them).
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=6)
token_id = st.integers(0, VOCAB - 1)
text = st.one_of(st.just(PROMPT), st.text(min_size=1, max_size=24))
openai_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                        "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                            {"type": st.just("text"), "text": text}), min_size=1, max_size=2))})
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(
    text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2))})

# JSON schemas, well formed or not (a request's schema is compiled into token masks).
schema = st.recursive(
    st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "number", "boolean",
                                                              "array", "null", "nothing"])}),
              st.fixed_dictionaries({"enum": st.lists(scalars, min_size=1, max_size=3)}),
              st.fixed_dictionaries({"type": st.just("string"), "pattern": st.text(max_size=8)}),
              st.fixed_dictionaries({"type": st.just("integer"), "minimum": st.integers(-5, 5),
                                     "maximum": st.integers(-5, 5)})),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3),
                               "required": st.lists(st.text(max_size=4), max_size=2)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner, "minItems": st.integers(0, 3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/a", "#", "http://x"])})),
    max_leaves=5)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"]), "parameters": st.one_of(st.none(), schema)})})

# Per field, a right value; a body draws some fields from `anything` instead (or all from here).
SAMPLING = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "stop_token_ids": st.lists(token_id, max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()},
                                            optional={"continuous_usage_stats": st.booleans()}),
    "speculation": st.fixed_dictionaries({"max_draft_len": st.integers(0, 20), "disable": st.booleans()}),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(token_id, min_size=1, max_size=4),
    "bad_words": st.lists(text, max_size=2),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                                 st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                     "type": "object", "properties": {"a": {"type": "integer"}}}}})),
    "guided_regex": st.sampled_from(["a+", "[0-9]{1,3}", "(a|b)*c"]),
    "guided_choice": st.lists(st.sampled_from(["yes", "no", "maybe"]), min_size=1, max_size=3, unique=True),
    "guided_json": st.one_of(schema, schema.map(json.dumps)),
    "guided_grammar": st.one_of(st.just('start: "yes" | "no"'), st.text(max_size=30)),
    "structured_outputs": st.one_of(st.fixed_dictionaries({"json": schema}), st.fixed_dictionaries(
        {"regex": st.text(max_size=12)}), st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=3)})),
    "prompt_logprobs": st.integers(0, 3),
    "truncate_prompt_tokens": st.one_of(st.just(-1), st.integers(1, 200)),
    "thinking_token_budget": st.integers(0, 6),
    "cache_salt": st.one_of(st.sampled_from(["", "a", "b"]), text),
    "prediction": st.fixed_dictionaries({"type": st.sampled_from(["content", "content", "text"]), "content": st.one_of(
        text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))}),
}
ROUTES: dict[str, dict[str, st.SearchStrategy]] = {
    CHAT: {**SAMPLING, "messages": st.lists(openai_message, min_size=1, max_size=3),
           "max_completion_tokens": st.integers(1, 8), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
           "tools": st.lists(tool, max_size=2),
           "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                                    st.just({"type": "function", "function": {"name": "f"}})),
           "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(), "echo": st.booleans(),
           "include_reasoning": st.booleans(), "chat_template_kwargs": st.fixed_dictionaries(
               {}, optional={"enable_thinking": st.booleans(), "open_thinking": st.booleans()}),
           "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"])},
    COMPLETIONS: {**SAMPLING, "prompt": st.one_of(text, st.lists(token_id, min_size=1, max_size=6),
                                                  st.lists(text, min_size=1, max_size=2)),
                  "echo": st.booleans(), "logprobs": st.integers(0, 5)},
    RESPONSES: {"model": SAMPLING["model"], "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
                "stream": st.booleans(), "seed": SAMPLING["seed"],
                "input": st.one_of(text, st.lists(st.one_of(openai_message, st.fixed_dictionaries(
                    {"type": st.just("reasoning"), "summary": st.just([]), "content": st.lists(
                        st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": text}), max_size=1)})),
                    min_size=1, max_size=2)),
                "instructions": st.one_of(st.none(), text), "max_output_tokens": st.integers(1, 8),
                "store": st.booleans(), "background": st.booleans(), "max_tool_calls": st.integers(0, 3),
                "text": st.just({"format": {"type": "json_object"}}),
                "top_logprobs": st.integers(0, 20), "reasoning": st.fixed_dictionaries({}, optional={
                    "effort": st.sampled_from(["none", "low", "high"]), "summary": st.sampled_from(["auto", None])})},
    INPUT_TOKENS: {"model": SAMPLING["model"], "input": text, "instructions": text,
                   "truncation": st.sampled_from(["auto", "disabled"]),
                   "previous_response_id": st.sampled_from(["resp_nope", ""])},
    CONVERSATIONS: {"items": st.lists(openai_message, max_size=3),
                    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=8), max_size=2)},
    MESSAGES: {"model": SAMPLING["model"], "max_tokens": st.integers(1, 8), "stream": st.booleans(),
               "messages": st.lists(anthropic_message, min_size=1, max_size=3), "system": text,
               "stop_sequences": st.lists(text, max_size=2), "temperature": st.floats(0, 1),
               "top_k": st.integers(1, 20), "thinking": st.one_of(
                   st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                    {"type": "adaptive", "display": "omitted"}]),
                   st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": st.integers(1, 6)})),
               "tool_choice": st.just({"type": "auto"}),
               "tools": st.lists(st.fixed_dictionaries({"name": st.just("f"), "input_schema": st.just(
                   {"type": "object"})}), max_size=1),
               "output_config": st.fixed_dictionaries({}, optional={
                   "effort": st.sampled_from(["low", "max"]), "format": st.just({"type": "json_schema", "schema": {
                       "type": "object", "properties": {"a": {"type": "integer"}}}})})},
    COUNT_TOKENS: {"model": SAMPLING["model"], "messages": st.lists(anthropic_message, min_size=1, max_size=3),
                   "system": text},
    TOKENIZE: {"model": SAMPLING["model"], "prompt": text, "add_special_tokens": st.booleans(),
               "return_token_strs": st.booleans()},
    DETOKENIZE: {"model": SAMPLING["model"], "tokens": st.lists(token_id, max_size=6)},
}
# The fields a route cannot do without, given in most bodies.
NEEDED = {CHAT: ["messages"], COMPLETIONS: ["prompt"], RESPONSES: ["input"], INPUT_TOKENS: ["input"], CONVERSATIONS: [],
          MESSAGES: ["messages", "max_tokens"], COUNT_TOKENS: ["messages"], TOKENIZE: ["prompt"],
          DETOKENIZE: ["tokens"]}
# Run first, whatever is drawn: a body every route serves (one streamed) and one refused. The drawn bodies
# alone need not reach every route's answer: hypothesis mixes constants from the modules loaded (more of
# them in a whole suite's worker than in this file alone) into what it draws, even derandomized.
SAY_HI = [{"role": "user", "content": "hi"}]
ONE_OF_EACH = [(CHAT, {"messages": SAY_HI, "max_completion_tokens": 4}),
               (COMPLETIONS, {"prompt": "hi", "stream": True}), (RESPONSES, {"input": "hi", "max_output_tokens": 4}),
               (INPUT_TOKENS, {"input": "hi"}), (CONVERSATIONS, {"items": SAY_HI}),
               (MESSAGES, {"messages": SAY_HI, "max_tokens": 4}),
               (COUNT_TOKENS, {"messages": SAY_HI}), (TOKENIZE, {"prompt": "hi"}), (DETOKENIZE, {"tokens": [1, 2]}),
               (CHAT, {"messages": []})]


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    fields = ROUTES[route]
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True))
    if draw(st.integers(0, 9)):
        chosen += [name for name in NEEDED[route] if name not in chosen]
    if "stream" in fields and "stream" not in chosen and draw(st.integers(0, 2)) == 0:
        chosen.append("stream")
    # Half the bodies right field by field (their combination may still be refused), half with wrong values.
    wrong = st.just(False) if draw(st.booleans()) else st.integers(0, 3).map(lambda i: i == 0)
    body = {name: draw(anything if draw(wrong) else fields[name]) for name in chosen}
    if draw(st.integers(0, 19)) == 0:  # not a JSON object at all
        return route, draw(st.one_of(st.binary(max_size=24), anything.map(lambda v: json.dumps(v).encode())))
    return route, json.dumps(body).encode()


def check_error(route: str, response: httpx.Response) -> str:
    """A refusal in its API's error shape, with a message; its kind."""
    assert response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    if route in ANTHROPIC:
        assert body["type"] == "error" and body["error"]["message"], body
        return f"{response.status_code} {body['error']['type']}"
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    return f"{response.status_code} {body['error']['type']}"


def check_served(route: str, text: str, stream: bool) -> None:
    """A 200: a whole answer, or a stream with no error in it that ended as its API ends one."""
    if not stream:
        json.loads(text)
        return
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    kinds = [event.get("type") for event in events]
    assert "error" not in kinds and not any("error" in event and event["error"] for event in events), text[-300:]
    if route == MESSAGES:
        assert kinds[-1] == "message_stop", kinds
    elif route == RESPONSES:
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    else:
        assert text.endswith("data: [DONE]\n\n"), text[-300:]


def fuzz(base_url: str, seen: Counter[str], examples: int) -> None:
    # One client for every body, as a client keeps its connections: a new one would build a TLS context per body
    # (40-50 ms, the most of this test's time), and a connection the server ends after a bad body is opened anew.
    with httpx.Client(base_url=base_url, timeout=WAIT_S) as http:
        @settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=bodies())
        def check(case: tuple[str, bytes]) -> None:
            route, raw = case
            seen["cases"] += 1
            with http.stream("POST", route, content=raw, headers={"content-type": "application/json"}) as response:
                text = response.read().decode()
                if response.status_code != 200:
                    seen[check_error(route, response)] += 1
                    return
                stream = response.headers["content-type"].startswith("text/event-stream")
                check_served(route, text, stream)
                seen[f"200 {route}{' stream' if stream else ''}"] += 1

        for route, body in ONE_OF_EACH:
            check = example(case=(route, json.dumps(body).encode()))(check)
        check()


@pytest.mark.parametrize("reasoning", [False, True], ids=["plain", "reasoning"])
def test_fuzz_http_bodies(reasoning: bool) -> None:
    # The reasoning model recommends sampling as Qwen3 does: bodies that leave it out take it.
    model = {"model": thinking_model(), "tokenizer": thinking_tokenizer(), "reasoning_parser": "qwen3",
             "override_generation_config": {"temperature": 0.6, "top_p": 0.95, "top_k": 20}} if reasoning else {}

    async def main() -> None:
        async with http_verifier(default_max_new_tokens=8, **model) as h:
            seen: Counter[str] = Counter()
            try:
                await asyncio.to_thread(fuzz, h.base_url, seen, EXAMPLES[reasoning])
            finally:
                print(dict(seen))
            served = {kind.split()[1] for kind in seen if kind.startswith("200")}
            assert served == set(ROUTES), f"never served: {set(ROUTES) - served}"
            assert any(kind.startswith("400") for kind in seen) and any(" stream" in kind for kind in seen)
            # Both sides were reached by the drawn bodies too, not only by ONE_OF_EACH.
            answered = sum(n for kind, n in seen.items() if kind.startswith("200"))
            assert answered > len(ONE_OF_EACH) and seen["cases"] - answered > len(ONE_OF_EACH), dict(seen)
            await wait_until(h.idle, "the engine idle and the drafter holding nothing")
            # Still serving, and exactly: the same greedy answer as a fresh request gets without speculation.
            asked = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                spec = (await http.post(COMPLETIONS, json=asked)).json()["choices"][0]["text"]
                plain = (await http.post(COMPLETIONS, json={**asked, "speculation": {"disable": True}})).json()
            assert spec == plain["choices"][0]["text"]

    asyncio.run(main())
