#!/usr/bin/env python3
"""trace_sanity.py RUN_DIR — the per-rank traces (trace_rank*.json) of a run are well formed (make gpu-check):
every slice has a category of trace_names.CATEGORIES and a duration >= 0; the slices of one track (a stream,
or the host's waits) never overlap, since a stream runs one op at a time (0.01 us of slack for the float
rounding of event times); every rank has compute slices, and collectives when the world has more than one
rank. Prints one line per rank; exit 1 on the first broken rule of any rank."""
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grader"))
import trace_names  # noqa: E402
from gradelib.trace_model import read_trace  # noqa: E402

SLACK_US = 0.01


def check(path, world):
    slices = read_trace(path).events
    tracks, cats = {}, {}
    for e in slices:
        if e.get("cat") not in trace_names.CATEGORIES:
            return "slice %r has category %r, not one of %s" % (e.get("name"), e.get("cat"), sorted(trace_names.CATEGORIES))
        if not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0 and isinstance(e.get("ts"), (int, float))):
            return "slice %r has ts %r dur %r" % (e.get("name"), e.get("ts"), e.get("dur"))
        tracks.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        cats[e["cat"]] = cats.get(e["cat"], 0) + 1
    for (pid, tid), evs in tracks.items():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            if b["ts"] < a["ts"] + a["dur"] - SLACK_US:
                return ("track %s: %r [%.3f, +%.3f) overlaps %r at %.3f: one stream runs one op at a time"
                        % (tid, a["name"], a["ts"], a["dur"], b["name"], b["ts"]))
    if not cats.get(trace_names.COMPUTE):
        return "no compute slice"
    if world > 1 and not cats.get(trace_names.COLLECTIVE):
        return "no collective slice at world %d" % world
    return "ok: %d slices on %d tracks (%s)" % (len(slices), len(tracks),
                                                 ", ".join("%s %d" % kv for kv in sorted(cats.items())))


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print("usage: trace_sanity.py RUN_DIR\n\n" + __doc__.split("\n", 1)[1].strip())
        return 0 if len(argv) == 2 else 2
    paths = sorted(glob.glob(os.path.join(argv[1], "trace_rank*.json")))
    if not paths:
        print("trace %s: no trace_rank*.json (was the run profiled? --profile-steps)" % argv[1])
        return 1
    bad = 0
    for p in paths:
        try:
            why = check(p, len(paths))
        except (OSError, ValueError, KeyError) as e:
            why = "unreadable: %s" % e
        print("trace %s: %s" % (os.path.relpath(p), why))
        bad += not why.startswith("ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
