"""Everything the verifier is started with: the one place its defaults live, validated once.

`splitspec-verifier`'s flags (api/cli.py) set no defaults of their own: a flag
left out is a field left at its default here, and the flags' help text reads
its defaults from here. Construction validates the whole tree, the speculative
config included, and keeps a filled-in copy of that config: the caller's
message is never changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from drafter_sdk.proto import speculative_pb2
from drafter_sdk.service.security import TokenSource
from drafter_sdk.service.watched_files import WatchedFiles
from verifier_service.engine.reasoning import PARSERS as REASONING_PARSERS
from verifier_service.model import generation_config
from verifier_service.spec_decode.config import ConfigError, validate

EMBEDDED_MODEL = "the embedded SmolLM2-135M-Instruct"
# The tool-call formats api/tool_calls.py reads from a model's text (vLLM's --tool-call-parser names).
TOOL_CALL_PARSERS = ("hermes",)
# vLLM's --scheduling-policy: first come first served, or by each request's priority (with preemption).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class ServerSettings:
    # --- model
    model: str | None = None  # Hugging Face folder or .gguf file; None: EMBEDDED_MODEL
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA (float16 where the GPU lacks it)
    device: str = "auto"
    prepack_weights: bool = True  # CPU: keep a oneDNN-reordered weight copy where it is faster
    # The start-up's forward timings (model/timing_cache.py): "on" takes what an earlier start on this
    # machine kept and times the rest, "refresh" times everything and keeps it, "off" times everything
    # and keeps nothing.
    timing_cache: str = "on"
    tensor_parallel_size: int = 1  # ranks the model is sharded over (one GPU each on CUDA)
    # CUDA: decode and verify steps of up to this many tokens (rows padded to a power of two) replay as
    # CUDA graphs (model/cuda_graphs.py); 0 always runs eagerly (vLLM's --enforce-eager). 512: the largest
    # step vLLM captures by default.
    cuda_graph_max_tokens: int = 512
    chat_template: str | None = None  # Jinja that renders chats in place of the model's template; None: the model's
    # The sampling a request's left-out fields take (model/generation_config.py): "auto", the model's
    # generation_config.json; "vllm", none; else a folder holding one. Overrides set keys on top of it.
    generation_config: str = generation_config.AUTO
    override_generation_config: Mapping[str, Any] = field(default_factory=dict)
    # --- capacity
    max_model_len: int = 2048  # longest prompt + generation
    max_num_seqs: int = 16
    max_queue_len: int = 64
    kv_cache_memory_gb: float = 4.0  # per rank: each holds its shard of the KV heads
    # A request's max_new_tokens when it sets none. None: the model's generation config's (below), else
    # the rest of the context, as vLLM's chat route and OpenAI's chat API answer until the model stops.
    default_max_new_tokens: int | None = None
    # Tokens one step's forward carries (decode and verify rows first, then prompt chunks).
    # None: the most a step can carry at PREFILL_STEP_COST times a one-token step's measured cost,
    # a late prompt token counting for more by its measured attention (builder.calibrate).
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True  # reuse the KV of shared prompt prefixes
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES (engine/scheduler.py)
    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_rpcs: int = 1024
    # --- speculation (filled in by validation: mode NONE when unset)
    speculative: speculative_pb2.SpeculativeConfig = field(default_factory=speculative_pb2.SpeculativeConfig)
    # Largest token tree verified per sequence, in nodes, for drafters that draft trees (their max depth
    # is the draft length); with adaptive draft lengths the planner sizes each tree up to it. 0: chains,
    # the default: on a CPU trees did not pay in tokens/s on every workload (README, token trees).
    max_draft_nodes: int = 0
    # --- serving
    host: str = "[::]"
    port: int = 50051  # 0: a free port
    grace_period_s: float = 30.0
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: a free port
    # The OpenAI-compatible HTTP API (and /health, /metrics, the playground). None: off; 0: a free port.
    http_port: int | None = 8000
    served_model_names: tuple[str, ...] = ()  # names the HTTP API answers to; (): the model's name
    # Origins whose web pages may call the HTTP API (CORS): "*", any (vLLM's default); (): none.
    allowed_origins: tuple[str, ...] = ("*",)
    # Chat tool calling's "auto" choice (api/tool_calls.py), as vLLM's flags: both, or it is refused.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS
    # A reasoning model's thinking markers (engine/reasoning.py): constraints hold the answer only, and the
    # HTTP answers carry the thinking apart. One of REASONING_PARSERS; None: the output is all answer.
    reasoning_parser: str | None = None
    # Request traces (tracing.py): an OTLP/gRPC collector, e.g. http://otel-collector:4317; None: no traces.
    otlp_traces_endpoint: str | None = None
    # The stats lines in the log (stats_log.py): every this many seconds while busy; 0: never.
    log_stats_interval_s: float = 10.0
    log_requests: bool = False  # a line per request as it ends (api/generation.py), metadata only
    # Memory for the Responses API's stored responses and conversations (api/response_store.py), least
    # recently used evicted first; 0 stores none.
    responses_store_mb: int = 64
    # Where a background response's end is announced (api/webhooks.py), signed with webhook_secret (the
    # key of --webhook-secret-file); None: no webhooks.
    webhook_url: str | None = None
    webhook_secret: bytes | WatchedFiles[bytes] | None = None  # --webhook-secret-file's, as it changes
    # Tensor parallelism: a rank that has not finished a step (or an idle heartbeat) within this
    # many seconds is taken as hung, and the verifier fails its requests and exits.
    rank_timeout_s: float = 60.0
    # TLS: cert + key serve TLS; adding client_ca requires client certificates (mTLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token: TokenSource | None = None  # the bearer token, or --auth-token-file's tokens as it changes

    def __post_init__(self) -> None:
        positive = ("max_model_len", "max_num_seqs", "default_max_new_tokens", "max_message_bytes",
                    "max_concurrent_rpcs", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, not {value}")
        try:
            generation_config.check_overrides(self.override_generation_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.default_max_new_tokens is not None and "max_new_tokens" in self.override_generation_config:
            raise ConfigError("default_max_new_tokens and override_generation_config's max_new_tokens both set "
                              "the default: give one")
        for name in ("port", "http_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be within [0, 65535], not {value}")
        if self.port and self.port == self.http_port:  # one would find the port taken by the other
            raise ConfigError(f"port (gRPC) and http_port (the OpenAI-compatible API) are both {self.port}: "
                              "vLLM's --port is the one called --http-port here")
        if self.metrics_port and self.metrics_port == self.http_port:  # (and gRPC's: GrpcService.start)
            raise ConfigError(f"metrics_port and http_port (the OpenAI-compatible API) are both {self.http_port}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, not {self.max_num_batched_tokens}")
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(f"cuda_graph_max_tokens must be >= 0, not {self.cuda_graph_max_tokens}")
        if self.max_draft_nodes < 0:
            raise ConfigError(f"max_draft_nodes must be >= 0, not {self.max_draft_nodes}")
        if self.responses_store_mb < 0:
            raise ConfigError(f"responses_store_mb must be >= 0, not {self.responses_store_mb}")
        if (self.webhook_url is None) != (self.webhook_secret is None):
            raise ConfigError("webhooks are signed: give --webhook-url and --webhook-secret-file together")
        if self.webhook_url is not None and not self.webhook_url.startswith(("http://", "https://")):
            raise ConfigError(f"webhook_url must be an http:// or https:// URL, not {self.webhook_url!r}")
        if self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, not {self.max_queue_len}")
        if not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb must be positive, not {self.kv_cache_memory_gb}")
        if not self.rank_timeout_s > 0:
            raise ConfigError(f"rank_timeout_s must be positive, not {self.rank_timeout_s}")
        if self.log_stats_interval_s < 0:
            raise ConfigError(f"log_stats_interval_s must be >= 0, not {self.log_stats_interval_s}")
        if self.grace_period_s < 0:
            raise ConfigError(f"grace_period_s must be >= 0, not {self.grace_period_s}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"not {self.scheduling_policy!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(f"enable_auto_tool_choice needs tool_call_parser ({', '.join(TOOL_CALL_PARSERS)})")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key (mutual TLS)")
        # Frozen: the validated copy replaces the field once, at construction.
        object.__setattr__(self, "speculative", validate(self.speculative))

    @property
    def by_priority(self) -> bool:
        """Requests' priorities are served (and running ones preempted for them)."""
        return self.scheduling_policy == "priority"


DEFAULTS = ServerSettings()
