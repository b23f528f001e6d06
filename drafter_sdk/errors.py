"""The SDK's exception types: what its call handlers raise (a refusal or failure with its gRPC status),
a port a service cannot listen on, and a model that cannot be loaded as asked. Here, free of torch, so
that every command can map them."""

from __future__ import annotations

import grpc


class DrafterError(Exception):
    """A call the drafter refused or failed; `code` is the status it is answered with over gRPC."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ListenError(OSError):
    """A port a service must listen on cannot be bound: another process holds it, or the address is
    not this host's. The command-line entry points report it in one line and exit 2."""


class ModelLoadError(ValueError):
    """The model cannot be loaded as asked: a path that names no model, files missing or a hub name
    that cannot be fetched, a device torch does not have here, an unknown dtype (drafter_sdk/loading/causal_lm.py).
    It is the user's to fix, so the command-line entry points report it in one line and exit 2."""
