"""The GGUF conversion cache: what a later start loads is what the GGUF itself loads to."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter_sdk import gguf_conversion, hf_loading
from drafter_sdk.tokenizer_fingerprint import tokenizer_fingerprint

CHAT = [{"role": "user", "content": "Résumé of café ünïcode 🙂, in one line."}]


@pytest.mark.real_model
def test_converted_embedded_model_loads_the_same_weights_and_tokenizer_as_its_gguf() -> None:
    source = hf_loading.embedded_source()
    folder = hf_loading.converted(source)
    assert folder.gguf_file is None and Path(folder.path).is_relative_to(os.environ[gguf_conversion.CACHE_ENV])
    done = Path(folder.path) / gguf_conversion.DONE
    converted_at = done.stat().st_mtime_ns
    assert hf_loading.converted(source) == folder and done.stat().st_mtime_ns == converted_at, "converted once"

    cached = hf_loading.load_causal_lm(source, torch.float32, torch.device("cpu")).state_dict()
    direct = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                  dtype=torch.float32).state_dict()
    assert cached.keys() == direct.keys()
    assert all(torch.equal(cached[name], direct[name]) for name in direct)

    tokenizer = hf_loading.load_tokenizer(source)
    gguf_tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(gguf_tokenizer)
    assert (tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
            == gguf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    assert tokenizer.eos_token_id == gguf_tokenizer.eos_token_id


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
    source = hf_loading.ModelSource("model", str(tmp_path), gguf.name)
    monkeypatch.setenv(gguf_conversion.CACHE_ENV, "off")
    assert hf_loading.converted(source) == source
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_conversion.CACHE_ENV, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING):
        assert hf_loading.converted(source) == source
    assert "loading the GGUF directly" in caplog.text
    folder = hf_loading.ModelSource("model", str(tmp_path))
    assert hf_loading.converted(folder) == folder
