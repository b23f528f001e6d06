""".ci/gpu-model: the embedded model goes to a device machine in parts of at most 64 MiB a call, and
gpu-check joins them there. Run as gpu-check runs it, on a stand-in file split into 1 MiB parts."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def gpu_model(*args: str, model: Path, parts: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_MODEL_FILE": str(model), "GPU_MODEL_DIR": str(parts), "GPU_MODEL_PART_MIB": "1"}
    return subprocess.run(["bash", str(ROOT / ".ci" / "gpu-model"), *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def split(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(2 * MIB + 12345))
    parts = tmp_path / "parts"
    done = gpu_model("split", model=model, parts=parts)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in parts.glob("*.part-*")) == [f"model.gguf.part-0{i}" for i in range(3)]
    # Every path of the folder is carried in some call, and no call carries more than 64 MiB.
    calls = [ast.literal_eval(m) for m in re.findall(r"^call \d+: carry (\[.*?\])", done.stdout, re.M)]
    assert sorted(p for call in calls for p in call if p != ".whl") == sorted(str(p) for p in parts.iterdir())
    assert all(sum(Path(p).stat().st_size for p in call if p != ".whl") <= 64 * MIB for call in calls)
    assert "bash .ci/gpu-check" in done.stdout.splitlines()[-1]
    return model, parts


def test_the_joined_parts_are_the_model(split: tuple[Path, Path], tmp_path: Path) -> None:
    model, parts = split
    done = gpu_model("join", str(tmp_path / "out"), model=model, parts=parts)
    assert done.returncode == 0, done.stderr
    joined = Path(done.stdout.strip())
    assert joined == tmp_path / "out" / "model.gguf"
    assert joined.read_bytes() == model.read_bytes()


def test_a_missing_part_is_named_and_nothing_is_joined(split: tuple[Path, Path], tmp_path: Path) -> None:
    model, parts = split
    (parts / "model.gguf.part-01").unlink()
    done = gpu_model("join", str(tmp_path / "out"), model=model, parts=parts)
    assert done.returncode == 1
    assert "1 of 3 parts missing" in done.stderr and "model.gguf.part-01" in done.stderr
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_a_corrupt_part_fails_the_checksum_and_leaves_no_file(split: tuple[Path, Path], tmp_path: Path) -> None:
    model, parts = split
    part = parts / "model.gguf.part-02"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    done = gpu_model("join", str(tmp_path / "out"), model=model, parts=parts)
    assert done.returncode == 1
    assert "sha256" in done.stderr
    assert not (tmp_path / "out" / "model.gguf").exists()
