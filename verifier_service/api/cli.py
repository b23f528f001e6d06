"""`splitspec-verifier`: serve a model with speculative decoding over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from drafter_sdk.security import add_server_flags, read_token, server_flags_problem
from verifier_service.spec import config
from verifier_service.api.server import run
from verifier_service.settings import ServerSettings


def parser() -> argparse.ArgumentParser:
    # No abbreviations: `--auth-token SECRET` must not pass as a prefix of --auth-token-file.
    p = argparse.ArgumentParser(prog="splitspec-verifier", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="[::]")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    m = p.add_argument_group("model")
    m.add_argument("--model", help="Hugging Face model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    m.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false",
                   help="CPU: do not keep a oneDNN-reordered copy of the linear weights (it is kept only "
                        "if faster for some token counts, and costs as much memory as those weights)")
    c = p.add_argument_group("capacity")
    c.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + generation")
    c.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    c.add_argument("--max-queue-len", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
    c.add_argument("--kv-cache-memory-gb", type=float, default=4.0, help="KV cache budget; bounds running sequences")
    c.add_argument("--default-max-new-tokens", type=int, default=256)
    c.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024,
                   help="largest request or response; larger ones fail with RESOURCE_EXHAUSTED")
    c.add_argument("--max-concurrent-rpcs", type=int, default=1024,
                   help="calls served at once, health included; more are refused with RESOURCE_EXHAUSTED")
    config.add_flags(p)
    add_server_flags(p, "security (of this server; the drafter connection has --drafter-tls-* flags)")
    o = p.add_argument_group("operations")
    o.add_argument("--grace-period-s", type=float, default=30.0, help="drain time on SIGTERM")
    o.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port (logged); "
                        "unset: no metrics endpoint")
    o.add_argument("--log-level", default="INFO")
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Raises config.ConfigError with a message a person can act on."""
    speculative = config.from_args(args)
    if problem := server_flags_problem(args):
        raise config.ConfigError(problem)
    try:
        token = read_token(args.auth_token_file)
    except (OSError, ValueError) as exc:
        raise config.ConfigError(f"--auth-token-file: {exc}") from None
    return ServerSettings(
        model=args.model, dtype=args.dtype, device=args.device, prepack_weights=args.prepack_weights,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_queue_len=args.max_queue_len,
        kv_cache_memory_gb=args.kv_cache_memory_gb, default_max_new_tokens=args.default_max_new_tokens,
        speculative=speculative, host=args.host, port=args.port, grace_period_s=args.grace_period_s,
        max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, auth_token=token,
        metrics_port=args.metrics_port)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except config.ConfigError as exc:
        print(f"splitspec-verifier: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run(settings, port_file=args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
