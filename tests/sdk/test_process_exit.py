"""The commands skip the interpreter's final garbage collection at exit, and only then."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, gc
from drafter_sdk.service.process_exit import skip_final_collection
atexit.register(lambda: print("at exit, frozen:", gc.get_freeze_count() > 0))  # runs after what is registered next
skip_final_collection()
skip_final_collection()
print("while working, frozen:", gc.get_freeze_count() > 0)
"""


def test_objects_are_frozen_at_exit_not_while_the_process_works() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["while working, frozen: False", "at exit, frozen: True"]
