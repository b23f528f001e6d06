"""All of a verifier's torch work runs on its one model thread (see builder.build_runtime)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import shared_model

from verifier_service import builder
from verifier_service.model.runner import ModelRunner


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
