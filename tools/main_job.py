#!/usr/bin/env python3
"""The main job (`make run`, `./hwfsdp run`): train the debugmodel with FSDP.

    main_job.py --out DIR -- TRAIN_FLAGS...

Which implementation trains:
  - in the instructors' tree, the solution of rubric.json's main_job stage;
  - in a student tree (no solutions/), the student's most advanced stage whose
    build/stages/NN_name/train survives one tiny step (a stage whose TODOs are
    still open stops at the first one), with that stage's own flags
    (--forward-only for stage 01, --ac for 05, ...);
  - when no stage of the student's runs yet, the non-sharded baseline, saying so.
Prints which one and why, then runs it with TRAIN_FLAGS into DIR.
"""
import os
import subprocess
import sys
import tempfile

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest

BUILD = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))
SMOKE = ["--flavor", "tiny", "--world", "2", "--seq-len", "16", "--batch-size", "1", "--steps", "1",
         "--profile-steps", "0", "--quiet"]


def fail(msg):
    print("main_job: " + msg, file=sys.stderr)
    sys.exit(2)


def last_error(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def student_stage():
    """(binary, stage flags, what to say) of the most advanced stage of stages/ that runs a step."""
    why_not = []
    for st in reversed(manifest.stages()):
        binary = os.path.join(BUILD, "stages", st.dir, "train")
        if not os.path.exists(binary):
            why_not.append("stage %s: not built" % st.id)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([binary] + SMOKE + st.flags + ["--out", tmp], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
        if p.returncode == 0:
            return binary, st.flags, "training with your stage %s (stages/%s), the most advanced one that runs" % (
                st.id, st.dir)
        why_not.append("stage %s: %s" % (st.id, last_error(p.stdout + p.stderr)))
    baseline = os.path.join(BUILD, "baseline", "train")
    return baseline, [], ("no stage of yours runs a step yet (%s): training the non-sharded baseline instead"
                          % (why_not[-1] if why_not else "no stages"))


def main(argv):
    if len(argv) < 3 or argv[0] != "--out" or "--" not in argv:
        fail("usage: main_job.py --out DIR -- TRAIN_FLAGS...")
    out, flags = argv[1], argv[argv.index("--") + 1:]
    main_stage = manifest.stage(manifest.rubric()["main_job"]["stage"])
    solution = os.path.join(BUILD, "solutions", main_stage.dir, "train")
    if os.path.isdir(os.path.join(ROOT, "solutions")):
        if not os.path.exists(solution):
            fail("%s is missing: run make first" % os.path.relpath(solution, ROOT))
        binary, stage_flags, say = solution, main_stage.flags, "training with solutions/%s" % main_stage.dir
    else:
        binary, stage_flags, say = student_stage()
    if not os.path.exists(binary):
        fail("%s is missing: run make first" % os.path.relpath(binary, ROOT))
    print("main job: " + say, flush=True)
    cmd = [binary] + flags + stage_flags + ["--out", out]
    print("$ " + " ".join(os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd), flush=True)
    sys.exit(subprocess.run(cmd, cwd=ROOT).returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
