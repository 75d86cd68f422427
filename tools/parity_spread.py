#!/usr/bin/env python3
"""parity_spread.py [--write | --check] [--stage NN]... [--jobs N] — how far correct implementations spread
around the reference logs: the figures the grader's loss and grad-norm tolerances come from.

For every stage of grader/rubric.json and every run the grader grades (the main configuration and each
variant the stage lists, read from the rubric), this runs
  - the solution as the grader runs it, and again under --blas-threads 1, 2, 4 and under
    OPENBLAS_CORETYPE=Haswell, Sandybridge, Prescott (another machine's thread split and BLAS kernels);
  - every correct reordering of the solution that tests/mutants/equivalents.json lists for the stage
    (the same program but for the order of its floating-point operations), as the grader runs it;
and for each metric the run's checks compare (loss; grad_norm, which the clip check reads too) records
  spread_ref  the largest relative difference, over those runs and steps, from the reference log
              (logs/reference/stageNN[/variant]/metrics.jsonl)
  gap_base    the largest relative difference from the non-sharded baseline (build/baseline's driver, one
              rank with the global batch, run as the grader runs it)
each to 3 significant digits, with the run it came from, and, with the sweep,
  band        how far those two figures may move on another machine, whose OpenBLAS picks its own kernel: the
              largest relative difference between two runs of the same program on different machines or BLAS
              settings (the solution's runs here under each thread count and core type, and the reference log,
              which another machine may have written), plus the same between the baseline's runs under each
              core type, rounded up to 3 digits. The grader does not read it; --check does.
  grad_state_band  (grad_norm, runs whose memory snapshots hold "grad_state" notes) the same between the
              solution's runs and the reference for every number of those notes: make reference-check compares
              them within it
The grader compares a student's run with the
reference within tolerance_from_spread(spread_ref) and with the baseline within tolerance_from_spread(gap_base)
(grader/gradelib/rubric.py): the figure, never below float32's resolution 2**-23, times the margin, rounded up
to one significant digit.

  (default)  print the figures and the tolerances they give
  --write    store them in grader/figures/parity_spread.json, written whole (the stages not measured kept as
             stored; grader/rubric.json, the hand-written spec, is not touched)
  --check    exit 1 naming every run whose stored figures differ from this measurement by more than the BLAS
             band (the larger of the stored and the measured one) explains, or that has none; a figure that moved
             within the band is named as such and is no failure

Re-measure after any change to the solutions, the runtime, the equivalents or the rubric's stages and variants,
after `make reference` (spread_ref reads the reference logs). The runs go to a temporary folder (--keep DIR
keeps them there); two at a time by default (--jobs).
"""
import argparse
import concurrent.futures
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

from repo_paths import ROOT  # noqa: F401  (first: grader/ on sys.path)
import manifest
from gradelib.context import Context, read_metrics
from gradelib.rubric import (MAIN_RUN, RUBRIC_PATH, SPREAD_FLOOR, baseline_flags, load_rubric, parity_metrics,
                             parse_stage, stage_config, stage_flags, stage_variants, tolerance_from_spread)
from gradelib.runner import Runner, RunResult, classify_run, openblas_core, run_limited
from gradelib.util import CheckFailed, UsageError, one_line, rel, relpath

EQUIVALENTS = os.path.join(ROOT, "tests", "mutants", "equivalents.json")
REFERENCE = os.path.join(ROOT, "logs", "reference")
BASELINE_SRC = os.path.join(ROOT, "common", "driver", "baseline.c")
BLAS_THREADS = (1, 2, 4)
CORETYPES = ("Haswell", "Sandybridge", "Prescott")
DEFAULT_MARGIN = 10
SOLUTION = "solution"  # the label of the solution run as the grader runs it
FIGURES = (("spread_ref", "ref_by"), ("gap_base", "base_by"))
BASELINE = "baseline"  # the label of the baseline run on this machine's own BLAS kernel
GRAD_STATE = "grad_state"  # a run's gradient-state probe values (the memory snapshots' grad_state notes)
GRAD_STATE_FLOATS = ("by_module", "unsharded_grad_sumsq", "grad_shard_sumsq", "dot_previous", "dot_params")


def grad_state_values(run_dir):
    """The numbers of every rank's "grad_state" notes (probes.h: the gradient sums of squares and dot products the
    hints read, written under --grad-accum and --pp) in rank and event order, nulls kept: BLAS-dependent like the
    grad norm, and what reference-check compares them within (grad_state_band). [] when the run has none."""
    values = []

    def walk(v):
        if isinstance(v, dict):
            for k in sorted(v):
                walk(v[k])
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            values.append(v)
    rank = 0
    while True:
        path = os.path.join(run_dir, "memory_rank%d.json" % rank)
        if not os.path.exists(path):
            path += ".gz"  # a reference tree's
            if not os.path.exists(path):
                break
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as fh:
            for e in json.load(fh).get("events", []):
                if e.get("kind") == "grad_state":
                    walk({k: v for k, v in e.items() if k in GRAD_STATE_FLOATS})
        rank += 1
    return values


ABOUT = ("The loss and grad-norm tolerances, measured: per stage, run (main: the grading configuration; then each "
         "variant the stage lists) and metric, spread_ref (the largest relative difference of a correct run from the "
         "reference log) and gap_base (from the non-sharded baseline), ref_by / base_by (the run each came from), "
         "band (how far both may move under another BLAS kernel) and grad_state_band (the same for the gradient-state "
         "probes). The correct runs: the solution under --blas-threads %s and OPENBLAS_CORETYPE=%s, and the "
         "reorderings of tests/mutants/equivalents.json. The grader's tolerance is max(x, 2**-23) x margin, rounded up "
         "to one digit (grader/gradelib/rubric.py tolerance_from_spread). What each figure means and how it is "
         "measured: INSTRUCTORS.md, \"The loss and grad-norm tolerances are measured\"."
         % (", ".join(map(str, BLAS_THREADS)), ", ".join(CORETYPES)))


class Fatal(Exception):
    """What stops the measurement: one line."""


def fig3(x):
    """A figure as stored: 3 significant digits."""
    return float("%.3g" % x)


def fig3_up(x):
    """x rounded up to 3 significant digits (a band: never below what was measured)."""
    y = fig3(x)
    if y < x:
        y = fig3(y + 10 ** (math.floor(math.log10(x)) - 2))
    return y


def largest_pairwise(series):
    """The largest relative difference, over the steps, between any two of the series (lists of equal length;
    a null matches only a null)."""
    out = 0.0
    for i, a in enumerate(series):
        for b in series[i + 1:]:
            if len(a) != len(b) or any((x is None) != (y is None) for x, y in zip(a, b)):
                raise Fatal("two runs that differ only in their BLAS setting wrote different notes: not one program")
            out = max([out] + [max(rel(x, y), rel(y, x)) for x, y in zip(a, b) if x is not None])
    return out


def blas_band(band):
    """The band a comparison allows: the measured one, never below float32's resolution 2**-23 (as the grader's
    tolerances): the sweep forces OpenBLAS's kernels and thread counts, but not what else another machine
    changes in the last bits (its cache sizes, which OpenBLAS blocks its products by, or its libm)."""
    return max(band or 0.0, SPREAD_FLOOR)


def allowed_move(stored, fresh):
    """How far a figure may move between two measurements and still be the same program on other BLAS kernels:
    the larger band of the two (blas_band), plus half a unit of the 3rd digit of the larger figure (each is
    stored rounded to 3 digits)."""
    band = blas_band(max(stored.get("band") or 0.0, fresh.get("band") or 0.0))
    return band, band + 5e-3 * max(abs(stored.get("spread_ref") or 0.0), abs(stored.get("gap_base") or 0.0),
                                   abs(fresh.get("spread_ref") or 0.0), abs(fresh.get("gap_base") or 0.0))


# ------------------------------------------------------------------------------------------------ the sources

def load_equivalents(rubric, path=EQUIVALENTS):
    """The equivalents of tests/mutants/equivalents.json, checked: {name, stage, base, replace}."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        items = data["equivalents"]
        assert isinstance(items, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise Fatal("%s: cannot read its list of equivalents (%s)" % (relpath(path), one_line(str(e), 200)))
    names = set()
    for i, e in enumerate(items):
        ok = isinstance(e, dict) and all(isinstance(e.get(k), str) and e[k] for k in ("name", "stage", "base", "why"))
        ok = ok and isinstance(e.get("replace"), list) and e["replace"] and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in e["replace"])
        if not ok:
            raise Fatal("%s: equivalent %d needs name, stage, base, why and replace (pairs of texts)"
                        % (relpath(path), i))
        if e["name"] in names or e["name"] == SOLUTION or e["name"].startswith(SOLUTION + " "):
            raise Fatal("%s: the name %s is taken" % (relpath(path), e["name"]))
        names.add(e["name"])
        if e["stage"] not in rubric["stages"]:
            raise Fatal("%s: %s: stage %s is not in the rubric" % (relpath(path), e["name"], e["stage"]))
    return items


def equivalent_source(e):
    """The text of an equivalent: its base with each replacement made (each old text exactly once)."""
    base = os.path.join(ROOT, e["base"])
    try:
        with open(base, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise Fatal("equivalent %s: cannot read its base %s (%s)" % (e["name"], e["base"], err.strerror or err))
    for old, new in e["replace"]:
        n = text.count(old)
        if n != 1:
            raise Fatal("equivalent %s: a text to replace occurs %d times in %s, not once (the solution changed? "
                        "update tests/mutants/equivalents.json): %s" % (e["name"], n, e["base"], one_line(old, 120)))
        text = text.replace(old, new)
    return text


def solution_configs(sweep):
    """[(label, extra flags, environment prefix)] of the solution's runs: as the grader runs it, then (sweep)
    each BLAS thread count and core type."""
    out = [(SOLUTION, [], [])]
    if sweep:
        out += [("%s --blas-threads %d" % (SOLUTION, n), ["--blas-threads", str(n)], []) for n in BLAS_THREADS]
        out += [("%s OPENBLAS_CORETYPE=%s" % (SOLUTION, c), [], ["OPENBLAS_CORETYPE=" + c]) for c in CORETYPES]
    return out


# ------------------------------------------------------------------------------------------------ measuring

class Measurement:
    """Builds and runs everything one measurement needs in `work`, two at a time (jobs)."""

    def __init__(self, rubric, stages, sweep=True, jobs=2, work=None, keep=False, reference=REFERENCE,
                 equivalents=EQUIVALENTS, say=print):
        self.rubric, self.stages, self.sweep, self.jobs = rubric, stages, sweep, max(1, jobs)
        self.reference, self.say, self.keep = reference, say, keep
        self.equivalents = [e for e in load_equivalents(rubric, equivalents) if e["stage"] in stages]
        self.work = work
        self.limits = rubric["limits"]
        self.timeout = self.limits["run_timeout_s"]
        self.runner = Runner(self.limits, self.timeout)
        self.notes = []

    def run_list(self):
        """[(stage, variant or None)] of every graded run of the stages, main runs first in each stage."""
        return [(s, v) for s in self.stages for v in [None] + stage_variants(self.rubric, s)]

    def _build(self, name, src):
        d = os.path.join(self.work, "bin", name.replace(" ", "_"))
        os.makedirs(d, exist_ok=True)
        binary = os.path.join(d, "train")
        ok, reason, _ = self.runner.build(src, binary, os.path.join(d, "log.txt"))
        if not ok:
            raise Fatal("%s did not build: %s (log: %s)" % (name, reason, relpath(os.path.join(d, "log.txt"))))
        return binary

    def _run(self, task):
        """Run one binary into a fresh folder; {metric: [value per step]} of its metrics.jsonl."""
        name, binary, flags, env, steps, metrics = task
        d = os.path.join(self.work, "runs", re.sub(r"[^A-Za-z0-9_.=-]+", "_", name))
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        log = os.path.join(d, "log.txt")
        cmd = (["env"] + env if env else []) + [binary] + flags + ["--out", d, "--quiet"]
        rc, _ = run_limited(cmd, log, self.timeout, self.limits)
        ok, reason = classify_run(rc, log, d, self.timeout, steps, self.limits)
        if not ok:
            raise Fatal("%s failed: %s (log: %s)" % (name, one_line(reason, 300), relpath(log)))
        try:
            rows = read_metrics(os.path.join(d, "metrics.jsonl"), name)
        except CheckFailed as e:
            raise Fatal(str(e))
        if len(rows) != steps:
            raise Fatal("%s wrote %d steps, not %d (log: %s)" % (name, len(rows), steps, relpath(log)))
        out = {}
        for m in metrics:
            out[m] = [r.get(m) for r in rows]
            if any(v is None for v in out[m]):
                raise Fatal("%s: %s is missing or not finite at some step (log: %s)" % (name, m, relpath(log)))
        out[GRAD_STATE] = grad_state_values(d)
        if not self.keep:
            shutil.rmtree(d, ignore_errors=True)
        return out

    def _parallel(self, fn, items):
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            return list(pool.map(fn, items))

    def baseline_configs(self):
        """[(label, environment prefix)] of the baseline's runs: on this machine's kernel, then (sweep) each core
        type (the band of gap_base)."""
        return [(BASELINE, [])] + ([("%s OPENBLAS_CORETYPE=%s" % (BASELINE, c), ["OPENBLAS_CORETYPE=" + c])
                                    for c in CORETYPES] if self.sweep else [])

    def reference_rows(self, stage, variant):
        """The reference log's rows, checked to be recorded on the configuration the rubric grades."""
        ctx = Context(self.rubric, stage, RunResult(self.work, True, "", 0.0, []), self.reference, None,
                      variant=variant)
        try:
            return ctx.reference_metrics()
        except CheckFailed as e:
            raise Fatal("stage %s%s: %s" % (stage, "/" + variant if variant else "", e))

    def measure(self):
        """{stage: {run: {metric: {spread_ref, ref_by, gap_base, base_by}}}} (figures to 3 digits)."""
        t0 = time.monotonic()
        runs = self.run_list()
        refs = {(s, v): self.reference_rows(s, v) for s, v in runs}  # a stale reference stops us before any build
        baseline = self._build("baseline", BASELINE_SRC)  # first and alone: it brings the runtime up to date
        self.core = openblas_core(baseline)
        if self.sweep:
            for c in CORETYPES:
                got = openblas_core(baseline, c)
                if got != c:
                    self.notes.append("OPENBLAS_CORETYPE=%s is not honoured by this OpenBLAS (it runs %s): that "
                                      "run measures %s" % (c, got or "an unnamed core", got or "the default"))
        src_dir = os.path.join(self.work, "src")
        sources = [(SOLUTION + " " + s, manifest.stage(s, self.rubric).solution_src()) for s in self.stages]
        for e in self.equivalents:
            d = os.path.join(src_dir, e["name"])
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, "hw_fsdp.c")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(equivalent_source(e))
            sources.append((e["name"], path))
        for name, src in sources:
            if not os.path.isfile(src):
                raise Fatal("%s: no such file: %s" % (name, relpath(src)))
        binaries = dict(zip([n for n, _ in sources], self._parallel(lambda ns: self._build(*ns), sources)))

        tasks, keys = [], []
        base_tasks = {}
        for stage, variant in runs:
            metrics = parity_metrics(self.rubric, stage, variant)
            steps = int(stage_config(self.rubric, stage, variant)["steps"])
            where = "stage %s %s" % (stage, variant or MAIN_RUN)
            flags = stage_flags(self.rubric, stage, variant)
            configs = [(label, binaries[SOLUTION + " " + stage], extra, env)
                       for label, extra, env in solution_configs(self.sweep)]
            configs += [(e["name"], binaries[e["name"]], [], []) for e in self.equivalents if e["stage"] == stage]
            for label, binary, extra, env in configs:
                tasks.append(("%s: %s" % (where, label), binary, flags + extra, env, steps, metrics))
                keys.append((stage, variant, label))
            bflags = tuple(baseline_flags(self.rubric, stage, variant))
            for blabel, env in self.baseline_configs():
                k = (bflags, blabel)
                base_tasks.setdefault(k, ("%s %s" % (blabel, " ".join(bflags)), baseline, list(bflags), env, steps, []))
                base_tasks[k][5].extend(m for m in metrics if m not in base_tasks[k][5])
        base_keys = list(base_tasks)
        results = self._parallel(self._run, tasks + [base_tasks[k] for k in base_keys])
        got = dict(zip(keys, results[:len(tasks)]))
        bases = dict(zip(base_keys, results[len(tasks):]))
        blas_labels = [label for label, _, _ in solution_configs(self.sweep)]

        figures = {}
        for stage, variant in runs:
            run = variant or MAIN_RUN
            ref = refs[(stage, variant)]
            bflags = tuple(baseline_flags(self.rubric, stage, variant))
            base = bases[(bflags, BASELINE)]
            labels = [k[2] for k in keys if k[:2] == (stage, variant)]
            for metric in parity_metrics(self.rubric, stage, variant):
                d_ref_solution = 0.0
                want = [r.get(metric) for r in ref]
                if any(v is None for v in want):
                    raise Fatal("stage %s %s: the reference log has no %s at some step (make reference)"
                                % (stage, run, metric))
                fig = {"spread_ref": 0.0, "ref_by": SOLUTION, "gap_base": 0.0, "base_by": SOLUTION}
                for label in labels:  # in a fixed order: the first run that reaches the largest names it
                    values = got[(stage, variant, label)][metric]
                    d_ref = max(rel(g, r) for g, r in zip(values, want))
                    d_base = max(rel(g, b) for g, b in zip(values, base[metric]))
                    if label == SOLUTION and d_ref > 0:
                        d_ref_solution = d_ref
                    if fig3(d_ref) > fig["spread_ref"]:
                        fig["spread_ref"], fig["ref_by"] = fig3(d_ref), label
                    if fig3(d_base) > fig["gap_base"]:
                        fig["gap_base"], fig["base_by"] = fig3(d_base), label
                if self.sweep:  # the reference log is one more machine's run of the same program
                    fig["band"] = fig3_up(
                        largest_pairwise([want] + [got[(stage, variant, label)][metric] for label in blas_labels]) +
                        largest_pairwise([bases[(bflags, blabel)][metric] for blabel, _ in self.baseline_configs()]))
                    probes = [got[(stage, variant, label)][GRAD_STATE] for label in blas_labels]
                    if metric == "grad_norm" and probes[0]:
                        ref_probes = grad_state_values(os.path.join(self.reference, "stage" + stage, variant or ""))
                        if len(ref_probes) == len(probes[0]):
                            probes.append(ref_probes)
                        else:
                            self.notes.append("stage %s %s: the reference's grad_state notes hold %d numbers, this "
                                              "run's %d: grad_state_band leaves the reference out (make reference)"
                                              % (stage, run, len(ref_probes), len(probes[0])))
                        fig["grad_state_band"] = fig3_up(largest_pairwise(probes))
                if d_ref_solution:
                    self.notes.append(
                        "stage %s %s: the solution, run as the grader runs it, differs from the reference log (%s rel "
                        "%.2g)%s" % (stage, run, metric, d_ref_solution,
                                     ": within the BLAS band %.3g (another machine's kernel wrote it)"
                                     % blas_band(fig["band"]) if "band" in fig and
                                     d_ref_solution <= blas_band(fig["band"]) else
                                     ": is logs/reference from another machine or stale (make reference)?"))
                figures.setdefault(stage, {}).setdefault(run, {})[metric] = fig
        self.runs_done = len(tasks) + len(base_keys)
        self.seconds = time.monotonic() - t0
        return figures


# ------------------------------------------------------------------------------------------------ the rubric

def stored_block(rubric):
    block = rubric.get("parity_spread")
    return block if isinstance(block, dict) else {}


def margin_of(rubric):
    m = stored_block(rubric).get("margin")
    return m if isinstance(m, (int, float)) and not isinstance(m, bool) and m >= 1 else DEFAULT_MARGIN


def merged_block(rubric, figures):
    """The parity_spread block with the measured stages' figures replaced (stages not measured kept as stored),
    in rubric order."""
    runs = dict(stored_block(rubric).get("runs") or {})
    runs.update(figures)
    order = {s: i for i, s in enumerate(rubric["stages"])}
    runs = {s: runs[s] for s in sorted(runs, key=lambda s: (order.get(s, len(order)), s))}
    for s in figures:  # runs in rubric order: main, then the variants as the stage lists them
        names = [MAIN_RUN] + stage_variants(rubric, s)
        runs[s] = {r: runs[s][r] for r in names if r in runs[s]}
    return {"about": ABOUT, "margin": margin_of(rubric), "runs": runs}


def write_block(path, block):
    """Store the block in the measured-figures file of the rubric at `path` (grader/figures/parity_spread.json
    beside it), written whole; the path written."""
    try:
        return manifest.write_figures("parity_spread", block, path)
    except manifest.ManifestError as e:
        raise Fatal(str(e))


def differences(rubric, figures):
    """(lines naming every run whose stored figures differ from the measured ones by more than BLAS kernels
    explain (allowed_move), lines naming the figures that moved within that)."""
    runs = stored_block(rubric).get("runs") or {}
    beyond, within = [], []
    for stage, by_run in figures.items():
        for run, by_metric in by_run.items():
            for metric, fig in by_metric.items():
                stored = ((runs.get(stage) or {}).get(run) or {}).get(metric)
                if not isinstance(stored, dict):
                    beyond.append("stage %s %s %s: nothing stored, measured spread_ref %g, gap_base %g"
                                  % (stage, run, metric, fig["spread_ref"], fig["gap_base"]))
                    continue
                band, allowed = allowed_move(stored, fig)
                for key, by in FIGURES:
                    s, f = stored.get(key), fig[key]
                    if s == f:
                        continue
                    what = "stage %s %s %s: %s stored %s, measured %g (%s)" % (stage, run, metric, key, s, f, fig[by])
                    if isinstance(s, (int, float)) and not isinstance(s, bool) and abs(s - f) <= allowed:
                        within.append("%s: within the BLAS band %.3g" % (what, band))
                    else:
                        beyond.append("%s: beyond what BLAS kernels explain (band %.3g)" % (what, band))
    return beyond, within


def table(rubric, figures):
    margin = margin_of(rubric)
    lines = ["%-5s %-14s %-9s %10s %10s   %-8s %-8s  %s" % ("stage", "run", "metric", "spread_ref", "gap_base",
                                                           "tol ref", "tol base", "largest from (ref; base)")]
    for stage, by_run in figures.items():
        for run, by_metric in by_run.items():
            for metric, f in by_metric.items():
                lines.append("%-5s %-14s %-9s %10.3g %10.3g   %-8g %-8g  %s; %s" % (
                    stage, run, metric, f["spread_ref"], f["gap_base"], tolerance_from_spread(f["spread_ref"], margin),
                    tolerance_from_spread(f["gap_base"], margin), f["ref_by"], f["base_by"]))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="parity_spread.py", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="store the figures in grader/figures/parity_spread.json")
    mode.add_argument("--check", action="store_true", help="exit 1 if the stored figures differ from a fresh measurement")
    ap.add_argument("--stage", action="append", default=[], help="measure this stage only (repeatable; default all)")
    ap.add_argument("--jobs", type=int, default=2, help="builds and runs at once (default 2)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="the solution only as the grader runs it (no BLAS thread counts or core types)")
    ap.add_argument("--keep", metavar="DIR", help="build and run in DIR and keep the runs (default: a temporary folder)")
    ap.add_argument("--rubric", default=RUBRIC_PATH, help=argparse.SUPPRESS)
    ap.add_argument("--reference", default=REFERENCE, help=argparse.SUPPRESS)
    ap.add_argument("--equivalents", default=EQUIVALENTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.write and args.no_sweep:
        ap.error("--write stores the full measurement: drop --no-sweep")
    work = None
    try:
        rubric = load_rubric(args.rubric, spread=False)
        stages = sorted({parse_stage(rubric, s) for s in args.stage}) or list(rubric["stages"])
        work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="parity_spread.")
        os.makedirs(work, exist_ok=True)
        m = Measurement(rubric, stages, sweep=not args.no_sweep, jobs=args.jobs, work=work, keep=bool(args.keep),
                        reference=os.path.abspath(args.reference), equivalents=args.equivalents)
        print("measuring %d graded runs of %d stage%s: the solution%s and %d equivalent%s" % (
            len(m.run_list()), len(stages), "" if len(stages) == 1 else "s",
            " as graded and under %d BLAS settings" % (len(solution_configs(True)) - 1) if m.sweep else "",
            len(m.equivalents), "" if len(m.equivalents) == 1 else "s"), flush=True)
        figures = m.measure()
    except (UsageError, Fatal) as e:
        print("parity_spread.py: error: %s" % one_line(str(e)), file=sys.stderr)
        return 2
    finally:
        if work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for line in table(rubric, figures):
        print(line)
    for n in m.notes:
        print("note: " + n)
    print("%d runs in %.0f s (OpenBLAS core %s)" % (m.runs_done, m.seconds, m.core or "unknown"))
    stored = relpath(manifest.figures_path("parity_spread", args.rubric))
    if args.check:
        diff, moved = differences(rubric, figures)
        for line in moved:
            print("moved: " + line)
        for line in diff:
            print("differs: " + line)
        if diff:
            print("%s: the stored spread is not this measurement: tools/parity_spread.py --write" % stored)
            return 1
        print("%s: the stored spread matches%s" % (stored, " within the BLAS band (%d figure%s moved)" % (
            len(moved), "" if len(moved) == 1 else "s") if moved else ""))
    elif args.write:
        try:
            stored = relpath(write_block(args.rubric, merged_block(rubric, figures)))
        except Fatal as e:
            print("parity_spread.py: error: %s" % e, file=sys.stderr)
            return 2
        print("wrote %s (%d stage%s)" % (stored, len(figures),
                                                       "" if len(figures) == 1 else "s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
