"""The draft model's own figures: call latency with and without drafting ahead, hit rate, acceptance.

Replays each prompt's plain-decoding output through the SDK's ModelDrafter behind the same
in-process path the verifier's DRAFT_TARGET uses (DrafterServicer + DrafterClient), step by step
as a verifier would: ask for a draft, accept its longest prefix that matches the target's output
plus the target's next token, then wait as long as the target's verify forward of that many
tokens takes (measured, `forward_cost_s`), which is when drafting ahead does its work. The
drafter's call latency is what the verifier would wait for a draft.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from drafter_sdk.drafters.model import ModelDrafter
from drafter_sdk.proto import drafter_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from verifier_service.spec_decode.drafter_client import DeltaHistory, DrafterClient, DraftQuery, ReleasedRequest
from verifier_service.spec_decode.transport import InProcessTransport
from verifier_service.tools.bench.workloads import Prompt


@dataclass
class DraftModelFigures:
    draft_ahead: bool
    calls: int
    latency_p50_ms: float
    latency_p99_ms: float
    hit_rate: float  # calls answered from what was drafted ahead, without a forward
    acceptance_rate: float  # accepted / drafted tokens against the target's output
    mean_acceptance_length: float  # 1 + accepted per step


def measure(model: str | None, device: str, dtype: str, prompts: list[Prompt], outputs: list[list[int]],
            max_draft_len: int, forward_cost_s: Callable[[int], float], vocab_size: int) -> list[DraftModelFigures]:
    """Both settings, ahead first; `outputs[i]` is plain decoding's output for `prompts[i]`."""
    return [asyncio.run(_replay(ModelDrafter(model, device=device, dtype=dtype, max_draft_len=max_draft_len,
                                             draft_ahead=ahead), prompts, outputs, max_draft_len, forward_cost_s,
                                vocab_size)) for ahead in (True, False)]


async def _replay(drafter: ModelDrafter, prompts: list[Prompt], outputs: list[list[int]], k: int,
                  forward_cost_s: Callable[[int], float], vocab_size: int) -> DraftModelFigures:
    servicer = DrafterServicer(drafter, SequenceStore())
    client = DrafterClient(InProcessTransport(servicer), "bench", vocab_size, deadline_s=float("inf"),
                           overlap_steps=1)
    await client.connect()
    latencies: list[float] = []
    drafted = accepted = steps = 0
    try:
        for n, (prompt, output) in enumerate(zip(prompts, outputs)):
            context, history, done = list(prompt.token_ids), DeltaHistory(), 0
            request_id = f"p{n}"
            while done < len(output):
                # As the verifier does, no draft beyond the tokens still to generate.
                started = time.perf_counter()
                draft = (await client.propose([DraftQuery(request_id, context, len(prompt.token_ids),
                                                          min(k, len(output) - done - 1), history)])).drafts[0]
                latencies.append(time.perf_counter() - started)
                ok = 0
                while ok < len(draft) and done + ok < len(output) and draft[ok] == output[done + ok]:
                    ok += 1
                drafted, accepted, steps = drafted + len(draft), accepted + ok, steps + 1
                new = output[done:done + ok + 1]
                context += new
                done += len(new)
                await asyncio.sleep(forward_cost_s(len(draft) + 1))  # the target verifies meanwhile
            client.release([ReleasedRequest(request_id, drafter_pb2.RELEASE_REASON_FINISHED, context,
                                            len(prompt.token_ids), history)])
    finally:
        await client.close()
    latencies.sort()
    stats = drafter.stats
    return DraftModelFigures(
        draft_ahead=drafter.draft_ahead, calls=len(latencies),
        latency_p50_ms=1000 * statistics.median(latencies),
        latency_p99_ms=1000 * latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        hit_rate=stats.hit_rate, acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_acceptance_length=1 + accepted / steps if steps else 1.0)


def print_table(figures: list[DraftModelFigures], model: str, device: str) -> None:
    print(f"\n== draft model {model} on {device}: the drafter's calls, replaying plain decoding's outputs ==")
    header = (f"{'draft ahead':>11} {'calls':>6} {'p50 ms':>7} {'p99 ms':>7} {'hit rate':>8} {'acc rate':>8} "
              f"{'mean acc len':>12}")
    print(header)
    print("-" * len(header))
    for f in figures:
        print(f"{'on' if f.draft_ahead else 'off':>11} {f.calls:>6} {f.latency_p50_ms:>7.1f} {f.latency_p99_ms:>7.1f} "
              f"{f.hit_rate:>8.2f} {f.acceptance_rate:>8.2f} {f.mean_acceptance_length:>12.2f}")
