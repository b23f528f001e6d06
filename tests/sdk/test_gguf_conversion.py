"""The GGUF conversion cache: converted once, and kept only if it loads back to what the GGUF loads to."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from tiny_gguf import Q, write_tiny_gguf
from tiny_model import tiny_model, tiny_tokenizer

from drafter_sdk.loading import causal_lm, gguf_conversion

CHAT = [{"role": "user", "content": "Résumé of café ünïcode 🙂, in one line."}]


def test_a_gguf_is_converted_once_and_checked_against_its_own_load(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, Q.Q4_1)
    source = causal_lm.ModelSource("tiny", str(tmp_path), gguf.name)
    folder = causal_lm.converted(source)
    assert folder.gguf_file is None and Path(folder.path).is_relative_to(os.environ[gguf_conversion.CACHE_ENV])
    done = Path(folder.path) / gguf_conversion.DONE
    converted_at = done.stat().st_mtime_ns
    assert causal_lm.converted(source) == folder and done.stat().st_mtime_ns == converted_at, "converted once"
    # The conversion loaded the folder back and compared it with the GGUF's own load (check_loads_back).
    assert f"loads back equal: {len(tiny_model().state_dict())} tensors and the tokenizer" in done.read_text()
    tokenizer = causal_lm.load_tokenizer(folder)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False).endswith("<|assistant|>")


def test_a_conversion_that_loads_back_different_is_not_kept(tmp_path: Path) -> None:
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert gguf_conversion.check_loads_back(model, tokenizer, tmp_path) == len(model.state_dict())
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-6
    with pytest.raises(gguf_conversion.ConversionMismatch, match="model.norm.weight loads back different"):
        gguf_conversion.check_loads_back(model, tokenizer, tmp_path)
    other = tiny_tokenizer().__class__.from_pretrained(tmp_path)
    other.chat_template = "{{ messages }}"
    with pytest.raises(gguf_conversion.ConversionMismatch, match="tokenizer"):
        gguf_conversion.check_loads_back(tiny_model(), other, tmp_path)


def test_a_replaced_gguf_or_another_transformers_converts_again(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"first")
    first = gguf_conversion.converted_folder(gguf, tmp_path)
    assert gguf_conversion.converted_folder(gguf, tmp_path) == first
    os.utime(gguf, ns=(1, 1))
    assert gguf_conversion.converted_folder(gguf, tmp_path) != first
    touched = gguf_conversion.converted_folder(gguf, tmp_path)
    monkeypatch.setattr(gguf_conversion.transformers, "__version__", "0.0.0")
    assert gguf_conversion.converted_folder(gguf, tmp_path) != touched


def test_cache_off_or_unwritable_loads_the_gguf_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not converted")
    source = causal_lm.ModelSource("model", str(tmp_path), gguf.name)
    monkeypatch.setenv(gguf_conversion.CACHE_ENV, "off")
    assert causal_lm.converted(source) == source
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_conversion.CACHE_ENV, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING):
        assert causal_lm.converted(source) == source
    assert "loading the GGUF directly" in caplog.text
    folder = causal_lm.ModelSource("model", str(tmp_path))
    assert causal_lm.converted(folder) == folder
