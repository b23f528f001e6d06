"""Forward costs measured at one start-up, kept for the next (a timing cache, as TensorRT keeps one).

On a CPU, start-up times every probed token count under each linear layout to choose the fastest
(model/step_costs.py): 14 s of the embedded SmolLM2's start on a 2-core CPU, every restart. What
it measures depends on the machine, the software and the model's shapes, not on the weights: so
the seconds are kept under the cache folder (`$SPLITSPEC_CACHE_DIR`, where GGUF conversions go;
"off" keeps nothing), keyed by all of that, and a start that finds every point it needs measures
nothing. `--timing-cache refresh` measures afresh and keeps that; `splitspec bench` starts one
verifier so, alone, and the verifiers it compares with it together after, on those timings.
`--timing-cache off` measures and keeps nothing. A file is written whole and renamed into place,
so verifiers starting together never read half of one.

Timings taken on a busy machine would mislead every later start, so verifiers starting together on
one machine take turns to measure (a lock file beside the cache: each then reads what the one before
it measured), and timings that contradict each other as only a busy machine makes them
(step_costs.disturbance) are neither kept nor read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from drafter_sdk.loading.gguf_conversion import cache_root
from drafter_sdk.service.package_version import package_version
from verifier_service.model.runner import ModelRunner
from verifier_service.model.step_costs import Measurements, disturbance

log = logging.getLogger(__name__)

# 2: a start that converted its GGUF off the model thread timed every forward ~1.5x slow; not reused.
# 3: shapes timed in rounds (step_costs.measure_shapes); one shape after another, drift bent the curve.
FORMAT = 3
# How long a start waits for its turn to measure: a busy CPU may take minutes, a hung holder forever.
TURN_WAIT_S = 600.0
TURN_POLL_S = 0.1


@dataclass(frozen=True)
class TimingCache:
    path: Path
    key: dict[str, object]  # what the timings depend on; kept in the file, for whoever reads it

    @classmethod
    def for_runner(cls, runner: ModelRunner, context_len: int, repeats: int) -> "TimingCache | None":
        """The cache file for this runner's measurements (`measure`'s context_len and repeats);
        None when caching is off."""
        root = cache_root()
        if root is None:
            return None
        key = _key(runner, context_len, repeats)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cls(root / "timing" / f"{digest}.json", key)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Held while this start reads, measures and keeps its timings: one verifier of this machine
        (of this cache folder) at a time, so that verifiers starting together neither time their
        forwards against each other nor measure what another has just kept. The kernel lets go of
        the lock when its holder exits, however it exits."""
        lock_path = self.path.parent / ".measuring.lock"
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(lock_path, "a")
        except OSError as e:
            log.warning("cannot take turns to time forwards (%s); timing them now", e)
            yield
            return
        with lock:
            if not _try_lock(lock):
                log.info("waiting for another verifier on this machine to finish timing its forwards")
                deadline = time.monotonic() + TURN_WAIT_S
                while not _try_lock(lock):
                    if time.monotonic() > deadline:
                        log.warning("another verifier on this machine has timed its forwards for %.0f s; timing "
                                    "them now", TURN_WAIT_S)
                        break
                    time.sleep(TURN_POLL_S)
            yield  # closing the file releases the lock

    def load(self) -> Measurements:
        """What earlier starts measured; {} when there is nothing readable or it looks disturbed."""
        try:
            raw = json.loads(self.path.read_text())["seconds"]
            measured = {layout: {int(t): float(s) for t, s in seconds.items()} for layout, seconds in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the unreadable timing cache %s (%s)", self.path, e)
            return {}
        if why := disturbance(measured):
            log.warning("ignoring the timing cache %s: it was measured on a busy machine (%s)", self.path, why)
            return {}
        return measured

    def save(self, measured: Measurements) -> None:
        """Keep `measured`, unless it looks disturbed: then the next start measures again."""
        if why := disturbance(measured):
            log.warning("forward timings disturbed by other work on this machine (%s): not kept in %s, the next "
                        "start times them again; give the verifier whole cores (README)", why, self.path)
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}.")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": self.key, "seconds": measured}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot keep the forward costs in %s (%s); the next start measures them again", self.path, e)


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _key(runner: ModelRunner, context_len: int, repeats: int) -> dict[str, object]:
    """Everything a forward's time depends on but the weights' values and the machine's load."""
    config = runner.model.config.to_dict()
    for name in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(name, None)
    device = runner.device
    return {
        "format": FORMAT,
        "splitspec": package_version(),
        "torch": torch.__version__,
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "dtype": str(runner.dtype),
        "batch_invariant": runner.batch_invariant,  # another attention
        "cuda_graph_max_tokens": runner.graphs.max_tokens if runner.graphs is not None else 0,
        "model": config,
        "layouts": [layout.value for layout in runner.layouts.available] if runner.layouts is not None else [],
        "measure": {"context_len": context_len, "repeats": repeats},
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
    return f"{device.type}:{_cpu_model()}:{os.cpu_count()} cpus"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
