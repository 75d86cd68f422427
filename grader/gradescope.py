#!/usr/bin/env python3
"""The Gradescope side of the grader: what run_autograder runs (make gradescope builds the zip).

    gradescope.py --submission DIR --results FILE [--config gradescope.json]

Takes the student's hw_fsdp.c files from the submission (stages/NN_name/hw_fsdp.c at any
depth, as `make handout`'s tree has them; when the assignment grades one stage, a lone
hw_fsdp.c is that stage's), grades them with grade.py --tree --sandbox, and writes FILE in
Gradescope's results format: the total score, one test per check (its points, max points,
status and message) and the visibility the zip was built with. FILE is written whatever
happens (a submission with no file, a grader that fails): a student always gets a result
that says why. Standard library only.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import manifest
from gradelib.checks import CHECKS
from gradelib.classroom import MAX_FILE, collect
from gradelib.runner import reachable_temp_dir
from gradelib.util import NOT_GRADED, fmt_points, one_line

ROOT = manifest.ROOT
VISIBILITIES = ("hidden", "after_due_date", "after_published", "visible")


def lone_file(submission):
    """The shallowest regular hw_fsdp.c anywhere in the submission (one-stage assignments)."""
    best = None
    for dirpath, dirnames, filenames in os.walk(submission):
        depth = os.path.relpath(dirpath, submission).count(os.sep)
        if depth > 4:
            dirnames[:] = []
        if "hw_fsdp.c" in filenames:
            p = os.path.join(dirpath, "hw_fsdp.c")
            if os.path.isfile(p) and not os.path.islink(p) and (best is None or depth < best[0]):
                best = (depth, p)
    if best is None or os.path.getsize(best[1]) > MAX_FILE:
        return None
    with open(best[1], "rb") as fh:
        return fh.read()


def to_gradescope(results, stages, rubric, notes, visibility, seconds):
    """Gradescope's results.json from grade.py's results.json (None: the grader wrote none)."""
    tests, lines = [], []
    stage_results = (results or {}).get("stages", {})
    for sid in stages:
        spec = rubric["stages"][sid]
        r = stage_results.get(sid)
        got = r["points"] if r else 0
        lines.append("Stage %s (%s): %s/%s%s" % (sid, spec.get("title", spec["dir"]), fmt_points(got),
                                                fmt_points(sum(spec["checks"].values())),
                                                " (bonus: extra points)" if spec.get("bonus") else ""))
        if r and not r["run"]["ok"]:
            lines.append("    run failed: %s" % r["run"]["reason"])
        for k, (key, points) in enumerate(spec["checks"].items(), 1):
            c = next((c for c in (r or {}).get("checks", []) if c["key"] == key), None)
            if c is not None and c["ok"] is None:  # not graded on this backend (grade.py --cuda's overlap)
                continue
            ok = bool(c and c["ok"])
            if c is None:
                msg = "not graded: the grader did not get to this stage"
            else:
                msg = c["reason"] if not ok else (c.get("detail") or "passed")
                if not ok and msg.startswith(NOT_GRADED):  # each test is read alone: it says why the run failed
                    msg = "%s: %s%s" % (NOT_GRADED, r["run"]["reason"], msg[len(NOT_GRADED):])
            tests.append({"name": "Stage %s: %s" % (sid, CHECKS[key].label), "number": "%s.%d" % (sid, k),
                          "score": float(points) if ok else 0.0, "max_score": float(points),
                          "status": "passed" if ok else "failed", "output": one_line(msg, 4000),
                          "visibility": visibility, "tags": ["stage-%s" % sid] + (["bonus"] if spec.get("bonus") else [])})
    out = "\n".join(notes + ([""] if notes else []) + lines)
    return {"score": float(sum(t["score"] for t in tests)), "execution_time": int(round(seconds)),
            "output": out, "visibility": visibility, "stdout_visibility": "hidden", "tests": tests}


def write(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    t0 = time.monotonic()
    ap = argparse.ArgumentParser(prog="gradescope.py", description="Grade a Gradescope submission.")
    ap.add_argument("--submission", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--config", default=os.path.join(ROOT, "gradescope.json"))
    ap.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.timeout is None and os.environ.get("HWFSDP_GRADE_TIMEOUT"):  # the tests' hanging submission
        args.timeout = float(os.environ["HWFSDP_GRADE_TIMEOUT"])
    rubric = manifest.rubric()
    try:
        with open(args.config) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        cfg = {}
    stages = [s for s in cfg.get("stages") or sorted(rubric["stages"]) if s in rubric["stages"]]
    visibility = cfg.get("visibility", "visible")
    if visibility not in VISIBILITIES:
        visibility = "visible"
    dirs = {rubric["stages"][s]["dir"]: s for s in stages}

    notes = []
    try:
        files, notes = collect(args.submission, list(dirs))
    except OSError as e:
        files, notes = {}, ["your submission could not be read: %s" % e]
    if not files and len(stages) == 1:
        data = lone_file(args.submission)
        if data is not None:
            files = {rubric["stages"][stages[0]]["dir"]: data}
    missing = [d for d in dirs if d not in files]
    notes = [n for n in notes if "no hw_fsdp.c" not in n]
    if missing:
        notes.append("No hw_fsdp.c found for %s: upload stages/NN_name/hw_fsdp.c (your copy's layout)%s."
                     % (", ".join(missing), ", or just hw_fsdp.c" if len(stages) == 1 else ""))

    # the sandbox's user reaches its runs through it (a $TMPDIR out of its reach is passed over)
    work = reachable_temp_dir("hwfsdp-grade-")
    if work is None:
        work = tempfile.mkdtemp(prefix="hwfsdp-grade-")  # grade.py then says what is out of reach
        os.chmod(work, 0o755)
    results = None
    try:
        for d, data in files.items():
            os.makedirs(os.path.join(work, "tree", "stages", d))
            with open(os.path.join(work, "tree", "stages", d, "hw_fsdp.c"), "wb") as fh:
                fh.write(data)
        os.makedirs(os.path.join(work, "tree", "stages"), exist_ok=True)
        cmd = [sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--tree", os.path.join(work, "tree"),
               "--out", os.path.join(work, "runs"), "--json", os.path.join(work, "results.json"), "--sandbox"]
        for s in stages:
            cmd += ["--stage", s]
        if args.timeout:
            cmd += ["--timeout", "%g" % args.timeout]
        sys.stdout.flush()
        subprocess.run(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            with open(os.path.join(work, "results.json")) as fh:
                results = json.load(fh)
        except (OSError, ValueError) as e:
            notes.append("The grader wrote no results (%s): tell your instructors." % e)
    except Exception as e:  # noqa: BLE001 -- whatever happens, the student gets a results.json that says it
        notes.append("The autograder failed (%s: %s): tell your instructors." % (type(e).__name__, e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = to_gradescope(results, stages, rubric, notes, visibility, time.monotonic() - t0)
    write(args.results, data)
    print("results: %s (score %s)" % (args.results, fmt_points(data["score"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
