#!/bin/bash
# gpu_check.sh — `make gpu-check`: the acceptance test of the CUDA backend on a machine with an NVIDIA GPU.
# Paste its output: it is the evidence that the backend works there.
#
#   ops-*       every kernel vs the CPU kernel on fresh random inputs (check_ops: float32 and bf16 activations;
#               fp32, then tf32 bounds for the float32 matmuls)
#   colls-*     every collective vs the CPU backend (check_colls): 4 ranks on one GPU bitwise; NCCL at
#               min(GPUs, 4) ranks (world 1 on one GPU) and under mpirun (nccl-mpi) within float64 bounds
#   train-NN    each solution's grading configuration on the GPU vs the CPU, within the band the grader
#               accepts between correct CPU implementations (compare_runs.py --stage NN)
#   rerun-NN    the GPU run again: bitwise equal (no atomics, sums in rank order: a difference is a race)
#   poison-NN   the GPU run without NaN-filling fresh memory: bitwise equal (a difference is a read of
#               memory nothing wrote, or poisoning racing a stream)
#   trace-NN    the GPU trace: known categories, slices of one stream never overlap, durations >= 0
#   nccl-*      the main stage on NCCL (2+ GPUs) and under mpirun (nccl-mpi) vs the CPU
#   sanitizer-* compute-sanitizer memcheck, racecheck, synccheck, initcheck on one short run (if installed)
#   grader      grade.py --solutions --cuda: every solution gets every graded point
# Every step runs under a time limit; the last line is `gpu-check: N passed, N failed` and names the failures.
#
# usage: tools/gpu_check.sh [--only PATTERN] [--list] [--out DIR] [--time-scale X]
set -u
cd "$(dirname "$0")/.." || exit 2
usage() { echo "usage: tools/gpu_check.sh [--only PATTERN] [--list] [--out DIR] [--time-scale X]"; }
ONLY="" LIST=0 OUT=${GPU_CHECK_OUT:-build-cuda/gpu-check} SCALE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --only) [ $# -ge 2 ] || { echo "gpu_check.sh: --only needs a pattern (e.g. 'train-*')"; exit 2; }; ONLY=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a directory"; exit 2; }; OUT=$2; shift 2 ;;
    --time-scale) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+([.][0-9]+)?$ ]] && [ "$2" != 0 ] ||
        { echo "gpu_check.sh: --time-scale needs a positive number"; exit 2; }; SCALE=$2; shift 2 ;;
    --list) LIST=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'"; usage; exit 2 ;;
  esac
done
if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import json' 2>/dev/null; then PYTHON=${PYTHON:-/usr/bin/python3}; else PYTHON=${PYTHON:-python3}; fi

# ------------------------------------------------------------------ the machine
NGPU=0
if [ $LIST -eq 0 ]; then
  command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-check: nvidia-smi not found: this needs a machine with an NVIDIA GPU and its driver (the CPU build needs none: make test)"; exit 2; }
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$NGPU" -ge 1 ] || { echo "gpu-check: nvidia-smi lists no GPU"; exit 2; }
  # CUDA_VISIBLE_DEVICES may hide some: the ranks get only what it leaves
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    VIS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
    [ "$VIS" -lt "$NGPU" ] && NGPU=$VIS
  fi
  for b in build-cuda/tests/check_ops build-cuda/tests/check_colls build/tests/check_colls; do
    [ -x "$b" ] || { echo "gpu-check: $b is missing: run it as make gpu-check (which builds make all and make cuda first)"; exit 2; }
  done
  rm -rf "$OUT"; mkdir -p "$OUT"
  echo "== gpu-check =="
  date -u '+date: %Y-%m-%dT%H:%M:%SZ'
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  echo "gpus used: $NGPU"
  command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -1 | sed 's/^/nvcc: /'
fi
MPIRUN=""
if command -v mpirun >/dev/null 2>&1 && grep -q HAVE_MPI build/.flags 2>/dev/null; then MPIRUN=mpirun; fi
[ -n "$MPIRUN" ] && [ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# ------------------------------------------------------------------ the steps
PASSED=0 FAILED=0 FAILS="" SKIPPED=""
# step NAME SECONDS CMD...: run CMD (a shell function or program) under a time limit, output in $OUT/NAME.log
step() {
  local name=$1 secs=$2; shift 2
  case "$name" in $ONLY) ;; *) [ -n "$ONLY" ] && return 0 ;; esac
  if [ $LIST -eq 1 ]; then echo "$name"; return 0; fi
  local t0 limit rc
  limit=$(awk -v s="$secs" -v k="$SCALE" 'BEGIN { t = int(s * k + 0.5); printf "%d", t < 1 ? 1 : t }')
  t0=$(date +%s.%N)
  # a step may be a function of this script: timeout runs it in a bash that has them (export -f below)
  timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc -eq 0 ]; then
    PASSED=$((PASSED + 1)); echo "== $name == OK (${dt}s)"
    grep -h -E '^(train|rerun|poison|trace) |^[0-9]+ (ops|collectives) passed|^Score' "$OUT/$name.log" | sed 's/^/    /'
  else
    FAILED=$((FAILED + 1)); FAILS="$FAILS $name"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "== $name == FAIL: no result within ${limit}s (a hang? log: $OUT/$name.log)"
    else echo "== $name == FAIL (exit $rc; log: $OUT/$name.log)"; fi
    grep -v '^\s*$' "$OUT/$name.log" | grep -E 'FAIL|error|rror:' | head -8 | sed 's/^/    /'
    grep -q . "$OUT/$name.log" && ! grep -q -E 'FAIL|error|rror:' "$OUT/$name.log" && tail -4 "$OUT/$name.log" | sed 's/^/    /'
  fi
}
skip() { case "$1" in $ONLY) ;; *) [ -n "$ONLY" ] && return 0 ;; esac
         [ $LIST -eq 1 ] && { echo "$1 (skipped here: $2)"; return 0; }
         SKIPPED="$SKIPPED $1"; echo "== $1 == skipped: $2"; }

W=$NGPU; [ "$W" -gt 4 ] && W=4
WL=$W; [ $LIST -eq 1 ] && { W=2; WL=N; }   # --list names the steps of a machine with N GPUs
SHORT="--steps 10 --warmup-steps 2 --profile-steps 2 --quiet"

colls_local() { build/tests/check_colls --world 4 --out "$OUT/colls_cpu_w4.txt" >/dev/null &&
                build-cuda/tests/check_colls --world 4 --ref "$OUT/colls_cpu_w4.txt" --out "$OUT/colls_local_w4.txt"; }
colls_nccl() { build/tests/check_colls --world "$1" --out "$OUT/colls_cpu_w$1.txt" >/dev/null &&
               build-cuda/tests/check_colls --backend nccl --world "$1" --ref "$OUT/colls_cpu_w$1.txt" --out "$OUT/colls_nccl_w$1.txt"; }
colls_nccl_mpi() { build/tests/check_colls --world "$1" --out "$OUT/colls_cpu_w$1.txt" >/dev/null &&
                   $MPIRUN -np "$1" build-cuda/tests/check_colls --backend nccl-mpi --ref "$OUT/colls_cpu_w$1.txt" --out "$OUT/colls_ncclmpi_w$1.txt"; }

# train_pair NN DIR FLAGS...: the CPU run and the GPU run of one configuration
train_pair() { local id=$1 dir=$2; shift 2
  build/solutions/$dir/train "$@" --out "$OUT/cpu/$dir" >/dev/null || { echo "error: the CPU run failed"; return 1; }
  build-cuda/solutions/$dir/train "$@" --out "$OUT/gpu/$dir" || { echo "error: the GPU run failed"; return 1; }
  $PYTHON tools/compare_runs.py --stage "$id" "train $dir" "$OUT/cpu/$dir" "$OUT/gpu/$dir"; }
rerun() { local dir=$1; shift
  build-cuda/solutions/$dir/train "$@" --out "$OUT/rerun/$dir" || { echo "error: the GPU rerun failed"; return 1; }
  $PYTHON tools/compare_runs.py --bitwise "rerun $dir" "$OUT/gpu/$dir" "$OUT/rerun/$dir"; }
unpoisoned() { local dir=$1; shift
  build-cuda/solutions/$dir/train "$@" --no-poison --out "$OUT/nopoison/$dir" || { echo "error: the GPU run failed"; return 1; }
  $PYTHON tools/compare_runs.py --bitwise "poison $dir" "$OUT/gpu/$dir" "$OUT/nopoison/$dir"; }
nccl_train() { local backend=$1 dir=$2; shift 2
  build/solutions/$dir/train "$@" --out "$OUT/cpu/$backend" >/dev/null || { echo "error: the CPU run failed"; return 1; }
  if [ "$backend" = nccl-mpi ]; then $MPIRUN -np "$W" build-cuda/solutions/$dir/train "$@" --backend nccl-mpi --out "$OUT/gpu/$backend"
  else build-cuda/solutions/$dir/train "$@" --backend nccl --out "$OUT/gpu/$backend"; fi || { echo "error: the GPU run failed"; return 1; }
  $PYTHON tools/compare_runs.py "$backend $dir world $W" "$OUT/cpu/$backend" "$OUT/gpu/$backend"; }
sanitize() { local tool=$1 dir=$2
  compute-sanitizer --tool "$tool" --error-exitcode 9 build-cuda/solutions/$dir/train --flavor tiny --world 2 \
    --seq-len 32 --batch-size 1 --steps 2 --warmup-steps 0 --profile-steps 1 --quiet --out "$OUT/san_$tool"; }

export OUT PYTHON MPIRUN W
export -f colls_local colls_nccl colls_nccl_mpi train_pair rerun unpoisoned nccl_train sanitize

step ops-f32 300 build-cuda/tests/check_ops
step ops-tf32 300 build-cuda/tests/check_ops --tf32
step colls-local-w4 300 colls_local
if [ "$W" -ge 2 ]; then step "colls-nccl-w$WL" 300 colls_nccl "$W"; else step colls-nccl-w1 300 colls_nccl 1; fi
if [ -n "$MPIRUN" ] || [ $LIST -eq 1 ]; then
  if [ "$W" -ge 2 ]; then step "colls-nccl-mpi-np$WL" 300 colls_nccl_mpi "$W"; else step colls-nccl-mpi-np1 300 colls_nccl_mpi 1; fi
else skip colls-nccl-mpi "mpirun not found or the build has no MPI (apt-get install openmpi-bin libopenmpi-dev, then make)"; fi

# the solutions' grading configurations: "NN dir flags..." (grader/gradelib/rubric.py stage_flags)
STAGES=$($PYTHON - <<'PY'
import os, sys
sys.path.insert(0, "grader")
import manifest
from gradelib.rubric import stage_flags
rubric = manifest.rubric()
for s in manifest.stages(rubric):
    if os.path.isfile(os.path.join("solutions", s.dir, "hw_fsdp.c")):
        print(s.id, s.dir, " ".join(stage_flags(rubric, s.id)))
PY
) || { echo "gpu-check: cannot read the stage manifest"; exit 2; }
while read -r id dir flags; do
  [ -n "$id" ] || continue
  # shellcheck disable=SC2086
  step "train-$id" 240 train_pair "$id" "$dir" $flags $SHORT
  # shellcheck disable=SC2086
  step "rerun-$id" 120 rerun "$dir" $flags $SHORT
  # shellcheck disable=SC2086
  step "poison-$id" 120 unpoisoned "$dir" $flags $SHORT
  step "trace-$id" 60 $PYTHON tools/trace_sanity.py "$OUT/gpu/$dir"
done <<< "$STAGES"

MAIN=$($PYTHON -c 'import sys; sys.path.insert(0, "grader"); import manifest; print(manifest.main_job_stage().dir)' 2>/dev/null)
NCCLF="--flavor tiny --world $W --seq-len 64 --batch-size 2 --steps 10 --warmup-steps 2 --profile-steps 2 --quiet"
if [ "$W" -ge 2 ]; then
  step "nccl-w$WL" 300 nccl_train nccl "$MAIN" $NCCLF
  if [ -n "$MPIRUN" ] || [ $LIST -eq 1 ]; then step "nccl-mpi-np$WL" 300 nccl_train nccl-mpi "$MAIN" $NCCLF
  else skip nccl-mpi "mpirun not found or the build has no MPI"; fi
else
  skip nccl-train "one GPU: --backend nccl needs one GPU per rank (colls-nccl-w1 ran NCCL at world 1)"
fi

if command -v compute-sanitizer >/dev/null 2>&1 || [ $LIST -eq 1 ]; then
  for tool in memcheck racecheck synccheck initcheck; do step "sanitizer-$tool" 400 sanitize "$tool" "$MAIN"; done
else
  skip sanitizer "compute-sanitizer not found (it ships with the CUDA toolkit: /usr/local/cuda/bin)"
fi

# grade.py exits 0 whenever grading happened: the step passes only if every solution gets every point
grade_all() { $PYTHON grader/grade.py --solutions --cuda --out "$OUT/grade" &&
  $PYTHON -c 'import json, sys
r = json.load(open(sys.argv[1]))
lost = ["stage %s: %s" % (s, ", ".join(c["name"] for c in x["checks"] if c["ok"] is False) or x["run"]["reason"])
        for s, x in sorted(r["stages"].items()) if x["points"] < x["max_points"]]
print("\n".join("error: the solution of %s" % l for l in lost) or "every solution got every graded point")
sys.exit(1 if lost else 0)' "$OUT/grade/results.json"; }
export -f grade_all
step grader 900 grade_all

[ $LIST -eq 1 ] && exit 0
echo "gpu-check: $PASSED passed, $FAILED failed${FAILS:+ (failed:$FAILS)}${SKIPPED:+; skipped:$SKIPPED}"
[ $FAILED -eq 0 ]
