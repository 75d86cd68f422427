#!/usr/bin/env python3
"""The Gradescope autograder zip (make gradescope [RELEASE=NN] [STAGE=NN] [VISIBILITY=...]).

    make_gradescope.py [--release NN] [--stage NN ...] [--visibility V] [--out FILE]

The zip holds, at its root, the student tree of `make handout` (release NN's when given:
its stages, reference logs and rubric; never solutions/), plus:
  setup.sh          run once when Gradescope builds the image: installs the Debian/Ubuntu
                    packages grading needs and builds the runtime
  run_autograder    run for every submission: grader/gradescope.py grades the uploaded
                    hw_fsdp.c files into /autograder/results/results.json
  gradescope.json   which stages this assignment grades and the tests' visibility
Default: every stage of the release; one Gradescope assignment per stage is --stage NN
(then a lone uploaded hw_fsdp.c is that stage's). Writes dist/hwfsdp-gradescope.zip
(dist/hwfsdp-gradescope-release-NN-stage-MM.zip with --release NN --stage MM).
"""
import argparse
import json
import os
import sys
import zipfile

import make_handout
from repo_paths import ROOT

PACKAGES = "make gcc libc6-dev libopenblas-dev openmpi-bin libopenmpi-dev python3"

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image.
set -euo pipefail
cd "${AUTOGRADER_ROOT:-/autograder}/source"
missing=""
for p in %(packages)s; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing
fi
# the runtime every submission links with, and the non-sharded baseline the grader re-runs
make -s -j"$(nproc)" build/baseline/train
chmod -R o+rX .   # each run is an unprivileged user of its own (grade.py --sandbox)
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for every submission (as root, working directory /autograder).
AG="${AUTOGRADER_ROOT:-/autograder}"
cd "$AG/source" || exit 1
exec python3 grader/gradescope.py --submission "$AG/submission" --results "$AG/results/results.json"
"""


def fail(msg):
    print("make_gradescope: error: " + msg, file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write the Gradescope autograder zip.")
    ap.add_argument("--release", help="the release whose tree the zip holds (default: every stage)")
    ap.add_argument("--stage", action="append", default=[], help="a stage this assignment grades (repeatable)")
    ap.add_argument("--visibility", default="visible", choices=("visible", "hidden", "after_due_date",
                                                                  "after_published"))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    norm = lambda s: "%02d" % int(s) if s.isdigit() else s  # noqa: E731
    release = norm(args.release) if args.release else None
    kept, dropped = make_handout.release_plan(release)
    stages = [norm(s) for s in args.stage] or kept
    bad = [s for s in stages if s not in kept]
    if bad:
        fail("--stage %s: not a stage of %s (stages: %s)" % (bad[0], "release " + release if release else "the workbook",
                                                              ", ".join(kept)))
    tag = ("-release-" + release if release else "") + ("-stage-" + "-".join(stages) if args.stage else "")
    out = args.out or os.path.join(ROOT, "dist", "hwfsdp-gradescope%s.zip" % tag)
    files = [f for f in make_handout.tracked_files() if not f.startswith(make_handout.INSTRUCTORS_ONLY)
             and not make_handout.dropped_path(f, dropped) and not f.startswith(("tests/", "fuzz/", ".ci/"))]
    rubric_files = make_handout.release_rubric(kept) if dropped else {}  # the rubric and its figures, kept stages
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def add(z, name, data, mode=0o644):
        info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(info, data)

    with zipfile.ZipFile(out + ".tmp", "w") as z:
        for f in files:
            path = os.path.join(ROOT, f)
            if not os.path.exists(path):
                continue
            if dropped and f in rubric_files:
                data = rubric_files[f]
            elif dropped and f == "logs/reference/MANIFEST.json":
                with open(path, "rb") as fh:
                    data = make_handout.reference_manifest(fh.read(),
                                                           lambda p: not make_handout.dropped_path(p, dropped))
            else:
                with open(path, "rb") as fh:
                    data = fh.read()
            add(z, f, data, 0o755 if os.access(path, os.X_OK) else 0o644)
        add(z, "setup.sh", SETUP % {"packages": PACKAGES}, 0o755)
        add(z, "run_autograder", RUN, 0o755)
        add(z, "gradescope.json", json.dumps({"stages": stages, "visibility": args.visibility}, indent=1) + "\n")
    os.replace(out + ".tmp", out)
    print("wrote %s (grades stage%s %s; tests %s; %d files, %.1f MB)" % (
        out, "" if len(stages) == 1 else "s", ", ".join(stages), args.visibility, len(files) + 3,
        os.path.getsize(out) / 1e6))
    print("upload it as the assignment's autograder (Gradescope: Configure Autograder, Zip file upload)")


if __name__ == "__main__":
    main()
