"""The scripts the image runs (deploy/docker/*) and what the Dockerfile copies, without Docker.

The entrypoint runs in its dry-run mode (it prints the command it would exec); GPU claiming runs
against a fake `nvidia-smi` and a temporary claim directory; the healthcheck probes real local
gRPC and HTTP servers; model-init writes a real tiny model.
"""

from __future__ import annotations

import fcntl
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "deploy" / "docker"
ENTRYPOINT = DOCKER_DIR / "entrypoint.sh"
MODEL_INIT = DOCKER_DIR / "model-init.sh"
HEALTHCHECK = DOCKER_DIR / "healthcheck.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the scripts need bash")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PDSERVE_", "UCX_", "CUDA_VISIBLE", "MODEL"))
    }
    env["PATH"] = f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PDSERVE_ENTRYPOINT_DRY_RUN"] = "1"
    env.update(extra)
    return env


def dry_run(tmp_path: Path, *args: str, **env: str) -> tuple[list[str], str]:
    """(argv the entrypoint would exec, CUDA_VISIBLE_DEVICES it chose)."""
    proc = subprocess.run(
        [str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path, **env),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("CUDA_VISIBLE_DEVICES=")
    return lines[:-1], lines[-1].split("=", 1)[1]


def fake_nvidia_smi(tmp_path: Path, gpus: list[str]) -> None:
    """An `nvidia-smi` that answers `--query-gpu=index,uuid --format=csv,noheader` as the real
    one does (``0, GPU-...``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    table = "\\n".join(f"{i}, {uuid}" for i, uuid in enumerate(gpus))
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/usr/bin/env bash\nprintf '{table}\\n'\n")
    script.chmod(0o755)


# ---- entrypoint -------------------------------------------------------------------------------


def test_workers_advertise_their_own_address(tmp_path):
    for role in ("prefill", "decode"):
        argv, _ = dry_run(
            tmp_path,
            role,
            "--model",
            "/models/m",
            "--port",
            "50061",
            PDSERVE_ADVERTISE_HOST="172.18.0.7",
        )
        assert argv == [
            "pdserve",
            role,
            "--model",
            "/models/m",
            "--port",
            "50061",
            "--advertise-host",
            "172.18.0.7",
        ]


def test_an_explicit_advertise_host_is_kept(tmp_path):
    for given in (["--advertise-host", "10.0.0.5"], ["--advertise-host=10.0.0.5"]):
        argv, _ = dry_run(
            tmp_path, "decode", "--model", "m", *given, PDSERVE_ADVERTISE_HOST="172.18.0.7"
        )
        assert argv == ["pdserve", "decode", "--model", "m", *given]


def test_a_loopback_address_is_refused(tmp_path):
    proc = subprocess.run(
        [str(ENTRYPOINT), "prefill", "--model", "m"],
        capture_output=True,
        text=True,
        env=_env(tmp_path, PDSERVE_ADVERTISE_HOST="127.0.0.1"),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "PDSERVE_ADVERTISE_HOST" in proc.stderr


def test_an_empty_served_model_name_becomes_the_model_directory_name(tmp_path):
    argv, _ = dry_run(
        tmp_path,
        "router",
        "--model",
        "/models/Qwen2.5-7B-Instruct/",
        "--served-model-name",
        "",
        "--port",
        "8000",
    )
    assert argv == [
        "pdserve",
        "router",
        "--model",
        "/models/Qwen2.5-7B-Instruct/",
        "--served-model-name",
        "Qwen2.5-7B-Instruct",
        "--port",
        "8000",
    ]
    argv, _ = dry_run(
        tmp_path,
        "decode",
        "--model=/models/tiny-llama",
        "--served-model-name=",
        PDSERVE_ADVERTISE_HOST="172.18.0.7",
    )
    assert argv[:4] == [
        "pdserve",
        "decode",
        "--model=/models/tiny-llama",
        "--served-model-name=tiny-llama",
    ]
    argv, _ = dry_run(tmp_path, "router", "--model", "/models/m", "--served-model-name", "mine")
    assert argv == ["pdserve", "router", "--model", "/models/m", "--served-model-name", "mine"]


def test_extra_args_are_appended_word_by_word_without_globbing(tmp_path):
    (tmp_path / "x.txt").write_text("")
    argv, _ = dry_run(
        tmp_path, "router", "--model", "m", PDSERVE_EXTRA_ARGS="  --max-retries 3 --api-key * "
    )
    assert argv == ["pdserve", "router", "--model", "m", "--max-retries", "3", "--api-key", "*"]


def test_the_router_gets_no_advertise_host(tmp_path):
    argv, cuda = dry_run(tmp_path, "router", "--model", "m", PDSERVE_ADVERTISE_HOST="172.18.0.7")
    assert argv == ["pdserve", "router", "--model", "m"]
    assert cuda == ""


def test_other_commands_run_as_given(tmp_path):
    proc = subprocess.run(
        [str(ENTRYPOINT), "echo", "hello"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout == "hello\n"


@pytest.mark.parametrize("tool", ["quantize", "fuzz", "chaos"])
def test_pdserve_tools_run_through_pdserve(tmp_path, tool):
    """``docker run IMAGE quantize ...`` exec'd ``quantize`` as a program (not found)."""
    proc = subprocess.run(
        [str(ENTRYPOINT), tool, "--help"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: pdserve {tool}")


def test_empty_ucx_variables_are_dropped(tmp_path):
    proc = subprocess.run(
        [str(ENTRYPOINT), "env"],
        capture_output=True,
        text=True,
        env=_env(tmp_path, UCX_TLS="", UCX_NET_DEVICES="eth0"),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert "UCX_TLS=" not in proc.stdout.splitlines()
    assert "UCX_NET_DEVICES=eth0" in proc.stdout.splitlines()


# ---- GPU claims -------------------------------------------------------------------------------

needs_flock = pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) missing")


@needs_flock
def test_each_worker_claims_a_gpu_no_other_worker_holds(tmp_path):
    fake_nvidia_smi(tmp_path, ["GPU-aaa", "GPU-bbb", "GPU-ccc"])
    claims = tmp_path / "claims"
    env = {"PDSERVE_GPU_CLAIM_DIR": str(claims), "PDSERVE_ADVERTISE_HOST": "172.18.0.7"}
    _, first = dry_run(tmp_path, "decode", "--model", "m", **env)
    assert first == "GPU-aaa"  # the dry run let go of it on exit
    claims.mkdir(exist_ok=True)
    with open(claims / "GPU-aaa.lock", "w") as held_a, open(claims / "GPU-bbb.lock", "w") as held_b:
        fcntl.flock(held_a, fcntl.LOCK_EX | fcntl.LOCK_NB)  # two running workers
        fcntl.flock(held_b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _, third = dry_run(tmp_path, "prefill", "--model", "m", **env)
        assert third == "GPU-ccc"
        _, restricted = dry_run(
            tmp_path, "prefill", "--model", "m", PDSERVE_GPUS="2,GPU-aaa", **env
        )
        assert restricted == "GPU-ccc"


@needs_flock
def test_no_free_gpu_fails_with_a_message(tmp_path):
    fake_nvidia_smi(tmp_path, ["GPU-aaa"])
    claims = tmp_path / "claims"
    claims.mkdir()
    with open(claims / "GPU-aaa.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.run(
            [str(ENTRYPOINT), "decode", "--model", "m"],
            capture_output=True,
            text=True,
            env=_env(
                tmp_path,
                PDSERVE_GPU_CLAIM_DIR=str(claims),
                PDSERVE_GPU_CLAIM_WAIT="0",
                PDSERVE_ADVERTISE_HOST="172.18.0.7",
            ),
            timeout=60,
            check=False,
        )
    assert proc.returncode == 1
    assert "held by other pdserve workers" in proc.stderr


@needs_flock
def test_a_preset_cuda_visible_devices_skips_claiming(tmp_path):
    _, cuda = dry_run(
        tmp_path,
        "decode",
        "--model",
        "m",
        PDSERVE_GPU_CLAIM_DIR=str(tmp_path),
        CUDA_VISIBLE_DEVICES="3",
        PDSERVE_ADVERTISE_HOST="172.18.0.7",
    )
    assert cuda == "3"


# ---- model-init -------------------------------------------------------------------------------


def _model_init(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MODEL_INIT)],
        capture_output=True,
        text=True,
        env=_env(tmp_path, **env),
        timeout=300,
        check=False,
    )


def test_model_init_keeps_an_existing_model(tmp_path):
    model = tmp_path / "real-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _model_init(tmp_path, MODEL=str(model))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]


def test_model_init_refuses_a_missing_real_model(tmp_path):
    proc = _model_init(
        tmp_path, MODEL=str(tmp_path / "missing"), PDSERVE_TINY_MODEL=str(tmp_path / "tiny-llama")
    )
    assert proc.returncode == 1
    assert "MODELS_DIR" in proc.stderr
    assert not (tmp_path / "tiny-llama").exists()


def test_model_init_writes_a_given_cluster_secret_into_the_file_members_read(tmp_path):
    """With ``PDSERVE_CLUSTER_SECRET`` set, model-init wrote no file, but every member reads
    ``--cluster-secret-file`` (the file wins): on a fresh volume they all failed to start, on a
    used one an old secret overrode the given one."""
    model = tmp_path / "real-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    secret = tmp_path / "cluster-secret"
    secret.write_text("old\n")
    env = {"MODEL": str(model), "PDSERVE_CLUSTER_SECRET_FILE": str(secret)}
    proc = _model_init(tmp_path, PDSERVE_CLUSTER_SECRET="s3cret-of-the-user", **env)
    assert proc.returncode == 0, proc.stderr
    assert secret.read_text().strip() == "s3cret-of-the-user"
    assert secret.stat().st_mode & 0o077 == 0
    secret.unlink()  # without the variable: a random one, made once
    assert _model_init(tmp_path, **env).returncode == 0
    made = secret.read_text()
    assert len(made.strip()) == 64
    assert _model_init(tmp_path, **env).returncode == 0 and secret.read_text() == made


def test_model_init_writes_the_tiny_model_once(tmp_path):
    tiny = tmp_path / "tiny-llama"
    proc = _model_init(tmp_path, MODEL=str(tiny), PDSERVE_TINY_MODEL=str(tiny))
    assert proc.returncode == 0, proc.stderr
    written = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= written
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    again = _model_init(tmp_path, MODEL=str(tiny), PDSERVE_TINY_MODEL=str(tiny))
    assert again.returncode == 0 and "using" in again.stdout
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp


# ---- healthcheck ------------------------------------------------------------------------------


def _healthcheck(*args: str) -> int:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, timeout=60, check=False
    ).returncode


def test_grpc_healthcheck_follows_the_serving_status():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _healthcheck("grpc", str(port)) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _healthcheck("grpc", str(port)) == 0
    finally:
        server.stop(None)
    assert _healthcheck("grpc", str(port)) == 1  # nothing listening


def test_http_healthcheck_follows_the_status_code():
    status = {"code": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "x"}')

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = str(httpd.server_address[1])
    try:
        assert _healthcheck("http", port) == 1
        status["code"] = 200
        assert _healthcheck("http", port) == 0
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert _healthcheck("bogus", port) == 2


# ---- Dockerfile and build context --------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore glob: `*` and `?` stop at `/`, `**/` spans directories."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """A pattern excludes the path when it matches the path or one of its parent directories."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(_glob_regex(p).match(prefix) for p in patterns for prefix in prefixes)


def test_the_build_context_holds_what_the_image_needs():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "update _dockerignored for exceptions"
    needed = [
        "pyproject.toml",
        "README.md",
        "deploy/docker/entrypoint.sh",
        "deploy/docker/model-init.sh",
        "deploy/docker/healthcheck.py",
        "shared/models/__init__.py",
        "shared/proto/pdserve_pb2.py",
        "router/server.py",
        "kvtransfer/ucx.py",
        "prefill_service/server.py",
        "decode_service/server.py",
        "kernels/__init__.py",
        "bench/__init__.py",
    ]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not _dockerignored(path, patterns), f"{path} is excluded from the build context"
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "shared/__pycache__/x.pyc",
        "models/tiny-llama/model.safetensors",
    ):
        assert _dockerignored(path, patterns), path


def test_dockerfile_entrypoint_and_scripts_are_wired():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/app/deploy/docker/entrypoint.sh"]' in dockerfile
    assert "WORKDIR /app" in dockerfile
    assert "pip install -e '.[engine,nixl]'" in dockerfile
    for script in (ENTRYPOINT, MODEL_INIT):
        assert os.access(script, os.X_OK), f"{script} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env bash\n")


def test_the_image_has_what_the_cpu_kernels_build_with():
    """``kernels/cpp_build.py`` builds the CPU kernels at a worker's first start with torch's
    ``cpp_extension`` (a C++ compiler and ninja); the image had only gcc, so every CPU worker
    in compose and Kubernetes ran the torch reference path. No Docker engine here: the
    Dockerfile's package list is checked."""
    text = (ROOT / "Dockerfile").read_text()
    install = next(line for line in text.splitlines() if "apt-get install" in line)
    assert {"g++", "ninja-build"} <= set(install.split())


def test_the_cpu_image_refuses_a_cuda_torch(tmp_path):
    """The Dockerfile's check after the dependencies are installed: in the CPU image (the CPU
    torch index) a CUDA torch fails the build, as it would if a dependency had made pip swap
    the CPU wheel for PyPI's; the CUDA image passes it. Run with a stand-in torch module."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    [run] = [line for line in text.splitlines() if "pip install -e '.[engine,nixl]'" in line]
    check = run[run.index("case ") : run.index("esac") + len("esac")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    for cuda, url, ok in (
        ("12.8", "https://download.pytorch.org/whl/cpu", False),
        ("12.8", "https://download.pytorch.org/whl/cpu/", False),
        (None, "https://download.pytorch.org/whl/cpu", True),
        ("12.8", "https://download.pytorch.org/whl/cu128", True),
    ):
        torch_dir = tmp_path / f"torch-{cuda}" / "torch"
        torch_dir.mkdir(parents=True, exist_ok=True)
        (torch_dir / "__init__.py").write_text("__version__ = '2.13.0'\nfrom . import version\n")
        (torch_dir / "version.py").write_text(f"cuda = {cuda!r}\n")
        proc = subprocess.run(
            ["sh", "-c", check],
            capture_output=True,
            text=True,
            env={
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "PYTHONPATH": str(torch_dir.parent),
                "TORCH_INDEX_URL": url,
            },
            timeout=60,
            check=False,
        )
        assert (proc.returncode == 0) == ok, (cuda, url, proc.stderr)
        if not ok:
            assert "CUDA build" in proc.stderr


# ---- scripts/setup.sh: which torch it installs ----------------------------------------------------

SETUP = ROOT / "scripts" / "setup.sh"


def setup_torch_index(tmp_path: Path, gpu: bool = False, **env: str) -> tuple[str, str]:
    """(the --index-url scripts/setup.sh would install torch from, "" for pip's own
    configuration; what it said) on a machine with or without a GPU (a fake `nvidia-smi -L`
    that succeeds or fails)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n"
    )
    smi.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    base["PATH"] = f"{bin_dir}:{base.get('PATH', '')}"
    proc = subprocess.run(
        [str(SETUP), "--print-torch-index"],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


@pytest.fixture
def torch_index_server():
    """A package index on loopback that has a page for torch (what the probe asks for)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.rstrip("/").endswith("/torch")
            body = b"<a href='torch-2.13.0+cpu.whl'>torch</a>" if found else b"no"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def test_setup_installs_the_cpu_torch_when_its_index_answers(tmp_path, torch_index_server):
    # plain `pip install torch` on Linux x86_64 is PyPI's CUDA build: the CPU index instead
    got, said = setup_torch_index(tmp_path, PDSERVE_TORCH_CPU_INDEX_URL=torch_index_server)
    assert got == torch_index_server, said
    auto = {"PDSERVE_TORCH_INDEX_URL": "auto", "PDSERVE_TORCH_CPU_INDEX_URL": torch_index_server}
    assert setup_torch_index(tmp_path, **auto)[0] == torch_index_server


def test_setup_takes_pips_configuration_when_the_cpu_index_does_not_answer(tmp_path):
    """An offline machine or one with only its own mirror (pip's find-links, index-url): pip's
    configuration, at once when the connection is refused."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got, said = setup_torch_index(tmp_path, PDSERVE_TORCH_CPU_INDEX_URL=f"http://127.0.0.1:{port}/")
    assert got == "" and "does not answer" in said


def test_setup_waits_for_a_silent_cpu_index_only_the_probe_timeout(tmp_path):
    """A network that swallows the connection (pip would wait PIP_DEFAULT_TIMEOUT, retried)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # accepts, never answers
        port = s.getsockname()[1]
        start = time.monotonic()
        got, said = setup_torch_index(
            tmp_path,
            PDSERVE_TORCH_CPU_INDEX_URL=f"http://127.0.0.1:{port}/",
            PDSERVE_TORCH_INDEX_PROBE_TIMEOUT="1",
        )
        assert got == "" and "does not answer" in said
        assert time.monotonic() - start < 10


def test_setup_takes_pips_configuration_on_a_gpu_machine(tmp_path, torch_index_server):
    got, said = setup_torch_index(
        tmp_path, gpu=True, PDSERVE_TORCH_CPU_INDEX_URL=torch_index_server
    )
    assert got == "" and "GPU" in said


def test_setup_torch_index_override(tmp_path, torch_index_server):
    cu = "https://download.pytorch.org/whl/cu128"
    for gpu in (False, True):
        assert setup_torch_index(tmp_path, gpu=gpu, PDSERVE_TORCH_INDEX_URL=cu)[0] == cu
        got = setup_torch_index(
            tmp_path,
            gpu=gpu,
            PDSERVE_TORCH_INDEX_URL="pip",
            PDSERVE_TORCH_CPU_INDEX_URL=torch_index_server,
        )[0]
        assert got == ""


def test_setup_script_documents_its_torch_settings():
    text = SETUP.read_text()
    header = text.split("\nset -euo pipefail", 1)[0]
    for name in (
        "PDSERVE_TORCH_INDEX_URL",
        "PDSERVE_TORCH_CPU_INDEX_URL",
        "PDSERVE_TORCH_INDEX_PROBE_TIMEOUT",
        "https://download.pytorch.org/whl/cpu",
        "--print-torch-index",
    ):
        assert name in header, name
    readme = (ROOT / "README.md").read_text()
    assert "PDSERVE_TORCH_INDEX_URL" in readme
