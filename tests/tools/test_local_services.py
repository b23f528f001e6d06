"""Local processes started together (the benchmark's verifiers): all SERVING, or, when one fails,
the error raised and every process stopped."""

from __future__ import annotations

import contextlib
import sys

import pytest

from verifier_service.tools.local_services import LocalService, script, start_together


def drafter(name: str) -> LocalService:
    return LocalService([script("splitspec-drafter"), "ngram", "--log-level", "WARNING"], name=name)


def test_services_started_together_serve_and_stop_with_the_stack() -> None:
    with contextlib.ExitStack() as stack:
        first, second = start_together(stack, [drafter("first"), drafter("second")])
        assert first.port and second.port and first.port != second.port
        assert first.process.poll() is None and second.process.poll() is None
    assert first.process.poll() is not None and second.process.poll() is not None


def test_a_failed_start_is_raised_and_stops_the_others() -> None:
    good = drafter("good")
    broken = LocalService([sys.executable, "-c", "import sys; sys.exit(3)"], name="broken")
    with pytest.raises(RuntimeError, match="broken exited with 3"):
        with contextlib.ExitStack() as stack:
            start_together(stack, [good, broken])
    assert good.process is not None and good.process.poll() is not None
