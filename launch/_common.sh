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

# TORCHRUN (default: torchrun) and TORCHRUN_ARGS (extra flags) as arrays; the training script.
read -r -a torchrun <<<"${TORCHRUN:-torchrun}"
read -r -a extra <<<"${TORCHRUN_ARGS:-}"
nproc_per_node="${NPROC_PER_NODE:-$(default_nproc)}"
train_script="${TRAIN_SCRIPT:-$(dirname "${BASH_SOURCE[0]}")/train.py}"
