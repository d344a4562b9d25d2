"""docker-compose.yml, the Prometheus config and the Grafana dashboard, checked without Docker.

The compose tests run `docker-compose config` (Compose v1, as Debian ships it; `docker compose`
v2 when only that is installed) on the committed file and assert on the rendered result, so
interpolation, YAML anchors / merge keys and the schema are the tool's, not ours. They skip
when neither binary exists. The Prometheus and Grafana tests need nothing but the files and
the source tree: every metric the dashboard queries must be one the code exports.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from functools import cache, lru_cache
from pathlib import Path

import pytest
import yaml

from shared.cli.launcher import DISAGG_DECODE_PREFILL_SHARE

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "pdserve.yml"
SOURCE_PACKAGES = ("shared", "router", "kvtransfer", "prefill_service", "decode_service")

CPU_WORKERS = ("prefill", "decode")
GPU_WORKERS = ("prefill-gpu", "decode-gpu")
WORKERS = CPU_WORKERS + GPU_WORKERS
CORE = {"redis", "model-init", "router"}


# ---- running docker-compose ----------------------------------------------------------------


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _interpolated_variables() -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE_FILE.read_text()))


@cache
def _render(profiles: tuple[str, ...], env_items: tuple[tuple[str, str], ...] = ()) -> dict:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip(
            "neither docker-compose nor `docker compose` is installed "
            "(scripts/setup.sh --test installs docker-compose)"
        )
    # The file's defaults, not whatever the calling shell exports, unless a test sets a value.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _interpolated_variables() and not k.startswith("COMPOSE_")
    }
    env.update(dict(env_items))
    argv = [*cmd, "-f", str(COMPOSE_FILE)]
    for p in profiles:
        argv += ["--profile", p]
    proc = subprocess.run(
        [*argv, "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(argv)} config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def active_services(profiles: tuple[str, ...], **env: str) -> dict[str, dict]:
    """Services `up` would start with these profiles (Compose v1's `config` lists them all)."""
    services = _render(profiles, tuple(sorted(env.items())))["services"]
    return {
        name: svc
        for name, svc in services.items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }


def published_ports(svc: dict) -> list[tuple[str, str, str]]:
    """(host_ip, published, target) of every port the service publishes on the host."""
    out = []
    for port in svc.get("ports", []):
        if isinstance(port, dict):  # Compose v2 long syntax
            if port.get("published"):
                out.append((port.get("host_ip", ""), str(port["published"]), str(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append(("", parts[0], parts[1]))
    return out


def mounts(svc: dict) -> dict[str, str]:
    """target -> source of the service's volumes."""
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict):
            out[vol["target"]] = vol.get("source", "")
        else:
            source, target = str(vol).split(":")[:2]
            out[target] = source
    return out


def read_only(svc: dict, target: str) -> bool:
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict):
            if vol["target"] == target:
                return bool(vol.get("read_only"))
        elif str(vol).split(":")[1] == target:
            return str(vol).split(":")[2:] == ["ro"]
    raise KeyError(target)


def command(svc: dict) -> list[str]:
    cmd = svc["command"]
    return cmd.split() if isinstance(cmd, str) else [str(a) for a in cmd]


def flag(cmd: list[str], name: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == name:
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


# ---- compose ----------------------------------------------------------------------------------

PROFILE_SETS = {
    (): CORE,
    ("cpu",): CORE | set(CPU_WORKERS),
    ("gpu",): CORE | set(GPU_WORKERS),
    ("cpu", "monitoring"): CORE | set(CPU_WORKERS) | {"prometheus", "grafana"},
    ("gpu", "monitoring"): CORE | set(GPU_WORKERS) | {"prometheus", "grafana"},
}


@pytest.mark.parametrize("profiles", list(PROFILE_SETS), ids=lambda p: "+".join(p) or "default")
def test_each_profile_renders_the_expected_services(profiles):
    assert set(active_services(profiles)) == PROFILE_SETS[profiles]


@pytest.mark.parametrize("profiles", [(), ("cpu",), ("gpu",)], ids=["default", "cpu", "gpu"])
def test_router_is_the_only_published_port(profiles):
    services = active_services(profiles)
    published = {
        name: published_ports(svc) for name, svc in services.items() if published_ports(svc)
    }
    assert set(published) == {"router"}
    [(_, host_port, target)] = published["router"]
    assert host_port == "8000"
    assert target == flag(command(services["router"]), "--port") == "8000"


def test_monitoring_publishes_grafana_on_loopback_only():
    services = active_services(("cpu", "monitoring"))
    published = {name for name, svc in services.items() if published_ports(svc)}
    assert published == {"router", "grafana"}
    [(host_ip, host_port, target)] = published_ports(services["grafana"])
    assert (host_ip, host_port, target) == ("127.0.0.1", "3000", "3000")
    assert not published_ports(services["prometheus"])


@pytest.mark.parametrize("name", WORKERS)
def test_workers_can_be_scaled(name):
    """`--scale` needs: no container_name, no host ports, fixed ports inside the container, and
    no fixed advertised address (the entrypoint adds each replica's own IP)."""
    svc = active_services(("cpu", "gpu"))[name]
    assert "container_name" not in svc
    assert "hostname" not in svc
    assert published_ports(svc) == []
    cmd = command(svc)
    role = name.split("-")[0]
    assert cmd[0] == role
    assert flag(cmd, "--host") == "0.0.0.0"
    assert flag(cmd, "--port") == ("50061" if role == "prefill" else "50051")
    assert flag(cmd, "--metrics-port") == "9100"
    if role == "decode":
        assert flag(cmd, "--kv-port") == "13337"
        # the same bound on local prefills `pdserve up` gives a disaggregated decode worker
        assert flag(cmd, "--max-prefill-tokens-while-decoding") == str(DISAGG_DECODE_PREFILL_SHARE)
    assert flag(cmd, "--advertise-host") is None
    assert flag(cmd, "--redis-url") == "redis://redis:6379/0"


@pytest.mark.parametrize("name", WORKERS + ("router",))
def test_pdserve_services_wait_for_redis_and_the_model(name):
    svc = active_services(("cpu", "gpu"))[name]
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and "healthcheck.py" in " ".join(test)
    port = flag(command(svc), "--port")
    assert test[-1] == port, "the healthcheck must probe the port the process listens on"


def test_redis_has_a_healthcheck_and_no_published_port():
    redis = active_services(())["redis"]
    assert redis["image"].startswith("redis:7")
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert published_ports(redis) == []


def test_gpu_and_cpu_workers_differ_only_where_they_should():
    services = active_services(("cpu", "gpu"))
    for role in ("prefill", "decode"):
        cpu, gpu = services[role], services[f"{role}-gpu"]
        assert flag(command(cpu), "--device") == "cpu"
        assert flag(command(gpu), "--device") == "cuda"
        assert flag(command(gpu), "--attention-backend") == "triton"
        assert "deploy" not in cpu
        [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert cpu["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert "/whl/cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]
        assert "cuda" in gpu["build"]["args"]["BASE_IMAGE"]
        assert gpu["environment"]["PDSERVE_GPU_CLAIM_DIR"] in mounts(gpu)
        # Same pool name on the network whichever profile runs (Prometheus scrapes by it).
        assert role in gpu["networks"]["default"]["aliases"]
        base = [a for a in command(gpu) if a not in ("cuda", "--attention-backend", "triton")]
        assert base == [a for a in command(cpu) if a != "cpu"]


def test_worker_threads_come_from_one_setting():
    """A CPU worker's torch threads (PDSERVE_NUM_THREADS) and its OpenMP pools (OMP_NUM_THREADS)
    are one setting; GPU workers cap torch's CPU threads, which would otherwise be one per host
    core in every replica. No CPU quota unless it equals the threads (docs/deploy.md)."""
    for env, cpu_threads, gpu_threads in (
        ({}, "2", "4"),
        ({"PDSERVE_NUM_THREADS": "3", "PDSERVE_GPU_NUM_THREADS": "6"}, "3", "6"),
    ):
        services = active_services(("cpu", "gpu"), **env)
        for name in CPU_WORKERS:
            svc = services[name]
            got = svc["environment"]
            assert got["PDSERVE_NUM_THREADS"] == got["OMP_NUM_THREADS"] == cpu_threads, name
            if "cpus" in svc:
                assert float(svc["cpus"]) == float(cpu_threads), name
        for name in GPU_WORKERS:
            assert services[name]["environment"]["OMP_NUM_THREADS"] == gpu_threads, name


def test_workers_have_room_for_their_ranks_shared_memory():
    """A worker of several ranks (-tp / -pp in WORKER_ARGS) reserves its ranks' channels in
    /dev/shm (16 MiB + 2 x TP x 8 MiB per stage: 48 MiB at TP 2); Docker's default 64 MiB holds
    one such worker at most, and too little fails its start."""
    services = active_services(("cpu", "gpu"))
    for name in CPU_WORKERS + GPU_WORKERS:
        size = str(services[name].get("shm_size", "0"))
        mib = int(size) / 2**20 if size.isdigit() else int(size.rstrip("mM"))
        assert mib >= 128, (name, size)


def test_default_model_is_the_generated_tiny_model_in_a_named_volume():
    services = active_services(("cpu",))
    assert services["model-init"]["environment"]["MODEL"] == "/models/tiny-llama"
    assert mounts(services["model-init"])["/models"] == "models"
    for name in ("router", "prefill", "decode"):
        assert flag(command(services[name]), "--model") == "/models/tiny-llama"
        # empty: the entrypoint names the model after its directory, the same in every service
        assert flag(command(services[name]), "--served-model-name") == ""
        assert mounts(services[name])["/models"] == "models"
        assert read_only(services[name], "/models"), name
    assert not read_only(services["model-init"], "/models")


def test_a_real_model_directory_reaches_every_service():
    env = {
        "MODELS_DIR": "/srv/models",
        "MODEL": "/models/Qwen2.5-0.5B-Instruct",
        "SERVED_MODEL_NAME": "qwen2.5-0.5b",
    }
    services = active_services(("cpu", "gpu"), **env)
    assert services["model-init"]["environment"]["MODEL"] == env["MODEL"]
    for name in ("model-init", "router", *WORKERS):
        assert mounts(services[name])["/models"] == "/srv/models", name
    for name in ("router", *WORKERS):
        cmd = command(services[name])
        assert flag(cmd, "--model") == env["MODEL"], name
        assert flag(cmd, "--served-model-name") == env["SERVED_MODEL_NAME"], name


def test_every_build_arg_is_declared_in_the_dockerfile():
    dockerfile = (ROOT / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)", dockerfile, re.MULTILINE))
    for name, svc in active_services(("cpu", "gpu")).items():
        if "build" in svc:
            assert set(svc["build"]["args"]) <= declared, name


# ---- Prometheus -------------------------------------------------------------------------------


def _prometheus() -> dict:
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def test_prometheus_scrapes_router_and_both_pools():
    cfg = _prometheus()
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert set(jobs) == {"router", "prefill", "decode"}
    assert jobs["router"]["static_configs"][0]["targets"] == ["router:8000"]
    for role in ("prefill", "decode"):
        [sd] = jobs[role]["dns_sd_configs"]
        assert sd["names"] == [role] and sd["type"] == "A" and sd["port"] == 9100
    # The text format keeps the colons of `pdserve:*` names (see the comment in the file).
    assert cfg["global"]["scrape_protocols"] == ["PrometheusText0.0.4"]


def test_prometheus_targets_match_the_compose_services():
    """The DNS names Prometheus resolves are the worker services (or their aliases) and the
    port is the one their --metrics-port binds; the router target is the router's --port."""
    services = active_services(("cpu", "gpu", "monitoring"))
    jobs = {job["job_name"]: job for job in _prometheus()["scrape_configs"]}
    for name in WORKERS:
        svc = services[name]
        dns_names = {name, *svc.get("networks", {}).get("default", {}).get("aliases", [])}
        role = name.split("-")[0]
        [sd] = jobs[role]["dns_sd_configs"]
        assert set(sd["names"]) & dns_names, name
        assert str(sd["port"]) == flag(command(svc), "--metrics-port")
    host, port = jobs["router"]["static_configs"][0]["targets"][0].split(":")
    assert host == "router" and port == flag(command(services["router"]), "--port")
    assert mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"].endswith(
        "deploy/prometheus/prometheus.yml"
    )


def test_promtool_accepts_the_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    version = subprocess.run(
        [promtool, "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"version (\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) < (2, 49):
        pytest.skip(f"promtool {found[1]}.{found[2]} predates scrape_protocols (2.49)")
    proc = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- metric names the code exports -------------------------------------------------------------

_METRIC_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    # shared/prom.py's lock-free histogram: same exposition as Histogram's
    "LoopHistogram": "histogram",
}
_SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _family_helpers(tree: ast.AST) -> dict[str, tuple[str, str]]:
    """Local functions like ``def gauge(name, ...): GaugeMetricFamily(f"pdserve:{name}", ...)``:
    function name -> (prefix, metric type)."""
    helpers = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or not fn.args.args:
            continue
        param = fn.args.args[0].arg
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and _callee(call) in _METRIC_TYPES and call.args):
                continue
            name = call.args[0]
            if (
                isinstance(name, ast.JoinedStr)
                and len(name.values) == 2
                and isinstance(name.values[0], ast.Constant)
                and isinstance(name.values[1], ast.FormattedValue)
                and isinstance(name.values[1].value, ast.Name)
                and name.values[1].value.id == param
            ):
                helpers[fn.name] = (name.values[0].value, _METRIC_TYPES[_callee(call)])
    return helpers


@lru_cache(maxsize=1)
def exported_series() -> dict[str, str]:
    """Every series name the source tree exposes (``pdserve:x_total``, ``..._bucket``, ...),
    mapped to the metric it belongs to, found by reading the metric constructors' calls."""
    metrics: dict[str, str] = {}
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            helpers = _family_helpers(tree)
            for call in ast.walk(tree):
                if not (
                    isinstance(call, ast.Call)
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                    and isinstance(call.args[0].value, str)
                ):
                    continue
                callee, name = _callee(call), call.args[0].value
                if callee in _METRIC_TYPES and name.startswith("pdserve:"):
                    metrics[name] = _METRIC_TYPES[callee]
                elif (  # a custom collector's Metric(name, doc, type), shared/prom.py's
                    callee == "Metric"
                    and name.startswith("pdserve:")
                    and len(call.args) >= 3
                    and isinstance(call.args[2], ast.Constant)
                ):
                    metrics[name] = str(call.args[2].value)
                elif callee in helpers:
                    prefix, kind = helpers[callee]
                    metrics[prefix + name] = kind
    series = {}
    for name, kind in metrics.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        for suffix in _SERIES_SUFFIXES[kind]:
            series[base + suffix] = name
    return series


_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels and literals out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def test_promql_name_extraction():
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(pdserve:ttft_bucket{role="a b",'
        'job!="x"}[$__rate_interval]))) / 1e9 + sum(pdserve:x) or vector(0)'
    )
    assert promql_metric_names(expr) == {"pdserve:ttft_bucket", "pdserve:x"}


def test_exported_series_cover_the_documented_metrics():
    series = exported_series()
    for name in (
        "pdserve:num_requests_running",
        "pdserve:kv_cache_usage_perc",
        "pdserve:prefix_cache_hits_total",
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:kv_transfer_bytes_total",
        "pdserve:router_requests_total",
        "pdserve:prefill_fallbacks_total",
        "pdserve:gc_pause_seconds_bucket",
        "pdserve:gc_frozen_objects",
    ):
        assert name in series, name
    assert "pdserve:num_requests_running_total" not in series  # a gauge has no _total


# ---- Grafana --------------------------------------------------------------------------------


def _dashboard_targets() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_dashboard_queries_only_metrics_the_code_exports():
    series = exported_series()
    targets = _dashboard_targets()
    assert len(targets) >= 10
    for title, expr in targets:
        names = promql_metric_names(expr)
        assert names, f"{title!r}: {expr!r} selects no metric"
        unknown = names - set(series)
        assert not unknown, f"{title!r} queries {sorted(unknown)}, which no code exports"


def test_dashboard_covers_the_serving_signals():
    used = {name for _, expr in _dashboard_targets() for name in promql_metric_names(expr)}
    for name in (
        "pdserve:router_requests_total",
        "pdserve:router_time_to_first_token_seconds_bucket",
        "pdserve:router_inter_token_latency_seconds_bucket",
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_bucket",
        "pdserve:kv_cache_usage_perc",
        "pdserve:prefix_cache_hits_total",
        "pdserve:prefix_cache_queries_total",
        "pdserve:kv_transfer_bytes_total",
        "pdserve:kv_transfer_failures_total",
        "pdserve:prefill_fallbacks_total",
        "pdserve:num_preemptions_total",
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
    ):
        assert name in used, name


def test_dashboard_panels_use_the_provisioned_datasource():
    [source] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pdserve"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = active_services(("cpu", "monitoring"))["grafana"]
    mounted = mounts(grafana)
    [provider] = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert mounted[provider["options"]["path"]].endswith("deploy/grafana/dashboards")
    assert mounted["/etc/grafana/provisioning"].endswith("deploy/grafana/provisioning")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


# ---- docs -------------------------------------------------------------------------------------


def test_every_compose_setting_is_documented():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    missing = sorted(v for v in _interpolated_variables() if f"`{v}`" not in doc)
    assert not missing, f"docs/deploy.md does not describe {missing}"


def test_the_router_stops_within_its_grace_period():
    """The router's SIGTERM path takes ``--shutdown-timeout`` (10 s) plus up to 5 s of clean-up;
    compose had no ``stop_grace_period`` for it (Docker's default: 10 s, then SIGKILL)."""
    from router.config import RouterConfig

    grace = active_services(("cpu",))["router"]["stop_grace_period"]
    seconds = float(str(grace).rstrip("s"))
    assert seconds > RouterConfig.shutdown_timeout_s + 5
