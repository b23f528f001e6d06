"""A server's start-up heap: built without the garbage collector's passes, then frozen out of them.

CPython's full (oldest-generation) collection stops every thread and walks every tracked object, and in a
server almost all of them are start-up state that is never garbage: the modules of torch and
transformers, the model, the tokenizer; about 460,000 objects in the verifier.

While the imports build them, the collector walks the growing heap again and again (seven full passes, about
a second, in a verifier's start) and finds next to nothing. `imports_frozen` keeps it off for the imports,
then collects once and freezes what they left, so that later passes skip it: a verifier on the embedded
model reached SERVING 0.91x as late (BENCHMARKS.md, *The garbage collector's full passes*). Only imports run
with the collector off: a model's load can drop large tensors held in reference cycles, which only a
collection frees.

Once started, what serving keeps (stored responses, above all) brings a full pass now and then: 268 ms
with every thread stopped, against 39 ms with the start-up heap frozen. `gc.freeze()` moves what is alive
to the permanent generation, which collections skip: what serving allocates later is collected as before,
and frozen objects are still freed by reference counting. vLLM and SGLang freeze their serving processes'
start-up heap likewise. Only a process's own entry point freezes (`splitspec-verifier`,
`splitspec-drafter` and the SDK's `serve()`), never a server started inside another program
(`start_server`): an object frozen there and later dropped in a reference cycle would never be freed. A
command's `main()` called in-process, as tests do, freezes its caller's heap as it then is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def imports_frozen() -> Iterator[None]:
    """For a block of imports: no collection while they build their objects, then one pass, and what is left
    frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    _collect_and_freeze()


def freeze_start_up_heap() -> None:
    """At the end of start-up: its garbage freed, all that is alive frozen, and how much logged."""
    log.info("start-up heap frozen: %d objects left out of the garbage collector's full passes",
             _collect_and_freeze())


def _collect_and_freeze() -> int:
    gc.collect()  # start-up's own garbage is freed first rather than kept for good
    gc.freeze()
    return gc.get_freeze_count()
