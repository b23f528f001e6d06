"""The verifier process keeps the host memory a forward frees for the next one: a forward's worth of
activation-sized tensors, allocated and freed again, touches (nearly) no fresh page the second time;
with glibc's defaults the whole working set is faulted in again. Malloc settings from the environment
are left alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# 64 MiB in 1 MiB tensors (over glibc's first mmap threshold), as a forward's activations, twice.
SCRIPT = """
import resource, sys, torch
from verifier_service.model import host_memory
print(host_memory.keep_freed_memory() if sys.argv[1] == "keep" else "default")
for step in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(1 << 18) for _ in range(64)]
    del tensors
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_forward(mode: str, **env: str) -> tuple[str, int]:
    """(what keep_freed_memory returned, minor page faults of the second round)."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    kept, faults = done.stdout.split()
    return kept, int(faults)


def test_freed_memory_is_reused_without_page_faults() -> None:
    kept, faults = second_forward("keep")
    assert kept == "True"
    assert faults < 4096  # a quarter of the working set at most: 64 MiB afresh is 16,384 pages
    default, faults = second_forward("default")
    assert faults > 10_000, "glibc's defaults give the memory back: the check above could not fail"


def test_malloc_settings_from_the_environment_are_kept() -> None:
    kept, faults = second_forward("keep", MALLOC_TRIM_THRESHOLD_="0")
    assert kept == "False" and faults > 10_000  # trimming everything, as asked
