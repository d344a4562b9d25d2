#!/usr/bin/env bash
# One-shot `model-init` service: make sure $MODEL is a model directory before the workers start.
#
#   * $MODEL has a config.json: nothing to do (a real model you mounted, or a tiny model made
#     by an earlier run into the same volume).
#   * $MODEL is the built-in tiny model path ($PDSERVE_TINY_MODEL, default /models/tiny-llama)
#     and is missing: write it with `pdserve make-tiny-model` (random weights, offline, a few
#     seconds), into a temporary directory first so that a crash never leaves half a model.
#   * anything else is missing: fail with a message saying how to mount a model.
set -euo pipefail

# The cluster secret every member proves (docs/deploy.md, Security), in the `secrets` volume
# that the router and the workers mount read-only (--cluster-secret-file, which wins over the
# variable): $PDSERVE_CLUSTER_SECRET when set (written each time: the file holds the secret in
# force), else made once, random. Skipping the file when the variable was set left every
# member failing to start on a fresh volume, and an old file overriding it on a used one.
secret=${PDSERVE_CLUSTER_SECRET_FILE:-}
if [ -n "$secret" ] && [ -n "${PDSERVE_CLUSTER_SECRET:-}" ]; then
  (umask 077 && printf '%s\n' "$PDSERVE_CLUSTER_SECRET" > "$secret.tmp")
  mv "$secret.tmp" "$secret"
  echo "[model-init] wrote PDSERVE_CLUSTER_SECRET to $secret"
elif [ -n "$secret" ] && [ ! -s "$secret" ]; then
  (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > "$secret.tmp")
  mv "$secret.tmp" "$secret"
  echo "[model-init] wrote a new cluster secret to $secret"
fi

model=${MODEL:-/models/tiny-llama}
tiny=${PDSERVE_TINY_MODEL:-/models/tiny-llama}

if [ -f "$model/config.json" ]; then
  echo "[model-init] using $model"
  exit 0
fi

if [ "$model" != "$tiny" ]; then
  echo "[model-init] MODEL=$model has no config.json inside the container." >&2
  echo "[model-init] Mount the directory that holds it at /models (MODELS_DIR=/host/dir)" >&2
  echo "[model-init] and set MODEL=/models/<name>, or unset MODEL to serve the tiny test model." >&2
  ls -la "$(dirname "$model")" >&2 || true
  exit 1
fi

tmp="$(dirname "$tiny")/.$(basename "$tiny").tmp-$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
pdserve make-tiny-model "$tmp"
mv "$tmp" "$tiny"
trap - EXIT
echo "[model-init] wrote the tiny test model to $tiny"
