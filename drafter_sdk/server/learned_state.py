"""Keeps what a drafter learned across requests in a file, so that a restarted drafter starts warm.

A drafter that learns from the traffic (the suffix drafter's global tree, learned from every
finished request) loses it all when its process ends: a rollout, an eviction, a crash. With a
file, the server gives the drafter what the file holds after `load()` and before any call is let
in, saves what it learned every `every_s` seconds, and once more after the last call at shutdown
(`Drafter.save_learned` / `restore_learned`). A crash loses what was learned since the last save.

A save goes to a temporary file beside the target, synced, then renamed over it, so a crash
mid-write leaves the previous save whole (and a temporary file, which the next start removes). A
file that cannot be read or that the drafter refuses (another format version, another
configuration) is logged, moved aside to `<file>.rejected` so that the next save does not
overwrite it, and the drafter starts empty: like every drafter fault, this costs speed, never an
answer. A file no save could be written to is refused at start (`check_writable`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from drafter_sdk.server.metrics import DrafterMetrics
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.service.lifecycle import MIB

log = logging.getLogger(__name__)


@dataclass
class LearnedStateFile:
    path: Path
    every_s: float  # between periodic saves
    metrics: DrafterMetrics | None = None
    _saving: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        check_writable(self.path)
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):  # saves a crash cut short
            stale.unlink(missing_ok=True)

    def restore(self, servicer: DrafterServicer) -> bool:
        """Give the drafter what the file holds (on the drafter's worker thread, before calls are let in);
        whether it took it. Never raises: a drafter that cannot take it starts empty."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.info("no learned state at %s yet: %s starts empty", self.path, servicer.drafter.name)
            return False
        except OSError as exc:
            log.warning("cannot read the learned state at %s (%s): %s starts empty", self.path, exc,
                        servicer.drafter.name)
            return False
        start = time.perf_counter()
        if not servicer.restore_learned(data, f"at {self.path}"):
            log.warning("%s starts empty; the file is kept as %s", servicer.drafter.name, self._rejected())
            self._move_aside()
            return False
        log.info("%s restored its learned state from %s (%.1f MiB) in %.2f s", servicer.drafter.name, self.path,
                 len(data) / MIB, time.perf_counter() - start)
        return True

    async def save(self, servicer: DrafterServicer) -> None:
        """Write what the drafter learned to the file (a failure is logged and counted).

        One save at a time, each to its end: a caller cancelled mid-save (the periodic saves, at
        shutdown) leaves it writing, and the next save waits for it."""
        await asyncio.shield(self._save(servicer))

    async def _save(self, servicer: DrafterServicer) -> None:
        async with self._saving:
            start = time.perf_counter()
            try:
                data = await servicer.run(servicer.drafter.save_learned)
                if data is None:
                    return
                await asyncio.to_thread(_write_atomically, self.path, data)
            except Exception:
                log.exception("saving %s's learned state to %s failed", servicer.drafter.name, self.path)
                if self.metrics is not None:
                    self.metrics.record_learned_save(None)
                return
        if self.metrics is not None:
            self.metrics.record_learned_save(len(data))
        log.info("saved %s's learned state to %s (%.1f MiB) in %.2f s", servicer.drafter.name, self.path,
                 len(data) / MIB, time.perf_counter() - start)

    async def save_every(self, servicer: DrafterServicer) -> None:
        """Save every `every_s` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            await self.save(servicer)

    def _rejected(self) -> Path:
        return self.path.with_name(self.path.name + ".rejected")

    def _move_aside(self) -> None:
        try:
            os.replace(self.path, self._rejected())
        except OSError as exc:
            log.warning("cannot move %s aside (%s): the next save will replace it", self.path, exc)


def check_writable(path: Path) -> None:
    """ValueError where no save could be written to `path`: better refused at start than every save failing."""
    directory = path.parent
    if not directory.is_dir():
        raise ValueError(f"learned-state file {path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"learned-state file {path}: cannot write in {directory}")
    if path.is_dir():
        raise ValueError(f"learned-state file {path} is a directory")


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` whole or not at all, also across a crash of this machine."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)
