"""Helpers shared by test_deploy.py and test_deploy_local.py.

Reads the Dockerfiles under deploy/docker and renders the kustomize overlays
under deploy/k8s with `kubectl kustomize` (offline). No pytest fixtures here.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKER_DIR = DEPLOY / "docker"
K8S_DIR = DEPLOY / "k8s"
# Console scripts are called from the repository's venv (.ci/setup makes it);
# failing that, from the venv running the tests.
VENV_BIN = REPO / ".venv" / "bin" if (REPO / ".venv" / "bin").is_dir() else Path(sys.executable).parent

DOCKERFILES = {
    "verifier-cpu": DOCKER_DIR / "verifier-cpu.Dockerfile",
    "verifier-cuda": DOCKER_DIR / "verifier-cuda.Dockerfile",
    "drafter": DOCKER_DIR / "drafter.Dockerfile",
    "model-drafter": DOCKER_DIR / "model-drafter.Dockerfile",
}
OVERLAYS = ("cpu", "cpu-suffix-drafter", "cpu-tls", "cpu-suffix-tls", "gpu", "gpu-tp", "gpu-model-drafter")
VERIFIER = "splitspec-verifier"
DRAFTER = "splitspec-drafter"


# --------------------------------------------------------------------------
# pyproject


@functools.cache
def console_scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


# --------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Instruction:
    cmd: str  # upper case
    value: str  # everything after the keyword, continuations joined
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]

    def last(self, cmd: str) -> Instruction | None:
        found = self.all(cmd)
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> list[Stage]:
    """Split a Dockerfile into stages of instructions (no variable expansion)."""
    stages: list[Stage] = []
    logical, start = "", 0
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped
        if not logical:
            start = lineno
        if raw.rstrip().endswith("\\"):
            logical += raw.rstrip()[:-1] + " "
            continue
        logical += raw
        keyword, _, rest = logical.strip().partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, rest, start))
        logical = ""
    return stages


def exec_form(value: str) -> list[str] | None:
    """The JSON array of an exec-form ENTRYPOINT/CMD, or None (shell form)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed) else None


def copy_sources(inst: Instruction) -> tuple[dict[str, str], list[str]]:
    """(flags, sources) of a COPY/ADD instruction."""
    parsed = exec_form(inst.value)
    words = parsed if parsed is not None else shlex.split(inst.value)
    flags = {}
    while words and words[0].startswith("--"):
        k, _, v = words.pop(0)[2:].partition("=")
        flags[k] = v
    return flags, words[:-1]


def env_of(stage: Stage) -> dict[str, str]:
    """ENV of one stage, in order (KEY=VALUE forms and legacy `ENV KEY VALUE`)."""
    env: dict[str, str] = {}
    for inst in stage.all("ENV"):
        words = shlex.split(inst.value)
        if words and "=" not in words[0]:
            env[words[0]] = inst.value.split(None, 1)[1] if len(words) > 1 else ""
            continue
        for w in words:
            k, _, v = w.partition("=")
            env[k] = v
    return env


@dataclass
class Image:
    """What the runtime (final) stage of a Dockerfile declares."""

    path: Path
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    user: str | None
    workdir: str | None
    expose: set[int]


@functools.cache
def image_of(key: str) -> Image:
    path = DOCKERFILES[key]
    final = parse_dockerfile(path)[-1]
    ep = final.last("ENTRYPOINT")
    cmd = final.last("CMD")
    user = final.last("USER")
    workdir = final.last("WORKDIR")
    expose = set()
    for inst in final.all("EXPOSE"):
        expose |= {int(p.split("/")[0]) for p in inst.value.split()}
    return Image(
        path=path,
        entrypoint=(exec_form(ep.value) or []) if ep else [],
        cmd=(exec_form(cmd.value) or []) if cmd else [],
        env=env_of(final),
        user=user.value if user else None,
        workdir=workdir.value if workdir else None,
        expose=expose,
    )


def dockerfile_key_for_image(image: str) -> str:
    """Which Dockerfile builds a manifest's image reference."""
    name, _, tag = image.rpartition(":")
    if name.endswith("/verifier"):
        if tag.endswith("-cpu"):
            return "verifier-cpu"
        if tag.endswith("-cuda"):
            return "verifier-cuda"
    if name.endswith("/drafter"):
        return "drafter"
    if name.endswith("/model-drafter"):
        return "model-drafter"
    raise AssertionError(f"no Dockerfile builds image {image!r}")


def dockerignore_patterns() -> list[str]:
    path = REPO / ".dockerignore"
    if not path.exists():
        return []
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _glob_to_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
        i += 1
    return re.compile(out + r"\Z")


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore drops `rel` (or a folder above it) from the context."""
    rel = rel.strip("/").removeprefix("./")
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in dockerignore_patterns():
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/").removeprefix("./")
        rx = _glob_to_regex(pat)
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


# --------------------------------------------------------------------------
# console scripts


@functools.cache
def script_help(script: str, *prefix: str) -> str:
    """`<venv>/bin/<script> [prefix...] --help` output; AssertionError if it fails."""
    exe = VENV_BIN / script
    assert exe.exists(), f"console script {exe} is not installed (pip install -e . after it is declared and written)"
    proc = subprocess.run(
        [str(exe), *prefix, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, (
        f"{script} {' '.join(prefix)} --help failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout + proc.stderr


def help_flags(script: str, args: list[str]) -> set[str]:
    """Long options a script documents: `--help` plus, if args begin with a
    positional (a drafter name such as `ngram`), `<positional> --help`."""
    text = script_help(script)
    if args and not args[0].startswith("-"):
        try:
            text += script_help(script, args[0])
        except AssertionError:
            pass  # a plain positional, not a sub-command: the first help suffices
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", text))


def flags_in(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# --------------------------------------------------------------------------
# kustomize


def kubectl() -> str:
    exe = shutil.which("kubectl")
    assert exe, "kubectl (with its built-in kustomize) is needed on PATH to render deploy/k8s"
    return exe


@functools.cache
def render_text(path: str) -> str:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(K8S_DIR / path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"kubectl kustomize deploy/k8s/{path} failed:\n{proc.stderr}"
    return proc.stdout


def render(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render_text(path)) if d]


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels / matchExpressions) matches labels."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        k, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def pod_labels(deploy: dict) -> dict:
    return deploy["spec"]["template"]["metadata"]["labels"]


def containers(deploy: dict) -> list[dict]:
    spec = deploy["spec"]["template"]["spec"]
    return list(spec.get("initContainers") or []) + list(spec["containers"])


def main_container(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]["containers"][0]


def prestop_seconds(container: dict) -> int:
    """Seconds a preStop hook keeps the container up (sleep action or `sleep N`)."""
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = (pre.get("exec") or {}).get("command") or []
    if cmd and Path(cmd[0]).name == "sleep":
        return int(cmd[1])
    if len(cmd) == 3 and cmd[1] == "-c":  # sh -c "sleep N"
        m = re.fullmatch(r"\s*sleep\s+(\d+)\s*", cmd[2])
        if m:
            return int(m.group(1))
    return 0


def speculative_config_of(objs: list[dict]) -> tuple[str, dict, str]:
    """(file name, parsed YAML, raw text) of the config the verifier is given."""
    verifier = one(objs, "Deployment", VERIFIER)
    c = main_container(verifier)
    path = flag_value(c.get("args") or [], "--speculative-config")
    assert path, "verifier is not given --speculative-config"
    mount = next(
        m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
    )
    vol = next(v for v in verifier["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert "configMap" in vol, f"--speculative-config {path} is not on a ConfigMap volume"
    cm = one(objs, "ConfigMap", vol["configMap"]["name"])
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    for item in vol["configMap"].get("items") or []:
        if item["path"] == key:
            key = item["key"]
    assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key!r}"
    raw = cm["data"][key]
    return key, yaml.safe_load(raw), raw


# --------------------------------------------------------------------------
# monitoring: what the dashboard and the alert rules query

DASHBOARD_KEY = "splitspec-dashboard.json"
# What Grafana puts in place of the dashboard's variables, as a query runs: the rate window, and the
# namespace the tests' Prometheus gives its targets.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": "splitspec"}
# The samples a histogram family writes beside its name (Prometheus text format).
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict:
    """The Grafana dashboard, as the rendered ConfigMap carries it."""
    return json.loads(one(render("monitoring"), "ConfigMap", "splitspec-dashboard")["data"][DASHBOARD_KEY])


def monitoring_queries() -> dict[str, str]:
    """Every PromQL expression deploy/k8s/monitoring ships, by where it stands: the series of the
    dashboard's variables, its panels' targets, and the alert rules."""
    queries = {}
    board = dashboard()
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":  # label_values(SERIES, LABEL): the label's values in SERIES
            series = re.fullmatch(r"label_values\((.+), *\w+\)", variable["query"]["query"])
            assert series, f"variable {variable['name']}: {variable['query']['query']}"
            queries[f"variable {variable['name']}"] = series.group(1)
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries[f"panel {panel['title']!r} {target['refId']}"] = expr
    for group in alert_rules()["groups"]:
        for rule in group["rules"]:
            queries[f"alert {rule['alert']}"] = rule["expr"]
    return queries


def alert_rules() -> dict:
    """The PrometheusRule's spec: a Prometheus rule file."""
    return one(render("monitoring"), "PrometheusRule")["spec"]


def prometheus_tool(name: str) -> str | None:
    """Debian's `prometheus` or `promtool`, which .ci/setup unpacks into .venv/bin, else one on PATH."""
    local = VENV_BIN / name
    return str(local) if local.is_file() else shutil.which(name)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects; ValueError where it does not parse."""
    names: set[str] = set()
    _selected(promql_parser.parse(expr), names)
    return names


def _selected(node: object, names: set[str]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        names.add(node.name)
    elif isinstance(node, promql_parser.MatrixSelector):
        _selected(node.vector_selector, names)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            _selected(arg, names)
    elif isinstance(node, promql_parser.BinaryExpr):
        _selected(node.lhs, names)
        _selected(node.rhs, names)
    elif isinstance(node, (promql_parser.AggregateExpr, promql_parser.ParenExpr, promql_parser.UnaryExpr,
                           promql_parser.SubqueryExpr)):
        _selected(node.expr, names)


def exported_series(exposition: str) -> set[str]:
    """The sample names a /metrics page holds, and those its `# TYPE` lines announce: a labelled
    family shows no sample until a label value is used, but always its type. prometheus_client
    names a counter's family with its `_total` (0.26) or without it (older)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names.add(family)
            if kind == "histogram":
                names |= {family + suffix for suffix in _HISTOGRAM_SUFFIXES}
            elif kind == "counter" and not family.endswith("_total"):
                names.add(family + "_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
