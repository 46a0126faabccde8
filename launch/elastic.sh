#!/usr/bin/env bash
# Fault-tolerant run: when any worker dies, torchrun stops the others and restarts the whole
# group (up to MAX_RESTARTS times); train.py then resumes from the newest checkpoint in --ckpt-dir
# (--resume auto), with the sampler position and every rank's RNG streams.
#
#   bash launch/elastic.sh --ckpt-dir ckpt --steps 1000 --save-every 50
#   MAX_RESTARTS=10 NNODES=1:4 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash launch/elastic.sh --ckpt-dir /shared/ckpt
#
# Without MASTER_ADDR it runs on this node (--standalone). With MASTER_ADDR it uses a c10d
# rendezvous (NNODES may be MIN:MAX: nodes can leave and join; each change restarts the group,
# and the new world size finishes the interrupted epoch with every sample seen once).
# Optional: MAX_RESTARTS (default 3), NPROC_PER_NODE, MASTER_PORT (default 29500), RDZV_ID,
# TORCHRUN, TORCHRUN_ARGS, TRAIN_SCRIPT, OMP_NUM_THREADS (default 1). Arguments after the script go to train.py.
# Ctrl-C, SIGTERM or SIGHUP to this script stop the whole job, workers included (see run_torchrun in
# _common.sh; STOP_GRACE: seconds before leftover workers get SIGKILL, default 30).
set -euo pipefail

# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"

if [ -n "${MASTER_ADDR:-}" ]; then
    rdzv=(--nnodes="${NNODES:-1}" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
          --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-dist_resume}}")
else
    rdzv=(--standalone)
fi
run_torchrun "${torchrun[@]}" "${rdzv[@]}" --nproc_per_node="$(nproc_per_node)" \
    --max-restarts="${MAX_RESTARTS:-3}" ${extra[@]+"${extra[@]}"} \
    "$train_script" --resume auto "$@"
