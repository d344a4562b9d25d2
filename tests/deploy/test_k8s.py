"""deploy/k8s (the Kubernetes manifests), checked without a cluster.

Every kustomization (the base, every overlay, every example) is built by the small renderer in
``tests/deploy/k8s_render.py``, which always runs, and by ``kubectl kustomize`` when kubectl is
installed; the two must agree object for object. Every rendered object then validates offline:
built-in kinds against the strict schemas kubernetes-validate bundles (Kubernetes 1.30, the
oldest that every kubernetes-validate>=1.30 has, and the newest the installed one has), custom
resources against the CRD schemas vendored in ``deploy/k8s/schemas``.

The contract tests read the rendered objects the way the cluster would use them: each pdserve
container's argv is what the kubelet (``$(VAR)`` expansion from the env) and the image's
entrypoint (``$PDSERVE_EXTRA_ARGS``) make of it, parsed by pdserve's own argument parsers; the
probes, Services, NetworkPolicies, monitors and grace periods are held against the ports and
timeouts those parsed flags say, and the metric names in monitors and autoscaler queries
against the names the code exports.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.cli.launcher import DISAGG_DECODE_PREFILL_SHARE
from tests.deploy.k8s_render import RenderError, build, pod_spec, render, strategic_merge
from tests.deploy.test_compose import exported_series, promql_metric_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
DOCS = ROOT / "docs" / "deploy.md"

OVERLAYS = ("cpu", "gpu", "monitoring", "autoscaling", "multinode")
ROLE_LABEL = "pdserve.ai/role"
WORKER_ROLES = ("prefill", "decode")
# kubernetes-validate>=1.30 (pyproject's test extra) bundles 1.30; the newest it has too
K8S_VERSIONS = tuple(dict.fromkeys(("1.30", kubernetes_validate.latest_version())))
POD_IP = "10.244.3.17"  # stands in for status.podIP
# After --drain-timeout, serve_worker (shared/worker/service.py) still stops the registry
# thread (joined for up to 3 s), closes the KV endpoint, stops gRPC with a 2 s grace and the
# metrics server: what a worker's grace period must leave room for beyond the drain.
WORKER_STOP_S = 10.0
# What the Prometheus trigger of KEDA v2.20.2 reads (pkg/scalers/prometheus_scaler.go); the
# vendored CRD schema leaves trigger metadata free-form.
KEDA_PROMETHEUS_KEYS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}

unit = pytest.mark.unit


def _targets() -> list[str]:
    """Every buildable kustomization under deploy/k8s (Components are built as part of one)."""
    out = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind") != "Component":
            out.append(str(path.parent.relative_to(K8S)))
    return out


TARGETS = _targets()
# what a user applies (the base alone lacks a model)
DEPLOYABLE = [t for t in TARGETS if t != "base"]


@cache
def _rendered(target: str) -> tuple[list[dict], dict[str, str]]:
    return render(K8S / target)


def objects(target: str) -> list[dict]:
    return copy.deepcopy(_rendered(target)[0])


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if pod_spec(o) is not None]


def role_of(obj: dict) -> str | None:
    return obj["spec"]["template"]["metadata"]["labels"].get(ROLE_LABEL)


def flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against labels."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# ---- what the kubelet and the image's entrypoint make of a container ---------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, `$$` is a `$`, anything
    else stays as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i):
            end = text.find(")", i + 2)
            if end != -1:
                name = text[i + 2 : end]
                out.append(env.get(name, text[i : end + 1]))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def resolved_env(objs: list[dict], workload: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: in order, each value expanded
    with the variables defined before it, ConfigMap keys looked up in the rendered ConfigMaps."""
    ns = workload["metadata"].get("namespace")
    configmaps = {
        cm["metadata"]["name"]: cm.get("data") or {}
        for cm in by_kind(objs, "ConfigMap")
        if cm["metadata"].get("namespace") == ns
    }
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        src = var["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            assert ref["name"] in configmaps, f"{var['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in configmaps[ref["name"]], f"{var['name']}: no key {ref['key']}"
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            env[var["name"]] = f"<secret {ref['name']}.{ref['key']}>"
        elif "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            env[var["name"]] = {"status.podIP": POD_IP, "metadata.name": "pod-0"}[path]
        elif "resourceFieldRef" in src:
            env[var["name"]] = _resource_field(container, src["resourceFieldRef"])
        else:
            raise AssertionError(f"{var['name']}: unexpected valueFrom {src}")
    return env


def _resource_field(container: dict, ref: dict) -> str:
    """The downward API's value of a container's request or limit (``resourceFieldRef``): the
    quantity over the divisor, rounded up (the kubelet's ExtractContainerResourceValue). An
    unset limit would be the node's allocatable: the manifests always set the ones they read."""
    assert ref.get("containerName", container["name"]) == container["name"], ref
    kind, _, resource = ref["resource"].partition(".")
    assert kind in ("limits", "requests"), ref
    resources = container["resources"][kind]
    assert resource in resources, f"{container['name']}: no {ref['resource']} to read"
    value = _quantity(resources[resource]) / _quantity(ref.get("divisor", "1"))
    return str(math.ceil(round(value, 9)))


def entrypoint_argv(args: list[str], env: dict[str, str]) -> list[str]:
    """What deploy/docker/entrypoint.sh execs for a pdserve subcommand: the args, then
    $PDSERVE_EXTRA_ARGS split on whitespace, an empty --served-model-name filled with the last
    component of --model, and --advertise-host for workers that lack one."""
    argv = [*args, *env.get("PDSERVE_EXTRA_ARGS", "").split()]
    model = flag(argv, "--model")
    for i, arg in enumerate(argv):
        if arg == "--served-model-name" and i + 1 < len(argv) and not argv[i + 1] and model:
            argv[i + 1] = model.rstrip("/").rsplit("/", 1)[-1]
    if argv[0] in WORKER_ROLES and flag(argv, "--advertise-host") is None:
        argv += ["--advertise-host", env["PDSERVE_ADVERTISE_HOST"]]
    return ["pdserve", *argv]


def is_pdserve(container: dict) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == "pdserve"


def pdserve_containers(objs: list[dict]):
    """(workload, container, env, argv) of every long-running pdserve container."""
    for w in workloads(objs):
        for c in pod_spec(w)["containers"]:
            if is_pdserve(c):
                assert "command" not in c, "the image's entrypoint must run (args only)"
                env = resolved_env(objs, w, c)
                args = [expand(str(a), env) for a in c["args"]]
                yield w, c, env, entrypoint_argv(args, env)


def parse(argv: list[str]):
    """pdserve's own parser on the argv (as `pdserve` would run it)."""
    from shared.cli.main import build_parser

    parser, chosen = build_parser(argv[1:])
    assert chosen == argv[1], argv
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"pdserve refuses {argv}: exit {e.code}") from None


@cache
def parsed(target: str) -> dict[str, tuple]:
    """container name (router / prefill / decode) -> (workload, container, env, argv, the
    parsed argparse.Namespace) for a target. Cached: read it, do not change it."""
    objs = objects(target)
    return {
        c["name"]: (w, c, env, argv, parse(argv)) for w, c, env, argv in pdserve_containers(objs)
    }


# ---- rendering -----------------------------------------------------------------------------------


@unit
def test_every_overlay_is_rendered():
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in TARGETS, overlay
    assert "base" in TARGETS


@unit
@pytest.mark.parametrize("target", TARGETS)
def test_kustomization_renders(target):
    objs = objects(target)
    keys = [
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in objs
    ]
    assert len(keys) == len(set(keys))
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "pdserve", (o["kind"], o["metadata"]["name"])


def _normalized(objs: list[dict], renames: dict[str, str]) -> dict[tuple, str]:
    """Objects keyed by kind / name, generated names' hash suffixes replaced by a marker (the
    suffix algorithm is kustomize's business; that both sides use theirs consistently is
    checked separately)."""
    out = {}
    for o in objs:
        text = json.dumps(o, sort_keys=True)
        for base in renames:
            text = re.sub(rf'"{re.escape(base)}-[a-z0-9]{{10}}"', f'"{base}-HASH"', text)
        meta = json.loads(text)["metadata"]
        out[(o["apiVersion"], o["kind"], meta.get("namespace"), meta["name"])] = text
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_kubectl_kustomize_agrees_with_the_renderer(target):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the in-test renderer covered this target")
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = [o for o in yaml.safe_load_all(proc.stdout) if o]
    mine, renames = _rendered(target)
    a, b = _normalized(mine, renames), _normalized(theirs, renames)
    assert set(a) == set(b)
    for key in a:
        assert json.loads(a[key]) == json.loads(b[key]), key
    # kubectl's own output is consistent: every ConfigMap a pod reads is in it
    names = {cm["metadata"]["name"] for cm in by_kind(theirs, "ConfigMap")}
    for w in workloads(theirs):
        spec = pod_spec(w)
        for c in spec["containers"] + spec.get("initContainers", []):
            for var in c.get("env") or []:
                ref = (var.get("valueFrom") or {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in names, (w["metadata"]["name"], ref)


@unit
def test_the_renderer_refuses_what_it_does_not_know(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(RenderError, match="namePrefix"):
        build(tmp_path)
    # kustomize's strategic merge: the patch's list elements first, null deletes a field
    merged = strategic_merge(
        {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}], "x": 1},
        {"env": [{"name": "C", "value": "3"}, {"name": "A", "value": "9"}], "x": None},
        None,
    )
    assert merged == {
        "env": [
            {"name": "C", "value": "3"},
            {"name": "A", "value": "9"},
            {"name": "B", "value": "2"},
        ]
    }


# ---- schemas -------------------------------------------------------------------------------------


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        jsonschema.Draft7Validator.check_schema(schema)
        props = schema["properties"]
        out[(props["apiVersion"]["enum"][0], props["kind"]["enum"][0])] = schema
    return out


def validation_errors(obj: dict) -> list[str]:
    key = (obj["apiVersion"], obj["kind"])
    if key in crd_schemas():
        validator = jsonschema.Draft7Validator(crd_schemas()[key])
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{version}: {'/'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{version}: {e.message}")
    return errors


@unit
def test_vendored_schemas_cover_the_custom_resources():
    assert set(crd_schemas()) == {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    }


@unit
@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_offline(target):
    for obj in objects(target):
        errors = validation_errors(obj)
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: {errors}"


@unit
def test_validation_is_strict():
    objs = objects("overlays/autoscaling")
    deployment = one(objs, "Deployment", "pdserve-decode")
    pod_spec(deployment)["containers"][0]["imagePullPolcy"] = "Always"
    assert validation_errors(deployment)
    for kind in ("ServiceMonitor", "PodMonitor", "ScaledObject"):
        obj = by_kind(objs, kind)[0]
        obj["spec"]["scrapeIntervall"] = "5s"
        assert validation_errors(obj), kind


# ---- exposure --------------------------------------------------------------------------------------


@unit
@pytest.mark.parametrize("target", TARGETS)
def test_only_the_router_is_exposed(target):
    objs = objects(target)
    pods = {
        w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(objs)
    }
    for svc in by_kind(objs, "Service"):
        name, spec = svc["metadata"]["name"], svc["spec"]
        selected = {
            w for w, labels in pods.items() if matches({"matchLabels": spec["selector"]}, labels)
        }
        if name == "pdserve-router":
            assert selected == {"pdserve-router"}
        else:
            assert spec.get("type", "ClusterIP") == "ClusterIP", name
            assert not spec.get("externalIPs"), name
            # the workers have no Service at all: each pod registers its own address in Redis
            assert selected <= {"pdserve-redis"}, (name, selected)
    for ingress in by_kind(objs, "Ingress"):
        backends = [
            p["backend"]["service"]["name"]
            for rule in ingress["spec"]["rules"]
            for p in rule["http"]["paths"]
        ]
        if "defaultBackend" in ingress["spec"]:
            backends.append(ingress["spec"]["defaultBackend"]["service"]["name"])
        assert set(backends) == {"pdserve-router"}
    for w in workloads(objs):
        spec = pod_spec(w)
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), w["metadata"]["name"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for port in c.get("ports") or []:
                assert "hostPort" not in port, (w["metadata"]["name"], port)


@unit
def test_no_secret_is_committed():
    for target in TARGETS:
        assert not by_kind(objects(target), "Secret"), target


# ---- the processes' command lines --------------------------------------------------------------


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_every_pdserve_container_passes_pdserve_own_parser(target):
    """Parsed by pdserve's parsers after the kubelet's $(VAR) expansion and the entrypoint's
    additions; then held against the roles, the shared settings and the pod's mounts."""
    procs = parsed(target)
    assert set(procs) == {"router", "prefill", "decode"}
    models, names, redis = set(), set(), set()
    for name, (w, c, _env, argv, ns) in procs.items():
        assert not any("$(" in a for a in argv), f"{name}: unresolved reference in {argv}"
        assert argv[1] == name == role_of(w), (name, argv[1], role_of(w))
        assert ns.host == "0.0.0.0", name  # probes and peers arrive on the pod IP
        models.add(ns.model)
        names.add(ns.served_model_name)
        redis.add(ns.redis_url)
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
        assert any(ns.model.startswith(p + "/") for p in mounts), (name, ns.model)
        if name in WORKER_ROLES:
            assert ns.advertise_host == POD_IP, name  # from the downward API
            assert ns.worker_id is None, name  # the default: role, pod name and pid
            assert ns.port and ns.metrics_port, name  # fixed: probes and policies name them
        if name == "decode":
            assert ns.kv_port, name
            # local prefills bounded while streams decode, as `pdserve up` does (README)
            assert ns.max_prefill_tokens_while_decoding == DISAGG_DECODE_PREFILL_SHARE, target
        elif name == "prefill":
            assert ns.max_prefill_tokens_while_decoding is None, target
    # one model, one name (it seeds the prefix-cache hashes), one Redis for every process
    assert len(models) == len(names) == len(redis) == 1, (models, names, redis)
    assert names != {None}


def _secret_files(workload: dict, container: dict) -> dict[str, tuple[str, str]]:
    """path in the container -> (Secret name, key) of every file a Secret volume projects."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes") or []}
    out = {}
    for m in container.get("volumeMounts") or []:
        vol = volumes[m["name"]]
        sources = []
        if "secret" in vol:
            sources.append((vol["secret"]["secretName"], vol["secret"].get("items")))
        for src in (vol.get("projected") or {}).get("sources") or []:
            if "secret" in src:
                sources.append((src["secret"]["name"], src["secret"].get("items")))
        for secret, items in sources:
            assert items, f"{m['name']}: list the keys, so a missing one fails the pod"
            for item in items:
                out[f"{m['mountPath']}/{item['path']}"] = (secret, item["key"])
    return out


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_cluster_secret_and_api_keys_come_from_secrets(target, tmp_path, monkeypatch):
    from router.config import API_KEY_ENV, RouterConfig
    from shared.security import ClusterSecurity

    for var in API_KEY_ENV:  # the router would add keys from these
        monkeypatch.delenv(var, raising=False)

    for name, (w, c, _env, _argv, ns) in parsed(target).items():
        files = _secret_files(w, c)
        assert files.get(ns.cluster_secret_file) == ("pdserve-cluster-secret", "cluster-secret")
        # a file, not an environment variable (which `kubectl describe` and /proc show)
        assert not {"PDSERVE_CLUSTER_SECRET", "PDSERVE_API_KEY"} & {e["name"] for e in c["env"]}
        # The files the flags name, written where the kubelet would put them: the process's
        # own configuration code accepts them.
        real = copy.copy(ns)
        secret = tmp_path / f"{name}-cluster-secret"
        secret.write_text(os.urandom(32).hex() + "\n")
        real.cluster_secret_file = str(secret)
        assert ClusterSecurity.from_cli_args(real).secret is not None
        if name == "router":
            keys = [files.get(p) for p in ns.api_key_file]
            assert keys == [("pdserve-api-keys", "api-keys"), ("pdserve-api-keys", "metrics-key")]
            real.api_key_file = []
            for i, _ in enumerate(ns.api_key_file):
                path = tmp_path / f"key-{i}"
                path.write_text(f"sk-test-{i}-{os.urandom(8).hex()}\n")
                path.chmod(0o600)
                real.api_key_file.append(str(path))
            config = RouterConfig.from_cli_args(real)
            assert len(config.api_key) == 2 and not config.disable_metrics_auth
            assert ns.api_key is None  # never a key in the args


def _run_entrypoint(args: list[str], env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), **env, "PDSERVE_ENTRYPOINT_DRY_RUN": "1"},
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[:-1]  # the last line is CUDA_VISIBLE_DEVICES=...


@pytest.mark.parametrize("target", ["overlays/cpu", "overlays/gpu", "examples/managed-redis"])
def test_the_image_entrypoint_builds_the_same_argv(target):
    """The argv above is the one deploy/docker/entrypoint.sh really builds (dry-run mode)."""
    if shutil.which("bash") is None:
        pytest.skip("the entrypoint needs bash")
    for w, c, env, argv in pdserve_containers(objects(target)):
        args = [expand(str(a), env) for a in c["args"]]
        assert _run_entrypoint(args, env) == argv, (w["metadata"]["name"], argv)


@unit
def test_overlays_pick_the_device():
    from shared.config import parse_bytes

    for target, device in (("overlays/cpu", "cpu"), ("overlays/gpu", "cuda")):
        for name, (_w, c, _env, _argv, ns) in parsed(target).items():
            limits = c["resources"].get("limits", {})
            if name in WORKER_ROLES:
                assert ns.device == device, (target, name)
                assert ("nvidia.com/gpu" in limits) == (device == "cuda"), (target, name)
            else:
                assert "nvidia.com/gpu" not in limits
    cpu = parsed("overlays/cpu")
    for role in WORKER_ROLES:
        w, c, env, _argv, ns = cpu[role]
        # the KV cache is sized for the container, not for the node (the CPU default)
        assert parse_bytes(ns.kv_cache_memory) < _quantity(c["resources"]["limits"]["memory"])
        assert int(env["PDSERVE_NUM_THREADS"]) <= _quantity(c["resources"]["limits"]["cpu"])


def _quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "": 1}
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units[suffix]


# ---- CPUs and torch threads -----------------------------------------------------------------------


def qos_class(spec: dict) -> str:
    """A pod's QoS class as Kubernetes computes it (GetPodQOS): Guaranteed when every container,
    init containers included, has CPU and memory limits and requests equal to them (a request
    left out defaults to its limit); BestEffort when none has any CPU or memory request or
    limit; Burstable otherwise."""
    guaranteed, any_set = True, False
    for c in spec["containers"] + spec.get("initContainers", []):
        res = c.get("resources") or {}
        limits = res.get("limits") or {}
        requests = {**limits, **(res.get("requests") or {})}
        for r in ("cpu", "memory"):
            any_set = any_set or r in requests or r in limits
            if r not in limits or _quantity(requests[r]) != _quantity(limits[r]):
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable" if any_set else "BestEffort"


def _worker_pods(target: str):
    """(where, pod spec, container, env, parsed) of every prefill / decode worker pod of a
    target: the Deployments' pods, and each LeaderWorkerSet's leader and worker pod."""
    for name, (w, c, env, _argv, ns) in parsed(target).items():
        if name in WORKER_ROLES:
            yield f"{target} {w['metadata']['name']}", pod_spec(w), c, env, ns
    objs = objects(target)
    for lws in by_kind(objs, "LeaderWorkerSet"):
        for index in (0, 1):
            template, c, env, _argv, ns = _lws_pod(objs, lws, index)
            yield f"{target} {lws['metadata']['name']}[{index}]", template["spec"], c, env, ns


@unit
def test_qos_class_follows_kubernetes_rules():
    def pod(*resources, init=()):
        return {
            "containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(resources)],
            "initContainers": [{"name": f"i{i}", "resources": r} for i, r in enumerate(init)],
        }

    whole = {"limits": {"cpu": "2", "memory": "4Gi"}}
    assert qos_class(pod(whole)) == "Guaranteed"  # requests default to the limits
    assert qos_class(pod({"requests": {"cpu": "2000m", "memory": "4Gi"}, **whole})) == "Guaranteed"
    assert qos_class(pod({"requests": {"cpu": "1", "memory": "4Gi"}, **whole})) == "Burstable"
    assert qos_class(pod({"limits": {"cpu": "2"}})) == "Burstable"  # no memory limit
    assert qos_class(pod(whole, init=[{"requests": {"cpu": "250m"}, **whole}])) == "Burstable"
    assert qos_class(pod({})) == "BestEffort"


@unit
def test_cpu_workers_get_whole_cpus_of_their_own_one_per_torch_thread():
    """A CPU worker runs as many torch threads as its CPU limit, and its pod is Guaranteed with
    whole CPUs, so that the static CPU manager pins it: requests below the limits (Burstable)
    let other pods use the threads' CPUs, and the CFS quota then stalls a step's threads."""
    checked = set()
    for target in DEPLOYABLE:
        for where, spec, c, env, ns in _worker_pods(target):
            res = c["resources"]
            if "nvidia.com/gpu" in res.get("limits", {}):
                continue
            assert ns.device in ("cpu", "auto"), where
            checked.add(target)
            cpu = _quantity(res["limits"]["cpu"])
            for r in ("cpu", "memory"):
                assert _quantity(res["requests"][r]) == _quantity(res["limits"][r]), (where, r)
            assert cpu >= 1 and cpu == int(cpu), (where, "a whole number of CPUs", cpu)
            assert int(env["PDSERVE_NUM_THREADS"]) == cpu, (where, env["PDSERVE_NUM_THREADS"])
            assert int(env["OMP_NUM_THREADS"]) == cpu, (where, env.get("OMP_NUM_THREADS"))
            assert qos_class(spec) == "Guaranteed", where
    assert "overlays/cpu" in checked


@unit
def test_gpu_workers_cap_torch_cpu_threads_at_their_cpu_limit():
    """torch starts one CPU thread per core of the node, not of the pod, unless told: each rank
    process of a GPU worker gets OMP_NUM_THREADS = the pod's CPU limit over its ranks (one per
    GPU)."""
    checked = set()
    for target in DEPLOYABLE:
        for where, _spec, c, env, ns in _worker_pods(target):
            limits = c["resources"].get("limits", {})
            if "nvidia.com/gpu" not in limits:
                continue
            assert ns.device == "cuda", where
            checked.add(target)
            ranks = ns.tensor_parallel_size * ns.pipeline_parallel_size // ns.nnodes
            assert limits["nvidia.com/gpu"] == ranks, where
            cpu = _quantity(limits["cpu"])
            assert "OMP_NUM_THREADS" in env, where
            assert int(env["OMP_NUM_THREADS"]) * ranks == cpu, (where, env["OMP_NUM_THREADS"])
    assert {"overlays/gpu", MULTINODE} <= checked


# ---- ports, probes, grace periods ----------------------------------------------------------------


def _container_port(c: dict, ref: int | str) -> int:
    if isinstance(ref, int):
        assert ref in {p["containerPort"] for p in c["ports"]}, (c["name"], ref)
        return ref
    [port] = [p["containerPort"] for p in c["ports"] if p["name"] == ref]
    return port


def _probe_port(probe: dict, c: dict) -> int:
    for action in ("grpc", "httpGet", "tcpSocket"):
        if action in probe:
            return _container_port(c, probe[action]["port"])
    raise AssertionError(f"probe without a port: {probe}")


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_probes_point_at_ports_the_process_listens_on(target):
    for name, (_w, c, _env, _argv, ns) in parsed(target).items():
        declared = {p["containerPort"] for p in c["ports"]}
        listens = {ns.port} | ({ns.metrics_port} if name in WORKER_ROLES else set())
        if name == "decode":
            listens.add(ns.kv_port)
        assert declared == listens, (name, declared, listens)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert _probe_port(probe, c) == ns.port, (name, kind)
            if name in WORKER_ROLES:
                # the gRPC health service; the kubelet's probe sends no token, which the
                # workers allow for grpc.health.v1 only, and speaks no TLS
                assert "grpc" in probe and probe["grpc"].get("service", "") == "", (name, kind)
                assert not ns.grpc_ssl_certfile
        if name == "router":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            # /health is 503 without decode workers: not a reason to restart the router
            assert "httpGet" not in c["livenessProbe"]
            assert not ns.ssl_certfile  # the httpGet probe speaks HTTP
    # the router's Service forwards to the port it listens on
    objs = objects(target)
    w, c, _env, _argv, ns = parsed(target)["router"]
    [svc_port] = one(objs, "Service", "pdserve-router")["spec"]["ports"]
    assert _container_port(c, svc_port["targetPort"]) == ns.port


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_redis_probes_and_service_match_its_port(target):
    objs = objects(target)
    if not by_kind(objs, "StatefulSet"):
        return  # examples/managed-redis
    sts = one(objs, "StatefulSet", "pdserve-redis")
    [c] = pod_spec(sts)["containers"]
    svc = one(objs, "Service", "pdserve-redis")
    [svc_port] = svc["spec"]["ports"]
    port = _container_port(c, svc_port["targetPort"])
    assert port == svc_port["port"] == _probe_port(c["livenessProbe"], c)
    assert matches(
        {"matchLabels": svc["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"]
    )
    for name, (*_, ns) in parsed(target).items():
        assert ns.redis_url == f"redis://{svc['metadata']['name']}:{port}/0", name


def _prestop_seconds(c: dict) -> float:
    hook = (c.get("lifecycle") or {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_grace_period_covers_the_drain(target):
    from router.server import _CLEANUP_TIMEOUT_S

    for name, (w, c, _env, _argv, ns) in parsed(target).items():
        grace = pod_spec(w)["terminationGracePeriodSeconds"]
        hook = _prestop_seconds(c)
        if name in WORKER_ROLES:
            need = hook + ns.drain_timeout + WORKER_STOP_S
        else:
            need = hook + ns.shutdown_timeout + _CLEANUP_TIMEOUT_S
        assert grace > need, f"{name}: grace {grace} s <= {need} s"
    # the router keeps serving until its endpoint removal has spread
    assert _prestop_seconds(parsed(target)["router"][1]) >= 3


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_pools_have_role_labels_disruption_budgets_and_resources(target):
    objs = objects(target)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for w in workloads(objs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(w["spec"]["selector"], labels)
        spec = pod_spec(w)
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["resources"].get("requests") and c["resources"].get("limits"), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]
        if w["kind"] != "Deployment":
            continue
        role = role_of(w)
        assert role in ("router", *WORKER_ROLES), w["metadata"]["name"]
        assert w["spec"]["selector"]["matchLabels"][ROLE_LABEL] == role
        [pdb] = [p for p in pdbs if matches(p["spec"]["selector"], labels)]
        assert pdb["spec"]["maxUnavailable"] == 1, role


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_pods_run_unprivileged(target):
    objs = objects(target)
    [namespace] = by_kind(objs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for w in workloads(objs):
        spec = pod_spec(w)
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] and sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        # no Service environment variables: PDSERVE_* names would land in pdserve's env
        assert spec["enableServiceLinks"] is False
        if role_of(w) is not None:
            # an init that reaps orphans (compose's `init: true`), and pdserve not PID 1: a
            # SIGTERM that arrives before its handler is installed ends it
            assert spec["shareProcessNamespace"] is True
        for c in spec["containers"] + spec.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, c["name"]
            assert csc["capabilities"]["drop"] == ["ALL"], c["name"]


# ---- models ----------------------------------------------------------------------------------------


@unit
def test_cpu_overlay_generates_the_tiny_model_in_every_pod():
    objs = objects("overlays/cpu")
    assert not by_kind(objs, "PersistentVolumeClaim")
    script = (ROOT / "deploy" / "docker" / "model-init.sh").read_text()
    tiny = re.search(r"tiny=\$\{PDSERVE_TINY_MODEL:-([^}]+)\}", script)[1]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "WORKDIR /app" in dockerfile and "COPY . ." in dockerfile  # /app is the repository
    for name, (w, c, _env, _argv, ns) in parsed("overlays/cpu").items():
        spec = pod_spec(w)
        [init] = spec["initContainers"]
        assert init["command"] == ["/app/deploy/docker/model-init.sh"]
        assert (ROOT / init["command"][0].removeprefix("/app/")).is_file()
        init_env = resolved_env(objs, w, init)
        # the model the process loads is the one the init container makes
        assert init_env["MODEL"] == ns.model == tiny, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        [model_mount] = [m for m in c["volumeMounts"] if ns.model.startswith(m["mountPath"] + "/")]
        assert "emptyDir" in volumes[model_mount["name"]], name
        assert model_mount["readOnly"] is True
        [init_mount] = [m for m in init["volumeMounts"] if m["name"] == model_mount["name"]]
        assert init_mount["mountPath"] == model_mount["mountPath"]
        assert not init_mount.get("readOnly")  # the init container writes the model


@unit
@pytest.mark.parametrize("target", ["base", "overlays/gpu"])
def test_model_from_the_shared_claim(target):
    objs = objects(target)
    [pvc] = by_kind(objs, "PersistentVolumeClaim")
    # pods on several nodes read one copy
    assert {"ReadWriteMany", "ReadOnlyMany"} & set(pvc["spec"]["accessModes"])
    for name, (w, c, _env, _argv, ns) in parsed(target).items():
        vols = {v["name"]: v for v in pod_spec(w)["volumes"]}
        [mount] = [m for m in c["volumeMounts"] if ns.model.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True, name
        claim = vols[mount["name"]]["persistentVolumeClaim"]
        assert claim["claimName"] == pvc["metadata"]["name"] and claim["readOnly"], name


@unit
def test_gpu_overlay_gives_each_worker_one_gpu_and_shared_memory():
    objs = objects("overlays/gpu")
    for w in workloads(objs):
        spec, role = pod_spec(w), role_of(w)
        [c] = spec["containers"]
        if role not in WORKER_ROLES:
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
            continue
        assert c["image"] == "pdserve:cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["nodeSelector"] and spec["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        vols = {v["name"]: v for v in spec["volumes"]}
        [shm] = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert vols[shm["name"]]["emptyDir"]["medium"] == "Memory"
        # no GPU claiming by the entrypoint: the device plugin assigns the GPU
        assert "PDSERVE_GPU_CLAIM_DIR" not in {e["name"] for e in c["env"]}
        assert parsed("overlays/gpu")[role][4].attention_backend == "triton"


# ---- network policies ------------------------------------------------------------------------------


def _allowed(objs: list[dict], src: dict, dst: dict, port: int) -> bool:
    """Whether the NetworkPolicies let `src` open a TCP connection to `dst` on `port`
    (src / dst: {"ns", "labels", "ports": {name: number}}): allowed if no policy selects dst
    for ingress, else if a rule of one of those that does admits src and port."""
    selecting = [
        p
        for p in by_kind(objs, "NetworkPolicy")
        if p["metadata"]["namespace"] == dst["ns"]
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and matches(p["spec"]["podSelector"], dst["labels"])
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers is not None and not any(_peer_matches(p, policy, src) for p in peers):
                continue
            ports = rule.get("ports")
            if ports is None or any(_port_matches(p, dst, port) for p in ports):
                return True
    return False


def _peer_matches(peer: dict, policy: dict, src: dict) -> bool:
    assert "ipBlock" not in peer
    ns_labels = {"kubernetes.io/metadata.name": src["ns"]}
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], ns_labels):
            return False
    elif src["ns"] != policy["metadata"]["namespace"]:
        return False
    return "podSelector" not in peer or matches(peer["podSelector"], src["labels"])


def _port_matches(rule_port: dict, dst: dict, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    p = rule_port.get("port")
    if p is None:
        return True
    if isinstance(p, str):
        return dst["ports"].get(p) == port
    return p <= port <= rule_port.get("endPort", p)


def _peers(target: str) -> dict[str, dict]:
    objs = objects(target)
    out = {
        "outside": {"ns": "elsewhere", "labels": {}, "ports": {}},
        "prometheus": {"ns": "monitoring", "labels": {"app": "prometheus"}, "ports": {}},
    }
    for w in workloads(objs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        name = role_of(w) or labels["app.kubernetes.io/component"]
        ports = {
            p["name"]: p["containerPort"] for c in pod_spec(w)["containers"] for p in c["ports"]
        }
        out[name] = {"ns": w["metadata"]["namespace"], "labels": labels, "ports": ports}
    return out


def _ucx_range(env: dict[str, str]) -> tuple[int, int]:
    lo, hi = env["UCX_TCP_PORT_RANGE"].split("-")
    return int(lo), int(hi)


@unit
@pytest.mark.parametrize("target", DEPLOYABLE)
def test_network_policies_admit_exactly_the_flows_pdserve_uses(target):
    objs = objects(target)
    peers = _peers(target)
    procs = parsed(target)
    router, prefill, decode = (procs[r][4] for r in ("router", "prefill", "decode"))
    ranges = {_ucx_range(procs[r][2]) for r in WORKER_ROLES}
    assert len(ranges) == 1, "both pools need the same UCX port range"
    [(lo, hi)] = ranges
    assert decode.kv_port not in range(lo, hi + 1)
    flows = [
        ("outside", "router", router.port),  # the API
        ("router", "decode", decode.port),  # DecodeWorker.Generate
        ("decode", "prefill", prefill.port),  # PrefillWorker.Prefill
        ("prefill", "decode", decode.kv_port),  # UCX connection setup
        ("prefill", "decode", lo),  # UCX TCP lanes, both ways
        ("prefill", "decode", hi),
        ("decode", "prefill", lo),
        ("decode", "prefill", hi),
        # the router's /dashboard reads every worker's /metrics (it showed them all "timed
        # out" in Kubernetes while the policies admitted only Prometheus there)
        ("router", "decode", decode.metrics_port),
        ("router", "prefill", prefill.metrics_port),
    ]
    if "redis" in peers:
        port = int(router.redis_url.rsplit(":", 1)[1].split("/")[0])
        flows += [(r, "redis", port) for r in ("router", "prefill", "decode")]
        refused_redis = [("outside", "redis", port), ("prometheus", "redis", port)]
    else:
        refused_redis = []
    for src, dst, port in flows:
        assert _allowed(objs, peers[src], peers[dst], port), f"{src} -> {dst}:{port} refused"
    refused = [
        ("outside", "decode", decode.port),
        ("outside", "prefill", prefill.port),
        ("outside", "decode", decode.kv_port),
        ("outside", "decode", lo),
        ("router", "prefill", prefill.port),  # the router talks to decode workers only
        ("router", "decode", decode.kv_port),
        ("prefill", "decode", decode.port),
        ("decode", "decode", decode.kv_port),
        ("prefill", "prefill", lo),
        ("outside", "prefill", prefill.metrics_port),
        ("prefill", "decode", decode.metrics_port),
        *refused_redis,
    ]
    for src, dst, port in refused:
        assert not _allowed(objs, peers[src], peers[dst], port), f"{src} -> {dst}:{port} admitted"
    monitored = bool(by_kind(objs, "PodMonitor"))
    for role, ns in (("prefill", prefill), ("decode", decode)):
        allowed = _allowed(objs, peers["prometheus"], peers[role], ns.metrics_port)
        assert allowed == monitored, (role, monitored)
    assert _allowed(objs, peers["prometheus"], peers["router"], router.port)


# ---- monitoring and autoscaling ------------------------------------------------------------------


def _dashboard_jobs() -> set[str]:
    return set(re.findall(r'job="([^"]+)"', DASHBOARD.read_text()))


@unit
@pytest.mark.parametrize("target", ["overlays/monitoring", "overlays/autoscaling"])
def test_monitors_scrape_the_metrics_ports_under_the_dashboard_job_names(target):
    objs = objects(target)
    procs = parsed(target)
    jobs = {}
    [sm] = by_kind(objs, "ServiceMonitor")
    services = [
        s
        for s in by_kind(objs, "Service")
        if s["metadata"]["namespace"] == sm["metadata"]["namespace"]
        and matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))
    ]
    assert [s["metadata"]["name"] for s in services] == ["pdserve-router"]
    [endpoint] = sm["spec"]["endpoints"]
    [svc_port] = [p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
    w, c, _env, _argv, ns = procs["router"]
    assert _container_port(c, svc_port["targetPort"]) == ns.port
    assert endpoint["path"] == "/metrics"
    # the router's /metrics needs a key: the scrape presents the one the router reads
    creds = endpoint["authorization"]["credentials"]
    files = _secret_files(w, c)
    assert (creds["name"], creds["key"]) in [files[p] for p in ns.api_key_file]
    jobs["router"] = services[0]["metadata"]["labels"][sm["spec"]["jobLabel"]]

    [pm] = by_kind(objs, "PodMonitor")
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for role in WORKER_ROLES:
        w, c, _env, _argv, ns = procs[role]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(pm["spec"]["selector"], labels), role
        assert _container_port(c, endpoint["port"]) == ns.metrics_port
        jobs[role] = labels[pm["spec"]["jobLabel"]]
    router_labels = procs["router"][0]["spec"]["template"]["metadata"]["labels"]
    assert not matches(pm["spec"]["selector"], router_labels)
    # the job names are the compose Prometheus config's, which the dashboard's queries use
    compose = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    compose_jobs = {j["job_name"] for j in compose["scrape_configs"]}
    assert jobs == {j: j for j in compose_jobs}
    assert _dashboard_jobs() <= set(jobs.values())
    for monitor in (sm, pm):
        # text format 0.0.4 keeps the colons of pdserve:* names (deploy/prometheus/prometheus.yml)
        assert monitor["spec"]["scrapeProtocols"] == ["PrometheusText0.0.4"]
        spec = monitor["spec"]
        for ep in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
            for relabel in ep.get("metricRelabelings") or []:
                names = set(re.findall(r"pdserve:[A-Za-z0-9_:]+", relabel.get("regex", "")))
                assert names <= set(exported_series()), names


@unit
@pytest.mark.parametrize("target", ["overlays/monitoring", "overlays/autoscaling"])
def test_grafana_gets_the_compose_dashboard_and_its_datasource(target):
    objs = objects(target)
    [cm] = _labelled(objs, "grafana_dashboard")
    assert cm["data"] == {"pdserve.json": DASHBOARD.read_text()}
    dash = json.loads(DASHBOARD.read_text())
    uids = {
        t["datasource"]["uid"]
        for p in dash["panels"]
        if p["type"] != "row"
        for t in [p, *p["targets"]]
    }
    [ds_cm] = _labelled(objs, "grafana_datasource")
    [(_, text)] = ds_cm["data"].items()
    [source] = yaml.safe_load(text)["datasources"]
    assert uids == {source["uid"]}
    assert source["type"] == "prometheus" and source["isDefault"] is False


def _labelled(objs: list[dict], label: str) -> list[dict]:
    """ConfigMaps with `label` set (what Grafana's sidecars pick up)."""
    return [c for c in by_kind(objs, "ConfigMap") if c["metadata"].get("labels", {}).get(label)]


def _selectors(query: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: value}) of every selector in a PromQL expression with label matchers."""
    out = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", query):
        labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', m[2]))
        out.append((m[1], labels))
    return out


def _fallback_reasons() -> set[str]:
    source = (ROOT / "decode_service" / "server.py").read_text()
    body = source.split("def _fallback_reason", 1)[1].split("\ndef ", 1)[0]
    return set(re.findall(r'return "(\w+)"', body))


@unit
def test_autoscalers_scale_each_pool_on_metrics_the_code_exports():
    objs = objects("overlays/autoscaling")
    series = exported_series()
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in by_kind(objs, "ScaledObject")}
    assert set(scaled) == {"pdserve-prefill", "pdserve-decode"}
    used = {}
    for target, so in scaled.items():
        deployment = one(objs, "Deployment", target)
        assert so["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        # the HPA owns the replica count: a manifest value would reset it on every apply
        assert "replicas" not in deployment["spec"], target
        role = role_of(deployment)
        assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
        down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 60  # each removed pod drains
        names = set()
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            meta = trigger["metadata"]
            assert set(meta) <= KEDA_PROMETHEUS_KEYS, set(meta) - KEDA_PROMETHEUS_KEYS
            assert meta["serverAddress"].startswith(("http://", "https://"))
            assert float(meta["threshold"]) > 0
            assert trigger["metricType"] in ("Value", "AverageValue")
            query = meta["query"]
            # KEDA needs one number: aggregations over the whole pool, no `by`
            assert not re.search(r"\bby\b|\bwithout\b", query), query
            metrics = promql_metric_names(query)
            assert metrics and metrics <= set(series), f"{trigger['name']}: {metrics - set(series)}"
            names |= metrics
            for _metric, labels in _selectors(query):
                assert labels.get("namespace") == deployment["metadata"]["namespace"], query
                assert labels.get("role") in WORKER_ROLES, query
                if "reason" in labels:
                    assert labels["reason"] in _fallback_reasons(), labels["reason"]
        used[role] = names
    # the signals: prefill backlog tokens for P, KV usage and running streams for D
    assert "pdserve:prefill_backlog_tokens" in used["prefill"]
    assert {"pdserve:kv_cache_usage_perc", "pdserve:num_requests_running"} <= used["decode"]


# ---- docs -------------------------------------------------------------------------------------------


@unit
def test_docs_have_a_kubernetes_section():
    doc = DOCS.read_text()
    assert "## Kubernetes" in doc
    k8s = doc.split("## Kubernetes", 1)[1]
    for overlay in OVERLAYS:
        assert f"deploy/k8s/overlays/{overlay}" in k8s, overlay
    for text in (
        "scale deployment/pdserve-decode",
        "scale deployment/pdserve-prefill",
        "kubectl apply -k deploy/k8s/overlays/cpu",
        "pdserve-cluster-secret",
        "pdserve-api-keys",
        "multinode",
        "docs/benchmarks.md",
    ):
        assert text in k8s, text
    # the autoscaling queries the docs explain are the ones the ScaledObjects run
    for so in by_kind(objects("overlays/autoscaling"), "ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            assert f"`{trigger['metadata']['query']}`" in k8s, trigger["name"]


# ---- multinode: LeaderWorkerSet groups -----------------------------------------------------------

MULTINODE = "overlays/multinode"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def _lws_pod(objs: list[dict], lws: dict, index: int) -> tuple[dict, dict, dict, list[str], object]:
    """(template, container, env, argv, parsed) of pod ``index`` of a group (0: the leader),
    with the variables LeaderWorkerSet injects into every container."""
    lwt = lws["spec"]["leaderWorkerTemplate"]
    template = lwt["leaderTemplate"] if index == 0 else lwt["workerTemplate"]
    [c] = template["spec"]["containers"]
    env = resolved_env(objs, lws, c)
    name = lws["metadata"]["name"]
    env.update(
        LWS_LEADER_ADDRESS=f"{name}-0.{name}.pdserve",
        LWS_GROUP_SIZE=str(lwt["size"]),
        LWS_WORKER_INDEX=str(index),
    )
    args = [expand(str(a), env) for a in c["args"]]
    argv = entrypoint_argv(args, env)
    return template, c, env, argv, parse(argv)


@unit
def test_multinode_groups_run_one_worker_over_their_pods():
    objs = objects(MULTINODE)
    router = parsed(MULTINODE)["router"][4]
    groups = {role_of_lws(g): g for g in by_kind(objs, "LeaderWorkerSet")}
    assert set(groups) == set(WORKER_ROLES)
    for role, lws in groups.items():
        lwt = lws["spec"]["leaderWorkerTemplate"]
        size = lwt["size"]
        assert size >= 2
        # a lost rank ends the worker: LWS recreates the whole group, as a supervisor would
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        # rank 0 waits for every rank before its gRPC port opens: the followers must start
        # with the leader, not once it is ready
        assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
        pods = [_lws_pod(objs, lws, i) for i in range(size)]
        layouts = set()
        for i, (template, c, _env, argv, ns) in enumerate(pods):
            assert not any("$(" in a for a in argv), argv
            assert argv[1] == role == template["metadata"]["labels"][ROLE_LABEL]
            assert ns.node_rank == i and ns.nnodes == size
            assert (
                ns.master_addr == f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.pdserve"
            )
            # one model, one name, one Redis with the router (the ConfigMaps are separate)
            assert (ns.model, ns.served_model_name, ns.redis_url) == (
                router.model,
                router.served_model_name,
                router.redis_url,
            )
            assert ns.device == "cuda"
            world = ns.tensor_parallel_size * ns.pipeline_parallel_size
            assert world % size == 0, (world, size)
            for kind in ("requests", "limits"):
                assert c["resources"][kind]["nvidia.com/gpu"] == world // size, (role, i)
            layouts.add((ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.master_port))
        assert len(layouts) == 1, layouts  # every pod of the group agrees
        # only the leader serves: it is probed on its gRPC port and declares the rendezvous
        leader_c, leader_ns = pods[0][1], pods[0][4]
        declared = {p["containerPort"] for p in leader_c["ports"]}
        assert leader_ns.master_port in declared and leader_ns.port in declared
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _probe_port(leader_c[kind], leader_c) == leader_ns.port
        for _t, c, *_ in pods[1:]:
            assert not any(k in c for k in ("startupProbe", "readinessProbe", "livenessProbe"))


def role_of_lws(lws: dict) -> str:
    return lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"][ROLE_LABEL]


@unit
def test_multinode_pods_are_the_gpu_overlays_worker_pods():
    """The groups' pods are overlays/gpu's worker pods but for the multi-node flags, the GPU
    count, the probes and ports of the followers and the spread constraint (LWS places a
    group's pods itself): a change to one that the other misses fails here."""
    gpu = {role_of(w): pod_spec(w) for w in workloads(objects("overlays/gpu"))}
    for lws in by_kind(objects(MULTINODE), "LeaderWorkerSet"):
        role = role_of_lws(lws)
        want = copy.deepcopy(gpu[role])
        want.pop("topologySpreadConstraints", None)
        lwt = lws["spec"]["leaderWorkerTemplate"]
        for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
            got = copy.deepcopy(template["spec"])
            [gc], [wc] = got.pop("containers"), copy.deepcopy(want["containers"])
            assert got == {k: v for k, v in want.items() if k != "containers"}, role
            same = ("image", "imagePullPolicy", "volumeMounts", "securityContext", "name")
            assert {k: gc.get(k) for k in same} == {k: wc.get(k) for k in same}, role
            assert gc["args"][: len(wc["args"])] == wc["args"], role
            wanted_env = {e["name"] for e in wc["env"]} - {"PDSERVE_NUM_THREADS"}
            assert wanted_env <= {e["name"] for e in gc["env"]}, role


@unit
def test_multinode_groups_talk_among_themselves_only():
    objs = objects(MULTINODE)
    peers = _peers(MULTINODE)
    for lws in by_kind(objs, "LeaderWorkerSet"):
        name = lws["metadata"]["name"]
        labels = {**lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]}
        labels[LWS_NAME_LABEL] = name  # LeaderWorkerSet adds it to every pod of the set
        member = {"ns": "pdserve", "labels": labels, "ports": {}}
        other = {**member, "labels": {**labels, LWS_NAME_LABEL: "someone-else"}}
        for port in (29500, 41234, 61000):  # the rendezvous, then ports gloo / NCCL pick
            assert _allowed(objs, member, member, port), (name, port)
            assert not _allowed(objs, other, member, port), (name, port)
            assert not _allowed(objs, peers["router"], member, port), (name, port)
            assert not _allowed(objs, peers["outside"], member, port), (name, port)
    # the single-node pools are there to scale, at 0
    for role in WORKER_ROLES:
        assert one(objs, "Deployment", f"pdserve-{role}")["spec"]["replicas"] == 0
