"""`splitspec bench --engine-sections ...`: what the engine adds around the model's forward.

- overhead: per-step overhead (the step period minus its forward, read from the verifier's
  splitspec:engine_step_overhead_seconds histogram) at batch 1, plain and with the remote
  n-gram drafter (the default verifier, which overlaps the drafter's calls with its forward
  where it can, and one that waits for every call), and plain decoding's speed against
  1 / (one-token forward time). That
  forward is timed like for like: one token after as many cached tokens as the decode's
  steps have (its prompt's length, then up to the last token), not at a fixed context.
  With the remote drafter, the share of calls that overlapped the forward, the round trip of
  those waited for as the verifier sees it and the drafter's own handling time (its
  splitspec_drafter_call_latency_seconds) are read beside it, so the overhead splits into the
  network and the drafter's server, and the rest (ours); and the share of steps that made no call
  (splitspec:drafter_calls_saved_total: the planner found it would not pay), whose overhead is
  plain decoding's;
- prefill-gap: three plain streams' inter-token gaps while a long prompt is admitted, with the
  default chunked prefill and with the whole prompt in one step;
- multi-turn: time to first token of each turn of a chat over a long document, with prefix
  caching on and off (the outputs must be identical);
- structured: the templated workload's JSON descriptions asked for free and held to a JSON schema
  (structured output), plain and with the remote n-gram drafter: decoding speed, tokens per step,
  whether each held answer is valid JSON of the schema, and whether speculation changed a token;
- prediction: the grounded workload (a function given, asked back with a docstring) plain, with the
  remote n-gram drafter, and with it and the function as the request's prediction (OpenAI's Predicted
  Outputs), then on a verifier whose drafter is down, without and with the prediction: decoding speed and
  its ratio to plain's, tokens per step, the prediction's accepted and rejected tokens, and whether any
  token changed;
- priority: a short interactive request arriving while two long background streams hold every
  sequence slot, on a verifier serving in order of arrival and on one serving by priority (which
  preempts a background stream for it): its time to first token and to its end, the background
  streams' own time, and whether every output is the same on both;
- cuda-graphs (CUDA): decoding's speed at batch 1 with CUDA graphs (the default) and with
  --enforce-eager, plain and with the remote n-gram drafter, the two verifiers taking turns;
- logits: the logits processors alone, in this process (logits_speed.py): no verifier is started
  for it;
- sampling: verifying a sampled row, the engine's sampler against the textbook one, in this process
  (sampling_speed.py);
- step-work: the engine's own work a step (schedule, verify, commit) at 1 to 128 sequences, with a
  stand-in for the forward, in this process (step_work.py).

Verifier processes: defaults (with /metrics), and as sections need them calls awaited, unchunked, no
prefix caching, a drafter that is down, eager, and two sequence slots in order of arrival and by priority;
one n-gram drafter
(with /metrics). Each section uses prompts of its own, so no cached prefix crosses from one section to
another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerBase

from drafter_sdk.loading.causal_lm import pick_device
from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from verifier_service.tools.bench import logits_speed, sampling_speed, step_work, workloads
from verifier_service.tools.local_services import LocalService, free_port, script

SECTIONS = ("overhead", "prefill-gap", "multi-turn", "structured", "prediction", "priority", "cuda-graphs", "logits",
            "sampling", "step-work")
IN_PROCESS = {"logits", "sampling", "step-work"}  # sections that start no verifier
UNCHUNKED = 1 << 20  # a step budget no prompt reaches
STARTUP_TIMEOUT_S = 1200.0  # start-up measures the cost curve: slow on a busy CPU


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-sections", default="",
                   help=f"also measure the engine: comma list of {', '.join(SECTIONS)}, or all")
    p.add_argument("--engine-only", action="store_true", help="run only --engine-sections")
    p.add_argument("--long-prompt-tokens", type=int, default=1800, help="prefill-gap: the long prompt")
    p.add_argument("--document-tokens", type=int, default=1500, help="multi-turn: the shared document")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns of the chat")


def sections(args: argparse.Namespace) -> list[str]:
    names = [s for s in args.engine_sections.split(",") if s]
    names = list(SECTIONS) if names == ["all"] else names
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--engine-sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return names


def document(tokenizer: PreTrainedTokenizerBase, tokens: int) -> list[int]:
    """`tokens` tokens of HumanEval prompts one after another (text nobody here wrote)."""
    ids: list[int] = []
    for _, text in workloads.code(164):
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def _decode_tok_s(arrivals: list[float]) -> float:
    """Decoding's own rate: tokens after the first over the time after the first (prefill excluded)."""
    return (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-9)


Run = tuple[list[float], verifier_pb2.GenerationOutput]  # a request's token arrival times, and its output


def _decode_figures(runs: list[Run], plain: list[Run]) -> dict:
    """One system's figures over its prompts' runs: decode tok/s (median over prompts), tokens per step,
    mean tokens, and how many outputs equal `plain`'s (the same prompts' runs, plain)."""
    outs = [final for _, final in runs]
    steps = sum(o.stats.num_steps for o in outs)
    return {"tok_s": statistics.median(_decode_tok_s(a) for a, _ in runs),
            "tokens_per_step": sum(len(o.token_ids) - 1 for o in outs) / steps if steps else 1.0,
            "mean_tokens": statistics.mean(len(o.token_ids) for o in outs),
            "identical_to_plain": sum(list(o.token_ids) == list(p.token_ids) for o, (_, p) in zip(outs, plain)),
            "prompts": len(outs)}


def run(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, common: list[str],
        forward_s: Callable[[int], float], out: Path) -> dict:
    """Run the chosen sections; print their tables; write out/engine.json. `forward_s(n)`: the
    one-token forward's seconds after n cached tokens."""
    chosen = sections(args)
    results: dict = {}
    device, vocab = pick_device(args.device), len(tokenizer)
    for name, section in (("logits", logits_speed), ("sampling", sampling_speed)):
        if name in chosen:
            results[name] = section.measure(vocab, device)
            section.print_table(results[name], vocab, device)
    if "step-work" in chosen:
        results["step_work"] = step_work.measure(tokenizer)
        step_work.print_table(results["step_work"], tokenizer)
    if set(chosen) - IN_PROCESS:
        results |= _with_services(chosen, args, tokenizer, common, forward_s)
    _print(results)
    (out / "engine.json").write_text(json.dumps(results, indent=2))
    return results


def _with_services(chosen: list[str], args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase,
                   common: list[str], forward_s: Callable[[int], float]) -> dict:
    """The sections that measure verifier processes, beside one n-gram drafter."""
    results: dict = {}
    metrics_port, drafter_metrics_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        drafter = stack.enter_context(LocalService(
            [script("splitspec-drafter"), "ngram", "--max-matching-ngram-size", str(args.ngram_size),
             "--metrics-port", str(drafter_metrics_port)],
            name="drafter", startup_timeout_s=STARTUP_TIMEOUT_S))
        spec = ["--speculative-mode", "user_provided", "--drafter-target", drafter.address, *common]

        def verifier(name: str, *extra: str) -> LocalService:
            print(f"starting verifier-{name} ...", flush=True)
            return stack.enter_context(LocalService([script("splitspec-verifier"), *spec, *extra],
                                                    name=f"verifier-{name}", startup_timeout_s=STARTUP_TIMEOUT_S))
        # It times its forwards afresh and keeps them; the verifiers after it start on those timings.
        default = verifier("default", "--metrics-port", str(metrics_port), "--timing-cache", "refresh")
        if "overhead" in chosen:
            awaited_port = free_port()
            awaited = verifier("awaited", "--no-overlap-drafter-calls", "--metrics-port", str(awaited_port))
            results["overhead"] = _overhead([(default, metrics_port), (awaited, awaited_port)],
                                            drafter_metrics_port, tokenizer, args, forward_s)
        if "prefill-gap" in chosen:
            long_prompt = document(tokenizer, args.long_prompt_tokens)
            unchunked = verifier("unchunked", "--max-num-batched-tokens", str(UNCHUNKED))
            results["prefill_gap"] = [_prefill_gap(v, label, long_prompt, tokenizer, args)
                                      for label, v in (("chunked (default)", default), ("unchunked", unchunked))]
        if "multi-turn" in chosen:
            uncached = verifier("uncached", "--no-prefix-caching")
            results["multi_turn"] = _multi_turn(default, uncached, tokenizer, args)
        if "structured" in chosen:
            results["structured"] = _structured(default, tokenizer, args)
        if "prediction" in chosen:  # and a verifier whose drafter is down: nothing listens at its target
            down = verifier("drafter-down", "--drafter-target", f"127.0.0.1:{free_port()}")
            results["prediction"] = _prediction(default, down, tokenizer, args)
        if "priority" in chosen:
            slots, priority_port = ("--max-num-seqs", "2"), free_port()
            results["priority"] = _priority(
                verifier("fcfs", *slots),
                verifier("priority", *slots, "--scheduling-policy", "priority", "--metrics-port", str(priority_port)),
                priority_port, tokenizer, args)
        if "cuda-graphs" in chosen:
            results["cuda_graphs"] = _cuda_graphs(default, verifier("eager", "--enforce-eager"), tokenizer, args)
    return results


# --- overhead -------------------------------------------------------------------------------------

def _overhead(verifiers: list[tuple[LocalService, int]], drafter_port: int, tokenizer: PreTrainedTokenizerBase,
              args: argparse.Namespace, forward_s: Callable[[int], float]) -> dict:
    """`verifiers`: the default verifier and one that waits for every drafter call, with their
    /metrics ports; `drafter_port`: the drafter's."""
    prompt = workloads.build(["grounded"], 1, tokenizer)[0].token_ids
    n = args.max_new_tokens
    # Like for like: the forward after as many cached tokens as the decode's steps see, from the
    # prompt's length to its last token (the cost grows with the context; the mean of three points).
    contexts = [len(prompt), len(prompt) + n // 2, len(prompt) + n - 1]
    decode_forward_s = statistics.mean(forward_s(c) for c in contexts)
    (default, default_port), (awaited, awaited_port) = verifiers
    rows = []
    for label, v, port, speculate in (("plain", default, default_port, False),
                                      ("remote n-gram", default, default_port, True),
                                      ("remote, calls awaited", awaited, awaited_port, True)):
        client = Client(v.address)
        client.stream(prompt[:32], 8, speculate=False)  # warm-up
        before = [_metrics(p) for p in (port, drafter_port)]
        arrivals, _ = client.stream(prompt, n, speculate=speculate)
        client.close()
        tok_s = _decode_tok_s(arrivals)
        after = [_metrics(p) for p in (port, drafter_port)]
        delta = _delta(after[0], before[0], OVERHEAD)
        row = {"system": label, "steps": delta[-1][1], "p50_ms": 1000 * _quantile(delta, 0.5),
               "p99_ms": 1000 * _quantile(delta, 0.99), "tok_s": tok_s, "x_ideal": tok_s * decode_forward_s}
        if speculate:  # the drafter call: its round trip, and the drafter's own handling of it
            overlapped = _delta(after[0], before[0], OVERLAPPED)[0][1]
            waited = _delta(after[0], before[0], ROUND_TRIP + "_count")[0][1]  # a step's call, when waited for
            row["overlapped"] = overlapped / max(overlapped + waited, 1)
            row["no_call"] = _delta(after[0], before[0], SAVED)[0][1] / max(row["steps"], 1)
            row["call_ms"] = 1000 * _mean(after[0], before[0], ROUND_TRIP)
            row["drafter_server_ms"] = 1000 * _mean(after[1], before[1], DRAFTER_HANDLING)
        rows.append(row)
    return {"one_token_forward_ms": 1000 * decode_forward_s, "contexts": contexts, "rows": rows}


OVERHEAD = "splitspec:engine_step_overhead_seconds"
ROUND_TRIP = "splitspec:drafter_call_latency_seconds"
OVERLAPPED = "splitspec:drafter_calls_overlapped_total"
SAVED = "splitspec:drafter_calls_saved_total"
PREEMPTIONS = "splitspec:num_preemptions_total"
DRAFTER_HANDLING = 'splitspec_drafter_call_latency_seconds{method="PrepareDraftTokens"}'


def _metrics(port: int) -> dict[str, list[tuple[float, float]]]:
    """The histograms and counters of a /metrics page: a histogram's name (with its labels but le) ->
    [(le, cumulative count)], plus name + "_sum" and "_count" -> [(0, value)]; a counter's sample
    name (..._total) -> [(0, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            out.update((sample.name, [(0.0, sample.value)]) for sample in family.samples if not sample.labels)
        if family.type != "histogram":
            continue
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            key = family.name + (f"{{{labels}}}" if labels else "")
            if sample.name.endswith("_bucket"):
                out.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            else:
                out[key + sample.name[len(family.name):]] = [(0.0, sample.value)]
    return out


def _delta(after: dict, before: dict, name: str) -> list[tuple[float, float]]:
    if name not in after:
        raise RuntimeError(f"no {name} histogram exported")
    return [(le, a - b) for (le, a), (_, b) in zip(after[name], before.get(name, [(le, 0.0) for le, _ in after[name]]))]


def _mean(after: dict, before: dict, name: str) -> float:
    """Mean observation between two scrapes (nan if none)."""
    count = _delta(after, before, name + "_count")[0][1]
    return _delta(after, before, name + "_sum")[0][1] / count if count else float("nan")


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation."""
    total = buckets[-1][1]
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = le, count
    return lower


# --- prefill gap ----------------------------------------------------------------------------------

def _prefill_gap(v: LocalService, label: str, long_prompt: list[int], tokenizer: PreTrainedTokenizerBase,
                 args: argparse.Namespace) -> dict:
    streams = [p.token_ids for p in workloads.build(["open"], 3, tokenizer)]
    client = Client(v.address)
    client.stream(streams[0][:32], 8, speculate=False)  # warm-up
    _warm_up_long(client, long_prompt)
    arrivals: list[list[float]] = [[] for _ in streams]
    length = max(args.max_new_tokens, 192)  # long enough to outlast the long prompt's prefill
    threads = [threading.Thread(target=client.stream, args=(streams[i], length, False, arrivals[i]))
               for i in range(len(streams))]
    for t in threads:
        t.start()
    while min(len(a) for a in arrivals) < 8:
        time.sleep(0.01)
    admitted = time.perf_counter()
    long_arrivals, _ = client.stream(long_prompt, 4, speculate=False)
    long_first = long_arrivals[0]
    for t in threads:
        t.join()
    client.close()
    pairs = [(a, b) for arr in arrivals for a, b in zip(arr, arr[1:])]
    during = [b - a for a, b in pairs if b > admitted and a < long_first]
    # The streams' usual gap: outside the long prompt's prefill (smaller chunks take more steps, and
    # the median of every gap would count them as usual).
    median = statistics.median([b - a for a, b in pairs if b <= admitted or a >= long_first])
    return {"config": label, "long_prompt_tokens": len(long_prompt), "median_gap_ms": 1000 * median,
            "max_gap_during_prefill_ms": 1000 * max(during, default=0.0),
            "max_over_median": max(during, default=0.0) / median, "long_ttft_s": long_first - admitted}


def _warm_up_long(client: Client, prompt: list[int]) -> None:
    """Prefill a prompt as long as `prompt`, reversed so that nothing of it is cached, untimed. A
    process's first forward of that size paid about 1.5 s more on the 2-core CI VM (SmolLM2, 1,800
    tokens: 3.4-3.9 s, then 1.9-2.3 s; the heap grows, page by page): timed cold, the unchunked
    verifier's first long prompt carried it and the chunked one's small steps did not."""
    client.stream(prompt[::-1], 1, speculate=False)


# --- multi-turn -----------------------------------------------------------------------------------

def _multi_turn(cached: LocalService, uncached: LocalService, tokenizer: PreTrainedTokenizerBase,
                args: argparse.Namespace) -> dict:
    # A document the other sections never sent: nothing of it is cached before turn 1.
    doc = document(tokenizer, args.document_tokens + 200)[200:]
    questions = [tokenizer(f"\n\nQuestion {k + 1}: what does function {k + 1} above do? Answer:")["input_ids"]
                 for k in range(args.turns)]
    configs = (("caching on", cached), ("caching off", uncached))
    clients = {label: Client(v.address) for label, v in configs}
    contexts = {label: list(doc) for label, _ in configs}
    by_config: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for client in clients.values():  # warm-ups: prefixes of nothing later asked
        client.stream(doc[:32][::-1], 8, speculate=False)
        _warm_up_long(client, doc)
    # Turn by turn, on then off: both see the same moment's load (the machine may be shared).
    for q in questions:
        for label, _ in configs:
            context = contexts[label]
            context += q
            started = time.perf_counter()
            arrivals, final = clients[label].stream(context, 24, speculate=True)
            by_config[label].append({"prompt_tokens": len(context), "ttft_s": arrivals[0] - started,
                                     "cached_prompt_tokens": final.cached_prompt_tokens,
                                     "tokens": list(final.token_ids)})
            context += final.token_ids
    for client in clients.values():
        client.close()
    on, off = by_config["caching on"], by_config["caching off"]
    rows = [{"turn": k + 1, "prompt_tokens": a["prompt_tokens"], "cached_tokens": a["cached_prompt_tokens"],
             "ttft_on_s": a["ttft_s"], "ttft_off_s": b["ttft_s"], "speedup": b["ttft_s"] / a["ttft_s"],
             "identical": a["tokens"] == b["tokens"]} for k, (a, b) in enumerate(zip(on, off))]
    return {"document_tokens": len(doc), "rows": rows}


# --- structured output ----------------------------------------------------------------------------

# Bounded, as one would hold a small model: left to itself, the 135M model repeats a list item or a
# sentence until max_new_tokens.
TEMPLATED_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "module", "summary", "parameters", "returns", "example"],
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "module": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "parameters": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "description"],
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "description": {"type": "string", "maxLength": 120}}}},
        "returns": {"type": "string", "maxLength": 120}, "example": {"type": "string", "maxLength": 80}}}


def _structured(v: LocalService, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> dict:
    """Each templated prompt (its chat alone, the answer not started) four ways, one after another:
    free and held to TEMPLATED_SCHEMA, each plain and with the remote n-gram drafter."""
    schema = verifier_pb2.StructuredOutput(json_schema=json.dumps(TEMPLATED_SCHEMA))
    prompts = [workloads.chat_ids(text, tokenizer) for _, text in workloads.templated(args.prompts)]
    systems = [("free", None, False), ("free", None, True), ("JSON schema", schema, False),
               ("JSON schema", schema, True)]
    client = Client(v.address)
    client.stream(prompts[0][:32][::-1], 8, speculate=False)  # warm-up
    client.stream(prompts[0][:32][::-1], 8, speculate=False, structured=schema)  # llguidance's vocabulary, once
    runs: dict[int, list[Run]] = {i: [] for i in range(len(systems))}
    for prompt in prompts:
        for i, (_, form, speculate) in enumerate(systems):
            runs[i].append(client.stream(prompt, args.max_new_tokens, speculate=speculate, structured=form))
    client.close()
    rows = []
    for i, (form_name, form, speculate) in enumerate(systems):
        outs = [final for _, final in runs[i]]
        rows.append({
            "output": form_name, "speculation": "remote n-gram" if speculate else "plain",
            **_decode_figures(runs[i], runs[i - 1] if speculate else runs[i]),
            "valid_json": sum(_valid(tokenizer.decode(o.token_ids, skip_special_tokens=True)) for o in outs)
            if form is not None else None,
            "finished": sum(o.finish_reason == verifier_pb2.FINISH_REASON_STOP for o in outs)})
    return {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}


# --- prediction -----------------------------------------------------------------------------------

def _prediction(v: LocalService, down: LocalService, tokenizer: PreTrainedTokenizerBase,
                args: argparse.Namespace) -> dict:
    """Each grounded prompt five ways, one after another: plain, with the remote n-gram drafter, and with
    it and the function given as the request's prediction, as a client that expects the answer to repeat
    it sends; then on a verifier whose drafter is down (`down`), without and with the prediction. Each
    answer runs to its own end."""
    functions = [function for _, function in workloads.grounded_functions(args.prompts)]
    prompts = [workloads.chat_ids(workloads.GROUNDED_ASK + function, tokenizer) for function in functions]
    clients = {"up": Client(v.address), "down": Client(down.address)}
    systems = [("plain", "up", False, False), ("remote n-gram", "up", True, False),
               ("n-gram + prediction", "up", True, True), ("drafter down", "down", True, False),
               ("drafter down + prediction", "down", True, True)]
    for client in clients.values():
        client.stream(prompts[0][:32][::-1], 8, speculate=False)  # warm-up
    runs: dict[int, list[Run]] = {i: [] for i in range(len(systems))}
    for prompt, function in zip(prompts, functions):
        for i, (_, where, speculate, predict) in enumerate(systems):
            runs[i].append(clients[where].stream(prompt, args.max_new_tokens, speculate=speculate,
                                                 prediction=function if predict else "", until_eos=True))
    for client in clients.values():
        client.close()
    plain = runs[0]
    rows = []
    for i, (name, _, _, _) in enumerate(systems):
        outs = [final for _, final in runs[i]]
        rows.append({
            "system": name, **_decode_figures(runs[i], plain),
            "speedup": statistics.median(_decode_tok_s(a) / _decode_tok_s(p) for (a, _), (p, _) in zip(runs[i], plain)),
            "accepted_prediction": sum(o.stats.accepted_prediction_tokens for o in outs),
            "rejected_prediction": sum(o.stats.rejected_prediction_tokens for o in outs)})
    return {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}


# --- priority -------------------------------------------------------------------------------------

def _priority(fcfs: LocalService, by_priority: LocalService, metrics_port: int,
              tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> dict:
    """Two long background streams (priority 1) fill both sequence slots; once they decode, a short
    interactive request (priority 0) arrives. Its time to first token and to its end, and the
    background streams' own time, on a verifier serving in order of arrival and on one serving by
    priority (each --max-num-seqs 2), the two taking turns `args.repeats` times; medians. `metrics_port`:
    the priority verifier's /metrics, whose preemptions are counted."""
    background = [p.token_ids for p in workloads.build(["grounded"], 2, tokenizer)]
    interactive = workloads.build(["open"], 1, tokenizer)[0].token_ids
    length = max(args.max_new_tokens, 192)  # long enough to be running when the interactive one comes
    configs = (("fcfs", fcfs, 0), ("priority", by_priority, 1))
    clients = {label: Client(v.address) for label, v, _ in configs}
    for client in clients.values():
        client.stream(interactive[:32][::-1], 8, speculate=False)  # warm-up
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    before = _metrics(metrics_port)[PREEMPTIONS][0][1]
    for _ in range(args.repeats):
        for label, _, low in configs:
            client = clients[label]
            arrivals: list[list[float]] = [[] for _ in background]
            finals: list[verifier_pb2.GenerationOutput] = [verifier_pb2.GenerationOutput() for _ in background]

            def run_background(i: int) -> None:
                _, finals[i] = client.stream(background[i], length, True, arrivals[i], priority=low)
            threads = [threading.Thread(target=run_background, args=(i,)) for i in range(len(background))]
            started = time.perf_counter()
            for t in threads:
                t.start()
            while min(len(a) for a in arrivals) < 8 and all(t.is_alive() for t in threads):
                time.sleep(0.01)
            sent = time.perf_counter()
            first, final = client.stream(interactive, 32, speculate=True)
            for t in threads:
                t.join()
            runs[label].append({"ttft_s": first[0] - sent, "latency_s": first[-1] - sent,
                                "background_s": max(a[-1] for a in arrivals) - started,
                                "tokens": [list(final.token_ids), *(list(f.token_ids) for f in finals)]})
    for client in clients.values():
        client.close()
    rows = [{"policy": label, **{key: statistics.median(r[key] for r in runs[label])
                                 for key in ("ttft_s", "latency_s", "background_s")}} for label, _, _ in configs]
    identical = all(a["tokens"] == b["tokens"] for a, b in zip(runs["fcfs"], runs["priority"]))
    return {"background_tokens": length, "rows": rows, "identical": identical,
            "preemptions": _metrics(metrics_port)[PREEMPTIONS][0][1] - before, "rounds": args.repeats}


# --- CUDA graphs ----------------------------------------------------------------------------------

def _cuda_graphs(graphed: LocalService, eager: LocalService, tokenizer: PreTrainedTokenizerBase,
                 args: argparse.Namespace) -> list[dict]:
    """Decode tok/s (after the first token) of one prompt, each system `args.repeats` times on each
    verifier in turn; medians."""
    prompt = workloads.build(["code"], 1, tokenizer)[0].token_ids
    clients = {"graphs": Client(graphed.address), "eager": Client(eager.address)}
    for client in clients.values():
        client.stream(prompt[:32][::-1], 8, speculate=False)  # warm-up
    rows = []
    for label, speculate in (("plain", False), ("remote n-gram", True)):
        rates: dict[str, list[float]] = {name: [] for name in clients}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name, client in clients.items():
                arrivals, final = client.stream(prompt, args.max_new_tokens, speculate=speculate)
                rates[name].append(_decode_tok_s(arrivals))
                outputs[name] = list(final.token_ids)
        graphs, eager_rate = statistics.median(rates["graphs"]), statistics.median(rates["eager"])
        rows.append({"system": label, "graphs_tok_s": graphs, "eager_tok_s": eager_rate,
                     "ratio": graphs / eager_rate, "identical": outputs["graphs"] == outputs["eager"]})
    for client in clients.values():
        client.close()
    return rows


def _valid(text: str) -> bool:
    """The text is one JSON object of TEMPLATED_SCHEMA's keys."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(TEMPLATED_SCHEMA["required"])


class Client:
    """Streams a request and notes when each token arrives."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = verifier_pb2_grpc.VerifierServiceStub(self._channel)

    def stream(self, ids: list[int], max_new_tokens: int, speculate: bool, arrivals: list[float] | None = None,
               structured: verifier_pb2.StructuredOutput | None = None, priority: int = 0, prediction: str = "",
               until_eos: bool = False) -> Run:
        """Arrival times (appended to `arrivals` as tokens come, if given) and the final output. The
        end-of-sequence token is ignored (every request runs its length) unless `until_eos` or a structured
        output, whose end it is, is asked for."""
        request = verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
            token_ids=verifier_pb2.TokenIds(ids=ids), sampling=verifier_pb2.SamplingParams(temperature=0.0),
            stopping=verifier_pb2.StoppingCriteria(max_new_tokens=max_new_tokens,
                                                   ignore_eos=structured is None and not until_eos),
            speculation=verifier_pb2.SpeculationOverrides(disable=not speculate), structured_output=structured,
            priority=priority, prediction=prediction))
        arrivals = [] if arrivals is None else arrivals
        tokens: list[int] = []
        final = verifier_pb2.GenerationOutput()
        for message in self._stub.GenerateStream(request, timeout=1800):
            now = time.perf_counter()
            arrivals += [now] * len(message.output.token_ids)
            tokens += message.output.token_ids
            final = message.output
        del final.token_ids[:]
        final.token_ids.extend(tokens)
        return arrivals, final

    def close(self) -> None:
        self._channel.close()


def _print(results: dict) -> None:
    if "overhead" in results:
        o = results["overhead"]
        print(f"\nPer-step overhead at batch 1 (step period - forward; one-token forward "
              f"{o['one_token_forward_ms']:.1f} ms after {o['contexts'][0]}-{o['contexts'][-1]} cached tokens, "
              f"as the decode's steps)")
        print(f"{'system':<22}{'steps':>7}{'p50 ms':>9}{'p99 ms':>9}{'tok/s':>8}{'x 1/forward':>13}"
              f"{'overlapped':>12}{'call ms':>9}{'drafter ms':>12}{'no call':>9}")
        for r in o["rows"]:
            call = (f"{r['overlapped']:>12.0%}{r['call_ms']:>9.2f}{r['drafter_server_ms']:>12.2f}{r['no_call']:>9.0%}"
                    if "call_ms" in r else "")
            print(f"{r['system']:<22}{r['steps']:>7.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['tok_s']:>8.1f}"
                  f"{r['x_ideal']:>13.2f}{call}")
        print("overlapped: drafter calls the step did not wait for (it verified what was left of the last "
              "answer; the call was answered during the forward); call ms: the mean round trip of the calls "
              "waited for; drafter ms: the mean of the drafter's own handling of a call; no call: steps the "
              "planner made no call in, as it would not pay")
    if "prefill_gap" in results:
        print("\nThree plain streams while a long prompt is prefilled")
        print(f"{'config':<20}{'prompt':>7}{'median gap ms':>15}{'max gap ms':>12}{'max/median':>12}"
              f"{'long TTFT s':>13}")
        for r in results["prefill_gap"]:
            print(f"{r['config']:<20}{r['long_prompt_tokens']:>7}{r['median_gap_ms']:>15.1f}"
                  f"{r['max_gap_during_prefill_ms']:>12.1f}{r['max_over_median']:>12.1f}{r['long_ttft_s']:>13.2f}")
    if "structured" in results:
        st = results["structured"]
        print(f"\nStructured output: {st['prompts']} templated prompts, free and held to a JSON schema "
              f"(decode tok/s: median over prompts, after the first token)")
        print(f"{'output':<13}{'speculation':<15}{'tok/s':>7}{'tokens/step':>13}{'tokens':>8}{'valid JSON':>12}"
              f"{'ended':>7}{'identical':>11}")
        for r in st["rows"]:
            valid = "-" if r["valid_json"] is None else f"{r['valid_json']}/{r['prompts']}"
            print(f"{r['output']:<13}{r['speculation']:<15}{r['tok_s']:>7.1f}{r['tokens_per_step']:>13.2f}"
                  f"{r['mean_tokens']:>8.0f}{valid:>12}{r['finished']:>7}{r['identical_to_plain']:>8}/{r['prompts']}")
        print("identical: equal to the same output plain; ended: stopped by itself, not by max_new_tokens")
    if "prediction" in results:
        pd = results["prediction"]
        print(f"\nPredicted outputs: {pd['prompts']} grounded prompts (a function, asked back with a docstring), the "
              f"function as the prediction (decode tok/s and its ratio to plain's: medians over prompts)")
        print(f"{'system':<22}{'tok/s':>7}{'x plain':>9}{'tokens/step':>13}{'tokens':>8}{'accepted':>10}"
              f"{'rejected':>10}{'identical':>11}")
        for r in pd["rows"]:
            print(f"{r['system']:<22}{r['tok_s']:>7.1f}{r['speedup']:>8.2f}x{r['tokens_per_step']:>13.2f}"
                  f"{r['mean_tokens']:>8.0f}{r['accepted_prediction']:>10}{r['rejected_prediction']:>10}"
                  f"{r['identical_to_plain']:>8}/{r['prompts']}")
        print("accepted, rejected: the prediction's draft tokens verified and kept, and verified and discarded "
              "(OpenAI's usage counts); identical: equal to the same output plain")
    if "priority" in results:
        pr = results["priority"]
        print(f"\nA 32-token request (priority 0) while two {pr['background_tokens']}-token streams (priority 1) "
              "hold both sequence slots (medians)")
        print(f"{'policy':<10}{'TTFT s':>8}{'latency s':>11}{'background s':>14}")
        for r in pr["rows"]:
            print(f"{r['policy']:<10}{r['ttft_s']:>8.2f}{r['latency_s']:>11.2f}{r['background_s']:>14.2f}")
        print(f"preemptions: {pr['preemptions']:.0f} in {pr['rounds']} rounds; every output identical on both: "
              f"{pr['identical']}")
    if "cuda_graphs" in results:
        print("\nCUDA graphs at batch 1: decode tok/s with graphs (the default) and --enforce-eager")
        print(f"{'system':<16}{'graphs':>9}{'eager':>9}{'ratio':>8}{'identical':>11}")
        for r in results["cuda_graphs"]:
            print(f"{r['system']:<16}{r['graphs_tok_s']:>9.1f}{r['eager_tok_s']:>9.1f}{r['ratio']:>7.2f}x"
                  f"{str(r['identical']):>11}")
    if "multi_turn" in results:
        m = results["multi_turn"]
        print(f"\nMulti-turn chat over a {m['document_tokens']}-token document: time to first token")
        print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'caching on s':>14}{'caching off s':>15}{'speedup':>9}"
              f"{'identical':>11}")
        for r in m["rows"]:
            print(f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_on_s']:>14.3f}"
                  f"{r['ttft_off_s']:>15.3f}{r['speedup']:>9.1f}{str(r['identical']):>11}")
