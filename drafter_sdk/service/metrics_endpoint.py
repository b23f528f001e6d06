"""The /metrics HTTP endpoint a service serves beside gRPC, on a daemon thread, and /health beside it.

/health answers 200 while the service's gRPC health is SERVING and 503 otherwise (loading, draining),
in plain HTTP whatever the gRPC port serves: the kubelet's gRPC probes speak plaintext only, so a
service serving TLS is probed here instead (deploy/k8s/components/tls).

It always answers in Prometheus' text format 0.0.4, whatever the scraper prefers. Asked for
OpenMetrics first, as Prometheus 2 asks, prometheus_client answers with `escaping=underscores`,
which writes the verifier's `splitspec:` names as `splitspec_` in the samples but not in their
`# TYPE` lines (prometheus/client_python#1177): one metric would carry two names, depending on
the Prometheus that scrapes it, and the dashboards and alerts of deploy/k8s/monitoring would
find nothing under Prometheus 2. The text format keeps every name as registered.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class MetricsServer:
    """The /metrics HTTP endpoint, served from a daemon thread."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up a shutdown

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family  # read when the socket is made, by WSGIServer's own __init__
        super().__init__(address, _QuietHandler)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes come every few seconds: not one log line each."""


def _app(metrics: Callable[..., Iterable[bytes]], serving: Callable[[], bool]) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/health":
            up = serving()
            start_response("200 OK" if up else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"SERVING\n" if up else b"NOT_SERVING\n"]
        return metrics({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    return app


def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                         serving: Callable[[], bool]) -> MetricsServer:
    """/metrics from `registry`, and /health from `serving()`, on host:port."""
    host = host.strip("[]")  # a socket wants a bare IPv6 address ("::"), gRPC a bracketed one ("[::]")
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server = _Server((host, port), family)
    server.set_app(_app(make_wsgi_app(registry), serving))
    thread = threading.Thread(target=server.serve_forever, name="metrics-endpoint", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
