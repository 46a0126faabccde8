#!/usr/bin/env bash
# The README's main job: launch/train.py under torchrun (2 CPU processes, or one per accelerator device) trains 120
# steps with a checkpoint every 20, is stopped as if preempted at step 60 and relaunched (it resumes from step 60);
# then the same 120 steps run uninterrupted in a second folder, and the two step-120 checkpoints are compared bit for
# bit (dist-resume verify: model, optimizer, scheduler, step). `dist-resume check` compares the RNG streams and the
# data position too, killing the job as a preemption would (docs/resume-check.md).
#
#   bash launch/demo.sh [FOLDER]     # FOLDER (default demo-ckpt) and FOLDER-reference are replaced
set -euo pipefail
here="$(dirname "$0")"
dir="${1:-demo-ckpt}"
rm -rf "$dir" "$dir-reference"
bash "$here/single_node.sh" --ckpt-dir "$dir" --steps 120 --stop-after 60
bash "$here/single_node.sh" --ckpt-dir "$dir" --steps 120
echo "demo: the same 120 steps, never interrupted, in $dir-reference"
bash "$here/single_node.sh" --ckpt-dir "$dir-reference" --steps 120 >/dev/null
echo "demo: the resumed run's step-120 checkpoint against the uninterrupted one's"
dist-resume verify "$dir/ckpt_00000120.pt" "$dir-reference/ckpt_00000120.pt"
