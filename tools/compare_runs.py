#!/usr/bin/env python3
"""compare_runs.py LABEL CPU_RUN_DIR GPU_RUN_DIR — losses and grad norms of two
runs of the same configuration, step by step (gpu-check).

Tolerances: fp32 kernels on the GPU sum in a different order than the CPU ones
(block reductions, cuBLAS tiling), so per-op results differ by ~1e-6 relative;
ten AdamW steps amplify that, mostly through the first steps' updates where
m / sqrt(v) is near +-1. Stated bounds: loss within 1e-3 relative, grad norm
within 1e-2 relative at every step. A wrong kernel or a missing event wait
moves them by orders of magnitude more (a dropped gradient shard changes the
grad norm by > 10%)."""
import json
import math
import sys

LOSS_REL, GN_REL = 1e-3, 1e-2


def rows(d):
    out = []
    with open(d + "/metrics.jsonl") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def rel(a, b):
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def main():
    if len(sys.argv) != 4:
        print("usage: compare_runs.py LABEL CPU_RUN_DIR GPU_RUN_DIR")
        return 2
    label, cpu_dir, gpu_dir = sys.argv[1:]
    try:
        cpu, gpu = rows(cpu_dir), rows(gpu_dir)
    except (OSError, ValueError) as e:
        print("%s: cannot read the runs: %s" % (label, e))
        return 1
    if len(cpu) != len(gpu) or not cpu:
        print("%s: %d CPU steps vs %d GPU steps" % (label, len(cpu), len(gpu)))
        return 1
    worst_l = max(rel(g.get("loss"), c.get("loss")) for c, g in zip(cpu, gpu))
    has_gn = all(c.get("grad_norm") is not None for c in cpu)
    worst_g = max(rel(g.get("grad_norm"), c.get("grad_norm")) for c, g in zip(cpu, gpu)) if has_gn else 0.0
    ok = worst_l <= LOSS_REL and worst_g <= GN_REL
    print("train %-28s steps %d  loss max_rel %.2e (bound %g)  grad_norm max_rel %.2e (bound %g)  %s"
          % (label, len(cpu), worst_l, LOSS_REL, worst_g if has_gn else 0.0, GN_REL, "OK" if ok else "FAIL"))
    if not ok:
        for i, (c, g) in enumerate(zip(cpu, gpu)):
            print("  step %d  loss cpu %s gpu %s  grad_norm cpu %s gpu %s"
                  % (i + 1, c.get("loss"), g.get("loss"), c.get("grad_norm"), g.get("grad_norm")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
