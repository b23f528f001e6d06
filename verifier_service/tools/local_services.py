"""Start splitspec services as real local processes (demo, benchmark, tests).

Each child gets a lifeline (drafter_sdk/service/lifecycle.py, `LIFELINE_FD_ENV`): it stops when this
process exits, even when this process is killed too hard to stop it (SIGKILL, the OOM killer),
so no verifier is left holding its KV cache behind a killed `splitspec bench`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_sdk.service.lifecycle import LIFELINE_FD_ENV


def script(name: str) -> str:
    """Path of a console script installed beside this interpreter."""
    return str(Path(sys.executable).with_name(name))


@dataclass
class LocalService:
    """A child process serving gRPC, SERVING before `start` returns; restartable on its port."""

    argv: list[str]
    name: str = "service"
    startup_timeout_s: float = 300.0
    env: dict[str, str] | None = None
    show_output: bool = False  # let the child write to our terminal (model-loading progress)
    channel_credentials: grpc.ChannelCredentials | None = None  # for the readiness probe of a TLS service
    workdir: Path | None = None  # default: a fresh temporary folder
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    port: int = field(default=0, init=False)
    starts: int = field(default=0, init=False)
    _lifeline: int | None = field(default=None, init=False)  # the write end of the child's lifeline

    def __post_init__(self) -> None:
        self.workdir = self.workdir or Path(tempfile.mkdtemp(prefix=f"splitspec-{self.name}-"))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def current_log(self) -> Path | None:
        """This start's output (one file per start, in `workdir`); None when shown on our terminal."""
        if self.show_output:
            return None
        return self.workdir / f"{self.name}-{self.starts}.log"

    def start(self, port: int | None = None) -> "LocalService":
        """Start on `port` (default: the previous start's port, else a free one); wait for SERVING."""
        deadline = time.monotonic() + self.startup_timeout_s
        port = self.port if port is None else port
        port_file = self.workdir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        self.starts += 1
        argv = [*self.argv, "--port", str(port), "--port-file", str(port_file)]
        self._cut_lifeline()
        child_end, self._lifeline = os.pipe()  # neither end is inherited by other children
        env = {**os.environ, **(self.env or {}), LIFELINE_FD_ENV: f"{child_end}:{os.fstat(child_end).st_ino}"}
        try:
            if self.current_log is None:
                self.process = subprocess.Popen(argv, env=env, pass_fds=(child_end,))
            else:
                with open(self.current_log, "wb") as log_file:
                    self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                                    pass_fds=(child_end,))
        finally:
            os.close(child_end)
        try:
            while not port_file.exists() or not port_file.read_text().strip():
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} did not bind a port; log:\n{self.tail()}")
                time.sleep(0.02)
            self.port = int(port_file.read_text())
            self._wait_serving(deadline)
        except BaseException:
            self.stop(timeout_s=5.0)  # a start that failed leaves no process behind
            raise
        return self

    def _wait_serving(self, deadline: float) -> None:
        with (grpc.insecure_channel(self.address) if self.channel_credentials is None
              else grpc.secure_channel(self.address, self.channel_credentials)) as channel:
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
                    raise TimeoutError(f"{self.name} not SERVING in time; log:\n{self.tail()}")
                time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        """The end of this start's output."""
        log = self.current_log
        if log is None:
            return "(see above)"
        try:
            return log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time; the exit status."""
        try:
            if self.process is None or self.process.poll() is not None:
                return self.process.returncode if self.process else 0
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        finally:
            self._cut_lifeline()

    def _cut_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def __enter__(self) -> "LocalService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A port of 127.0.0.1 free now (for a service that must know its peers' ports before they start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_together(stack: contextlib.ExitStack, services: list[LocalService]) -> list[LocalService]:
    """Start `services` at once, each waiting for SERVING on a thread of its own; they stop when
    `stack` closes. The first start that fails is raised once every start has ended."""
    for service in services:
        stack.callback(service.stop)
    with ThreadPoolExecutor(max_workers=max(len(services), 1)) as pool:
        starts = [pool.submit(service.start) for service in services]
    for started in starts:
        started.result()
    return services
