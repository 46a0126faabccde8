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

# Run torchrun so that the whole job stops on Ctrl-C, SIGTERM or SIGHUP to this script. torchrun starts each
# worker in a session of its own, so a signal to the terminal's process group (or `kill -- -PGID`) reaches the
# torchrun agent but never a worker: the agent forwards SIGINT/SIGTERM/SIGHUP to its workers and waits for them,
# and SIGKILL leaves them running. Here the agent runs in its own session (`setsid`, where available), this script
# traps those signals and forwards each one, once, to the agent, and waits for it. Every process of the launch
# carries DIST_RESUME_LAUNCH_ID in its environment: workers still running once the agent has exited (it was
# SIGKILLed, or died) get SIGTERM, then SIGKILL after STOP_GRACE seconds (default 30). Exits with torchrun's
# status, or 128 + the signal's number when a signal stopped the job.
run_torchrun() {
    local id setsid_cmd=() status=0
    id="$$-$(date +%s)-$RANDOM"  # fresh: an inherited value would name processes outside this launch
    command -v setsid >/dev/null 2>&1 && setsid_cmd=(setsid)
    _agent="" _stopped_by=""
    trap '_forward INT 2' INT
    trap '_forward TERM 15' TERM
    trap '_forward HUP 1' HUP
    DIST_RESUME_LAUNCH_ID="$id" ${setsid_cmd[@]+"${setsid_cmd[@]}"} "$@" <&0 &
    _agent=$!
    if [ -n "$_stopped_by" ]; then kill -n "$_stopped_by" "$_agent" 2>/dev/null || true; fi  # came in meanwhile
    wait "$_agent" || status=$?
    while [ "$status" -gt 128 ] && kill -0 "$_agent" 2>/dev/null; do  # a trapped signal interrupted the wait
        status=0
        wait "$_agent" || status=$?
    done
    trap - INT TERM HUP
    _stop_leftovers "$id"
    if [ -n "$_stopped_by" ]; then return $((128 + _stopped_by)); fi
    return "$status"
}

_forward() {
    _stopped_by="$2"
    [ -n "$_agent" ] || return 0
    echo "launch: got SIG$1: forwarding it to torchrun (pid $_agent), which stops its workers" >&2
    kill -s "$1" "$_agent" 2>/dev/null || true
}

# The pids of processes whose environment holds DIST_RESUME_LAUNCH_ID=$1 (Linux /proc; elsewhere none).
_launch_pids() {
    local f pid
    for f in /proc/[0-9]*/environ; do
        [ -r "$f" ] || continue
        if grep -qzx -- "DIST_RESUME_LAUNCH_ID=$1" "$f" 2>/dev/null; then
            pid="${f#/proc/}"
            echo "${pid%/environ}"
        fi
    done
}

_stop_leftovers() {
    local pids left waited=0
    pids="$(_launch_pids "$1")"
    [ -n "$pids" ] || return 0
    echo "launch: torchrun exited and left worker(s) running (pids: $(echo $pids)): sending SIGTERM" >&2
    # shellcheck disable=SC2086
    kill -s TERM $pids 2>/dev/null || true
    left="$pids"
    while [ -n "$left" ] && [ "$waited" -lt "${STOP_GRACE:-30}" ]; do
        sleep 1
        waited=$((waited + 1))
        left="$(_launch_pids "$1")"
    done
    if [ -n "$left" ]; then
        echo "launch: sending SIGKILL to $(echo $left)" >&2
        # shellcheck disable=SC2086
        kill -s KILL $left 2>/dev/null || true
    fi
}
