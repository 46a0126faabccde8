#!/usr/bin/env bash
# The multi-GPU CI job, and its CPU stand-in.
#
# With N >= 1 GPUs: the CUDA-marked tests (pytest -m "cuda or multigpu"), then launch/train.py under
# torchrun with one process per GPU (nccl from 2 GPUs, --amp): an uninterrupted run, a kill-and-resume
# run through launch/elastic.sh that must end bitwise equal to it, and a single-card -> DDP conversion
# (a one-process checkpoint continued by N processes with --init-from). Without GPUs the same flow runs
# on gloo with 2 CPU processes (about a minute on 2 cores). Results go to JUnit XML in $CI_OUT:
# junit-cuda.xml (pytest) and junit-launch.xml (the flow, one test case per step, log tails on failure).
#
#   bash scripts/ci_multigpu.sh                    # CI_OUT=build/ci
#   CI_OUT=/tmp/ci NPROC=4 bash scripts/ci_multigpu.sh
#
# Environment: CI_OUT, NPROC (default: the GPU count, else 2), PYTHON (default: python).
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

ngpu="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$ngpu" -ge 1 ]; then
    nproc="${NPROC:-$ngpu}" device=cuda extra=(--amp)
    backend=$([ "$nproc" -ge 2 ] && echo nccl || echo "none (one process)")
else
    nproc="${NPROC:-2}" device=cpu extra=()
    backend=gloo
fi
echo "ci_multigpu: $ngpu GPU(s) visible; flow on $device with $nproc process(es), backend $backend; JUnit in $OUT"

train=(--device "$device" --steps 24 --save-every 8 --batch-size 16 --num-samples 256 --log-every 8
       --timeout 120 ${extra[@]+"${extra[@]}"})  # fresh folders: nothing to resume at first
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

reference() {
    "${torchrun[@]}" --standalone --nproc_per_node="$nproc" launch/train.py "${train[@]}" \
        --ckpt-dir "$WORK/ref" --dump-final "$WORK/ref.pt"
}

kill_and_resume() {  # the last rank SIGKILLs itself after step 11; torchrun restarts; resume from step 8
    MAX_RESTARTS=2 NPROC_PER_NODE="$nproc" TORCHRUN="$TORCHRUN" bash launch/elastic.sh "${train[@]}" \
        --ckpt-dir "$WORK/kr" --kill-at-step 11 --dump-final "$WORK/kr.pt" | tee "$WORK/kr.out"
    grep -q "SIGKILL at step 11" "$WORK/kr.out"
    grep -q "resumed from .*ckpt_00000008.pt" "$WORK/kr.out"
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

single_card() {
    CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-0}" "$PY" launch/train.py "${train[@]}" --steps 8 \
        --ckpt-dir "$WORK/single"
}

single_to_ddp() {
    "${torchrun[@]}" --standalone --nproc_per_node="$nproc" launch/train.py "${train[@]}" --steps 8 \
        --ckpt-dir "$WORK/ddp" --init-from "$WORK/single/ckpt_00000008.pt" | tee "$WORK/conv.out"
    grep -q "initialised from .*ckpt_00000008.pt (step 8 of a 1-rank run)" "$WORK/conv.out"
    grep -q "done: step 8" "$WORK/conv.out"
}

pytest_rc=0
"$PY" -m pytest -m "cuda or multigpu" -q -p no:cacheprovider --junitxml="$OUT/junit-cuda.xml" || pytest_rc=$?
if [ "$pytest_rc" -ne 0 ] && [ "$pytest_rc" -ne 5 ]; then  # 5: nothing selected
    failed=1
fi

step reference reference
step kill_and_resume kill_and_resume
step bitwise_equal bitwise_equal
step single_card single_card
step single_to_ddp single_to_ddp

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
print(f"ci_multigpu: {len(rows)} flow steps, {suite.get('failures')} failed, {total:.1f}s; {out / 'junit-launch.xml'}")
EOF
exit "$failed"
