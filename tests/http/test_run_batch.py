"""`splitspec run-batch`, a real process, against a running verifier's HTTP API (tiny model, remote n-gram
drafter): every request of an OpenAI batch file answered once, in OpenAI's batch output shape, with the answer
the same request gets sent alone (greedy: exact); a refused request answered with its error; a full server's
429s retried until answered; a file with mistakes refused whole, line by line, before anything is sent; a
batch cut short resumed without sending again what was answered."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
from certs import make_pki
from http_support import PROMPT, WAIT_S, HttpVerifier, http_verifier, wait_until
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

SPLITSPEC = str(Path(sys.executable).with_name("splitspec"))
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24}
COMPLETION = {"prompt": PROMPT, "max_tokens": 24}
RESPONSE = {"input": PROMPT, "max_output_tokens": 24}


async def run_batch(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(SPLITSPEC, "run-batch", *args, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 3 * WAIT_S)
    return process.returncode, out.decode() + err.decode()


def batch_file(path: Path, requests: list[tuple[str, str, dict]]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"
                            for custom_id, url, body in requests))
    return path


def answers(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a request answered twice"
    return by_id


async def alone(h: HttpVerifier, url: str, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=h.base_url, timeout=WAIT_S) as http:
        return (await http.post(url, json={"model": "tiny", **body})).json()


def text(url: str, body: dict) -> str:
    if url == "/v1/responses":
        return body["output"][0]["content"][0]["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if url == "/v1/chat/completions" else choice["text"]


def test_every_request_is_answered_once_as_it_is_answered_alone(tmp_path: Path) -> None:
    requests = [("chat", "/v1/chat/completions", CHAT), ("completion", "/v1/completions", COMPLETION),
                ("response", "/v1/responses", RESPONSE),
                ("refused", "/v1/chat/completions", {**CHAT, "max_tokens": -1}),
                ("unserved", "/v1/completions", {**COMPLETION, "model": "gpt-9"})]
    requests += [(f"chat-{i}", "/v1/chat/completions", {**CHAT, "max_tokens": 8 + i}) for i in range(6)]
    source, output = batch_file(tmp_path / "in.jsonl", requests), tmp_path / "out.jsonl"

    async def main() -> None:
        async with http_verifier() as h:
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url,
                                            "--concurrency", "4")
            assert code == 0, printed
            got = answers(output)
            assert set(got) == {custom_id for custom_id, _, _ in requests}
            for custom_id, url, body in requests[:3] + requests[5:]:
                line = got[custom_id]
                assert line["id"].startswith("batch_req_") and line["error"] is None
                response = line["response"]
                assert response["status_code"] == 200 and response["request_id"]
                assert text(url, response["body"]) == text(url, await alone(h, url, body)), custom_id
            refused, unserved = got["refused"]["response"], got["unserved"]["response"]
            assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
            assert unserved["status_code"] == 404 and "gpt-9" in unserved["body"]["error"]["message"]
            assert "11 requests (0 answered before, kept by --resume; 11 sent): 9 answered 200, 1 answered 400, " \
                   "1 answered 404; 0 without an answer" in printed, printed
            assert "speculation: mean acceptance length" in printed  # the remote drafter drafted for the batch
            await wait_until(h.idle, "every sequence and the drafter's state freed")

    asyncio.run(main())


def test_a_verifier_asking_for_client_certificates_is_reached_with_them(tmp_path: Path) -> None:
    """An https:// base URL: --tls-ca verifies the verifier's certificate, --tls-cert/--tls-key answer its
    --tls-client-ca (its HTTP port asks as its gRPC port does)."""
    pki = make_pki(tmp_path)
    batch = batch_file(tmp_path / "in.jsonl", [("chat", "/v1/chat/completions", CHAT)])
    tls = ["--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]

    async def main() -> None:
        async with http_verifier(speculate=False, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                 tls_client_ca=str(pki.ca_cert)) as h:
            base = f"https://localhost:{h.v.running.http_port}"
            code, said = await run_batch("-i", str(batch), "-o", str(tmp_path / "out.jsonl"), "--base-url", base,
                                         *tls)
            assert code == 0, said
            assert answers(tmp_path / "out.jsonl")["chat"]["response"]["status_code"] == 200
            # Without the CA the verifier's certificate fails verification, once: no retry would change it.
            code, said = await run_batch("-i", str(batch), "-o", str(tmp_path / "refused.jsonl"), "--base-url",
                                         base, *tls[2:])
            assert code == 1 and "0 retries" in said, said
            error = answers(tmp_path / "refused.jsonl")["chat"]["error"]["message"]
            assert error.startswith("no answer after 1 try; the last: ") and "CERTIFICATE_VERIFY_FAILED" in error, error
            code, said = await run_batch("-i", str(batch), "-o", str(tmp_path / "plain.jsonl"), "--base-url",
                                         base.replace("https", "http"), *tls)
            assert code == 2 and "are for an https:// --base-url" in said, said

    asyncio.run(main())


def test_a_full_server_is_waited_for(tmp_path: Path) -> None:
    """Two sequences fit (one running, one queued); eight sent at once: the rest are 429s. Not retried, they
    are lines without an answer (exit status 1), which --resume sends again; retried, they are answered."""
    requests = [(f"chat-{i}", "/v1/chat/completions", {**CHAT, "max_tokens": 60}) for i in range(8)]
    source, output = batch_file(tmp_path / "in.jsonl", requests), tmp_path / "out.jsonl"

    async def main() -> None:
        async with http_verifier(max_num_seqs=1, max_queue_len=1) as h:
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url,
                                            "--concurrency", "8", "--max-retries", "0")
            full = [line for line in answers(output).values() if line["response"]["status_code"] == 429]
            assert code == 1 and full and f"; {len(full)} without an answer; 0 retries" in printed, printed
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url,
                                            "--concurrency", "8", "--max-retries", "100", "--resume")
            assert code == 0, printed
            assert f"({8 - len(full)} answered before, kept by --resume; {len(full)} sent)" in printed, printed
            output.unlink()
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url,
                                            "--concurrency", "8", "--max-retries", "100")
            assert code == 0, printed
            got = answers(output)
            assert {line["response"]["status_code"] for line in got.values()} == {200}
            assert len({text("/v1/chat/completions", line["response"]["body"]) for line in got.values()}) == 1
            retries = int(printed.split(" retries;")[0].rsplit(" ", 1)[1])
            assert retries > 0, printed

    asyncio.run(main())


def test_a_file_with_mistakes_is_refused_whole_before_anything_is_sent(tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": COMPLETION}),
             "{not json", json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}),
             json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}),
             json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions",
                         "body": {**COMPLETION, "stream": True}}), "", json.dumps(["e"]),
             '{"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud800"}}']
    source.write_text("\n".join(lines) + "\n")

    async def main() -> None:
        async with http_verifier(speculate=False) as h:
            submitted = []
            engine = h.v.running.runtime.engine
            submit = engine.submit
            engine.submit = lambda seq: (submitted.append(seq), submit(seq))[-1]
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url)
            assert code == 2 and not submitted and not output.exists(), printed
            for words in ("line 2: not JSON", "line 3: custom_id 'a' is used by an earlier line",
                          "line 4: method must be POST", "line 5: url must be one of", "line 6: body.stream",
                          "line 8: not a JSON object", "line 9: body.prompt: a lone UTF-16 surrogate (\\ud800)"):
                assert words in printed, printed
            empty = tmp_path / "empty.jsonl"
            empty.write_text("\n")
            code, printed = await run_batch("-i", str(empty), "-o", str(output), "--base-url", h.base_url)
            assert code == 2 and "holds no requests" in printed, printed
            code, printed = await run_batch("-i", str(source), "-o", str(source), "--base-url", h.base_url)
            assert code == 2 and "must not be the input" in printed, printed

    asyncio.run(main())


def test_a_batch_cut_short_resumes_without_sending_the_answered_again(tmp_path: Path) -> None:
    requests = [(f"chat-{i}", "/v1/chat/completions", {**CHAT, "max_tokens": 8 + i}) for i in range(5)]
    source, output = batch_file(tmp_path / "in.jsonl", requests), tmp_path / "out.jsonl"
    answered = {"custom_id": "chat-0", "response": {"status_code": 200, "request_id": "r0", "body": {"kept": 1}}}
    refused = {"custom_id": "chat-1", "response": {"status_code": 400, "request_id": "r1", "body": {"kept": 2}}}
    full = {"custom_id": "chat-2", "response": {"status_code": 429, "request_id": "r2", "body": {}}}
    unreachable = {"custom_id": "chat-3", "response": None, "error": {"code": "unreachable", "message": "x"}}
    gone = {"custom_id": "not-in-the-input", "response": {"status_code": 200, "request_id": "r", "body": {}}}
    output.write_text("".join(json.dumps(line) + "\n" for line in (answered, refused, full, unreachable, gone))
                      + '{"custom_id": "chat-4", "respo')  # the last line cut short by a crash

    async def main() -> None:
        async with http_verifier() as h:
            code, printed = await run_batch("-i", str(source), "-o", str(output), "--base-url", h.base_url,
                                            "--resume")
            assert code == 0, printed
            got = answers(output)
            assert set(got) == {f"chat-{i}" for i in range(5)} | {"not-in-the-input"}  # nothing answered is lost
            assert got["chat-0"] == answered and got["chat-1"] == refused  # kept as they were, not sent again
            assert got["not-in-the-input"] == gone
            for custom_id in ("chat-2", "chat-3", "chat-4"):
                assert got[custom_id]["response"]["status_code"] == 200
            assert "5 requests (2 answered before, kept by --resume; 3 sent): 3 answered 200" in printed, printed

    asyncio.run(main())
