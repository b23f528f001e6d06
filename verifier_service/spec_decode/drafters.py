"""The verifier's one view of every drafter: a DrafterClient over the right transport.

A built-in drafter runs in-process behind the SDK's own servicer logic, so it is
served by exactly the code a remote drafter service runs; only the hop differs.
It runs where that code runs it: NGRAM's and SUFFIX's drafters on the engine's
event loop (`runs_inline`: well under a millisecond a sequence), DRAFT_TARGET's
model drafter on the servicer's worker thread (its forwards must not block the
loop). Each loads when the client connects. The draft model's own torch work runs
on a thread of its own, except where draft and target both run on the CPU: there
it runs on the verifier's model thread, while the engine waits for its draft,
since a second thread's OpenMP regions slowed every forward of the target ~1.8x.
"""

from __future__ import annotations

from concurrent.futures import Executor

from drafter_sdk.drafter import Drafter
from drafter_sdk.proto import speculative_pb2
from drafter_sdk.server.sequence_store import SequenceStore
from drafter_sdk.server.servicer import DrafterServicer
from drafter_sdk.service.security import watch_channel_credentials, watch_token
from verifier_service.spec_decode.config import DRAFT_TARGET, NGRAM, NONE, SUFFIX, ngram_drafter, suffix_drafter
from verifier_service.spec_decode.drafter_client import DrafterClient
from verifier_service.spec_decode.transport import GrpcTransport, InProcessTransport


def build_drafter_client(config: speculative_pb2.SpeculativeConfig, verifier_id: str, vocab_size: int,
                         tokenizer_fingerprint: str = "", tokenizer_name: str = "", target_device: str = "cpu",
                         target_dtype: str = "float32", model_thread: Executor | None = None) -> DrafterClient | None:
    """None for NONE; the SDK's n-gram, suffix or model drafter in-process for NGRAM, SUFFIX or
    DRAFT_TARGET; gRPC for USER_PROVIDED. `tokenizer_fingerprint` is the target tokenizer's: a drafter
    reporting another one gets no calls. The draft model's "auto" device and dtype are the target's;
    a draft model on the CPU beside a target on the CPU runs on the target's `model_thread`.

    `config` is validated (ServerSettings), so every default is filled in."""
    if config.mode == NONE:
        return None
    if config.mode in (NGRAM, SUFFIX, DRAFT_TARGET):
        drafter = _in_process_drafter(config, target_device, target_dtype, model_thread)
        # One in-process drafter sees every call: plain deltas, no overlap needed; it never misses a deadline.
        return DrafterClient(InProcessTransport(DrafterServicer(drafter, SequenceStore())), verifier_id, vocab_size,
                             deadline_s=float("inf"), overlap_steps=1, tokenizer_fingerprint=tokenizer_fingerprint,
                             tokenizer_name=tokenizer_name)
    up = config.user_provided
    credentials = None
    if up.HasField("tls"):
        credentials = watch_channel_credentials(up.tls.ca_cert_file or None, up.tls.cert_file or None,
                                                up.tls.key_file or None, "TLS files of the drafter connection")
    transport = GrpcTransport(
        up.drafter_target, credentials=credentials,
        auth_token=watch_token(up.auth_token_file) if up.auth_token_file else None,
        load_balancing_policy=up.load_balancing_policy, server_name_override=up.tls.server_name_override,
        block=True)  # called from the engine's own thread (engine/model_thread.py)
    return DrafterClient(transport, verifier_id, vocab_size, deadline_s=up.call_deadline.ToNanoseconds() / 1e9,
                         overlap_steps=up.delta_overlap_steps, tokenizer_fingerprint=tokenizer_fingerprint,
                         tokenizer_name=tokenizer_name, overlap_calls=up.overlap_calls,
                         share_finished=up.share_finished)


def _in_process_drafter(config: speculative_pb2.SpeculativeConfig, target_device: str,
                        target_dtype: str, model_thread: Executor | None) -> Drafter:
    if config.mode == NGRAM:
        return ngram_drafter(config)
    if config.mode == SUFFIX:
        return suffix_drafter(config.suffix)
    from drafter_sdk.drafters.model import ModelDrafter  # torch: only when a draft model is configured

    dm = config.draft_model
    device = target_device if dm.device == "auto" else dm.device
    return ModelDrafter(
        dm.model or None, device=device, dtype=target_dtype if dm.dtype == "auto" else dm.dtype,
        max_draft_len=config.max_draft_len, kv_cache_memory_gb=dm.kv_cache_memory_gb, draft_ahead=dm.draft_ahead,
        model_thread=model_thread if device == target_device == "cpu" else None)
