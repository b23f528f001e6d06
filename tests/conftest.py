"""Suite-wide fixtures: one GGUF conversion and timing cache for the whole run, and one thread per
test worker.

Every test, and every verifier or drafter process a test starts, loads the embedded model through
the same fresh cache folder: the run converts the GGUF once (and tests that conversion), times the
embedded model's forwards once, and writes nothing under the home folder. Run in parallel
(`pytest -n 2 --dist loadfile`, as CI does), the workers share that folder: its lock files let one
worker convert or time while the other waits, then read what it kept. Each worker, and every process
it starts, keeps to one torch thread: two workers' thread pools spinning on two cores would slow
each other many times over.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from drafter_sdk.loading.gguf_conversion import CACHE_ENV


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked `long_running` first, the longest first; the rest in collection order, each module's
    tests together. xdist hands whole modules to whichever worker is free in this order: a 4-minute module
    handed out last kept one worker busy long after the other had run out of work."""
    def seconds(item: pytest.Item) -> float:
        marker = item.get_closest_marker("long_running")
        return marker.args[0] if marker is not None else 0.0

    items.sort(key=lambda item: -seconds(item))  # stable: modules stay whole and in order


@pytest.fixture(scope="session", autouse=True)
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # A worker's temporary folder is `<run>/popen-gwN`: the run's folder is shared.
            cache = tmp_path_factory.getbasetemp().parent / "splitspec-cache"
            cache.mkdir(exist_ok=True)
            patch.setenv("OMP_NUM_THREADS", "1")
            torch.set_num_threads(1)
        else:
            cache = tmp_path_factory.mktemp("splitspec-cache")
        patch.setenv(CACHE_ENV, str(cache))
        yield
