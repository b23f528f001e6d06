"""The /metrics HTTP endpoint a service serves beside gRPC, on a daemon thread (prometheus_client's own server)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


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


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    # prometheus_client wants a bare IPv6 address ("::"), gRPC a bracketed one ("[::]").
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsServer(server, thread)
