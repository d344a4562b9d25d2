#!/usr/bin/env bash
# Set up pdserve in ./.venv on a fresh machine (idempotent; fast when already done).
#   scripts/setup.sh          runtime: CPU torch + pdserve[engine,nixl]
#   scripts/setup.sh --test   also the test extras and the system tools the tests drive
#                             (Chromium + ChromeDriver for the dashboard test, docker-compose
#                             to validate the compose file), installed with apt-get when root.
# GPU machines: install the CUDA torch wheel for your driver first (see README, "GPU install"),
# e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu124`, then
# `pip install -e '.[engine]'`; this script pins the CPU wheel because that is what this
# project's CI machines have.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT_TEST=0
[ "${1:-}" = "--test" ] && WANT_TEST=1
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.pdserve-setup-$( (cat pyproject.toml; echo "$TORCH_VERSION $WANT_TEST") | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==$TORCH_VERSION (CPU build)"
    .venv/bin/pip install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  extras="engine,nixl"
  [ "$WANT_TEST" = 1 ] && extras="engine,nixl,test,dev"
  echo "[setup] installing pdserve[$extras]"
  .venv/bin/pip install -q -e ".[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, shared.engine, router" >/dev/null
  rm -f .venv/.pdserve-setup-*
  touch "$stamp"
fi

if [ "$WANT_TEST" = 1 ]; then
  missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "[setup] apt-get install ${missing[*]}"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/tmp/pdserve-apt.log 2>&1 \
        || { echo "[setup] apt-get failed, see /tmp/pdserve-apt.log"; exit 1; }
    else
      echo "[setup] missing system tools: ${missing[*]} (install them to run the browser and compose tests)"
    fi
  fi
fi
