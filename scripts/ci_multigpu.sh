#!/usr/bin/env bash
# The multi-GPU CI job, and its launch flow on the test accelerator in every CI run (.ci/run).
#
# launch/train.py under torchrun, one process per device, each on <type>:LOCAL_RANK with the device type's backend:
# an uninterrupted run; a kill-and-resume run through launch/elastic.sh (the last rank SIGKILLs itself, torchrun
# restarts the group, training resumes) that must end bitwise equal to it; a single-device run continued by every
# device with --init-from (single card -> DDP).
#   With CUDA GPUs: first the CUDA tests (pytest -m "cuda or multigpu": the accelerator tests' CUDA variants), then
#   the flow on cuda with nccl (from 2 GPUs) and --amp.
#   Without: the flow alone on the test accelerator (tests/accelerator: 2 simulated "sim" devices, simgloo; built here
#   on first use), fewer steps; the accelerator tests themselves run in the main suite. Where it cannot be built (no
#   C++ compiler or ninja) the flow runs on 2 CPU processes with gloo and says why.
# Results go to JUnit XML in $CI_OUT: junit-cuda.xml (pytest, with GPUs) and junit-launch.xml (the flow, one test
# case per step, log tails on failure).
#
#   bash scripts/ci_multigpu.sh                    # CI_OUT=build/ci
#   CI_OUT=/tmp/ci NPROC=4 bash scripts/ci_multigpu.sh
#
# Environment: CI_OUT, NPROC (default: the device count, 2 on sim or CPU), PYTHON (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python}"
OUT="${CI_OUT:-build/ci}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dist_resume_ci.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
TORCHRUN="$PY -m torch.distributed.run"
read -r -a torchrun <<<"$TORCHRUN"

# what torch reports for this process: "cuda 4", "xpu 2", "none 0"
read -r accel count <<<"$("$PY" -c 'import torch
a = torch.accelerator.current_accelerator(check_available=True)
print(a.type if a else "none", torch.accelerator.device_count())')"
plugin=() single_env=()
if [ "$accel" != "none" ]; then
    device="$accel" nproc="${NPROC:-$count}"
    # 24 steps of 16 samples, 256 samples (8 steps an epoch on 2 ranks); the last rank dies after step 11
    train=(--steps 24 --save-every 8 --num-samples 256) kill_at=11 resume_at=8 single_steps=8
    [ "$accel" = cuda ] && train+=(--amp) single_env=(CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-0}")
elif sim_env="$(PYTHONPATH=. "$PY" -c 'import shlex, sys
from tests import accelerator as a
reason = a.unavailable_reason()
if reason:
    sys.exit(reason)
print(" ".join(f"export {k}={shlex.quote(v)};" for k, v in a.worker_env(2).items()))')"; then
    # the test accelerator: its built library, device count and PYTHONPATH for every process (builds once, cached)
    eval "$sim_env"
    device=sim nproc="${NPROC:-2}" plugin=(--plugin tests.accelerator.plugin)
    # as short as still proves it: 12 steps, 128 samples (4 steps an epoch on 2 ranks), killed after step 6
    train=(--steps 12 --save-every 4 --num-samples 128) kill_at=6 resume_at=4 single_steps=4
    single_env=(DIST_RESUME_SIM_DEVICES=1)
else  # sys.exit(reason) printed why on stderr
    echo "ci_multigpu: the test accelerator is unavailable (above); the flow runs on the CPU"
    device=cpu nproc="${NPROC:-2}"
    train=(--steps 12 --save-every 4 --num-samples 128) kill_at=6 resume_at=4 single_steps=4
fi
backend=$(case "$device" in cuda) echo nccl ;; sim) echo simgloo ;; cpu) echo gloo ;; *) echo "its own" ;; esac)
echo "ci_multigpu: accelerator $accel ($count device(s)); flow on $device with $nproc process(es), backend $backend;" \
    "JUnit in $OUT"

train+=(--device "$device" --batch-size 16 --log-every 4 --timeout 120 ${plugin[@]+"${plugin[@]}"})
ckpt() { printf '%s/ckpt_%08d.pt' "$1" "$2"; }
RESULTS="$WORK/results.tsv"
: >"$RESULTS"
failed=0

step() {  # step NAME COMMAND...: run it, log to $OUT/NAME.log, record the outcome for the JUnit file
    local name="$1" rc=0 start="${EPOCHREALTIME:-$(date +%s)}"
    shift
    echo "== $name"
    "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$start" "${EPOCHREALTIME:-$(date +%s)}" >>"$RESULTS"
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "   FAILED (exit $rc); last lines of $OUT/$name.log:"
        tail -n 20 "$OUT/$name.log" | sed 's/^/   | /'
    fi
}

reference() {  # fresh folders: nothing to resume at first; every rank on its own device
    "${torchrun[@]}" --standalone --nproc_per_node="$nproc" launch/train.py "${train[@]}" \
        --ckpt-dir "$WORK/ref" --dump-final "$WORK/ref.pt" --dump-losses "$WORK/ref_losses" | tee "$WORK/ref.out"
    grep -q "rank 0 of $nproc on $device" "$WORK/ref.out"
    "$PY" - "$WORK/ref_losses" "$device" "$nproc" <<'EOF'
import json, sys
from pathlib import Path
folder, device, nproc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
where = {json.loads(line)["device"] for f in folder.glob("rank*.jsonl") for line in f.read_text().splitlines()}
want = {f"{device}:{i}" for i in range(nproc)} if device != "cpu" else {"cpu"}
if where != want:
    sys.exit(f"the ranks trained on {sorted(where)}, expected {sorted(want)}")
print(f"trained on {sorted(where)}")
EOF
}

kill_and_resume() {  # the last rank SIGKILLs itself after step $kill_at; torchrun restarts; resume from $resume_at
    MAX_RESTARTS=2 NPROC_PER_NODE="$nproc" TORCHRUN="$TORCHRUN" bash launch/elastic.sh "${train[@]}" \
        --ckpt-dir "$WORK/kr" --kill-at-step "$kill_at" --dump-final "$WORK/kr.pt" | tee "$WORK/kr.out"
    grep -q "SIGKILL at step $kill_at" "$WORK/kr.out"
    grep -q "resumed from $(ckpt "$WORK/kr" "$resume_at")" "$WORK/kr.out"
}

bitwise_equal() {
    "$PY" - "$WORK/ref.pt" "$WORK/kr.pt" <<'EOF'
import sys, torch
ref, got = (torch.load(p, weights_only=True, map_location="cpu") for p in sys.argv[1:])
bad = [k for k, v in ref["model"].items() if not torch.equal(v, got["model"][k])]
for pid, state in ref["optimizer"]["state"].items():
    bad += [f"optimizer[{pid}][{k}]" for k, v in state.items() if not torch.equal(v, got["optimizer"]["state"][pid][k])]
if ref["step"] != got["step"] or bad:
    sys.exit(f"kill-and-resume differs from the uninterrupted run (step {got['step']} vs {ref['step']}): {bad}")
print(f"bitwise equal after {ref['step']} steps: {len(ref['model'])} model tensors, optimizer state")
EOF
}

single_card() {  # one process that sees one device
    env ${single_env[@]+"${single_env[@]}"} "$PY" launch/train.py "${train[@]}" --steps "$single_steps" \
        --ckpt-dir "$WORK/single" | tee "$WORK/single.out"
    grep -q "rank 0 of 1 on $device" "$WORK/single.out"
}

single_to_ddp() {
    local from
    from="$(ckpt "$WORK/single" "$single_steps")"
    "${torchrun[@]}" --standalone --nproc_per_node="$nproc" launch/train.py "${train[@]}" --steps "$single_steps" \
        --ckpt-dir "$WORK/ddp" --init-from "$from" | tee "$WORK/conv.out"
    grep -q "initialised from $from (step $single_steps of a 1-rank run)" "$WORK/conv.out"
    grep -q "done: step $single_steps" "$WORK/conv.out"
}

if [ "$accel" = cuda ]; then
    pytest_rc=0
    "$PY" -m pytest -m "cuda or multigpu" -q -p no:cacheprovider --junitxml="$OUT/junit-cuda.xml" || pytest_rc=$?
    if [ "$pytest_rc" -ne 0 ] && [ "$pytest_rc" -ne 5 ]; then  # 5: nothing selected
        failed=1
    fi
fi

step reference reference
step kill_and_resume kill_and_resume
step bitwise_equal bitwise_equal
if [ "$accel" = cuda ]; then
    step single_card single_card
    step single_to_ddp single_to_ddp
else  # single card -> DDP both ways on sim is tests/dist/test_ddp_accelerator.py's, in the same CI run
    echo "== single_card, single_to_ddp: on $device they are the suite's (tests/dist/test_ddp_accelerator.py)"
fi

"$PY" - "$RESULTS" "$OUT" "$device" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

results, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rows = [line.split("\t") for line in results.read_text().splitlines()]
suite = ET.Element("testsuite", name=f"launch-flow-{device}", tests=str(len(rows)),
                   failures=str(sum(r[1] != "0" for r in rows)))
total = 0.0
for name, rc, start, end in rows:
    seconds = float(end) - float(start)
    total += seconds
    case = ET.SubElement(suite, "testcase", classname=f"ci_multigpu.{device}", name=name, time=f"{seconds:.2f}")
    log = (out / f"{name}.log").read_text(errors="replace")[-8000:]
    if rc != "0":
        ET.SubElement(case, "failure", message=f"exit code {rc}").text = log
    ET.SubElement(case, "system-out").text = log
suite.set("time", f"{total:.2f}")
root = ET.Element("testsuites")
root.append(suite)
ET.ElementTree(root).write(out / "junit-launch.xml", encoding="utf-8", xml_declaration=True)
steps = ", ".join(f"{name} {float(end) - float(start):.1f}s" for name, _, start, end in rows)
print(f"ci_multigpu: {len(rows)} flow steps on {device}, {suite.get('failures')} failed, {total:.1f}s ({steps});"
      f" {out / 'junit-launch.xml'}")
EOF
exit "$failed"
