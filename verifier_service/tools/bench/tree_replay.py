"""Offline replay of n-gram chains and trees against recorded greedy outputs: the fast loop for tuning
tree construction.

Under greedy decoding the path a verifier accepts is fixed by the target's own output, so replaying
drafts against a recorded output gives each draft's exact tokens per step without running the model:
the accepted path plus the target's token after it. `record` decodes a few prompts per workload once
(transformers, greedy) into a JSON file; `replay` then compares a chain and a tree drafter on it in
seconds, and prints the tokens verified per step the forward cost depends on.

    python -m verifier_service.tools.bench.tree_replay record outputs.json --prompts 8
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --nodes 16
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafter_sdk.drafter import TOKEN_TYPECODE
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.tree import ROOT, accepted_path


@dataclass
class Replay:
    workload: str
    tokens_per_step: float  # emitted tokens after the first / steps, as `splitspec bench --trees` counts
    verified_per_step: float  # draft tokens (nodes) verified per step
    draft_ms: float  # the drafter's mean time per step


def replay(records: list[dict], drafter: Callable[[], NgramDrafter], depth: int, nodes: int) -> list[Replay]:
    """Each record: {"workload", "prompt", "output"} (token ids). `nodes` 0 replays chains."""
    totals: dict[str, list[float]] = {}
    for i, record in enumerate(records):
        d, out = drafter(), record["output"]
        history = array(TOKEN_TYPECODE, record["prompt"] + out[:1])
        pos, steps, verified, seconds = 1, 0, 0, 0.0
        while pos < len(out):
            started = time.perf_counter()
            if nodes:
                tree = d.draft_tree(("replay", str(i)), history, depth, nodes)
                tokens, parents = list(tree.tokens), list(tree.parents)
            else:
                tokens = d.draft(("replay", str(i)), history, depth)
                parents = list(range(ROOT, len(tokens) - 1))
            seconds += time.perf_counter() - started
            emitted = min(len(accepted_path(tokens, parents, out[pos:pos + depth])) + 1, len(out) - pos)
            history.extend(out[pos:pos + emitted])
            pos, steps, verified = pos + emitted, steps + 1, verified + len(tokens)
        total = totals.setdefault(record["workload"], [0.0, 0.0, 0.0, 0.0])
        for k, v in enumerate((len(out) - 1, steps, verified, seconds)):
            total[k] += v
    return [Replay(w, emitted / steps, verified / steps, seconds / steps * 1e3)
            for w, (emitted, steps, verified, seconds) in totals.items() if steps]


def record(path: Path, workload_names: list[str], count: int, max_new_tokens: int) -> None:
    """Greedy outputs of the embedded model (transformers) for `count` prompts per workload."""
    import torch

    from verifier_service.model import loader
    from verifier_service.tools.bench import workloads

    source = loader.resolve_source(None)
    model, tokenizer = loader.load(source, torch.float32, torch.device("cpu"))
    out = []
    for prompt in workloads.build(workload_names, count, tokenizer):
        ids = torch.tensor([prompt.token_ids])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False)
        out.append({"workload": prompt.workload, "name": prompt.name, "prompt": prompt.token_ids,
                    "output": generated[0, ids.shape[1]:].tolist()})
        print(prompt.workload, prompt.name, len(out[-1]["output"]), flush=True)
    path.write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("file", type=Path)
    r.add_argument("--workloads", default="grounded,code,open")
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=128)
    q = sub.add_parser("replay")
    q.add_argument("file", type=Path)
    q.add_argument("--nodes", type=int, default=16, help="tree budget, and the chain's length")
    args = p.parse_args()
    if args.command == "record":
        record(args.file, args.workloads.split(","), args.prompts, args.max_new_tokens)
        return
    records = json.loads(args.file.read_text())
    n = args.nodes
    chains = replay(records, lambda: NgramDrafter(max_draft_len=n), n, 0)
    trees = replay(records, lambda: NgramDrafter(max_draft_len=n), n, n)
    print(f"{'workload':<10} {'chain t/step':>12} {'tree t/step':>11} {'vs chain':>8} {'verified':>13} "
          f"{'draft ms':>11}")
    for c, t in zip(chains, trees):
        print(f"{c.workload:<10} {c.tokens_per_step:>12.3f} {t.tokens_per_step:>11.3f} "
              f"{t.tokens_per_step / c.tokens_per_step:>7.3f}x {c.verified_per_step:>5.1f} / "
              f"{t.verified_per_step:<5.1f} {c.draft_ms:>4.2f} / {t.draft_ms:<4.2f}")


if __name__ == "__main__":
    main()
