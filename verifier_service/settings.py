"""Everything the verifier server is started with (from flags or code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_sdk.proto import speculative_pb2


@dataclass
class ServerSettings:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "auto"
    prepack_weights: bool = True  # CPU: keep a oneDNN-reordered weight copy where it is faster
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_queue_len: int = 64
    kv_cache_memory_gb: float = 4.0
    default_max_new_tokens: int = 256
    speculative: speculative_pb2.SpeculativeConfig = field(default_factory=speculative_pb2.SpeculativeConfig)
    host: str = "[::]"
    port: int = 50051
    grace_period_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_rpcs: int = 1024
    # TLS: cert + key serve TLS; adding client_ca requires client certificates (mTLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token: str | None = None
    metrics_port: int | None = None
