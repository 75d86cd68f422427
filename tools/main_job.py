#!/usr/bin/env python3
"""The main job (`make run`, `./hwfsdp run`): train the debugmodel with FSDP.

    main_job.py --out DIR -- TRAIN_FLAGS...

Which implementation trains:
  - in the instructors' tree, the solution of rubric.json's main_job stage;
  - in a student tree (no solutions/), the highest-numbered stage, core or bonus,
    whose stages/NN_name/hw_fsdp.c the student changed (or carried) and whose
    build/stages/NN_name/train survives one tiny step at the run's world size (a stage
    whose TODOs are still open stops at the first one), with that stage's own flags
    (--forward-only for stage 01, --ac for 05, --mesh for 09, ...): the stages add
    features in number order, so the highest one that works is the latest work;
  - when no stage of the student's runs yet, the non-sharded baseline, saying so.
Prints which one and why, then runs it with TRAIN_FLAGS into DIR, and then makes DIR smaller
(compact_run_dir; the runtime writes a full memory_viz pickle per rank, 13 MB each for 30
steps of the debugmodel at 4 ranks):
  - memory_rank0.pickle   rank 0's snapshot over the profiled steps (--profile-steps, from
                          fsdp_init to the end of the last profiled step): memory_viz opens
                          it as it is, and its steps are the ones the trace times;
  - memory_rank<r>.all_steps.pickle.gz   every rank's whole snapshot (gunzip -k first);
  - memory_rank<r>.json   rank 0's as it is (plots, scripts), the others' gzipped;
  - trace_rank<r>.json.gz gzipped (trace.json holds every rank, for Perfetto).
The grader never reads a make-run directory (it runs the binaries itself, grader/gradelib/runner.py).
"""
import gzip
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest

BUILD = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))
SMOKE = ["--flavor", "tiny", "--seq-len", "16", "--steps", "1", "--profile-steps", "0", "--quiet"]


def fail(msg):
    print("main_job: " + msg, file=sys.stderr)
    sys.exit(2)


def last_error(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def student_stage(flags):
    """(binary, stage flags, what to say) of the highest-numbered stage of stages/ that the student changed and
    that runs a step with the run's world size and batch size (the smoke run uses the stage's flags at that
    world: --grad-accum must divide the batch, --mesh must fit the world)."""
    world = int(manifest.flag_value(flags, "--world", "1"))
    run = SMOKE + ["--world", str(world), "--batch-size", manifest.flag_value(flags, "--batch-size", "1")]
    passed = []  # (stage, why) of the higher stages that do not run, said in the line that names the one that does
    for st in reversed(manifest.stages()):
        started, why = st.started(ROOT)
        binary = os.path.join(BUILD, "stages", st.dir, "train")
        if not started:
            passed.append((st.id, why))
            continue
        if not os.path.exists(binary):
            passed.append((st.id, "does not build"))
            continue
        smoke = manifest.override_flags(run, st.flags_at(world))[0] + st.flags_at(world)  # each flag once
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([binary] + smoke + ["--out", tmp], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        if p.returncode == 0:
            return binary, st.flags_at(world), "training with your stage %s (stages/%s): the highest-numbered " \
                "stage you changed that runs a step%s" % (st.id, st.dir, _passed(passed))
        passed.append((st.id, last_error(p.stdout + p.stderr)))
    baseline = os.path.join(BUILD, "baseline", "train")
    return baseline, [], "no stage of yours runs a step yet: training the non-sharded baseline instead%s" % (
        _passed(passed))


def _passed(passed):
    """' (10, 08: unchanged from their starters; 09: error: ...)': why the higher stages were passed over."""
    if not passed:
        return ""
    return " (%s)" % "; ".join("%s: %s" % (", ".join(ids), why) for ids, why in manifest.by_reason(passed))


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
        binary, stage_flags, say = student_stage(flags)
    if not os.path.exists(binary):
        fail("%s is missing: run make first" % os.path.relpath(binary, ROOT))
    print("main job: " + say, flush=True)
    cmd, said = train_command(binary, flags, stage_flags, out)
    if said:
        print("main job: " + said, flush=True)
    print("$ " + " ".join(os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc == 0:
        compact_run_dir(out if os.path.isabs(out) else os.path.join(ROOT, out),
                        int(manifest.flag_value(cmd, "--profile-steps", "3")))
    sys.exit(rc)


def train_command(binary, flags, stage_flags, out):
    """(the training command line, what to say or ""): the run's flags, then the stage's own, each flag once. The
    stage's win where both set one (stage 12's --batch-size=4, which its 4 microbatches need, over make run's
    --batch-size 2): the run's is left out and said."""
    kept, replaced = manifest.override_flags(flags, stage_flags)
    said = ""
    if replaced:
        theirs = dict((name, " ".join(tokens)) for name, tokens in manifest.flag_groups(stage_flags))
        said = "the stage's own %s in place of the run's %s" % (
            ", ".join(theirs[name] for name, _ in replaced), ", ".join(" ".join(t) for _, t in replaced))
    return [binary] + kept + stage_flags + ["--out", out], said


def gzip_file(path, dest=None):
    """path -> dest (path.gz), the original removed."""
    with open(path, "rb") as src, gzip.open(dest or path + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(path)


def profiled_snapshot(snap, profile_steps):
    """The memory_viz snapshot cut after the last profiled step: its device trace up to the first event of step
    profile_steps (frames[-1] is {"filename": "step", "line": step}; init is step -1), and its segments the
    blocks alive at that point, as the runtime writes them (one block per segment), so that memory_viz's
    replay of the trace ends on them."""
    trace = snap["device_traces"][0]
    cut = next((i for i, e in enumerate(trace) if e["frames"] and e["frames"][-1].get("line", -1) >= profile_steps),
               len(trace))
    kept = trace[:cut]
    alive, real = {}, {}
    for e in kept:
        if e["action"] == "segment_alloc":
            real[e["addr"]] = e["size"]
        elif e["action"] == "alloc":
            alive[e["addr"]] = [e, "active_allocated"]
        elif e["action"] == "free_requested" and e["addr"] in alive:
            alive[e["addr"]][1] = "active_pending_free"
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    segments = []
    for addr, (e, state) in sorted(alive.items()):
        size = real.get(addr, e["size"])
        segments.append({"device": 0, "address": addr, "total_size": size, "allocated_size": size,
                         "active_size": size, "requested_size": e["size"], "stream": e["stream"],
                         "segment_type": "small" if e["size"] < (1 << 20) else "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": e["frames"],
                         "blocks": [{"address": addr, "size": size, "requested_size": e["size"], "state": state,
                                     "frames": e["frames"]}]})
    return {"segments": segments, "device_traces": [kept]}


def compact_run_dir(out, profile_steps):
    """Shrink a run directory as the docstring says (a file that is not there is left alone)."""
    ranks = sorted(int(f[len("memory_rank"):-len(".pickle")]) for f in os.listdir(out)
                   if f.startswith("memory_rank") and f.endswith(".pickle") and f[11:-7].isdigit())
    for r in ranks:
        pk = os.path.join(out, "memory_rank%d.pickle" % r)
        if r == 0 and profile_steps > 0:
            with open(pk, "rb") as fh:
                snap = pickle.load(fh)
            cut = profiled_snapshot(snap, profile_steps)
        gzip_file(pk, os.path.join(out, "memory_rank%d.all_steps.pickle.gz" % r))
        if r == 0 and profile_steps > 0:
            with open(pk, "wb") as fh:
                w = pickle.Pickler(fh, protocol=2)  # dicts, lists, str, int, tuples: opcodes memory_viz reads,
                w.fast = True                       # and no memo (BINPUT/BINGET): no object is shared twice
                w.dump(cut)
        js = os.path.join(out, "memory_rank%d.json" % r)
        if r > 0 and os.path.exists(js):
            gzip_file(js)
    for f in os.listdir(out):
        if f.startswith("trace_rank") and f.endswith(".json") and os.path.exists(os.path.join(out, "trace.json")):
            gzip_file(os.path.join(out, f))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print("run directory %s: %.1f MB (memory_rank0.pickle: rank 0 over the %d profiled step%s, for memory_viz; "
          "every rank's whole snapshot in memory_rank<r>.all_steps.pickle.gz)"
          % (os.path.relpath(out, ROOT), size / 1e6, profile_steps, "" if profile_steps == 1 else "s"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
