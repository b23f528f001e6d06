"""Tensor parallelism on CPU: two gloo ranks serve the tiny Llama (4 heads, 2 KV heads), saved to disk.

Each sharded verifier costs two processes that import torch and transformers, so the module
starts four: one under torchrun (exactness against an unsharded verifier, plain, with a
remote n-gram drafter and sampled), one scheduling by priority (requests preempted and resumed
across both ranks), and two started by `--tensor-parallel-size 2` itself, whose follower rank is
killed or frozen. Refusals are checked in-process, before any rank starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_model import tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM
from verifier_harness import reference_greedy, run_verifier, spec_config
from verifier_support import LOOPING_SEEDS, repetitive_prompt, serve_drafter

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.api import cli
from verifier_service.tools.local_services import LocalService, free_port, script

pytestmark = pytest.mark.timeout(600)
WAIT_S = 120.0  # bound on any wait (never a timing assertion: the machine is shared)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
COMMON = ["--max-model-len", "256", "--kv-cache-memory-gb", "0.05", "--max-num-seqs", "8", "--log-level", "INFO",
          "--http-port", "off"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tp")
    model = tiny_model()
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _requests() -> list[verifier_pb2.GenerationParams]:
    """Mixed: prompts whose greedy continuation loops (drafts get accepted) and plain ones, with and
    without speculation, greedy and seeded sampling, of different lengths."""
    params = []
    for i, seed in enumerate(LOOPING_SEEDS[:8]):
        p = verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=repetitive_prompt(seed)),
                                          stopping=verifier_pb2.StoppingCriteria(max_new_tokens=24 + 4 * i))
        p.speculation.disable = i % 4 == 3
        params.append(p)
    for i in range(6):
        p = verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=[7 + i, 40 + 3 * i, 9, 100 + i]),
                                          stopping=verifier_pb2.StoppingCriteria(max_new_tokens=20))
        p.sampling.temperature, p.sampling.top_p, p.sampling.seed = 0.9, 0.95, 1000 + i
        p.speculation.disable = i == 5
        params.append(p)
    return params


async def _generate_all(address: str) -> tuple[list[verifier_pb2.GenerationOutput], int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        replies = await asyncio.gather(*(stub.Generate(verifier_pb2.GenerateRequest(params=p), timeout=WAIT_S)
                                         for p in _requests()))
        info = await stub.GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=WAIT_S)
    return [r.output for r in replies], info.tensor_parallel_size


def test_two_ranks_under_torchrun_generate_what_one_does(model_dir: Path) -> None:
    async def main() -> None:
        async with serve_drafter(NgramDrafter(max_draft_len=4)) as drafter:
            target = f"127.0.0.1:{drafter.port}"
            sharded = LocalService(
                [script("torchrun"), "--standalone", "--nproc-per-node", "2", script("splitspec-verifier"),
                 "--model", str(model_dir), "--tensor-parallel-size", "2", "--speculative-mode", "user_provided",
                 "--drafter-target", target, "--max-draft-len", "4", *COMMON],
                name="verifier-tp2", env=CHILD_ENV, startup_timeout_s=WAIT_S)
            await asyncio.to_thread(sharded.start)  # the drafter answers meanwhile, on this loop
            try:
                tp2, tp2_size = await _generate_all(sharded.address)
            finally:
                await asyncio.to_thread(sharded.stop)
            whole = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            async with run_verifier(spec_config("USER_PROVIDED", 4, drafter_target=target), model=whole,
                                    max_num_seqs=8) as v:
                tp1, tp1_size = await _generate_all(v.address)
        assert (tp2_size, tp1_size) == (2, 1)
        for params, a, b in zip(_requests(), tp2, tp1):
            assert list(a.token_ids) == list(b.token_ids), params
        # The greedy ones are transformers' own greedy decoding, and the drafter's tokens were used.
        for params, out in zip(_requests()[:8], tp2):
            assert list(out.token_ids) == reference_greedy(whole, list(params.token_ids.ids), len(out.token_ids))
        assert sum(out.stats.num_accepted_tokens for out in tp2) > 0
        assert all(out.stats.num_drafts == 0 for params, out in zip(_requests(), tp2) if params.speculation.disable)

    asyncio.run(main())


def test_requests_preempted_for_a_higher_priority_resume_exactly_on_two_ranks(model_dir: Path) -> None:
    """Two long streams hold both slots; two requests that come first preempt them. The followers replay
    the leader's recompute like any prefill: every answer is the unsharded verifier's."""
    low = [verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=repetitive_prompt(seed)), priority=1,
                                         stopping=verifier_pb2.StoppingCriteria(max_new_tokens=160, ignore_eos=True))
           for seed in LOOPING_SEEDS[:2]]
    high = [verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=repetitive_prompt(seed)),
                                          stopping=verifier_pb2.StoppingCriteria(max_new_tokens=16))
            for seed in LOOPING_SEEDS[2:4]]
    metrics_port = free_port()
    verifier = LocalService([script("splitspec-verifier"), "--model", str(model_dir), "--tensor-parallel-size", "2",
                             "--speculative-mode", "ngram", "--max-draft-len", "4", *COMMON, "--max-num-seqs", "2",
                             "--scheduling-policy", "priority", "--metrics-port", str(metrics_port)],
                            name="verifier-tp-priority", env=CHILD_ENV, startup_timeout_s=WAIT_S)

    async def generate(stub, p: verifier_pb2.GenerationParams, started: set[int], i: int  # noqa: ANN001
                       ) -> list[int]:
        tokens: list[int] = []
        async for reply in stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=p), timeout=WAIT_S):
            started.add(i)
            tokens += reply.output.token_ids
        return tokens

    async def sharded() -> list[list[int]]:
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            started: set[int] = set()
            calls = [asyncio.ensure_future(generate(stub, p, started, i)) for i, p in enumerate(low)]
            deadline = time.monotonic() + WAIT_S
            while len(started) < 2 and not any(c.done() for c in calls) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(started) == 2, "both long streams were producing tokens"
            calls += [asyncio.ensure_future(generate(stub, p, started, 2 + i)) for i, p in enumerate(high)]
            return list(await asyncio.gather(*calls))

    async def unsharded() -> list[list[int]]:
        whole = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        async with run_verifier(spec_config("NGRAM", 4), model=whole) as v:
            replies = await asyncio.gather(*(v.stub.Generate(verifier_pb2.GenerateRequest(
                params=verifier_pb2.GenerationParams(token_ids=p.token_ids, stopping=p.stopping)), timeout=WAIT_S)
                for p in low + high))
        return [list(r.output.token_ids) for r in replies]

    with _stopped_at_end(verifier.start()):
        got = asyncio.run(sharded())
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S) as response:
            metrics = response.read().decode()
    preemptions = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("splitspec:num_preemptions_total "))
    assert preemptions >= 1, "the requests that came first found both slots taken"
    assert got == asyncio.run(unsharded())
    # Each rank froze its start-up heap once its shard had loaded (drafter_sdk/service/start_up_heap.py).
    log = verifier.current_log.read_text(errors="replace")
    assert log.count("start-up heap frozen: ") == 2, log[-4000:]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_lost_rank_fails_requests_unavailable_and_exits(model_dir: Path, fault: str) -> None:
    """SIGKILL (a crash) or SIGSTOP (a hang, found by --rank-timeout-s) of rank 1 in mid-generation:
    every request in flight gets UNAVAILABLE, health turns NOT_SERVING, rank 0 exits non-zero
    and takes rank 1 with it; nothing hangs (the waits are bounded)."""
    verifier = LocalService([script("splitspec-verifier"), "--model", str(model_dir), "--tensor-parallel-size", "2",
                             "--rank-timeout-s", "2", *COMMON], name=f"verifier-{fault}", env=CHILD_ENV,
                            startup_timeout_s=WAIT_S)
    with _stopped_at_end(verifier.start()):
        (follower,) = _children(verifier.process.pid)
        statuses: list[str] = []

        async def main() -> list[grpc.StatusCode]:
            async with grpc.aio.insecure_channel(verifier.address) as channel:
                stub = verifier_pb2_grpc.VerifierServiceStub(channel)
                health = health_pb2_grpc.HealthStub(channel)

                async def watch() -> None:
                    async for reply in health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S):
                        statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

                async def stream(i: int) -> grpc.StatusCode:
                    request = verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
                        token_ids=verifier_pb2.TokenIds(ids=[5 + i, 6, 7]),
                        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=240, ignore_eos=True)))
                    try:
                        async for _ in stub.GenerateStream(request, timeout=WAIT_S):
                            started.add(i)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

                started: set[int] = set()
                watching = asyncio.ensure_future(watch())
                calls = [asyncio.ensure_future(stream(i)) for i in range(3)]
                deadline = time.monotonic() + WAIT_S
                while len(started) < 3 and not any(c.done() for c in calls) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(started) == 3, "every stream was producing tokens before the fault"
                os.kill(follower, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
                codes = await asyncio.gather(*calls)
                await asyncio.gather(watching, return_exceptions=True)
                return codes

        faulted = time.monotonic()
        codes = asyncio.run(main())
        code = verifier.process.wait(WAIT_S)
        print(f"rank 1 {fault}: rank 0 exited with {code} {time.monotonic() - faulted:.1f} s later")
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
        assert statuses[0] == "SERVING" and "NOT_SERVING" in statuses
        assert code != 0
        assert _gone(follower), "rank 0 ends the rank it started"
        # The whole log: the engine thread's traceback of the failed step may be written after this line.
        assert "exiting with status 1" in verifier.current_log.read_text(errors="replace")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited and awaits its parent's wait(): gone as a process.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


class _stopped_at_end:
    """Whatever the test found, no rank outlives it."""

    def __init__(self, service: LocalService) -> None:
        self.service = service

    def __enter__(self) -> LocalService:
        return self.service

    def __exit__(self, *exc: object) -> None:
        process = self.service.process
        children = _children(process.pid) if process.poll() is None else []
        self.service.stop(timeout_s=10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["--port", "0", *argv]) == 2
    return capsys.readouterr().err


def test_smollm2_cannot_be_split_two_ways(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(capsys, "--tensor-parallel-size", "2")
    assert "cannot split SmolLM2-135M-Instruct 2 ways: it has 9 attention heads and 3 KV heads" in err


def test_refusals_name_the_counts(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert "it has 4 attention heads and 2 KV heads, and --tensor-parallel-size 3 must divide both" in _refusal(
        capsys, "--model", str(model_dir), "--tensor-parallel-size", "3")
    assert "--tensor-parallel-size 2 needs 2 GPUs, one per rank; 0 visible" in _refusal(
        capsys, "--model", str(model_dir), "--tensor-parallel-size", "2", "--device", "cuda")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "started as one of 4 ranks (WORLD_SIZE=4), but --tensor-parallel-size is 2" in _refusal(
        capsys, "--model", str(model_dir), "--tensor-parallel-size", "2")
