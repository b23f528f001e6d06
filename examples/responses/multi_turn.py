"""A multi-turn conversation through the Responses API: each turn continues the last by
`previous_response_id` (or, with --conversation, goes on in a conversation of the Conversations
API), so the verifier renders the conversation so far and takes its earlier tokens from the prefix
cache. Prints each turn's time to first token and how many of its prompt's tokens came from the cache.

    splitspec-verifier &                      # the embedded model, HTTP API on :8000
    python examples/responses/multi_turn.py --document README.md [--conversation]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import openai

QUESTIONS = ("Summarise this document in one sentence:\n\n{document}", "What does the verifier do?",
             "And the drafter?", "Name one metric it exports.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default="unused", help="the verifier's bearer token, if it has one")
    p.add_argument("--document", type=Path, required=True, help="a text the first turn asks about")
    p.add_argument("--document-chars", type=int, default=5000, help="how much of it to send")
    p.add_argument("--max-output-tokens", type=int, default=24)
    p.add_argument("--conversation", action="store_true",
                   help="keep the turns in a conversation (client.conversations) instead of chaining responses")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = client.models.list().data[0].id
    document = args.document.read_text()[:args.document_chars]
    # Where the conversation so far lives: the last response, or a conversation its turns are added to.
    history: dict[str, str] = {"conversation": client.conversations.create().id} if args.conversation else {}
    for turn, question in enumerate(QUESTIONS, 1):
        start, first, response = time.perf_counter(), None, None
        stream = client.responses.create(model=model, input=question.format(document=document), stream=True,
                                         max_output_tokens=args.max_output_tokens, **history)
        for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            elif event.type in ("response.completed", "response.incomplete"):  # the whole response
                response = event.response
        if not args.conversation:
            history = {"previous_response_id": response.id}
        usage = response.usage
        ttft = f"{first:.2f} s" if first is not None else "no text"
        print(f"turn {turn}: time to first token {ttft}, prompt {usage.input_tokens} tokens "
              f"({usage.input_tokens_details.cached_tokens} cached), {usage.output_tokens} out: "
              f"{response.output_text!r}")
    if args.conversation:
        items = client.conversations.items.list(history["conversation"], order="asc")
        print(f"conversation {history['conversation']}: {len(list(items))} items")


if __name__ == "__main__":
    main()
