"""The README's drafter example, run exactly as written, as a real drafter process behind a real verifier."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from tiny_model import tiny_model
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request

from verifier_service.tools.local_services import LocalService, script

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_drafter() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class RepeatLastDrafter" in b]
    return block


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
