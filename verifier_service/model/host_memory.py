"""Keep the host memory a forward frees for the next forward, instead of giving it back to the OS.

glibc serves an allocation over its mmap threshold (128 KiB at first, raised as such blocks are
freed, to 32 MiB at most) with a mapping of its own, unmapped when freed, and gives the free top of
its heap back to the OS past a trim threshold. A forward on a CPU allocates and frees activations
of up to tens of MiB per layer, so a large forward touches fresh pages each time and the kernel
zero-fills every one: an 1,800-token prefill of SmolLM2 on the 2-core VM took 4.9 s, 230,000 minor
page faults and 3.8 s of system time the first time, and later ones still up to 30,000 faults and
0.9 s (2.8 s against 1.9 s). With the mmap threshold at its largest and no trimming, the heap grows
once and serves every later forward: 2.7 s the first time (20,000 faults), then 2.0 s without a
fault. The process then holds its largest forward's peak, which the next such forward needs anyway.

This is process-wide, so the verifier's entry point sets it (every rank), never library code. A
MALLOC_* environment variable or a malloc tunable in GLIBC_TUNABLES means someone chose their own
settings; they are left alone, as is any platform without glibc's mallopt.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound on 64-bit: past it, mallopt refuses
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest one


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to its maximum and (nearly) never trim; False where nothing was set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    chosen = [name for name in os.environ if name.startswith("MALLOC_") and name.endswith("_")]
    if chosen or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("host memory: malloc settings from the environment (%s) kept as they are",
                 ", ".join(chosen) or "GLIBC_TUNABLES")
        return False
    mallopt = ctypes.CDLL(None).mallopt
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        log.warning("host memory: glibc refused mallopt; a large forward's memory goes back to the OS each time")
        return False
    log.info("host memory: freed memory kept for the next forward (glibc mmap threshold %d MiB, no trimming)",
             MMAP_THRESHOLD_MAX >> 20)
    return True
