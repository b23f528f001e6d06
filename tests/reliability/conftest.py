"""Fixtures of the reliability tests, and the figures (faults, load, fuzz cases) printed after the run."""

from __future__ import annotations

from pathlib import Path

import pytest

import reliability_support
from tiny_model import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harness's tiny model and tokenizer on disk, for `splitspec-verifier --model DIR` processes."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's hook signature
    figures = reliability_support.FIGURES
    if not figures:
        return
    terminalreporter.section("reliability figures")
    for row in figures:
        terminalreporter.write_line("  ".join(f"{k}={v}" for k, v in row.items()))
