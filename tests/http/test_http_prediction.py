"""OpenAI's Predicted Outputs through the official openai client: a chat's `prediction` (text, or text parts)
drafts the answer, which stays the answer without it, and usage counts the prediction's accepted and rejected
tokens as OpenAI does; completions take one too (extra_body); a prediction of another type is a 400. The model
is scripted to write a text that tokenizes back to itself (verifier_support.text_chain)."""

from __future__ import annotations

import asyncio

import httpx
from http_support import WAIT_S, http_verifier
from tiny_model import tiny_tokenizer
from verifier_support import one_torch_thread, scripted_model, text_chain  # noqa: F401 - autouse fixture

ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 30}


def test_a_prediction_drafts_the_answer_and_usage_counts_it() -> None:
    async def main() -> None:
        async with http_verifier(model=scripted_model(list(text_chain()))) as h:
            plain = await h.client.chat.completions.create(**ASK)
            answer = plain.choices[0].message.content
            assert plain.usage.completion_tokens_details is None  # no prediction: no counts
            predicted = await h.client.chat.completions.create(**ASK, prediction={"type": "content", "content": answer})
            assert predicted.choices[0].message.content == answer
            details = predicted.usage.completion_tokens_details
            assert details.accepted_prediction_tokens >= 20 and details.rejected_prediction_tokens <= 4
            assert predicted.model_extra["speculation"]["accepted_prediction_tokens"] == \
                details.accepted_prediction_tokens
            # As text parts, and wrong: the same answer; streamed, the last chunk's usage counts it too.
            parts = await h.client.chat.completions.create(**ASK, prediction={"type": "content", "content": [
                {"type": "text", "text": answer[:20]}, {"type": "text", "text": answer[20:]}]})
            assert parts.choices[0].message.content == answer
            assert parts.usage.completion_tokens_details == details
            wrong = await h.client.chat.completions.create(**ASK, prediction={"type": "content", "content": "no"})
            assert wrong.choices[0].message.content == answer
            assert wrong.usage.completion_tokens_details.accepted_prediction_tokens == 0
            chunks = [c async for c in await h.client.chat.completions.create(
                **ASK, prediction={"type": "content", "content": answer}, stream=True,
                stream_options={"include_usage": True})]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
            assert chunks[-1].usage.completion_tokens_details == details
            # Completions: a prediction in extra_body, as vLLM's fields come.
            prompt = tiny_tokenizer().decode([text_chain()[0]])
            text = (await h.client.completions.create(model="tiny", prompt=prompt, max_tokens=30)).choices[0].text
            done = await h.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, extra_body={
                "prediction": {"type": "content", "content": text}})
            assert done.choices[0].text == text
            assert done.usage.completion_tokens_details.accepted_prediction_tokens >= 20
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
                bad = await http.post("/v1/chat/completions",
                                      json={**ASK, "prediction": {"type": "text", "content": ""}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction.type", bad.text

    asyncio.run(main())
