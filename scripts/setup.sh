#!/usr/bin/env bash
# Set up pdserve in ./.venv on a fresh machine (idempotent; fast when already done).
#   scripts/setup.sh          runtime: CPU torch + pdserve[engine,nixl]
#   scripts/setup.sh --test   also the test extras and the system tools the tests drive
#                             (Chromium + ChromeDriver for the dashboard test, docker-compose
#                             to validate the compose file), installed with apt-get when root.
#   scripts/setup.sh --print-torch-index
#                             print the index torch would be installed from (empty: pip's own
#                             configuration) and why, then exit; changes nothing
#
# Which torch (installed only when .venv has none; TORCH_VERSION pins it, default below):
#   PDSERVE_TORCH_INDEX_URL unset or `auto`: PyTorch's CPU index
#       (https://download.pytorch.org/whl/cpu, or $PDSERVE_TORCH_CPU_INDEX_URL) when it answers
#       within a few seconds: plain `pip install torch` on Linux x86_64 takes PyPI's CUDA build,
#       gigabytes of CUDA libraries a CPU machine never uses. Where it does not answer within
#       $PDSERVE_TORCH_INDEX_PROBE_TIMEOUT seconds (5; an offline machine, one that reaches only
#       its own mirror) pip's own configuration (index, --find-links, pip.conf). On a
#       machine where `nvidia-smi` sees a GPU: pip's own configuration (PyPI's CUDA build);
#       pick the CUDA version with a cuXXX index instead.
#   PDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (any index): torch from it.
#   PDSERVE_TORCH_INDEX_URL=pip: pip's own configuration (index-url, find-links, pip.conf).
# After installing, a CUDA build on a machine without nvidia-smi gets a warning.
# GPU machines can also install the CUDA torch wheel for their driver first (README, "GPU
# install"), e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu128`; an
# installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT_TEST=0
PRINT_INDEX=0
case "${1:-}" in
  "") ;;
  --test) WANT_TEST=1 ;;
  --print-torch-index) PRINT_INDEX=1 ;;
  *) echo "usage: scripts/setup.sh [--test | --print-torch-index]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=${PDSERVE_TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}
PROBE_S=${PDSERVE_TORCH_INDEX_PROBE_TIMEOUT:-5}
export PIP_DISABLE_PIP_VERSION_CHECK=1

note() { echo "[setup] $*" >&2; }

# `timeout` where coreutils has it (macOS has not): nothing here may hang on the network
bounded() {
  local s=$1
  shift
  if command -v timeout >/dev/null 2>&1; then timeout "$s" "$@"; else "$@"; fi
}

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && bounded 20 nvidia-smi -L >/dev/null 2>&1
}

# Whether a package index answers for torch within $PROBE_S seconds (name resolution included:
# the outer timeout). Proxies from the environment apply; pip's own proxy / cert settings in
# pip.conf do not (PIP_CERT does), so such a machine takes pip's configuration instead.
index_answers() {
  bounded "$((PROBE_S + 5))" "$PY" - "${1%/}/torch/" "$PROBE_S" <<'EOF' >/dev/null 2>&1
import os, ssl, sys, urllib.request

ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]), context=ctx) as r:
    r.read(1)
EOF
}

# The --index-url for torch on stdout (nothing: pip's own configuration), the reason on stderr.
torch_index() {
  local want=${PDSERVE_TORCH_INDEX_URL:-auto}
  case "$want" in
    pip)
      note "torch from pip's own configuration (PDSERVE_TORCH_INDEX_URL=pip)"
      return 0 ;;
    auto) ;;
    *)
      note "torch from $want (PDSERVE_TORCH_INDEX_URL)"
      echo "$want"
      return 0 ;;
  esac
  if has_gpu; then
    note "nvidia-smi sees a GPU: torch from pip's own configuration (PyPI: the CUDA build);" \
         "PDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 picks the CUDA version"
    return 0
  fi
  if index_answers "$CPU_INDEX"; then
    note "torch from $CPU_INDEX (the CPU build)"
    echo "$CPU_INDEX"
    return 0
  fi
  note "$CPU_INDEX does not answer (within ${PROBE_S}s): torch from pip's own" \
       "configuration (PDSERVE_TORCH_INDEX_URL names another index)"
}

pip_install() {  # pip's exit status, without its find-links noise
  .venv/bin/pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

if [ "$PRINT_INDEX" = 1 ]; then
  torch_index
  exit 0
fi

# The system tools the tests drive (apt-get, when root) install in the background while pip
# works (a minute or more each on a fresh machine); the end of this script waits for them.
apt_pid=
build_pid=
# an early exit (set -e) stops the kernel build and waits for apt-get (a killed apt-get could
# leave dpkg's lock to the next try); on the normal path both were waited for already
finish_background() {
  if [ -n "$build_pid" ]; then kill "$build_pid" 2>/dev/null || true; fi
  if [ -n "$apt_pid" ]; then wait "$apt_pid" 2>/dev/null || true; fi
}
trap finish_background EXIT
if [ "$WANT_TEST" = 1 ]; then
  missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "[setup] apt-get install ${missing[*]} (in the background, log: /tmp/pdserve-apt.log)"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
        >/tmp/pdserve-apt.log 2>&1 &
      apt_pid=$!
    else
      echo "[setup] missing system tools: ${missing[*]} (install them to run the browser and compose tests)"
    fi
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.pdserve-setup-$( (cat pyproject.toml; echo "$TORCH_VERSION $WANT_TEST") | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    index=$(torch_index)
    echo "[setup] installing torch==$TORCH_VERSION${index:+ from $index}"
    if [ -n "$index" ]; then
      if ! pip_install --index-url "$index" "torch==$TORCH_VERSION" \
          && [ "${PDSERVE_TORCH_INDEX_URL:-auto}" = auto ]; then
        note "installing from $index failed: trying pip's own configuration"
        pip_install "torch==$TORCH_VERSION" || true
      fi
    else
      pip_install "torch==$TORCH_VERSION" || true
    fi
  fi
  # The C++ CPU kernels compile (a minute or two on 2 cores) while pip installs the rest:
  # they need only torch and ninja. Whoever loads one meanwhile waits for this build
  # (kernels/prebuild.py); a failed build leaves the runtime on torch's kernels, as before.
  if pip_install "ninja>=1.11" && .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "[setup] building the C++ CPU kernels in the background (log: .venv/prebuild.log)"
    .venv/bin/python -m kernels.prebuild >.venv/prebuild.log 2>&1 &
    build_pid=$!
  fi
  extras="engine,nixl"
  [ "$WANT_TEST" = 1 ] && extras="engine,nixl,test,dev"
  echo "[setup] installing pdserve[$extras]"
  .venv/bin/pip install -q -e ".[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
  if [ -n "$build_pid" ]; then
    wait "$build_pid" || true
    build_pid=
    sed 's/^/[setup] /' .venv/prebuild.log | grep '^\[setup\] \[prebuild\]' || true
  fi
  cuda=$(.venv/bin/python -c "import torch, shared.engine, router; print(torch.version.cuda or '')")
  cuda=${cuda##*$'\n'}  # the last line: anything printed on import comes before it
  if [ -n "$cuda" ] && ! has_gpu; then
    tv=$(.venv/bin/python -c "import torch; print(torch.__version__)")
    note "WARNING: torch $tv is a CUDA $cuda build, but this machine has no NVIDIA GPU" \
         "(no working nvidia-smi): gigabytes of CUDA libraries that pdserve does not use here."
    note "For the CPU build: .venv/bin/pip uninstall -y torch &&" \
         "PDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh"
  fi
  rm -f .venv/.pdserve-setup-*
  touch "$stamp"
fi

# the system tools' apt-get ran in the background since the start: done by now, or waited for
if [ -n "$apt_pid" ]; then
  if ! wait "$apt_pid"; then
    apt_pid=
    echo "[setup] apt-get failed, see /tmp/pdserve-apt.log"
    exit 1
  fi
  apt_pid=
fi
