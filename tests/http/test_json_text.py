"""Half a UTF-16 surrogate pair, which JSON can spell (`"\\ud800"`) and no text can hold, is refused where
JSON is read (api/json_text.py), by the path of the string holding it: in an HTTP body, and in the JSON
texts gRPC carries (tool calls' arguments, template variables, a JSON schema), as INVALID_ARGUMENT; so is
JSON nested deeper than it can be read or rendered."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from http_support import PROMPT, WAIT_S, http_verifier
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from drafter_sdk.proto import verifier_pb2
from verifier_service.api import json_text


def test_a_lone_surrogate_is_named_by_its_path_and_a_pair_is_text() -> None:
    for data in ('{"a": [1, {"b": "x\\ud800"}]}', b'{"a": [1, {"b": "x\\ud800"}]}'):
        with pytest.raises(json_text.NotText) as refused:
            json_text.loads(data)
        assert refused.value.path == "a.1.b" and "(\\ud800) is not text" in str(refused.value)
    with pytest.raises(json_text.NotText, match=r"^c: a lone UTF-16 surrogate \(\\udfff\)"):
        json_text.loads('{"c": {"\\uDFFF": 1}}')  # in a key: named by the object holding it
    with pytest.raises(json_text.NotText, match=r"^a lone UTF-16 surrogate \(\\udc00\)"):
        json_text.loads('"\\udc00"')
    assert json_text.loads('{"a": "\\ud83d\\ude00 \\u00e9"}') == {"a": "\U0001f600 \u00e9"}
    assert json_text.loads('{"path": "C:\\\\ud800"}') == {"path": "C:\\ud800"}  # an escaped backslash: text
    with pytest.raises(ValueError, match="Expecting"):
        json_text.loads("{")
    # One encoded in the bytes (json.loads itself would pass it through) is no UTF-8.
    with pytest.raises(UnicodeDecodeError):
        json_text.loads(b'{"a": "x\xed\xa0\x80"}')
    assert json_text.loads('{"a": 1}'.encode("utf-16")) == {"a": 1}  # as json.loads reads bytes: any UTF
    # Nesting: past the decoder's recursion, a ValueError like any mistake; below it, walked without recursion.
    with pytest.raises(ValueError, match="nested deeper than Python's recursion limit"):
        json_text.loads("[" * 100_000 + "]" * 100_000)
    with pytest.raises(json_text.NotText) as refused:
        json_text.loads('{"a": ' * 900 + '["\\ud800"]' + "}" * 900)
    assert refused.value.path == ".".join(["a"] * 900 + ["0"])


def test_grpc_json_texts_holding_one_are_invalid_argument() -> None:
    lone = '"\\ud800"'  # a JSON string spelling half a pair
    user = verifier_pb2.ChatMessage(role="user", content=PROMPT)
    call = verifier_pb2.ChatMessage(role="assistant", tool_calls=[verifier_pb2.ToolCall(
        id="c", name="f", arguments=f'{{"x": {lone}}}')])
    requests = {
        "chat message 1 tool call 0 arguments is not valid JSON: x: a lone": verifier_pb2.GenerationParams(
            chat=verifier_pb2.ChatMessages(messages=[user, call, verifier_pb2.ChatMessage(
                role="tool", tool_call_id="c", content="1")])),
        "chat.template_kwargs is not valid JSON: enable_thinking: a lone": verifier_pb2.GenerationParams(
            chat=verifier_pb2.ChatMessages(messages=[user], template_kwargs=f'{{"enable_thinking": {lone}}}')),
        "structured_output.json_schema is not valid JSON: enum.0: a lone": verifier_pb2.GenerationParams(
            prompt=PROMPT, structured_output=verifier_pb2.StructuredOutput(json_schema=f'{{"enum": [{lone}]}}')),
        # Nested past the decoder's recursion (it was UNKNOWN, a RecursionError).
        "structured_output.json_schema is not valid JSON: nested deeper": verifier_pb2.GenerationParams(
            prompt=PROMPT, structured_output=verifier_pb2.StructuredOutput(json_schema="[" * 10**5 + "]" * 10**5)),
        # Nested within it, and past what rendering the chat template takes (transformers recurses through it).
        "chat template cannot render these messages: their tools or template variables are nested too deeply":
            verifier_pb2.GenerationParams(chat=verifier_pb2.ChatMessages(
                messages=[user], template_kwargs='{"a": ' * 600 + "1" + "}" * 600)),
    }

    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            for words, params in requests.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=WAIT_S)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
                assert words in refused.value.details(), refused.value.details()
            served = verifier_pb2.GenerationParams(prompt=PROMPT, stopping=verifier_pb2.StoppingCriteria(
                max_new_tokens=2), structured_output=verifier_pb2.StructuredOutput(json_schema='{"enum": ["\\u00e9"]}'))
            assert (await h.v.stub.Generate(verifier_pb2.GenerateRequest(params=served), timeout=WAIT_S)).output.text

    asyncio.run(main())
