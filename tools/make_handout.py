#!/usr/bin/env python3
"""The student copy (make handout [RELEASE=NN]).

    make_handout.py [--release NN [--no-earlier-solutions]] [--out FILE]

Everything git tracks but what only instructors have (solutions/, the mutants built from
them, the tests that need them, INSTRUCTORS.md, and README.md's paragraphs between
`<!-- instructors -->` and `<!-- /instructors -->`).

Without --release: the full handout, for a self-learner or a course that hands out everything
at once. Its starters are the committed stages/, which hold no answer: stage NN's starter
stubs every stage up to NN, and a student who did the earlier stages carries their own file
forward (make carry STAGE=NN).

With --release NN: a staged release for a course that hands out one stage at a time, holding
stages 01..NN only: their starters, their reference logs, and a rubric (grader/rubric.json, with
its measured figures in grader/figures/) that lists only them. Its starters are generated here from solutions/: stage N's starter
contains the solutions of the stages before N (being stuck never blocks the next stage), so
release N is published after stage N-1's deadline. --no-earlier-solutions ships the
committed, answer-free starters instead (students then carry their own files forward).

Writes dist/hwfsdp-handout.tar.gz, or dist/hwfsdp-release-NN.tar.gz.
"""
import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest
import make_starters

# README.md's paragraphs for instructors, between these two lines, are left out of the student copy
INSTRUCTORS_BLOCK = re.compile(r"^<!-- instructors -->\n.*?^<!-- /instructors -->\n\n?", re.M | re.S)
STUDENT_EDITED = {"README.md": lambda data: INSTRUCTORS_BLOCK.sub("", data.decode("utf-8")).encode("utf-8")}
INSTRUCTORS_ONLY = ("solutions/", "tests/mutants/", "tests/test_solutions", "tests/test_grader", "tests/test_handout",
                    "tests/test_parity_spread",
                    "tests/test_class", "tests/class_fixtures", "tests/test_gradescope", "INSTRUCTORS.md")


def fail(msg):
    print("make_handout: error: " + msg, file=sys.stderr)
    sys.exit(2)


def tracked_files():
    p = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if p.returncode != 0:
        fail("git ls-files failed (the handout is made from an instructors' git checkout): %s"
             % p.stderr.decode(errors="replace").strip())
    return sorted(f for f in p.stdout.decode().split("\0") if f)


def release_plan(release):
    """(kept stage ids, dropped stage dirs and ids) for release `release` (None: every stage)."""
    stages = manifest.stages()
    if release is None:
        return [s.id for s in stages], []
    ids = [s.id for s in stages]
    if release not in ids:
        fail("--release %s: no such stage (stages: %s)" % (release, ", ".join(ids)))
    kept = [s for s in stages if s.id <= release]
    return [s.id for s in kept], [s for s in stages if s.id > release]


def dropped_path(path, dropped):
    for s in dropped:
        if path.startswith("stages/%s/" % s.dir) or path.startswith("logs/reference/stage%s/" % s.id):
            return True
        if path.startswith("logs/debugmodel_200/%s/" % s.dir):
            return True
    return False


def release_rubric(kept):
    """{path: bytes}: grader/rubric.json with only the kept stages (the main job falls back to the last kept one)
    and the measured figures beside it (grader/figures/) as they go with it: the parity spreads of the kept
    stages' runs, the overlap figures as they are."""
    rubric = manifest.load()
    rubric["stages"] = {k: v for k, v in rubric["stages"].items() if k in kept}
    if rubric.get("main_job", {}).get("stage") not in kept:
        rubric["main_job"] = dict(rubric.get("main_job", {}), stage=kept[-1])
    used = {v for spec in rubric["stages"].values() for v in spec.get("variants", [])}
    rubric["variants"] = {k: v for k, v in rubric.get("variants", {}).items() if k == "about" or k in used}
    if isinstance(rubric.get("parity_spread"), dict):  # the measured tolerances of the kept stages' runs
        runs = rubric["parity_spread"].get("runs") or {}
        rubric["parity_spread"]["runs"] = {k: v for k, v in runs.items() if k in kept}
    manifest.validate_stages(rubric, "the release's rubric.json")
    out = {"grader/rubric.json": (json.dumps({k: v for k, v in rubric.items() if k not in manifest.FIGURES},
                                             indent=2, ensure_ascii=False) + "\n").encode()}
    for name, (path, _, _) in manifest.FIGURES.items():
        if name in rubric:
            out["grader/" + path] = manifest.figures_text(name, rubric[name]).encode()
    return out


def release_starters(kept):
    """{path: bytes}: the staged release's starters, their READMEs and hash records, with the solutions of the
    earlier stages kept (make_starters.convert(keep_earlier=True))."""
    out = {}
    for st in manifest.stages():
        if st.id not in kept:
            continue
        src = st.solution_src()
        if not os.path.isfile(src):
            fail("%s is missing: a staged release's starters are made from the solutions (or give "
                 "--no-earlier-solutions)" % os.path.relpath(src, ROOT))
        for name, text in make_starters.starter_files(st, keep_earlier=True).items():
            out["stages/%s/%s" % (st.dir, name)] = text.encode()
    return out


def reference_manifest(data, keep):
    m = json.loads(data)
    m["files"] = [f for f in m.get("files", []) if keep("logs/reference/" + f["path"])]
    return (json.dumps(m, indent=1) + "\n").encode()


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write the student copy (a staged release with --release).")
    ap.add_argument("--release", help="the last stage the release holds (01..)")
    ap.add_argument("--no-earlier-solutions", action="store_true",
                    help="with --release: ship the answer-free starters of the full handout, not starters holding "
                         "the earlier stages' solutions")
    ap.add_argument("--out", help="the tarball (default dist/hwfsdp-handout.tar.gz or dist/hwfsdp-release-NN.tar.gz)")
    args = ap.parse_args(argv)
    release = None
    if args.release:
        release = "%02d" % int(args.release) if args.release.isdigit() else args.release
    kept, dropped = release_plan(release)
    if args.no_earlier_solutions and release is None:
        fail("--no-earlier-solutions goes with --release NN (the full handout's starters hold no solution anyway)")
    generated = release_starters(kept) if release is not None and not args.no_earlier_solutions else {}
    out = args.out or os.path.join(ROOT, "dist", "hwfsdp-handout.tar.gz" if release is None
                                   else "hwfsdp-release-%s.tar.gz" % release)
    files = [f for f in tracked_files() if not f.startswith(INSTRUCTORS_ONLY) and not dropped_path(f, dropped)]
    rubric_files = release_rubric(kept) if dropped else {}  # the rubric and its figures, of the kept stages
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tarfile.open(out + ".tmp", "w:gz") as tar:
        for f in files:
            path = os.path.join(ROOT, f)
            if not os.path.exists(path):
                continue  # deleted in the work tree, not yet in git
            data = None
            if f in generated:
                data = generated[f]
            elif dropped and f in rubric_files:
                data = rubric_files[f]
            elif dropped and f == "logs/reference/MANIFEST.json":
                with open(path, "rb") as fh:
                    data = reference_manifest(fh.read(), lambda p: not dropped_path(p, dropped))
            elif f in STUDENT_EDITED:
                with open(path, "rb") as fh:
                    data = STUDENT_EDITED[f](fh.read())
            info = tar.gettarinfo(path, arcname="hwfsdp/" + f)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if data is None:
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(out + ".tmp", out)
    print("wrote %s (stages %s, %d files, %.1f MB; starters: %s)" % (
        out, ", ".join(kept), len(files), os.path.getsize(out) / 1e6,
        "with the earlier stages' solutions" if generated else "answer-free"))


if __name__ == "__main__":
    main()
