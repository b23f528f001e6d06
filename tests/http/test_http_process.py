"""`splitspec-verifier` as a real process: the HTTP port (0 = free, published with
--http-port-file; `off`), and SIGTERM: /health turns 503, new requests are refused, the
stream in flight finishes whole, and the process exits 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from tiny_model import tiny_model, tiny_tokenizer

from verifier_service.api import cli
from verifier_service.settings import DEFAULTS
from verifier_service.tools.local_services import LocalService, script

WAIT_S = 60.0
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_http_port_flag() -> None:
    def settings(*argv: str):  # noqa: ANN202
        return cli.settings_from_args(cli.parser().parse_args(list(argv)))

    assert DEFAULTS.http_port == 8000 and settings().http_port == 8000
    assert settings("--http-port", "0").http_port == 0
    assert settings("--http-port", "off").http_port is None
    assert settings("--served-model-name", "a", "b").served_model_names == ("a", "b")
    assert DEFAULTS.allowed_origins == settings().allowed_origins == ("*",)  # vLLM's default: any web page
    assert settings("--allowed-origins", "https://a.example", "http://b:3000").allowed_origins == (
        "https://a.example", "http://b:3000")
    assert settings("--allowed-origins").allowed_origins == ()  # none: no cross-origin calls
    assert DEFAULTS.responses_store_mb == settings().responses_store_mb == 64
    assert settings("--responses-store-mb", "0").responses_store_mb == 0
    with pytest.raises(cli.config.ConfigError, match="responses_store_mb must be >= 0"):
        settings("--responses-store-mb", "-1")
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--http-port", "eighty"])
    with pytest.raises(cli.config.ConfigError, match="http_port must be within"):
        settings("--http-port", "70000")
    # vLLM's --port is its HTTP port: here that takes gRPC's, and the API's 8000 would find it taken.
    with pytest.raises(cli.config.ConfigError, match="both 8000: vLLM's --port is the one called --http-port here"):
        settings("--port", "8000")
    with pytest.raises(cli.config.ConfigError, match="metrics_port and http_port .* are both 9000"):
        settings("--http-port", "9000", "--metrics-port", "9000")
    assert settings("--port", "0", "--http-port", "0", "--metrics-port", "0").port == 0  # 0s: each its own


def test_sigterm_drains_the_http_api(model_dir: Path, tmp_path: Path) -> None:
    """Also logs in JSON (--log-format json): every line the process writes, uvicorn's included."""
    http_port_file = tmp_path / "http.port"
    verifier = LocalService([script("splitspec-verifier"), "--model", str(model_dir), "--max-model-len", "512",
                             "--kv-cache-memory-gb", "0.25", "--host", "127.0.0.1", "--http-port", "0",
                             "--http-port-file", str(http_port_file), "--served-model-name", "tiny", "small",
                             "--grace-period-s", "60", "--responses-store-mb", "1", "--log-format", "json"],
                            name="verifier", env=ENV, startup_timeout_s=WAIT_S)
    with verifier:
        http_port = int(http_port_file.read_text())
        base = f"http://127.0.0.1:{http_port}"
        with socket.create_connection(("127.0.0.1", http_port), timeout=WAIT_S) as raw:
            raw.sendall(b"NOT HTTP\r\n\r\n")  # uvicorn logs a warning of its own
            raw.recv(1024)
        with httpx.Client(base_url=base, timeout=WAIT_S) as http:
            assert http.get("/health").status_code == 200
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "small"]
            r = http.post("/v1/completions", json={"model": "small", "prompt": "def", "max_tokens": 3})
            assert r.status_code == 200
            response = http.post("/v1/responses", json={"model": "tiny", "input": "def", "max_output_tokens": 3})
            assert response.status_code == 200 and response.json()["store"] is True
            assert http.get(f"/v1/responses/{response.json()['id']}").json() == response.json()
            with http.stream("POST", "/v1/completions", json={"prompt": "def add", "max_tokens": 300, "stream": True,
                                                              "ignore_eos": True}) as stream:
                lines = stream.iter_lines()
                first = next(lines)
                verifier.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + WAIT_S
                while (health := http.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline, "/health never turned 503"
                    time.sleep(0.02)
                assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
                refused = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 3})
                assert refused.status_code == 503
                rest = list(lines)
            events = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
            assert sum(len(e["choices"][0]["splitspec"]["token_ids"]) for e in events) == 300
            assert events[-1]["choices"][0]["finish_reason"] == "length" and "data: [DONE]" in rest
        assert verifier.process.wait(WAIT_S) == 0
        records = [json.loads(line) for line in verifier.current_log.read_text().splitlines()]
    messages = [(r["level"], r["logger"], r["message"]) for r in records]
    assert any(level == "WARNING" and logger == "uvicorn.error" for level, logger, _ in messages), messages
    serving = next(i for i, (_, _, message) in enumerate(messages) if message.startswith("serving tiny-model"))
    # Torch's and transformers' modules and the model left the collector's full passes before it served.
    frozen = next(i for i, (_, _, message) in enumerate(messages) if message.startswith("start-up heap frozen: "))
    assert frozen < serving and int(messages[frozen][2].split()[3]) > 100_000, messages[frozen]


def test_http_off_serves_grpc_only(model_dir: Path, tmp_path: Path) -> None:
    verifier = LocalService([script("splitspec-verifier"), "--model", str(model_dir), "--max-model-len", "256",
                             "--kv-cache-memory-gb", "0.1", "--host", "127.0.0.1", "--http-port", "off",
                             "--http-port-file", str(tmp_path / "http.port")], name="verifier", env=ENV,
                            startup_timeout_s=WAIT_S)
    with verifier:
        assert not (tmp_path / "http.port").exists()
    assert verifier.process.returncode == 0


@pytest.mark.parametrize("command", ["verifier_service.api.cli", "drafter_sdk.server.cli"])
def test_grpc_core_is_held_to_its_errors_before_grpc_is_imported(command: str) -> None:
    """The core reads GRPC_VERBOSITY on a thread of its own right after grpc's import: both commands set its
    default before anything imports grpc (-X importtime lists imports in the order they finish)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           f"import os, {command}; print(os.environ['GRPC_VERBOSITY'])"],
                          env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.stdout.strip() == "ERROR", done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert imported.index("drafter_sdk.service.grpc_core_logs") < imported.index("grpc")


def test_json_logs_stay_json_when_the_drafter_restarts(model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter that stops while the verifier's draft stream is open ends it with a GOAWAY, which gRPC's C
    core logs on its own, as a text line: with --log-format json, every line stays one JSON object. The
    processes start without GRPC_VERBOSITY (this one has it from importing drafter_sdk): they set it."""
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    drafter = LocalService([script("splitspec-drafter"), "ngram", "--grace-period-s", "0"], name="drafter",
                           env=ENV)
    http_port_file = tmp_path / "http.port"
    with drafter:
        verifier = LocalService([script("splitspec-verifier"), "--model", str(model_dir), "--max-model-len", "256",
                                 "--kv-cache-memory-gb", "0.25", "--host", "127.0.0.1", "--http-port", "0",
                                 "--http-port-file", str(http_port_file), "--speculative-mode", "user_provided",
                                 "--drafter-target", drafter.address, "--log-format", "json"],
                                name="verifier", env=ENV, startup_timeout_s=WAIT_S)
        with verifier:
            base = f"http://127.0.0.1:{int(http_port_file.read_text())}"
            with httpx.Client(base_url=base, timeout=WAIT_S) as http:
                # Three restarts: whether the core sees the GOAWAY before the connection closes is a race.
                for restart in (True, True, True, False):
                    r = http.post("/v1/completions", json={"prompt": "def add(a, b): return a + b\n" * 3,
                                                           "max_tokens": 8})
                    assert r.status_code == 200
                    if restart:  # the draft stream is open: the drafter's stop cancels it
                        drafter.stop()
                        drafter.start()
        lines = verifier.current_log.read_text().splitlines()
    assert lines and all(line.startswith("{") for line in lines), [line for line in lines if not line.startswith("{")]
    records = [json.loads(line) for line in lines]
    assert any(r["message"].startswith("serving tiny-model") for r in records), records


def test_the_models_generation_config_sets_what_requests_leave_out(model_dir: Path, tmp_path: Path) -> None:
    """--generation-config auto (the default) reads the --model folder's generation_config.json; one a request
    could not send is refused at start-up, before the weights load, naming the file."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "max_new_tokens": 5}))
    http_port_file = tmp_path / "http.port"
    # The model given first, as `vllm serve MODEL` takes it.
    verifier = LocalService([script("splitspec-verifier"), str(model), "--max-model-len", "256",
                             "--kv-cache-memory-gb", "0.1", "--host", "127.0.0.1", "--http-port", "0",
                             "--http-port-file", str(http_port_file)], name="verifier", env=ENV,
                            startup_timeout_s=WAIT_S)
    with verifier, httpx.Client(base_url=f"http://127.0.0.1:{int(http_port_file.read_text())}", timeout=WAIT_S) as http:
        r = http.post("/v1/completions", json={"prompt": "def", "temperature": 1.0, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5  # the file's max_new_tokens
        # top_k 1 from the file: sampling at temperature 1 picks the most likely token, as greedy decoding does.
        greedy = http.post("/v1/completions", json={"prompt": "def", "temperature": 0, "ignore_eos": True}).json()
        assert r["choices"][0]["text"] == greedy["choices"][0]["text"]
        log = verifier.current_log.read_text()
    assert f"sampling defaults of requests that leave them out: top_k=1 (from {model / 'generation_config.json'}" in log
    assert "default max_new_tokens: 5" in log
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    refused = subprocess.run([script("splitspec-verifier"), "--model", str(model), "--http-port", "off"],
                             env={**os.environ, **ENV}, capture_output=True, text=True, timeout=WAIT_S)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"{model / 'generation_config.json'}: temperature must be within [0, 100]" in refused.stderr
    assert "serving" not in refused.stderr


def test_a_gemma_2_folder_served_by_a_real_process_answers_what_its_own_generate_decodes(tmp_path: Path) -> None:
    """A model whose layers ask for more than causal attention (Gemma 2: a sliding window of 8 tokens, capped
    scores, capped logits) from a --model folder, with the n-gram drafter, to the official client: the text
    transformers' generate() decodes (tests/verifier/model/test_architectures.py holds every row and path)."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    prompt = "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)\n"
    ids = tokenizer(prompt)["input_ids"]
    expected = tokenizer.decode(model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):],
                                skip_special_tokens=True)
    http_port_file = tmp_path / "http.port"
    verifier = LocalService([script("splitspec-verifier"), "--model", str(tmp_path / "gemma2"), "--max-model-len",
                             "256", "--kv-cache-memory-gb", "0.1", "--speculative-mode", "ngram", "--host", "127.0.0.1",
                             "--http-port", "0", "--http-port-file", str(http_port_file)], name="verifier", env=ENV,
                            startup_timeout_s=WAIT_S)
    with verifier:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{int(http_port_file.read_text())}/v1", api_key="-",
                               timeout=WAIT_S)
        answer = client.completions.create(model="gemma2", prompt=prompt, max_tokens=32, temperature=0)
    assert len(ids) + 32 > 5 * config.sliding_window and answer.choices[0].text == expected
