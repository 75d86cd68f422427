#!/usr/bin/env python3
"""The solutions' overlap figures, measured: what grader/figures/overlap.json must say.

Every overlap check's bar is a share of the solution's own figure on the same run (the modelled
clock makes it one fixed number per program), so grader/figures/overlap.json keeps those figures at full
precision, beside the rubric (grader/manifest.py reads both).
After a change to the runtime's cost model, the device profile, a solution or the variants:

    tools/overlap_figures.py            grade the solutions, print the figures, exit 1 if the stored ones differ
    tools/overlap_figures.py --write    the same, and write grader/figures/overlap.json whole ("solutions" and
                                        "variants" measured, "mutants" kept)
    tools/overlap_figures.py --from D   read an existing grade.py --solutions output D instead of grading

A stage's figures list each overlap check it grades, on every run whose trace has transfers of the
kind (0 where the solution overlaps nothing: such a run is not graded on the check). The "mutants"
entries are measured by tests/test_grader.py and left as they are.
"""
import argparse
import os
import subprocess
import sys
import tempfile

from repo_paths import ROOT

import manifest
from gradelib.checks import OVERLAP_CHECKS, overlap_figures, overlap_transfers
from gradelib.context import Context
from gradelib.rubric import stage_variants
from gradelib.runner import RunResult
from gradelib.util import CheckFailed

RUBRIC = manifest.RUBRIC_PATH
ABOUT = ("What the overlap checks read (grader/gradelib/checks/overlap.py overlap_figures), per check: [the share of "
         "the compute under the transfers (graded: the bar is overlap_share_min of it on the same run), the share of "
         "the transfers' time under compute (printed)], to 10 significant digits, on the main run (solutions) and "
         "every variant (variants) whose trace has transfers of the kind; mutants: what tests/test_grader.py measures "
         "of some mutants of tests/mutants/mutants.json (kept as they are by --write). Why the bar sits there: "
         "INSTRUCTORS.md, \"The overlap bar\".")


def measure(rubric, out):
    """{"solutions": {stage: {key: [c, t]}}, "variants": {stage: {variant: {key: [c, t]}}}} from the graded runs
    under `out` (grade.py --solutions --out out)."""
    sol, var = {}, {}
    for s in manifest.stages(rubric):
        keys = [k for k in s.checks if k in OVERLAP_CHECKS]
        if not keys:
            continue
        for v in [None] + stage_variants(rubric, s.id):
            d = os.path.join(out, "stage" + s.id, v or "")
            ctx = Context(rubric, s.id, RunResult(d, True, "", 0.0, []), None, None, variant=v)
            figs = {}
            for k in keys:
                try:
                    if not overlap_transfers(ctx, k):
                        continue
                    f = overlap_figures(ctx, k)
                except CheckFailed as e:
                    sys.exit("overlap_figures.py: stage %s%s %s: %s" % (s.id, "/" + v if v else "", k, e))
                figs[k] = [float("%.10g" % f.compute_share), float("%.10g" % f.collective_share)]
            if v is None:
                sol[s.id] = figs
            elif figs:
                var.setdefault(s.id, {})[v] = figs
    return {"solutions": sol, "variants": var}


def _fmt(figs):
    return "{%s}" % ", ".join('"%s": [%s]' % (k, ", ".join("%.10g" % x for x in v)) for k, v in figs.items())


def render(measured):
    """The "solutions" and "variants" members, one run per line (what the tool prints)."""
    lines = ['"solutions": {']
    sol = measured["solutions"]
    lines += ['  "%s": %s%s' % (sid, _fmt(f), "," if i < len(sol) - 1 else "") for i, (sid, f) in enumerate(sol.items())]
    lines += ["},", '"variants": {']
    var = measured["variants"]
    for i, (sid, runs) in enumerate(var.items()):
        lines.append('  "%s": {' % sid)
        lines += ['    "%s": %s%s' % (v, _fmt(f), "," if j < len(runs) - 1 else "") for j, (v, f) in enumerate(runs.items())]
        lines.append("  }%s" % ("," if i < len(var) - 1 else ""))
    lines.append("}")
    return "\n".join(lines)


def block(rubric, measured):
    """The whole overlap_figures block: the measured solutions and variants, the stored mutants."""
    stored = rubric.get("overlap_figures") or {}
    return {"about": ABOUT, "solutions": measured["solutions"], "variants": measured["variants"],
            "mutants": stored.get("mutants", {})}


def write(rubric, measured, path=RUBRIC):
    """Write grader/figures/overlap.json (of the rubric at `path`) whole; the path written."""
    return manifest.write_figures("overlap_figures", block(rubric, measured), path)


def _flat(figs):
    """{(part, stage, run, key): [compute, transfer]} of a {"solutions": ..., "variants": ...} block (run None:
    the main run)."""
    out = {}
    for sid, f in figs.get("solutions", {}).items():
        out.update({("solutions", sid, None, k): v for k, v in f.items()})
    for sid, runs in figs.get("variants", {}).items():
        for run, f in runs.items():
            out.update({("variants", sid, run, k): v for k, v in f.items()})
    return out


def differences(rubric, measured):
    """One line per figure the rubric does not say (to 1e-9 relative)."""
    got, have = _flat(measured), _flat(rubric["overlap_figures"])
    out = []
    for key in sorted(set(got) | set(have), key=str):
        a, b = got.get(key), have.get(key)
        if a is None or b is None or any(abs(x - y) > 1e-9 * abs(y) for x, y in zip(a, b)):
            out.append("%s: measured %s, %s says %s" % (" ".join(str(x) for x in key if x), a,
                                                       manifest.FIGURES["overlap_figures"][0], b))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write grader/figures/overlap.json")
    ap.add_argument("--from", dest="src", help="a grade.py --solutions output to read instead of grading")
    args = ap.parse_args(argv)
    rubric = manifest.load(RUBRIC)
    with tempfile.TemporaryDirectory(prefix="overlap_figures.") as tmp:
        out = args.src
        if out is None:
            out = tmp
            p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--solutions", "--out", out],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if p.returncode:
                sys.exit("overlap_figures.py: grade.py failed: %s" % p.stderr.strip()[-500:])
        measured = measure(rubric, out)
    print(render(measured))
    diff = differences(rubric, measured)
    if args.write:
        print("overlap_figures.py: wrote %s" % os.path.relpath(write(rubric, measured), ROOT))
        return 0
    for line in diff:
        print("differs: " + line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
