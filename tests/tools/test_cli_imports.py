"""The command lines answer --help, a bad flag and the light commands without importing torch or
transformers, which cost seconds a start (verifier_service/tools/cli.py, verifier_service/api/cli.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

CHECK = """
import sys
from {module} import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(code, ",".join(heavy) or "-")
"""


@pytest.mark.parametrize(("module", "argv", "code"), [
    ("verifier_service.tools.cli", ["--help"], 0),
    ("verifier_service.tools.cli", ["generate", "--help"], 0),
    ("verifier_service.tools.cli", ["demo", "--help"], 0),
    ("verifier_service.tools.cli", ["bench-drafter-memory", "--help"], 0),
    ("verifier_service.tools.cli", ["bench-serve", "--help"], 0),
    ("verifier_service.tools.cli", ["bench-serve", "--base-url", "http://127.0.0.1:9", "--max-tokens", "0"], 2),
    ("verifier_service.api.cli", ["--help"], 0),
    ("verifier_service.api.cli", ["--max-draft-len", "x"], 2),  # argparse's error
    ("verifier_service.api.cli", ["--speculative-mode", "ngram", "--drafter-target", "h:1"], 2),  # settings' error
    ("verifier_service.api.cli", ["--override-generation-config", '{"top_k": 0.5}'], 2),  # the sampling defaults'
])
def test_no_torch_for_help_bad_flags_and_light_commands(module: str, argv: list[str], code: int) -> None:
    done = subprocess.run([sys.executable, "-c", CHECK.format(module=module, argv=argv)], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split()[-2:] == [str(code), "-"], done.stdout[-2000:] + done.stderr[-2000:]



@pytest.mark.parametrize("module", ["verifier_service.tools.cli", "verifier_service.api.cli", "drafter_sdk.server.cli"])
def test_version_is_the_installed_packages(module: str) -> None:
    """`splitspec --version`, `splitspec-verifier --version` and `splitspec-drafter --version`, as `vllm --version`."""
    done = subprocess.run([sys.executable, "-c", CHECK.format(module=module, argv=["--version"])], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == [importlib.metadata.version("splitspec"), "0", "-"], done.stdout + done.stderr
