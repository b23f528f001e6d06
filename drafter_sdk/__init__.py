"""splitspec drafter SDK: serve a speculative-decoding drafter over gRPC (no torch needed).

    from drafter_sdk import Drafter, serve

    class Repeat(Drafter):
        def prepare_draft_tokens(self, requests):
            # Each request carries its full history; propose its last token again.
            return [r.tokens[-1:] * r.draft_len for r in requests]

    serve(Repeat(), port=50052)

Or without a script: `splitspec-drafter my_module:Repeat --port 50052`, or the
built-in `splitspec-drafter ngram` / `splitspec-drafter suffix`.
"""

from drafter_sdk.service import grpc_core_logs  # noqa: F401, I001 - first: before anything imports grpc
from drafter_sdk.drafter import (
    CACHE_SALT,
    LEARNS_FROM_FINISHED,
    LOOKAHEAD,
    Drafter,
    DraftRequest,
    ReleaseReason,
    SamplingHints,
)
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.errors import DrafterError
from drafter_sdk.server.peers import Peers
from drafter_sdk.server.serve import RunningDrafter, serve, start_server
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree

__all__ = [
    "CACHE_SALT",
    "LEARNS_FROM_FINISHED",
    "LOOKAHEAD",
    "DraftRequest",
    "DraftTree",
    "Drafter",
    "DrafterError",
    "DrafterServicer",
    "NgramDrafter",
    "Peers",
    "ReleaseReason",
    "RunningDrafter",
    "SamplingHints",
    "SuffixDrafter",
    "TREE_CAPABILITY",
    "serve",
    "start_server",
]
