"""A multi-turn conversation through the Responses API: each turn continues the last by
`previous_response_id`, so the verifier renders the stored conversation and takes its earlier
tokens from the prefix cache. Prints each turn's time to first token and how many of its prompt's
tokens came from the cache.

    splitspec-verifier &                      # the embedded model, HTTP API on :8000
    python examples/responses/multi_turn.py --document README.md
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
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = client.models.list().data[0].id
    document = args.document.read_text()[:args.document_chars]
    previous = None
    for turn, question in enumerate(QUESTIONS, 1):
        start, first, response = time.perf_counter(), None, None
        stream = client.responses.create(model=model, input=question.format(document=document), stream=True,
                                         previous_response_id=previous, max_output_tokens=args.max_output_tokens)
        for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            elif event.type in ("response.completed", "response.incomplete"):  # the whole response
                response = event.response
        previous = response.id
        usage = response.usage
        ttft = f"{first:.2f} s" if first is not None else "no text"
        print(f"turn {turn}: time to first token {ttft}, prompt {usage.input_tokens} tokens "
              f"({usage.input_tokens_details.cached_tokens} cached), {usage.output_tokens} out: "
              f"{response.output_text!r}")


if __name__ == "__main__":
    main()
