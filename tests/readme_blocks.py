"""The README's code blocks that tests run or check as written (tests/tools/test_readme.py,
tests/deploy/test_packaging.py)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_drafter() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class RepeatLastDrafter" in b]
    return block


def readme_http_blocks() -> tuple[str, str]:
    text = README.read_text()
    (curl,) = [b for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S) if "curl" in b and "/v1/" in b]
    (client,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "from openai import" in b]
    return curl, client
