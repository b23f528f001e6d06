"""Offline replay of n-gram chains and trees against recorded greedy outputs: the fast loop for tuning
tree construction.

Under greedy decoding the path a verifier accepts is fixed by the target's own output, so replaying
drafts against a recorded output gives each draft's exact tokens per step without running the model:
the accepted path plus the target's token after it. `record` decodes a few prompts per workload once
(transformers, greedy) into a JSON file; `replay` then compares a chain and a tree drafter on it in
seconds, and prints the tokens verified per step the forward cost depends on.

    python -m verifier_service.tools.bench.tree_replay record outputs.json --prompts 8
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --nodes 16
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --min-node-prob 0,0.05 \
        --costs 1:30,9:43,17:55
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
from verifier_service.model.step_costs import CostCurve


@dataclass
class Replay:
    workload: str
    tokens_per_step: float  # emitted tokens after the first / steps, as `splitspec bench --trees` counts
    verified_per_step: float  # draft tokens (nodes) verified per step
    draft_ms: float  # the drafter's mean time per step
    modelled_tok_s: float  # emitted tokens / the cost curve's time of every step's forward (0 without one)


def replay(records: list[dict], drafter: Callable[[], NgramDrafter], depth: int, nodes: int,
           costs: CostCurve | None = None, one_token_ms: float = 1.0) -> list[Replay]:
    """Each record: {"workload", "prompt", "output"} (token ids). `nodes` 0 replays chains. With a
    cost curve, each step's forward (1 + verified tokens) is charged to a modelled tokens/s."""
    totals: dict[str, list[float]] = {}
    forward_ms: dict[str, float] = {}
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
            if costs is not None:
                forward_ms[record["workload"]] = (forward_ms.get(record["workload"], 0.0)
                                                  + one_token_ms * costs(1 + len(tokens)))
        total = totals.setdefault(record["workload"], [0.0, 0.0, 0.0, 0.0])
        for k, v in enumerate((len(out) - 1, steps, verified, seconds)):
            total[k] += v
    return [Replay(w, emitted / steps, verified / steps, seconds / steps * 1e3,
                   emitted / forward_ms[w] * 1e3 if w in forward_ms else 0.0)
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
    q.add_argument("--min-node-prob", default="0",
                   help="comma-separated tree_min_prob values: one tree row each (0: fill the budget)")
    q.add_argument("--costs", help="forward cost by tokens in one forward, as 'tokens:ms,...' (the verifier logs its "
                                   "curve at start-up): adds a modelled tokens/s column")
    args = p.parse_args()
    if args.command == "record":
        record(args.file, args.workloads.split(","), args.prompts, args.max_new_tokens)
        return
    records = json.loads(args.file.read_text())
    n = args.nodes
    ms = {int(t): float(c) for t, c in (point.split(":") for point in args.costs.split(","))} if args.costs else {}
    costs = CostCurve.from_seconds(ms) if ms else None
    one_token_ms = ms[min(ms)] if ms else 1.0
    rows = {"chain": replay(records, lambda: NgramDrafter(max_draft_len=n), n, 0, costs, one_token_ms)}
    for floor in (float(f) for f in args.min_node_prob.split(",")):
        rows[f"tree p>={floor:g}"] = replay(records, lambda: NgramDrafter(max_draft_len=n, tree_min_prob=floor), n, n,
                                            costs, one_token_ms)
    print(f"{'workload':<10} {'drafts':<14} {'tokens/step':>11} {'vs chain':>8} {'verified':>8} {'draft ms':>8}"
          + (f" {'model tok/s':>11} {'vs chain':>8}" if costs else ""))
    for i, chain in enumerate(rows["chain"]):
        for name, replays in rows.items():
            r = replays[i]
            print(f"{r.workload:<10} {name:<14} {r.tokens_per_step:>11.3f} "
                  f"{r.tokens_per_step / chain.tokens_per_step:>7.3f}x {r.verified_per_step:>8.1f} {r.draft_ms:>8.2f}"
                  + (f" {r.modelled_tok_s:>11.1f} {r.modelled_tok_s / chain.modelled_tok_s:>7.3f}x" if costs else ""))


if __name__ == "__main__":
    main()
