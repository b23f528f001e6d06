"""LangChain's ChatOpenAI pointed at the verifier, as the README says a user may: a whole answer and a
streamed one, each the answer the official openai client gets (greedy), with speculation on."""

from __future__ import annotations

import asyncio

from http_support import PROMPT, http_verifier
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture


def test_chat_openai_invokes_and_streams_the_answer_the_openai_client_gets() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            expected = await h.client.chat.completions.create(
                model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": PROMPT}], max_tokens=30)
            llm = ChatOpenAI(base_url=f"{h.base_url}/v1", api_key="unused", model="tiny", max_tokens=30,
                             temperature=0, max_retries=0)
            messages = [SystemMessage("Be brief."), HumanMessage(PROMPT)]
            whole = await llm.ainvoke(messages)
            streamed = [chunk.content async for chunk in llm.astream(messages)]
            answer = expected.choices[0].message.content
            assert whole.content == answer and "".join(streamed) == answer
            assert sum(1 for piece in streamed if piece) > 1, "streamed as it was generated"
            assert whole.response_metadata["finish_reason"] == expected.choices[0].finish_reason
            assert whole.usage_metadata["output_tokens"] == expected.usage.completion_tokens

    asyncio.run(main())
