#!/usr/bin/env python3
"""The solutions' overlap figures, measured: what grader/rubric.json's overlap_figures must say.

Every overlap check's bar is a share of the solution's own figure on the same run (the modelled
clock makes it one fixed number per program), so the rubric keeps those figures at full precision.
After a change to the runtime's cost model, the device profile, a solution or the variants:

    tools/overlap_figures.py            grade the solutions, print the figures, exit 1 if the rubric differs
    tools/overlap_figures.py --write    the same, and rewrite overlap_figures' "solutions" and "variants"
    tools/overlap_figures.py --from D   read an existing grade.py --solutions output D instead of grading

A stage's figures list each overlap check it grades, on every run whose trace has transfers of the
kind (0 where the solution overlaps nothing: such a run is not graded on the check). The "mutants"
entries are measured by tests/test_grader.py and left as they are.
"""
import argparse
import json
import os
import re
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

RUBRIC = os.path.join(ROOT, "grader", "rubric.json")


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


def render(measured, indent="    "):
    """The "solutions" and "variants" members as rubric.json writes them (one run per line)."""
    lines = [indent + '"solutions": {']
    sol = measured["solutions"]
    lines += ['%s  "%s": %s%s' % (indent, sid, _fmt(f), "," if i < len(sol) - 1 else "") for i, (sid, f) in enumerate(sol.items())]
    lines += [indent + "},", indent + '"variants": {']
    var = measured["variants"]
    for i, (sid, runs) in enumerate(var.items()):
        lines.append('%s  "%s": {' % (indent, sid))
        lines += ['%s    "%s": %s%s' % (indent, v, _fmt(f), "," if j < len(runs) - 1 else "") for j, (v, f) in enumerate(runs.items())]
        lines.append("%s  }%s" % (indent, "," if i < len(var) - 1 else ""))
    lines.append(indent + "},")
    return "\n".join(lines)


def write(measured, path=RUBRIC):
    text = open(path, encoding="utf-8").read()
    m = re.search(r'\n    "solutions": \{.*?\n    "variants": \{.*?\n    \},\n', text, re.S)
    if not m or '"overlap_figures"' not in text[:m.start()]:
        sys.exit("overlap_figures.py: cannot find overlap_figures' solutions/variants in %s" % path)
    new = text[:m.start()] + "\n" + render(measured) + "\n" + text[m.end():]
    json.loads(new)  # still JSON
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)


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
            out.append("%s: measured %s, rubric.json says %s" % (" ".join(str(x) for x in key if x), a, b))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite rubric.json's figures")
    ap.add_argument("--from", dest="src", help="a grade.py --solutions output to read instead of grading")
    args = ap.parse_args(argv)
    rubric = manifest.load_json(RUBRIC)
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
        write(measured)
        print("overlap_figures.py: wrote %s" % os.path.relpath(RUBRIC, ROOT))
        return 0
    for line in diff:
        print("differs: " + line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
