#!/usr/bin/env python3
"""compare_runs.py [--stage NN | --bitwise] LABEL RUN_A RUN_B — losses and grad norms of two runs of the
same configuration, step by step (make gpu-check: RUN_A on the CPU, RUN_B on the GPU).

Tolerances (--stage NN): the ones the grader accepts between correct implementations of stage NN's grading
configuration, measured on the CPU (grader/figures/parity_spread.json: BLAS threads, CPU kernels and reorderings of
the solution) times its margin. A GPU sums in yet another order (block reductions, cuBLAS tiling), which is
one more correct implementation: measured on an H100, the GPU runs differ from the CPU ones by at most
2.1e-8 (loss) and 6.7e-8 (grad norm) relative over ten steps, inside every stage's band (>= 1.2e-6). A wrong
kernel or a missing event wait moves them by orders of magnitude more.
Without --stage: the loosest band of any stage (for configurations the rubric does not grade).

--bitwise: every step's loss and grad norm must be equal to the last bit (a rerun on the same GPU; poisoned
vs not): the local GPU backend has no atomics and sums in rank order, so any difference is a race."""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "grader"))
import manifest  # noqa: E402
from gradelib.rubric import tolerance_from_spread  # noqa: E402

METRICS = ("loss", "grad_norm")


def rows(d):
    out = []
    with open(os.path.join(d, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def rel(a, b):
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def tolerances(stage):
    """{metric: relative tolerance} of stage's main run (None: the loosest over every stage and run)."""
    ps = manifest.load()["parity_spread"]
    runs = ps["runs"]
    if stage is not None and stage not in runs:
        raise KeyError("grader/figures/parity_spread.json has no stage %s (stages: %s)" % (stage, ", ".join(sorted(runs))))
    out = {}
    for m in METRICS:
        spreads = [r[m]["spread_ref"] for r in runs[stage].values() if m in r] if stage else [
            r[m]["spread_ref"] for st in runs.values() for r in st.values() if m in r]
        out[m] = tolerance_from_spread(max(spreads), ps["margin"]) if spreads else 0.0
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", help="take the tolerances of this stage's grading configuration")
    ap.add_argument("--bitwise", action="store_true", help="every value equal to the last bit")
    ap.add_argument("label")
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    a = ap.parse_args(argv)
    try:
        tol = {m: 0.0 for m in METRICS} if a.bitwise else tolerances(a.stage)
    except (OSError, KeyError, ValueError) as e:
        print("%s: %s" % (a.label, e))
        return 2
    try:
        ra, rb = rows(a.run_a), rows(a.run_b)
    except (OSError, ValueError) as e:
        print("%s: cannot read the runs: %s" % (a.label, e))
        return 1
    if len(ra) != len(rb) or not ra:
        print("%s: %d steps vs %d steps" % (a.label, len(ra), len(rb)))
        return 1
    parts, ok = [], True
    for m in METRICS:
        if all(r.get(m) is None for r in ra) and all(r.get(m) is None for r in rb):
            continue  # --forward-only: no grad norm on either side
        if a.bitwise:
            bad = [i for i, (x, y) in enumerate(zip(ra, rb)) if x.get(m) != y.get(m) or x.get(m) is None]
            ok &= not bad
            parts.append("%s %s" % (m, "bitwise equal" if not bad else "differs from step %d" % (bad[0] + 1)))
        else:
            worst = max(rel(y.get(m), x.get(m)) for x, y in zip(ra, rb))
            ok &= worst <= tol[m]
            parts.append("%s max_rel %.2e (bound %g)" % (m, worst, tol[m]))
    print("%-34s steps %d  %s  %s" % (a.label, len(ra), "  ".join(parts), "OK" if ok else "FAIL"))
    if not ok:
        for i, (x, y) in enumerate(zip(ra, rb)):
            print("  step %d  " % (i + 1) + "  ".join("%s %r vs %r" % (m, x.get(m), y.get(m)) for m in METRICS))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
