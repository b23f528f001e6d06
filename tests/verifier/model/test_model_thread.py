"""All of a verifier's torch work runs on its one model thread (see builder.build_runtime)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from tiny_gguf import Q, write_tiny_gguf
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import shared_model

from drafter_sdk.loading import causal_lm, gguf_conversion
from verifier_service import builder
from verifier_service.api import server
from verifier_service.model.runner import ModelRunner
from verifier_service.settings import ServerSettings


def test_kv_allocation_probes_and_every_forward_run_on_the_model_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real_forward, real_kv_cache_for = ModelRunner.forward, builder.kv_cache_for

    def forward(self: ModelRunner, batch: object) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return real_forward(self, batch)

    def kv_cache_for(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return real_kv_cache_for(*args)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    monkeypatch.setattr(builder, "kv_cache_for", kv_cache_for)
    model = shared_model()

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4, adaptiveDraftLen=True), model=model) as v:
            reply = await v.stub.Generate(token_request([5, 6, 7, 5, 6, 7, 5], 12))
            assert len(reply.output.token_ids) == 12

    asyncio.run(main())
    assert len(threads) > 10  # the allocation, the start-up probes and the decoding steps
    assert {name.split("_")[0] for name in threads} == {"model"}
    # Stopped: the model is handed back with its own linear layers.
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_gguf_is_converted_on_the_model_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A first start converts a GGUF (torch ops: dequantising, comparing what loads back). Run on another
    thread, that made every forward of the process about 1.5x as slow (SmolLM2, one token: 47.5-49.4 ms
    against 30-32 ms), and the timing cache kept those timings for later starts."""
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, Q.F32)
    threads: dict[str, threading.Thread] = {}

    def recorded(name: str, fn):  # noqa: ANN001, ANN202
        def call(*args: object, **kwargs: object) -> object:
            threads[name] = threading.current_thread()
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(gguf_conversion, "convert", recorded("convert", gguf_conversion.convert))
    monkeypatch.setattr(builder, "make_runner", recorded("runner", builder.make_runner))
    # The config every start checks first (api/cli.check_start) is read from the header, converting nothing.
    assert causal_lm.load_config(causal_lm.resolve_source(str(gguf))).num_hidden_layers == 2
    assert "convert" not in threads
    settings = ServerSettings(model=str(gguf), host="127.0.0.1", port=0, http_port=0, max_model_len=256,
                              kv_cache_memory_gb=0.05, grace_period_s=0.5, max_num_batched_tokens=256)

    async def main() -> None:
        serving = asyncio.ensure_future(server.run(settings))
        while not any(r.getMessage().startswith("serving tiny") for r in caplog.records):
            if serving.done():
                serving.result()  # raises what stopped it
                pytest.fail("the verifier stopped before it served")
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # run's own handler: a graceful stop
        await serving

    with caplog.at_level(logging.INFO, logger="verifier_service.api.server"):
        asyncio.run(main())
    assert threads["convert"] is threads["runner"]
    assert threads["runner"].name.startswith("model")
