"""A command's exit once its work is done: without the interpreter's final garbage collection.

At exit Python collects garbage over every object still alive. A process that has imported torch
and transformers holds a great many, and that collection is most of the time it takes to end:
importing the verifier's server and exiting took 1.29 s to exit, 0.22 s with this, on a 2-core
CPU. Whoever waits for the process waits for it: Kubernetes' termination, `splitspec bench` and
`splitspec demo` stopping their services, the tests. Freezing moves every object to the permanent
generation, which that collection skips; objects are still freed by reference counting, and
atexit handlers still run.
"""

from __future__ import annotations

import gc


def skip_final_collection() -> None:
    """Call last, when nothing of the process's work is left to run."""
    gc.freeze()
