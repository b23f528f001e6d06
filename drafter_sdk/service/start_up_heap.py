"""A server's start-up heap taken out of the garbage collector's full passes, once it has started.

CPython's full (oldest-generation) collection stops every thread and walks every tracked object, and in a
server almost all of them are start-up state that is never garbage: the modules of torch and
transformers, the model, the tokenizer; about 460,000 objects in the verifier. What serving keeps (stored
responses, above all) brings such a pass now and then: 268 ms with every thread stopped, against 39 ms with
the start-up heap frozen (BENCHMARKS.md, *The garbage collector's full passes*). `gc.freeze()` moves what is
alive to the permanent generation, which collections skip: what serving allocates later is collected as
before, and frozen objects are still freed by reference counting. vLLM and SGLang freeze their serving
processes' start-up heap likewise.

Only a process's own entry point calls this (`splitspec-verifier`, `splitspec-drafter` and the SDK's
`serve()`), never a server started inside another program: an object frozen there and later dropped in
a reference cycle would never be freed.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_start_up_heap() -> None:
    gc.collect()  # start-up's own garbage is freed first rather than kept for good
    gc.freeze()
    log.info("start-up heap frozen: %d objects left out of the garbage collector's full passes",
             gc.get_freeze_count())
