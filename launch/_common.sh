# Sourced by the launch scripts: how many processes per node, and how torchrun is called.

# One process per device of the accelerator torch reports (torch.accelerator.device_count(): CUDA, XPU, an NPU
# whose plugin torch loads by itself, ...; it honours CUDA_VISIBLE_DEVICES and the like); 2 CPU processes without
# one. Asking costs one `import torch` ($PYTHON, default python): set NPROC_PER_NODE to skip it.
default_nproc() {
    local n
    n=$("${PYTHON:-python}" -c 'import torch; print(torch.accelerator.device_count())' 2>/dev/null) || n=0
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 2; fi
}

# A quiet start-up. torchrun prints a banner whenever it sets OMP_NUM_THREADS itself (to 1, for more than one
# process per node), so set the same value first; export OMP_NUM_THREADS to choose another. torch warns
# "Failed to initialize NumPy" when it is imported without numpy, in the torchrun agent as well as in every
# worker; dist_resume needs no numpy, so the demo stays torch-only and ignores just that warning.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Failed to initialize NumPy:UserWarning"

# TORCHRUN (default: torchrun) and TORCHRUN_ARGS (extra flags) as arrays; processes per node; the training script.
read -r -a torchrun <<<"${TORCHRUN:-torchrun}"
read -r -a extra <<<"${TORCHRUN_ARGS:-}"
nproc_per_node() { echo "${NPROC_PER_NODE:-$(default_nproc)}"; }  # asked when a script launches, not when sourced
train_script="${TRAIN_SCRIPT:-$(dirname "${BASH_SOURCE[0]}")/train.py}"
