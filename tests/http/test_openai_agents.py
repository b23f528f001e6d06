"""The OpenAI Agents SDK's Runner pointed at the verifier through the Responses API, its history kept the
three ways the SDK keeps it: a session whose items live in a conversation (OpenAIConversationsSession,
which lists and adds them itself), a conversation the server adds each turn to (`conversation_id`), and
responses chained by `previous_response_id`. Each way, the second turn's answer is the chat written out
(greedy, speculation on). The answers are held to a regular expression: the random model would not end
one on its own, and the SDK refuses a response its token limit cut short."""

from __future__ import annotations

import asyncio

from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from agents.memory import OpenAIConversationsSession
from http_support import PROMPT, http_verifier
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

INSTRUCTIONS, FOLLOW = "Be brief.", "and then?"
HELD = {"structured_outputs": {"regex": "Hello [a-z]{1,5}[.]"}}


def test_agents_keep_their_history_in_conversations_and_chains() -> None:
    async def main() -> None:
        async with http_verifier() as h:
            agent = Agent(name="brief", instructions=INSTRUCTIONS,
                          model=OpenAIResponsesModel(model="tiny", openai_client=h.client),
                          model_settings=ModelSettings(max_tokens=40, extra_body=HELD))
            run = RunConfig(tracing_disabled=True)  # nothing sent to OpenAI's trace exporter

            async def chat(*turns: str) -> str:
                messages = [{"role": "system", "content": INSTRUCTIONS}]
                for i, text in enumerate(turns):
                    messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
                answer = await h.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                                                extra_body=HELD)
                return answer.choices[0].message.content

            first = await chat(PROMPT)
            second = await chat(PROMPT, first, FOLLOW)

            session = OpenAIConversationsSession(openai_client=h.client)
            assert (await Runner.run(agent, PROMPT, session=session, run_config=run)).final_output == first
            assert (await Runner.run(agent, FOLLOW, session=session, run_config=run)).final_output == second
            items = await session.get_items()
            assert [(i["role"], i["content"][0]["text"]) for i in items] == [
                ("user", PROMPT), ("assistant", first), ("user", FOLLOW), ("assistant", second)]

            conversation = (await h.client.conversations.create()).id
            for said, answer in ((PROMPT, first), (FOLLOW, second)):
                result = await Runner.run(agent, said, conversation_id=conversation, run_config=run)
                assert result.final_output == answer
            listed = [i async for i in h.client.conversations.items.list(conversation, order="asc")]
            assert [i.content[0].text for i in listed] == [PROMPT, first, FOLLOW, second]

            started = await Runner.run(agent, PROMPT, run_config=run)
            followed = await Runner.run(agent, FOLLOW, previous_response_id=started.last_response_id,
                                        run_config=run)
            assert (started.final_output, followed.final_output) == (first, second)

    asyncio.run(main())
