"""The README's drafter example, run exactly as written, as a real drafter process behind a real verifier."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from readme_blocks import readme_drafter, readme_http_blocks
from tiny_model import tiny_model
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

from verifier_service.tools.local_services import LocalService, script


def test_readme_drafter_is_about_ten_lines_and_runs_behind_a_verifier(tmp_path: Path) -> None:
    source = readme_drafter()
    code_lines = [line for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code_lines) <= 16, "the README promises a drafter in about ten lines"
    (tmp_path / "my_drafter.py").write_text(source)
    model = tiny_model()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repetitive: the example drafter has something to copy
    expected = reference_greedy(model, prompt, 40)
    with LocalService([script("splitspec-drafter"), f"{tmp_path / 'my_drafter.py'}:RepeatLastDrafter"],
                      name="readme-drafter", startup_timeout_s=60) as drafter:
        async def main() -> None:
            spec = spec_config("USER_PROVIDED", 4, drafter_target=drafter.address, deadline_ms=2000)
            async with run_verifier(spec, model=model) as v:
                reply = await v.stub.Generate(token_request(prompt, 40), timeout=120)
                assert list(reply.output.token_ids) == expected
                assert reply.output.stats.num_drafts > 0 and reply.output.stats.num_drafter_failures == 0

        asyncio.run(main())
        assert drafter.stop() == 0


def test_readme_curl_and_openai_examples_run_as_written(tmp_path: Path) -> None:
    """Only the port changes (8000 -> the test server's free port)."""
    import sys

    from drafter_sdk.proto import verifier_pb2

    curl, client = readme_http_blocks()
    model = tiny_model()

    async def run(*argv: str) -> str:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        return out.decode()

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=model) as v:
            port = str(v.running.http_port)
            chat = verifier_pb2.ChatMessages(messages=[verifier_pb2.ChatMessage(role="user",
                                                                                content="Name three primes.")])
            expected = (await v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                chat=chat, stopping=verifier_pb2.StoppingCriteria(max_new_tokens=32))), timeout=120)).output.text
            answer = json.loads(await run("bash", "-c", curl.replace("8000", port)))
            assert answer["choices"][0]["message"]["content"] == expected
            (tmp_path / "client.py").write_text(client.replace("8000", port))
            assert await run(sys.executable, str(tmp_path / "client.py")) == expected

    asyncio.run(main())
