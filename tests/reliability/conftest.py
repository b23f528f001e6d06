"""Prints the reliability figures (faults tried, requests, failures; fuzz cases) after the run."""

from __future__ import annotations

import reliability_support


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's hook signature
    figures = reliability_support.FIGURES
    if not figures:
        return
    terminalreporter.section("reliability figures")
    for row in figures:
        terminalreporter.write_line("  ".join(f"{k}={v}" for k, v in row.items()))
