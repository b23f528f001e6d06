"""TLS, mutual TLS and bearer-token auth, shared by drafter servers, the verifier server and its drafter client.

Tokens are only ever read from a file or the environment, never taken from a
command line (where `ps` and shell histories would show them).

A server takes one token every client shares, or named tokens (`name token` lines
in a file): a named token, like a client certificate under mutual TLS, tells who is
calling, and a drafter puts that identity into the namespace of the call
(`CallerIdentity`), so one client cannot touch another's sequences by sending its
verifier id.

Certificates and token files are read again when they change (watched_files.py), so a renewed
certificate or a rotated token takes effect without a restart: at the next TLS handshake or call (a
second after the change at most, since a use looks at the files once a second).
"""

from __future__ import annotations

import argparse
import hmac
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import grpc

from drafter_sdk.service.watched_files import WatchedFiles, current

TOKEN_ENV_VAR = "SPLITSPEC_AUTH_TOKEN"
AUTH_METADATA_KEY = "authorization"
# Probes (Kubernetes gRPC probes, grpcurl) cannot send a token.
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})

PathLike = str | os.PathLike[str]
Tokens = str | Mapping[str, str]
"""One bearer token every client shares, or named tokens (name -> token), each naming its client."""
TokenSource = Tokens | WatchedFiles[Tokens]
"""Tokens as given, or as a file holds them now."""


def add_server_flags(parser: argparse.ArgumentParser, title: str = "security") -> None:
    """The TLS and token flags of a splitspec server (drafter and verifier alike)."""
    group = parser.add_argument_group(title, "the files are read again when they change: a renewed certificate "
                                             "or a rotated token takes effect without a restart")
    group.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    group.add_argument("--auth-token-file",
                       help=f"file holding the bearer token every call but health must carry "
                            f"(default: ${TOKEN_ENV_VAR}, if set); never pass the token itself")


def server_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of add_server_flags, or None."""
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if args.tls_client_ca and not args.tls_cert:
        return "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)"
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-client-ca", args.tls_client_ca)):
        if path and not Path(path).is_file():
            return f"{flag} {path}: no such file"
    return None


def server_credentials(cert_file: PathLike, key_file: PathLike,
                       client_ca_file: PathLike | None = None) -> grpc.ServerCredentials:
    """Serve TLS with this certificate chain and key; with `client_ca_file`, require client certificates
    signed by that CA bundle (mutual TLS). A change to any of the files takes effect at the next handshake
    (module docstring). Raises OSError (ssl.SSLError: a key that is not the certificate's) or ValueError."""
    def load() -> grpc.ServerCertificateConfiguration:
        check_tls_files(cert_file, key_file, client_ca_file)
        return grpc.ssl_server_certificate_configuration(
            [(_read(key_file), _read(cert_file))], root_certificates=_read(client_ca_file) if client_ca_file else None)

    watched = WatchedFiles(load, [f for f in (cert_file, key_file, client_ca_file) if f], "TLS certificate")
    # gRPC asks at each handshake. Never None ("unchanged"): a server made later with these credentials
    # would find nothing to start from; a handshake is once a connection, so making it afresh costs little.
    return grpc.dynamic_ssl_server_credentials(watched.get(), watched.get,
                                               require_client_authentication=client_ca_file is not None)


def check_tls_files(cert_file: PathLike | None, key_file: PathLike | None, ca_file: PathLike | None = None,
                    protocol: int = ssl.PROTOCOL_TLS_SERVER) -> None:
    """Raises ssl.SSLError where the files do not make a TLS server (or, with PROTOCOL_TLS_CLIENT, client): a
    key that is not the certificate's, a CA bundle that holds no certificate. gRPC would take them, and fail
    every handshake."""
    context = ssl.SSLContext(protocol)
    if cert_file and key_file:
        context.load_cert_chain(cert_file, key_file)
    if ca_file:
        context.load_verify_locations(ca_file)


def channel_credentials(ca_file: PathLike | None = None, cert_file: PathLike | None = None,
                        key_file: PathLike | None = None) -> grpc.ChannelCredentials:
    """Client TLS: verify the server with `ca_file` (default: the system roots); present
    `cert_file`/`key_file` for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file) if ca_file else None,
        private_key=_read(key_file) if key_file else None,
        certificate_chain=_read(cert_file) if cert_file else None)


def watch_channel_credentials(ca_file: PathLike | None = None, cert_file: PathLike | None = None,
                              key_file: PathLike | None = None, what: str = "client TLS credentials"
                              ) -> WatchedFiles[grpc.ChannelCredentials]:
    """channel_credentials, made again when a file changes (a renewed client certificate); a channel
    keeps the credentials it was opened with, so its holder opens a new one (GrpcTransport)."""
    def load() -> grpc.ChannelCredentials:
        check_tls_files(cert_file, key_file, ca_file, ssl.PROTOCOL_TLS_CLIENT)
        return channel_credentials(ca_file, cert_file, key_file)

    return WatchedFiles(load, [f for f in (ca_file, cert_file, key_file) if f], what)


def read_token(token_file: PathLike | None = None, env_var: str = TOKEN_ENV_VAR) -> str | None:
    """The bearer token from `token_file`, else from the environment variable; None when neither is set.

    Surrounding whitespace (a trailing newline, typically) is not part of the token.
    """
    if token_file is not None:
        return _token_in(token_file)
    return os.environ.get(env_var, "").strip() or None


def _token_in(token_file: PathLike) -> str:
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {token_file} is empty")
    return token


def watch_token(token_file: PathLike) -> WatchedFiles[str]:
    """The bearer token `token_file` holds, read again when it changes."""
    return WatchedFiles(lambda: _token_in(token_file), [token_file], "auth token file")


def watch_named_tokens(path: PathLike) -> WatchedFiles[dict[str, str]]:
    """The named tokens `path` holds (read_named_tokens), read again when it changes."""
    return WatchedFiles(lambda: read_named_tokens(path), [path], "auth tokens file")


def current_tokens(source: TokenSource) -> Tokens:
    """The tokens a TokenSource stands for now: watched_files.current, typed (mypy joins str and Mapping into a
    Collection)."""
    return cast(Tokens, current(source))


def read_named_tokens(path: PathLike) -> dict[str, str]:
    """Named bearer tokens from a file of `name token` lines (blank lines and `#` comments skipped)."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'name token'")
        name, token = fields
        if name in tokens:
            raise ValueError(f"{path}:{number}: the name {name!r} appears twice")
        if token in tokens.values():
            raise ValueError(f"{path}:{number}: {name!r} has the token of another name")
        tokens[name] = token
    if not tokens:
        raise ValueError(f"auth tokens file {path} names no token")
    return tokens


def bearer_name(metadata: Iterable[tuple[str, str | bytes]] | None, tokens: Mapping[str, bytes]) -> str | None:
    """The name of the token a call carries ("" for a shared one); None without a matching token."""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            scheme, _, supplied = str(value).partition(" ")
            if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 6750)
                return None
            found = None
            for name, token in tokens.items():  # constant time, and every token compared
                if hmac.compare_digest(supplied.strip().encode(), token):
                    found = name
            return found
    return None


class CallerIdentity:
    """Who a call comes from: the name of its bearer token (named tokens only: a shared token names
    nobody) and the subject of its client certificate (mutual TLS); "" when nothing identifies it."""

    def __init__(self, tokens: TokenSource | None = None) -> None:
        self._tokens = None if tokens is None else _EncodedTokens(tokens)

    def __call__(self, context: grpc.aio.ServicerContext) -> str:
        parts = []
        if self._tokens is not None and self._tokens.named() and (
                name := bearer_name(context.invocation_metadata(), self._tokens())):
            parts.append(f"token:{name}")
        subject = (context.auth_context() or {}).get("x509_subject")
        if subject:
            parts.append(f"cert:{subject[0].decode(errors='replace')}")
        return ",".join(parts)


def carries_token(identity: str, name: str) -> bool:
    """Whether a caller `CallerIdentity` named carries the token named `name`."""
    return f"token:{name}" in identity.split(",")


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying the token; works over plaintext and TLS channels alike."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


def call_credentials(token: str) -> grpc.CallCredentials:
    """The token as call credentials, to compose with TLS channel credentials
    (gRPC refuses to send call credentials over plaintext)."""
    return grpc.access_token_call_credentials(token)


class BearerTokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (one of the named tokens) with UNAUTHENTICATED.

    Services in `open_services` (health, reflection) stay reachable without a token.
    """

    def __init__(self, tokens: TokenSource, open_services: Iterable[str] = OPEN_SERVICES) -> None:
        if not current_tokens(tokens):
            raise ValueError("the bearer token must not be empty")
        self._tokens = _EncodedTokens(tokens)
        self._tokens()  # raises for an empty one among named tokens
        self._open_services = frozenset(open_services)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service in self._open_services or self._authorized(handler_call_details):
            return handler
        return _unauthenticated_like(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        return bearer_name(details.invocation_metadata, self._tokens()) is not None


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _unauthenticated_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that refuses the call."""
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(_deny, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class _EncodedTokens:
    """A TokenSource's tokens as bytes, name -> token ("" names a shared one), for the check every call makes:
    encoded again only when the source gives new tokens (a token file that changed)."""

    def __init__(self, source: TokenSource) -> None:
        self._source = source
        self._made: tuple[Tokens, dict[str, bytes]] | None = None  # (the tokens, as bytes): one attribute, one swap

    def named(self) -> bool:
        return isinstance(current_tokens(self._source), Mapping)

    def __call__(self) -> dict[str, bytes]:
        tokens, made = current_tokens(self._source), self._made
        if made is None or made[0] is not tokens:
            made = self._made = (tokens, _encoded(tokens))
        return made[1]


def _encoded(tokens: Tokens) -> dict[str, bytes]:
    named = {"": tokens} if isinstance(tokens, str) else dict(tokens)
    if not all(named.values()):
        raise ValueError("a bearer token must not be empty")
    return {name: token.encode() for name, token in named.items()}


def _read(path: PathLike) -> bytes:
    return Path(path).read_bytes()
