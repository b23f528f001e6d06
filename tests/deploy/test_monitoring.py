"""Offline checks of deploy/k8s/monitoring: the ServiceMonitor, the alert rules and the Grafana dashboard.

What each query selects is checked against what a running verifier and drafter export in
test_deploy_local.py; here, that everything renders, parses and is laid out as Grafana and the
Prometheus Operator expect.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    DASHBOARD_KEY,
    DRAFTER,
    K8S_DIR,
    OVERLAYS,
    VERIFIER,
    alert_rules,
    dashboard,
    find,
    metric_names,
    monitoring_queries,
    one,
    prometheus_tool,
    render,
    selects,
)

PROMETHEUS_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
PROMTOOL = prometheus_tool("promtool")
ALERT_TESTS = Path(__file__).with_name("alert_rules_test.yaml")


def test_monitoring_is_kept_out_of_the_overlays():
    """The ServiceMonitor and PrometheusRule need the Prometheus Operator's CRDs, which an overlay must not."""
    for overlay in OVERLAYS:
        objs = render(f"overlays/{overlay}")
        assert not find(objs, "ServiceMonitor") and not find(objs, "PrometheusRule"), overlay
    kinds = sorted(o["kind"] for o in render("monitoring"))
    assert kinds == ["ConfigMap", "PrometheusRule", "ServiceMonitor"]
    assert {o["metadata"]["namespace"] for o in render("monitoring")} == {"splitspec"}


def test_servicemonitor_matches_services():
    sm = one(render("monitoring"), "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    objs = render("overlays/cpu")
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["splitspec"]
    port_names = {e["port"] for e in sm["spec"]["endpoints"]}
    matched = [s for s in find(objs, "Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in matched} == {VERIFIER, DRAFTER}
    for s in matched:
        assert port_names <= {p["name"] for p in s["spec"]["ports"]}
    paths = {e.get("path", "/metrics") for e in sm["spec"]["endpoints"]}
    for d in find(objs, "Deployment"):
        assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in paths


def test_every_query_parses_and_selects_a_splitspec_metric():
    queries = monitoring_queries()
    assert sum(where.startswith("alert ") for where in queries) >= 5
    bad = {}
    for where, expr in queries.items():
        try:
            names = metric_names(expr)
        except ValueError as exc:
            bad[where] = f"does not parse: {exc}"
            continue
        if not names or not all(n.startswith(("splitspec:", "splitspec_drafter_")) for n in names):
            bad[where] = f"selects {sorted(names)}"
    assert not bad, bad


def test_dashboard_ships_as_the_configmap_grafana_loads():
    """The sidecar loads ConfigMaps labelled grafana_dashboard=1; a stable name lets a re-apply replace it."""
    cm = one(render("monitoring"), "ConfigMap")
    assert cm["metadata"]["name"] == "splitspec-dashboard"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"][DASHBOARD_KEY] == (K8S_DIR / "monitoring" / DASHBOARD_KEY).read_text()
    board = dashboard()
    assert board["uid"] == "splitspec" and board["title"] == "splitspec"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["includeAll"] and variables["namespace"]["multi"]


def test_dashboard_panels_tile_the_grid():
    """Unique ids, inside Grafana's 24 columns, no two panels on the same cell, every query on the
    dashboard's Prometheus variable and filtered by its namespace variable."""
    cells: dict[tuple[int, int], str] = {}
    ids = set()
    for panel in dashboard()["panels"]:
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert g["w"] >= 1 and g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["description"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
        for t in panel["targets"]:
            assert 'namespace=~"$namespace"' in t["expr"], (panel["title"], t["expr"])


def test_alerts_say_what_they_cost_and_what_to_do():
    rules = [r for g in one(render("monitoring"), "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for r in rules:
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 60, r["alert"]
        assert PROMETHEUS_DURATION.match(r.get("for", "0s")), r["alert"]


def _annotations(rule: dict, labels: dict[str, str]) -> dict[str, str]:
    """A firing alert's annotations: the rule's, with its `{{ $labels.X }}` filled in."""
    filled = {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
              for k, v in rule["annotations"].items()}
    assert not any("{{" in v for v in filled.values()), f"{rule['alert']}: templated beyond its labels"
    return filled


@pytest.mark.skipif(PROMTOOL is None and not os.environ.get("CI"),
                    reason="no promtool (bash .ci/setup unpacks Debian's prometheus into .venv/bin)")
def test_alert_rules_fire_where_they_should_and_nowhere_else(tmp_path):
    """promtool's own unit tests (alert_rules_test.yaml) on the rendered rules: each alert fires on
    its case and stays quiet on the look-alike beside it, with the annotations the rule writes."""
    spec = alert_rules()
    rules = {r["alert"]: r for g in spec["groups"] for r in g["rules"]}
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    fired = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                alert["exp_annotations"] = _annotations(rules[check["alertname"]], alert["exp_labels"])
                fired.add(check["alertname"])
    assert fired == set(rules), f"no case fires {sorted(set(rules) - fired)}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    for command in (["check", "rules", "rules.yaml"], ["test", "rules", "tests.yaml"]):
        run = subprocess.run([PROMTOOL, *command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"promtool {' '.join(command)}:\n{run.stdout}{run.stderr}"
