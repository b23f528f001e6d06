"""`splitspec bench-serve`, a real process, against a running verifier's HTTP API (tiny model, remote n-gram
drafter): both passes served, speculation seen only where it is on, outputs identical (greedy, and sampled
with seeds); a bad dataset
or a refused token fails in one line before anything is measured."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from certs import make_pki
from http_support import PROMPT, WAIT_S, http_verifier, submitted_priorities
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from verifier_service.tools.bench.endpoint import (
    Pass,
    Record,
    arrivals,
    pass_order,
    percentile,
    print_summary,
    stream_request,
    summarise,
)
from verifier_service.tools.bench.serve_prompts import Request, load_dataset

SPLITSPEC = str(Path(sys.executable).with_name("splitspec"))


async def bench_serve(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(SPLITSPEC, "bench-serve", *args, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 3 * WAIT_S)
    return process.returncode, out.decode(), err.decode()


def test_bench_serve_measures_a_running_verifier_with_and_without_speculation(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": PROMPT, "raw": True}, {"prompt": PROMPT[6:], "raw": True, "max_tokens": 12},
             {"messages": [{"role": "user", "content": PROMPT}]}, {"prompt": "d10 add"}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    async def main() -> None:
        async with http_verifier(auth_token="s3cret") as h:
            code, out, err = await bench_serve(
                "--base-url", h.base_url + "/v1", "--auth-token-file", str(token), "--dataset", str(dataset),
                "--max-tokens", "20", "--request-rate", "40", "--max-concurrency", "2", "--rounds", "2",
                "--out", str(tmp_path / "out"))
            assert code == 0, out + err
            assert out.count("outputs identical: 4 of 4") == 2, out
            result = json.loads((tmp_path / "out" / "bench-serve.json").read_text())
            assert result["model"] == "tiny"
            passes = result["summary"]["passes"]
            assert [(p["mode"], p["round"], p["done"], p["failed"]) for p in passes] == [
                ("spec", 0, 4, 0), ("plain", 0, 4, 0), ("plain", 1, 4, 0), ("spec", 1, 4, 0)]
            for p in passes:
                assert p["mean_acceptance_length"] > 1.5 if p["mode"] == "spec" else p["mean_acceptance_length"] == 1
                assert 0 < p["drafter_wait_share"] < 1 if p["mode"] == "spec" else p["drafter_wait_share"] == 0
                assert p["output_tokens"] == passes[0]["output_tokens"]
            assert [r["round"] for r in result["summary"]["rounds"]] == [0, 1]
            records = result["requests"]
            assert [(r["mode"], r["round"]) for r in records[::4]] == [
                ("spec", 0), ("plain", 0), ("plain", 1), ("spec", 1)]
            for r in records:
                assert r["output_tokens"] == len(r["token_ids"]) and 1 <= r["output_tokens"] <= 20
                assert r["ttft_s"] <= r["e2e_s"] and len(r["chunk_gaps_s"]) < r["output_tokens"]
            assert max(r["output_tokens"] for r in records if r["prompt"] == 1) <= 12  # its line's max_tokens

            # The server's configuration alone (as against another OpenAI-compatible server), unwarmed, on 3
            # of the 4 prompts.
            code, out, err = await bench_serve(
                "--base-url", h.base_url, "--auth-token-file", str(token), "--dataset", str(dataset), "--no-plain",
                "--no-warmup", "--num-prompts", "3", "--max-tokens", "8", "--out", str(tmp_path / "alone"))
            assert code == 0, out + err
            alone = json.loads((tmp_path / "alone" / "bench-serve.json").read_text())
            assert [(p["mode"], p["done"]) for p in alone["summary"]["passes"]] == [("spec", 3)]
            assert alone["summary"]["rounds"] == [] and len(set(alone["prompts"])) == 3

            # The token refused: told in one line, nothing measured.
            code, out, err = await bench_serve("--base-url", h.base_url, "--dataset", str(dataset),
                                               "--out", str(tmp_path / "refused"))
            assert code == 1 and "GET /v1/models answered 401" in err, err
            assert not (tmp_path / "refused").exists()

    asyncio.run(main())


def test_bench_serve_reaches_a_verifier_over_https_with_its_ca_and_a_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": PROMPT, "raw": True}) + "\n")
    common = ["--dataset", str(dataset), "--max-tokens", "4", "--no-warmup", "--out", str(tmp_path)]

    async def main() -> None:
        async with http_verifier(speculate=False, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                 tls_client_ca=str(pki.ca_cert)) as h:
            base = f"https://localhost:{h.v.running.http_port}"
            code, out, err = await bench_serve("--base-url", base, "--tls-ca", str(pki.ca_cert), "--tls-cert",
                                               str(pki.client_cert), "--tls-key", str(pki.client_key), *common)
            assert code == 0, out + err
            code, out, err = await bench_serve("--base-url", base, "--tls-ca", str(pki.ca_cert), *common)
            assert code == 1 and "no answer from" in err, out + err  # no client certificate: no handshake
            code, out, err = await bench_serve("--base-url", base, "--tls-cert", str(pki.client_cert), *common)
            assert code == 2 and "--tls-cert and --tls-key go together" in err, err

    asyncio.run(main())


def test_sampled_outputs_compare_too_each_request_seeded_alike(tmp_path: Path) -> None:
    """Sampled, with the sampling sent or left to the server's defaults (a model's generation config): the same
    seeds in both passes, so the same tokens with speculation and without, and not greedy decoding's."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "raw": True}) for p in (PROMPT, PROMPT[6:], "d10 add")))

    async def main() -> dict[str, list[list[int]]]:
        tokens = {}
        async with http_verifier(override_generation_config={"temperature": 0.9, "top_k": 8}) as h:
            for name, flags in [("server", ["--temperature", "server"]),
                                ("sent", ["--temperature", "0.9", "--top-k", "8"]), ("greedy", [])]:
                code, out, err = await bench_serve("--base-url", h.base_url, "--dataset", str(dataset), "--max-tokens",
                                                   "12", "--ignore-eos", "--seed", "3", "--out", str(tmp_path / name),
                                                   *flags)
                assert code == 0 and "outputs identical: 3 of 3" in out, out + err
                result = json.loads((tmp_path / name / "bench-serve.json").read_text())
                tokens[name] = [r["token_ids"] for r in result["requests"] if r["mode"] == "spec"]
        return tokens

    tokens = asyncio.run(main())
    assert tokens["server"] == tokens["sent"] != tokens["greedy"]


def test_bench_serve_sends_priorities_and_reports_each_class(tmp_path: Path) -> None:
    """A line's own priority, else --priorities in turn; each pass broken down by priority. A verifier that
    serves in order of arrival refuses them at the warm-up, in one line."""
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": PROMPT, "raw": True}, {"prompt": PROMPT[6:], "raw": True, "priority": 5},
             {"prompt": "d10 add"}, {"prompt": PROMPT[3:], "raw": True}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    async def main() -> None:
        async with http_verifier(scheduling_policy="priority", max_num_seqs=1) as h:
            submitted = submitted_priorities(h)
            code, out, err = await bench_serve(
                "--base-url", h.base_url, "--dataset", str(dataset), "--priorities", "1,-1", "--max-tokens", "8",
                "--no-plain", "--out", str(tmp_path / "out"))
            assert code == 0, out + err
            assert sorted(submitted) == sorted([1, 5, 1, -1] * 2)  # the warm-up, then the pass
            result = json.loads((tmp_path / "out" / "bench-serve.json").read_text())
            assert [r["priority"] for r in result["requests"]] == [1, 5, 1, -1]
            (spec,) = result["summary"]["passes"]
            classes = {c["priority"]: c for c in spec["by_priority"]}
            assert {k: c["done"] for k, c in classes.items()} == {-1: 1, 1: 2, 5: 1}
            assert all(c["ttft_50_ms"] <= c["e2e_50_ms"] for c in classes.values())
            assert "  priority 5: 1 done, 0 failed; TTFT p50/p99" in out
        async with http_verifier() as h:
            code, out, err = await bench_serve("--base-url", h.base_url, "--dataset", str(dataset),
                                               "--out", str(tmp_path / "fcfs"))
            assert code == 1 and "needs a verifier started with --scheduling-policy priority" in err, err

    asyncio.run(main())


@pytest.mark.parametrize("line, problem", [
    ("not json", "line 2: Expecting value"),
    ('{"prompt": ""}', 'line 2: a line needs "messages" (a chat) or "prompt" (a non-empty string)'),
    ('{"messages": []}', "line 2: messages must be a non-empty list"),
    ('{"prompt": "x", "max_tokens": 0}', "line 2: max_tokens must be a positive integer, not 0"),
    ("[1]", "line 2: a line must be a JSON object"),
    ('{"prompt": "x", "priority": "high"}', "line 2: priority must be an integer, not 'high'"),
])
def test_a_bad_dataset_line_is_named_before_anything_is_sent(tmp_path: Path, line: str, problem: str) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "fine"}\n' + line + "\n")
    code, _, err = asyncio.run(bench_serve("--base-url", "http://127.0.0.1:9", "--dataset", str(dataset)))
    assert code == 2 and problem in err, err


@pytest.mark.parametrize("text, problem", [
    ('[{"conversations": "hi"}]', 'item 0: a ShareGPT item holds a list of turns under "conversations"'),
    ('[{"conversations": [{"from": "robot", "value": "hi"}]}]', 'item 0: a turn is {"from": human, gpt or system'),
    ('[{"conversations": [{"from": "gpt", "value": "hi"}]}]', "holds no conversation with a human turn"),
    ("[1, ", "not JSON"),
])
def test_a_bad_sharegpt_file_is_named_before_anything_is_sent(tmp_path: Path, text: str, problem: str) -> None:
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(text)
    code, _, err = asyncio.run(bench_serve("--base-url", "http://127.0.0.1:9", "--dataset", str(dataset)))
    assert code == 2 and problem in err, err


def test_sharegpt_conversations_become_their_first_question(tmp_path: Path) -> None:
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                                      {"from": "human", "value": "Q2"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"conversations": []}]))
    requests = load_dataset(dataset)
    assert [(r.name, r.messages) for r in requests] == [
        ("sharegpt.json:a", [{"role": "user", "content": "Q1"}]),
        ("sharegpt.json:b", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])]


def test_a_greedy_output_that_differs_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    def record(mode: str, prompt: int, tokens: list[int]) -> Record:
        return Record(mode, 0, prompt, ttft_s=0.1, e2e_s=0.5, output_tokens=len(tokens), token_ids=tokens)

    requests = [Request("same", prompt="a"), Request("changed", prompt="b")]
    passes = [Pass("spec", 0, 1.0, [record("spec", 0, [1, 2, 3]), record("spec", 1, [4, 5, 6])]),
              Pass("plain", 0, 2.0, [record("plain", 0, [1, 2, 3]), record("plain", 1, [4, 5, 7])])]
    args = argparse.Namespace(temperature=0.0, request_rate=float("inf"), max_concurrency=None)
    summary = summarise(passes, args)
    assert summary["rounds"][0]["identical"] == {"same": 1, "compared": 2, "differ": [1]}
    assert summary["rounds"][0]["output_tokens_per_s_ratio"] == 2.0
    print_summary(summary, "http://x", "m", requests, args)
    assert "outputs identical: 1 of 2 (not: changed)" in capsys.readouterr().out


def test_a_stream_cut_short_is_a_failure() -> None:
    cut = 'data: {"choices": [{"index": 0, "text": "a", "splitspec": {"token_ids": [5]}}]}\n\n'

    async def main() -> Record:
        transport = httpx.MockTransport(lambda _: httpx.Response(200, text=cut,
                                                                 headers={"content-type": "text/event-stream"}))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            record = Record("spec", 0, 0)
            await stream_request(http, "/v1/completions", {}, record)
            return record

    record = asyncio.run(main())
    assert record.error == "the stream ended before its [DONE]" and record.token_ids == [5]


def test_poisson_arrivals_alternating_passes_and_percentiles() -> None:
    times = arrivals(4000, 20.0, seed=1)
    assert times == arrivals(4000, 20.0, seed=1) and times != arrivals(4000, 20.0, seed=2)
    assert times[0] == 0 and times == sorted(times)
    assert 0.045 < times[-1] / 3999 < 0.055  # a mean gap of 1/20 s
    assert arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    assert pass_order(3, plain=True) == ["spec", "plain", "plain", "spec", "spec", "plain"]
    assert pass_order(2, plain=False) == ["spec", "spec"]
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)
