"""`splitspec-verifier`: serve a model with speculative decoding over gRPC and an OpenAI-compatible HTTP API.

The flags hold no defaults: one left out leaves its ServerSettings field at the
default settings.py gives it, and the help text quotes that default.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from drafter_sdk.errors import ListenError
from drafter_sdk.service.logs import add_logging_flags, configure_logging
from drafter_sdk.service.package_version import package_version
from drafter_sdk.service.process_exit import skip_final_collection
from drafter_sdk.service.security import add_server_flags, read_token, server_flags_problem, watch_tokens
from drafter_sdk.service.start_up_heap import imports_frozen
from verifier_service.api import vllm_flags
from verifier_service.api.webhooks import watch_secret
from verifier_service.model import generation_config, host_memory
from verifier_service.settings import (
    DEFAULTS,
    EMBEDDED_MODEL,
    REASONING_PARSERS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    ServerSettings,
)
from verifier_service.spec_decode import config

if TYPE_CHECKING:
    from verifier_service.model.ranks import Ranks


def _setting(group: argparse._ActionsContainer, name: str, help_text: str, *aliases: str, **options: object) -> None:
    """A flag setting the ServerSettings field `name`; absent from the parsed args when not given."""
    shown = "" if options.get("action") == "store_false" else f" (default: {getattr(DEFAULTS, name)})"
    group.add_argument("--" + name.replace("_", "-"), *aliases, dest=name, default=argparse.SUPPRESS,
                       help=help_text + shown, **options)


SETTING_FLAGS = ("host", "port", "model", "dtype", "device", "prepack_weights", "timing_cache",
                 "tensor_parallel_size", "cuda_graph_max_tokens", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "enable_prefix_caching", "scheduling_policy",
                 "max_queue_len", "kv_cache_memory_gb", "default_max_new_tokens",
                 "max_message_bytes", "max_concurrent_rpcs", "grace_period_s", "metrics_port", "rank_timeout_s",
                 "http_port", "served_model_names", "allowed_origins", "enable_auto_tool_choice", "tool_call_parser",
                 "reasoning_parser", "otlp_traces_endpoint", "generation_config",
                 "responses_store_mb", "max_draft_nodes", "log_stats_interval_s", "log_requests", "webhook_url")


def _http_port(value: str) -> int | None:
    if value == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', not {value!r}") from None


def parser() -> argparse.ArgumentParser:
    # No abbreviations: `--auth-token SECRET` must not pass as a prefix of --auth-token-file.
    p = argparse.ArgumentParser(prog="splitspec-verifier", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--version", action="version", version=package_version())
    _setting(p, "host", "address to listen on")
    _setting(p, "port", "0 picks a free port (see --port-file)", type=int)
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    _setting(p, "http_port", "the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, "
                             "/v1/models, Anthropic's /v1/messages, /health, /ping and /invocations for SageMaker, "
                             "/version, /metrics, and a playground at /); 0 picks a free port (see "
                             "--http-port-file), off disables it",
             type=_http_port, metavar="PORT|off")
    p.add_argument("--http-port-file", help="write the HTTP API's bound port to this file once listening")
    p.add_argument("--served-model-name", dest="served_model_names", nargs="+", type=str, default=argparse.SUPPRESS,
                   metavar="NAME", help="the names the HTTP API accepts as `model` (the first is reported); "
                                        "default: the model's name and the --model value")
    p.add_argument("--allowed-origins", dest="allowed_origins", nargs="*", default=argparse.SUPPRESS,
                   metavar="ORIGIN", help="origins whose web pages may call the HTTP API (CORS), e.g. "
                                          "https://app.example.com; * any; none given: no cross-origin calls "
                                          f"(default: {' '.join(DEFAULTS.allowed_origins)})")
    p.add_argument("--enable-auto-tool-choice", dest="enable_auto_tool_choice", action="store_true",
                   default=argparse.SUPPRESS, help='serve chat tool_choice "auto" (the default with tools), reading '
                                                   "the model's calls with --tool-call-parser (vLLM's flags)")
    _setting(p, "tool_call_parser", "how --enable-auto-tool-choice reads calls from the model's text: hermes "
                                    "(<tool_call> blocks: Hermes, Qwen2.5, Qwen3)", choices=TOOL_CALL_PARSERS)
    _setting(p, "reasoning_parser", "a reasoning model's <think> markers: structured output and tool calls hold "
                                    "its answer, not its thinking, and HTTP answers carry the thinking apart "
                                    "(`reasoning`); deepseek_r1 (DeepSeek-R1, QwQ) or qwen3",
             choices=sorted(REASONING_PARSERS))
    _setting(p, "otlp_traces_endpoint", "an OpenTelemetry collector (OTLP over gRPC) to send a span per request to, "
                                        "e.g. http://otel-collector:4317 (https:// for TLS); under the caller's trace "
                                        "where a traceparent header or metadata names one", metavar="URL")
    _setting(p, "responses_store_mb", "memory for the Responses API's stored responses (GET /v1/responses/{id}, "
                                      "previous_response_id, background responses once they end) and "
                                      "conversations (/v1/conversations), least recently used evicted first; 0 "
                                      "stores none (and refuses background responses and conversations)",
             type=int, metavar="MB")
    _setting(p, "webhook_url", "where to POST OpenAI's webhook event when a background response ends "
                               "(response.completed, .incomplete, .failed, .cancelled), signed with "
                               "--webhook-secret-file", metavar="URL")
    p.add_argument("--webhook-secret-file", metavar="PATH",
                   help="the webhooks' signing secret (whsec_ and base64, as OpenAI writes it, or any text)")
    m = p.add_argument_group("model")
    m.add_argument("--model", dest="model", default=argparse.SUPPRESS,
                   help=f"Hugging Face model folder or .gguf file (default: {EMBEDDED_MODEL})")
    m.add_argument("model_given_first", nargs="?", metavar="MODEL",
                   help="the same as --model, given first as in `vllm serve MODEL`")
    _setting(m, "dtype", "auto: float32 on CPU, bfloat16 on CUDA (float16 on a GPU without it, as vLLM); vLLM's "
                         "half and float name float16 and float32",
             choices=["auto", "float32", "bfloat16", "float16"], type=vllm_flags.dtype)
    _setting(m, "device", "auto, cpu, cuda or cuda:N")
    m.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false", default=argparse.SUPPRESS,
                   help="CPU: do not keep a oneDNN-reordered copy of the linear weights (it is kept only "
                        "if faster for some token counts, and costs as much memory as those weights)")
    _setting(m, "timing_cache", "the forward timings of start-up (the CPU linear layouts, the cost curve), kept "
                                "under $SPLITSPEC_CACHE_DIR (~/.cache/splitspec) per machine, software and model "
                                "shapes: on takes what an earlier start kept and times the rest, refresh times "
                                "everything and keeps it, off times everything and keeps nothing",
             choices=["on", "refresh", "off"])
    _setting(m, "cuda_graph_max_tokens", "CUDA: steps of up to N tokens (rows and each row's tokens padded to a "
                                         "power of two, 8 or more with drafts; a prompt's chunk beside decode "
                                         "rows as a graph of its own) replay as CUDA graphs, every batch size's "
                                         "decode and draft steps captured at start-up, other shapes the second "
                                         "time they are seen; 0: always eager",
             type=int, metavar="N")
    m.add_argument("--enforce-eager", dest="cuda_graph_max_tokens", action="store_const", const=0,
                   default=argparse.SUPPRESS, help="CUDA: no CUDA graphs (vLLM's flag; --cuda-graph-max-tokens 0)")
    _setting(m, "generation_config", "the sampling a request's left-out fields take (temperature, top_p, top_k, "
                                     "min_p, repetition_penalty, and max_new_tokens): auto, the model's "
                                     "generation_config.json, as vLLM; vllm, none (greedy); or a folder holding one",
             metavar="auto|vllm|FOLDER")
    m.add_argument("--override-generation-config", metavar="JSON",
                   help="sampling defaults set on top of --generation-config, as a JSON object, e.g. "
                        "'{\"temperature\": 0.6, \"top_p\": 0.95}' (vLLM's flag)")
    m.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="render chats with this Jinja chat template instead of the model's: a file, or the "
                        "template itself (vLLM's flag); checked at start-up")
    _setting(m, "tensor_parallel_size", "shard the model over N ranks, one GPU each on CUDA (nccl; gloo on CPU); "
                                        "ranks 1..N-1 are started here unless torchrun started them", "-tp",
             type=int)
    c = p.add_argument_group("capacity")
    _setting(c, "max_model_len", "longest prompt + generation", type=int)
    _setting(c, "max_num_seqs", "sequences decoded together", type=int)
    c.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, default=argparse.SUPPRESS,
                   help="tokens one step's forward carries: running sequences' decode and verify rows first, "
                        "long prompts prefilled in chunks of what is left; lower keeps streams smoother during "
                        "a long prefill, higher gives that prompt its first token sooner (default: the most a "
                        "step can carry at 2.5x the measured one-token step, logged at start-up, while "
                        "sequences decode, a late prompt token counting for more by its measured attention, and "
                        "up to 2048 in a step where none does; with CUDA graphs --cuda-graph-max-tokens in every "
                        "step; a value given caps every step, in tokens)")
    c.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=argparse.SUPPRESS,
                   help="do not reuse the KV cache of shared prompt prefixes (on by default; the second is vLLM's)")
    c.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   default=argparse.SUPPRESS, help="reuse them, as by default (vLLM's flag)")
    _setting(c, "scheduling_policy", "fcfs: requests run in order of arrival; priority: by each request's "
                                     "priority (lower first, vLLM's), a running request preempted for one that "
                                     "comes before it and resumed exactly where it stopped",
             choices=SCHEDULING_POLICIES)
    _setting(c, "max_queue_len", "waiting requests before RESOURCE_EXHAUSTED", type=int)
    _setting(c, "kv_cache_memory_gb", "KV cache budget per rank; bounds running sequences", type=float)
    c.add_argument("--default-max-new-tokens", dest="default_max_new_tokens", type=int, default=argparse.SUPPRESS,
                   help="a request's max_new_tokens when it sets none (default: the model's generation config's "
                        "max_new_tokens, else the rest of the context)")
    _setting(c, "max_message_bytes", "largest request or response; larger ones fail with RESOURCE_EXHAUSTED",
             type=int)
    _setting(c, "max_concurrent_rpcs", "calls served at once, health included; more are refused with "
                                       "RESOURCE_EXHAUSTED", type=int)
    config.add_flags(p)
    _setting(p, "max_draft_nodes", "largest token tree verified per sequence, for drafters that draft trees "
                                   "(capability token-tree); the planner sizes each up to it; 0: chains only",
             type=int)
    add_server_flags(p, "security (of this server; the drafter connection has --drafter-tls-* flags)")
    o = p.add_argument_group("operations")
    _setting(o, "grace_period_s", "drain time on SIGTERM", type=float)
    o.add_argument("--metrics-port", dest="metrics_port", type=int, default=argparse.SUPPRESS,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port (logged); "
                        "unset: no metrics endpoint")
    _setting(o, "log_stats_interval_s", "log throughput, load, speculation and drafter calls every S seconds "
                                        "while busy (vLLM's stats lines); 0: never", type=float, metavar="S")
    o.add_argument("--disable-log-stats", dest="log_stats_interval_s", action="store_const", const=0.0,
                   default=argparse.SUPPRESS, help="no stats lines (vLLM's flag; --log-stats-interval-s 0)")
    o.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=argparse.SUPPRESS,
                   help="log a line per request as it ends: its ids, tokens (cached included), queue time, time to "
                        "first token, total, mean acceptance length, drafter wait; metadata only, never text "
                        "(vLLM's flag; with --log-format json, every field of its trace span too)")
    _setting(o, "rank_timeout_s", "tensor parallelism: a rank silent this long in a step is taken as hung, and "
                                  "the verifier fails its requests (UNAVAILABLE) and exits non-zero", type=float)
    add_logging_flags(p)
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Raises config.ConfigError with a message a person can act on."""
    if problem := server_flags_problem(args):
        raise config.ConfigError(problem)
    try:
        token = (watch_tokens(args.auth_token_file) if args.auth_token_file
                 else read_token() or read_token(env_var=vllm_flags.API_KEY_ENV_VAR))
    except (OSError, ValueError) as exc:
        raise config.ConfigError(f"--auth-token-file: {exc}") from None
    try:
        webhook_secret = watch_secret(args.webhook_secret_file) if args.webhook_secret_file else None
    except ValueError as exc:
        raise config.ConfigError(f"--webhook-secret-file: {exc}") from None
    given = {name: getattr(args, name) for name in SETTING_FLAGS if hasattr(args, name)}
    if args.model_given_first is not None:
        if "model" in given:
            raise config.ConfigError(f"two models: {args.model_given_first} and --model {given['model']}")
        given["model"] = args.model_given_first
    for name in ("served_model_names", "allowed_origins"):
        if name in given:
            given[name] = tuple(given[name])
    if args.chat_template is not None:
        given["chat_template"] = _chat_template(args.chat_template)
    if args.override_generation_config is not None:
        try:
            given["override_generation_config"] = generation_config.parse_overrides(args.override_generation_config)
        except ValueError as exc:
            raise config.ConfigError(str(exc)) from None
    return ServerSettings(speculative=config.from_args(args), auth_token=token, webhook_secret=webhook_secret,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, **given)


def _chat_template(value: str) -> str:
    """--chat-template's text: the value itself where it is a template, else the file it names."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise config.ConfigError(f"--chat-template: {value} is neither a Jinja template nor a file "
                                 f"to read ({exc})") from None


def check_start(settings: ServerSettings, rank: Ranks) -> None:
    """Before any server listens, any weight loads or any other rank starts, from the model's config
    alone: the model is there, torch has the device and the dtype, its layers are ones splitspec
    computes, the KV budget holds one sequence, the model splits that many ways, and its sampling
    defaults hold. Raises ModelLoadError, ConfigError or ShardingError."""
    from verifier_service import builder
    from verifier_service.api import request_parsing
    from verifier_service.model import architecture_check, loader, ranks

    source = loader.resolve_source(settings.model)
    sharded = settings.tensor_parallel_size > 1
    device = ranks.rank_device(settings.device, rank) if sharded else loader.pick_device(settings.device)
    model_config = loader.load_config(source)
    architecture_check.check_config(model_config, source.name)
    ranks.check_split(model_config, settings.tensor_parallel_size, source.name, device)
    builder.kv_cache_shape(model_config, loader.pick_dtype(settings.dtype, device), settings,
                           builder.model_len(model_config, settings))
    request_parsing.sampling_defaults(settings, source.path)


def main(argv: list[str] | None = None) -> int:
    skip_final_collection()
    argv = sys.argv[1:] if argv is None else argv
    flags = parser()
    args, unrecognized = flags.parse_known_args(argv)
    if unrecognized:
        flags.error(vllm_flags.explain(unrecognized))
    try:
        settings = settings_from_args(args)
    except config.ConfigError as exc:
        print(f"splitspec-verifier: {exc}", file=sys.stderr)
        return 2
    # Only now torch and transformers (seconds): --help and a bad flag are answered without them.
    with imports_frozen():
        from verifier_service.api.server import run, run_follower
        from verifier_service.model import ranks
        from verifier_service.model.loader import ChatTemplateError, ModelLoadError

    try:
        rank = ranks.this_rank(settings.tensor_parallel_size)
        if rank.leader:
            check_start(settings, rank)
    except (ranks.ShardingError, ModelLoadError, config.ConfigError) as exc:
        print(f"splitspec-verifier: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format, **({"rank": rank.rank} if rank.size > 1 else {}))
    host_memory.keep_freed_memory()  # before the model's first forward
    if not rank.leader:
        return run_follower(settings, rank)
    try:
        asyncio.run(run(settings, port_file=args.port_file, rank=rank, argv=argv,
                        http_port_file=args.http_port_file))
    except (ListenError, ChatTemplateError, ModelLoadError, config.ConfigError) as exc:  # a port, or the model
        print(f"splitspec-verifier: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
