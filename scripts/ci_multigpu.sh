#!/usr/bin/env bash
# The multi-GPU CI job, and its launch flow on the test accelerator in every CI run (.ci/run).
#
# launch/train.py under torchrun, one process per device, each on <type>:LOCAL_RANK with the device type's backend,
# checked by `dist-resume check`: an uninterrupted run, then one stopped twice (SIGKILL to the whole process tree) and
# relaunched, whose checkpoints must be bitwise equal to the uninterrupted run's at every step both folders hold.
#   With CUDA GPUs: first the CUDA tests (pytest -m "cuda or multigpu": the accelerator tests' CUDA variants), then
#   the check on cuda with nccl (from 2 GPUs) and --amp; a kill-and-resume run through launch/elastic.sh (the last rank
#   SIGKILLs itself, torchrun restarts the group, training resumes) whose newest checkpoint `dist-resume verify` finds
#   equal to the check's uninterrupted run's; a single-device run continued by every device with --init-from (single
#   card -> DDP).
#   Without: the check alone on the test accelerator (dist_resume.testing.sim: 2 simulated "sim" devices, simgloo;
#   built once, here or by the suite, and reused), `--device sim` booting it in every process of the launch; torchrun
#   restarts on sim and single card -> DDP are the suite's (tests/dist/test_ddp_accelerator.py). Where it cannot be
#   built (no C++ compiler or ninja) the check runs on 2 CPU processes with gloo and the script says why.
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
# 192 steps of 16 samples a rank, a checkpoint every 32 (6 of them, 0.1-0.3 s apart on sim: two stops, each between two
# checkpoints, and the three newest compared); 256 samples on GPUs (8 steps an epoch on 2 ranks), 128 on sim or CPU (4)
check_device=() single_env=()
if [ "$accel" != "none" ]; then
    device="$accel" nproc="${NPROC:-$count}"
    # the last rank of the elastic run dies after step 43; torchrun restarts the group, which resumes from step 32
    train=(--steps 192 --save-every 32 --num-samples 256) kill_at=43 resume_at=32 single_steps=32
    [ "$accel" = cuda ] && train+=(--amp) single_env=(CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-0}")
elif sim_env="$(PYTHONPATH=. "$PY" -c 'import shlex, sys
from tests import accelerator as a
reason = a.unavailable_reason()
if reason:
    sys.exit(reason)
print(" ".join(f"export {k}={shlex.quote(v)};" for k, v in a.worker_env(2).items()))')"; then
    # the test accelerator's built library (built once, cached: tests/accelerator/.build), for every process
    eval "$sim_env"
    device=sim nproc="${NPROC:-2}" check_device=(--device sim)
    train=(--steps 192 --save-every 32 --num-samples 128)
else  # sys.exit(reason) printed why on stderr
    echo "ci_multigpu: the test accelerator is unavailable (above); the flow runs on the CPU"
    device=cpu nproc="${NPROC:-2}"
    train=(--steps 192 --save-every 32 --num-samples 128)
fi
backend=$(case "$device" in cuda) echo nccl ;; sim) echo simgloo ;; cpu) echo gloo ;; *) echo "its own" ;; esac)
echo "ci_multigpu: accelerator $accel ($count device(s)); flow on $device with $nproc process(es), backend $backend;" \
    "JUnit in $OUT"

train+=(--device "$device" --batch-size 16 --log-every 16 --timeout 120)
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

check() {  # dist-resume check: an uninterrupted run, one stopped twice and relaunched, the checkpoints compared
    local rc=0
    TMPDIR="$WORK" "$PY" -m dist_resume check --json --keep --timeout 300 ${check_device[@]+"${check_device[@]}"} -- \
        "${torchrun[@]}" --standalone --nproc_per_node="$nproc" launch/train.py "${train[@]}" --ckpt-dir '{dir}' \
        --dump-losses '{dir}-losses' >"$WORK/check.json" || rc=$?
    "$PY" - "$WORK/check.json" "$device" "$nproc" "$rc" <<'EOF'
import json, sys
from pathlib import Path
path, device, nproc, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if rc not in (0, 1):
    sys.exit(f"dist-resume check could not check the launch (exit {rc}): its error is above")
result = json.loads(Path(path).read_text())
work = Path(result["folders"]["reference"]).parent
# every rank on its own device, in every launch: what train.py --dump-losses wrote beside each checkpoint folder
where = {json.loads(line)["device"] for f in work.glob("*-losses/rank*.jsonl") for line in f.read_text().splitlines()}
want = {f"{device}:{i}" for i in range(nproc)} if device != "cpu" else {"cpu"}
if where != want:
    sys.exit(f"the ranks trained on {sorted(where)}, expected {sorted(want)}")
walls = result["wall_seconds"]
print(f"{'exact' if result['exact'] else 'DIFFERENT'}: interrupted {result['interrupts']['done']} of "
      f"{result['interrupts']['asked']} times on {sorted(where)}; steps compared {[s['step'] for s in result['steps']]}; "
      f"check {walls['total']:.1f} s, its uninterrupted run {walls['reference']:.1f} s")
if not result["exact"]:
    sys.exit(f"the resume is not exact: {result['first_difference']}\n{result['diagnosis']}")
EOF
}

kill_and_resume() {  # the last rank SIGKILLs itself after step $kill_at; torchrun restarts; resume from $resume_at
    MAX_RESTARTS=2 NPROC_PER_NODE="$nproc" TORCHRUN="$TORCHRUN" bash launch/elastic.sh "${train[@]}" \
        --ckpt-dir "$WORK/kr" --kill-at-step "$kill_at" | tee "$WORK/kr.out"
    grep -q "SIGKILL at step $kill_at" "$WORK/kr.out"
    grep -q "resumed from $(ckpt "$WORK/kr" "$resume_at")" "$WORK/kr.out"
    local steps reference
    steps="$("$PY" -c 'import sys; a = sys.argv[1:]; print(a[a.index("--steps") + 1])' "${train[@]}")"
    reference="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["folders"]["reference"])' \
        "$WORK/check.json")"
    # model, optimizer, scheduler, scaler, step and epoch: bitwise equal to the check's uninterrupted run
    "$PY" -m dist_resume verify "$(ckpt "$reference" "$steps")" "$(ckpt "$WORK/kr" "$steps")"
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

step check check
if [ "$accel" = cuda ]; then
    step kill_and_resume kill_and_resume
    step single_card single_card
    step single_to_ddp single_to_ddp
else  # torchrun restarts and single card -> DDP on sim are tests/dist/test_ddp_accelerator.py's, in the same CI run
    echo "== kill_and_resume, single_card, single_to_ddp: on $device they are the suite's (test_ddp_accelerator.py)"
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
