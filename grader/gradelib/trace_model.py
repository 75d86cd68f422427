"""trace_model.py — the one reader of what a run wrote, and the one home of every measure taken from it.

A run directory holds the runtime's files: run.json (what ran: flags, world, mesh, process groups, pipeline
stages, the trace's vocabularies), metrics.jsonl (one line per step), trace_rank<r>.json (one Chrome trace per
rank; a reference log merges them into trace.json.gz, pid = rank) and memory_rank<r>.json (the allocator's
events). Times in a trace are on the world's clock: the modelled one on the CPU backends (the same on every
run), the GPU's on the CUDA backend.

The measures, each defined here only (the grader, plots.py, the bench, simulate.py, fsdp2_check.py and the
tests import them):
  overlap_shares     the share of compute that ran while transfers of one kind were in flight (the overlap checks)
  exposed_comm       the compute stream's time in collectives and waits, by forward / backward / other
  passes_ran         the forwards and backwards of the microbatches in the order they ran (pp_schedule)
  schedule_order     the order a pipeline schedule defines (GPipe, 1F1B), ideal_bubble its idle share
  pipeline_bubble    the stages' mean idle share of one step (pp_bubble, pipeline.png, the bench)
  activation_peaks   the activation bytes live at once per step (a memory snapshot)
checked_slices is the grader's strict reading of a trace a student's run wrote.
"""
import glob
import gzip
import json
import os

from trace_names import (BACKWARD_PHASES, COLLECTIVE, COMPUTE, COMPUTE_TID, FORWARD_PHASES, TAG_ACTIVATION, WAIT,
                         label_and_kind)
from trace_names import PHASE_BACKWARD, PHASE_FORWARD, PHASE_RECOMPUTE  # the phases (runtime/phase.h)

from .util import is_finite, is_int, one_line, short


# ---- reading ----------------------------------------------------------------------------------------

def open_json(path):
    """The JSON document at path, or at path + '.gz'; None when neither exists."""
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            with (gzip.open(p, "rt", encoding="utf-8") if p.endswith(".gz") else open(p, encoding="utf-8")) as fh:
                return json.load(fh)
    return None


class Trace:
    """One trace file: its slices ("ph": "X"), the names of its tracks ({(pid, tid): name}, from the
    thread_name metadata) and its otherData (clock, device_profile, peak_flops, ...)."""

    def __init__(self, doc):
        doc = doc if isinstance(doc, dict) else {"traceEvents": doc or []}
        self.events, self.names = [], {}
        for e in doc.get("traceEvents") or []:
            if not isinstance(e, dict):
                continue
            if e.get("ph") == "X":
                self.events.append(e)
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                self.names[(e.get("pid"), e.get("tid"))] = (e.get("args") or {}).get("name")
        self.meta = doc.get("otherData") or {}


class TraceError(ValueError):
    """A trace that breaks the format the runtime writes (checked_slices): one line naming the file and event."""


def checked_slices(doc, name):
    """The slices ("ph": "X") of trace document `doc` (a file called `name`), each checked to be what the runtime
    writes: a name, finite ts and dur (dur >= 0), args an object whose module/phase/group/op are strings, bytes
    and microbatch non-negative integers, step an integer (present on every collective). TraceError on the first
    that is not."""
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError("%s: traceEvents is not a list" % name)
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceError("%s: event %d is not a JSON object" % (name, i))
        if e.get("ph") != "X":
            continue
        where = "%s: event %d" % (name, i)
        if not isinstance(e.get("name"), str):
            raise TraceError("%s has no name" % where)
        for key in ("ts", "dur"):
            if not is_finite(e.get(key)) or (key == "dur" and e[key] < 0):
                raise TraceError("%s (%s): %s is %s, not a finite%s number" % (
                    where, one_line(e["name"], 80), key, short(e.get(key)), " non-negative" if key == "dur" else ""))
        args = e.get("args")
        if not isinstance(args, dict):  # the runtime gives every slice its args (step, phase, module)
            raise TraceError("%s (%s): args is %s" % (where, one_line(e["name"], 80),
                                                       "missing" if args is None else "not a JSON object"))
        bad = [k for k in ("module", "phase", "group", "op") if k in args and not isinstance(args[k], str)]
        if "bytes" in args and not (is_int(args["bytes"]) and 0 <= args["bytes"] < 2 ** 53):
            bad.append("bytes")
        if "step" in args and not is_int(args["step"]) or e.get("cat") == COLLECTIVE and "step" not in args:
            bad.append("step")
        if "microbatch" in args and not (is_int(args["microbatch"]) and 0 <= args["microbatch"] < 2 ** 31):
            bad.append("microbatch")
        if bad:
            raise TraceError("%s (%s): args.%s is %s" % (where, one_line(e["name"], 80), bad[0],
                                                         short(args.get(bad[0]))))
        out.append(e)
    return out


def read_trace(path):
    """The Trace at path (or path.gz); None when there is none."""
    doc = open_json(path)
    return None if doc is None else Trace(doc)


def by_rank(events):
    """{rank: [slice]} of slices from one or several ranks (pid = rank)."""
    out = {}
    for e in events:
        out.setdefault(e.get("pid"), []).append(e)
    return out


class RunDir:
    """A run directory, read lazily: run_json, metrics, trace(rank), traces() ({rank: [slice]}), meta (rank 0's
    otherData), track_names, memory(rank). A directory with per-rank traces is read from them; a reference log
    from its merged trace.json(.gz)."""

    def __init__(self, path):
        self.path = str(path)
        self._traces = None
        self._meta = {}
        self._names = {}
        self._run_json = None

    def file(self, name):
        return os.path.join(self.path, name)

    @property
    def run_json(self):
        if self._run_json is None:
            self._run_json = open_json(self.file("run.json")) or {}
        return self._run_json

    def metrics(self):
        with open(self.file("metrics.jsonl"), encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def memory(self, rank):
        return open_json(self.file("memory_rank%d.json" % rank))

    def _load(self):
        if self._traces is not None:
            return
        self._traces = {}
        paths = sorted(glob.glob(self.file("trace_rank*.json")) + glob.glob(self.file("trace_rank*.json.gz")))
        if paths:
            for p in paths:
                rank = int(os.path.basename(p)[len("trace_rank"):].split(".")[0])
                t = read_trace(p[:-3] if p.endswith(".gz") else p)
                self._traces[rank] = t.events
                self._names.update(t.names)
                if rank == 0 or not self._meta:
                    self._meta = t.meta
        else:
            t = read_trace(self.file("trace.json"))
            if t is not None:
                self._traces = by_rank(t.events)
                self._names, self._meta = t.names, t.meta

    def traces(self):
        self._load()
        return self._traces

    def trace(self, rank):
        return self.traces().get(rank, [])

    def events(self):
        """Every rank's slices, in rank order."""
        return [e for r in sorted(self.traces()) for e in self.traces()[r]]

    @property
    def meta(self):
        """Rank 0's otherData; read from rank 0's file alone when the traces are not loaded."""
        if self._traces is None:
            t = read_trace(self.file("trace_rank0.json")) or read_trace(self.file("trace.json"))
            return t.meta if t is not None else {}
        return self._meta

    @property
    def track_names(self):
        self._load()
        return self._names


# ---- what the runtime states it used (run.json; common/runtime/facts.h) ------------------------------------

# the keys of the facts the runtime states: run.json's top level and the trace's otherData (facts.h), and run.json's
# rules (common/driver/train_main.c run_rules)
FACT_KEYS = ("groups", "device_mesh", "pipeline", "vocab", "prefetch_schedule")

MADE_BY_RUNTIME = ("world", "shard", "replicate", "stage")  # group kinds: the world, the mesh's, the pipeline's


def runtime_groups(run_json):
    """{name: [world ranks]} of the process groups the runtime made (run.json "groups"): the world, the mesh's
    shard and replicate groups, the pipeline's stage groups; a hw_fsdp.c's own groups (kind "group") left out.
    ValueError when run.json states none (a run that stopped first, or a runtime older than the facts)."""
    groups = run_json.get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("name"), str)
                                               and isinstance(g.get("ranks"), list) for g in groups):
        raise ValueError("run.json states no process groups (\"groups\"): did the run stop before its end?")
    return {g["name"]: list(g["ranks"]) for g in groups if g.get("kind") in MADE_BY_RUNTIME}


def group_kinds(run_json):
    """{name: kind} of every process group run.json states (kind "group": one a hw_fsdp.c made itself)."""
    groups = run_json.get("groups")
    return {g["name"]: g.get("kind") for g in (groups if isinstance(groups, list) else [])
            if isinstance(g, dict) and isinstance(g.get("name"), str)}


def group_of(run_json, rank, kind):
    """The name of the runtime's group of `kind` ("shard", "replicate", "stage") that holds `rank`, or None."""
    groups = run_json.get("groups")
    for g in groups if isinstance(groups, list) else []:
        if isinstance(g, dict) and g.get("kind") == kind and isinstance(g.get("ranks"), list) and rank in g["ranks"]:
            return g.get("name") if isinstance(g.get("name"), str) else None
    return None


def stage_modules(run_json):
    """[[module names of stage p, forward order]] of a --pp run (run.json "pipeline"); None without --pp."""
    stages = run_json.get("pipeline")
    if stages is None:
        return None
    return [list(s["modules"]) for s in sorted(stages, key=lambda s: s["stage"])]


# ---- what a slice is -------------------------------------------------------------------------------

def phase_group(phase):
    """'forward', 'backward' or 'other' (data, optimizer, the grad norm, ...) of a slice's args.phase."""
    return "forward" if phase in FORWARD_PHASES else "backward" if phase in BACKWARD_PHASES else "other"


def is_compute_kernel(e):
    """A kernel on the rank's compute stream."""
    return e.get("cat") == COMPUTE and e.get("tid") == COMPUTE_TID


def is_exposed_comm(e):
    """Time the compute stream spent in a collective or stalled on an event: communication the step did not
    hide behind compute."""
    return e.get("tid") == COMPUTE_TID and e.get("cat") in (COLLECTIVE, WAIT)


def step_of(e):
    return (e.get("args") or {}).get("step")


# ---- intervals --------------------------------------------------------------------------------------

def union_intervals(intervals):
    """The sorted disjoint union of [a, b) intervals, as [[a, b]]."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def covered(a, b, merged):
    """Length of [a, b) covered by the sorted disjoint intervals `merged`."""
    total = 0.0
    for x, y in merged:
        if y <= a:
            continue
        if x >= b:
            break
        total += min(y, b) - max(x, a)
    return total


def spans(events):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


# ---- overlap and exposed communication -----------------------------------------------------------------

def transfers(traces, cat, kind, labels=None):
    """{rank: [slice]} of the transfers of one kind in the training steps (args.step >= 0): collectives (cat
    COLLECTIVE) named "<label>.<kind>", or copies (cat COPY) named "<module>.<h2d|d2h>"; with `labels`, only
    those whose label is one of them (e.g. the modules: not the grad norm's all-reduce)."""
    out = {}
    for r, trace in traces.items():
        for e in trace:
            if e.get("cat") != cat or (e.get("args") or {}).get("step", -1) < 0:
                continue
            label, k = label_and_kind(e["name"])
            if k == kind and (labels is None or label in labels):
                out.setdefault(r, []).append(e)
    return out


def overlap_shares(traces, transfers, phases):
    """(compute_share, collective_share, compute_total) of transfers running beside compute.

    traces     {rank: [slice]}: each rank's trace
    transfers  {rank: [slice]}: the transfers measured (collectives or copies of one kind)
    phases     the phases (args.phase) of the compute-stream kernels measured

    compute_share     of the ranks' compute-stream kernels in `phases` (durations summed over ranks), the share
                      that ran while one of the rank's transfers was in flight on another stream
    collective_share  of the union of each rank's transfer slices, the share during which its compute stream
                      ran a kernel (any phase)
    A transfer on the compute stream runs between that stream's kernels, never beside them: it is left out of
    what can cover them (ts and dur are rounded to the nanosecond, so back-to-back slices of one stream may
    touch by 1 ns)."""
    compute_total = compute_covered = comm_total = comm_covered = 0.0
    for r, trace in traces.items():
        kernels = [e for e in trace if is_compute_kernel(e)]
        mine = transfers.get(r, [])
        in_flight = union_intervals(spans(mine))
        beside = union_intervals(spans(e for e in mine if e.get("tid") != COMPUTE_TID))
        busy = union_intervals(spans(kernels))
        for e in kernels:
            if (e.get("args") or {}).get("phase") in phases:
                compute_total += e["dur"]
                compute_covered += covered(e["ts"], e["ts"] + e["dur"], beside)
        comm_total += sum(b - a for a, b in in_flight)
        comm_covered += sum(covered(a, b, busy) for a, b in beside)
    return (compute_covered / compute_total if compute_total > 0 else 0.0,
            comm_covered / comm_total if comm_total > 0 else 0.0, compute_total)


def exposed_comm(events):
    """{'forward', 'backward', 'other': microseconds} the compute stream spent in collectives and waits among
    `events` (one rank's slices, e.g. of one step), by phase_group."""
    out = {"forward": 0.0, "backward": 0.0, "other": 0.0}
    for e in events:
        if is_exposed_comm(e):
            out[phase_group((e.get("args") or {}).get("phase"))] += e["dur"]
    return out


# ---- pipeline schedules -----------------------------------------------------------------------------

PASS_PHASES = {PHASE_FORWARD: "F", PHASE_BACKWARD: "B"}  # a pass's kernels: args.phase -> its letter
BUSY_PHASES = (PHASE_FORWARD, PHASE_BACKWARD, PHASE_RECOMPUTE)  # the kernels that count as a stage's work in the bubble


def schedule_order(P, M, stage, schedule):
    """[('F', mb) / ('B', mb)]: stage's forwards and backwards of M microbatches in the order the schedule
    defines. GPipe: every forward, then the backwards B0 .. B(M-1) (torch's ScheduleGPipe order); 1F1B:
    min(P-1-stage, M) warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    w = min(P - 1 - stage, M)
    out = [("F", m) for m in range(w)]
    for k in range(M - w):
        out += [("F", w + k), ("B", k)]
    return out + [("B", m) for m in range(M - w, M)]


def held(order):
    """The most microbatches whose forward ran and whose backward had not, along `order`."""
    n = best = 0
    for what, _ in order:
        n += 1 if what == "F" else -1
        best = max(best, n)
    return best


def ideal_bubble(P, M):
    """The share of a step a pipeline of P equal stages idles over M microbatches when transfers are free:
    (P-1)/(M+P-1)."""
    return (P - 1) / (M + P - 1)


def passes_ran(trace, step):
    """[('F', mb) / ('B', mb)]: the forwards and backwards whose compute ran in `step` on one rank, in time order
    (consecutive kernels of one microbatch's pass collapsed)."""
    out = []
    for e in sorted((e for e in trace if e.get("cat") == COMPUTE and e["args"].get("step") == step
                     and e["args"].get("phase") in PASS_PHASES and is_int(e["args"].get("microbatch"))),
                    key=lambda e: e["ts"]):
        token = (PASS_PHASES[e["args"]["phase"]], e["args"]["microbatch"])
        if not out or out[-1] != token:
            out.append(token)
    return out


def pipeline_bubble(traces, step, world, ranks=None):
    """(bubble, window) of one step: the mean over the world's ranks of the share of the window their compute
    idles. The window runs from the step's first forward kernel on any rank to its last backward kernel; a
    rank's busy time is the union of its forward, backward and recompute kernels inside it. (None, 0.0) when
    the step ran no such kernel. ranks: the ranks that stand for the world (default all of them), e.g. one
    traced rank per pipeline stage when the others recorded no trace, or a dry run's representative ranks
    (run.json "executed_ranks": one per stage); each stage's ranks are alike, so the mean over them is the
    world's."""
    ranks = list(range(world)) if ranks is None else list(ranks)
    busy = {}
    lo = hi = None
    for r in ranks:
        busy[r] = union_intervals(spans(e for e in traces.get(r, []) if e.get("cat") == COMPUTE
                                        and e["args"].get("step") == step and e["args"].get("phase") in BUSY_PHASES))
        for a, b in busy[r]:
            lo = a if lo is None or a < lo else lo
            hi = b if hi is None or b > hi else hi
    if lo is None or hi <= lo:
        return None, 0.0
    idle = [1.0 - sum(b - a for a, b in busy[r]) / (hi - lo) for r in ranks]
    return sum(idle) / len(ranks), hi - lo


# ---- memory -----------------------------------------------------------------------------------------

def activation_peaks(events, steps, tag=TAG_ACTIVATION):
    """{step: [peak live bytes tagged `tag`, live at the step's start, live at its end]} of the training steps
    0 .. steps-1, replaying a memory snapshot's events in order."""
    live, cur, out = {}, 0, {}

    def apply(e):
        nonlocal cur
        addr = e.get("addr")
        if e.get("action") == "alloc" and e.get("tag") == tag and is_int(addr) and is_int(e.get("size")):
            live[addr] = e["size"]
            cur += e["size"]
            return True
        if e.get("action") in ("free", "free_completed") and addr in live:
            cur -= live.pop(addr)
            return True
        return False

    for e in events:
        step = e.get("step")
        if not is_int(e.get("addr")) or not is_int(step) or not 0 <= step < steps:
            apply(e)
            continue
        if step not in out:
            out[step] = [cur, cur, cur]
        if apply(e):
            out[step][0] = max(out[step][0], cur)
            out[step][2] = cur
    return out
