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
