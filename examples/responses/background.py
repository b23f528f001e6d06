"""A long answer in the background (OpenAI's background mode): started without holding a connection
to its end, its stream dropped part-way and picked up again after the last event seen, as a client
that lost its network would; then a second one cancelled once it has begun.

    splitspec-verifier &                      # the embedded model, HTTP API on :8000
    python examples/responses/background.py
"""

from __future__ import annotations

import argparse
import time

import openai

INPUT = "Write a long story about a lighthouse keeper who learns to speak with the sea."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default="unused", help="the verifier's bearer token, if it has one")
    p.add_argument("--input", default=INPUT)
    p.add_argument("--max-output-tokens", type=int, default=400)
    p.add_argument("--drop-after", type=int, default=8, help="events read before the stream is dropped")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = client.models.list().data[0].id
    ask = {"model": model, "input": args.input, "max_output_tokens": args.max_output_tokens}

    text, cursor, response_id = "", -1, ""
    stream = client.responses.create(**ask, background=True, stream=True)
    for read, event in enumerate(stream, 1):
        cursor = event.sequence_number
        if event.type == "response.created":
            response_id = event.response.id
        elif event.type == "response.output_text.delta":
            text += event.delta
        if read == args.drop_after:
            break
    stream.close()
    status = client.responses.retrieve(response_id).status
    print(f"{response_id}: stream dropped after event {cursor} ({len(text)} characters); polled: {status}")

    final = None
    for event in client.responses.retrieve(response_id, stream=True, starting_after=cursor):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None
    print(f"resumed after event {cursor}: {final.status}, {final.usage.output_tokens} tokens; "
          f"the text read in two parts is the response's: {text == final.output_text}")

    second = client.responses.create(**ask, background=True)
    while client.responses.retrieve(second.id).status == "queued":  # cancelled once it has begun to write
        time.sleep(0.05)
    try:
        cancelled = client.responses.cancel(second.id)
        print(f"{second.id}: {cancelled.status} with {cancelled.usage.output_tokens} tokens written")
    except openai.BadRequestError as exc:  # it ended before the cancel reached it
        print(f"{second.id}: not cancelled: {exc.body['message']}")


if __name__ == "__main__":
    main()
