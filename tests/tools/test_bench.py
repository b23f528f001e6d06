"""`splitspec bench` end to end on a tiny model saved to disk: every system runs, every output
matches plain decoding, and the report, JSON and chart are written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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
         "--workloads", "grounded,open", "--concurrency", "2", "--device", "cpu", "--out", str(out)],
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


def test_bench_drafter_memory_floods_a_real_drafter_within_its_budget(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [script("splitspec"), "bench-drafter-memory", "--sequences", "4", "--tokens", "2000", "--unbounded-calls", "1",
         "--calls", "4", "--max-state-mib", "0.5", "--good-sequences", "2", "--json", str(out)],
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
