"""Status codes, health around load(), reflection and shutdown of the in-process server."""

import asyncio
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sdk_support import RecordingDrafter, seq, serving, still_serving, until

from drafter_sdk import DrafterError, DrafterServicer, NgramDrafter, start_server
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.server import cli

SERVICE = "splitspec.v1.DrafterService"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def expect_error(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details()


@pytest.mark.parametrize("verifier_id, sequences, message", [
    ("", [seq("a", 0, [1])], "verifier_id must not be empty"),
    ("v\0salt", [seq("a", 0, [1])], "verifier_id must not hold a NUL character"),
    ("v", [seq("", 0, [1])], "request_id must not be empty"),
    ("v", [seq("a", 0, [1]), seq("a", 0, [2])], "duplicate request_id 'a'"),
    ("v", [seq("a", 0, [1]), seq("b", 0, [3, -1])], "negative token id -1"),
    ("v", [seq("a", 0, [1], prompt_len=2)], "prompt_len 2 exceeds the context length 1"),
    ("v", [seq("a", 0, [5, 1000])], "token id 1000 is outside the drafter's vocabulary (vocab_size 1000)"),
])
def test_malformed_requests_are_invalid_argument_and_touch_no_state(verifier_id, sequences, message):
    async def body():
        drafter = RecordingDrafter()
        drafter.vocab_size = 1000
        async with serving(drafter) as c:
            details = await expect_error(c.prepare(verifier_id, *sequences), INVALID)
            assert message in details
            assert drafter.calls == [] and len(c.running.servicer.store) == 0
            await still_serving(c)

    asyncio.run(body())


def test_release_without_verifier_id_is_invalid_argument():
    async def body():
        async with serving(RecordingDrafter()) as c:
            await expect_error(c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(request_ids=["a"])), INVALID)
            await still_serving(c)

    asyncio.run(body())


def test_drafter_exceptions_become_internal_and_the_server_keeps_serving():
    def propose(r):
        if r.request_id == "bad":
            raise ValueError("model exploded")
        return [1]

    async def body():
        async with serving(RecordingDrafter(propose)) as c:
            details = await expect_error(c.prepare("v", seq("bad", 0, [1])), grpc.StatusCode.INTERNAL)
            assert details == "prepare_draft_tokens raised ValueError: model exploded"
            await still_serving(c)

    asyncio.run(body())


@pytest.mark.parametrize("returned, message", [
    (lambda requests: [[1]] * (len(requests) + 1), "returned 2 drafts for 1 requests"),
    (lambda requests: None, "returned a NoneType, not a list of drafts"),
    (lambda requests: [[1, -5]], "token id -5 outside [0, 2147483648)"),
    (lambda requests: [[1.5]], "is not a sequence of int token ids"),
    (lambda requests: [7], "is not a sequence of int token ids"),
])
def test_nonsensical_drafts_are_internal(returned, message):
    class Broken(RecordingDrafter):
        def prepare_draft_tokens(self, requests):
            return returned(requests) if requests[0].request_id == "x" else super().prepare_draft_tokens(requests)

    async def body():
        async with serving(Broken()) as c:
            details = await expect_error(c.prepare("v", seq("x", 0, [1])), grpc.StatusCode.INTERNAL)
            assert message in details
            await still_serving(c)

    asyncio.run(body())


def test_tokens_beyond_the_declared_vocabulary_are_internal():
    drafter = RecordingDrafter(lambda r: [3, 50])
    drafter.vocab_size = 50

    async def body():
        async with serving(drafter) as c:
            details = await expect_error(c.prepare("v", seq("x", 0, [1])), grpc.StatusCode.INTERNAL)
            assert "token id 50 outside [0, 50)" in details

    asyncio.run(body())


class SlowLoad(RecordingDrafter):
    def __init__(self) -> None:
        super().__init__()
        self.release_load = threading.Event()

    def load(self) -> None:
        assert self.release_load.wait(10)


async def health_of(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


@pytest.mark.parametrize("inline", [False, True])
def test_health_is_not_serving_during_load_and_calls_are_refused_until_it_ends(inline):
    async def body():
        drafter = SlowLoad()
        drafter.runs_inline = inline  # load() runs on the worker either way, so health answers meanwhile
        async with serving(drafter, wait_loaded=False) as c:
            for service in ("", SERVICE):
                assert await health_of(c.channel, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            details = await expect_error(c.prepare("v", seq("r", 0, [1])), grpc.StatusCode.UNAVAILABLE)
            assert "still loading" in details
            drafter.release_load.set()
            await c.running.wait_loaded()
            for service in ("", SERVICE):
                assert await health_of(c.channel, service) == health_pb2.HealthCheckResponse.SERVING
            await still_serving(c)

    asyncio.run(body())


class ThreadRecording(RecordingDrafter):
    """Records which thread ran each of its hooks."""

    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.runs_inline = inline
        self.threads: dict[str, set[str]] = {}

    def _ran(self, hook: str) -> None:
        self.threads.setdefault(hook, set()).add(threading.current_thread().name)

    def load(self) -> None:
        self._ran("load")

    def prepare_draft_tokens(self, requests):
        self._ran("prepare_draft_tokens")
        return super().prepare_draft_tokens(requests)

    def on_release(self, key, reason) -> None:
        self._ran(f"on_release {reason.name}")


@pytest.mark.parametrize("inline", [False, True])
def test_drafter_code_runs_on_the_event_loop_when_it_runs_inline_else_on_the_worker_thread(inline):
    drafter = ThreadRecording(inline)

    async def body() -> str:
        async with serving(drafter, idle_timeout_s=1.0) as c:
            await still_serving(c)  # its sequence is left idle, then evicted
            await c.prepare("v", seq("r", 0, [1, 2]))
            await c.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["r"]))
            await until(lambda: "on_release EVICTED" in drafter.threads)
        return threading.current_thread().name

    loop_thread = asyncio.run(body())
    (worker,) = drafter.threads.pop("load")
    assert worker.startswith("drafter"), worker
    expected = loop_thread if inline else worker
    assert drafter.threads == {hook: {expected} for hook in
                               ("prepare_draft_tokens", "on_release UNSPECIFIED", "on_release EVICTED")}


def test_a_failing_load_stops_the_server():
    class Unloadable(RecordingDrafter):
        def load(self) -> None:
            raise OSError("weights not found")

    async def body():
        running = await start_server(Unloadable(), host="127.0.0.1")
        with pytest.raises(OSError, match="weights not found"):
            await running.wait_loaded()
        await asyncio.wait_for(running.wait_for_termination(), 5)

    asyncio.run(body())


def test_reflection_lists_the_services():
    async def body():
        async with serving(RecordingDrafter()) as c:
            stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            responses = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        names = {s.name for s in responses[0].list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names

    asyncio.run(body())


def test_stop_refuses_new_calls_and_reports_not_serving():
    async def body():
        async with serving(RecordingDrafter()) as c:
            await c.running.stop(0)
            await expect_error(c.prepare("v", seq("r", 0, [1])), grpc.StatusCode.UNAVAILABLE)
            await c.running.wait_for_termination()

    asyncio.run(body())


def test_in_process_servicer_runs_the_same_protocol_without_grpc():
    servicer = DrafterServicer(NgramDrafter(max_draft_len=3, max_matching_ngram_size=2))
    request = pb.PrepareDraftTokensRequest(verifier_id="v", sequences=[seq("r", 0, [1, 2, 3, 1], draft_len=2)])
    with pytest.raises(DrafterError) as info:
        servicer.prepare(request)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE  # load() not called yet
    servicer.load()
    assert list(servicer.prepare(request).results[0].draft_tokens) == [2, 3]
    with pytest.raises(DrafterError) as info:
        servicer.prepare(pb.PrepareDraftTokensRequest(sequences=[seq("r", 0, [1])]))
    assert info.value.code == INVALID
    assert servicer.release(pb.ReleaseRequestsRequest(verifier_id="v", request_ids=["r"])).released == 1
    assert servicer.info().name == "ngram"


def test_connections_close_after_max_connection_age_and_clients_reconnect():
    """gRPC clients re-resolve DNS only when a connection closes: the server ends each
    connection (GOAWAY) after max_connection_age_s, and the next call reconnects."""
    async def body():
        async with serving(RecordingDrafter(), max_connection_age_s=0.2) as c:
            await still_serving(c)
            assert c.channel.get_state() is grpc.ChannelConnectivity.READY
            await asyncio.wait_for(c.channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 30)
            await still_serving(c)

    asyncio.run(body())


def test_max_connection_age_flag():
    from drafter_sdk.server.cli import build_parser

    assert build_parser().parse_args(["ngram"]).max_connection_age_s == 300
    assert build_parser().parse_args(["ngram", "--max-connection-age-s", "0"]).max_connection_age_s == 0


@pytest.mark.parametrize("flag, what", [("--port", "gRPC"), ("--metrics-port", "metrics")])
def test_splitspec_drafter_on_a_taken_port_says_so_in_one_line(flag, what, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", flag: str(port)}
        with pytest.raises(SystemExit) as exited:
            cli.main(["ngram", "--host", "127.0.0.1", *(x for item in ports.items() for x in item)])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.splitlines()[-1].startswith(f"splitspec-drafter: cannot listen on 127.0.0.1:{port} ({what})"), err
    assert "Traceback" not in err


def test_splitspec_drafter_given_one_port_for_grpc_and_metrics_names_both(capsys):
    with pytest.raises(SystemExit) as exited:  # before anything binds: gRPC's own error would say only "taken"
        cli.main(["ngram", "--host", "127.0.0.1", "--port", "50999", "--metrics-port", "50999"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.splitlines()[-1] == ("splitspec-drafter: the metrics port and the gRPC port are both 50999: "
                                    "give each its own"), err
