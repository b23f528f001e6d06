"""The speculative config: a file or an inline JSON object (SpeculativeConfig in protobuf's JSON
mapping, as JSON or YAML; or vLLM's --speculative-config, vllm_config.py) and/or flags, validated once
at start-up, defaults filled in."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.proto import speculative_pb2
from verifier_service.spec_decode import vllm_config

Mode = speculative_pb2.SpeculativeDecodingMode
MODE_PREFIX = "SPECULATIVE_DECODING_MODE_"
NONE = Mode.SPECULATIVE_DECODING_MODE_NONE
NGRAM = Mode.SPECULATIVE_DECODING_MODE_NGRAM
USER_PROVIDED = Mode.SPECULATIVE_DECODING_MODE_USER_PROVIDED
SUFFIX = Mode.SPECULATIVE_DECODING_MODE_SUFFIX
DRAFT_TARGET = Mode.SPECULATIVE_DECODING_MODE_DRAFT_TARGET
SERVED_MODES = (NONE, NGRAM, SUFFIX, USER_PROVIDED, DRAFT_TARGET)
# The oneof section each mode takes (the others parse, so configs from other engines load).
MODE_CONFIG_FIELD = {USER_PROVIDED: "user_provided", NGRAM: "ngram", SUFFIX: "suffix",
                     Mode.SPECULATIVE_DECODING_MODE_DRAFT_TARGET: "draft_model",
                     Mode.SPECULATIVE_DECODING_MODE_EAGLE3: "draft_model",
                     Mode.SPECULATIVE_DECODING_MODE_MEDUSA: "draft_model",
                     Mode.SPECULATIVE_DECODING_MODE_MTP: "draft_model",
                     Mode.SPECULATIVE_DECODING_MODE_LOOKAHEAD: "lookahead"}
# The flags that fill a section, named when a mode is given a section it does not take.
SECTION_FLAGS = {"user_provided": "--drafter-target and the other --drafter-* flags",
                 "ngram": "--max-matching-ngram-size", "draft_model": "--draft-model and the other --draft-* flags"}
DEFAULT_MAX_DRAFT_LEN = 8
MAX_DRAFT_LEN_LIMIT = 64
DEFAULT_CALL_DEADLINE_S = 0.05
DEFAULT_DELTA_OVERLAP_STEPS = 8
MAX_DELTA_OVERLAP_STEPS = 1024
DEFAULT_NGRAM_SIZE = 3
DEFAULT_DRAFT_KV_CACHE_GB = 1.0
DRAFT_MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """The speculative configuration cannot be served; the message says why."""


def mode_name(mode: int) -> str:
    return Mode.Name(mode).removeprefix(MODE_PREFIX)


def parse_mode(text: str) -> int:
    name = text.strip().upper().replace("-", "_")
    name = name if name.startswith(MODE_PREFIX) else MODE_PREFIX + name
    try:
        return Mode.Value(name)
    except ValueError:
        known = ", ".join(mode_name(v) for v in Mode.values() if v)
        raise ConfigError(f"unknown speculation mode {text!r}; known modes: {known}") from None


def load(source: str | Path) -> speculative_pb2.SpeculativeConfig:
    """The config a file holds, or `source` itself where it is a JSON object (it starts with "{"): this
    verifier's SpeculativeConfig, or vLLM's speculative config (vllm_config.py)."""
    inline = isinstance(source, str) and source.lstrip().startswith("{")
    where = "the inline speculative config" if inline else str(source)
    try:
        data: Any = yaml.safe_load(source if inline else Path(source).read_text())  # YAML holds JSON
    except OSError as exc:
        raise ConfigError(f"cannot read speculative config {source}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is neither valid YAML nor JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a SpeculativeConfig object, found {type(data).__name__}")
    if vllm_config.is_vllm(data):
        try:
            return vllm_config.translate(data)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if isinstance(data.get("mode"), str):  # accept "NGRAM" as well as the full enum name
        data["mode"] = Mode.Name(parse_mode(data["mode"]))
    try:
        return json_format.ParseDict(data, speculative_pb2.SpeculativeConfig())
    except json_format.ParseError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (flags override --speculative-config)")
    g.add_argument("--speculative-config", metavar="FILE|JSON",
                   help="SpeculativeConfig in protobuf JSON mapping, as .json or .yaml, or inline as a JSON object; "
                        "vLLM's --speculative-config JSON is read too")
    g.add_argument("--speculative-mode", metavar="MODE",
                   help="none, ngram, suffix, user_provided or draft_target (other known modes are refused)")
    g.add_argument("--max-draft-len", type=int,
                   help=f"most draft tokens verified per sequence and step (default {DEFAULT_MAX_DRAFT_LEN})")
    g.add_argument("--drafter-target", help="gRPC target of the drafter, e.g. localhost:50052 or dns:///drafter:50052")
    g.add_argument("--drafter-deadline-ms", type=float, help=f"deadline of one drafter call (default {DEFAULT_CALL_DEADLINE_S * 1000:g})")
    g.add_argument("--overlap-drafter-calls", action=argparse.BooleanOptionalAction, default=None,
                   help="USER_PROVIDED: where the drafter looks ahead, verify what is left of its last draft and "
                        "read the step's call after the forward instead of waiting for it (default on)")
    g.add_argument("--share-finished-with-replicas", action=argparse.BooleanOptionalAction, default=None,
                   help="USER_PROVIDED: where the drafter learns from finished requests, tell every replica behind "
                        "--drafter-target of each one, not only the replica that served it (default on)")
    g.add_argument("--max-matching-ngram-size", type=int, help=f"NGRAM: longest suffix looked up (default {DEFAULT_NGRAM_SIZE})")
    g.add_argument("--draft-model", metavar="PATH",
                   help="DRAFT_TARGET: draft model folder or .gguf sharing the model's tokenizer "
                        "(default: the embedded SmolLM2)")
    g.add_argument("--draft-device", help="DRAFT_TARGET: device of the draft model (default: the model's)")
    g.add_argument("--draft-dtype", help="DRAFT_TARGET: dtype of the draft model (default: the model's)")
    g.add_argument("--draft-kv-cache-memory-gb", type=float,
                   help=f"DRAFT_TARGET: the draft model's KV memory (default {DEFAULT_DRAFT_KV_CACHE_GB:g})")
    g.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="DRAFT_TARGET: draft the next step while the model verifies (default on)")
    t = parser.add_argument_group("drafter connection security (flags override user_provided.tls / auth_token_file)")
    t.add_argument("--drafter-tls-ca", metavar="PEM",
                   help="CA bundle verifying the drafter's certificate: connect over TLS")
    t.add_argument("--drafter-tls-cert", metavar="PEM", help="client certificate for mutual TLS (needs --drafter-tls-key)")
    t.add_argument("--drafter-tls-key", metavar="PEM", help="private key of --drafter-tls-cert")
    t.add_argument("--drafter-tls-server-name", metavar="NAME",
                   help="expected name in the drafter's certificate when it differs from the target host")
    t.add_argument("--drafter-auth-token-file", metavar="FILE",
                   help="file holding the bearer token sent to the drafter, its first line where it lists "
                        "several (never the token itself)")


def from_args(args: argparse.Namespace) -> speculative_pb2.SpeculativeConfig:
    """The config file (if any) with the flags applied over it; validated by ServerSettings."""
    config = load(args.speculative_config) if args.speculative_config else speculative_pb2.SpeculativeConfig()
    if args.speculative_mode:
        config.mode = parse_mode(args.speculative_mode)
    if args.max_draft_len is not None:
        config.max_draft_len = args.max_draft_len
    if args.drafter_target is not None:
        config.user_provided.drafter_target = args.drafter_target
    if args.drafter_deadline_ms is not None:
        config.user_provided.call_deadline.FromMilliseconds(int(args.drafter_deadline_ms))
    if args.overlap_drafter_calls is not None:
        config.user_provided.overlap_calls = args.overlap_drafter_calls
    if args.share_finished_with_replicas is not None:
        config.user_provided.share_finished = args.share_finished_with_replicas
    if args.max_matching_ngram_size is not None:
        config.ngram.max_matching_ngram_size = args.max_matching_ngram_size
    for flag, field_name in (("draft_model", "model"), ("draft_device", "device"), ("draft_dtype", "dtype"),
                             ("draft_kv_cache_memory_gb", "kv_cache_memory_gb"), ("draft_ahead", "draft_ahead")):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(config.draft_model, field_name, value)
    for flag, field_name in (("drafter_tls_ca", "ca_cert_file"), ("drafter_tls_cert", "cert_file"),
                             ("drafter_tls_key", "key_file"), ("drafter_tls_server_name", "server_name_override")):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(config.user_provided.tls, field_name, value)
    if getattr(args, "drafter_auth_token_file", None) is not None:
        config.user_provided.auth_token_file = args.drafter_auth_token_file
    return config


def validate(config: speculative_pb2.SpeculativeConfig) -> speculative_pb2.SpeculativeConfig:
    """Refuse what cannot be served; return a copy with defaults filled in."""
    config = speculative_pb2.SpeculativeConfig.FromString(config.SerializeToString())
    if config.mode == Mode.SPECULATIVE_DECODING_MODE_UNSPECIFIED:
        config.mode = Mode.SPECULATIVE_DECODING_MODE_NONE
    name = mode_name(config.mode)
    if config.mode not in SERVED_MODES:
        raise ConfigError(f"speculation mode {name} is not supported by this verifier; "
                          f"it serves {', '.join(mode_name(m) for m in SERVED_MODES)} (use USER_PROVIDED with a "
                          f"drafter service to bring any other drafting technique)")
    which = config.WhichOneof("mode_config")
    if which is not None and which != MODE_CONFIG_FIELD.get(config.mode):
        owner = next(mode_name(m) for m, field in MODE_CONFIG_FIELD.items() if field == which)
        flags = f" (set by {SECTION_FLAGS[which]})" if which in SECTION_FLAGS else ""
        raise ConfigError(f"mode {name} does not take a `{which}` section{flags}; it belongs to mode {owner}")
    if config.mode == NONE:
        config.max_draft_len = 0
        return config
    if config.max_draft_len == 0:
        config.max_draft_len = DEFAULT_MAX_DRAFT_LEN
    if config.max_draft_len > MAX_DRAFT_LEN_LIMIT:
        raise ConfigError(f"max_draft_len {config.max_draft_len} is above the limit {MAX_DRAFT_LEN_LIMIT}")
    if config.mode == NGRAM:
        ng = config.ngram
        if ng.max_matching_ngram_size == 0:
            ng.max_matching_ngram_size = DEFAULT_NGRAM_SIZE
        for knob, default in (("is_keep_all", True), ("is_use_oldest", True), ("is_public_pool", False)):
            if not ng.HasField(knob):
                setattr(ng, knob, default)
        try:
            ngram_drafter(config)  # the drafter checks the values
        except ValueError as exc:
            raise ConfigError(f"ngram: {exc}") from None
    if config.mode == SUFFIX:
        _fill_suffix(config.suffix)
    if config.mode == DRAFT_TARGET:
        _fill_draft_model(config.draft_model)
    if config.mode == USER_PROVIDED:
        up = config.user_provided
        if not up.drafter_target:
            raise ConfigError("mode USER_PROVIDED needs user_provided.drafter_target (or --drafter-target)")
        if up.call_deadline.ToNanoseconds() <= 0:
            up.call_deadline.FromNanoseconds(int(DEFAULT_CALL_DEADLINE_S * 1e9))
        if not up.load_balancing_policy:
            up.load_balancing_policy = "round_robin"
        if up.delta_overlap_steps == 0:
            # pick_first sends every call to one replica: plain deltas are enough there.
            up.delta_overlap_steps = DEFAULT_DELTA_OVERLAP_STEPS if up.load_balancing_policy == "round_robin" else 1
        if not up.HasField("overlap_calls"):
            up.overlap_calls = True
        if not up.HasField("share_finished"):
            up.share_finished = True
        if up.delta_overlap_steps > MAX_DELTA_OVERLAP_STEPS:
            raise ConfigError(f"delta_overlap_steps {up.delta_overlap_steps} is above the limit "
                              f"{MAX_DELTA_OVERLAP_STEPS}")
        if up.load_balancing_policy not in ("round_robin", "pick_first"):
            raise ConfigError(f"load_balancing_policy must be round_robin or pick_first, "
                              f"not {up.load_balancing_policy!r}")
        if up.HasField("tls") and bool(up.tls.cert_file) != bool(up.tls.key_file):
            raise ConfigError("user_provided.tls needs both cert_file and key_file for mutual TLS, or neither")
        # Checked now, not when the drafter client is built after a long model load.
        for what, path in (("tls.ca_cert_file", up.tls.ca_cert_file), ("tls.cert_file", up.tls.cert_file),
                           ("tls.key_file", up.tls.key_file), ("auth_token_file", up.auth_token_file)):
            if path and not Path(path).is_file():
                raise ConfigError(f"user_provided.{what} {path}: no such file")
    policy = config.policy
    if not policy.HasField("adaptive_draft_len"):
        policy.adaptive_draft_len = True
    for rule in policy.draft_len_schedule:
        if rule.max_batch_size == 0:
            raise ConfigError("every draft_len_schedule rule needs max_batch_size >= 1")
    auto = policy.auto_disable
    if not 0.0 <= auto.min_acceptance_rate <= 1.0:
        raise ConfigError(f"auto_disable.min_acceptance_rate must be within [0, 1], not {auto.min_acceptance_rate}")
    return config


def _fill_suffix(sx: speculative_pb2.SuffixConfig) -> None:
    """Unset knobs take SuffixDrafter's defaults (vLLM's, own_spec_factor, prefer_longer_match and
    learn_choice); the drafter checks the values."""
    defaults = SuffixDrafter()
    if sx.max_tree_depth == 0:
        sx.max_tree_depth = defaults.max_tree_depth
    for knob in ("max_cached_requests", "max_cached_mib", "max_spec_factor", "max_spec_offset", "min_token_prob",
                 "own_spec_factor", "prefer_longer_match", "learn_choice"):
        if not sx.HasField(knob):
            setattr(sx, knob, getattr(defaults, knob))
    if sx.cache_scope == speculative_pb2.SUFFIX_CACHE_SCOPE_UNSPECIFIED:
        sx.cache_scope = speculative_pb2.SUFFIX_CACHE_SCOPE_GLOBAL
    try:
        suffix_drafter(sx)
    except ValueError as exc:
        raise ConfigError(f"suffix: {exc}") from None


def ngram_drafter(config: speculative_pb2.SpeculativeConfig) -> NgramDrafter:
    """The in-process NgramDrafter an NGRAM config (filled in) describes."""
    ng = config.ngram
    return NgramDrafter(max_draft_len=config.max_draft_len, max_matching_ngram_size=ng.max_matching_ngram_size,
                        is_keep_all=ng.is_keep_all, is_use_oldest=ng.is_use_oldest, is_public_pool=ng.is_public_pool,
                        tree_min_prob=ng.tree_min_prob)


def suffix_drafter(sx: speculative_pb2.SuffixConfig) -> SuffixDrafter:
    """The in-process SuffixDrafter a (filled-in) SuffixConfig describes."""
    scope = speculative_pb2.SuffixCacheScope.Name(sx.cache_scope).removeprefix("SUFFIX_CACHE_SCOPE_").lower()
    return SuffixDrafter(max_tree_depth=sx.max_tree_depth, max_cached_requests=sx.max_cached_requests,
                         max_spec_factor=sx.max_spec_factor, max_spec_offset=sx.max_spec_offset,
                         min_token_prob=sx.min_token_prob, cache_prompts=sx.cache_prompts, cache_scope=scope,
                         own_spec_factor=sx.own_spec_factor, prefer_longer_match=sx.prefer_longer_match,
                         learn_choice=sx.learn_choice, max_cached_mib=sx.max_cached_mib)


def _fill_draft_model(dm: speculative_pb2.DraftModelConfig) -> None:
    dm.device = dm.device or "auto"
    dm.dtype = dm.dtype or "auto"
    if dm.dtype not in DRAFT_MODEL_DTYPES:
        raise ConfigError(f"draft_model.dtype must be one of {', '.join(DRAFT_MODEL_DTYPES)}, not {dm.dtype!r}")
    if dm.kv_cache_memory_gb < 0:
        raise ConfigError(f"draft_model.kv_cache_memory_gb must be positive, not {dm.kv_cache_memory_gb}")
    dm.kv_cache_memory_gb = dm.kv_cache_memory_gb or DEFAULT_DRAFT_KV_CACHE_GB
    if not dm.HasField("draft_ahead"):
        dm.draft_ahead = True
    # Checked now, not after the target model's long load.
    if dm.model and (Path(dm.model).is_absolute() or dm.model.startswith(".")) and not Path(dm.model).exists():
        raise ConfigError(f"draft_model.model {dm.model}: no such file or folder")
