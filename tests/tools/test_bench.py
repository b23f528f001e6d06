"""`splitspec bench` end to end on a tiny model saved to disk: every system runs, every output
matches plain decoding, and the report, JSON and chart are written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tiny_model import tiny_model, tiny_tokenizer

from verifier_service.tools.local_services import script

SYSTEMS = {"splitspec plain", "splitspec ngram in-process", "splitspec ngram remote", "transformers generate",
           "transformers prompt lookup"}


def test_bench_runs_every_system_and_reports(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    tiny_model(max_positions=4096).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--model", str(model_dir), "--prompts", "1", "--max-new-tokens", "12",
         "--workloads", "grounded,open", "--concurrency", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== grounded (1 prompts) ==" in done.stdout and "== serving" in done.stdout
    report = json.loads((out / "results.json").read_text())
    assert {s["system"] for s in report["summaries"]} == SYSTEMS
    assert all(s["identical"] == s["prompts"] == 1 for s in report["summaries"]), done.stdout
    assert [n for n, _ in report["request_bytes"]] == [100, 500, 1000, 2000]
    sizes = [b for _, b in report["request_bytes"]]
    assert max(sizes[1:]) < 2 * min(sizes[1:]), "deltas, not histories: request size stays flat"
    assert report["serving"][0]["identical"] == report["serving"][0]["requests"]
    assert (out / "chart.png").stat().st_size > 0


@pytest.mark.timeout(600)  # three verifiers start one after another
def test_bench_engine_sections_report_overhead_prefill_gaps_and_multi_turn_ttft(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    tiny_model(max_positions=4096).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "results"
    done = subprocess.run(
        [script("splitspec"), "bench", "--model", str(model_dir), "--engine-only", "--engine-sections", "all",
         "--max-new-tokens", "12", "--long-prompt-tokens", "300", "--document-tokens", "200", "--turns", "3",
         "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Per-step overhead" in done.stdout and "Multi-turn chat" in done.stdout
    report = json.loads((out / "engine.json").read_text())
    assert [r["system"] for r in report["overhead"]["rows"]] == ["plain", "remote n-gram"]
    assert all(r["steps"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in report["overhead"]["rows"])
    assert [r["config"] for r in report["prefill_gap"]] == ["chunked (default)", "unchunked"]
    assert all(r["long_prompt_tokens"] == 300 and r["max_gap_during_prefill_ms"] > 0 for r in report["prefill_gap"])
    turns = report["multi_turn"]["rows"]
    assert len(turns) == 3 and all(t["identical"] for t in turns)
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] >= 192 for t in turns[1:])
