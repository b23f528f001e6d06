"""Run the rendered cpu overlays' verifier and drafter as local processes (local_stack.py says how a laptop
stands in for the pods).

Both CPU overlays run: `cpu` (the n-gram drafter) and `cpu-suffix-drafter` (the suffix drafter, which
learns from finished requests). Health is checked the way the kubelet's probes do, then a Generate call must
come back with text and drafted tokens, and SIGTERM must end both processes within
terminationGracePeriodSeconds minus the preStop sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    alert_rules,
    exported_series,
    flag_value,
    main_container,
    metric_names,
    monitoring_queries,
    prestop_seconds,
    prometheus_tool,
)
from local_stack import Proc, assert_probes_serving, generate_with_drafts, grpc_port, running_stack

from verifier_service.tools.local_services import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=["cpu", "cpu-suffix-drafter"])
def stack(request, tmp_path_factory):
    with running_stack(request.param, tmp_path_factory.mktemp("deploy-local")) as running:
        yield running


def test_probes_report_serving(stack):
    assert_probes_serving(stack)


def test_generate_through_the_remote_drafter(stack):
    generate_with_drafts(stack)


def test_a_question_asked_again_drafts_from_its_first_answer_where_the_drafter_learns(stack):
    """The same open question twice, as two requests: the suffix drafter has learned the first answer by the
    time the second runs (at least 4 tokens a step, at the verifier's 8); the n-gram drafter, which drafts from
    a request's own text alone, has not. Both answers are the same tokens."""
    import grpc

    from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc

    v = stack["verifier"]
    port = grpc_port(v)
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
    port = grpc_port(v)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        info = verifier_pb2_grpc.VerifierServiceStub(ch).GetServerInfo(
            verifier_pb2.GetServerInfoRequest(), timeout=30
        )
    up = info.speculative_config.user_provided
    d = stack["drafter"]
    drafter_port = grpc_port(d)
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
