"""TLS, mutual TLS and bearer-token auth, shared by drafter servers, the verifier server and its drafter client.

Tokens are only ever read from a file or the environment, never taken from a
command line (where `ps` and shell histories would show them).

A server takes one token every client shares, or named tokens (`name token` lines
in a file): a named token, like a client certificate under mutual TLS, tells who is
calling, and a drafter puts that identity into the namespace of the call
(`CallerIdentity`), so one client cannot touch another's sequences by sending its
verifier id.

A token file may list several tokens, one a line: a server takes any of them, a client sends
the first. So a token is rotated without refusing a call, one file for both sides: list the new
token second (every server takes it), then first (every client sends it), then alone (the old one
is refused). The servers and clients of a deployment see a changed Secret up to a minute apart
(the kubelet's sync period), so each step waits for the last to reach them all; vLLM's
`--api-key` takes several keys for the same reason. A named token's name may appear on several
lines the same way.

Certificates and token files are read again when they change (watched_files.py), so a renewed
certificate or a rotated token takes effect without a restart: at the next TLS handshake or call (a
second after the change at most, since a use looks at the files once a second).
"""

from __future__ import annotations

import argparse
import hmac
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
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
Tokens = str | tuple[str, ...] | Mapping[str, str | tuple[str, ...]]
"""The bearer tokens a server takes: one every client shares, several (any of them: a rotation's old and
new), or named ones (name -> its token or tokens), each naming its client."""
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
                       help=f"file of the bearer tokens every call but health must carry one of, one a line "
                            f"(several while one rotates; default: ${TOKEN_ENV_VAR}, if set); never pass the token "
                            "itself")


def key_pair_problem(cert_file: PathLike | None, key_file: PathLike | None) -> str | None:
    """--tls-cert without --tls-key or the other way round (a server's flags or a client's), or None."""
    return "--tls-cert and --tls-key go together" if (cert_file is None) != (key_file is None) else None


def server_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of add_server_flags, or None."""
    if problem := key_pair_problem(args.tls_cert, args.tls_key):
        return problem
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


def read_tokens(token_file: PathLike) -> tuple[str, ...]:
    """The tokens a token file lists, one a line, in order (blank lines and `#` comments skipped): a
    server takes any of them, a client sends the first (module docstring)."""
    tokens = []
    for where, fields in _lines(token_file):
        if len(fields) != 1:
            raise ValueError(f"{where}: expected one token a line")
        tokens.append(fields[0])
    if not tokens:
        raise ValueError(f"auth token file {token_file} is empty")
    return tuple(tokens)


def read_token(token_file: PathLike | None = None, env_var: str = TOKEN_ENV_VAR) -> str | None:
    """The bearer token a client sends: the first `token_file` lists, else the environment variable's; None
    when neither is set. Surrounding whitespace (a trailing newline, typically) is not part of the token."""
    if token_file is not None:
        return sent_token(read_tokens(token_file))
    return os.environ.get(env_var, "").strip() or None


def watch_token(token_file: PathLike) -> WatchedFiles[str]:
    """The bearer token a client sends (read_token), read again when the file changes."""
    return WatchedFiles(lambda: sent_token(read_tokens(token_file)), [token_file], "auth token file")


def watch_tokens(token_file: PathLike) -> WatchedFiles[tuple[str, ...]]:
    """The bearer tokens a server takes (read_tokens), read again when the file changes."""
    return WatchedFiles(lambda: read_tokens(token_file), [token_file], "auth token file")


def watch_named_tokens(path: PathLike) -> WatchedFiles[dict[str, tuple[str, ...]]]:
    """The named tokens `path` holds (read_named_tokens), read again when it changes."""
    return WatchedFiles(lambda: read_named_tokens(path), [path], "auth tokens file")


def current_tokens(source: TokenSource) -> Tokens:
    """The tokens a TokenSource stands for now: watched_files.current, typed (mypy joins str and Mapping into a
    Collection)."""
    return cast(Tokens, current(source))


def read_named_tokens(path: PathLike) -> dict[str, tuple[str, ...]]:
    """Named bearer tokens from a file of `name token` lines (blank lines and `#` comments skipped); a name on
    several lines has several tokens, any of them taken, the first sent (module docstring)."""
    tokens: dict[str, tuple[str, ...]] = {}
    names: dict[str, str] = {}  # token -> name
    for where, fields in _lines(path):
        if len(fields) != 2:
            raise ValueError(f"{where}: expected 'name token'")
        name, token = fields
        if names.setdefault(token, name) != name:
            raise ValueError(f"{where}: {name!r} has the token of {names[token]!r}")
        if token not in tokens.get(name, ()):
            tokens[name] = (*tokens.get(name, ()), token)
    if not tokens:
        raise ValueError(f"auth tokens file {path} names no token")
    return tokens


def _lines(path: PathLike) -> Iterator[tuple[str, list[str]]]:
    """A token file's lines as ("path:line number", their words), blank lines and `#` comments skipped."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            yield f"{path}:{number}", fields


def sent_token(tokens: str | tuple[str, ...]) -> str:
    """The token a client sends of those a file lists: the first."""
    return _listed(tokens)[0]


def _listed(tokens: str | tuple[str, ...]) -> tuple[str, ...]:
    return (tokens,) if isinstance(tokens, str) else tokens


def bearer_name(metadata: Iterable[tuple[str, str | bytes]] | None, tokens: AcceptedTokens) -> str | None:
    """The name of the token a call carries ("" for a shared one); None without a matching token."""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            return tokens.name_of(bearer_value(str(value)))
    return None


def bearer_value(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` value; "" for another scheme (case-insensitive, RFC
    6750)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class CallerIdentity:
    """Who a call comes from: the name of its bearer token (named tokens only: a shared token names
    nobody) and the subject of its client certificate (mutual TLS); "" when nothing identifies it."""

    def __init__(self, tokens: TokenSource | None = None) -> None:
        self._tokens = None if tokens is None else AcceptedTokens(tokens)

    def __call__(self, context: grpc.aio.ServicerContext) -> str:
        parts = []
        if self._tokens is not None and self._tokens.named() and (
                name := bearer_name(context.invocation_metadata(), self._tokens)):
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
        self._tokens = AcceptedTokens(tokens)
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
        return bearer_name(details.invocation_metadata, self._tokens) is not None


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


class AcceptedTokens:
    """The tokens a server takes, as a TokenSource gives them now, for the check every call makes: encoded
    again only when the source gives new ones (a token file that changed). Raises ValueError for no token
    or an empty one."""

    def __init__(self, source: TokenSource) -> None:
        self._source = source
        # (the tokens, as (name, bytes) pairs; "" names a shared one): one attribute, one swap
        self._made: tuple[Tokens, tuple[tuple[str, bytes], ...]] | None = None
        self._encoded()

    def named(self) -> bool:
        return isinstance(current_tokens(self._source), Mapping)

    def name_of(self, supplied: str) -> str | None:
        """The name of the token `supplied` is ("" for a shared one); None where it is none of them. Every
        token is compared, each in constant time."""
        found = None
        for name, token in self._encoded():
            if hmac.compare_digest(supplied.encode(), token):
                found = name
        return found

    def _encoded(self) -> tuple[tuple[str, bytes], ...]:
        tokens, made = current_tokens(self._source), self._made
        if made is None or made[0] is not tokens:
            made = self._made = (tokens, _as_pairs(tokens))
        return made[1]


def _as_pairs(tokens: Tokens) -> tuple[tuple[str, bytes], ...]:
    named = {"": tokens} if isinstance(tokens, (str, tuple)) else tokens
    pairs = tuple((name, token.encode()) for name, listed in named.items() for token in _listed(listed))
    if not pairs or not all(token for _, token in pairs):
        raise ValueError("a bearer token must not be empty")
    return pairs


def _read(path: PathLike) -> bytes:
    return Path(path).read_bytes()
