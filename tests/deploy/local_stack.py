"""The rendered cpu overlays' verifier and drafter as local processes, for test_deploy_local.py and
test_deploy_local_tls.py.

Everything comes from `kubectl kustomize deploy/k8s/overlays/<overlay>` and from the
Dockerfiles that build its images: the executable is the image ENTRYPOINT
(unless the container sets `command`), the arguments are the container's
`args` (or the image CMD), the environment is the image ENV overlaid with the
container `env`, the working directory is the image WORKDIR (or `workingDir`).
Only these rewrites are made, because a laptop is not a pod:

1. Executables: the image's /opt/venv/bin/<script> becomes .venv/bin/<script>
   (the image puts /opt/venv/bin first on PATH; PATH itself is not copied).
2. Volumes: every emptyDir becomes a fresh temporary directory; every
   ConfigMap volume becomes a temporary directory holding the ConfigMap's
   data, one file per key (or per `items` entry); every Secret volume one
   holding the test's files for that Secret, the same way (the TLS overlays'
   certificates, from a throwaway PKI, and their tokens). Any arg, env value or
   working directory at or under a mountPath is remapped to that directory.
3. Ports: each containerPort (gRPC and metrics) becomes a free local port;
   the values of `--port` and `--metrics-port` are remapped accordingly, and
   probes and scrapes go to the remapped port.
4. Drafter target: in the written speculative config, the host:port of
   userProvided.drafterTarget (the headless Service's DNS name) becomes
   127.0.0.1:<drafter's local gRPC port>; the `dns:///` scheme, the
   load-balancing policy and every other field stay as rendered.
5. The process environment is only the image ENV + container env (plus PATH
   = .venv/bin:/usr/bin:/bin), as in a container; nothing from the host.
6. Threads: a pod has its CPU request to itself, a test run shares the
   machine. Where the run gives its processes fewer threads than the pod's
   OMP_NUM_THREADS (`pytest -n 2` gives each worker's processes one), the
   run's number is kept: two thread pools spinning on two cores slow each
   other many times over.

Health is checked the way the kubelet's probes do (grpc.health.v1 Check with
the probe's service, "" by default; or GET /health where the probe is
httpGet).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_support import (
    DRAFTER,
    VENV_BIN,
    VERIFIER,
    dockerfile_key_for_image,
    flag_value,
    image_of,
    main_container,
    one,
    render,
    speculative_config_of,
)

from verifier_service.tools.local_services import free_port

STARTUP_BUDGET_S = 240  # of the 300 s test timeout; the probe itself allows 600 s
PORT_FLAGS = ("--port", "--metrics-port", "--http-port")


@dataclass
class Proc:
    name: str
    deployment: dict
    argv: list[str]
    env: dict[str, str]
    cwd: str
    ports: dict[int, int]  # containerPort -> local port
    log: Path
    popen: subprocess.Popen | None = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def probe(self, kind: str) -> dict:
        return main_container(self.deployment)[kind]


def remap_path(value: str, mounts: dict[str, Path]) -> str:
    """Rewrite 2: a path at or under a mountPath moves to its local directory."""
    for mount in sorted(mounts, key=len, reverse=True):
        m = mount.rstrip("/")
        if value == m or value.startswith(m + "/"):
            return str(mounts[mount]) + value[len(m) :]
    return value


def prepare(deploy: dict, objs: list[dict], root: Path, drafter_local_port: int | None = None,
            secrets: dict[str, dict[str, bytes]] | None = None) -> Proc:
    name = deploy["metadata"]["name"]
    pod = deploy["spec"]["template"]["spec"]
    c = main_container(deploy)
    img = image_of(dockerfile_key_for_image(c["image"]))

    # Rewrite 2: volumes.
    local_vols: dict[str, Path] = {}
    for vol in pod.get("volumes") or []:
        d = root / name / "volumes" / vol["name"]
        d.mkdir(parents=True)
        if "emptyDir" in vol:
            pass
        elif "configMap" in vol:
            cm = one(objs, "ConfigMap", vol["configMap"]["name"])
            items = vol["configMap"].get("items") or [{"key": k, "path": k} for k in cm["data"]]
            for item in items:
                (d / item["path"]).write_text(cm["data"][item["key"]])
        elif "secret" in vol and vol["secret"]["secretName"] in (secrets or {}):
            data = (secrets or {})[vol["secret"]["secretName"]]
            items = vol["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (d / item["path"]).write_bytes(data[item["key"]])
        else:
            raise AssertionError(f"{name}: volume {vol['name']} of a kind this test cannot map locally")
        local_vols[vol["name"]] = d
    mounts = {m["mountPath"]: local_vols[m["name"]] for m in c.get("volumeMounts") or []}

    # Rewrite 3: ports.
    ports = {p["containerPort"]: free_port() for p in c["ports"]}

    # Rewrite 1: the executable.
    command = c.get("command") or img.entrypoint
    args = list(c["args"] if "args" in c else img.cmd)
    exe = command[0]
    if "/" in exe:
        exe = Path(exe).name
    local_exe = VENV_BIN / exe
    assert local_exe.exists(), f"{local_exe} not installed: the image entrypoint {command[0]!r} must be a console script"
    out_args = []
    for i, a in enumerate(args):
        if i > 0 and args[i - 1] in PORT_FLAGS:
            assert int(a) in ports, f"{name}: {args[i - 1]} {a} is not a declared containerPort"
            a = str(ports[int(a)])
        out_args.append(remap_path(a, mounts))
    argv = [str(local_exe), *[remap_path(a, mounts) for a in command[1:]], *out_args]

    # Rewrite 5: environment = image ENV + container env, paths remapped.
    env = {k: v for k, v in img.env.items() if k != "PATH"}
    for e in c.get("env") or []:
        assert "valueFrom" not in e, f"{name}: env {e['name']} uses valueFrom; not mappable locally"
        env[e["name"]] = e.get("value", "")
    env = {k: remap_path(v, mounts) for k, v in env.items()}
    env["PATH"] = f"{VENV_BIN}:/usr/bin:/bin"
    # Rewrite 6: threads.
    run_threads = os.environ.get("OMP_NUM_THREADS")
    if run_threads and "OMP_NUM_THREADS" in env and int(run_threads) < int(env["OMP_NUM_THREADS"]):
        env["OMP_NUM_THREADS"] = run_threads
    cwd = remap_path(c.get("workingDir") or img.workdir or "/", mounts)

    # Rewrite 4: the drafter target in the mounted speculative config.
    if drafter_local_port is not None:
        key, cfg, raw = speculative_config_of(objs)
        target = cfg["userProvided"]["drafterTarget"]
        assert target.startswith("dns:///")
        local_target = f"dns:///127.0.0.1:{drafter_local_port}"
        path = Path(remap_path(flag_value(c["args"], "--speculative-config"), mounts))
        assert path.read_text() == raw and raw.count(target) == 1
        path.write_text(raw.replace(target, local_target))

    return Proc(name, deploy, argv, env, cwd, ports, root / f"{name}.log")


def grpc_port(proc: Proc) -> int:
    """The local port standing in for the container's gRPC port (its `--port`)."""
    return proc.ports[int(flag_value(main_container(proc.deployment)["args"], "--port"))]


def health_check(port: int, service: str = "", timeout: float = 3.0) -> str:
    """What the kubelet's gRPC probe does: grpc.health.v1.Health/Check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return f"rpc error: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def http_health_check(port: int, path: str, timeout: float = 3.0) -> str:
    """What the kubelet's httpGet probe does: success is a 2xx or 3xx status."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return "SERVING" if 200 <= response.status < 400 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except OSError as e:
        return f"unreachable: {e}"


def probe_status(proc: Proc, kind: str) -> str:
    """The probe `kind` of the container, made as the kubelet makes it: "SERVING" where it succeeds."""
    probe = proc.probe(kind)
    if "httpGet" in probe:
        return http_health_check(proc.ports[probe["httpGet"]["port"]], probe["httpGet"]["path"])
    return health_check(proc.ports[probe["grpc"]["port"]], probe["grpc"].get("service", ""))


def wait_serving(proc: Proc, deadline: float) -> None:
    status = "not tried"
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        status = probe_status(proc, "readinessProbe")
        if status == "SERVING":
            return
        time.sleep(1.0)
    pytest.fail(f"{proc.name} not SERVING after startup budget (last: {status}):\n{proc.log_tail()}")


@contextlib.contextmanager
def running_stack(overlay: str, root: Path, secrets: dict[str, dict[str, bytes]] | None = None) -> Iterator[dict]:
    """The overlay's drafter and verifier as local processes, both SERVING."""
    objs = render(f"overlays/{overlay}")
    drafter_dep = one(objs, "Deployment", DRAFTER)
    verifier_dep = one(objs, "Deployment", VERIFIER)
    drafter = prepare(drafter_dep, objs, root, secrets=secrets)
    verifier = prepare(verifier_dep, objs, root, drafter_local_port=grpc_port(drafter), secrets=secrets)
    procs = [drafter, verifier]
    try:
        # Like pods, both start at once: the verifier must cope with a drafter
        # that is not up yet.
        for p in procs:
            with open(p.log, "wb") as log:
                p.popen = subprocess.Popen(
                    p.argv, env=p.env, cwd=p.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        deadline = time.monotonic() + STARTUP_BUDGET_S
        for p in procs:
            wait_serving(p, deadline)
        yield {"drafter": drafter, "verifier": verifier, "objs": objs, "overlay": overlay}
    finally:
        for p in procs:
            if p.popen and p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait(10)


def assert_probes_serving(stack) -> None:
    for name in ("drafter", "verifier"):
        p = stack[name]
        c = main_container(p.deployment)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                assert probe_status(p, kind) == "SERVING", f"{p.name} {kind}:\n{p.log_tail()}"


def generate_with_drafts(stack, credentials=None, metadata=None) -> None:  # noqa: ANN001 - grpc is imported late
    """A Generate call whose answer has text and tokens the remote drafter drafted (over TLS with
    `credentials`, with `metadata`: an API key)."""
    import grpc

    from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc

    v = stack["verifier"]
    port = grpc_port(v)
    req = verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
        prompt=(
            "Copy the list exactly.\n"
            "List: red, green, blue, red, green, blue, red, green, blue\n"
            "Copy: red, green, blue, red, green,"
        ),
        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=32),
    ))
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials) as ch:
        try:
            resp = verifier_pb2_grpc.VerifierServiceStub(ch).Generate(req, timeout=120, metadata=metadata)
        except grpc.RpcError as e:
            pytest.fail(f"Generate failed: {e.code().name} {e.details()}\n{v.log_tail()}")
    assert resp.output.text.strip(), f"empty text:\n{v.log_tail()}"
    assert resp.output.stats.num_draft_tokens > 0, (
        f"no tokens drafted by the remote drafter: {resp.output.stats}\n{v.log_tail()}\n{stack['drafter'].log_tail()}"
    )
