"""The HTTP API's server: uvicorn on the verifier's own event loop, beside the grpc.aio server.

One process, one loop: the routes await the same engine outputs the gRPC servicer
does. The socket is bound here first, so a taken port fails start-up with a
ListenError (as the gRPC and metrics ports do) instead of uvicorn's exit, and port 0
reports the bound port. uvicorn's own signal handling is off: SIGTERM belongs to
api/server.py, which drains both fronts together (`stop`: /health answers 503 and
new requests are refused while the requests in flight, background responses included, finish within the
grace period; those still running then end unavailable, `RunningVerifier.end_drain`: a stream with an error
event, a background response failed). What is left after that is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from uvicorn.config import create_ssl_context

from drafter_sdk.errors import ListenError
from drafter_sdk.service.security import AcceptedTokens, TokenSource
from drafter_sdk.service.watched_files import WatchedFiles
from verifier_service.api.generation import Generations
from verifier_service.api.http_app import build_app
from verifier_service.api.http_requests import HttpState
from verifier_service.api.response_store import ResponseStore
from verifier_service.api.webhooks import Webhooks

log = logging.getLogger(__name__)
CLOSE_S = 1.0  # after the drain: for idle keep-alive connections to close


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the verifier handles signals
        yield


def _follow_certificate_files(config: uvicorn.Config) -> None:
    """Each TLS handshake takes the certificate the files hold now, as the gRPC port's do (security.py):
    the context uvicorn made hands every connection over to the latest one made from them."""
    def load() -> ssl.SSLContext:
        assert config.ssl_certfile is not None
        return create_ssl_context(
            certfile=config.ssl_certfile, keyfile=config.ssl_keyfile, password=config.ssl_keyfile_password,
            ssl_version=config.ssl_version, cert_reqs=config.ssl_cert_reqs, ca_certs=config.ssl_ca_certs,
            ciphers=config.ssl_ciphers)

    paths = [p for p in (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) if p]
    watched = WatchedFiles(load, paths, "TLS certificate (HTTP)")

    def hand_over(connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
        connection.context = watched.get()  # called for every client hello, with or without a server name

    assert config.ssl is not None
    config.ssl.sni_callback = hand_over


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port ("[::]" or "::": every address, IPv4 included)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]") or "::", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port} (HTTP API): {exc.strerror or exc}") from exc
    return sock


class HttpServer:
    def __init__(self, server: _Server, task: asyncio.Task[None], state: HttpState, port: int, tls: bool) -> None:
        self._server = server
        self._task = task
        self.state = state
        self.port = port
        self.tls = tls

    @classmethod
    async def start(cls, generations: Generations, *, host: str, port: int, auth_token: TokenSource | None,
                    max_body_bytes: int, responses_store_bytes: int, tls_cert: str | None = None,
                    tls_key: str | None = None, tls_client_ca: str | None = None, served_names: tuple[str, ...] = (),
                    tool_call_parser: str | None = None, allowed_origins: tuple[str, ...] = (),
                    webhook_url: str | None = None,
                    webhook_secret: bytes | WatchedFiles[bytes] | None = None) -> "HttpServer":
        """Bind and serve (health 503 until the model is attached). Raises ListenError if the port is taken."""
        sock = bind(host, port)
        store = ResponseStore(responses_store_bytes)
        tokens = None if auth_token is None else AcceptedTokens(auth_token)
        state = HttpState(generations, tokens, max_body_bytes, store, served_names, tool_call_parser, allowed_origins,
                          webhooks=Webhooks(webhook_url, webhook_secret) if webhook_url and webhook_secret else None)
        if generations.metrics is not None:
            generations.metrics.track_responses(lambda: len(store), lambda: store.conversations,
                                                lambda: store.used_bytes, lambda: len(state.background))
        config = uvicorn.Config(
            # log_config None: uvicorn's loggers go through the process's own handler and format (--log-format).
            build_app(state), lifespan="off", access_log=False, log_config=None, log_level="warning",
            timeout_graceful_shutdown=CLOSE_S,
            ssl_certfile=tls_cert, ssl_keyfile=tls_key, ssl_ca_certs=tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE)
        if tls_cert:
            config.load()
            _follow_certificate_files(config)
        server = _Server(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http")
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            sock.close()
            task.result()  # raises what failed
            raise OSError(f"the HTTP server on {host}:{port} stopped at start-up")
        bound = sock.getsockname()[1]
        log.info("OpenAI-compatible HTTP API on %s://%s:%d (%s)", "https" if tls_cert else "http", host, bound,
                 "bearer auth" if auth_token else "no auth")
        return cls(server, task, state, bound, tls_cert is not None)

    async def stop(self, grace_s: float) -> None:
        """Refuse new generations (the owner set generations.draining), let the ones in flight finish
        within grace_s, then close."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.state.idle.wait(), grace_s)
        await self.state.background.close()
        if self.state.webhooks is not None:  # after the runs: their ends are announced too
            await self.state.webhooks.close()
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
