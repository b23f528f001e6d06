"""The sampling a model's creators recommend, from its generation_config.json: what a request's
left-out sampling fields take, as vLLM's `--generation-config auto` (its default) applies it.

Reasoning models ship it and need it: Qwen3 and the DeepSeek-R1 distills ask for temperature 0.6
and top-p 0.95, and loop under greedy decoding. Only the keys the file itself sets count, read
from its JSON: transformers' GenerationConfig fills in class defaults (top_k 50) that would look
set. As in vLLM, `do_sample` is not read. `--override-generation-config` sets keys on top of the
file, `--generation-config vllm` reads none, and a folder reads that folder's file instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafter_sdk.errors import ModelLoadError

FILE = "generation_config.json"
# --generation-config: the model's own file, or none (vLLM's names); anything else is a folder.
AUTO, NONE = "auto", "vllm"
# The keys read, vLLM's, with their types; max_new_tokens is a request's default max_new_tokens.
SAMPLING_KEYS: Mapping[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                                     "repetition_penalty": float}
KEYS: Mapping[str, type] = {**SAMPLING_KEYS, "max_new_tokens": int}


@dataclass(frozen=True)
class SamplingDefaults:
    # SamplingParams fields (verifier.proto) a request leaves out take these; a field absent here
    # keeps its own default (temperature 0: greedy).
    sampling: Mapping[str, float | int] = field(default_factory=dict)
    max_new_tokens: int | None = None  # a request's length when it sets none; None: not set here
    origin: str = ""  # where they were read, for messages: "<path>", "--override-generation-config"

    def describe(self) -> str:
        return ", ".join(f"{k}={v:g}" for k, v in self.sampling.items())


def read(setting: str, model_path: str | None, overrides: Mapping[str, Any]) -> SamplingDefaults:
    """The defaults `setting` names (AUTO: `model_path`'s file, a folder or a hub id, None: no file;
    NONE: no file; else a folder holding one), `overrides` on top. Raises ModelLoadError for a file
    that is missing where named, unreadable, or whose values are not numbers of the right type."""
    values: dict[str, float | int] = {}
    origins = []
    path = _file(setting, model_path)
    if path is not None:
        values = _values(_json(path), str(path))
        origins.append(str(path))
    if overrides:
        values.update(_values(overrides, "--override-generation-config"))
        origins.append("--override-generation-config")
    max_new_tokens = values.pop("max_new_tokens", None)
    return SamplingDefaults(values, int(max_new_tokens) if max_new_tokens is not None else None, " and ".join(origins))


def parse_overrides(text: str) -> dict[str, Any]:
    """--override-generation-config's JSON object (ValueError when it is not one)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.6}'")
    return value


def check_overrides(overrides: Mapping[str, Any]) -> None:
    """ValueError unless every key is one of KEYS, set to a number of its type."""
    unknown = sorted(overrides.keys() - KEYS.keys())
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
    _values(overrides, "override_generation_config")


def _file(setting: str, model_path: str | None) -> Path | None:
    if setting == NONE:
        return None
    if setting != AUTO:
        path = Path(setting).expanduser() / FILE
        if not path.is_file():
            raise ModelLoadError(f"--generation-config {setting}: no {FILE} in that folder")
        return path
    if model_path is None:
        return None
    if Path(model_path).is_dir():
        path = Path(model_path) / FILE
        return path if path.is_file() else None
    # A hub id: the file beside its weights in the Hugging Face cache (fetched where it may be). Imported
    # here: settings.py imports this module, and the verifier's flags are answered without transformers.
    from transformers.utils import cached_file

    found = cached_file(model_path, FILE, _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False)
    return Path(found) if found else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return value


def _values(raw: Mapping[str, Any], origin: str) -> dict[str, float | int]:
    """The KEYS `raw` sets (null: unset), as their types; ModelLoadError naming `origin` for any other value."""
    values: dict[str, float | int] = {}
    for key, kind in KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ModelLoadError(f"{origin}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"not {value!r}")
        values[key] = kind(value)
    return values
