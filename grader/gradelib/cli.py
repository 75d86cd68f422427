"""grade.py's command line: the arguments, the grading of each stage, the printed lines, results.json.

Every line goes through say(), so that grading goes on whatever happens to stdout; the
results file is written whatever the score. Exit status: 0 whenever grading happened,
2 for a usage error (one line on stderr: "grade.py: error: ...").
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import manifest

from .checks import CHECKS, run_check
from .context import Context
from .rubric import (RUBRIC_PATH, load_rubric, parse_stage, stage_config, stage_flags, stage_variants,
                     variant_label)
from .runner import (RUNTIME_ERROR, Baselines, Runner, RunResult, Sandbox, reachable_temp_dir, sandbox_reach_error,
                     unreachable_by_others)
from .util import NOT_GRADED, ROOT, UsageError, fmt_points, one_line, relpath


def say(line, stream=None):
    """One line to stream (stdout), flushed at once: progress shows while the next run is on its way."""
    stream = stream or sys.stdout
    try:
        try:
            stream.write(line + "\n")
        except UnicodeEncodeError:  # a terminal that is not UTF-8 and a name that is not ASCII
            stream.write(line.encode("ascii", "backslashreplace").decode("ascii") + "\n")
        stream.flush()
    except BrokenPipeError:  # `grade.py | head`: keep grading (the results file still gets written)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())


# Why grade.py --cuda leaves the clock checks (Check.clock: overlap, the pipeline bubble) out of the score,
# measured on an H100 (make gpu-check): the ranks share one GPU, so their kernels take turns on it; a
# collective is device copies that take microseconds; at the grading size the host's kernel launches pace the
# GPU. The solution itself reads 0.0% of its compute under an all-gather (3.8% at the 1B flavour, sequence
# 512), and stage 11's solution a 56% pipeline bubble where its schedule idles 38% on the modelled clock.
# A GPU's clock there says nothing about the schedule; the modelled clock judges it the same on every run.
GPU_CLOCK_NOT_GRADED = ("on one GPU the ranks' kernels take turns and kernel launches pace the GPU at the grading "
                        "size, so its clock says nothing about your schedule (the solution itself reads 0.0% "
                        "overlap there): grade.py without --cuda judges this on the modelled clock")


def not_graded(key, cuda):
    """Why the check `key` is left out of the score on this backend, or None if it is graded."""
    return GPU_CLOCK_NOT_GRADED if cuda and CHECKS[key].clock else None


def grade_stage(rubric, stage, src, out_root, ref_root, runner, baselines):
    """Build, run and check one stage; prints its lines and returns its result dict.

    The binary runs on the grading configuration and then on each of the stage's variants
    (rubric.json "variants": another world, other flags) into run_dir/<variant>; a check a
    variant lists, or one graded on every run (checks/ variants="every": the overlap checks, the host
    waits), passes only if it passes on the main run and on every such variant."""
    spec = rubric["stages"][stage]
    run_dir = os.path.join(out_root, "stage" + stage)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log_path = os.path.join(run_dir, "log.txt")
    binary = os.path.join(run_dir, "train")
    prefix = "== stage %s ==" % stage
    variants = stage_variants(rubric, stage)

    t0 = time.monotonic()
    extra = {}
    saved = None  # the run with --save (rubric "save"), after the main run and its variants
    try:
        if not os.path.exists(src):
            run = RunResult(run_dir, False, "no such file: %s" % relpath(src), 0.0, [])
        else:
            ok, reason, build_s = runner.build(src, binary, log_path)
            if ok:
                one_stream = not manifest.stage(stage, rubric).streams
                run = runner.run(binary, stage_flags(rubric, stage), run_dir, log_path,
                                 int(stage_config(rubric, stage)["steps"]), one_stream)
                for v in (variants if run.ok else []):  # a failed main run already fails every check
                    vdir = os.path.join(run_dir, v)
                    os.makedirs(vdir)
                    extra[v] = runner.run(binary, stage_flags(rubric, stage, v), vdir, os.path.join(vdir, "log.txt"),
                                          int(stage_config(rubric, stage, v)["steps"]), one_stream)
                if run.ok and manifest.stage(stage, rubric).save:
                    saved = runner.run_saving(binary, stage_flags(rubric, stage), run_dir,
                                              int(stage_config(rubric, stage)["steps"]), one_stream)
            else:
                run = RunResult(run_dir, False, reason, build_s, [])
    except (OSError, subprocess.SubprocessError) as e:  # make or the binary could not even be started
        run = RunResult(run_dir, False, "could not build or run: %s" % e, 0.0, [])
    run_s = time.monotonic() - t0
    run.reason = one_line(run.reason)  # it quotes the student's log: one printable line
    # the runs' lines, said once the checks are graded: a 'most likely cause' line goes first
    runs_said = ["%s %s: %s (%.1fs; log: %s)" % (prefix, relpath(src), "built and ran" if run.ok else "run FAILED",
                                                  run_s, relpath(log_path))]
    if not run.ok:
        runs_said.append("    " + run.reason)
    for v, r in extra.items():
        r.reason = one_line(r.reason)
        runs_said.append("%s   also on %s: %s%s" % (
            prefix, variant_label(rubric, v, stage), "ran" if r.ok else "run FAILED",
            "" if r.ok else " (log: %s)" % relpath(os.path.join(r.dir, "log.txt"))))
        if not r.ok:
            runs_said.append("    " + r.reason)

    ctx = Context(rubric, stage, run, ref_root, baselines, cuda=runner.cuda, saved=saved)
    vctx = {v: Context(rubric, stage, r, ref_root, baselines, cuda=runner.cuda, variant=v) for v, r in extra.items()}
    checks = []
    # the checks a failed run leaves ungraded, per run (None: the main run): said in one line after the others,
    # the run's reason having been said once above
    ungraded = {}
    said = {}  # key -> (the check's line, the line under it): the checks said on lines of their own
    failed_by = {}  # key of a failed check -> why: FAILED_ITSELF, or the run that failed (None: the main run)
    failed_at = {}  # key of a failed check -> the first step its failure shows in (CheckFailed.step) or None
    for key, points in spec["checks"].items():
        name = CHECKS[key].label
        skip = not_graded(key, runner.cuda)
        if skip:
            checks.append({"key": key, "name": name, "ok": None, "points": 0, "max_points": 0,
                           "reason": skip, "detail": "", "seconds": 0.0})
            continue
        t1 = time.monotonic()
        ok, reason, detail = _grade_check(ctx, key)
        failed_at[key] = ctx.failed_at.get(key)
        on_partial = _grade_on_partial(ctx, key)
        # a failed run's check goes on the one "not graded" line below, not its own, unless its partial record
        # fails it: that reason is said (it may name what the runtime error is a symptom of)
        said_below = not run.ok and not (on_partial and not on_partial[0])
        if not run.ok:
            # a check that fails on what the run wrote before it failed may name its cause (lead_order)
            failed_by[key] = (JUDGED_ON_FILES if reason.startswith(FAILS_ON_FILES) or (on_partial and not on_partial[0])
                              else None)
        if said_below:
            ungraded.setdefault(None, []).append(name + (
                " (the files the run wrote before failing pass it)" if reason == PASSES_ON_FILES else
                " (the files the run wrote before failing FAIL it: %s)" % reason[len(FAILS_ON_FILES):]
                if reason.startswith(FAILS_ON_FILES) else
                " (its record up to the runtime error passes it)" if on_partial else ""))
        if on_partial:
            reason = on_partial[1]
        for v, c in vctx.items():
            if ok and (key in rubric["variants"][v]["checks"] or CHECKS[key].variants == "every"):
                ok, why, _ = _grade_check(c, key)
                failed_at[key] = c.failed_at.get(key)
                reason = "" if ok else why if not c.run.ok else "on %s: %s" % (c.label, why)
                if not c.run.ok and not ok:
                    said_below = True
                    failed_by[key] = v
                    ungraded.setdefault(v, []).append(name)
        if not ok:
            failed_by.setdefault(key, FAILED_ITSELF)
        seconds = time.monotonic() - t1
        if not said_below:
            said[key] = ("%s %s: %s (%.1fs)" % (prefix, name, "OK" if ok else "FAIL", seconds),
                         "    " + (reason if not ok else detail) if not ok or detail else None)
        checks.append({"key": key, "name": name, "ok": ok, "points": points if ok else 0, "max_points": points,
                       "reason": reason, "detail": detail, "seconds": round(seconds, 3)})
        if on_partial:
            checks[-1]["partial"] = True  # judged on the partial record of a run stopped by a runtime error
    order = lead_order(failed_by, failed_at, list(spec["checks"]), run, extra)
    lead = order[0] if order else None
    if len(order) > 1:  # at the top of the stage's result
        on_files = {c["key"]: c["reason"][len(FAILS_ON_FILES):] for c in checks
                    if c["reason"].startswith(FAILS_ON_FILES)}
        say("%s most likely cause: %s" % (prefix, _lead_line(lead, order, rubric, on_files, stage)))
    for line in runs_said:
        say(line)
    # the failed checks first, the one that names the cause leading; then those that passed, in the rubric's order
    for key in [k for k in order if k in said] + [k for k in spec["checks"] if k in said and k not in failed_by]:
        for line in said[key]:
            if line is not None:
                say(line)
    gpu_skipped = [c["name"] for c in checks if c["ok"] is None]
    if gpu_skipped:
        say("%s not graded with --cuda: %s (%s)" % (prefix, ", ".join(gpu_skipped), GPU_CLOCK_NOT_GRADED))
    for v, names in ungraded.items():
        say("%s not graded (%s): %s" % (prefix, "the run failed" if v is None else "the run on %s failed"
                                         % variant_label(rubric, v, stage), ", ".join(names)))
    got = sum(c["points"] for c in checks)
    total = sum(c["max_points"] for c in checks)
    say("stage %s: %s/%s points%s" % (stage, fmt_points(got), fmt_points(total), " (bonus)" if spec.get("bonus") else ""))
    return {"stage": stage, "dir": spec["dir"], "title": spec.get("title", ""), "bonus": bool(spec.get("bonus")),
            "source": relpath(src),
            "run": {"ok": run.ok, "reason": run.reason, "seconds": round(run_s, 3), "dir": relpath(run_dir),
                    "command": _command(run)},
            "variants": {v: {"label": variant_label(rubric, v, stage), "ok": r.ok, "reason": r.reason,
                             "dir": relpath(r.dir), "command": _command(r)} for v, r in extra.items()},
            "lead": lead, "failed_order": order, "points": got, "max_points": total, "checks": checks}


PASSES_ON_FILES = NOT_GRADED + "; the files it wrote before failing pass this check"
FAILS_ON_FILES = NOT_GRADED + "; the files it wrote before failing fail this check: "
# the checks that read only files a run writes before its first step: check key -> those files, per rank
ON_EARLY_FILES = {"dtensors": "dtensors_rank%d.json"}

FAILED_ITSELF = "check"  # failed_by: the check failed on its own evidence (not because a run it reads failed)
JUDGED_ON_FILES = "files"  # failed_by: the main run failed, and the check fails on the files it wrote before failing
MAIN_RUN_FAILED = "run"  # lead_order's name for the main run's failure


def lead_order(failed_by, failed_at, keys, run, extra):
    """The stage's failures in the order a student should read them, the one most likely to name the cause first:
    a run stopped by the runtime (the main run, or a variant's) with its diagnosis, then the checks that failed on
    their own evidence by how directly they name a cause (Check.tier: what ran, which buffer, which number, a total,
    the loss; within a tier the one whose failure shows in the earlier step (failed_at: a cause comes before what
    it moves), then the rubric's order), then a run that failed without a diagnosis (NaN, a crash, a
    timeout: often a consequence); each entry a check's key, MAIN_RUN_FAILED, or "run:<variant>". When the main
    run failed, its reason comes after the checks that fail on the files it wrote before failing (JUDGED_ON_FILES);
    the checks it left ungraded are said with it, not listed."""
    index = {k: i for i, k in enumerate(keys)}
    if not run.ok:  # what the run wrote before failing, when a check finds its cause there, then the run's reason
        return sorted((k for k, why in failed_by.items() if why == JUDGED_ON_FILES),
                      key=lambda k: (CHECKS[k].tier, index[k])) + [MAIN_RUN_FAILED]
    def first_step(k):
        return failed_at.get(k) if failed_at.get(k) is not None else float("inf")
    own = sorted((k for k, why in failed_by.items() if why == FAILED_ITSELF),
                 key=lambda k: (CHECKS[k].tier, first_step(k), index[k]))
    runs = ["run:" + v for v in extra if v in failed_by.values()]
    diagnosed = [r for r in runs if extra[r[4:]].reason.startswith(RUNTIME_ERROR)]
    return diagnosed + own + [r for r in runs if r not in diagnosed]


def _lead_line(lead, order, rubric, on_files, stage=None):
    """'pipeline schedule order (read it first: peak memory, pipeline bubble may follow from it)'; a check that
    failed on the files a failed run wrote (on_files: key -> its reason) with its reason, said nowhere else on a
    line of its own."""
    def name(entry):
        if entry == MAIN_RUN_FAILED:
            return "the run failed"
        if entry.startswith("run:"):
            return "the run on %s failed" % variant_label(rubric, entry[4:], stage)
        return CHECKS[entry].label
    said = name(lead) + (", on the files the run wrote before failing: " + on_files[lead] if lead in on_files else "")
    return "%s (read it first: %s may follow from it)" % (said, ", ".join(name(e) for e in order[1:]))


def _grade_check(ctx, key):
    """run_check; on a failed run no check earns points and each points at the run's reason (said once),
    but a check whose files the run wrote before failing (the DTensors, written right after fsdp_init)
    still says whether they pass, and why not when every rank wrote them and they fail."""
    ok, reason, detail = run_check(ctx, key)
    if ctx.run.ok:
        return ok, reason, detail
    if ctx.variant is not None:
        return False, "on %s the run failed: %s" % (ctx.label, ctx.run.reason), ""
    if ok:
        return False, PASSES_ON_FILES, ""
    files = ON_EARLY_FILES.get(key)
    if files and all(os.path.isfile(ctx.path(files % r)) for r in range(ctx.world)):
        return False, FAILS_ON_FILES + reason, ""
    return False, NOT_GRADED, ""


PASSES_ON_PARTIAL = NOT_GRADED + "; its record up to the runtime error passes this check"


def _grade_on_partial(ctx, key):
    """On a main run stopped by a runtime error: (ok, reason) of the check `key` judged on the partial record the
    run left (Context.partial_view: the reporting rank's enqueued ops and memory notes up to the error), for a
    check that can judge one (Check.partial); None otherwise. It earns nothing either way (the run failed);
    a failure is said with its reason, which may name the cause the runtime error is a symptom of (a backward
    prefetch turned the wrong way stops the run at a race)."""
    if ctx.run.ok or ctx.variant is not None or not CHECKS[key].partial:
        return None
    view = ctx._memo("partial_view", ctx.partial_view)
    if view is None:
        return None
    ok, reason, _ = run_check(view, key)
    return (True, PASSES_ON_PARTIAL) if ok else (False, "before the runtime error: " + reason)


def _started(rubric, stages, root):
    """(stages, {skipped stage: why}, lines): by default every core stage is graded, and each bonus stage the
    student has started (manifest.Stage.started: carried, or changed from its starter); a line names those left
    out (said just before the score)."""
    keep, skipped = [], {}
    for sid in stages:
        st = manifest.stage(sid, rubric)
        started, why = st.started(root) if st.spec.get("bonus") else (True, "")
        if started:
            keep.append(sid)
        else:
            skipped[sid] = why
    lines = ["bonus stage%s %s skipped: %s; `make grade STAGE=%s` grades one" % (
        "s" if len(ids) > 1 else "", ", ".join(ids), why, ids[0])
        for ids, why in sorted(manifest.by_reason(skipped.items()), key=lambda g: g[1])]
    return keep, skipped, lines


def score_line(score, total, bonus_score, bonus_total, bonus_ids, any_core):
    """'Score: 20/22', 'Score: 20/22 + bonus 4.5/4.5 (stage 08)', or with only bonus stages graded
    'Score: bonus 4.5/4.5 (stage 08)' (the advanced track's points are extra: outside the total)."""
    parts = ["%s/%s" % (fmt_points(score), fmt_points(total))] if any_core or not bonus_ids else []
    if bonus_ids:
        parts.append("bonus %s/%s (stage%s %s)" % (fmt_points(bonus_score), fmt_points(bonus_total),
                                                  "s" if len(bonus_ids) > 1 else "", ", ".join(bonus_ids)))
    return "Score: " + " + ".join(parts)


def _command(run):
    return [relpath(c) if os.path.isabs(c) else c for c in run.cmd]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _stage_range():
    """'01..06' for --help, from the default rubric (--help must work even if that rubric is broken)."""
    try:
        ids = sorted(manifest.rubric()["stages"])
    except manifest.ManifestError:
        return "see grader/rubric.json"
    return "%s..%s" % (ids[0], ids[-1])


def parse_args(argv):
    ap = _Parser(prog="grade.py", description="Grade hwFSDP stages (see HANDOUT.md#grading).")
    ap.add_argument("--stage", action="append", default=[],
                    help="stage to grade (%s); repeatable; default: every core stage, and the bonus stages "
                         "whose file differs from its starter (--every-stage: all)" % _stage_range())
    ap.add_argument("--every-stage", action="store_true",
                    help="with no --stage: grade the bonus stages left as their starters too")
    ap.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    ap.add_argument("--file", help="grade this hw_fsdp.c (needs exactly one --stage)")
    ap.add_argument("--out", help="where runs go (default grade-runs/; with --class or --sandbox as root, a fresh "
                                  "folder in /tmp when the sandbox's users cannot reach grade-runs/)")
    ap.add_argument("--json", help="results file (default OUT/results.json)")
    ap.add_argument("--reference", default=os.path.join(ROOT, "logs", "reference"),
                    help="reference logs (default logs/reference/)")
    ap.add_argument("--rubric", default=RUBRIC_PATH, help=argparse.SUPPRESS)
    ap.add_argument("--cuda", action="store_true",
                    help="build against the CUDA backend (make cuda) and run on the GPU; loss and grad norm are "
                         "compared with the baseline run on the same GPU")
    ap.add_argument("--timeout", type=float, help="wall-clock limit per run in seconds (default: the rubric's)")
    ap.add_argument("--tree", help="grade TREE/stages/*/hw_fsdp.c (a student's copy) instead of stages/")
    ap.add_argument("--sandbox", action="store_true",
                    help="contain every run (as root: an unprivileged user of its own; see INSTRUCTORS.md)")
    ap.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--class", dest="klass", metavar="SUBMISSIONS",
                    help="grade a class: one folder or tarball per student in SUBMISSIONS (writes OUT/scores.csv)")
    ap.add_argument("--jobs", type=int, default=2, help="with --class: students graded at once (default 2)")
    return ap.parse_args(argv)


def write_results(path, summary):
    """results.json, replaced in one step (a reader never sees half a file); a failure is said, not raised."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as e:
        say("could not write %s: %s" % (path, e), sys.stderr)


DEFAULT_OUT = os.path.join(ROOT, "grade-runs")


def _reachable_default(out_root, args, say):
    """The default out folder, or where the runs go instead when the sandbox's users (root's --class and
    --sandbox) cannot reach it: a clone in a mode-700 home. A fresh folder in the temp folder, said in one
    line; an --out given by hand is never replaced (out of reach, it is the one-line error)."""
    blocked = unreachable_by_others(out_root)
    if not blocked:
        return out_root
    fallback = reachable_temp_dir("hwfsdp-class-runs-" if args.klass else "hwfsdp-grade-runs-")
    if fallback is None:
        raise UsageError("the sandbox's users cannot reach %s (they need o+x on %s), nor a temp folder: "
                         "choose another --out" % (relpath(out_root), blocked))
    say("the sandbox's users cannot reach %s (no o+x on %s): the runs and %s go to %s" % (
        relpath(out_root), blocked, "reports" if args.klass else "results", fallback))
    return fallback


def main(argv=None):
    t_start = time.monotonic()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        rubric = load_rubric(args.rubric)
        stages = [parse_stage(rubric, s) for s in args.stage] or [s.id for s in manifest.stages(rubric)]
        stages = sorted(set(stages))
        if args.file and (len(stages) != 1 or not args.stage):
            raise UsageError("--file needs exactly one --stage (e.g. --file my/hw_fsdp.c --stage 03)")
        sources = [o for o, on in (("--file", args.file), ("--solutions", args.solutions), ("--tree", args.tree),
                                    ("--class", args.klass)) if on]
        if len(sources) > 1:
            raise UsageError("%s exclude each other" % " and ".join(sources))
        if args.tree and not os.path.isdir(os.path.join(args.tree, "stages")):
            raise UsageError("--tree %s: no stages/ folder in it" % args.tree)
        if args.klass and not os.path.isdir(args.klass):
            raise UsageError("--class %s: no such directory" % args.klass)
        if args.jobs < 1:
            raise UsageError("--jobs must be at least 1")
        if args.file and not os.path.isfile(args.file):
            raise UsageError("--file %s: no such file" % args.file)
        if not os.path.isdir(args.reference):
            raise UsageError("--reference %s: no such directory" % args.reference)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError("--timeout must be positive")
        out_root = os.path.abspath(args.out or DEFAULT_OUT)
        if args.out is None and (args.klass or args.sandbox) and os.geteuid() == 0:
            out_root = _reachable_default(out_root, args, say)
        try:
            os.makedirs(out_root, exist_ok=True)
        except OSError as e:
            raise UsageError("--out %s: cannot create the directory (%s)" % (args.out, e.strerror or e))
    except UsageError as e:
        say("grade.py: error: %s" % one_line(str(e)), sys.stderr)
        return 2

    if args.klass:
        from .classroom import grade_class
        return grade_class(args, rubric, stages, out_root, say)
    sandbox = None
    if args.sandbox:
        sandbox = Sandbox(args.slot)
        blocked = sandbox.uid is not None and sandbox_reach_error(out_root)
        if blocked:
            say("grade.py: error: %s" % blocked, sys.stderr)
            return 2
        say(sandbox.describe())
    runner = Runner(rubric["limits"], args.timeout or rubric["limits"]["run_timeout_s"], cuda=args.cuda,
                    sandbox=sandbox)
    baselines = Baselines(runner, out_root)
    tree = "file" if args.file else "solutions" if args.solutions else "tree" if args.tree else "stages"
    base = os.path.abspath(args.tree) if args.tree else os.path.join(ROOT, tree)
    if tree in ("stages", "tree") and not args.stage and not args.every_stage:
        stages, skipped, skip_lines = _started(rubric, stages, os.path.dirname(base) if tree == "stages" else base)
    else:
        skipped, skip_lines = {}, []
    results = []
    for stage in stages:
        src = os.path.abspath(args.file) if args.file else os.path.join(base, "stages" if args.tree else "",
                                                                          rubric["stages"][stage]["dir"], "hw_fsdp.c")
        results.append(grade_stage(rubric, stage, src, out_root, os.path.abspath(args.reference), runner,
                                   baselines))
    # the advanced track's points are extra: outside the total, said after it
    core = [r for r in results if not r["bonus"]]
    bonus = [r for r in results if r["bonus"]]
    score = sum(r["points"] for r in core)
    total = sum(r["max_points"] for r in core)
    bonus_score = sum(r["points"] for r in bonus)
    bonus_total = sum(r["max_points"] for r in bonus)
    elapsed = time.monotonic() - t_start
    for line in skip_lines:
        say(line)
    say(score_line(score, total, bonus_score, bonus_total, [r["stage"] for r in bonus], bool(core)))
    json_path = args.json or os.path.join(out_root, "results.json")
    write_results(json_path, {"score": score, "max_score": total, "bonus_score": bonus_score,
                              "bonus_max_score": bonus_total, "seconds": round(elapsed, 3), "tree": tree,
                              "reference": relpath(os.path.abspath(args.reference)),
                              "stages": {r["stage"]: r for r in results}, "skipped": skipped})
    say("results: %s" % relpath(os.path.abspath(json_path)))
    say("graded %d stage%s in %.1f s" % (len(results), "" if len(results) == 1 else "s", elapsed))
    return 0
