#!/usr/bin/env bash
# Several nodes, one process per accelerator device on each, c10d rendezvous at MASTER_ADDR:MASTER_PORT.
# Run the same command on every node; --ckpt-dir must be on a filesystem all nodes share.
#
#   # node 0 (10.0.0.1) and node 1, each:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash launch/multi_node.sh --ckpt-dir /shared/ckpt
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash launch/multi_node.sh --ckpt-dir /shared/ckpt
#
# Required: NNODES (a number, or MIN:MAX for elastic membership), NODE_RANK, MASTER_ADDR, MASTER_PORT.
# Optional: NPROC_PER_NODE (default: the accelerator's devices, else 2), RDZV_ID (job id shared by all nodes,
# default: $SLURM_JOB_ID or "dist_resume"), MAX_RESTARTS (default 0), TORCHRUN (default: torchrun),
# TORCHRUN_ARGS (extra torchrun flags, e.g. "--rdzv-conf=is_host=false --local-addr=127.0.0.1"),
# TRAIN_SCRIPT, OMP_NUM_THREADS (default 1). The c10d rendezvous assigns node ranks itself; NODE_RANK is passed for the record.
# The node whose address is MASTER_ADDR hosts the rendezvous store; global ranks are
# node-major and every process picks its device by LOCAL_RANK.
# Ctrl-C, SIGTERM or SIGHUP to this script stop the whole job, workers included (see run_torchrun in
# _common.sh; STOP_GRACE: seconds before leftover workers get SIGKILL, default 30).
set -euo pipefail
: "${NNODES:?set NNODES, the number of nodes}" "${NODE_RANK:?set NODE_RANK, the index of this node}"
: "${MASTER_ADDR:?set MASTER_ADDR, the address of node 0}" "${MASTER_PORT:?set MASTER_PORT, a free port on node 0}"

# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"

run_torchrun "${torchrun[@]}" --nnodes="$NNODES" --node_rank="$NODE_RANK" \
    --nproc_per_node="$(nproc_per_node)" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-dist_resume}}" --max-restarts="${MAX_RESTARTS:-0}" ${extra[@]+"${extra[@]}"} \
    "$train_script" "$@"
