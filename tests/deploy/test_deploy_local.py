"""Run the rendered cpu overlays' verifier and drafter as local processes.

Both CPU overlays run: `cpu` (the n-gram drafter) and `cpu-suffix-drafter` (the suffix drafter, which
learns from finished requests). Everything comes from `kubectl kustomize deploy/k8s/overlays/<overlay>` and from the
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
   holding the test's files for that Secret (the cpu-tls overlay's
   certificates, from a throwaway PKI). Any arg, env value or
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
httpGet), then a Generate call must
come back with text and drafted tokens, and SIGTERM must end both processes
within terminationGracePeriodSeconds minus the preStop sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from certs import make_pki, service_tls_files, tls_files
from deploy_support import (
    DRAFTER,
    VENV_BIN,
    VERIFIER,
    alert_rules,
    dockerfile_key_for_image,
    exported_series,
    flag_value,
    image_of,
    main_container,
    metric_names,
    monitoring_queries,
    one,
    prestop_seconds,
    prometheus_tool,
    render,
    speculative_config_of,
)

from verifier_service.tools.local_services import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

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
            for key, data in (secrets or {})[vol["secret"]["secretName"]].items():
                (d / key).write_bytes(data)
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


@pytest.fixture(scope="module", params=["cpu", "cpu-suffix-drafter"])
def stack(request, tmp_path_factory):
    with running_stack(request.param, tmp_path_factory.mktemp("deploy-local")) as running:
        yield running


@contextlib.contextmanager
def running_stack(overlay: str, root: Path, secrets: dict[str, dict[str, bytes]] | None = None) -> Iterator[dict]:
    """The overlay's drafter and verifier as local processes, both SERVING."""
    objs = render(f"overlays/{overlay}")
    drafter_dep = one(objs, "Deployment", DRAFTER)
    verifier_dep = one(objs, "Deployment", VERIFIER)
    drafter = prepare(drafter_dep, objs, root, secrets=secrets)
    drafter_grpc = int(flag_value(main_container(drafter_dep)["args"], "--port"))
    verifier = prepare(verifier_dep, objs, root, drafter_local_port=drafter.ports[drafter_grpc], secrets=secrets)
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


def test_probes_report_serving(stack):
    assert_probes_serving(stack)


def assert_probes_serving(stack) -> None:
    for name in ("drafter", "verifier"):
        p = stack[name]
        c = main_container(p.deployment)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                assert probe_status(p, kind) == "SERVING", f"{p.name} {kind}:\n{p.log_tail()}"


def test_generate_through_the_remote_drafter(stack):
    generate_with_drafts(stack)


def generate_with_drafts(stack, credentials=None) -> None:  # noqa: ANN001 - grpc is imported late here
    """A Generate call whose answer has text and tokens the remote drafter drafted (over TLS with
    `credentials`)."""
    import grpc

    from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc

    v = stack["verifier"]
    port = v.ports[int(flag_value(main_container(v.deployment)["args"], "--port"))]
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
            resp = verifier_pb2_grpc.VerifierServiceStub(ch).Generate(req, timeout=120)
        except grpc.RpcError as e:
            pytest.fail(f"Generate failed: {e.code().name} {e.details()}\n{v.log_tail()}")
    assert resp.output.text.strip(), f"empty text:\n{v.log_tail()}"
    assert resp.output.stats.num_draft_tokens > 0, (
        f"no tokens drafted by the remote drafter: {resp.output.stats}\n{v.log_tail()}\n{stack['drafter'].log_tail()}"
    )


def test_a_question_asked_again_drafts_from_its_first_answer_where_the_drafter_learns(stack):
    """The same open question twice, as two requests: the suffix drafter has learned the first answer by the
    time the second runs (at least 4 tokens a step, at the verifier's 8); the n-gram drafter, which drafts from
    a request's own text alone, has not. Both answers are the same tokens."""
    import grpc

    from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc

    v = stack["verifier"]
    port = v.ports[int(flag_value(main_container(v.deployment)["args"], "--port"))]
    req = verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
        chat=verifier_pb2.ChatMessages(messages=[
            verifier_pb2.ChatMessage(role="user", content="Give three tips for writing readable Python code.")]),
        stopping=verifier_pb2.StoppingCriteria(max_new_tokens=48),
    ))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = verifier_pb2_grpc.VerifierServiceStub(ch)
        first, again = (stub.Generate(req, timeout=120).output for _ in range(2))
    assert list(again.token_ids) == list(first.token_ids)
    learns = stack["overlay"] == "cpu-suffix-drafter"
    assert (again.stats.mean_acceptance_length >= 4.0) == learns, (
        f"{stack['overlay']}: first {first.stats.mean_acceptance_length:.2f}, "
        f"again {again.stats.mean_acceptance_length:.2f}\n{stack['drafter'].log_tail()}")


def test_server_info_reflects_the_rendered_flags(stack):
    import grpc

    from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc

    v = stack["verifier"]
    args = main_container(v.deployment)["args"]
    port = v.ports[int(flag_value(args, "--port"))]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        info = verifier_pb2_grpc.VerifierServiceStub(ch).GetServerInfo(
            verifier_pb2.GetServerInfoRequest(), timeout=30
        )
    up = info.speculative_config.user_provided
    d = stack["drafter"]
    drafter_port = d.ports[int(flag_value(main_container(d.deployment)["args"], "--port"))]
    assert up.drafter_target == f"dns:///127.0.0.1:{drafter_port}"
    assert up.load_balancing_policy == "round_robin"
    assert info.max_model_len == int(flag_value(args, "--max-model-len"))
    assert info.max_num_seqs == int(flag_value(args, "--max-num-seqs"))
    assert info.max_queue_len == int(flag_value(args, "--max-queue-len"))
    assert flag_value(args, "--device") in info.device
    assert info.drafter.state == verifier_pb2.DRAFTER_STATE_HEALTHY, f"{info.drafter}"


def metrics_endpoint(p: Proc) -> tuple[int, str]:
    """The local port and the path of /metrics, where the pod's Prometheus annotations point."""
    ann = p.deployment["spec"]["template"]["metadata"]["annotations"]
    return p.ports[int(ann["prometheus.io/port"])], ann["prometheus.io/path"]


def scrape(p: Proc) -> str:
    """GET /metrics."""
    port, path = metrics_endpoint(p)
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            return r.read().decode()
    except OSError as e:
        pytest.fail(f"{p.name}: GET {url} failed: {e}\n{p.log_tail()}")


def test_metrics_served_where_prometheus_annotations_point(stack):
    for name in ("drafter", "verifier"):
        body = scrape(stack[name])
        assert "# TYPE" in body, f"{name}: not Prometheus text format"
        expected = {"verifier": ("splitspec:spec_decode_num_draft_tokens_total", "splitspec:num_requests_running",
                                 "splitspec:e2e_request_latency_seconds_count", "splitspec:drafter_up"),
                    "drafter": ("splitspec_drafter_calls_total",)}[name]
        missing = [m for m in expected if m not in body]
        assert not missing, f"{name}: /metrics lacks {missing}"


def test_every_series_the_dashboard_and_alerts_query_is_served(stack):
    """A metric renamed or dropped would leave a panel of deploy/k8s/monitoring empty and an alert
    silent, never an error: every series they query must be on this stack's /metrics pages. The
    n-gram drafter (overlay cpu) lacks only the suffix drafter's own."""
    served = exported_series(scrape(stack["verifier"])) | exported_series(scrape(stack["drafter"]))
    missing = {}
    for where, expr in monitoring_queries().items():
        for name in metric_names(expr) - served:
            missing.setdefault(name, []).append(where)
    if stack["overlay"] == "cpu":
        missing = {n: w for n, w in missing.items() if not n.startswith("splitspec_drafter_suffix_")}
    assert not missing, missing


# A panel may show nothing on a stack that served a request and is idle: no save of what the drafter
# learned yet (every 5 minutes), no sequence held by the drafter once its request finished.
# Nor HTTP responses, where only gRPC was called.
EMPTY_WHILE_IDLE = {"panel 'Learned state' A", "panel 'Drafter state memory' A",
                    "panel 'Verifier calls and HTTP responses by status' B"}
# ... nor, with the n-gram drafter (overlay cpu), the suffix drafter's panels, and where a starting
# drafter took its learned state from (it is given no --learned-state-file or --peers there).
EMPTY_WITH_NGRAM = {"panel 'Suffix drafter: drafts by tree' A", "panel 'Suffix drafter: cached outputs' A",
                    "panel 'Suffix drafter: cached outputs' B", "panel 'Learned state' B"}


@pytest.mark.skipif(prometheus_tool("prometheus") is None and not os.environ.get("CI"),
                    reason="no prometheus (bash .ci/setup unpacks Debian's prometheus into .venv/bin)")
def test_prometheus_scraping_the_stack_fills_the_dashboard_and_fires_no_alert(stack, tmp_path):
    """A real Prometheus scrapes this stack's verifier and drafter every second, labelled as the
    ServiceMonitor's targets are (namespace, pod), with the alert rules loaded, while the verifier
    serves a request. Then every query of the dashboard runs without error (label matching included,
    which parsing cannot check) and returns series, but what an idle stack lacks (EMPTY_WHILE_IDLE,
    EMPTY_WITH_NGRAM); every rule evaluates without error, and none is pending or firing on this
    healthy stack (but the failing-calls rule where a call did fail)."""
    port = free_port()
    targets = [{"targets": [f"127.0.0.1:{metrics_port}"],
                "labels": {"namespace": "splitspec", "pod": f"{stack[name].name}-0", "__metrics_path__": path}}
               for name in ("verifier", "drafter") for metrics_port, path in [metrics_endpoint(stack[name])]]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(alert_rules()))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [{"job_name": "splitspec", "static_configs": targets}]}))
    log = tmp_path / "prometheus.log"

    def api(path: str, **params: str) -> object:
        url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    with open(log, "wb") as out:
        prometheus = subprocess.Popen(
            [prometheus_tool("prometheus"), "--config.file=prometheus.yml", "--storage.tsdb.path=data",
             f"--web.listen-address=127.0.0.1:{port}"], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (_ready(port) and _scraped_twice(api)):
            assert prometheus.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        generate_with_drafts(stack)
        time.sleep(3)  # scraped after the request, and the rules evaluated again
        empty, failed = [], {}
        for where, expr in monitoring_queries().items():
            if where.startswith("alert "):
                continue
            try:
                result = api("query", query=expr)["result"]
            except urllib.error.HTTPError as e:
                failed[where] = e.read().decode()
                continue
            if not result:
                empty.append(where)
        assert not failed, failed
        expected_empty = EMPTY_WHILE_IDLE | (EMPTY_WITH_NGRAM if stack["overlay"] == "cpu" else set())
        assert not set(empty) - expected_empty, f"no series for {sorted(set(empty) - expected_empty)}"
        groups = api("rules")["groups"]
        assert sum(len(g["rules"]) for g in groups) == sum(len(g["rules"]) for g in alert_rules()["groups"])
        unhealthy = {r["name"]: r.get("lastError") for g in groups for r in g["rules"] if r["health"] != "ok"}
        assert not unhealthy, unhealthy
        # A drafter call past its deadline on this busy test machine (two workers, this stack, Prometheus) is a
        # real failure, which makes the failing-calls rule true as it should; any other alert is a false one.
        failed_calls = sum(float(r["value"][1]) for r in api(
            "query", query="sum(splitspec:drafter_call_failures_total)")["result"])
        assert [a for a in api("alerts")["alerts"] if not (
            a["labels"]["alertname"] == "SplitspecDrafterCallsFailing" and failed_calls > 0)] == []
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _scraped_twice(api) -> bool:
    """Both targets up, with two scrapes each: enough for rate()."""
    result = api("query", query="count_over_time(up[1m]) >= 2 and up == 1")["result"]
    return len(result) == 2


def test_sigterm_ends_both_within_the_termination_grace_period(stack):
    """After the preStop sleep the kubelet sends SIGTERM, then SIGKILL at
    terminationGracePeriodSeconds. The servers' own drain (--grace-period-s)
    must end the process in the remaining time, with a clean exit: a process
    that only dies from the default SIGTERM action would, as PID 1 in a
    container, ignore SIGTERM and be SIGKILLed."""
    for name in ("verifier", "drafter"):
        p = stack[name]
        c = main_container(p.deployment)
        budget = p.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] - prestop_seconds(c)
        p.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = p.popen.wait(budget)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running {budget}s after SIGTERM:\n{p.log_tail()}")
        assert rc in (0, 128 + signal.SIGTERM), f"{name} exited {rc} after SIGTERM:\n{p.log_tail()}"
        assert time.monotonic() - t0 <= budget
    if stack["overlay"] == "cpu-suffix-drafter":
        # What the suffix drafter learned (the question asked twice, at least) waits for the next container
        # in the pod's volume.
        from drafter_sdk.drafters.suffix import SuffixDrafter

        argv = stack["drafter"].argv
        restored = SuffixDrafter()
        restored.restore_learned(Path(argv[argv.index("--learned-state-file") + 1]).read_bytes())
        assert restored.cached_requests >= 2


def test_the_tls_overlay_serves_tls_on_every_hop_and_is_probed_in_plain_http(tmp_path):
    """cpu-tls (components/tls), its Secrets from a throwaway PKI: the kubelet's probes reach both services
    through /health on their metrics ports; a client reaches the verifier over TLS only, and the verifier
    the drafter over mutual TLS (drafted tokens)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from drafter_sdk.service.security import channel_credentials

    pki = make_pki(tmp_path)
    secrets = {"splitspec-verifier-tls": service_tls_files(pki), "splitspec-drafter-tls": tls_files(pki)}
    with running_stack("cpu-tls", tmp_path, secrets) as stack:
        assert_probes_serving(stack)
        generate_with_drafts(stack, channel_credentials(pki.ca_cert))
        for name in ("verifier", "drafter"):
            p = stack[name]
            port = p.ports[int(flag_value(main_container(p.deployment)["args"], "--port"))]
            assert health_check(port) == "rpc error: UNAVAILABLE"  # plaintext: no TLS handshake
        drafter = stack["drafter"]
        port = drafter.ports[int(flag_value(main_container(drafter.deployment)["args"], "--port"))]
        with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(pki.ca_cert)) as ch:  # no certificate
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
