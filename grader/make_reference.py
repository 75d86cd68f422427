#!/usr/bin/env python3
"""Rebuild logs/reference/ from solutions/ (instructors: `make reference`).

For every stage of grader/rubric.json: build solutions/NN_x/hw_fsdp.c exactly
as the grader builds a student's file, run it on the stage's grading
configuration, check it against the non-sharded baseline (a reference that
disagrees with the baseline is never written), and keep:

    metrics.jsonl run.json dtensors_rank*.json      as written
    trace.json.gz memory_rank*.json.gz memory_rank*.pickle.gz
                                                     gzip'd: the whole tree stays a few MB
    loss.png timeline.png memory.png                 when tools/plots.py and matplotlib work
    groups.png backward.png pipeline.png             the same, for a 2-D mesh / a stage 10 policy / a pipeline
                                                     (variants too)

plus stageNN/<variant>/ (metrics, run.json, DTensors and memory snapshots of each
variant the stage lists: rubric.json "variants"; a pipeline stage's variants keep
their trace.json.gz too, for the bubble check), stage05/no_ac/ (stage 04's solution on stage
05's configuration without --ac: the activation-memory check compares with it) and MANIFEST.json (the
machine, the date, the git commit, the exact command lines, every file).
The new tree replaces the old one only when everything succeeded.

    make_reference.py [--out logs/reference] [--work DIR] [--no-plots] [--stage NN]...

--stage NN (repeatable) reruns only those stages and keeps the others' folders and commands
from the tree already there (a new stage, or one whose solution changed).
"""
import argparse
import datetime
import glob
import gzip
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys

import manifest
# the grader's rubric, build and run code: references are made the way grading runs
from gradelib.checks import run_check
from gradelib.context import Context, read_metrics
from gradelib.rubric import (RUBRIC_PATH, baseline_flags, load_rubric, parity_metrics, parity_tolerances,
                             stage_config, stage_flags, stage_only_flags, stage_variants)
from gradelib.runner import Baselines, Runner, RunResult, openblas_core
from gradelib.trace_model import FACT_KEYS
from gradelib.util import ROOT, rel, relpath

PLAIN = ["metrics.jsonl", "run.json", "dtensors_rank*.json"]
GZIPPED = ["trace.json", "memory_rank*.json", "memory_rank*.pickle"]
PLOTS = ["loss.png", "timeline.png", "memory.png", "groups.png", "backward.png", "pipeline.png"]  # the last three:
# 2-D mesh / stage 10 / pipeline runs
VARIANT_PLOTS = ["groups.png", "backward.png", "pipeline.png"]  # a variant keeps only the pictures its own configuration has


def fail(msg):
    sys.stderr.write("make_reference: error: %s\n" % msg)
    sys.exit(1)


def gzip_copy(src, dst):
    """gzip with mtime 0 and no file name, so the same run gives the same bytes."""
    with open(src, "rb") as fin, open(dst, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as fout:
            shutil.copyfileobj(fin, fout)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    def git(*args):
        p = subprocess.run(["git"] + list(args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return p.stdout.decode().strip() if p.returncode == 0 else ""
    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def check_against_baseline(rubric, stage, run_dir, baselines, notes, variant=None):
    """The reference must agree with the non-sharded baseline, step by step, within the tolerance the grader
    holds a student's run to (the measured gap_base of grader/figures/parity_spread.json). A run with no
    figures yet (a new stage or variant: tools/parity_spread.py measures them against this reference, after it)
    is only noted, with its largest gap and whether that passes the round tolerances.cuda_*_rel."""
    where = stage + ("/" + variant if variant else "")
    cfg = stage_config(rubric, stage, variant)
    steps = int(cfg["steps"])
    base = baselines.get(baseline_flags(rubric, stage, variant), steps)
    if not base.ok:
        fail("the baseline run for stage %s failed: %s" % (where, base.reason))
    got = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    ref = read_metrics(os.path.join(base.dir, "metrics.jsonl"))
    if len(got) != steps or len(ref) != steps:
        fail("stage %s: %d steps in the run, %d in the baseline, %d wanted" % (where, len(got), len(ref), steps))
    measured = parity_tolerances(rubric, stage, variant)
    for key in ["loss"] + ([] if "--forward-only" in stage_only_flags(rubric, stage, variant) else ["grad_norm"]):
        if any(g.get(key) is None for g in got):
            fail("stage %s's solution logged no %s at some step; not writing a reference" % (where, key))
        gaps = [rel(g[key], b[key]) for g, b in zip(got, ref)]
        if key not in measured:
            t = rubric["tolerances"]["cuda_%s_rel" % key]
            notes.append("stage %s: no measured %s spread in rubric.json yet: the solution is %.2g off the baseline "
                         "(%s the round %g of tolerances.cuda_%s_rel); measure it: tools/parity_spread.py --write"
                         % (where, key, max(gaps), "within" if max(gaps) <= t else "MORE than", t, key))
            continue
        for g, gap in zip(got, gaps):
            if gap > measured[key][1]:
                fail("stage %s's solution disagrees with the non-sharded baseline at step %d: %s %s (rel %.1e > %g, "
                     "the tolerance of its measured gap, grader/figures/parity_spread.json); not writing a reference "
                     "(a change meant to move it: tools/parity_spread.py --write, make reference, then --write again)"
                     % (where, g["step"], key, g[key], gap, measured[key][1]))
    return base


def run_solution(rubric, stage, solution_stage, flags, work, runner, commands, variant=None):
    """Build solution_stage's hw_fsdp.c and run it with `flags` into work/<name>; returns the run dir."""
    spec = rubric["stages"][solution_stage]
    name = "stage%s" % stage if solution_stage == stage else "stage%s-with-%s" % (stage, solution_stage)
    name += "-" + variant if variant else ""
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    src = os.path.join(ROOT, "solutions", spec["dir"], "hw_fsdp.c")
    binary = os.path.join(run_dir, "train")
    log = os.path.join(run_dir, "log.txt")
    ok, reason, _ = runner.build(src, binary, log)
    if not ok:
        fail("solutions/%s: %s" % (spec["dir"], reason))
    steps = int(stage_config(rubric, stage, variant)["steps"])
    run = runner.run(binary, flags, run_dir, log, steps)
    if not run.ok:
        fail("solutions/%s on stage %s's configuration: %s (see %s)" % (spec["dir"], stage, run.reason, log))
    commands.append({"stage": stage, "variant": variant, "solution": "solutions/%s/hw_fsdp.c" % spec["dir"],
                     "build": "make impl SRC=solutions/%s/hw_fsdp.c OUT=%s" % (spec["dir"], relpath(binary)),
                     "run": " ".join(relpath(c) if os.path.isabs(c) else c for c in run.cmd)})
    return run_dir


def keep(run_dir, dest, plain, gzipped, plots, names=PLOTS):
    os.makedirs(dest, exist_ok=True)
    for pattern in plain:
        for path in sorted(glob.glob(os.path.join(run_dir, pattern))):
            shutil.copy(path, os.path.join(dest, os.path.basename(path)))
    for pattern in gzipped:
        for path in sorted(glob.glob(os.path.join(run_dir, pattern))):
            gzip_copy(path, os.path.join(dest, os.path.basename(path) + ".gz"))
    if plots:
        for name in names:
            path = os.path.join(run_dir, "plots", name)
            if os.path.exists(path):
                shutil.copy(path, os.path.join(dest, name))


def make_plots(run_dir, notes):
    tool = os.path.join(ROOT, "tools", "plots.py")
    if not os.path.exists(tool):
        notes.append("tools/plots.py does not exist: no plots")
        return False
    p = subprocess.run([sys.executable, tool, run_dir, "--out", os.path.join(run_dir, "plots")], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        last = (p.stdout.decode("utf-8", "replace").strip().splitlines() or ["?"])[-1]
        notes.append("tools/plots.py failed for %s (%s): no plots" % (relpath(run_dir), last))
        return False
    return True


README = """# Reference runs

Written by `make reference` (grader/make_reference.py) from solutions/ on the grading
configuration of grader/rubric.json; MANIFEST.json says on which machine, when, from which
commit and with which command lines. The grader compares your runs with `metrics.jsonl`
(loss, grad norm, peak memory per rank) — and with a non-sharded baseline it runs itself.

Bulky files are gzip'd to keep the tree small:
- `trace.json.gz`: Perfetto (https://ui.perfetto.dev) and chrome://tracing open it as is.
- `memory_rank<r>.pickle.gz`: `gunzip -k` it, then drag the .pickle onto https://pytorch.org/memory_viz.
- `memory_rank<r>.json.gz`: the same snapshot for scripts (`zcat`, or Python's gzip module).
"""


def reference_stage(rubric, stage, work, staging, runner, baselines, commands, notes, args):
    """Run the stage's solution (and its variants, and the no-AC run) into the staging tree, then grade
    the main run against what was just kept; returns {check: reason} of the checks it fails."""
    spec = rubric["stages"][stage]
    flags = stage_flags(rubric, stage)
    print("reference: stage %s (solutions/%s) %s" % (stage, spec["dir"], " ".join(flags)), flush=True)
    run_dir = run_solution(rubric, stage, stage, flags, work, runner, commands)
    base = check_against_baseline(rubric, stage, run_dir, baselines, notes)
    commands[-1]["baseline"] = " ".join(relpath(c) if os.path.isabs(c) else c for c in base.cmd)
    plots = not args.no_plots and make_plots(run_dir, notes)
    dest = os.path.join(staging, "stage" + stage)
    shutil.rmtree(dest, ignore_errors=True)
    keep(run_dir, dest, PLAIN, GZIPPED, plots)

    no_ac = spec.get("no_ac_reference")
    if no_ac:
        drop = set(no_ac["drop_flags"])
        flags2 = [f for f in flags if f not in drop]
        print("reference: stage %s/%s (solutions/%s) %s" % (stage, no_ac["dir"],
                                                            rubric["stages"][no_ac["solution"]]["dir"],
                                                            " ".join(flags2)), flush=True)
        run2 = run_solution(rubric, stage, no_ac["solution"], flags2, work, runner, commands)
        commands[-1]["purpose"] = "stage %s's activation-memory check: the same configuration without %s" % (
            stage, ", ".join(sorted(drop)))
        keep(run2, os.path.join(dest, no_ac["dir"]), ["metrics.jsonl", "run.json"], [], False)

    for v in stage_variants(rubric, stage):
        vflags = stage_flags(rubric, stage, v)
        print("reference: stage %s/%s %s" % (stage, v, " ".join(vflags)), flush=True)
        vrun = run_solution(rubric, stage, stage, vflags, work, runner, commands, variant=v)
        vbase = check_against_baseline(rubric, stage, vrun, baselines, notes, v)
        commands[-1]["baseline"] = " ".join(relpath(c) if os.path.isabs(c) else c for c in vbase.cmd)
        vplots = not args.no_plots and make_plots(vrun, notes)
        # a pipeline's variants keep their trace too: its bubble check compares each run's timeline with its own
        pipeline = manifest.flag_value(vflags, "--pp") is not None
        keep(vrun, os.path.join(dest, v), PLAIN, ["memory_rank*.json"] + (["trace.json"] if pipeline else []), vplots,
             VARIANT_PLOTS)

    saved = None
    if manifest.stage(stage, rubric).save:  # the main run's twin with --save, for the checkpoint's check (not kept)
        saved = runner.run_saving(os.path.join(run_dir, "train"), flags, run_dir,
                                  int(stage_config(rubric, stage)["steps"]))
        if not saved.ok:
            fail("solutions/%s with --save: %s (see %s)" % (spec["dir"], saved.reason,
                                                            os.path.join(saved.dir, "log.txt")))
    ctx = Context(rubric, stage, RunResult(run_dir, True, "", 0.0, []), staging, baselines, saved=saved)
    failed = {}
    unmeasured = set(parity_metrics(rubric, stage)) - set(ctx.parity)  # noted by check_against_baseline
    for key in spec["checks"]:
        if key in ("loss", "grad_norm", "clip") and {"clip": "grad_norm"}.get(key, key) in unmeasured:
            continue
        ok, reason, _ = run_check(ctx, key)
        if not ok:
            failed[key] = reason
    return failed


def with_facts(old, fresh):
    """old (a reference's run.json object, or a trace document) with the facts (FACT_KEYS) fresh states and old
    lacks, in fresh's key order; everything else as old has it. (old, names of the keys added)."""
    def merge(o, f, where):
        if not (isinstance(o, dict) and isinstance(f, dict)):
            return o, []
        added = [k for k in FACT_KEYS if k in f and k not in o]
        if not added:
            return o, []
        merged = {}
        for k in list(f) + [k for k in o if k not in f]:
            if k in o:
                merged[k] = o[k]
            elif k in added:
                merged[k] = f[k]
        return merged, [where + k for k in added]
    out, added = merge(old, fresh, "")
    if isinstance(out, dict) and isinstance(out.get("otherData"), dict) and isinstance(fresh, dict):
        other, more = merge(out["otherData"], fresh.get("otherData"), "otherData.")
        if more:
            out = dict(out, otherData=other)
            added += more
    return out, added


def add_facts(out, fresh_root):
    """--add-facts-from: the facts a fresh rebuild (make reference-check's tree) states, added to the run.json
    and trace.json.gz files of reference `out` that lack them; MANIFEST.json's sizes and hashes follow, with a
    note. Nothing else changes: the losses, traces and snapshots stay the machine's that wrote them."""
    with open(os.path.join(out, "MANIFEST.json")) as fh:
        record = json.load(fh)
    changed = {}
    for f in record["files"]:
        name = os.path.basename(f["path"])
        if name not in ("run.json", "trace.json.gz"):
            continue
        src, new = os.path.join(fresh_root, f["path"]), os.path.join(out, f["path"])
        if not os.path.exists(src):
            fail("--add-facts-from: %s has no %s (a rebuild of every stage: make reference-check)"
                 % (relpath(fresh_root), f["path"]))
        opener = gzip.open if name.endswith(".gz") else open
        with opener(new, "rt", encoding="utf-8") as fh:
            old = json.load(fh)
        with opener(src, "rt", encoding="utf-8") as fh:
            doc, added = with_facts(old, json.load(fh))
        if not added:
            continue
        text = json.dumps(doc, separators=(",", ":")) + "\n"
        data = gzip.compress(text.encode(), mtime=0) if name.endswith(".gz") else text.encode()
        with open(new, "wb") as fh:
            fh.write(data)
        f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        changed[f["path"]] = added
    if changed:
        keys = sorted({k for v in changed.values() for k in v})
        record["total_bytes"] = sum(f["bytes"] for f in record["files"])
        record["notes"].append("%s: the facts %s added to %d run.json / trace.json.gz files from a rebuild "
                               "(make_reference.py --add-facts-from); every other value as the reference runs wrote it"
                               % (datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                                  ", ".join(keys), len(changed)))
        with open(os.path.join(out, "MANIFEST.json"), "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
    print("added facts to %d files of %s" % (len(changed), relpath(out)))


def main():
    ap = argparse.ArgumentParser(description="Rebuild logs/reference/ from solutions/.")
    ap.add_argument("--out", default=os.path.join(ROOT, "logs", "reference"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "reference-runs"),
                    help="where the runs happen before their files are kept")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--stage", action="append", default=[],
                    help="rerun only this stage (repeatable); the others are kept from --out as they are")
    ap.add_argument("--add-facts-from", metavar="DIR",
                    help="rerun nothing: add to --out's run.json and trace.json.gz the facts (what the runtime states "
                         "it used: groups, mesh, stage map, vocabularies, rules) that the rebuild DIR has and they lack")
    args = ap.parse_args()
    if args.add_facts_from:
        return add_facts(os.path.abspath(args.out), os.path.abspath(args.add_facts_from))

    rubric = load_rubric(spread=False)  # the spreads are measured against the reference: after it
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    staging = out + ".tmp.%d" % os.getpid()
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    runner = Runner(rubric["limits"], rubric["limits"]["run_timeout_s"])
    baselines = Baselines(runner, work)
    commands, notes = [], []

    only = {manifest.stage(s, rubric).id for s in args.stage}
    old_commands = []
    if only:
        try:
            with open(os.path.join(out, "MANIFEST.json")) as fh:
                old_commands = json.load(fh).get("commands", [])
        except (OSError, ValueError):
            fail("--stage keeps the other stages from %s, which has no readable MANIFEST.json: run without --stage"
                 % relpath(out))
    for stage in sorted(rubric["stages"]):
        if only and stage not in only:
            src = os.path.join(out, "stage" + stage)
            if not os.path.isdir(src):
                fail("--stage: %s has no stage%s to keep: run without --stage" % (relpath(out), stage))
            shutil.copytree(src, os.path.join(staging, "stage" + stage))
            commands += [c for c in old_commands if c.get("stage") == stage]
            continue
        # every check reads the program's own figures (the overlap checks the modelled clock): a miss is an error
        failed = reference_stage(rubric, stage, work, staging, runner, baselines, commands, notes, args)
        if failed:
            fail("stage %s's reference fails its own checks (%s): not writing a reference"
                 % (stage, "; ".join("%s: %s" % kv for kv in failed.items())))

    with open(os.path.join(staging, "README.md"), "w") as fh:
        fh.write(README)
    commit, dirty = git_commit()
    files, total = [], 0
    for dirpath, _, names in os.walk(staging):
        for n in sorted(names):
            path = os.path.join(dirpath, n)
            with open(path, "rb") as fh:
                data = fh.read()
            files.append({"path": os.path.relpath(path, staging), "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            total += len(data)
    rubric_sha = manifest.spec_sha256(RUBRIC_PATH)
    record = {
        "written_by": "grader/make_reference.py (make reference)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
                    "os": "%s %s %s" % (platform.system(), platform.release(), platform.machine()),
                    "python": platform.python_version(),
                    # the BLAS kernels the runs used: another core type rounds differently in the last bits
                    # (make reference-check compares those values within the measured band)
                    "openblas_core": (openblas_core(baselines.built[2]) if baselines.built and baselines.built[0]
                                      else None) or "unknown",
                    "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE")},
        "backend": "local: ranks as threads of one process, CPU streams (no GPU)",
        "git_commit": commit, "git_dirty": dirty,
        "rubric_sha256": rubric_sha, "config": rubric["config"],
        "commands": commands,
        "notes": notes,
        "files": sorted(files, key=lambda f: f["path"]),
        "total_bytes": total,
    }
    with open(os.path.join(staging, "MANIFEST.json"), "w") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")

    old = out + ".old.tmp.%d" % os.getpid()
    if os.path.exists(out):
        os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)
    for n in notes:
        print("note: " + n)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print("wrote %s (%d files, %.2f MB)" % (relpath(out), len(files) + 1, size / 1e6))


if __name__ == "__main__":
    main()
