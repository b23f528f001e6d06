"""Offline replay of n-gram chains and trees (or the suffix drafter's chains) against recorded greedy
outputs: the fast loop for tuning tree construction and drafting rules.

Under greedy decoding the path a verifier accepts is fixed by the target's own output, so replaying
drafts against a recorded output gives each draft's exact tokens per step without running the model:
the accepted path plus the target's token after it. `record` decodes a few prompts per workload once
(transformers, greedy) into a JSON file; `replay` then compares a chain and a tree drafter on it in
seconds, and prints the tokens verified per step the forward cost depends on.

    python -m verifier_service.tools.bench.tree_replay record outputs.json --prompts 8
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --nodes 16
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --min-node-prob 0,0.05 \
        --costs 1:30,9:43,17:55 --planner --select 0,1
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --drafter suffix --nodes 8 \
        --costs 1:35.8,9:60.1,17:73.7 --planner
    python -m verifier_service.tools.bench.tree_replay replay outputs.json --nodes 8 \
        --costs 1:35.8,9:60.1,17:73.7 --planner --lookahead

`--lookahead` asks chain drafters for 2k + 1 tokens where k are verified, as a verifier does of a
drafter that looks ahead (spec_decode/lookahead.py), and reports the share of drafting steps whose drafts
the rest of the last answer covers: the steps whose call could overlap the forward.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafter_sdk.drafter import TOKEN_TYPECODE, Drafter, DraftRequest, ReleaseReason, SamplingHints
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.tree import ROOT, DraftTree, accepted_path, depths
from verifier_service.model.step_costs import CostCurve
from verifier_service.spec_decode.lookahead import Lookahead
from verifier_service.spec_decode.lookahead import ask as lookahead_ask
from verifier_service.spec_decode.lookahead import covers as lookahead_covers
from verifier_service.spec_decode.planner import DraftPlanner
from verifier_service.spec_decode.policy import SpecState, SpeculationPolicy


@dataclass
class Replay:
    workload: str
    tokens_per_step: float  # emitted tokens after the first / steps, as `splitspec bench --trees` counts
    verified_per_step: float  # draft tokens (nodes) verified per step
    draft_ms: float  # the drafter's mean time per step
    modelled_tok_s: float  # emitted tokens / the cost curve's time of every step's forward (0 without one)
    # ... / (that time + the drafter's measured time here): where a forward takes a few milliseconds (a GPU),
    # the drafter's Python time is a share of the step
    modelled_with_draft_tok_s: float
    lookahead: float = 0.0  # with `lookahead`, of a chain's drafting steps: those the last answer's rest covers


def replay(records: list[dict], drafter: Callable[[], Drafter], depth: int, nodes: int,
           costs: CostCurve | None = None, one_token_ms: float = 1.0, planner: bool = False,
           learn: bool = False, lookahead: bool = False) -> list[Replay]:
    """Each record: {"workload", "prompt", "output"} (token ids). `nodes` 0 replays chains. With a
    cost curve, each step's forward (1 + verified tokens) is charged to a modelled tokens/s; with
    `planner` as well, the verifier's policy sizes every step's draft (chain length, and tree nodes
    up to `nodes`) from that curve and what it has seen accepted, as the verifier does. `learn`: one
    drafter replays every record in order, each released FINISHED (the suffix drafter learns it);
    otherwise each record gets a drafter of its own. `lookahead` (chains): ask for 2k + 1, and where the
    rest of the last answer covers a step, verify that (as the verifier does), counting those steps."""
    totals: dict[str, list[float]] = {}
    covers: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # drafting steps, covered ones
    forward_ms: dict[str, float] = {}
    shared = drafter() if learn else None
    for i, record in enumerate(records):
        d, out = shared if shared is not None else drafter(), record["output"]
        key = ("replay", str(i))
        policy = SpeculationPolicy(depth, planner=DraftPlanner(costs), max_draft_nodes=nodes) if planner else None
        state = SpecState()
        history = array(TOKEN_TYPECODE, record["prompt"] + out[:1])
        pos, steps, verified, seconds = 1, 0, 0, 0.0
        kept: Lookahead | None = None
        while pos < len(out):
            k, ask, m = depth, depth, nodes
            if policy is not None:
                sizes = policy.plan([state], [len(out) - pos])
                (k,), (ask,) = sizes.lengths, sizes.asks
                (m,) = policy.plan_nodes([state], [k]) if nodes else (0,)
            rest: list[int] | None = None  # what is left of the last answer, where it covers this step
            if lookahead and ask and not m:
                left = kept.remaining(out[:pos]) if kept is not None else []
                rest = left if lookahead_covers([left], [k], [ask]) else None
                if k:
                    covers[record["workload"]][0] += 1
                    covers[record["workload"]][1] += rest is not None
                ask = max(ask, lookahead_ask(k, len(out) - pos))
            started = time.perf_counter()
            [draft] = d.prepare_draft_tokens([DraftRequest(*key, history, len(record["prompt"]), ask, 0, 0,
                                                           SamplingHints(), max_draft_nodes=m)])
            seconds += time.perf_counter() - started
            tokens, parents = (list(draft.tokens), list(draft.parents)) if isinstance(draft, DraftTree) else (
                list(draft), [])
            kept = Lookahead(pos, tokens) if tokens and not parents else None
            # A covered step verifies (or scores, as a shadow) the rest, as the verifier does; the answer
            # is kept for the next step.
            chosen = rest if rest is not None else tokens
            shadow = chosen if not k else []
            tokens = tokens if parents else chosen[:k]
            chain = list(range(ROOT, len(tokens) - 1))
            emitted = min(len(accepted_path(tokens, parents or chain, out[pos:pos + depth])) + 1, len(out) - pos)
            new_tokens = out[pos:pos + emitted]
            if policy is not None:
                policy.observe(state, max(depths(parents), default=0) if parents else len(tokens), emitted - 1)
                policy.observe_tree(state, tokens, parents, new_tokens)
                policy.observe_shadow(state, shadow, new_tokens[0])
            history.extend(new_tokens)
            pos, steps, verified = pos + emitted, steps + 1, verified + len(tokens)
            if costs is not None:
                forward_ms[record["workload"]] = (forward_ms.get(record["workload"], 0.0)
                                                  + one_token_ms * costs(1 + len(tokens)))
        if learn:  # the verifier's last sync, then the release a learning drafter takes the output from
            d.prepare_draft_tokens([DraftRequest(*key, history, len(record["prompt"]), 0, 0, 0, SamplingHints())])
            d.on_release(key, ReleaseReason.FINISHED)
        total = totals.setdefault(record["workload"], [0.0, 0.0, 0.0, 0.0])
        for k, v in enumerate((len(out) - 1, steps, verified, seconds)):
            total[k] += v
    return [Replay(w, emitted / steps, verified / steps, seconds / steps * 1e3,
                   emitted / forward_ms[w] * 1e3 if w in forward_ms else 0.0,
                   emitted / (forward_ms[w] + seconds * 1e3) * 1e3 if w in forward_ms else 0.0,
                   covers[w][1] / max(covers[w][0], 1))
            for w, (emitted, steps, verified, seconds) in totals.items() if steps]


def record(path: Path, workload_names: list[str], count: int, max_new_tokens: int) -> None:
    """Greedy outputs of the embedded model (transformers) for `count` prompts per workload."""
    import torch

    from verifier_service.model import loader
    from verifier_service.tools.bench import workloads

    source = loader.resolve_source(None)
    model, tokenizer = loader.load(source, torch.float32, torch.device("cpu"))
    out: list[dict] = []
    answers: dict[str, list[int]] = {}  # by prompt name: what a follow-up turn sends back
    for prompt in workloads.build(workload_names, count, tokenizer):
        token_ids = (prompt.render(tokenizer.decode(answers[prompt.follows], skip_special_tokens=True), tokenizer)
                     if prompt.follows else prompt.token_ids)
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False)
        answers[prompt.name] = generated[0, ids.shape[1]:].tolist()
        out.append({"workload": prompt.workload, "name": prompt.name, "prompt": token_ids,
                    "output": answers[prompt.name]})
        print(prompt.workload, prompt.name, len(out[-1]["output"]), flush=True)
        path.write_text(json.dumps(out))  # as it goes: a long recording interrupted keeps what it has


def _selected(records: list[dict], select: str | None) -> list[dict]:
    """The records whose index within their workload is in `select` ("0,1"; None: all), to keep prompts
    tuned on apart from prompts checked on."""
    if not select:
        return records
    wanted, seen, out = {int(i) for i in select.split(",")}, {}, []
    for r in records:
        index = seen[r["workload"]] = seen.get(r["workload"], -1) + 1
        if index in wanted:
            out.append(r)
    return out


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
    q.add_argument("--planner", action="store_true",
                   help="with --costs: also the chain and the trees as the verifier's planner sizes them")
    q.add_argument("--select", help="only the records whose index within their workload is listed, e.g. 0,1")
    q.add_argument("--lookahead", action="store_true",
                   help="chains ask for 2k + 1 tokens where k are verified: adds the share of drafting steps the "
                        "rest of the last answer covers (their call could overlap the forward)")
    q.add_argument("--drafter", choices=["ngram", "suffix"], default="ngram",
                   help="suffix: instead of trees, the suffix drafter's chains against the n-gram chain, its choice "
                        "between its trees learned, by the longer match alone (unlearned) and by vLLM's higher "
                        "score (one drafter learns every record in order)")
    args = p.parse_args()
    if args.command == "record":
        record(args.file, args.workloads.split(","), args.prompts, args.max_new_tokens)
        return
    records = _selected(json.loads(args.file.read_text()), args.select)
    n = args.nodes
    ms = {int(t): float(c) for t, c in (point.split(":") for point in args.costs.split(","))} if args.costs else {}
    costs = CostCurve.from_seconds(ms) if ms else None
    if args.planner and costs is None:
        p.error("--planner needs --costs")
    one_token_ms = ms[min(ms)] if ms else 1.0
    # (row, drafter, tree nodes, one drafter learning every record): the chain the others are read against first
    # With --lookahead the chain drafter proposes up to 2n + 1 tokens (its first n are the same), as
    # `splitspec-drafter ngram` does by default.
    chain = functools.partial(NgramDrafter, max_draft_len=2 * n + 1 if args.lookahead else n)
    systems: list[tuple[str, Callable[[], Drafter], int, bool]] = [("chain", chain, 0, False)]
    if args.drafter == "suffix":
        systems += [("suffix", SuffixDrafter, 0, True),
                    ("suffix unlearned", lambda: SuffixDrafter(learn_choice=False), 0, True),
                    ("suffix score", lambda: SuffixDrafter(prefer_longer_match=False), 0, True)]
    else:
        systems += [(f"tree p>={floor:g}", functools.partial(NgramDrafter, max_draft_len=n, tree_min_prob=floor), n,
                     False) for floor in (float(f) for f in args.min_node_prob.split(","))]
    rows = {}
    for planner in (False, True) if args.planner else (False,):
        for name, make, nodes, learn in systems:
            row = f"planner {name}" if planner else name
            rows[row] = replay(records, make, n, nodes, costs, one_token_ms, planner, learn, args.lookahead)
    print(f"{'workload':<10} {'drafts':<20} {'tokens/step':>11} {'vs chain':>8} {'verified':>8} {'draft ms':>8}"
          + (f" {'model tok/s':>11} {'vs chain':>8} {'+draft tok/s':>12} {'vs chain':>8}" if costs else "")
          + (f" {'lookahead':>9}" if args.lookahead else ""))
    for i in range(len(rows["chain"])):
        for name, replays in rows.items():
            r, chain = replays[i], rows["planner chain" if name.startswith("planner") else "chain"][i]
            print(f"{r.workload:<10} {name:<20} {r.tokens_per_step:>11.3f} "
                  f"{r.tokens_per_step / chain.tokens_per_step:>7.3f}x {r.verified_per_step:>8.1f} {r.draft_ms:>8.2f}"
                  + (f" {r.modelled_tok_s:>11.1f} {r.modelled_tok_s / chain.modelled_tok_s:>7.3f}x"
                     f" {r.modelled_with_draft_tok_s:>12.1f}"
                     f" {r.modelled_with_draft_tok_s / chain.modelled_with_draft_tok_s:>7.3f}x" if costs else "")
                  + (f" {r.lookahead:>9.0%}" if args.lookahead else ""))


if __name__ == "__main__":
    main()
