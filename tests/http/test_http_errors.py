"""Every client mistake over HTTP is an OpenAI error object with the right status, never a 500;
auth and TLS as gRPC has them; /health (and vLLM's /ping) 503 before the model and while draining."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

import httpx
import openai
import pytest
from certs import make_pki
from http_support import PROMPT, WAIT_S, http_verifier, wait_until
from verifier_harness import run_verifier, spec_config
from verifier_support import one_torch_thread, shared_model  # noqa: F401 - autouse fixture

from verifier_service.api.server import start_server
from verifier_service.settings import ServerSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
INVOCATIONS = "/invocations"
MSG = [{"role": "user", "content": "hi"}]

# (path, body or raw bytes, status, words the message must contain)
BAD = [
    (CHAT, b"{not json", 400, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "JSON object"),
    (CHAT, b"\xff\xfe", 400, "not valid JSON"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role 'wizard'"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    # An image (or audio, or a file) for a model that reads text: one problem, named by its part's path.
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe:"}, {
        "type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400,
     "messages.0.content.1: 'image_url' parts are not served here: the model reads text only (text, input_text, "
     "output_text and refusal parts)"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0: a text part holds its text"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content: neither a text nor a list"),
    # Half a surrogate pair, which JSON can spell and no text can hold: a 400 naming where, not a 500 (and the
    # connection stays: this loop's next request goes over it).
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400,
     "messages.0.content: a lone UTF-16 surrogate (\\ud800) is not text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\\uDC00": 1}}', 400,
     "chat_template_kwargs: a lone UTF-16 surrogate (\\udc00) is not text"),
    (COMPLETIONS, b'{"prompt": ["ok", "x\\udbff"]}', 400, "prompt.1: a lone UTF-16 surrogate (\\udbff)"),
    (COMPLETIONS, b'{"prompt": "x\xed\xa0\x80"}', 400, "not valid JSON: 'utf-8' codec can't decode"),  # encoded
    # Nested deeper than can be read, or than the chat template's rendering can take (both were 500s).
    (COMPLETIONS, b'{"prompt": "x", "x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", 400,
     "not valid JSON: nested deeper than Python's recursion limit"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ' + b'{"a": ' * 600 + b"1"
     + b"}" * 601, 400, "chat template cannot render these messages: their tools or template variables are nested"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]}, 400,
     "chat message 1 tool call 0 arguments is not valid JSON: x: a lone UTF-16 surrogate (\\ud800)"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": float("nan")}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 1e300}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    # OpenAI's narrowest nucleus, not gRPC's "0 = none": refused (as vLLM does), never sampled from everything.
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p: top_p must be within (0, 1]; 0 keeps no token"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0.0}, 400, "top_p must be within (0, 1]"),
    (RESPONSES, {"input": "x", "top_p": 0}, 400, "top_p must be within (0, 1]"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**30}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 100000}, 400, "exceeds the context"),
    (CHAT, {"messages": MSG, "n": 9}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs: top_logprobs needs logprobs: true"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop strings must not be empty"),
    (CHAT, {"messages": MSG, "stop_token_ids": [100000]}, 400, "outside the vocabulary"),
    (CHAT, {"messages": MSG, "seed": 2**70}, 400, "seed"),
    (CHAT, {"messages": MSG, "speculation": {"max_draft_len": -1}}, 400, "speculation.max_draft_len"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt is empty"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [5, 100000]}, 400, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": [5, -1]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 5]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[5], "a"]}, 400, "prompt"),
    # A batch is all or none: the first prompt's sequence, already queued, goes again (the engine ends idle).
    (COMPLETIONS, {"prompt": ["hi", ""]}, 400, "prompt.1: prompt is empty"),
    (COMPLETIONS, {"prompt": ["hi", "x " * 2000]}, 400, "prompt.1: the prompt has"),
    (COMPLETIONS, {"prompt": ["hi"] * 100, "n": 8}, 400, "make 800 sequences"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "echo": "please"}, 400, "echo"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0 asks for the prompt alone, which needs echo"),
    # Fields that would change the answer and are not served: refused, never answered as if absent.
    (CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias must be within [-100, 100]"),
    (CHAT, {"messages": MSG, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "frequency_penalty": 2.5}, 400, "frequency_penalty must be within [-2, 2]"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "\"auto\" tool choice needs a tool call parser"),  # tools are served (test_tool_calls.py); "auto" needs one
    # Structured output: one constraint, well formed, that compiles, and that ends the answer itself.
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema: json_schema is required"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": MSG, "guided_regex": "a+", "guided_choice": ["a"]}, 400,
     "ask for one structured output, not 2 (guided_regex, guided_choice)"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400,
     "not 2 (response_format, structured_outputs.regex)"),
    (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "nonsense"}}, 400, "structured_output.json_schema: "),
    (COMPLETIONS, {"prompt": "x", "guided_json": "{not json"}, 400, "json_schema is not valid JSON"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "(unclosed"}, 400, "structured_output.regex: "),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, 400, "structured_output.choice needs at least one"),
    (COMPLETIONS, {"prompt": "x", "guided_grammar": "start: undefined_rule"}, 400, "structured_output.grammar: "),
    # One that compiles and matches nothing: refused, not answered with an empty text as if it had matched.
    (COMPLETIONS, {"prompt": "x", "guided_grammar": "start: start"}, 400,
     "structured_output.grammar: matches no text (no first token can begin a match)"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "[^\\s\\S]"}, 400, "structured_output.regex: matches no text"),
    (CHAT, {"messages": MSG, "guided_json": {"$ref": "#"}}, 400, "structured_output.json_schema: matches no text"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a+", "ignore_eos": True}, 400,
     "structured_output cannot be combined with ignore_eos"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, 400,
     "structured_outputs.whitespace_pattern: not supported"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 4, "max_tokens": 3}, 400, "min_new_tokens (4) is more than"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of: not supported"),
    # vLLM's own options, likewise (include_stop_str_in_output is served: a wrong type names it).
    (COMPLETIONS, {"prompt": "x", "include_stop_str_in_output": [True]}, 400, "include_stop_str_in_output"),
    (COMPLETIONS, {"prompt": "x", "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens: not supported"),
    (COMPLETIONS, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search: not supported"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),  # vLLM refuses it too
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [1, 2], "guided_regex": "a+"}, 400,
     "cannot be combined with allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs: prompt_logprobs are not available when stream is true"),
    (CHAT, {"messages": MSG, "prompt_logprobs": -1}, 400, "prompt_logprobs"),  # vLLM's whole vocabulary
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "add_special_tokens": False}, 400, "(leave it out or send true)"),
    (CHAT, {"messages": MSG, "add_special_tokens": True}, 400, "(leave it out or send false)"),
    (CHAT, {"messages": MSG, "add_generation_prompt": "open"}, 400, "add_generation_prompt"),
    (CHAT, {"messages": MSG, "chat_template": "{{ messages }}"}, 400, "chat_template: not supported"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "cannot set tokenize"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "set add_generation_prompt false too"),
    (CHAT, {"messages": MSG, "reasoning_effort": "extreme"}, 400, "reasoning_effort: Input should be 'none', "),
    (CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, 400, 'modalities: not supported by this server '
                                                                     '(leave it out or send ["text"])'),
    (CHAT, {"messages": MSG, "web_search_options": {}}, 400, "web_search_options: not supported"),
    (CHAT, {"messages": MSG, "verbosity": "low"}, 400, 'verbosity: not supported by this server (leave it out or '
                                                       'send "medium")'),
    (COMPLETIONS, {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "x " * 2000}, 400, "context"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens must be -1"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    (COMPLETIONS, {"prompt": "x " * 2000, "truncate_prompt_tokens": 4000}, 400, "context"),  # still too long
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here; served: tiny"),
    # The Responses API takes the chat's checks (more in test_responses_api.py).
    (RESPONSES, {}, 400, "input"),
    (RESPONSES, {"input": []}, 400, "chat has no messages"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 100000}, 400, "exceeds the context"),
    (RESPONSES, {"input": "x " * 2000}, 400, "context"),
    (RESPONSES, {"input": "hi", "temperature": float("nan")}, 400, "temperature"),
    (RESPONSES, {"input": [{"role": "wizard", "content": "hi"}]}, 400, "input.0.message.role"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "web_search"}]}, 400,
     "tools.0: 'web_search' tools are not served here: only function tools, which the model calls"),
    (CHAT, {"messages": MSG, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, 400,
     "tools.0: 'custom' tools are not served here"),
    (RESPONSES, {"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    (RESPONSES, {"input": "hi", "reasoning": {"context": "all_turns"}}, 400,
     'reasoning.context: not supported by this server (leave it out or send "auto")'),
    (RESPONSES, {"input": "hi", "reasoning": {"mode": "pro"}}, 400, "reasoning.mode: not supported"),
    (RESPONSES, {"input": "hi", "context_management": [{"type": "compaction"}]}, 400,
     "context_management: not supported"),
    (RESPONSES, {"input": "hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
    # SageMaker's route: either body, refused as its own route refuses it.
    (INVOCATIONS, b"{not json", 400, "not valid JSON"),
    (INVOCATIONS, b"[1, 2]", 400, "an /invocations body is a chat completion (with `messages`) or a completion"),
    (INVOCATIONS, {"input": "hi"}, 400, "or a completion (with `prompt`)"),
    (INVOCATIONS, {"messages": "hi"}, 400, "messages"),
    (INVOCATIONS, {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    (INVOCATIONS, {"messages": MSG, "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
    ("/v1/nothing", {"prompt": "hi"}, 404, "Not Found"),
]


def test_bad_requests_get_openai_errors_with_the_right_status() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                for path, body, status, words in BAD:
                    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                    r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                    assert r.status_code == status, (body, r.text)
                    error = r.json()["error"]
                    assert words in error["message"], (body, error)
                    assert "more problems" not in error["message"], (body, error)  # one mistake, one problem
                    assert set(error) == {"message", "type", "param", "code"}
                r = await http.get(CHAT)
                assert r.status_code == 405 and "error" in r.json()
                # Unknown fields are ignored, unsupported ones accepted at their neutral values (as clients
                # send them by default); the served name is accepted.
                r = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "model": "tiny",
                                                       "frequency_penalty": 0, "user": "u", "use_beam_search": False,
                                                       "skip_special_tokens": True, "add_special_tokens": True,
                                                       "length_penalty": 1, "bad_words": []})
                assert r.status_code == 200, r.text
                r = await http.post(CHAT, json={
                    "messages": MSG, "max_tokens": 2, "min_p": 0.0, "min_tokens": 0,
                    "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                    "best_of": 1, "guided_json": None, "echo": False, "add_generation_prompt": True,
                    "add_special_tokens": False, "include_stop_str_in_output": False, "chat_template_kwargs": None,
                    "modalities": ["text"], "verbosity": "medium", "audio": None})
                assert r.status_code == 200, r.text
                # A character outside the BMP as its pair of escapes is text.
                r = await http.post(CHAT, content=b'{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}],'
                                                  b' "max_tokens": 2}', headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text
                # The server kept serving through all of it, and nothing is left in the engine.
                await wait_until(h.idle, "the engine idle")
            with pytest.raises(openai.BadRequestError) as bad:
                await h.client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
            assert "messages" in str(bad.value)
            with pytest.raises(openai.BadRequestError, match="structured_output.regex"):
                await h.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3,
                                                       extra_body={"structured_outputs": {"regex": "("}})
            with pytest.raises(openai.NotFoundError):
                await h.client.chat.completions.create(model="nope", messages=MSG, max_tokens=3)

    asyncio.run(main())


def test_oversized_body_413_and_full_queue_429() -> None:
    async def main() -> None:
        async with http_verifier(speculate=False, max_message_bytes=4096, max_num_seqs=1, max_queue_len=0) as h:
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                r = await http.post(COMPLETIONS, json={"prompt": "x" * 5000})
                assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

                async def chunked():  # no Content-Length: the limit still holds
                    for _ in range(10):
                        yield b" " * 1000

                r = await http.post(COMPLETIONS, content=chunked())
                assert r.status_code == 413
                # One long stream holds the only slot; the queue holds none: the next request is 429.
                async with http.stream("POST", COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 200,
                                                                  "ignore_eos": True, "stream": True}) as s:
                    lines = s.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    r = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
                    assert r.status_code == 429 and "retry later" in r.json()["error"]["message"]
                    assert r.json()["error"]["type"] == "RateLimitError"
                await wait_until(h.idle, "the stream's slot freed")
                r = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200

    asyncio.run(main())


def test_bearer_token_and_tls(tmp_path) -> None:  # noqa: ANN001
    pki = make_pki(tmp_path)

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=shared_model(), auth_token="s3cret",
                                tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)) as v:
            base = f"https://localhost:{v.running.http_port}"
            async with httpx.AsyncClient(base_url=base, timeout=WAIT_S, verify=str(pki.ca_cert)) as http:
                assert (await http.get("/health")).status_code == 200  # open for probes
                assert (await http.get("/ping")).status_code == (await http.post("/ping")).status_code == 200
                version = await http.get("/version", headers={"Authorization": "Bearer s3cret"})
                assert version.json() == {"version": importlib.metadata.version("splitspec")}
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    assert (await http.get("/version", headers=headers)).status_code == 401
                    r = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, headers=headers)
                    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
                    assert (await http.get("/v1/models", headers=headers)).status_code == 401
                    assert (await http.get("/metrics", headers=headers)).status_code == 401
                    assert (await http.post("/tokenize", json={"prompt": "hi"}, headers=headers)).status_code == 401
                    assert (await http.post("/detokenize", json={"tokens": [1]}, headers=headers)).status_code == 401
                    assert (await http.post(INVOCATIONS, json={"prompt": "hi"}, headers=headers)).status_code == 401
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0,
                                        http_client=httpx.AsyncClient(verify=str(pki.ca_cert)))
            r = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
            assert r.usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=base + "/v1", api_key="nope", max_retries=0,
                                         http_client=httpx.AsyncClient(verify=str(pki.ca_cert))
                                         ).models.list()
            with pytest.raises(httpx.TransportError):  # plain HTTP on a TLS port
                async with httpx.AsyncClient() as plain:
                    await plain.get(f"http://localhost:{v.running.http_port}/health")

    asyncio.run(main())


def test_health_503_before_the_model_and_while_draining() -> None:
    async def main() -> None:
        running = await start_server(ServerSettings(host="127.0.0.1", port=0, http_port=0))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}", timeout=WAIT_S) as http:
                r = await http.get("/health")
                assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
                assert (await http.post("/ping")).json() == r.json()  # vLLM's name for it
                r = await http.post(COMPLETIONS, json={"prompt": "hi"})
                assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        finally:
            await running.stop(0)

        async with http_verifier(speculate=False) as h:
            running = h.v.running
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                assert (await http.get("/health")).status_code == 200
                async with http.stream("POST", COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 60,
                                                                  "ignore_eos": True, "stream": True}) as s:
                    lines = s.aiter_lines()
                    first = await anext(lines)
                    stopping = asyncio.ensure_future(running.stop(WAIT_S))  # what SIGTERM does
                    await wait_until(lambda: running.generations.draining, "draining")
                    r = await http.get("/health")
                    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
                    r = await http.post(COMPLETIONS, json={"prompt": "hi"})
                    assert r.status_code == 503
                    rest = [line async for line in lines]
                # The stream in flight finished whole within the grace period.
                events = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
                assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
                assert sum(len(e["choices"][0]["splitspec"]["token_ids"]) for e in events) == 60
                await stopping

    asyncio.run(main())
