"""Suite-wide fixtures: one GGUF conversion cache for the whole run.

Every test, and every verifier or drafter process a test starts, loads the embedded model through
the same fresh cache folder: the run converts the GGUF once (and tests that conversion), and
nothing is written under the home folder.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from drafter_sdk.gguf_conversion import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("splitspec-cache")))
        yield
