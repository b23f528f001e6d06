"""Local processes started together (the benchmark's verifiers): all SERVING, or, when one fails,
the error raised and every process stopped; and none left serving when their command is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from drafter_sdk.service.lifecycle import held_lifeline
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


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _running(pid: int) -> bool:
    try:  # a zombie waits for a reaper that a container may not run: it serves nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _command_flooding_its_drafter() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A `splitspec` command that started a drafter and is flooding it with calls: (command, drafter pid)."""
    command = subprocess.Popen([script("splitspec"), "bench-drafter-memory", "--sequences", "2", "--tokens", "50",
                                "--unbounded-calls", "1000000", "--calls", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (children := _children(command.pid)):
            assert command.poll() is None and time.monotonic() < deadline, "no drafter was started"
            time.sleep(0.05)
        (drafter_pid,) = children
        # Forked but not yet exec'd, the child still shows the command's own argv: wait for the drafter's.
        while "--port-file" not in (argv := Path(f"/proc/{drafter_pid}/cmdline").read_text().split("\0")):
            assert time.monotonic() < deadline, f"the child never became the drafter: {argv}"
            time.sleep(0.05)
        port_file = Path(argv[argv.index("--port-file") + 1])
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline, "the drafter never bound its port"
            time.sleep(0.05)
        time.sleep(1.0)  # into the flood
        assert _running(drafter_pid)
        yield command, drafter_pid
    finally:
        command.kill()
        command.wait()


def test_sigterm_to_a_command_stops_the_services_it_started() -> None:
    """`kill PID` (or a supervisor) signals the `splitspec` command alone: it must unwind and stop the
    drafter it started, not exit and leave it serving."""
    with _command_flooding_its_drafter() as (command, drafter_pid):
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=60)
        assert not _running(drafter_pid), "the drafter outlived the command that started it"
        assert code == 128 + signal.SIGTERM


def test_a_killed_command_leaves_no_service_serving() -> None:
    """SIGKILL (the OOM killer, a CI timeout) stops the command before it can stop anything: the
    drafter must notice its lifeline break and stop by itself."""
    with _command_flooding_its_drafter() as (command, drafter_pid):
        command.kill()
        command.wait()
        deadline = time.monotonic() + 30
        while _running(drafter_pid):
            assert time.monotonic() < deadline, "the drafter kept serving after its command was killed"
            time.sleep(0.05)


def test_a_service_started_here_keeps_serving_until_stopped() -> None:
    """The lifeline is held for the service's whole life, across a restart, not only while it starts."""
    service = drafter("held")
    with service:
        first_pid = service.process.pid
        time.sleep(1.0)
        assert _running(first_pid)
        service.stop()
        service.start()
        time.sleep(1.0)
        assert service.process.poll() is None and service.process.pid != first_pid


def test_a_lifeline_is_taken_only_where_its_very_pipe_is_held(tmp_path: Path) -> None:
    """A grandchild (torchrun's rank) inherits the variable, not the pipe: under that number it may
    hold nothing, or an unrelated file, and must not stop when that file is readable."""
    read_end, write_end = os.pipe()
    other_read, other_write = os.pipe()
    try:
        with open(tmp_path / "file", "w") as unrelated:
            assert held_lifeline(f"{read_end}:{os.fstat(read_end).st_ino}") == read_end
            assert held_lifeline(f"{other_read}:{os.fstat(read_end).st_ino}") is None  # another pipe
            assert held_lifeline(f"{unrelated.fileno()}:{os.fstat(unrelated.fileno()).st_ino}") is None
            assert held_lifeline(f"999:{os.fstat(read_end).st_ino}") is None  # nothing under that number
            assert held_lifeline("") is None
    finally:
        for fd in (read_end, write_end, other_read, other_write):
            os.close(fd)
