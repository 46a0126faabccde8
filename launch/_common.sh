# Sourced by the launch scripts: how many processes per node, and how torchrun is called.

# One process per visible GPU (CUDA_VISIBLE_DEVICES, else nvidia-smi); 2 CPU processes without GPUs.
default_nproc() {
    local n=0
    if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
        [ -n "$CUDA_VISIBLE_DEVICES" ] && n=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 2; fi
}

# A quiet start-up. torchrun prints a banner whenever it sets OMP_NUM_THREADS itself (to 1, for more than one
# process per node), so set the same value first; export OMP_NUM_THREADS to choose another. torch warns
# "Failed to initialize NumPy" when it is imported without numpy, in the torchrun agent as well as in every
# worker; dist_resume needs no numpy, so the demo stays torch-only and ignores just that warning.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Failed to initialize NumPy:UserWarning"

# TORCHRUN (default: torchrun) and TORCHRUN_ARGS (extra flags) as arrays; the training script.
read -r -a torchrun <<<"${TORCHRUN:-torchrun}"
read -r -a extra <<<"${TORCHRUN_ARGS:-}"
nproc_per_node="${NPROC_PER_NODE:-$(default_nproc)}"
train_script="${TRAIN_SCRIPT:-$(dirname "${BASH_SOURCE[0]}")/train.py}"
