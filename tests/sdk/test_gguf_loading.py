"""The one-pass GGUF load gives what transformers' own GGUF load gives, bit for bit, in a fraction of the time."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from tiny_gguf import Q, write_tiny_gguf
from tiny_model import tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drafter_sdk.loading import causal_lm, gguf_conversion, gguf_reading
from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint


@pytest.mark.parametrize("architecture,storage", [
    *(("llama", q) for q in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_1)), ("qwen2", Q.F32), ("qwen2", Q.Q4_1), ("qwen3", Q.F32),
    ("qwen3", Q.Q8_0)], ids=lambda p: getattr(p, "name", p))
def test_one_pass_loads_what_transformers_loads(tmp_path: Path, architecture: str,
                                                storage: gguf.GGMLQuantizationType) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path, storage, architecture)
    assert gguf_reading.one_pass_header(str(path)) is not None

    config = gguf_reading.load_config(str(path))
    assert config.to_dict() == AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()

    tokenizer = gguf_reading.load_tokenizer(str(path))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(tokenizer) is type(reference)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(reference)
    assert tokenizer.init_kwargs == reference.init_kwargs and tokenizer.chat_template == reference.chat_template
    text = "def add(a, b):\n    return a + b  # café 🙂"
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids

    loaded = gguf_reading.load_model(str(path), torch.float32).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert loaded.keys() == expected.keys()
    assert [name for name, t in loaded.items() if not torch.equal(t, expected[name])] == []
    if storage == Q.F32:  # nothing lost on the way: the model that was written
        assert all(torch.equal(loaded[name], t) for name, t in written.state_dict().items())


def test_a_load_in_another_dtype_casts_the_dequantised_weights(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q8_0)
    full = gguf_reading.load_model(str(path), torch.float32).state_dict()
    half = gguf_reading.load_model(str(path), torch.bfloat16).state_dict()
    assert all(half[name].dtype == torch.bfloat16 and torch.equal(half[name], t.to(torch.bfloat16))
               for name, t in full.items())


def test_what_one_pass_does_not_read_goes_to_transformers(tmp_path: Path) -> None:
    other = tmp_path / "phi3.gguf"
    write_tiny_gguf(other, architecture="phi3")
    header = gguf_reading.read_header(str(other))
    assert header.architecture == "phi3" and not header.one_pass
    assert gguf_reading.one_pass_header(str(other)) is None
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="ends inside its GGUF header"):
        gguf_reading.read_header(str(short))
    assert gguf_reading.one_pass_header(str(short)) is None
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_reading.read_header(str(text))


def test_with_the_cache_off_a_gguf_loads_in_one_pass_to_what_its_conversion_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q4_1)
    source = causal_lm.ModelSource("tiny", str(tmp_path), path.name)
    folder = causal_lm.converted(source)
    assert folder.gguf_file is None
    monkeypatch.setenv(gguf_conversion.CACHE_ENV, "off")
    assert causal_lm.converted(source) == source
    direct = causal_lm.load_causal_lm(source, torch.float32, torch.device("cpu")).state_dict()
    from_folder = causal_lm.load_causal_lm(folder, torch.float32, torch.device("cpu")).state_dict()
    assert direct.keys() == from_folder.keys()
    assert all(torch.equal(from_folder[name], t) for name, t in direct.items())


@pytest.mark.real_model
def test_the_embedded_model_reads_in_one_pass() -> None:
    source = causal_lm.embedded_source()
    header = gguf_reading.one_pass_header(causal_lm.gguf_path(source))
    assert header is not None and len(header.tensors) == 272
    assert causal_lm.load_config(source).num_hidden_layers == 30
    chat = [{"role": "user", "content": "Résumé of café ünïcode 🙂, in one line."}]
    rendered = causal_lm.load_tokenizer(source).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system") and rendered.endswith("<|im_start|>assistant\n")
