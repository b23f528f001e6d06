"""freeze_start_up_heap: start-up's garbage is freed, what start-up keeps leaves the collector's passes, and
what comes after is collected as before."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import gc, weakref
from drafter_sdk.service.start_up_heap import freeze_start_up_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

gc.disable()  # only the explicit passes below collect
kept = [[i] for i in range(50_000)]  # start-up state
dropped = cycle()  # start-up garbage, only a collection frees it
freeze_start_up_heap()
print("start-up garbage freed:", dropped() is None)
print("start-up state frozen:", gc.get_freeze_count() > 50_000)
print("left to the collector:", len(gc.get_objects()) < 1_000)
later = cycle()
gc.collect()
print("later garbage collected:", later() is None)
print("start-up state alive:", len(kept) == 50_000)
"""


def test_start_up_garbage_is_freed_its_state_frozen_and_later_garbage_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["start-up garbage freed: True", "start-up state frozen: True",
                                        "left to the collector: True", "later garbage collected: True",
                                        "start-up state alive: True"]
