"""Batch invariance in bfloat16 on CPU (model/invariant_attention.py): a row gets the same bits
however many rows share its forward, so speculation is exact in bfloat16, not only up to its
precision.

At the runner: plain one-token decoding, a verified chain and a chunked prefill, each beside another
prompt's prefill, give bitwise the same logits, and SDPA (the path everywhere else) does not. Token
trees are not covered: their nodes' keys sit elsewhere (see the module). Through the servers: with an
oracle drafter on a bfloat16 model whose logits lie close together, speculative outputs equal plain
decoding's, with chunked prefill and prefix-cache hits too. Skipped where this machine's bfloat16
products are not row-invariant (the verifier then keeps SDPA).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
from tiny_model import tiny_model
from verifier_harness import run_verifier, spec_config, token_request
from verifier_support import OracleDrafter, engine_of, in_process_drafter

from drafter_sdk.proto import verifier_pb2
from verifier_service.model import invariant_attention
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.linear_layout import Layout
from verifier_service.model.runner import ForwardBatch, ModelRunner

pytestmark = pytest.mark.skipif(not invariant_attention.gemm_is_row_invariant(torch.bfloat16, "cpu"),
                                reason="this CPU's bfloat16 products are not row-invariant")
WAIT_S = 120.0


@functools.cache
def close_logits_model() -> torch.nn.Module:
    """bfloat16, with a narrow init: next-token logits close together, so a last-bit difference in a
    verified row flips the choice often enough to be seen."""
    return tiny_model(seed=3, layers=2, init_std=0.05).to(torch.bfloat16)


@contextlib.contextmanager
def bfloat16_runner(slots: int, capacity: int) -> Iterator[ModelRunner]:
    model = close_logits_model()
    runner = ModelRunner(model, KVCache(KVCacheShape.for_model(model.config, num_slots=slots, capacity=capacity),
                                        torch.bfloat16, torch.device("cpu")))
    try:
        yield runner
    finally:
        runner.close()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n,), generator=g).tolist()


def decode_and_verify(runner: ModelRunner, ids: list[int], steps: int) -> tuple[list[torch.Tensor], dict]:
    """Logits of plain one-token decoding of `steps` tokens after `ids`, and of the same positions
    computed other ways (name -> rows), each in a slot of its own."""
    cache, n = runner.kv_cache, len(ids)
    a, b, c, d = (cache.allocate() for _ in range(4))
    first = runner.forward(ForwardBatch(ids, [a], [0], [n], [n - 1]))
    tokens, plain = [int(first[0].argmax())], [first[0]]
    for i in range(steps - 1):
        logits = runner.forward(ForwardBatch([tokens[-1]], [a], [n + i], [1], [0]))
        plain.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    other: dict[str, list[torch.Tensor]] = {}
    # The prompt in chunks of 7, its last chunk beside another prompt's prefill.
    pos = 0
    while n - pos > 7:
        runner.forward(ForwardBatch(ids[pos:pos + 7], [b], [pos], [7], [6]))
        pos += 7
    rest = ids[pos:]
    other["chunked prefill"] = list(runner.forward(ForwardBatch(rest + ids[:9], [b, d], [pos, 0], [len(rest), 9],
                                                                [len(rest) - 1])))
    # Every decoded token verified as one chain, beside a prefill.
    runner.forward(ForwardBatch(ids, [c], [0], [n], [n - 1]))
    other["verified chain"] = [first[0], *runner.forward(ForwardBatch(
        tokens[:-1] + ids[:5], [c, d], [n, 0], [steps - 1, 5], list(range(steps - 1))))]
    for slot in (a, b, c, d):
        cache.free(slot)
    return plain, other


@pytest.mark.parametrize("length", [30, 57, 61])  # verified rows cross a 64-key block or stay inside one
def test_every_row_gets_the_bits_plain_decoding_gives_it(length: int) -> None:
    with bfloat16_runner(4, 128) as runner:
        assert runner.batch_invariant
        ids = prompt(length, length)
        for layouts in ({1: Layout.PLAIN, 64: Layout.PACKED}, {1: Layout.PACKED, 64: Layout.TRANSPOSED},
                        {1: Layout.TRANSPOSED, 64: Layout.PLAIN}):
            runner.layouts.choose(layouts)
            plain, other = decode_and_verify(runner, ids, 8)
            for name, rows in other.items():
                for i, (want, got) in enumerate(zip(plain, rows)):
                    assert torch.equal(want, got), f"{name}, row {i}, layouts {layouts}"


def test_sdpa_gives_verified_rows_other_bits() -> None:
    """What the invariant path is for: SDPA's kernel for one query and for several round differently."""
    with bfloat16_runner(4, 128) as runner:
        runner.batch_invariant = False
        differ = 0
        for length in (30, 57, 61):
            plain, other = decode_and_verify(runner, prompt(length, length), 8)
            differ += sum(not torch.equal(want, got) for want, got in zip(plain, other["verified chain"]))
        assert differ


def test_a_single_row_is_multiplied_as_two_in_every_layout() -> None:
    with bfloat16_runner(1, 64) as runner:
        layer = runner.model.model.layers[0].mlp.up_proj
        x = torch.randn(1, 5, layer.in_features).to(torch.bfloat16)
        for layout in runner.layouts.available:
            runner.layouts.choose({64: layout})
            assert torch.equal(layer(x[:, 2:3]), layer(x)[:, 2:3]), layout


def test_speculative_bfloat16_outputs_equal_plain_decoding() -> None:
    """A drafter that knows plain decoding's outputs and corrupts 30% of its draft tokens: every step
    verifies draft rows, accepted and rejected. Prompts in 16-token chunks, and every prompt sent
    twice (prefix-cache hits), on the speculative side."""
    model = close_logits_model()
    prompts = [prompt(s, 20 + s) for s in range(16)]

    async def outputs(speculative, oracle=None, **settings) -> list[list[int]]:  # noqa: ANN001
        async with run_verifier(speculative, model=model, **settings) as v:
            if oracle is not None:
                in_process_drafter(engine_of(v), oracle)
            out = []
            for p in prompts + prompts:
                r = await v.stub.Generate(token_request(p, 40), timeout=WAIT_S)
                assert r.output.finish_reason == verifier_pb2.FINISH_REASON_LENGTH
                out.append(list(r.output.token_ids))
            return out

    plain = asyncio.run(outputs(spec_config("NONE")))
    assert plain[:len(prompts)] == plain[len(prompts):]
    oracle = OracleDrafter({tuple(p): out for p, out in zip(prompts, plain)}, corrupt=0.3)
    assert asyncio.run(outputs(spec_config("NGRAM", 6), oracle, max_num_batched_tokens=16)) == plain
    assert oracle.accepted_at and oracle.rejected_at and not oracle.feedback_errors


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, tree: torch.Tensor | None,
           scaling: float | None) -> torch.Tensor:
    blocks = invariant_attention.query_blocks(start, query.shape[1], tree, keys.shape[1], torch.device("cpu"))
    return invariant_attention.attend(query, keys, values, blocks, scaling)


@pytest.mark.parametrize("start,n", [(0, 1), (0, 300), (37, 1), (37, 17), (250, 9), (120, 300)])
def test_attention_equals_sdpa(start: int, n: int) -> None:
    """The same attention as SDPA's (float32 inputs, so that only the arithmetic could differ): causal
    after `start` cached keys, grouped query heads, query blocks for long prompts, and a token tree."""
    g = torch.Generator().manual_seed(start + n)
    heads, kv_heads, dim, capacity = 6, 2, 16, 512
    keys, values = torch.randn(kv_heads, capacity, dim, generator=g), torch.randn(kv_heads, capacity, dim, generator=g)
    query = torch.randn(heads, n, dim, generator=g)
    visible = torch.arange(start + n)[None, :] <= start + torch.arange(n)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        query[None], keys[None, :, :start + n], values[None, :, :start + n], attn_mask=visible, scale=0.3,
        enable_gqa=True)[0]
    assert torch.allclose(attend(query, keys, values, start, None, 0.3), want, atol=1e-5)
    tree = visible & (torch.rand(n, start + n, generator=g) < 0.7)
    tree[torch.arange(n), start + torch.arange(n)] = True  # every node sees itself
    want = torch.nn.functional.scaled_dot_product_attention(
        query[None], keys[None, :, :start + n], values[None, :, :start + n], attn_mask=tree, enable_gqa=True)[0]
    assert torch.allclose(attend(query, keys, values, start, tree, None), want, atol=1e-5)
