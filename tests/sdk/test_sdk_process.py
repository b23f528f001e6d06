"""The `splitspec-drafter` console script as a real process: loading user drafters, signals, exit codes."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sdk_support import DRAFTER_SCRIPT, seq

from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.server import cli

# What a drafter author writes (the __main__ part is the ten-line promise; the tests use the CLI).
USER_FILE = textwrap.dedent("""
    import os, time
    from pathlib import Path
    from drafter_sdk import Drafter, serve

    class SlowEcho(Drafter):
        version = "9.9"

        def prepare_draft_tokens(self, requests):
            Path(os.environ["MARK_FILE"]).touch()
            time.sleep(float(os.environ["DRAFT_DELAY_S"]))
            return [r.tokens[-r.draft_len:] for r in requests]

    class Unloadable(SlowEcho):
        def load(self):
            raise RuntimeError("no weights")

    class SlowLoad(SlowEcho):
        def load(self):
            time.sleep(120)  # weights to fetch

    if __name__ == "__main__":
        serve(SlowEcho(), port=50052)
""")


class DrafterProcess:
    def __init__(self, tmp_path: Path, drafter: str, *, cwd: Path | None = None, delay_s: float = 0.0,
                 log_flags: tuple[str, ...] = ("--log-level", "WARNING")) -> None:
        (tmp_path / "user_drafters.py").write_text(USER_FILE)
        self.port_file = tmp_path / "port"
        self.mark = tmp_path / "in-flight"
        env = dict(os.environ, MARK_FILE=str(self.mark), DRAFT_DELAY_S=str(delay_s))
        self.proc = subprocess.Popen(
            [str(DRAFTER_SCRIPT), drafter, "--host", "127.0.0.1", "--port", "0", "--port-file", str(self.port_file),
             "--grace-period-s", "5", *log_flags],
            cwd=cwd or tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_port(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.monotonic() < deadline, "no port file"
            time.sleep(0.05)
        return int(self.port_file.read_text())

    def output_once_serving(self) -> str:
        """Wait until it reports SERVING, stop it with SIGTERM, and return all it wrote."""
        port = self.wait_port()

        async def body() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await wait_serving(channel)

        asyncio.run(body())
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.communicate(timeout=30)[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def wait_serving(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(200):
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never SERVING")


def test_sigterm_lets_the_in_flight_call_finish_refuses_new_ones_and_exits_zero(tmp_path):
    drafter = DrafterProcess(tmp_path, f"{tmp_path / 'user_drafters.py'}:SlowEcho", delay_s=1.5)
    try:
        port = drafter.wait_port()

        async def body() -> float:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await wait_serving(channel)
                stub = drafter_pb2_grpc.DrafterServiceStub(channel)
                request = pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[seq("r", 0, [1, 2, 3], draft_len=2)])
                in_flight = asyncio.ensure_future(stub.PrepareDraftTokens(request, timeout=20))
                while not drafter.mark.exists():
                    await asyncio.sleep(0.02)
                drafter.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.3)  # the in-flight call still sleeps for over a second
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.PrepareDraftTokens(request, timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert not in_flight.done()
                response = await in_flight
                assert list(response.results[0].draft_tokens) == [2, 3]
                return sent

        sent = asyncio.run(body())
        assert drafter.proc.wait(timeout=10) == 0, drafter.proc.communicate()[0]
        assert time.monotonic() - sent < 5  # within the grace period
    finally:
        drafter.kill()


def test_cli_loads_module_colon_class_from_the_working_directory_and_stops_on_sigint(tmp_path):
    drafter = DrafterProcess(tmp_path, "user_drafters:SlowEcho", cwd=tmp_path)
    try:
        port = drafter.wait_port()

        async def body() -> pb.GetDrafterInfoResponse:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await wait_serving(channel)
                return await drafter_pb2_grpc.DrafterServiceStub(channel).GetDrafterInfo(
                    pb.GetDrafterInfoRequest(), timeout=5)

        info = asyncio.run(body())
        assert (info.name, info.version) == ("SlowEcho", "9.9")
        drafter.proc.send_signal(signal.SIGINT)
        assert drafter.proc.wait(timeout=10) == 0
    finally:
        drafter.kill()


def test_the_start_up_heap_is_frozen_before_the_drafter_loads(tmp_path):
    """The imports and the drafter object leave the collector's full passes before load() runs: what load()
    builds and what the drafter learns stay with the collector (service/start_up_heap.py)."""
    drafter = DrafterProcess(tmp_path, "user_drafters.py:SlowEcho", log_flags=("--log-level", "INFO"))
    try:
        lines = drafter.output_once_serving().splitlines()
        frozen = [i for i, line in enumerate(lines) if "start-up heap frozen: " in line]
        loaded = [i for i, line in enumerate(lines) if "SlowEcho loaded, SERVING" in line]
        assert len(frozen) == 1 and loaded and frozen[0] < loaded[0], lines
    finally:
        drafter.kill()


def test_json_logs_are_one_object_a_line_tracebacks_included(tmp_path):
    """--log-format json, for a log pipeline: every line a process writes is a JSON object with the
    record's time, level, logger and message; a failure's traceback rides in its record."""
    def records(out: str) -> list[dict]:
        lines = out.splitlines()
        assert lines, "nothing logged"
        parsed = [json.loads(line) for line in lines]  # fails on any line that is not one object
        for record in parsed:
            assert {"time", "level", "logger", "message"} <= record.keys(), record
            datetime.fromisoformat(record["time"])
        return parsed

    json_flags = ("--log-level", "INFO", "--log-format", "json")
    serving = DrafterProcess(tmp_path, "user_drafters.py:SlowEcho", log_flags=json_flags)
    try:
        messages = [r["message"] for r in records(serving.output_once_serving())]
        assert any("SERVING" in m for m in messages) and messages[-1] == "stopped", messages
    finally:
        serving.kill()
    failing = DrafterProcess(tmp_path, "user_drafters.py:Unloadable", log_flags=json_flags)
    try:
        errors = [r for r in records(failing.proc.communicate(timeout=30)[0]) if r["level"] == "ERROR"]
        assert failing.proc.returncode == 1
        assert any("no weights" in r.get("exception", "") for r in errors), errors
    finally:
        failing.kill()


def test_a_drafter_whose_load_fails_exits_non_zero(tmp_path):
    drafter = DrafterProcess(tmp_path, "user_drafters.py:Unloadable")
    try:
        assert drafter.proc.wait(timeout=30) == 1
        assert "no weights" in drafter.proc.communicate()[0]
    finally:
        drafter.kill()


def test_sigterm_while_load_runs_exits_at_once(tmp_path):
    """A drafter still in a long load() stops on SIGTERM at once, status 0, instead of lingering until load()
    returns: Python cannot stop the thread it runs on, and the interpreter's exit would wait for it."""
    drafter = DrafterProcess(tmp_path, "user_drafters.py:SlowLoad", log_flags=("--log-level", "INFO"))
    try:
        drafter.wait_port()
        drafter.proc.send_signal(signal.SIGTERM)
        assert drafter.proc.wait(timeout=30) == 0
        assert "SlowLoad's own code still runs (a load() not yet done" in drafter.proc.communicate()[0]
    finally:
        drafter.kill()


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "expected 'ngram', 'suffix', module:Class"),
    ("os:path", "os:path is not a Drafter subclass"),
    ("missing/file.py:X", "no Python file at missing/file.py"),
    ("no_such_module_xyz:X", "No module named 'no_such_module_xyz'"),
])
def test_cli_rejects_what_is_not_a_drafter(spec, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([spec])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["suffix", "--max-draft-len", "4"], "--max-draft-len is a flag of the ngram and model drafters, not of suffix"),
    (["ngram", "--max-tree-depth", "8"], "--max-tree-depth is a flag of the suffix drafter, not of ngram"),
    (["ngram", "--device", "cpu"], "--device is a flag of the model drafter, not of ngram"),
    (["model", "--no-is-keep-all"], "--is-keep-all is a flag of the ngram drafter, not of model"),
    (["my_module:MyDrafter", "--cache-scope", "request"], "--cache-scope is a flag of the suffix drafter, not of "
                                                          "my_module:MyDrafter"),
])
def test_cli_refuses_a_flag_of_another_drafter(argv, message, capsys):
    """A flag the chosen drafter would not read is an error, not silently ignored."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_keeps_each_drafters_defaults_for_flags_not_given():
    ngram = cli.make_drafter(cli.build_parser().parse_args(["ngram"]))
    assert (ngram.max_draft_len, ngram.max_matching_ngram_size, ngram.is_keep_all, ngram.is_use_oldest,
            ngram.is_public_pool, ngram.tree_min_prob) == (cli.NGRAM_MAX_DRAFT_LEN, 3, True, True, False, 0.0)


def test_cli_builds_the_ngram_drafter_from_its_flags():
    args = cli.build_parser().parse_args(["ngram", "--max-draft-len", "5", "--max-matching-ngram-size", "2",
                                          "--no-is-keep-all", "--no-is-use-oldest", "--is-public-pool",
                                          "--tree-min-prob", "0.05"])
    drafter = cli.make_drafter(args)
    assert (drafter.max_draft_len, drafter.max_matching_ngram_size, drafter.is_keep_all, drafter.is_use_oldest,
            drafter.is_public_pool, drafter.tree_min_prob) == (5, 2, False, False, True, 0.05)


def test_cli_builds_the_suffix_drafter_from_its_flags():
    default = cli.make_drafter(cli.build_parser().parse_args(["suffix"]))
    assert (default.max_spec_factor, default.own_spec_factor, default.prefer_longer_match,
            default.learn_choice) == (1.0, 8.0, True, True)
    args = cli.build_parser().parse_args(["suffix", "--max-spec-factor", "1.5", "--own-spec-factor", "1.0",
                                          "--no-prefer-longer-match", "--no-learn-choice", "--cache-scope", "request"])
    drafter = cli.make_drafter(args)
    assert (drafter.max_spec_factor, drafter.own_spec_factor, drafter.prefer_longer_match, drafter.learn_choice,
            drafter.cache_scope) == (1.5, 1.0, False, False, "request")


def test_the_sdk_imports_without_torch_or_numpy():
    code = textwrap.dedent("""
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.partition(".")[0] in ("torch", "numpy", "transformers"):
                    raise ImportError(f"{name} is blocked")

        sys.meta_path.insert(0, Block())
        import drafter_sdk, drafter_sdk.server.cli
        print(drafter_sdk.NgramDrafter().name)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ngram"
