"""`splitspec bench` end to end on a tiny model saved to disk: every system runs, every output
matches plain decoding, and the report, JSON and chart are written."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
from pathlib import Path

import pytest
from tiny_model import tiny_model, tiny_tokenizer

from verifier_service.tools import cli
from verifier_service.tools.bench import report as bench_report
from verifier_service.tools.bench import run, suffix_speed
from verifier_service.tools.bench.flags import positive_ints
from verifier_service.tools.bench.systems import Run
from verifier_service.tools.local_services import LocalService, script

SYSTEMS = {"splitspec plain", "splitspec ngram in-process", "splitspec ngram remote", "splitspec suffix in-process",
           "splitspec suffix remote", "transformers generate", "transformers prompt lookup"}
VARIANT = "splitspec suffix remote --max-spec-factor 2"
# A drafter a user wrote, as the SDK's docstring shows one: it proposes the context's last token again.
YOUR_DRAFTER = """
from drafter_sdk import Drafter


class Repeat(Drafter):
    def prepare_draft_tokens(self, requests):
        return [r.tokens[-1:] * r.draft_len for r in requests]
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The tiny test model and tokenizer saved as a model folder, as `--model` takes it."""
    path = tmp_path / "tiny"
    tiny_model(max_positions=4096).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.timeout(600)  # ten systems, eleven services
def test_bench_runs_every_system_and_reports(tmp_path: Path, model_dir: Path) -> None:
    """Every built-in system, a suffix variant, a drafter of the user's own (--drafter FILE:Class) and one
    already serving (--drafter-target). Draft lengths are fixed (no planner): on the tiny model, verifying two
    tokens costs about twice one, and the planner rightly drafts little in 8 tokens, where this test checks
    that drafts go through every system."""
    out = tmp_path / "results"
    (tmp_path / "my_drafter.py").write_text(YOUR_DRAFTER)
    (tmp_path / "policy.yaml").write_text("policy: {adaptiveDraftLen: false}\n")
    yours = f"{tmp_path / 'my_drafter.py'}:Repeat"
    with LocalService([script("splitspec-drafter"), "ngram"], name="serving-drafter") as serving:
        done = subprocess.run(
            [script("splitspec"), "bench", "--model", str(model_dir), "--prompts", "1", "--max-new-tokens", "8",
             "--workloads", "agentic", "--concurrency", "2", "--suffix-speed-outputs", "0", "--device", "cpu",
             "--suffix-variant=--max-spec-factor 2", "--drafter", yours, "--drafter-target", serving.address,
             "--speculative-config", str(tmp_path / "policy.yaml"), "--out", str(out)],
            capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== agentic (3 prompts) ==" in done.stdout and "== serving" in done.stdout
    report = json.loads((out / "results.json").read_text())
    your_systems = {f"drafter {yours}", f"drafter at {serving.address}"}
    assert {s["system"] for s in report["summaries"]} == SYSTEMS | {VARIANT} | your_systems
    assert all(s["mean_acceptance_length"] for s in report["summaries"] if s["system"] in your_systems), (
        "drafts went through both")
    assert {(c["system"], c["baseline"]) for c in report["comparisons"] if c["system"] in your_systems} == {
        (name, "splitspec ngram remote") for name in your_systems}
    # Agentic: a docstring turn, then two edits, each sending back the answer of the same system.
    assert {s["workload"]: s["prompts"] for s in report["summaries"]} == {"agentic": 3}
    assert {c["workload"] for c in report["comparisons"]} == {"agentic"}
    # The variant is paired with the n-gram remote and with the default suffix drafter, in the same run.
    assert {(c["system"], c["baseline"]) for c in report["comparisons"] if c["system"] == VARIANT} == {
        (VARIANT, "splitspec ngram remote"), (VARIANT, "splitspec suffix remote")}
    assert "suffix remote --max-spec-factor 2 ÷ suffix remote " in done.stdout  # the second pairing says so
    assert all(c["ratio"] > 0 and c["decode_ratio"] > 0 for c in report["comparisons"]), report["comparisons"]
    assert all(lo <= c["ratio"] <= hi for c in report["comparisons"] for lo, hi in [c["ratio_interval"]])
    assert all(s["identical"] == s["prompts"] for s in report["summaries"]), done.stdout
    assert [n for n, _ in report["request_bytes"]] == [100, 500, 1000, 2000]
    sizes = [b for _, b in report["request_bytes"]]
    assert max(sizes[1:]) < 2 * min(sizes[1:]), "deltas, not histories: request size stays flat"
    assert report["serving"][0]["identical"] == report["serving"][0]["requests"]
    assert (out / "chart.png").stat().st_size > 0


def test_bench_drafter_memory_floods_a_real_drafter_within_its_budget(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [script("splitspec"), "bench-drafter-memory", "--sequences", "4", "--tokens", "2000", "--unbounded-calls", "1",
         "--calls", "4", "--max-state-mib", "0.5", "--good-sequences", "2", "--learned-calls", "6",
         "--learned-outputs", "4", "--max-cached-mib", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["accounting"][0]["setting"] == "ngram (defaults)"
    assert report["accounting"][0]["bytes_per_token"] <= 64
    unbounded, budgeted = report["floods"]
    assert unbounded["held_tokens"] == unbounded["sent_tokens"] == 8000
    assert budgeted["calls_ok"] == budgeted["calls"] == 4
    assert budgeted["evictions"]["budget"] > 0 and budgeted["state_mib"] <= 0.5
    assert budgeted["good_resyncs"] == 0, "the flood evicted a verifier within its fair share"
    assert budgeted["good_accepted_per_step"] > 0
    # Far within what the 10-call unbounded flood would take; the real bound is in the README's full run.
    assert budgeted["peak_rss_mib"] - budgeted["baseline_rss_mib"] <= budgeted["max_state_mib"] + 64
    # The suffix drafter's global tree: held to its cap, where without one it takes what it was given.
    capped, uncapped = report["learned"]
    assert capped["calls_ok"] == uncapped["calls_ok"] == 6
    assert capped["learned_tokens"] == uncapped["learned_tokens"] == 6 * 4 * 2000
    assert 0 < capped["cached_mib"] <= capped["max_cached_mib"] == 1
    assert uncapped["cached_mib"] > 4 * capped["cached_mib"]


def test_bench_replay_reports_acceptance_without_timing(tmp_path: Path, model_dir: Path) -> None:
    """The recurring rounds after the first: the suffix drafter remembers the first round, n-gram cannot."""
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--replay", "--model", str(model_dir), "--prompts", "2", "--prompts-for",
         "recurring=1", "--max-new-tokens", "12", "--workloads", "recurring", "--suffix-speed-outputs", "0",
         "--suffix-variant=--cache-scope request", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {(r["drafter"], r["workload"]): r for r in json.loads((out / "replay.json").read_text())["results"]}
    assert results[("suffix", "recurring")]["prompts"] == 2  # rounds 2 and 3 of one question (--prompts-for)
    assert results[("suffix", "recurring")]["mean_acceptance_length"] > 2.0
    assert results[("suffix", "recurring")]["accepted"] > results[("ngram", "recurring")]["accepted"]
    assert results[("suffix-score", "recurring")]["steps"] > 0  # vLLM's choice between the trees, beside it
    # A variant runs with its own flags: without the global tree, the rounds after the first learn nothing.
    assert results[("suffix --cache-scope request", "recurring")]["accepted"] < results[("suffix", "recurring")][
        "accepted"]


@pytest.mark.parametrize("flags, problem", [("--max-spec-factor x", "not flags of"), ("  ", "needs flags"),
                                            ("--port 5", "not --port"),
                                            ("--min-token-prob 2", "min_token_prob must be within")])
def test_bench_suffix_variant_refuses_what_the_suffix_drafter_would_not_take(flags: str, problem: str) -> None:
    assert run.suffix_variants(["--max-spec-factor 2 --cache-scope verifier"]) == {
        "--max-spec-factor 2 --cache-scope verifier": {"max_spec_factor": 2.0, "cache_scope": "verifier"}}
    with pytest.raises(ValueError, match=problem):
        run.suffix_variants([flags])


@pytest.mark.parametrize("mode", [["--trees", "4"], ["--engine-only"],
                                  ["--draft-model", "embedded", "--draft-model-only"]])
def test_bench_refuses_a_suffix_variant_where_no_suffix_system_runs(mode: list[str], tmp_path: Path,
                                                                    capsys) -> None:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    args = parser.parse_args([*mode, "--suffix-variant=--max-spec-factor 2", "--model", "/nonexistent",
                              "--out", str(tmp_path)])
    assert run.main(args) == 2  # before anything loads: the model path is never read
    name = "--trees" if mode[0] == "--trees" else mode[-1]
    assert f"--suffix-variant does not apply to {name}" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [["--replay"], ["--suffix-speed-only"], ["--trees", "4"], ["--engine-only"],
                                  ["--draft-model", "embedded", "--draft-model-only"]])
@pytest.mark.parametrize("yours", [["--drafter", "my_drafter.py:Repeat"], ["--drafter-target", "localhost:50052"]])
def test_bench_refuses_your_drafter_where_no_verifier_drafts_through_a_remote_drafter(
        mode: list[str], yours: list[str], tmp_path: Path, capsys) -> None:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    args = parser.parse_args([*mode, *yours, "--model", "/nonexistent", "--out", str(tmp_path)])
    assert run.main(args) == 2  # before anything loads or starts
    name = "--trees" if mode[0] == "--trees" else mode[-1]
    assert f"--drafter and --drafter-target do not apply to {name}" in capsys.readouterr().err


def test_bench_trees_compares_suffix_chains_and_trees(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--model", str(model_dir), "--trees", "4", "--tree-drafter", "suffix",
         "--prompts", "1", "--max-new-tokens", "12", "--workloads", "recurring", "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "chains vs token trees (suffix in-process" in done.stdout
    rows = json.loads((out / "trees.json").read_text())
    assert {r["system"] for r in rows} == {"chain 4", "tree 4", "chain planner", "tree planner (<= 4 nodes)"}
    assert all(r["identical"] == r["prompts"] for r in rows), done.stdout
    # The rounds after the first draft from the first round's outputs, as chains and as trees.
    assert all(r["verified_per_step"] > 0 for r in rows if r["workload"] == "recurring"), rows


def test_bench_replicas_with_and_without_telling_every_replica(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench-replicas", "--model", str(model_dir), "--prompts", "2", "--max-new-tokens", "24",
         "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the same questions asked again, each through one suffix drafter replica" in done.stdout
    rows = json.loads((out / "replicas.json").read_text())
    assert [(r["setup"], r["replica"]) for r in rows] == [
        ("shared", 1), ("shared", 2), ("added, --peers", 3), ("added, cold", 3), ("not shared", 1),
        ("not shared", 2)]
    assert all(r["identical"] == r["requests"] for r in rows), rows
    assert [r["requests"] for r in rows] == [1, 1, 2, 2, 1, 1]
    # Told of every finished request, both replicas draft the question again; told only of what it served,
    # the other replica drafts from the request's own text alone.
    shared = [r["mean_acceptance_length"] for r in rows if r["setup"] == "shared"]
    alone = sorted(r["mean_acceptance_length"] for r in rows if r["setup"] == "not shared")
    assert min(shared) >= 4.0 and alone[0] < 2.0 <= 4.0 <= alone[1], rows
    # A replica added later drafts them again from what its peers learned; one that started cold cannot.
    added = {r["setup"]: r["mean_acceptance_length"] for r in rows if r["replica"] == 3}
    assert added["added, --peers"] >= 4.0 > 2.0 > added["added, cold"], rows


def test_suffix_speed_measures_the_drafter_itself() -> None:
    sizes = dict(cached=5, output_len=40, sequences=2, context_len=100, steps=3, corpus_tokens=5000)
    [alone] = suffix_speed.measure(tiny_tokenizer(), **sizes)
    speed, variant = suffix_speed.measure(tiny_tokenizer(), {"": {}, "--max-cached-requests 3": {
        "max_cached_requests": 3}}, **sizes)
    assert (speed.flags, speed.cached_outputs, speed.sequences, speed.context_len) == ("", 5, 2, 100)
    assert speed.global_tree_mb == alone.global_tree_mb  # timed beside a variant, on the same outputs
    # A variant's flags reach the drafter timed beside the default: three of the five outputs stay cached.
    assert variant.flags == "--max-cached-requests 3" and variant.global_tree_mb < speed.global_tree_mb
    assert speed.ingest_ms_p50 > 0 and speed.prepare_ms_p90 >= speed.prepare_ms_p50 > 0 and speed.global_tree_mb > 0
    assert speed.tree_nodes == 16 and speed.tree_prepare_ms_p90 >= speed.tree_prepare_ms_p50 > 0
    assert speed.copy_prepare_ms_p90 >= speed.copy_prepare_ms_p50 > 0
    assert speed.snapshot_mb > variant.snapshot_mb > 0 and speed.save_ms_p50 > 0 and speed.restore_s > 0
    assert speed.from_peer_s > 0 and variant.from_peer_s > 0


def test_bench_draft_model_figures_with_and_without_drafting_ahead(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--model", str(model_dir), "--prompts", "1", "--max-new-tokens", "24",
         "--workloads", "grounded,open", "--out", str(out), "--draft-model", str(model_dir),  # drafting for itself
         "--draft-device", "cpu", "--draft-model-only"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    ahead, no_ahead = report["draft_model"]
    assert ahead["draft_ahead"] and not no_ahead["draft_ahead"] and ahead["calls"] > 0 and no_ahead["calls"] > 0
    assert no_ahead["hit_rate"] == 0.0
    assert ahead["acceptance_rate"] >= 0.9 and no_ahead["acceptance_rate"] >= 0.9  # a model drafting for itself
    assert "== draft model" in done.stdout


@pytest.mark.timeout(600)  # eight verifiers start one after another
def test_bench_engine_sections_report_overhead_prefill_gaps_multi_turn_ttft_structured_prediction_priority_graphs(
        tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--model", str(model_dir), "--engine-only", "--engine-sections", "all",
         "--max-new-tokens", "12", "--long-prompt-tokens", "300", "--document-tokens", "200", "--turns", "3",
         "--prompts", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Per-step overhead" in done.stdout and "Multi-turn chat" in done.stdout
    assert "Structured output: 2 templated prompts" in done.stdout
    report = json.loads((out / "engine.json").read_text())
    assert [r["system"] for r in report["overhead"]["rows"]] == ["plain", "remote n-gram", "remote, calls awaited"]
    assert all(r["steps"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in report["overhead"]["rows"])
    for remote in report["overhead"]["rows"][1:]:  # a request's first call is always waited for
        assert remote["call_ms"] > 0 and remote["drafter_server_ms"] > 0  # the call, split: round trip and drafter
        assert 0 <= remote["no_call"] < 1  # steps the planner made no call in
    assert report["overhead"]["rows"][2]["overlapped"] == 0  # --no-overlap-drafter-calls
    assert report["overhead"]["contexts"] == sorted(report["overhead"]["contexts"])  # the decode's contexts
    assert [r["config"] for r in report["prefill_gap"]] == ["chunked (default)", "unchunked"]
    assert all(r["long_prompt_tokens"] == 300 and r["max_gap_during_prefill_ms"] > 0 for r in report["prefill_gap"])
    turns = report["multi_turn"]["rows"]
    assert len(turns) == 3 and all(t["identical"] for t in turns)
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] >= 192 for t in turns[1:])
    structured = report["structured"]["rows"]
    assert [(r["output"], r["speculation"]) for r in structured] == [
        ("free", "plain"), ("free", "remote n-gram"), ("JSON schema", "plain"), ("JSON schema", "remote n-gram")]
    assert all(r["identical_to_plain"] == r["prompts"] == 2 and r["tok_s"] > 0 for r in structured)
    assert [r["valid_json"] is None for r in structured] == [True, True, False, False]
    # The function as its answer's prediction (the random model's answer does not follow it: test_predicted_outputs.py
    # has one that does).
    prediction = report["prediction"]["rows"]
    assert [r["system"] for r in prediction] == ["plain", "remote n-gram", "n-gram + prediction", "drafter down",
                                                 "drafter down + prediction"]
    assert all(r["identical_to_plain"] == r["prompts"] == 2 and r["tok_s"] > 0 for r in prediction)
    assert all(r["accepted_prediction"] == r["rejected_prediction"] == 0 for r in prediction[:2] + prediction[3:4])
    assert prediction[3]["tokens_per_step"] == 1.0  # nothing drafted with the drafter down and no prediction
    assert "Predicted outputs: 2 grounded prompts" in done.stdout
    priority = report["priority"]  # greedy: the preempted background streams' outputs are fcfs's
    assert [r["policy"] for r in priority["rows"]] == ["fcfs", "priority"] and priority["identical"]
    assert priority["preemptions"] >= 1  # the interactive request took a background stream's slot
    assert all(0 < r["ttft_s"] <= r["latency_s"] and r["background_s"] > 0 for r in priority["rows"])
    assert "while two 192-token streams (priority 1) hold both sequence slots" in done.stdout
    graphs = report["cuda_graphs"]  # on a CPU both verifiers run eagerly
    assert [r["system"] for r in graphs] == ["plain", "remote n-gram"]
    assert all(r["identical"] and r["graphs_tok_s"] > 0 and r["eager_tok_s"] > 0 for r in graphs)
    assert "CUDA graphs at batch 1" in done.stdout
    logits = report["logits"]  # the processors alone, kept state against rebuilt
    assert [(r["request"].split()[0], r["draft_tokens"]) for r in logits] == [
        (name, k) for name in ("penalties", "allowed_token_ids", "logit_bias", "bad_words") for k in (0, 4, 16)]
    assert all(0 < r["kept_ms"] and 0 < r["rebuilt_ms"] for r in logits) and "Logits processors" in done.stdout
    sampling = report["sampling"]  # the engine's sampler against the textbook one
    assert [(r["sampling"].split()[0], r["draft_tokens"]) for r in sampling] == [
        (name, k) for name in ("temperature", "top-p", "Qwen3's") for k in (0, 4, 16)]
    assert all(0 < r["engine_ms"] and 0 < r["textbook_ms"] for r in sampling)
    assert "Verifying one sampled row" in done.stdout
    work = report["step_work"]  # the engine's own work a step, by batch size, with a stand-in forward
    assert [r["batch"] for r in work] == [1, 16, 64, 128] and all(r["step_ms"] > 0 for r in work)
    assert "The engine's own work a step" in done.stdout


def test_decode_speed_leaves_the_prefill_out() -> None:
    # Same decode rate (0.1 s a token after the first), one with a prefill 8 s longer: equal decode speed,
    # but 5x apart over the whole request.
    slow_prefill = Run(token_ids=list(range(11)), seconds=10.0, decode_seconds=1.0)
    fast_prefill = Run(token_ids=list(range(11)), seconds=2.0, decode_seconds=1.0)
    half_as_fast = Run(token_ids=list(range(11)), seconds=3.0, decode_seconds=2.0)
    assert bench_report.speed_ratios([fast_prefill], [slow_prefill]) == [pytest.approx(5.0)]
    assert bench_report.relative_decode_speed([fast_prefill], [slow_prefill]) == pytest.approx(1.0)
    assert bench_report.relative_decode_speed([half_as_fast, fast_prefill], [fast_prefill, fast_prefill]) \
        == pytest.approx(0.75)  # the median of 0.5 and 1.0
    one_token = Run(token_ids=[1], seconds=1.0, decode_seconds=0.0)
    assert bench_report.decode_speed(one_token, fast_prefill) is None
    assert math.isnan(bench_report.relative_decode_speed([one_token], [fast_prefill]))


def test_the_median_ratio_comes_with_a_bootstrap_interval_over_prompts() -> None:
    steady = [1.25] * 40
    assert bench_report.median_interval(steady) == (1.25, 1.25)
    spread = [1.0 + i / 100 for i in range(40)]  # 1.00 ... 1.39: median 1.195
    low, high = bench_report.median_interval(spread)
    assert low < statistics.median(spread) < high and 0.05 < high - low < 0.25
    assert bench_report.median_interval(spread) == (low, high)  # seeded: the same run reads the same
    few = bench_report.median_interval(spread[::4])  # 10 prompts of the same spread: a wider interval
    assert few[1] - few[0] > high - low
    assert all(math.isnan(x) for x in bench_report.median_interval([]))


@pytest.mark.parametrize("bad", ["nope=3", "templated=0", "templated", "code=x"])
def test_a_bad_prompt_count_for_one_workload_fails_before_anything_runs(bad: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--prompts-for", bad])
    assert exit_info.value.code == 2 and "give WORKLOAD=N" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "bench-tp"])
def test_a_bad_concurrency_fails_before_anything_runs(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert positive_ints("1,4,16") == [1, 4, 16] and positive_ints("") == []
    for bad in ("0", "2,x", "-1"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--concurrency", bad])
        assert exit_info.value.code == 2 and "--concurrency" in capsys.readouterr().err


def test_a_model_that_cannot_load_fails_the_bench_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "exit_on_sigterm", lambda: None)  # the test process keeps its own SIGTERM handling
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--model", str(tmp_path / "missing"), "--prompts", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"splitspec: model path {tmp_path / 'missing'} does not exist\n"
