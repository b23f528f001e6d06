"""The installed splitspec's version, as both services and the tools report it: `--version`, the HTTP
API's GET /version (vLLM's), and the key of a verifier's timing cache."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The installed package's version; "source" for a source tree that is not installed."""
    try:
        return importlib.metadata.version("splitspec")
    except importlib.metadata.PackageNotFoundError:
        return "source"
