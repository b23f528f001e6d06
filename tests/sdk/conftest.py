"""Puts tests/ on sys.path so the SDK tests can use the shared certificate factory (tests/certs.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
