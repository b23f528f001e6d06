""".ci/gpu-check runs once in a session that draws a GPU, with minutes to spare: a flag renamed since, or a
bench heading its summary no longer finds, would cost that run. Every command it starts must parse with
today's flags, and every heading its summary greps for must be one a bench or the verifier's log prints."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from verifier_service.api import cli as verifier_cli
from verifier_service.tools.bench import run as bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / ".ci" / "gpu-check").read_text()
# The script's shell values, as a session's run would have them.
VALUES = {'${model:+--model "$model"}': "--model /models/smollm2", '"$work': '"/tmp/work', '"$left"': "300"}


def commands(program: str) -> list[list[str]]:
    """The arguments of every `program` the script starts (continued lines joined, shell values filled in)."""
    text = SCRIPT.replace("\\\n", " ")
    for shell, value in VALUES.items():
        text = text.replace(shell, value)
    found = []
    for line in text.splitlines():
        if f"{program} " in line and not line.lstrip().startswith("#"):
            words = shlex.split(line.split(f"{program} ", 1)[1].split(" 2>&1")[0].split(" > ")[0])
            found.append(words)
    return found


def test_every_bench_gpu_check_runs_parses_with_todays_flags() -> None:
    runs = commands(".venv-gpu/bin/splitspec")
    assert len(runs) == 7 and all(run[0] == "bench" for run in runs)
    for run in runs:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        args = parser.parse_args(run[1:])  # exits (SystemExit) on a flag it does not know
        assert args.device == "cuda", run


def test_the_verifier_gpu_check_starts_parses_into_settings() -> None:
    [run] = commands(".venv-gpu/bin/splitspec-verifier")
    settings = verifier_cli.settings_from_args(verifier_cli.parser().parse_args(run))
    assert settings.device == "cuda" and settings.speculative.max_draft_len > 0


def test_every_heading_the_summary_looks_for_is_printed_by_a_bench() -> None:
    summary = SCRIPT.split('echo "== summary"', 1)[1]
    greps = re.findall(r'grep -h (-E |-A \d+ )?"([^"]+)"', summary)
    assert len(greps) == 9
    printed = "\n".join(path.read_text() for path in (ROOT / "verifier_service").rglob("*.py"))
    for option, pattern in greps:
        for heading in pattern.split("|" if option == "-E " else "\\|"):
            words = [w.strip() for w in re.split(r"\[0-9\]\+", heading.lstrip("^"))]  # around a number
            assert all(w in printed for w in words), f"no bench or log line prints {heading!r}"
