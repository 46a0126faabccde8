#!/usr/bin/env bash
# One node, one process per GPU (two CPU processes without GPUs), rendezvous via --standalone.
#
#   bash launch/single_node.sh --ckpt-dir ckpt --steps 200     # trains, checkpoints; rerun: resumes
#   NPROC_PER_NODE=4 bash launch/single_node.sh --steps 1000 --amp
#
# Environment: NPROC_PER_NODE (default: visible GPUs, else 2), TORCHRUN (default: torchrun),
# TORCHRUN_ARGS (extra torchrun flags), TRAIN_SCRIPT (default: train.py next to this file).
# Every other argument goes to train.py (see `python launch/train.py --help`).
set -euo pipefail

default_nproc() {
    local n=0
    if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
        [ -n "$CUDA_VISIBLE_DEVICES" ] && n=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 2; fi
}

read -r -a torchrun <<<"${TORCHRUN:-torchrun}"
read -r -a extra <<<"${TORCHRUN_ARGS:-}"
exec "${torchrun[@]}" --standalone --nproc_per_node="${NPROC_PER_NODE:-$(default_nproc)}" ${extra[@]+"${extra[@]}"} \
    "${TRAIN_SCRIPT:-$(dirname "$0")/train.py}" "$@"
