"""Convert a GGUF file to a Hugging Face folder once, and load that folder from then on.

Even read in one pass (gguf_reading.py), a GGUF takes seconds to load: every tensor is dequantised
(2 s for the embedded 135M SmolLM2 on a 2-core CPU; an architecture left to transformers' own
GGUF load takes 35 s). The saved folder loads in under a second, and each tensor-parallel rank
reads its shard from it. The first load saves what the GGUF loads to (config, tokenizer, float32
weights as safetensors) under the cache folder; later loads read that folder. Float32 holds every
dequantised value exactly, and a load in another dtype casts from it as the GGUF load would, so
the weights are the same either way.

The cache key is the GGUF's absolute path, size and modification time, and the transformers
version that converted it: a replaced file or an upgraded converter converts again. A lock file
serialises converters (tensor-parallel ranks start together); a conversion is written to a
temporary folder and renamed into place, so a reader never sees half of one. Before that, the
written folder is loaded back and compared with what the GGUF loaded to, every tensor and the
tokenizer's chat template, special tokens and vocabulary (about a second): a conversion that would
load to anything else is not kept, and the GGUF is loaded directly instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.loading import gguf_reading
from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

CACHE_ENV = "SPLITSPEC_CACHE_DIR"  # where conversions live; "off" loads every GGUF directly
DONE = "converted"  # written last: a folder without it is not a conversion


class ConversionMismatch(RuntimeError):
    """The written folder does not load back to what the GGUF loaded to."""


def cache_root() -> Path | None:
    """`$SPLITSPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/splitspec`, else `~/.cache/splitspec`; None when off."""
    configured = os.environ.get(CACHE_ENV)
    if configured == "off":
        return None
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitspec"


def converted_folder(gguf_path: Path, root: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return root / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def convert(folder: str, gguf_file: str) -> Path | None:
    """The Hugging Face folder converted from `folder/gguf_file`, converting it first if need be;
    None when the cache is off or cannot be written (the caller then loads the GGUF itself)."""
    root = cache_root()
    if root is None:
        return None
    gguf_path = Path(folder) / gguf_file
    target = converted_folder(gguf_path, root)
    if (target / DONE).exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f"{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / DONE).exists():
                _write(folder, gguf_file, target)
    except (OSError, ConversionMismatch) as e:
        log.warning("cannot cache the conversion of %s under %s (%s); loading the GGUF directly", gguf_path, root, e)
        return None
    return target


def _write(folder: str, gguf_file: str, target: Path) -> None:
    started = time.monotonic()
    log.info("converting %s once (tokenizer and float32 weights) into %s", gguf_file, target)
    path = str(Path(folder) / gguf_file)
    tokenizer = gguf_reading.load_tokenizer(path)
    model = gguf_reading.load_model(path, torch.float32)
    # The "quantizer" transformers' GGUF load attaches only dequantised; what it left is plain float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        checked = check_loads_back(model, tokenizer, staging)
        (staging / DONE).write_text(f"{folder}/{gguf_file}\nloads back equal: {checked} tensors and the tokenizer\n")
        if target.exists():  # an unfinished folder from a conversion that died
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf_file, time.monotonic() - started)


def check_loads_back(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> int:
    """Load `folder` and compare it with `model` and `tokenizer`: every tensor bit for bit, and the
    tokenizer's vocabulary, special tokens and chat template. Returns the tensors compared; raises
    ConversionMismatch at the first difference."""
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    original = model.state_dict()
    if saved.keys() != original.keys():
        raise ConversionMismatch(f"the saved model has other tensors ({sorted(saved.keys() ^ original.keys())[:3]})")
    different = next((name for name, t in original.items() if not torch.equal(saved[name], t)), None)
    if different is not None:
        raise ConversionMismatch(f"tensor {different} loads back different")
    loaded = AutoTokenizer.from_pretrained(folder)
    if (tokenizer_fingerprint(loaded) != tokenizer_fingerprint(tokenizer)
            or loaded.chat_template != tokenizer.chat_template or loaded.eos_token_id != tokenizer.eos_token_id):
        raise ConversionMismatch("the saved tokenizer loads back different")
    return len(original)
