"""Start splitspec services as real local processes (demo, benchmark, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def script(name: str) -> str:
    """Path of a console script installed beside this interpreter."""
    return str(Path(sys.executable).with_name(name))


@dataclass
class LocalService:
    """A child process serving gRPC on a free port, SERVING before `start` returns."""

    argv: list[str]
    name: str = "service"
    startup_timeout_s: float = 300.0
    env: dict[str, str] | None = None
    log_path: Path | None = None
    show_output: bool = False  # let the child write to our terminal (model-loading progress)
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    port: int = field(default=0, init=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "LocalService":
        workdir = Path(tempfile.mkdtemp(prefix=f"splitspec-{self.name}-"))
        port_file = workdir / "port"
        argv = [*self.argv, "--port", "0", "--port-file", str(port_file)]
        env = {**os.environ, **(self.env or {})}
        if self.show_output:
            self.process = subprocess.Popen(argv, env=env)
        else:
            self.log_path = self.log_path or workdir / "log.txt"
            with open(self.log_path, "wb") as log_file:
                self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not bind a port; log: {self.log_path}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.wait_serving(deadline)
        return self

    def wait_serving(self, deadline: float) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not SERVING in time; log: {self.log_path}")
                time.sleep(0.1)

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path else "(see above)"
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> "LocalService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
