#!/usr/bin/env bash
# One node, one process per accelerator device (two CPU processes without one), rendezvous via --standalone.
#
#   bash launch/single_node.sh --ckpt-dir ckpt --steps 200     # trains, checkpoints; rerun: resumes
#   NPROC_PER_NODE=4 bash launch/single_node.sh --steps 1000 --amp
#
# Environment: NPROC_PER_NODE (default: the accelerator's devices, else 2), TORCHRUN (default: torchrun),
# TORCHRUN_ARGS (extra torchrun flags), TRAIN_SCRIPT (default: train.py next to this file), OMP_NUM_THREADS
# (default 1). See _common.sh for what keeps the start-up quiet.
# Every other argument goes to train.py (see `python launch/train.py --help`).
# Ctrl-C, SIGTERM or SIGHUP to this script stop the whole job, workers included (see run_torchrun in
# _common.sh; STOP_GRACE: seconds before leftover workers get SIGKILL, default 30).
set -euo pipefail

# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"

run_torchrun "${torchrun[@]}" --standalone --nproc_per_node="$(nproc_per_node)" ${extra[@]+"${extra[@]}"} \
    "$train_script" "$@"
