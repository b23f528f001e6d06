"""32 concurrent streaming HTTP clients (httpx), some of which hang up mid-stream: every stream
that stays gets exactly its whole answer, and the ones that left leave nothing behind (no
sequence, KV slot or drafter state), with the process's memory bounded."""

from __future__ import annotations

import asyncio
import json
import random
import resource

import httpx
from http_support import WAIT_S, http_verifier, wait_until
from tiny_model import tiny_tokenizer
from verifier_support import LOOPING_SEEDS, one_torch_thread, repetitive_prompt  # noqa: F401 - autouse fixture

CLIENTS = 32
ROUNDS = 2


def test_concurrent_streams_with_random_disconnects() -> None:
    prompts = [tiny_tokenizer().decode(repetitive_prompt(LOOPING_SEEDS[i % len(LOOPING_SEEDS)] + i // 16))
               for i in range(CLIENTS)]
    rng = random.Random(0)

    def body(i: int, stream: bool) -> dict:
        return {"prompt": prompts[i], "max_tokens": 24, "stream": stream, "ignore_eos": True}

    async def main() -> None:
        async with http_verifier(max_num_seqs=8, max_queue_len=64) as h:
            limits = httpx.Limits(max_connections=CLIENTS + 4)
            async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S, limits=limits) as http:
                expected = []
                for i in range(CLIENTS):  # one at a time: the reference answers
                    r = await http.post("/v1/completions", json=body(i, False))
                    expected.append(r.json()["choices"][0]["text"])

                async def client(i: int, leave_after: int | None) -> str | None:
                    text, events = "", 0
                    async with http.stream("POST", "/v1/completions", json=body(i, True)) as s:
                        assert s.status_code == 200
                        async for line in s.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            text += json.loads(line[6:])["choices"][0]["text"]
                            events += 1
                            if leave_after is not None and events >= leave_after:
                                return None  # hang up mid-stream
                    return text

                rss = []
                for _ in range(ROUNDS):
                    leave = [rng.choice([None, None, 1, 3]) for _ in range(CLIENTS)]
                    texts = await asyncio.gather(*(client(i, leave[i]) for i in range(CLIENTS)))
                    for i, text in enumerate(texts):
                        if leave[i] is None:
                            assert text == expected[i], f"client {i}"
                    assert any(x is not None for x in leave) and any(x is None for x in leave)
                    await wait_until(h.idle, "every sequence, KV slot and drafter state released")
                    rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
                # Peak RSS (KiB) grows by less than 100 MiB between the rounds: nothing piles up per stream.
                assert rss[-1] - rss[0] < 100 * 1024, rss

                # A client that leaves stops its sequence at the next step, not at max_tokens.
                engine = h.v.running.runtime.engine
                steps = engine.decode_steps
                long = {"prompt": prompts[0], "max_tokens": 200, "ignore_eos": True, "stream": True,
                        "speculation": {"disable": True}}
                async with http.stream("POST", "/v1/completions", json=long) as s:
                    assert s.status_code == 200
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            break
                    assert line.startswith("data: {")
                await wait_until(h.idle, "the abandoned sequence released")
                assert engine.decode_steps - steps < 120

                # The same without streaming: the client hangs up while its answer is being generated.
                steps = engine.decode_steps
                payload = json.dumps(long | {"stream": False}).encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", h.v.running.http_port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                await writer.drain()
                await wait_until(lambda: engine.scheduler.running, "the request running")
                writer.close()
                await wait_until(h.idle, "the abandoned sequence released")
                assert engine.decode_steps - steps < 120

    asyncio.run(main())
