"""The verifier's one view of every drafter: a DrafterClient over the right transport.

A built-in drafter runs in-process behind the SDK's own servicer logic, so it is
served by exactly the code a remote drafter service runs; only the hop differs.
"""

from __future__ import annotations

from drafter_sdk.drafter import Drafter
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.proto import speculative_pb2
from drafter_sdk.security import channel_credentials, read_token
from drafter_sdk.sequence_store import SequenceStore
from drafter_sdk.servicer import DrafterServicer
from verifier_service.spec.config import NGRAM, NONE, SUFFIX, suffix_drafter
from verifier_service.spec.drafter_client import (
    DrafterClient,
    GrpcTransport,
    InProcessTransport,
)


def build_drafter_client(config: speculative_pb2.SpeculativeConfig, verifier_id: str,
                         vocab_size: int) -> DrafterClient | None:
    """None for NONE; the SDK's n-gram or suffix drafter in-process for NGRAM or SUFFIX; gRPC for
    USER_PROVIDED.

    `config` is validated (ServerSettings), so every default is filled in."""
    if config.mode == NONE:
        return None
    if config.mode in (NGRAM, SUFFIX):
        if config.mode == NGRAM:
            ng = config.ngram
            drafter: Drafter = NgramDrafter(
                max_draft_len=config.max_draft_len, max_matching_ngram_size=ng.max_matching_ngram_size,
                is_keep_all=ng.is_keep_all, is_use_oldest=ng.is_use_oldest, is_public_pool=ng.is_public_pool)
        else:
            drafter = suffix_drafter(config.suffix)
        servicer = DrafterServicer(drafter, SequenceStore())
        servicer.load()
        # One in-process drafter sees every call: plain deltas, no overlap needed; it never misses a deadline.
        return DrafterClient(InProcessTransport(servicer), verifier_id, vocab_size, deadline_s=float("inf"),
                             overlap_steps=1)
    up = config.user_provided
    credentials = None
    if up.HasField("tls"):
        credentials = channel_credentials(up.tls.ca_cert_file or None, up.tls.cert_file or None,
                                          up.tls.key_file or None)
    transport = GrpcTransport(
        up.drafter_target, credentials=credentials,
        auth_token=read_token(up.auth_token_file or None) if up.auth_token_file else None,
        load_balancing_policy=up.load_balancing_policy, server_name_override=up.tls.server_name_override)
    return DrafterClient(transport, verifier_id, vocab_size, deadline_s=up.call_deadline.ToNanoseconds() / 1e9,
                         overlap_steps=up.delta_overlap_steps)
