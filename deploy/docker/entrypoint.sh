#!/usr/bin/env bash
# Container entrypoint of the pdserve image: `docker run IMAGE <pdserve subcommand> [flags]`.
#
# What it adds to a plain `pdserve "$@"`:
#   * prefill / decode: appends `--advertise-host <this container's IP>` unless the flags already
#     carry one, so that every replica of a scaled service registers an address the router and
#     the other workers can reach (the compose service name would resolve to all replicas).
#     The address is $PDSERVE_ADVERTISE_HOST when set, else the container hostname's IPv4.
#   * an empty `--served-model-name` becomes the last path component of `--model`, so that the
#     router and the workers agree on the name (it seeds the block hashes) without the user
#     spelling it out: MODEL=/models/Qwen2.5-7B-Instruct serves "Qwen2.5-7B-Instruct".
#   * $PDSERVE_EXTRA_ARGS: appended to any pdserve subcommand, split on whitespace (no globbing),
#     so compose users can add engine flags without rewriting `command:`.
#   * $PDSERVE_GPU_CLAIM_DIR (GPU services): each worker takes one GPU for itself by holding an
#     flock on `<dir>/<gpu uuid>.lock` for its lifetime and exports CUDA_VISIBLE_DEVICES to that
#     GPU. Docker gives `count: N` device requests the first N GPUs, so without this every
#     replica of `--scale decode=4` would land on GPU 0. $PDSERVE_GPUS (e.g. "0,1") limits the
#     GPUs this service may claim. Skipped when CUDA_VISIBLE_DEVICES is set.
#   * empty UCX_* variables are removed, so that `UCX_TLS: ${UCX_TLS:-}` in docker-compose.yml
#     leaves the choice to UCX (and to kvtransfer's defaults) when the user did not set it.
#   * PDSERVE_ENTRYPOINT_DRY_RUN=1 prints the final command (one argument per line) and the
#     chosen CUDA_VISIBLE_DEVICES instead of running it (a GPU claimed for it is let go on exit).
# Anything that is not a pdserve subcommand (`bash`, `python ...`) is executed as given.
set -euo pipefail

log() { echo "[entrypoint] $*" >&2; }

for var in $(env | sed -n 's/^\(UCX_[A-Za-z0-9_]*\)=$/\1/p'); do
  unset "$var"
done

case "${1:-}" in
  up|router|prefill|decode|bench|make-tiny-model) ;;
  ""|-*|fuzz|chaos|quantize) exec pdserve "$@" ;;  # `docker run IMAGE --help`, the tools
  *) exec "$@" ;;
esac

role=$1
args=("$@")

if [ -n "${PDSERVE_EXTRA_ARGS:-}" ]; then
  set -f
  # shellcheck disable=SC2206  # word splitting is the point
  extra=(${PDSERVE_EXTRA_ARGS})
  set +f
  args+=("${extra[@]}")
fi

flag_value() {
  local want=$1 i
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [ "${args[i]}" = "$want" ] && [ $((i + 1)) -lt ${#args[@]} ]; then
      echo "${args[i + 1]}"; return 0
    fi
    if [ "${args[i]%%=*}" = "$want" ] && [ "${args[i]}" != "$want" ]; then
      echo "${args[i]#*=}"; return 0
    fi
  done
  return 1
}

# Fill an empty `--served-model-name` (or `--served-model-name=`) with basename(--model).
default_served_name() {
  local i model name
  model=$(flag_value --model) || return 0
  model=${model%/}
  name=${model##*/}
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [ "${args[i]}" = --served-model-name ] && [ $((i + 1)) -lt ${#args[@]} ] \
        && [ -z "${args[i + 1]}" ]; then
      args[i + 1]=$name
    elif [ "${args[i]}" = --served-model-name= ]; then
      args[i]="--served-model-name=$name"
    fi
  done
}
default_served_name

has_flag() {
  local want=$1 a
  for a in "${args[@]}"; do
    if [ "$a" = "$want" ] || [ "${a%%=*}" = "$want" ]; then return 0; fi
  done
  return 1
}

own_ipv4() {
  python3 - <<'EOF'
import socket
try:
    print(socket.gethostbyname(socket.gethostname()))
except OSError:
    pass
EOF
}

# UUIDs of the GPUs this worker may claim: all visible ones, or those PDSERVE_GPUS names
# (comma-separated indices as nvidia-smi numbers them, or UUIDs), in that order.
gpu_pool() {
  local table want idx uuid
  table=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader | tr -d ' ')
  if [ -z "${PDSERVE_GPUS:-}" ]; then
    echo "$table" | cut -d, -f2
    return
  fi
  for want in $(echo "$PDSERVE_GPUS" | tr ',' ' '); do
    while IFS=, read -r idx uuid; do
      if [ "$want" = "$idx" ] || [ "$want" = "$uuid" ]; then echo "$uuid"; fi
    done <<<"$table"
  done
}

claim_gpu() {
  local dir=$1 uuids uuid wait_s deadline
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    log "PDSERVE_GPU_CLAIM_DIR is set but nvidia-smi is missing: is the NVIDIA container toolkit" \
        "installed and the service given a GPU (deploy.resources.reservations.devices)?"
    exit 1
  fi
  uuids=$(gpu_pool)
  if [ -z "$uuids" ]; then
    log "no GPU to claim: nvidia-smi lists none${PDSERVE_GPUS:+ of PDSERVE_GPUS=$PDSERVE_GPUS}"
    exit 1
  fi
  mkdir -p "$dir"
  wait_s=${PDSERVE_GPU_CLAIM_WAIT:-60}
  deadline=$(( $(date +%s) + wait_s ))
  while :; do
    for uuid in $uuids; do
      # fd 9 stays open across `exec pdserve`, so the lock lives exactly as long as the worker.
      exec 9<>"$dir/$uuid.lock"
      if flock -n 9; then
        printf '%s pid %s\n' "$HOSTNAME" "$$" >"$dir/$uuid.lock"  # who holds it, for people
        export CUDA_VISIBLE_DEVICES=$uuid
        log "claimed GPU $uuid"
        return 0
      fi
      exec 9>&-
    done
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "all $(echo "$uuids" | wc -l) GPUs visible here are held by other pdserve workers" \
          "(waited ${wait_s}s); scale the worker services down or add GPUs"
      exit 1
    fi
    sleep 2
  done
}

if [ "$role" = prefill ] || [ "$role" = decode ]; then
  if ! has_flag --advertise-host; then
    host=${PDSERVE_ADVERTISE_HOST:-$(own_ipv4)}
    case "$host" in
      ""|127.*|localhost)
        log "cannot find a routable address for this container (got '${host}');" \
            "set PDSERVE_ADVERTISE_HOST or pass --advertise-host"
        exit 1 ;;
    esac
    args+=(--advertise-host "$host")
  fi
  if [ -n "${PDSERVE_GPU_CLAIM_DIR:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    claim_gpu "$PDSERVE_GPU_CLAIM_DIR"
  fi
fi

if [ "${PDSERVE_ENTRYPOINT_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' pdserve "${args[@]}"
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
  exit 0
fi
exec pdserve "${args[@]}"
