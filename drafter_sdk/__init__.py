"""splitspec drafter SDK: serve a speculative-decoding drafter over gRPC (no torch needed)."""

from drafter_sdk.drafter import Drafter, DraftRequest, SamplingHints
from drafter_sdk.errors import DrafterError
from drafter_sdk.ngram import NgramDrafter
from drafter_sdk.server import RunningDrafter, serve, start_server
from drafter_sdk.servicer import DrafterServicer

__all__ = [
    "DraftRequest",
    "Drafter",
    "DrafterError",
    "DrafterServicer",
    "NgramDrafter",
    "RunningDrafter",
    "SamplingHints",
    "serve",
    "start_server",
]
