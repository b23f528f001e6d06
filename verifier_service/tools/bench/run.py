"""Orchestrates `splitspec bench`: start the services, run every system on every prompt, report."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.server import cli as drafter_cli
from verifier_service.model import loader as model_loader
from verifier_service.model import step_costs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ModelRunner
from verifier_service.settings import DEFAULTS
from verifier_service.spec_decode.config import DEFAULT_DELTA_OVERLAP_STEPS
from verifier_service.spec_decode.drafter_client import DeltaHistory, DrafterClient, DraftQuery
from verifier_service.spec_decode.transport import GrpcTransport
from verifier_service.tools.bench import draft_model, engine_sections, replay, suffix_speed, workloads
from verifier_service.tools.bench import report as rep
from verifier_service.tools.bench import trees as bench_trees
from verifier_service.tools.bench.engine_sections import STARTUP_TIMEOUT_S
from verifier_service.tools.bench.flags import positive_ints
from verifier_service.tools.bench.systems import Run, TransformersSystem, VerifierSystem
from verifier_service.tools.local_services import LocalService, script, start_together

log = logging.getLogger(__name__)
PLAIN = "splitspec plain"
NGRAM_REMOTE = "splitspec ngram remote"
SUFFIX_REMOTE = "splitspec suffix remote"
SUFFIX_LOCAL = "splitspec suffix in-process"


def _service(argv: list[str], name: str) -> LocalService:
    """A drafter or verifier for the bench, given as long to start as the engine sections give theirs: a
    verifier's start-up measures its cost curve, which takes minutes on a busy CPU."""
    return LocalService(argv, name=name, startup_timeout_s=STARTUP_TIMEOUT_S)


def _verifier_through(address: str, flags: list[str], name: str) -> LocalService:
    """A verifier drafting through the drafter serving at `address`, started with `flags`."""
    return _service([script("splitspec-verifier"), "--speculative-mode", "user_provided", "--drafter-target", address,
                     *flags], name=name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                   help=f"comma list of {', '.join(workloads.WORKLOADS)}")
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    p.add_argument("--prompts-for", action="append", default=[], metavar="WORKLOAD=N", type=_workload_count,
                   help="another count for one workload, e.g. --prompts-for templated=40 (repeatable): a drafter "
                        "that learns across requests needs more of them than the others, in the same run")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-draft-len", type=int, default=8)
    p.add_argument("--ngram-size", type=int, default=3, help="max matching n-gram size (ours and transformers')")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and system (median)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers generate() systems")
    p.add_argument("--concurrency", type=positive_ints, default=[],
                   help="also measure serving throughput, e.g. 1,4,16")
    p.add_argument("--speculative-config", help="verifier speculative config file (policy knobs) for every verifier")
    p.add_argument("--verifier-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every verifier, e.g. --verifier-arg=--kv-cache-memory-gb=0.5 (repeatable)")
    p.add_argument("--suffix-variant", action="append", default=[], metavar="FLAGS",
                   help="also bench a suffix drafter started with these `splitspec-drafter suffix` flags, e.g. "
                        "--suffix-variant='--max-spec-factor 2' (repeatable): the system 'splitspec suffix remote "
                        "FLAGS' beside the default one in the same run, compared with both, its own speed timed "
                        "too (--replay: replayed beside it; refused with --trees, --engine-only and "
                        "--draft-model-only, which run no suffix remote system)")
    p.add_argument("--drafter", action="append", default=[], metavar="SPEC",
                   help="also bench your drafter, served by `splitspec-drafter SPEC` (my_drafter.py:MyDrafter, "
                        "a module:Class, or a built-in with its flags, e.g. 'suffix --cache-scope request'; "
                        "repeatable): the system 'drafter SPEC', a verifier drafting through it, beside plain "
                        "decoding and the built-in drafters, every output checked against plain decoding's and "
                        "its time per token compared with the remote n-gram drafter's")
    p.add_argument("--drafter-target", action="append", default=[], metavar="HOST:PORT",
                   help="the same for a drafter already serving at HOST:PORT, in any language (repeatable); "
                        "--drafter and --drafter-target are refused with --replay, --suffix-speed-only, --trees, "
                        "--engine-only and --draft-model-only, which run no verifier through a remote drafter")
    p.add_argument("--suffix-speed-outputs", type=int, default=10_000,
                   help="finished outputs in the global tree when timing the suffix drafter itself (0: skip)")
    p.add_argument("--suffix-speed-only", action="store_true",
                   help="only time the suffix drafter itself (no model, no services; writes suffix_speed.json)")
    p.add_argument("--replay", action="store_true",
                   help="acceptance only, no timing: replay the n-gram and suffix drafters against transformers' "
                        "greedy outputs (plus the suffix drafter's own speed); for machines too busy to time")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda: the verifiers' and transformers' device")
    p.add_argument("--dtype", default="auto", choices=["auto", *model_loader.DTYPES],
                   help="the verifiers' and transformers' dtype (auto: as the verifier's, float32 on cpu, "
                        "bfloat16 on cuda, float16 on a GPU without bfloat16)")
    p.add_argument("--draft-model", metavar="PATH",
                   help="also bench a draft model ('embedded': SmolLM2 drafting for itself): the system "
                        "'splitspec model remote' and the drafter's call latency with and without drafting ahead")
    p.add_argument("--draft-device", default="auto", help="device of the draft model: auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--draft-dtype", default="auto", help="dtype of the draft model (auto: as --dtype auto picks on "
                                                          "--draft-device)")
    p.add_argument("--draft-model-only", action="store_true",
                   help="with --draft-model: only the draft model's own figures (no services; the target's "
                        "outputs come from transformers generate())")
    p.add_argument("--trees", type=int, default=0, metavar="N",
                   help="instead: chains vs token trees at N verified tokens per step, and as the planner "
                        "sizes them (writes trees.json)")
    p.add_argument("--tree-drafter", choices=["ngram", "suffix"], default="ngram",
                   help="--trees: the in-process drafter that drafts the chains and trees")
    p.add_argument("--tree-min-prob", type=float, default=0.1,
                   help="--trees: the floored tree's least node probability (the n-gram drafter's tree_min_prob)")
    p.add_argument("--out", default="bench-results", help="folder for results.json and chart.png")
    engine_sections.add_arguments(p)
    p.set_defaults(func=main)


def _workload_count(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if name not in workloads.WORKLOADS or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give WORKLOAD=N, a workload of {', '.join(workloads.WORKLOADS)} "
                                         "and a count of 1 or more")
    return name, int(count)


def suffix_variants(flag_lines: list[str]) -> dict[str, dict]:
    """SuffixDrafter's keyword arguments for each --suffix-variant, by its flags as given; ValueError for flags
    that are not the suffix drafter's or that it refuses, before anything starts."""
    parser = drafter_cli.build_parser()
    defaults = vars(parser.parse_args(["suffix"]))
    variants = {}
    for line in flag_lines:
        flags = shlex.split(line)
        if not flags:
            raise ValueError("--suffix-variant needs flags: without any it is the default drafter")
        try:
            given = parser.parse_args(["suffix", *flags])
        except SystemExit:  # argparse has printed what was wrong
            raise ValueError(f"--suffix-variant {line!r}: not flags of `splitspec-drafter suffix`") from None
        other = sorted(k for k, v in vars(given).items()
                       if k not in drafter_cli.SUFFIX_FLAGS and (k not in defaults or defaults[k] != v))
        if other:
            flag = "--" + other[0].replace("_", "-")
            raise ValueError(f"--suffix-variant {line!r}: only the suffix drafter's flags, not {flag}")
        kwargs = drafter_cli.suffix_kwargs(given)
        SuffixDrafter(**kwargs)  # its own checks of the values
        variants[line] = kwargs
    return variants


def _suffix_speeds(tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace,
                   variants: dict[str, dict]) -> list[dict]:
    """The suffix drafter's own speed with its defaults, then with each variant's flags, timed side by side."""
    print(f"timing the suffix drafter with {args.suffix_speed_outputs} cached outputs ...", flush=True)
    return [asdict(speed) for speed in suffix_speed.measure(tokenizer, {"": {}, **variants},
                                                            cached=args.suffix_speed_outputs)]


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        variants = suffix_variants(args.suffix_variant)
        no_suffix_system = ("--trees" if args.trees else "--engine-only" if args.engine_only else
                            "--draft-model-only" if args.draft_model and args.draft_model_only else None)
        if variants and not (args.suffix_speed_only or args.replay) and no_suffix_system:
            raise ValueError(f"--suffix-variant does not apply to {no_suffix_system}: it runs no suffix remote system")
        no_remote_verifier = ("--replay" if args.replay else "--suffix-speed-only" if args.suffix_speed_only
                              else no_suffix_system)
        if (args.drafter or args.drafter_target) and no_remote_verifier:
            raise ValueError(f"--drafter and --drafter-target do not apply to {no_remote_verifier}: it runs no "
                             "verifier through a remote drafter")
    except ValueError as exc:
        print(f"splitspec bench: error: {exc}", file=sys.stderr)
        return 2
    source = model_loader.resolve_source(args.model)
    if args.suffix_speed_only:  # the drafter's own speed needs the tokenizer only
        speeds = _suffix_speeds(model_loader.load_tokenizer(source), args, variants)
        for speed in speeds:
            rep.print_suffix_speed(speed)
        (out / "suffix_speed.json").write_text(json.dumps({"suffix_speed": speeds[0],
                                                          "suffix_speed_variants": speeds[1:]}, indent=2))
        print(f"\nwrote {out / 'suffix_speed.json'}")
        return 0
    print(f"loading {source.name} for transformers and for tokenizing ...", flush=True)
    device = model_loader.pick_device(args.device)
    # The verifiers' dtype, so transformers decodes the same numbers.
    model, tokenizer = model_loader.load(source, model_loader.pick_dtype(args.dtype, device), device)
    prompts = workloads.build(args.workloads.split(","), args.prompts, tokenizer, dict(args.prompts_for))
    if args.replay:
        return _replay(model, tokenizer, prompts, args, out, variants)
    if args.trees:
        seconds = _forward_costs(model, args.trees)  # what the verifiers' planners weigh trees against
        print("target forward cost (ms) by tokens in one forward: "
              + ", ".join(f"{t}:{s * 1e3:.1f}" for t, s in sorted(seconds.items())), flush=True)
        del model
        rows = bench_trees.run(args, prompts, lambda systems, ps, a: _run_all(systems, ps, a, tokenizer))
        bench_trees.print_table(rows, args.trees, args.tree_drafter)
        bench_trees.to_json(rows, out / "trees.json")
        print(f"\nwrote {out / 'trees.json'}")
        return 0
    engine_sections.sections(args)  # a bad --engine-sections fails before anything runs
    common = ["--max-draft-len", str(args.max_draft_len), "--device", args.device, "--dtype", args.dtype,
              "--log-level", "WARNING", "--http-port", "off"] + (["--model", args.model] if args.model else [])
    if args.speculative_config:
        common += ["--speculative-config", args.speculative_config]
    common += args.verifier_arg
    if args.engine_only:  # the engine sections time the one-token forward at their own contexts
        engine_sections.run(args, tokenizer, common, lambda n: _forward_costs(model, 0, n)[1], out)
        return 0
    seconds = _forward_costs(model, args.max_draft_len)
    curve = step_costs.CostCurve.from_seconds(seconds)
    report = rep.Report(model=source.name, max_new_tokens=args.max_new_tokens, max_draft_len=args.max_draft_len,
                        forward_cost_ms={t: s * 1000 for t, s in seconds.items()})
    draft_path = None if args.draft_model in (None, "embedded") else args.draft_model
    if args.draft_model and args.draft_model_only:
        plain = TransformersSystem("plain", model)
        _draft_model_figures(args, draft_path, prompts, [plain.run(p, args.max_new_tokens).token_ids for p in prompts],
                             seconds, curve, model.config.vocab_size, report)
        report.to_json(out / "results.json")
        print(f"\nwrote {out / 'results.json'}")
        return 0
    print("starting the drafters and verifiers ...", flush=True)
    with contextlib.ExitStack() as stack:
        # The in-process n-gram verifier first, alone: it times its forwards afresh, at every token count
        # that any verifier here probes (plain decoding's are a subset), and keeps the timings. Every later
        # verifier starts on them (model/timing_cache.py), so the systems compared plan with one cost curve,
        # measured on a quiet machine, and they can start together.
        local = stack.enter_context(_service([script("splitspec-verifier"), "--speculative-mode", "ngram",
                                              "--max-matching-ngram-size", str(args.ngram_size), *common,
                                              "--timing-cache", "refresh"], name="verifier-inprocess"))
        model_system = []
        if args.draft_model:
            drafter_argv = [script("splitspec-drafter"), "model", "--device", args.draft_device, "--dtype",
                            args.draft_dtype, "--max-draft-len", str(args.max_draft_len), "--log-level", "WARNING",
                            *(["--model", draft_path] if draft_path else [])]
            model_drafter = stack.enter_context(_service(drafter_argv, name="model-drafter"))
            model_remote = stack.enter_context(_verifier_through(
                model_drafter.address, ["--drafter-deadline-ms", "1000", *common], name="verifier-model"))
            model_system = [VerifierSystem("splitspec model remote", model_remote.address, speculate=True)]
        _run_systems(args, common, local, model, tokenizer, prompts, curve, seconds, report,
                     model_system + _your_drafters(stack, args, common), draft_path, out, list(variants))
    if args.suffix_speed_outputs:
        report.suffix_speed, *report.suffix_speed_variants = _suffix_speeds(tokenizer, args, variants)
    rep.print_tables(report)
    report.to_json(out / "results.json")
    rep.save_chart(report, out / "chart.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'chart.png'}")
    return 0


def _your_drafters(stack: contextlib.ExitStack, args: argparse.Namespace, common: list[str]) -> list[VerifierSystem]:
    """A verifier drafting through each --drafter (served here by `splitspec-drafter SPEC`) and each
    --drafter-target (serving already)."""
    served = start_together(stack, [_service([script("splitspec-drafter"), *shlex.split(spec)], name=f"drafter-{i + 1}")
                                    for i, spec in enumerate(args.drafter)])
    targets = [(f"drafter {spec}", drafter.address) for spec, drafter in zip(args.drafter, served)]
    targets += [(f"drafter at {target}", target) for target in args.drafter_target]
    verifiers = start_together(stack, [_verifier_through(address, common, name=f"verifier-drafter-{i + 1}")
                                       for i, (_, address) in enumerate(targets)])
    return [VerifierSystem(name, verifier.address, speculate=True) for (name, _), verifier in zip(targets, verifiers)]


def _run_systems(args: argparse.Namespace, common: list[str], local: LocalService, model: torch.nn.Module,
                 tokenizer: PreTrainedTokenizerBase, prompts: list[workloads.Prompt], curve: step_costs.CostCurve,
                 seconds: dict[int, float], report: rep.Report, extra_systems: list[VerifierSystem],
                 draft_path: str | None, out: Path, variants: list[str]) -> None:
    """Start the n-gram and suffix drafters and four more verifiers beside the in-process n-gram one (and a suffix
    drafter and verifier for each of `variants`, flags of `splitspec-drafter suffix`), run every system (plus
    `extra_systems`) on every prompt, summarise into `report`; with a draft model, its own figures too; then the
    engine sections asked for."""
    with contextlib.ExitStack() as stack:
        drafter, suffix_drafter, *variant_drafters = start_together(stack, [
            _service([script("splitspec-drafter"), "ngram", "--max-matching-ngram-size", str(args.ngram_size)],
                     name="drafter"),
            _service([script("splitspec-drafter"), "suffix"], name="suffix-drafter"),
            *(_service([script("splitspec-drafter"), "suffix", *shlex.split(flags)], name=f"suffix-drafter-{i + 1}")
              for i, flags in enumerate(variants))])
        plain_verifier, remote, sremote, slocal, *variant_verifiers = start_together(stack, [
            _service([script("splitspec-verifier"), *common], name="verifier-plain"),
            _verifier_through(drafter.address, common, "verifier-remote"),
            _verifier_through(suffix_drafter.address, common, "verifier-suffix-remote"),
            _service([script("splitspec-verifier"), "--speculative-mode", "suffix", *common],
                     name="verifier-suffix-inprocess"),
            *(_verifier_through(d.address, common, f"verifier-suffix-remote-{i + 1}")
              for i, d in enumerate(variant_drafters))])
        variant_names = [f"{SUFFIX_REMOTE} {flags}" for flags in variants]
        # Each suffix system learns from its own requests only: every system sees the same ones, in order.
        # Each system has a verifier of its own: sharing one, the second system to run a prompt would
        # find it in the prefix cache and skip its prefill.
        systems = [VerifierSystem(PLAIN, plain_verifier.address, speculate=False),
                   VerifierSystem("splitspec ngram in-process", local.address, speculate=True),
                   VerifierSystem(NGRAM_REMOTE, remote.address, speculate=True),
                   VerifierSystem(SUFFIX_LOCAL, slocal.address, speculate=True),
                   VerifierSystem(SUFFIX_REMOTE, sremote.address, speculate=True),
                   *(VerifierSystem(name, v.address, speculate=True)
                     for name, v in zip(variant_names, variant_verifiers)),
                   *extra_systems]
        if not args.no_transformers:
            systems += [TransformersSystem("transformers generate", model),
                        TransformersSystem("transformers prompt lookup", model,
                                           prompt_lookup_num_tokens=args.max_draft_len,
                                           max_matching_ngram_size=args.ngram_size)]
        runs = _run_all(systems, prompts, args, tokenizer)
        for workload in dict.fromkeys(p.workload for p in prompts):
            idx = [i for i, p in enumerate(prompts) if p.workload == workload]
            plain = [runs[PLAIN][i] for i in idx]
            for system in systems:
                report.summaries.append(rep.summarise(system.name, workload, [runs[system.name][i] for i in idx],
                                                      plain, curve))
            # Each suffix system and each of `extra_systems` against the n-gram remote; each variant against the
            # default suffix remote too.
            pairs = [(system, NGRAM_REMOTE) for system in (SUFFIX_REMOTE, SUFFIX_LOCAL, *variant_names,
                                                           *(s.name for s in extra_systems))]
            for system, baseline_name in pairs + [(name, SUFFIX_REMOTE) for name in variant_names]:
                ours, baseline = [runs[system][i] for i in idx], [runs[baseline_name][i] for i in idx]
                ratios = rep.speed_ratios(ours, baseline)
                report.comparisons.append({"workload": workload, "system": system, "baseline": baseline_name,
                                           "ratio": statistics.median(ratios),
                                           "ratio_interval": list(rep.median_interval(ratios)),
                                           "decode_ratio": rep.relative_decode_speed(ours, baseline)})
        report.request_bytes = asyncio.run(_request_bytes(drafter.address, model.config.vocab_size))
        if args.concurrency:
            report.serving = _serving(remote.address, prompts, args)
        for system in systems:
            system.close()
        if args.draft_model:
            _draft_model_figures(args, draft_path, prompts, [r.token_ids for r in runs[PLAIN]], seconds, curve,
                                 model.config.vocab_size, report)
        if args.engine_sections:
            for verifier in (plain_verifier, remote, local, sremote, slocal, *variant_verifiers):
                verifier.stop()  # the engine sections start their own verifiers
            engine_sections.run(args, tokenizer, common, lambda n: _forward_costs(model, 0, n)[1], out)


def _draft_model_figures(args: argparse.Namespace, draft_path: str | None, prompts: list[workloads.Prompt],
                         outputs: list[list[int]], seconds: dict[int, float], curve: step_costs.CostCurve,
                         vocab_size: int, report: rep.Report) -> None:
    print("replaying plain decoding through the draft model, drafting ahead on and off ...", flush=True)
    figures = draft_model.measure(draft_path, args.draft_device, args.draft_dtype, prompts, outputs,
                                  args.max_draft_len, lambda tokens: seconds[min(seconds)] * curve(tokens), vocab_size)
    report.draft_model = [asdict(f) for f in figures]
    draft_model.print_table(figures, args.draft_model, args.draft_device)


def _replay(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[workloads.Prompt],
            args: argparse.Namespace, out: Path, variants: dict[str, dict]) -> int:
    print(f"greedy outputs of {len(prompts)} prompts ...", flush=True)
    outputs = replay.greedy_outputs(model, tokenizer, prompts, args.max_new_tokens)
    k = args.max_draft_len
    results = replay.replay("ngram", lambda: NgramDrafter(max_draft_len=k, max_matching_ngram_size=args.ngram_size),
                            prompts, outputs, k)
    results += replay.replay("suffix", SuffixDrafter, prompts, outputs, k)
    # vLLM's choice between the two trees, for comparison (drafters/suffix.py)
    results += replay.replay("suffix-score", lambda: SuffixDrafter(prefer_longer_match=False), prompts, outputs, k)
    for flags, kwargs in variants.items():
        results += replay.replay(f"suffix {flags}", lambda kwargs=kwargs: SuffixDrafter(**kwargs), prompts, outputs, k)
    replay.print_results(results)
    speeds = []
    if args.suffix_speed_outputs:
        print()
        speeds = _suffix_speeds(tokenizer, args, variants)
        for speed in speeds:
            rep.print_suffix_speed(speed)
    (out / "replay.json").write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "max_draft_len": k,
                                                 "results": replay.as_dicts(results),
                                                 "suffix_speed": speeds[0] if speeds else None,
                                                 "suffix_speed_variants": speeds[1:]}, indent=2))
    print(f"\nwrote {out / 'replay.json'}")
    return 0


def _forward_costs(model: torch.nn.Module, max_draft_len: int, context_len: int = 256) -> dict[int, float]:
    """Seconds of a forward by tokens in it, after `context_len` cached tokens."""
    shape = KVCacheShape.for_model(model.config, num_slots=1, capacity=max(512, 2 * (context_len + max_draft_len + 1)))
    # The verifier's default runner: CUDA graphs on a GPU.
    runner = ModelRunner(model, KVCache(shape, model.dtype, model.device),
                         cuda_graph_max_tokens=DEFAULTS.cuda_graph_max_tokens)
    try:  # with the linear layouts the verifiers choose; the transformers systems then get the model back as loaded
        return step_costs.tune_and_measure(runner, step_costs.probe_points(max_draft_len, 0), context_len=context_len,
                                           repeats=7, statistic=statistics.median)
    finally:
        runner.close()


def _run_all(systems: list, prompts: list[workloads.Prompt], args: argparse.Namespace,
             tokenizer: PreTrainedTokenizerBase) -> dict[str, list[Run]]:
    """Every prompt on every system, in the given order (drafters that learn depend on it). A follow-up
    turn sends back the answer the same system gave to the turn it follows. With --repeats above 1, a
    repeat is itself a recurring request for a drafter that learns."""
    warm = workloads.Prompt("warm-up", "warm-up", next(p.token_ids for p in prompts if p.token_ids)[:32])
    for system in systems:
        system.run(warm, 8)
    runs: dict[str, list[Run]] = {s.name: [] for s in systems}
    answers: dict[tuple[str, str], str] = {}  # (system, prompt name) -> the text it answered
    for n, prompt in enumerate(prompts):
        per_system: dict[str, list[Run]] = {s.name: [] for s in systems}
        for r in range(args.repeats):
            # Rotate the order so slow drift on a shared machine does not favour one system.
            shift = (n + r) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                asked = prompt if not prompt.follows else dataclasses.replace(
                    prompt, token_ids=prompt.render(answers[(system.name, prompt.follows)], tokenizer))
                per_system[system.name].append(system.run(asked, args.max_new_tokens))
        for name, rs in per_system.items():
            runs[name].append(sorted(rs, key=lambda x: x.seconds)[len(rs) // 2])
            answers[(name, prompt.name)] = tokenizer.decode(runs[name][-1].token_ids, skip_special_tokens=True)
        print(f"  {prompt.workload}/{prompt.name}: " + ", ".join(
            f"{name} {len(r[-1].token_ids) / r[-1].seconds:.1f} tok/s" for name, r in runs.items()), flush=True)
    return runs


async def _request_bytes(address: str, vocab_size: int) -> list[tuple[int, int]]:
    """Bytes of one PrepareDraftTokens as a sequence grows 100 -> 2000 tokens, one token per step."""
    client = DrafterClient(GrpcTransport(address), "bench", vocab_size, deadline_s=1.0,
                           overlap_steps=DEFAULT_DELTA_OVERLAP_STEPS)
    history = DeltaHistory()
    tokens = [int(t) for t in torch.randint(0, vocab_size, (2000,))]
    sizes = []
    try:
        for n in range(100, 2001):
            await client.propose([DraftQuery("grow", tokens[:n], 50, 8, history)])
            if n in (100, 500, 1000, 2000):
                sizes.append((n, client.stats.last_request_bytes))
    finally:
        await client.close()
    return sizes


def _serving(address: str, prompts: list[workloads.Prompt], args: argparse.Namespace) -> list[dict]:
    prompts = [p for p in prompts if p.token_ids]  # follow-up turns need an answer to send back
    rows = []
    for concurrency in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(concurrency, 4) * 2 if concurrency > 1 else 4)]
        result: dict[str, tuple[float, list[Run]]] = {}
        for speculate in (False, True):
            system = VerifierSystem("serving", address, speculate)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                done = list(pool.map(lambda p: system.run(p, args.max_new_tokens), batch))
            result[str(speculate)] = (time.perf_counter() - started, done)
            system.close()
        (t_plain, plain), (t_spec, spec) = result["False"], result["True"]
        rows.append({"concurrency": concurrency, "requests": len(batch),
                     "plain_tps": sum(len(r.token_ids) for r in plain) / t_plain,
                     "spec_tps": sum(len(r.token_ids) for r in spec) / t_spec,
                     "identical": sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))})
        print(f"  serving concurrency {concurrency}: plain {rows[-1]['plain_tps']:.1f} tok/s, "
              f"speculative {rows[-1]['spec_tps']:.1f} tok/s", flush=True)
    return rows
