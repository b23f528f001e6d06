"""A command's exit without the interpreter's final garbage collection, or without its finalization at all.

At exit Python collects garbage over every object still alive. A process that has imported torch
and transformers holds a great many, and that collection is most of the time it takes to end:
importing the verifier's server and exiting took 1.29 s to exit, 0.19 s with this, on a 2-core
CPU. Whoever waits for the process waits for it: Kubernetes' termination, `splitspec bench` and
`splitspec demo` stopping their services, the tests. Freezing moves every object to the permanent
generation, which that collection skips; objects are still freed by reference counting. It is
done by an atexit handler, which runs before that collection: until then the process (or a test
calling a command's main) collects garbage as usual.

`exit_at_once` skips finalization altogether, for a server that has stopped while a thread of its own
still runs code it cannot stop (a drafter's `load()`, a model's forwards): the interpreter would wait for
that thread, for as long as it takes, or tear torch down under it and abort.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
from typing import NoReturn


def skip_final_collection() -> None:
    atexit.unregister(gc.freeze)  # registered once, however many times a command runs in one process
    atexit.register(gc.freeze)


def exit_at_once(status: int) -> NoReturn:
    """End the process now with `status`, its logs flushed, no atexit handler run, no thread waited for."""
    logging.shutdown()
    os._exit(status)
