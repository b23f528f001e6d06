"""Run the Node.js example drafter (examples/node-drafter) as a real process.

Reusable by any test that needs a non-Python drafter:

    from node_drafter import node_available, run_node_drafter

    with run_node_drafter(max_ngram=3, max_draft_len=8) as address:
        ...  # "127.0.0.1:PORT", health already SERVING

Keyword flags map to the CLI: ``max_draft_len=8`` -> ``--max-draft-len 8``;
``True`` adds a bare flag, ``None``/``False`` leave it out. ``NodeDrafter``
gives access to the process itself (signals, exit code, log).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

NODE_DRAFTER_DIR = Path(__file__).resolve().parents[2] / "examples" / "node-drafter"
DRAFTER_SERVICE = "splitspec.v1.DrafterService"
_REQUIRED_PACKAGES = ("@grpc/grpc-js", "@grpc/proto-loader", "grpc-health-check")


def node_available() -> bool:
    return shutil.which("node") is not None


def ensure_node_modules(timeout: float = 300.0) -> None:
    """Run ``npm ci`` in the example once if its dependencies are missing."""
    modules = NODE_DRAFTER_DIR / "node_modules"

    def installed() -> bool:
        return all((modules / name / "package.json").is_file() for name in _REQUIRED_PACKAGES)

    if installed():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("node_modules is missing in examples/node-drafter and npm is not on PATH")
    lock_path = Path(tempfile.gettempdir()) / f"splitspec-node-drafter-npm-{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs install once
        if installed():
            return
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_DRAFTER_DIR, capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0 or not installed():
            raise RuntimeError(f"npm ci failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def _cli_flags(flags: dict[str, object]) -> list[str]:
    args: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return args


class NodeDrafter:
    """One Node drafter process on a free port of 127.0.0.1 (by default)."""

    def __init__(self, startup_timeout: float = 30.0, **flags: object) -> None:
        flags.setdefault("host", "127.0.0.1")
        for reserved in ("port", "port_file"):
            if reserved in flags:
                raise ValueError(f"{reserved} is chosen by NodeDrafter")
        self.flags = flags
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log_path: Path | None = None
        self._final_log = ""

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("drafter not started")
        host = str(self.flags["host"])
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def log(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        if self._log_path is None or not self._log_path.exists():
            return self._final_log
        return self._log_path.read_text(errors="replace")

    def start(self) -> NodeDrafter:
        node = shutil.which("node")
        if node is None:
            raise RuntimeError("node is not on PATH")
        ensure_node_modules()
        self._tmp = tempfile.TemporaryDirectory(prefix="node-drafter-")
        tmp = Path(self._tmp.name)
        port_file = tmp / "port"
        self._log_path = tmp / "drafter.log"
        cmd = [node, str(NODE_DRAFTER_DIR / "index.js"), "--port", "0", "--port-file", str(port_file),
               *_cli_flags(self.flags)]
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, cwd=NODE_DRAFTER_DIR, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        try:
            self.port = self._wait_for_port(port_file)
            if not any(str(k).startswith("tls") for k in self.flags):
                self._wait_for_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_port(self, port_file: Path) -> int:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"node drafter exited with {self.process.returncode}:\n{self.log()}")
            if port_file.exists():
                text = port_file.read_text().strip()
                if text:
                    return int(text)
            time.sleep(0.02)
        raise TimeoutError(f"node drafter did not write its port within {self.startup_timeout}s:\n{self.log()}")

    def _wait_for_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=DRAFTER_SERVICE), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError as err:
                    last_error = err
                if self.process.poll() is not None:
                    raise RuntimeError(f"node drafter exited with {self.process.returncode}:\n{self.log()}")
                time.sleep(0.02)
        raise TimeoutError(f"node drafter not SERVING within {self.startup_timeout}s ({last_error}):\n{self.log()}")

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) without waiting."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL if needed. Returns the exit code."""
        rc = None
        if self.process is not None:
            self.terminate()
            try:
                rc = self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                rc = self.process.wait()
        if self._tmp is not None:
            self._final_log = self.log()
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def __enter__(self) -> NodeDrafter:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def run_node_drafter(**flags: object) -> Iterator[str]:
    """Start the Node drafter, wait until it is SERVING, yield its address; stop it on exit."""
    with NodeDrafter(**flags) as drafter:
        yield drafter.address
