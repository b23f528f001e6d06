"""`splitspec-drafter`: serve a built-in drafter (ngram, model) or a user's Drafter class."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

from drafter_sdk.drafter import Drafter
from drafter_sdk.drafters.ngram import NgramDrafter
from drafter_sdk.security import (
    add_server_flags,
    read_token,
    server_credentials,
    server_flags_problem,
)
from drafter_sdk.server import serve
from drafter_sdk.service import MIB


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--auth-token SECRET` must not pass as a prefix of --auth-token-file.
    parser = argparse.ArgumentParser(prog="splitspec-drafter", description=__doc__, allow_abbrev=False)
    parser.add_argument("drafter", help="'ngram', 'model' (a draft model; needs the model-drafter extra), or a "
                                        "Drafter subclass as module:Class or path/to/file.py:Class "
                                        "(constructed without arguments)")
    parser.add_argument("--host", default="[::]")
    parser.add_argument("--port", type=int, default=50052, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound port to this file once listening")
    parser.add_argument("--idle-timeout-s", type=float, default=600.0,
                        help="forget sequences not seen for this long")
    parser.add_argument("--grace-period-s", type=float, default=10.0,
                        help="on SIGTERM, how long in-flight calls may finish")
    parser.add_argument("--max-message-bytes", type=int, default=16 * MIB,
                        help="largest request or response; larger ones fail with RESOURCE_EXHAUSTED")
    parser.add_argument("--max-concurrent-rpcs", type=int,
                        help="calls served at once; more are refused with RESOURCE_EXHAUSTED (default: no limit)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    parser.add_argument("--max-connection-age-s", type=float, default=300.0,
                        help="close each client connection gracefully after about this long, so clients "
                             "re-resolve DNS and reach replicas added since (0: never; default: 300)")
    parser.add_argument("--log-level", default="INFO")
    add_server_flags(parser)
    parser.add_argument("--max-draft-len", type=int, default=8, help="ngram and model: longest draft proposed")
    ngram = parser.add_argument_group("ngram drafter")
    ngram.add_argument("--max-matching-ngram-size", type=int, default=3)
    ngram.add_argument("--is-keep-all", action=argparse.BooleanOptionalAction, default=True)
    ngram.add_argument("--is-use-oldest", action=argparse.BooleanOptionalAction, default=True)
    ngram.add_argument("--is-public-pool", action=argparse.BooleanOptionalAction, default=False)
    model = parser.add_argument_group("model drafter (pip install 'splitspec[model-drafter]')")
    model.add_argument("--model", help="Hugging Face causal LM folder or .gguf file sharing the verifier's "
                                       "tokenizer (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1 ...")
    model.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, "
                                                       "bfloat16, float16")
    model.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                       help="memory for the draft model's KV cache; a sequence that does not fit gets no draft")
    model.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=True,
                       help="draft the next step right after answering, assuming the whole draft is accepted")
    return parser


def load_drafter_class(spec: str) -> type[Drafter]:
    """Import `module:Class` or `path/to/file.py:Class`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"expected 'ngram', module:Class or path/to/file.py:Class, got {spec!r}")
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
        return NgramDrafter(max_draft_len=args.max_draft_len, max_matching_ngram_size=args.max_matching_ngram_size,
                            is_keep_all=args.is_keep_all, is_use_oldest=args.is_use_oldest,
                            is_public_pool=args.is_public_pool)
    if args.drafter == "model":
        try:
            from drafter_sdk.drafters.model import ModelDrafter
        except ImportError as exc:
            raise ValueError(f"the model drafter needs torch and transformers: pip install "
                             f"'splitspec[model-drafter]' ({exc})") from exc
        return ModelDrafter(args.model, device=args.device, dtype=args.dtype, max_draft_len=args.max_draft_len,
                            kv_cache_memory_gb=args.kv_cache_memory_gb, draft_ahead=args.draft_ahead)
    return load_drafter_class(args.drafter)()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if problem := server_flags_problem(args):
        parser.error(problem)
    if args.max_connection_age_s < 0:
        parser.error("--max-connection-age-s must be 0 (never) or positive")
    try:
        drafter = make_drafter(args)
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        token = read_token(args.auth_token_file)
    except (ValueError, ImportError, OSError) as exc:
        parser.error(str(exc))
    serve(drafter, host=args.host, port=args.port, port_file=args.port_file, idle_timeout_s=args.idle_timeout_s,
          grace_period_s=args.grace_period_s, max_message_bytes=args.max_message_bytes,
          max_concurrent_rpcs=args.max_concurrent_rpcs,
          server_credentials=credentials, auth_token=token, metrics_port=args.metrics_port,
          max_connection_age_s=args.max_connection_age_s)


if __name__ == "__main__":
    main()
