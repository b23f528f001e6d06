"""Which rank of a tensor-parallel verifier this process is, whether the model can be split, and
starting the other ranks.

`splitspec-verifier --tensor-parallel-size N` is rank 0 (servers, scheduler, drafter client,
sampler) and starts ranks 1..N-1 itself, as `vllm serve --tensor-parallel-size` does: each runs
the same command line and learns its rank from the variables torchrun sets (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A process that torchrun started finds them already set,
and starts no one.

transformers' tensor-parallel plans shard attention by heads, so a model splits N ways only if
N divides both its query and its KV head counts; that is checked from the config before any
rank starts.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

log = logging.getLogger(__name__)


class ShardingError(ValueError):
    """The model, the devices or the launch cannot give the tensor parallelism asked for."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int  # the GPU index of this rank on CUDA
    size: int  # the tensor-parallel size (the world size)
    master_addr: str
    master_port: int
    start_others: bool  # rank 0 starts ranks 1..size-1 (False when torchrun started them)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def environ_for(self, rank: int) -> dict[str, str]:
        """What torchrun would give `rank` on this machine."""
        return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.size),
                "LOCAL_WORLD_SIZE": str(self.size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def this_rank(size: int) -> Ranks:
    """This process's place among `size` ranks: from torchrun's variables, else rank 0 of a group
    it will start itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ShardingError(f"started as one of {world} ranks (WORLD_SIZE={world}), but "
                                f"--tensor-parallel-size is {size}: launch {size} processes or pass "
                                f"--tensor-parallel-size {world}")
        rank = int(os.environ["RANK"])
        return Ranks(rank, int(os.environ.get("LOCAL_RANK", rank)), world,
                     os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                     start_others=False)
    return Ranks(0, 0, size, "127.0.0.1", _free_port() if size > 1 else 0, start_others=size > 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_others(ranks: Ranks, argv: list[str]) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..size-1 as children running `argv` (this verifier's own arguments); their output
    goes where ours does."""
    command = [sys.executable, "-m", "verifier_service.api.cli", *argv]
    children = [subprocess.Popen(command, env=ranks.environ_for(rank)) for rank in range(1, ranks.size)]
    log.info("started ranks 1..%d (pids %s)", ranks.size - 1, ", ".join(str(c.pid) for c in children))
    return children


def rank_device(device: str, ranks: Ranks) -> torch.device:
    """The device this rank runs on: with more than one rank, GPU `local_rank` or the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(device)
    if ranks.size == 1:
        return chosen
    if chosen.type == "cuda":
        if chosen.index is not None:
            raise ShardingError(f"with --tensor-parallel-size, pass --device cuda, not {device}: rank i uses "
                                "GPU i (choose the GPUs with CUDA_VISIBLE_DEVICES)")
        return torch.device("cuda", ranks.local_rank)
    if chosen.type != "cpu":
        raise ShardingError(f"tensor parallelism runs on cuda or cpu, not {device}")
    if torch.cuda.is_available():
        # transformers builds its device mesh on the accelerator whatever --device says.
        raise ShardingError("tensor parallelism on the CPU of a machine with GPUs: hide them with "
                            "CUDA_VISIBLE_DEVICES= or use --device cuda")
    return chosen


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_split(config: PretrainedConfig, size: int, model_name: str, device: torch.device) -> None:
    """Refuse, naming the counts, a model that cannot be split `size` ways here."""
    if size == 1:
        return
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if not getattr(cfg, "base_model_tp_plan", None):
        raise ShardingError(f"{model_name} ({cfg.model_type}) has no tensor-parallel plan in transformers; "
                            "serve it with --tensor-parallel-size 1")
    if heads % size or kv_heads % size:
        raise ShardingError(f"cannot split {model_name} {size} ways: it has {heads} attention heads and {kv_heads} "
                            f"KV heads, and --tensor-parallel-size {size} must divide both")
    if device.type == "cuda" and (visible := torch.cuda.device_count()) < size:
        raise ShardingError(f"--tensor-parallel-size {size} needs {size} GPUs, one per rank; {visible} visible")
