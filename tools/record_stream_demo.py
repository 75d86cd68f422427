#!/usr/bin/env python3
"""Why FSDP2 keeps a ReduceScatterState instead of calling record_stream.

    record_stream_demo.py [--out DIR] [--steps N] [--repeats N] [--publish]
    make record-stream-demo        (instructors: runs it with --publish)

Builds stage 04's solution twice:
  state          as shipped: the reduce-scatter input is kept in the ReduceScatterState
                 and freed once compute has waited for the reduce-scatter;
  record_stream  the input is freed right after the reduce-scatter is enqueued, with
                 dev_record_stream(input, reduce_scatter stream) first; nothing else
                 waits until fsdp_finish_backward.
Runs each on the debugmodel (world 4) under a fast and a slow link (--repeats times each)
and writes into DIR (default build/record_stream_demo):
  comm_buffer.png   rank 0's counted comm_buffer bytes over step 2's backward, per run
  summary.json      every run's peak (all tags and comm_buffer) and its pending frees
  <run>/            the run directories (memory_rank0.pickle: drag a record_stream one onto
                    pytorch.org/memory_viz to see the active_pending_free blocks)
What it shows: the state frees each input at a point of the program, so one input is
counted at a time. A block freed after record_stream is given back only when the allocator
sees that the reduce-scatter stream got past it; the host enqueues the whole backward long
before that stream has run (on this runtime as on a GPU), so every module's input is held
at once. How many are held is decided by the device's progress (here the modelled clock's:
the same on every run, but it moves with the link, the profile and everything else queued),
not by where the program frees them.
--publish copies comm_buffer.png, summary.json and the first slow record_stream run's
memory_rank0.pickle (gzipped) into logs/record_stream/, which students get.
Needs the solutions (instructors) and matplotlib for the picture.
"""
import argparse
import json
import os
import subprocess
import sys

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest  # the stage folders come from grader/rubric.json
from trace_names import TAG_COMM_BUFFER  # the memory tags (MemTag)
from trace_names import PHASE_BACKWARD, PHASE_POST_BACKWARD, PHASE_PRE_BACKWARD  # the phases (runtime/phase.h)

# (old, new): each old text must occur exactly once in the solution.
RECORD_STREAM = [
    ("    f->rs_state = in; /* the reduce-scatter stream still reads it: kept until compute waited for rs_done */\n",
     "    dev_record_stream(in, f->rs_stream); /* held until the reduce-scatter stream got past it */\n"
     "    dev_free(f->dev, in);\n"),
    ("    /* BEGIN SOLUTION: the optimizer (compute stream) must see every reduce-scatter's output (HANDOUT.md#stage-04) */\n"
     "    release_reduce_scatter_state(f);\n",
     "    /* BEGIN SOLUTION: the optimizer (compute stream) must see every reduce-scatter's output (HANDOUT.md#stage-04) */\n"
     "    dev_stream_wait_event(f->compute, f->rs_done);\n"),
]

LINKS = {"fast": "20", "slow": "0.5"}
RUN_FLAGS = ["--flavor", "debugmodel", "--world", "4", "--seq-len", "128", "--batch-size", "2",
             "--warmup-steps", "2", "--lr", "1e-3", "--link-latency-us", "20", "--profile-steps", "0", "--quiet"]


def fail(msg):
    print("record_stream_demo: " + msg, file=sys.stderr)
    sys.exit(1)


def stage04_solution():
    """The stage-04 solution's path, or one line saying why there is none here."""
    try:
        path = manifest.stage("04").solution_src(ROOT)
    except KeyError:
        fail("grader/rubric.json has no stage 04 (a staged release before it): the demo runs stage 04's solution")
    if not os.path.exists(path):
        fail("%s is missing (the demo needs the solutions: an instructor's checkout)" % path)
    return path


def variant_source(out_dir):
    with open(stage04_solution()) as fh:
        text = fh.read()
    for old, new in RECORD_STREAM:
        if text.count(old) != 1:
            fail("the stage-04 solution changed: this text is not there exactly once:\n" + old)
        text = text.replace(old, new)
    path = os.path.join(out_dir, "hw_fsdp_record_stream.c")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def build(src, binary):
    r = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=" + src, "OUT=" + binary],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        fail("building %s failed:\n%s" % (src, r.stdout + r.stderr))


def comm_replay(run_dir):
    """Rank 0's snapshot replayed: [(allocator event, counted comm_buffer bytes after it)] and the number
    of blocks held after their free (record_stream's free_requested)."""
    with open(os.path.join(run_dir, "memory_rank0.json")) as fh:
        events = json.load(fh)["events"]
    live, now, out = {}, 0, []
    for e in events:
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = (e["tag"], e["size"])
            now += e["size"] if e["tag"] == TAG_COMM_BUFFER else 0
        elif act in ("free", "free_completed") and e["addr"] in live:
            tag, size = live.pop(e["addr"])
            now -= size if tag == TAG_COMM_BUFFER else 0
        else:
            continue
        out.append((e, now))
    return out, sum(1 for e in events if e.get("action") == "free_requested")


def comm_peak(run_dir):
    """The most comm_buffer bytes rank 0 counted at once."""
    return max((now for _, now in comm_replay(run_dir)[0]), default=0)


def comm_series(run_dir, step):
    """Counted comm_buffer bytes of rank 0 after each allocator event of the given step's backward."""
    backward = (PHASE_PRE_BACKWARD, PHASE_POST_BACKWARD, PHASE_BACKWARD)
    return [now for e, now in comm_replay(run_dir)[0]
            if e.get("step") == step and e.get("phase", "").startswith(backward)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "record_stream_demo"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--publish", action="store_true", help="copy the results into logs/record_stream/")
    args = ap.parse_args()
    if args.steps < 2 or args.repeats < 1:
        fail("--steps must be at least 2 and --repeats at least 1")
    os.makedirs(args.out, exist_ok=True)
    binaries = {"state": os.path.join(args.out, "train_state"),
                "record_stream": os.path.join(args.out, "train_record_stream")}
    build(stage04_solution(), binaries["state"])
    build(variant_source(args.out), binaries["record_stream"])

    runs = []
    for variant, binary in binaries.items():
        for link, gbps in LINKS.items():
            for rep in range(args.repeats):
                name = "%s_%s_%d" % (variant, link, rep + 1)
                run_dir = os.path.join(args.out, name)
                cmd = [binary] + RUN_FLAGS + ["--steps", str(args.steps), "--link-gbps", gbps, "--out", run_dir]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if r.returncode != 0:
                    fail("%s failed:\n%s" % (" ".join(cmd), (r.stdout + r.stderr)[-2000:]))
                with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
                    rows = [json.loads(line) for line in fh if line.strip()]
                replay, pending = comm_replay(run_dir)
                runs.append({"name": name, "variant": variant, "link": link, "link_gbps": float(gbps),
                             "peak_bytes_rank0": max(row["peak_mem_bytes_per_rank"][0] for row in rows),
                             "comm_buffer_peak_rank0": max((now for _, now in replay), default=0),
                             "pending_frees_rank0": pending, "dir": run_dir})

    print("%-22s %-5s %14s %18s %14s" % ("run", "link", "peak (bytes)", "comm_buffer peak", "pending frees"))
    for r in runs:
        print("%-22s %-5s %14s %18s %14d" % (r["name"], r["link"], format(r["peak_bytes_rank0"], ","),
                                             format(r["comm_buffer_peak_rank0"], ","), r["pending_frees_rank0"]))
    for variant in binaries:
        peaks = sorted({r["peak_bytes_rank0"] for r in runs if r["variant"] == variant})
        print("%s: %d distinct peak(s) over %d runs: %s" % (variant, len(peaks),
              sum(1 for r in runs if r["variant"] == variant), ", ".join(format(p, ",") for p in peaks)))
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump({"flags": RUN_FLAGS + ["--steps", str(args.steps)], "runs": runs}, fh, indent=1)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping comm_buffer.png")
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    style = {("state", "fast"): "C0-", ("state", "slow"): "C0--",
             ("record_stream", "fast"): "C3-", ("record_stream", "slow"): "C3--"}
    for r in runs:
        if not r["name"].endswith("_1"):
            continue
        ys = [b / 2**20 for b in comm_series(r["dir"], 2)]
        ax.plot(range(len(ys)), ys, style[(r["variant"], r["link"])], drawstyle="steps-post",
                label="%s, %s link (%g Gb/s)" % (r["variant"], r["link"], r["link_gbps"]))
    ax.set_xlabel("allocator event of step 2's backward (host order), rank 0")
    ax.set_ylabel("comm_buffer MiB counted")
    ax.set_title("reduce-scatter inputs: ReduceScatterState vs dev_record_stream")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "comm_buffer.png"), dpi=110)
    plt.close(fig)
    print("wrote %s" % os.path.join(args.out, "comm_buffer.png"))
    if args.publish:
        publish(args.out, runs, args.steps)


def publish(out, runs, steps):
    import gzip
    import shutil
    dest = os.path.join(ROOT, "logs", "record_stream")
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.path.join(out, "comm_buffer.png"), dest)
    keep = [{k: v for k, v in r.items() if k != "dir"} for r in runs]
    with open(os.path.join(dest, "summary.json"), "w") as fh:
        json.dump({"flags": RUN_FLAGS + ["--steps", str(steps)], "made_by": "make record-stream-demo", "runs": keep}, fh, indent=1)
        fh.write("\n")
    with open(os.path.join(out, "record_stream_slow_1", "memory_rank0.pickle"), "rb") as src, \
            gzip.GzipFile(os.path.join(dest, "record_stream_slow_memory_rank0.pickle.gz"), "wb", mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    print("published into %s" % dest)


if __name__ == "__main__":
    main()
