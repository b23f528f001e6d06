"""start_up_heap: no collection while imports run, then their garbage freed and what they keep frozen; at the
end of start-up the same for the rest; what comes after is collected as before; a failed import freezes
nothing."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import gc, weakref
from drafter_sdk.service.start_up_heap import freeze_start_up_heap, imports_frozen

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

try:
    with imports_frozen():
        raise ImportError("no such module")
except ImportError:
    print("a failed import freezes nothing:", gc.isenabled() and gc.get_freeze_count() == 0)
with imports_frozen():
    print("no collection while importing:", not gc.isenabled())
    imported = [[i] for i in range(50_000)]
    import_garbage = cycle()
print("import garbage freed:", import_garbage() is None)
print("imported state frozen:", gc.isenabled() and gc.get_freeze_count() > 50_000)
loaded = [[i] for i in range(20_000)]
load_garbage = cycle()
frozen_at_imports = gc.get_freeze_count()
freeze_start_up_heap()
print("load garbage freed:", load_garbage() is None)
print("loaded state frozen too:", gc.get_freeze_count() >= frozen_at_imports + 20_000)
print("left to the collector:", len(gc.get_objects()) < 1_000)
later = cycle()
gc.collect()
print("later garbage collected:", later() is None)
print("start-up state alive:", len(imported) == 50_000 and len(loaded) == 20_000)
"""


def test_imports_then_the_rest_of_start_up_are_frozen_and_later_garbage_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [line.rsplit(": ", 1)[1] for line in done.stdout.splitlines()] == ["True"] * 9, done.stdout
