#!/usr/bin/env python3
"""compare_reference.py OLD NEW — do two reference trees (logs/reference/ and a fresh `make reference
--out`) hold the same runs? `make reference-check` runs it on logs/reference/ and a rebuild.

It compares what the program determines, bit for bit, and leaves out what the machine does:
  metrics.jsonl        every field but step_ms and tokens_per_s (wall clock; model_step_ms is compared)
  run.json             every field but host
  dtensors_rank*.json  all of it
  memory_rank*.json.gz every field but addr and reserved_bytes (the heap's); time_us is the host's
                       modelled time, compared; the allocations live at the end in allocation order,
                       not by address
  trace.json.gz        all of it (otherData, each track's slices in order with their ts and dur on
                       the modelled clock, the stream waits and host syncs, which are traced iff they
                       stalled in modelled time) but the slices' wall-clock args (wall_ts_us, wall_dur_us)
A file of OLD missing from NEW is a difference; exit status 1 when anything differs."""
import argparse
import glob
import gzip
import json
import os
import sys

import repo_paths  # noqa: F401  (grader/ on sys.path: the trace's words)
from trace_names import WALL_ARGS

WALL_CLOCK_METRICS = ("step_ms", "tokens_per_s")
MACHINE_FIELDS = {"addr", "reserved_bytes"}


def read_text(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def metrics(text):
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK_METRICS} for row in rows]


def run_config(text):
    return {k: v for k, v in json.loads(text).items() if k != "host"}


def without(value, keys):
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


def memory_snapshot(text):
    snap = without(json.loads(text), MACHINE_FIELDS)
    for key in ("live_at_end", "host_live_at_end"):
        if key in snap:
            snap[key] = sorted(snap[key], key=lambda a: a["seq"])
    return snap


def trace_tracks(text):
    """The trace's top level (otherData: the clock and the device profile) and its events by track, in file
    order (the runtime writes them sorted by track), each whole but for its wall-clock args."""
    trace = json.loads(text)
    out = {k: v for k, v in trace.items() if k != "traceEvents"}
    for e in trace["traceEvents"]:
        if isinstance(e.get("args"), dict):
            e = dict(e, args={k: v for k, v in e["args"].items() if k not in WALL_ARGS})
        out.setdefault("pid %s tid %s" % (e.get("pid"), e.get("tid")), []).append(e)
    return out


READERS = [("metrics.jsonl", metrics), ("run.json", run_config), ("dtensors_rank*.json", json.loads),
           ("memory_rank*.json.gz", memory_snapshot), ("trace.json.gz", trace_tracks)]


def first_difference(a, b):
    """A short description of where a and b first differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return "%s: %s" % (k, first_difference(a.get(k), b.get(k)))
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return "[%d] %s" % (i, first_difference(x, y))
        if len(a) != len(b):
            return "%d items vs %d" % (len(a), len(b))
    return "%.150s vs %.150s" % (json.dumps(a), json.dumps(b))


def compare(old, new, out=sys.stdout):
    """(files compared, files that differ), printing one line per difference."""
    compared = differ = 0
    for root, _dirs, _files in sorted(os.walk(old)):
        rel = os.path.relpath(root, old)
        for pattern, read in READERS:
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                name = os.path.normpath(os.path.join(rel, os.path.basename(path)))
                other = os.path.join(new, name)
                compared += 1
                if not os.path.exists(other):
                    differ += 1
                    out.write("missing in %s: %s\n" % (new, name))
                    continue
                a, b = read(read_text(path)), read(read_text(other))
                if a != b:
                    differ += 1
                    out.write("differs: %s: %s\n" % (name, first_difference(a, b)))
    return compared, differ


def main(argv=None):
    ap = argparse.ArgumentParser(description="Compare two reference trees on what the program determines.")
    ap.add_argument("old", help="the published tree (logs/reference)")
    ap.add_argument("new", help="a rebuilt tree (make_reference.py --out DIR)")
    args = ap.parse_args(argv)
    for d in (args.old, args.new):
        if not os.path.isdir(d):
            ap.error("%s is not a folder" % d)
    compared, differ = compare(args.old, args.new)
    if not compared:
        ap.error("%s holds no reference files" % args.old)
    print("%d files compared, %d differ" % (compared, differ))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
