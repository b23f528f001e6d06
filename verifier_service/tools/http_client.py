"""How the HTTP commands (`splitspec bench-serve`, `splitspec run-batch`) reach a verifier's HTTP API: a bearer
token, and over HTTPS the CA that signed the verifier's certificate and, where the verifier asks for one
(`--tls-client-ca`), a client certificate: the flags `splitspec generate` takes for gRPC."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass

from drafter_sdk.service.security import TOKEN_ENV_VAR, key_pair_problem, read_token


@dataclass(frozen=True)
class HttpAccess:
    base_url: str  # without a trailing /v1: the commands add each route's whole path
    headers: dict[str, str]  # the bearer token's, where there is one
    verify: ssl.SSLContext | bool  # httpx's `verify`: True checks against the system's CA roots


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("security")
    s.add_argument("--auth-token-file", help=f"file holding the bearer token (default: ${TOKEN_ENV_VAR}, if set)")
    s.add_argument("--tls-ca", help="with an https:// --base-url: PEM CA bundle verifying the verifier's certificate "
                                    "(default: the system's CA roots)")
    s.add_argument("--tls-cert", help="PEM client certificate, for a verifier that asks for one (needs --tls-key)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")


def access(args: argparse.Namespace) -> HttpAccess:
    """Raises ValueError for flags that do not go together, OSError (ssl.SSLError) for files that do not load."""
    if problem := key_pair_problem(args.tls_cert, args.tls_key):
        raise ValueError(problem)
    https = args.base_url.startswith("https://")
    if (args.tls_ca or args.tls_cert) and not https:
        raise ValueError(f"--tls-ca and --tls-cert are for an https:// --base-url, not {args.base_url}")
    token = read_token(args.auth_token_file)
    verify: ssl.SSLContext | bool = True
    if args.tls_ca or args.tls_cert:
        verify = ssl.create_default_context(cafile=args.tls_ca)
        if args.tls_cert:
            verify.load_cert_chain(args.tls_cert, args.tls_key)
    return HttpAccess(args.base_url.rstrip("/").removesuffix("/v1"),
                      {"authorization": f"Bearer {token}"} if token else {}, verify)
