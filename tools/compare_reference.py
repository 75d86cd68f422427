#!/usr/bin/env python3
"""compare_reference.py OLD NEW — do two reference trees (logs/reference/ and a fresh `make reference
--out`) hold the same runs? `make reference-check` runs it on logs/reference/ and a rebuild.

It compares what the program determines, bit for bit, and leaves out what the machine does:
  metrics.jsonl        every field but step_ms and tokens_per_s (wall clock; model_step_ms is compared);
                       the BLAS-dependent ones (loss, grad_norm, the clip coefficients) within the band measured
                       across OpenBLAS kernels (grader/figures/parity_spread.json: band, per stage, run and
                       metric; tools/parity_spread.py; never below float32's resolution 2**-23), since another
                       machine's OpenBLAS picks another kernel and rounds differently in the last bits: each
                       file is reported as equal or within the band
  run.json             every field but host
  dtensors_rank*.json  all of it
  memory_rank*.json.gz every field but addr and reserved_bytes (the heap's); time_us is the host's
                       modelled time, compared; the allocations live at the end in allocation order,
                       not by address; the numbers of the "grad_state" notes (gradient sums of squares and
                       dot products, BLAS-dependent) within the run's grad_state_band, the same way
  trace.json.gz        all of it (otherData, each track's slices in order with their ts and dur on
                       the modelled clock, the stream waits and host syncs, which are traced iff they
                       stalled in modelled time) but the slices' wall-clock args (wall_ts_us, wall_dur_us)
A file of OLD missing from NEW is a difference; exit status 1 when anything differs. The facts a run states
(FACT_KEYS: run.json's and the trace's otherData "groups", "device_mesh", "pipeline", "vocab"; run.json's rule
"prefetch_schedule") are compared where OLD has them; where OLD was written before the runtime stated them,
NEW's are new, said once, not compared.

--rubric FILE reads the bands from another rubric (default grader/rubric.json; a rubric without them compares
every value bit for bit)."""
import argparse
import glob
import gzip
import json
import os
import sys

import repo_paths  # noqa: F401  (grader/ on sys.path: the trace's words)
import manifest
from gradelib.rubric import MAIN_RUN, RUBRIC_PATH, SPREAD_FLOOR
from gradelib.trace_model import FACT_KEYS
from gradelib.util import rel
from trace_names import WALL_ARGS

WALL_CLOCK_METRICS = ("step_ms", "tokens_per_s")
# The metrics a BLAS kernel's rounding reaches, each with the parity_spread metric whose band bounds it (a clip
# coefficient is max_norm / grad_norm: the grad norm's relative band).
BLAS_METRICS = {"loss": "loss", "grad_norm": "grad_norm", "clip_coef_min_per_rank": "grad_norm",
                "clip_coef_max_per_rank": "grad_norm"}
MACHINE_FIELDS = {"addr", "reserved_bytes"}


def read_text(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def metrics(text):
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK_METRICS} for row in rows]


class Bands:
    """The measured BLAS band of each (stage, run, metric) from the rubric's parity_spread figures; a run they
    does not hold (a reference run the grader does not grade, e.g. stage05/no_ac) gets the largest band of that
    metric over all runs, and says so."""

    def __init__(self, rubric_path):
        # the rubric with its measured figures (grader/figures/parity_spread.json beside it); ManifestError is a
        # ValueError: main says it in one line
        runs = (manifest.load(rubric_path).get("parity_spread") or {}).get("runs") or {}
        self.runs = runs if isinstance(runs, dict) else {}
        self.widest = {}  # (metric, field) -> the largest over all runs
        for by_run in self.runs.values():
            for by_metric in (by_run or {}).values():
                for metric, f in (by_metric or {}).items():
                    for field in ("band", "grad_state_band"):
                        b = f.get(field) if isinstance(f, dict) else None
                        if isinstance(b, (int, float)) and b >= 0:
                            self.widest[metric, field] = max(self.widest.get((metric, field), 0.0), float(b))

    def band(self, where, metric, field="band"):
        """(band, how it was chosen) of `metric` for the run in the tree folder `where` ("stage02/uneven"): its
        measured `field` ("band", or "grad_state_band" for the memory snapshots' gradient probes, a grad_norm
        field), else the widest of any run; never below float32's resolution 2**-23 (tools/parity_spread.py
        blas_band says why)."""
        parts = where.split(os.sep)
        stage = parts[0][len("stage"):] if parts and parts[0].startswith("stage") else None
        run = parts[1] if len(parts) > 1 else MAIN_RUN
        f = ((self.runs.get(stage) or {}).get(run) or {}).get(metric)
        if isinstance(f, dict) and isinstance(f.get(field), (int, float)):
            band, how = float(f[field]), "stage %s %s" % (stage, run)
        elif (metric, field) in self.widest:
            band, how = self.widest[metric, field], "the widest of any run"
        else:
            band, how = 0.0, "none measured"
        if band < SPREAD_FLOOR:
            return SPREAD_FLOOR, how + ", at least float32's resolution 2**-23"
        return band, how

    def measured(self):
        """Does the rubric hold any band? (Without, every value is compared bit for bit.)"""
        return any(field == "band" for _, field in self.widest)


def compare_metrics(a, b, name, bands, notes):
    """The first difference between two metrics files' rows (None: the same program), the BLAS-dependent values
    within their band; a value that differs within its band adds one line to notes."""
    if len(a) != len(b):
        return "%d steps vs %d" % (len(a), len(b))
    where = os.path.dirname(name)
    worst = {}
    for i, (x, y) in enumerate(zip(a, b)):
        exact_x = {k: v for k, v in x.items() if k not in BLAS_METRICS}
        exact_y = {k: v for k, v in y.items() if k not in BLAS_METRICS}
        if exact_x != exact_y:
            return "step %s: %s" % (x.get("step", i + 1), first_difference(exact_x, exact_y))
        for key, metric in BLAS_METRICS.items():
            if (key in x) != (key in y):
                return "step %s: %s only in one" % (x.get("step", i + 1), key)
            if key not in x:
                continue
            u, v = x[key], y[key]
            if u == v:
                continue
            us, vs = (u, v) if isinstance(u, list) and isinstance(v, list) else ([u], [v])
            if len(us) != len(vs) or not all(isinstance(t, (int, float)) for t in us + vs):
                return "step %s: %s: %s" % (x.get("step", i + 1), key, first_difference(u, v))
            band, how = bands.band(where, metric) if bands.measured() else (0.0, "no band in the rubric")
            for p, q in zip(us, vs):
                d = max(rel(q, p), rel(p, q))
                if d > band:
                    return ("step %s: %s %.9g vs %.9g (rel %.3g): beyond the BLAS band %.3g (%s)"
                            % (x.get("step", i + 1), key, p, q, d, band, how))
                if d > worst.get(key, (0.0,))[0]:
                    worst[key] = (d, band, how)
    if worst:
        hows = {how for _, _, how in worst.values()}
        notes.append("within the BLAS band: %s: %s (%s)" % (name, ", ".join(
            "%s rel %.3g <= %.3g" % (key, d, band) for key, (d, band, _) in worst.items()), "; ".join(sorted(hows))))
    return None


def without_new_facts(a, b, name, new_facts):
    """b without the FACT_KEYS that a (the older reference) lacks, at run.json's top level and in the trace's
    otherData; each key left out is added to new_facts as "name: key"."""
    def strip(x, y, where):
        if not (isinstance(x, dict) and isinstance(y, dict)):
            return y
        gone = [k for k in FACT_KEYS if k in y and k not in x]
        new_facts.update("%s: %s%s" % (name, where, k) for k in gone)
        return {k: v for k, v in y.items() if k not in gone}
    b = strip(a, b, "")
    if isinstance(a, dict) and isinstance(b, dict) and "otherData" in b:
        b = dict(b, otherData=strip(a.get("otherData"), b["otherData"], "otherData."))
    return b


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


def beyond_band(a, b, band, worst, where=""):
    """Where a and b first differ other than by numbers within band (relative), or None; worst[0]: the largest
    relative difference of the numbers seen. A count (a JSON integer on both sides) stays exact."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return "%s keys %s vs %s" % (where, list(a), list(b))
        return next((w for w in (beyond_band(a[k], b[k], band, worst, "%s%s: " % (where, k)) for k in a) if w), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return "%s%d items vs %d" % (where, len(a), len(b))
        return next((w for w in (beyond_band(x, y, band, worst, "%s[%d] " % (where, i))
                                 for i, (x, y) in enumerate(zip(a, b))) if w), None)
    if (isinstance(a, float) or isinstance(b, float)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        d = max(rel(a, b), rel(b, a))
        worst[0] = max(worst[0], d)
        return None if d <= band else "%s%r vs %r (rel %.3g)" % (where, a, b, d)
    return None if a == b else "%s%.150s vs %.150s" % (where, json.dumps(a), json.dumps(b))


def compare_memory(a, b, name, bands, notes):
    """The first difference between two memory snapshots (None: the same program): every field exactly but the
    numbers of the grad_state notes, within the run's grad_state_band."""
    if {k: v for k, v in a.items() if k != "events"} != {k: v for k, v in b.items() if k != "events"}:
        return first_difference({k: v for k, v in a.items() if k != "events"},
                                {k: v for k, v in b.items() if k != "events"})
    ea, eb = a.get("events") or [], b.get("events") or []
    if len(ea) != len(eb):
        return "events: %d vs %d" % (len(ea), len(eb))
    band, how = (bands.band(os.path.dirname(name), "grad_norm", "grad_state_band") if bands.measured() else
                 (0.0, "no band in the rubric"))
    worst = [0.0]
    for i, (x, y) in enumerate(zip(ea, eb)):
        if x == y:
            continue
        if x.get("kind") == "grad_state" == y.get("kind"):
            why = beyond_band(x, y, band, worst)
            if why is None:
                continue
            return "events: [%d] (grad_state) %s: beyond the BLAS band %.3g (%s)" % (i, why, band, how)
        return "events: [%d] %s" % (i, first_difference(x, y))
    if worst[0] > 0:
        notes.append("within the BLAS band: %s: grad_state rel %.3g <= %.3g (%s)" % (name, worst[0], band, how))
    return None


def compare(old, new, out=sys.stdout, bands=None):
    """(files compared, files that differ, values within the BLAS band), printing one line per difference and
    one per metrics file whose BLAS-dependent values differ within their band."""
    bands = bands or Bands(RUBRIC_PATH)
    compared = differ = 0
    notes, new_facts = [], set()
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
                if read in (run_config, trace_tracks):
                    b = without_new_facts(a, b, name, new_facts)
                if a == b:
                    continue
                why = (compare_metrics(a, b, name, bands, notes) if read is metrics else
                       compare_memory(a, b, name, bands, notes) if read is memory_snapshot else first_difference(a, b))
                if why is not None:
                    differ += 1
                    out.write("differs: %s: %s\n" % (name, why))
    for line in notes:
        out.write(line + "\n")
    if new_facts:
        keys = sorted({f.rsplit(": ", 1)[1] for f in new_facts})
        out.write("new, not compared (absent from %s, which predates them): %s in %d files\n"
                  % (old, ", ".join(keys), len({f.rsplit(": ", 1)[0] for f in new_facts})))
    return compared, differ, len(notes)


def manifest_core(tree):
    """The OpenBLAS core type the tree's MANIFEST.json says its runs used (make_reference.py), or "not recorded"."""
    try:
        with open(os.path.join(tree, "MANIFEST.json"), encoding="utf-8") as fh:
            machine = json.load(fh).get("machine") or {}
    except (OSError, ValueError, AttributeError):
        return "not recorded"
    core = machine.get("openblas_core") if isinstance(machine, dict) else None
    return core if isinstance(core, str) and core != "unknown" else "not recorded"


def main(argv=None):
    ap = argparse.ArgumentParser(description="Compare two reference trees on what the program determines.")
    ap.add_argument("old", help="the published tree (logs/reference)")
    ap.add_argument("new", help="a rebuilt tree (make_reference.py --out DIR)")
    ap.add_argument("--rubric", default=RUBRIC_PATH, help="the rubric whose parity_spread bands (figures/parity_spread.json beside it) bound the "
                    "BLAS-dependent metrics (default grader/rubric.json)")
    args = ap.parse_args(argv)
    for d in (args.old, args.new):
        if not os.path.isdir(d):
            ap.error("%s is not a folder" % d)
    try:
        bands = Bands(args.rubric)
    except (OSError, ValueError, AttributeError) as e:
        ap.error("cannot read the bands from %s (%s)" % (args.rubric, getattr(e, "strerror", None) or e))
    cores = [manifest_core(d) for d in (args.old, args.new)]
    print("OpenBLAS core: %s wrote %s, %s wrote %s%s" % (
        args.old, cores[0], args.new, cores[1], "" if cores[0] == cores[1] != "not recorded" else
        ": the BLAS-dependent values are compared within the measured band, everything else bit for bit"))
    compared, differ, within = compare(args.old, args.new, bands=bands)
    if not compared:
        ap.error("%s holds no reference files" % args.old)
    print("%d files compared, %d differ%s" % (
        compared, differ, "; %d file%s equal only within the BLAS band (another OpenBLAS kernel: the loss, grad "
        "norm, clip coefficients and gradient-state probes; everything else bit for bit)" % (
            within, "" if within == 1 else "s")
        if within else " (bit for bit)"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
