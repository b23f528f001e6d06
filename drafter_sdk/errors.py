"""The one exception type the SDK's call handlers raise: a refusal or failure with its gRPC status."""

from __future__ import annotations

import grpc


class DrafterError(Exception):
    """A call the drafter refused or failed; `code` is the status it is answered with over gRPC."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
