"""Reading a model's recommended sampling (model/generation_config.py), the flags that choose and
override it, and the refusals at start-up. What requests do with it: tests/http/test_sampling_defaults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drafter_sdk.errors import ModelLoadError
from verifier_service.api import cli, request_parsing
from verifier_service.model.generation_config import SamplingDefaults, read
from verifier_service.settings import DEFAULTS, ServerSettings
from verifier_service.spec_decode.config import ConfigError

# As Qwen3's, with the keys no default reads and a null.
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": None, "transformers_version": "4.51.0"}


def _folder(path: Path, values: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(values))
    return path


def test_auto_reads_only_the_keys_the_file_sets(tmp_path: Path) -> None:
    model = _folder(tmp_path / "qwen3", QWEN3)
    defaults = read("auto", str(model), {})
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert isinstance(defaults.sampling["top_k"], int) and defaults.max_new_tokens is None
    assert defaults.origin == str(model / "generation_config.json")
    assert defaults.describe() == "temperature=0.6, top_p=0.95, top_k=20"
    with_length = _folder(tmp_path / "long", {"max_new_tokens": 2048, "repetition_penalty": 1.05, "top_k": 40.0})
    assert read("auto", str(with_length), {}) == SamplingDefaults(
        {"repetition_penalty": 1.05, "top_k": 40}, 2048, str(with_length / "generation_config.json"))


def test_no_file_vllm_and_a_folder_of_ones_own(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", QWEN3)
    (tmp_path / "bare").mkdir()
    assert read("auto", str(tmp_path / "bare"), {}) == SamplingDefaults()  # a model without the file
    assert read("auto", None, {}) == SamplingDefaults()  # a model given in-process
    assert read("vllm", str(model), {}) == SamplingDefaults()
    mine = _folder(tmp_path / "mine", {"temperature": 0.3})
    assert read(str(mine), str(model), {}).sampling == {"temperature": 0.3}
    with pytest.raises(ModelLoadError, match=r"--generation-config .*bare: no generation_config.json in that folder"):
        read(str(tmp_path / "bare"), str(model), {})


def test_overrides_set_keys_on_top_of_the_file(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", QWEN3)
    defaults = read("auto", str(model), {"temperature": 0, "max_new_tokens": 64})
    assert defaults.sampling == {"temperature": 0.0, "top_p": 0.95, "top_k": 20} and defaults.max_new_tokens == 64
    assert defaults.origin == f"{model / 'generation_config.json'} and --override-generation-config"
    assert read("vllm", str(model), {"top_p": 0.8}) == SamplingDefaults({"top_p": 0.8}, None,
                                                                       "--override-generation-config")


@pytest.mark.parametrize(("text", "words"), [
    ("{", "cannot read"),
    ("[0.6]", "is not a JSON object"),
    ('{"temperature": "warm"}', "temperature must be a number, not 'warm'"),
    ('{"top_k": 2.5}', "top_k must be an integer, not 2.5"),
    ('{"max_new_tokens": true}', "max_new_tokens must be an integer, not True"),
])
def test_a_file_that_cannot_be_read_is_refused_naming_it(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*{words}" if words != "cannot read" else words):
        read("auto", str(tmp_path), {})


@pytest.mark.parametrize(("values", "words"), [
    ({"temperature": 500}, r"temperature must be within \[0, 100\]"),
    ({"top_p": 1.5}, r"top_p must be within \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"min_p": 2}, r"min_p must be within \[0, 1\]"),
    ({"repetition_penalty": -1}, "repetition_penalty must be > 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
])
def test_values_a_request_could_not_send_are_refused_at_start_up(tmp_path: Path, values: dict[str, float],
                                                                 words: str) -> None:
    model = _folder(tmp_path, values)
    with pytest.raises(ConfigError, match=f"{model / 'generation_config.json'}: {words}"):
        request_parsing.sampling_defaults(DEFAULTS, str(model))
    with pytest.raises(ConfigError, match=f"--override-generation-config: {words}"):
        request_parsing.sampling_defaults(ServerSettings(generation_config="vllm", override_generation_config=values),
                                          None)


def test_the_flags() -> None:
    def settings(*argv: str) -> ServerSettings:
        return cli.settings_from_args(cli.parser().parse_args(list(argv)))

    assert DEFAULTS.generation_config == settings().generation_config == "auto"
    assert DEFAULTS.default_max_new_tokens is None and not DEFAULTS.override_generation_config
    assert settings("--generation-config", "vllm").generation_config == "vllm"
    given = settings("--override-generation-config", '{"temperature": 0.6, "top_p": 0.95}')
    assert given.override_generation_config == {"temperature": 0.6, "top_p": 0.95}
    assert settings("--default-max-new-tokens", "9").default_max_new_tokens == 9
    assert settings("/models/a").model == settings("--model", "/models/a").model == "/models/a"  # as `vllm serve`
    for flags, words in [
        (["--override-generation-config", "{temperature: 1}"], "--override-generation-config is not valid JSON"),
        (["--override-generation-config", "0.6"], "--override-generation-config must be a JSON object"),
        (["--override-generation-config", '{"do_sample": false}'], "unknown key.*do_sample; known: temperature"),
        (["--override-generation-config", '{"top_k": "20"}'], "top_k must be an integer"),
        (["--override-generation-config", '{"max_new_tokens": 9}', "--default-max-new-tokens", "9"],
         "both set the default: give one"),
        (["--default-max-new-tokens", "0"], "default_max_new_tokens must be at least 1"),
        (["/models/a", "--model", "/models/b"], "two models: /models/a and --model /models/b"),
    ]:
        with pytest.raises(ConfigError, match=words):
            settings(*flags)


def test_a_hub_models_file_comes_from_the_hugging_face_cache(tmp_path: Path) -> None:
    """Offline, from the cache's layout (a process: the hub's settings are read at its import)."""
    snapshot = tmp_path / "models--org--reasoner" / "snapshots" / ("0" * 40)
    _folder(snapshot, QWEN3)
    (tmp_path / "models--org--reasoner" / "refs").mkdir()
    (tmp_path / "models--org--reasoner" / "refs" / "main").write_text("0" * 40)
    code = ("from verifier_service.model.generation_config import read; "
            "print(dict(read('auto', 'org/reasoner', {}).sampling)); "
            "print(dict(read('auto', 'org/other', {}).sampling))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str({"temperature": 0.6, "top_p": 0.95, "top_k": 20}), "{}"]

