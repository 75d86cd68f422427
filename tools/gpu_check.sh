#!/bin/sh
# gpu_check.sh — what `make gpu-check` runs on a machine with an NVIDIA GPU.
# Its output is the evidence that the CUDA backend works there; paste it.
#   1. every kernel vs the CPU kernel on fresh random inputs (build-cuda/tests/check_ops), and every
#      collective vs a float64 reference and bitwise vs the CPU build's run (build-cuda/tests/check_colls)
#   2. a short training run of every solution on the GPU vs the same run on the CPU
#      (tools/compare_runs.py: losses and grad norms within the stated tolerance)
#   3. the grader on the GPU (grader/grade.py --solutions --cuda)
# Exit status: non-zero if any part failed.
set -u
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${GPU_CHECK_OUT:-build-cuda/gpu-check}
rm -rf "$OUT"; mkdir -p "$OUT"
fail=0
echo "== gpu-check =="
date -u '+date: %Y-%m-%dT%H:%M:%SZ'
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  NGPU=$(nvidia-smi -L | grep -c '^GPU')
else
  echo "gpu: nvidia-smi not found"; NGPU=0
fi
nvcc --version | tail -1 | sed 's/^/nvcc: /'

echo "== 1. ops vs the CPU kernels =="
build-cuda/tests/check_ops || fail=1
build-cuda/tests/check_ops --tf32 || fail=1

echo "== 1b. collectives vs the CPU backend =="
# local (4 ranks on one GPU) must give the CPU's bits; nccl (one GPU per rank) the float64 bound
build/tests/check_colls --world 4 --out "$OUT/colls_cpu_w4.txt" >/dev/null || { echo "check_colls: CPU run failed"; fail=1; }
build-cuda/tests/check_colls --world 4 --ref "$OUT/colls_cpu_w4.txt" --out "$OUT/colls_local_w4.txt" || fail=1
if [ "$NGPU" -ge 2 ]; then
  W=$NGPU; [ "$W" -gt 4 ] && W=4
  build/tests/check_colls --world $W --out "$OUT/colls_cpu_w$W.txt" >/dev/null || fail=1
  build-cuda/tests/check_colls --backend nccl --world $W --ref "$OUT/colls_cpu_w$W.txt" --out "$OUT/colls_nccl_w$W.txt" || fail=1
else
  build/tests/check_colls --world 1 --out "$OUT/colls_cpu_w1.txt" >/dev/null || fail=1
  build-cuda/tests/check_colls --backend nccl --world 1 --ref "$OUT/colls_cpu_w1.txt" --out "$OUT/colls_nccl_w1.txt" || fail=1
fi
grep -h FAIL "$OUT"/colls_local_w4.txt "$OUT"/colls_nccl_w*.txt 2>/dev/null | head -20

echo "== 2. training: GPU vs CPU =="
FLAGS="--flavor tiny --world 4 --seq-len 64 --batch-size 2 --steps 10 --warmup-steps 2 --profile-steps 2 --quiet"
# the stages and their flags from the manifest: "NN dir flag ..." per line
$PYTHON grader/manifest.py list > "$OUT/stages.txt" || { echo "cannot read the stage manifest"; exit 1; }
while read -r _ s extra; do
  [ -f "solutions/$s/hw_fsdp.c" ] || continue
  build/solutions/$s/train $FLAGS $extra --out "$OUT/cpu/$s" >/dev/null || { echo "$s: CPU run failed"; fail=1; continue; }
  build-cuda/solutions/$s/train $FLAGS $extra --out "$OUT/gpu/$s" || { echo "$s: GPU run failed"; fail=1; continue; }
  $PYTHON tools/compare_runs.py "$s local world 4" "$OUT/cpu/$s" "$OUT/gpu/$s" || fail=1
done < "$OUT/stages.txt"
if [ "$NGPU" -ge 2 ]; then
  W=$NGPU; [ "$W" -gt 4 ] && W=4
  F2="--flavor tiny --world $W --seq-len 64 --batch-size 2 --steps 10 --warmup-steps 2 --profile-steps 2 --quiet"
  MAIN=$($PYTHON -c 'import sys; sys.path.insert(0, "grader"); import manifest; print(manifest.main_job_stage().dir)')
  build/solutions/$MAIN/train $F2 --out "$OUT/cpu/nccl" >/dev/null || fail=1
  build-cuda/solutions/$MAIN/train $F2 --backend nccl --out "$OUT/gpu/nccl" || fail=1
  $PYTHON tools/compare_runs.py "$MAIN nccl world $W" "$OUT/cpu/nccl" "$OUT/gpu/nccl" || fail=1
else
  echo "nccl: skipped (one GPU visible; --backend nccl needs one GPU per rank)"
fi

echo "== 3. the grader on the GPU =="
$PYTHON grader/grade.py --solutions --cuda --out "$OUT/grade" || fail=1

if [ $fail -eq 0 ]; then echo "gpu-check: PASSED"; else echo "gpu-check: FAILED"; fi
exit $fail
