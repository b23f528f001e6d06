"""Drafters that misbehave on command, for fault tests with real processes.

Served by the SDK like any user drafter:

    splitspec-drafter tests/faulty_drafters.py:FaultyDrafter --port 0 --port-file PORT

The behaviour comes from a JSON control file named by $FAULTY_DRAFTER_CONTROL,
re-read whenever it changes, so a test switches faults while the process runs:

    {"mode": "ok" | "hang" | "slow_some" | "raise",
     "oracle": [[prompt + expected output ids], ...],   # what "ok" drafts from
     "slow_every": 4, "slow_s": 0.3}                      # slow_some: every Nth call sleeps

- ok: drafts the known continuation of the sequence (an oracle: the target's own
  greedy output, so drafts are accepted and a resumed drafter is visible in the
  acceptance figures); unknown sequences get no draft.
- hang: blocks inside prepare_draft_tokens until the mode changes (past any deadline).
- slow_some: every `slow_every`-th call sleeps `slow_s` first, the others are ok.
- raise: prepare_draft_tokens raises, which the SDK answers with INTERNAL.

FaultyDrafter looks ahead (capability "lookahead"): its oracle drafts are accepted whole, so steps
may verify the rest of the last answer and read their own call after the forward, and the faults
meet calls in flight too. FaultyModelDrafter has the same faults but drafts with the SDK's
ModelDrafter (the model folder named by $FAULTY_DRAFTER_MODEL) instead of the oracle, and waits
for every call as a model drafter does.

Counters go to the JSON file named by $FAULTY_DRAFTER_STATS after every call:
{"pid", "calls", "calls_by_mode": {...}, "sequences", "released"}.

`oracle_draft` is shared with the raw wire-level server (faulty_drafter_server.py).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from drafter_sdk import LOOKAHEAD, Drafter, DraftRequest

CONTROL_ENV = "FAULTY_DRAFTER_CONTROL"
STATS_ENV = "FAULTY_DRAFTER_STATS"
MODEL_ENV = "FAULTY_DRAFTER_MODEL"

OracleTable = dict[tuple[int, ...], list[int]]


def oracle_table(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> OracleTable:
    return {tuple(seq[:n]): list(seq) for seq, n in zip(sequences, prompt_lens)}


def oracle_draft(table: OracleTable, tokens: Sequence[int], prompt_len: int, draft_len: int) -> list[int]:
    """The next `draft_len` tokens of the known sequence that `tokens` is a prefix of, else []."""
    full = table.get(tuple(tokens[:prompt_len]))
    if full is None or draft_len <= 0 or len(tokens) >= len(full) or list(full[:len(tokens)]) != list(tokens):
        return []
    return list(full[len(tokens):len(tokens) + draft_len])


def load_control(path: str | os.PathLike[str]) -> tuple[dict, OracleTable]:
    control = json.loads(Path(path).read_text())
    entries = control.get("oracle", [])
    return control, oracle_table([e["ids"] for e in entries], [e["prompt_len"] for e in entries])


def write_control(path: str | os.PathLike[str], mode: str, oracle: Sequence[tuple[Sequence[int], int]] = (),
                  **knobs: object) -> None:
    """Atomically (re)write a control file; `oracle` holds (prompt + output ids, prompt_len) pairs."""
    path = Path(path)
    body = {"mode": mode, "oracle": [{"ids": list(ids), "prompt_len": n} for ids, n in oracle], **knobs}
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


class FaultyDrafter(Drafter):
    name = "faulty-sdk"
    version = "1.0"
    capabilities = (LOOKAHEAD,)

    def __init__(self) -> None:
        self.control_path = os.environ.get(CONTROL_ENV, "")
        self.stats_path = os.environ.get(STATS_ENV, "")
        self.control: dict = {"mode": "ok"}
        self.table: OracleTable = {}
        self._mtime = 0.0
        self.calls = 0
        self.sequences = 0
        self.released = 0
        self.by_mode: Counter[str] = Counter()

    def _refresh(self) -> None:
        if not self.control_path:
            return
        try:
            mtime = os.stat(self.control_path).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._mtime:
            self.control, self.table = load_control(self.control_path)
            self._mtime = mtime

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        self._refresh()
        mode = self.control.get("mode", "ok")
        self.calls += 1
        self.sequences += len(requests)
        self.by_mode[mode] += 1
        self._write_stats()
        if mode == "hang":
            while self.control.get("mode") == "hang":  # until the test says otherwise
                time.sleep(0.02)
                self._refresh()
        elif mode == "slow_some" and self.calls % int(self.control.get("slow_every", 4)) == 0:
            time.sleep(float(self.control.get("slow_s", 0.3)))
        elif mode == "raise":
            raise RuntimeError("injected drafter bug")
        return self.draft(requests)

    def draft(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [oracle_draft(self.table, r.tokens, r.prompt_len, r.draft_len) for r in requests]

    def on_release(self, key: tuple[str, str]) -> None:
        self.released += 1

    def _write_stats(self) -> None:
        if not self.stats_path:
            return
        tmp = Path(self.stats_path + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "calls": self.calls, "sequences": self.sequences,
                                   "released": self.released, "calls_by_mode": dict(self.by_mode)}))
        tmp.replace(self.stats_path)


class FaultyModelDrafter(FaultyDrafter):
    """The same faults in front of the SDK's ModelDrafter (drafts from the model in $FAULTY_DRAFTER_MODEL,
    not from the oracle): the draft model's own KV state goes through every fault."""

    name = "faulty-model"
    capabilities = ()  # each token a forward of the draft model

    def __init__(self) -> None:
        super().__init__()
        from drafter_sdk.drafters.model import ModelDrafter  # torch only for this drafter

        self.model = ModelDrafter(os.environ[MODEL_ENV], device="cpu", dtype="float32", max_draft_len=8)

    def load(self) -> None:
        self.model.load()
        self.vocab_size, self.tokenizer = self.model.vocab_size, self.model.tokenizer
        self.tokenizer_fingerprint = self.model.tokenizer_fingerprint

    def draft(self, requests: list[DraftRequest]) -> list[list[int]]:
        return self.model.prepare_draft_tokens(requests)

    def on_release(self, key: tuple[str, str]) -> None:
        super().on_release(key)
        self.model.on_release(key)


def read_stats(path: str | os.PathLike[str]) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"calls": 0, "sequences": 0, "released": 0, "calls_by_mode": {}}
