#!/usr/bin/env python3
"""Pictures of a run directory (written by `train --out DIR`).

    plots.py RUN [--ref REF_RUN] [--out DIR] [--step N] [--rank R]

writes into DIR (default RUN/plots), every title numbering steps from 1 as metrics.jsonl does:
  loss.png      loss, grad norm and peak memory per step: your run, and with --ref the
                reference (dashed); peak memory per rank where the ranks differ by over 1 %.
                Not for a dry run (no loss: its peak memory is memory.png's)
  timeline.png  one row per (rank, stream) for one step on the trace's clock (the modelled
                clock on the CPU): compute, copies, collectives; a wait only where it stalls
                the compute stream (a stream waiting for its input with compute busy is idle,
                not stalled); the host's waits pale where it runs ahead of the device, bright
                where it blocks and compute runs dry; the forward, backward and optimizer
                phases along the top (a pipeline: its passes as one span, each compute row
                naming its own, F3, B0); module names on the slices wide enough to hold them;
                at most 8 ranks
  memory.png    rank R's allocated bytes over the run (host order, step by step), stacked by
                tag, with the peak marked; with --ref the reference's total as a dashed line;
                the device's memory where the peak comes near it (a dry run on a profile)
  groups.png    for a run with process groups other than the world (a 2-D mesh, a pipeline):
                every rank's collectives of one step coloured by group (shard groups orange,
                replicate groups purple, each pipeline stage's its own colour, the world's
                dark, the sends between stages grey), titled with what ran in which
  backward.png  only for a run with a backward-prefetch policy other than pre or
                one comm stream (stage 10): rank R's streams during one step's
                backward, each collective labelled with its module
  pipeline.png  only for a pipeline run (--pp, stages 11-12): one row per rank, each
                microbatch's forward (F) and backward (B) through the rank's stage as
                one bar on the trace's clock, the idle gaps between them the bubble
A run directory's bulky files may be gzip'd (logs/reference/: trace.json.gz, memory_rank0.json.gz).
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import math
import os
import sys

import repo_paths  # noqa: F401  (grader/ on sys.path, for trace_names)
from gradelib.trace_model import BUSY_PHASES, RunDir, by_rank, group_kinds, ideal_bubble, open_json, pipeline_bubble
from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, BARRIER, BROADCAST, COLLECTIVE, COMPUTE, COMPUTE_TID,
                         COPY, EVENT, FORWARD_PHASES, HOST_SYNC, HOST_TID, MEMSET, P2P, REDUCE_SCATTER, WAIT,
                         label_and_kind)
from trace_names import PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_P2P  # the phases (runtime/phase.h)

DPI = 110


# ---- reading a run directory --------------------------------------------------------------------

def load_metrics(run):
    return RunDir(run).metrics()


def load_trace(run):
    """(slices, {(rank, tid): stream name}, otherData) of a run: its per-rank traces, else trace.json(.gz)."""
    r = RunDir(run)
    return r.events(), r.track_names, r.meta


def run_name(path):
    return os.path.basename(os.path.normpath(path))


# ---- one legend vocabulary: every plot names and colours the lines the same way -----------------

RANK_COLORS = ["#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def your_run(name):
    return {"label": "your run (%s)" % name, "color": "#1f77b4", "ls": "-", "lw": 1.6}


def reference(name):
    return {"label": "reference (%s)" % name, "color": "black", "ls": "--", "lw": 1.2}


def rank_line(ranks):
    """Your run's line of one rank, or of ranks with the same values ('ranks 0, 1, 3'), in the first one's colour."""
    return {"label": "rank%s %s" % ("s" if len(ranks) > 1 else "", ", ".join(map(str, ranks))),
            "color": RANK_COLORS[ranks[0] % len(RANK_COLORS)], "ls": "-", "lw": 1.2}


# ---- loss.png -----------------------------------------------------------------------------------

STEP_PANELS = [("loss", "loss", "", 1.0), ("grad_norm", "grad norm (before clipping)", "", 1.0),
               ("peak_mem_bytes", "peak memory", " (MiB)", 2.0 ** -20)]


def per_rank(rows, key):
    """[(ranks, values per step)] of key_per_rank, the ranks with equal values together, when some rank differs
    from another by more than 1 %; else None."""
    lists = [r.get(key + "_per_rank") for r in rows]
    if not lists or any(not v for v in lists):
        return None
    if all(max(v) - min(v) <= 0.01 * abs(max(v)) for v in lists):
        return None
    lines = {}
    for rank in range(len(lists[0])):
        lines.setdefault(tuple(v[rank] for v in lists), []).append(rank)
    return sorted((ranks, list(values)) for values, ranks in lines.items())


def draw_steps(plt, rows, ref_rows, name, ref_name):
    """loss.png's figure: one panel per metric of STEP_PANELS the run has, one legend for them all."""
    panels = [p for p in STEP_PANELS if any(r.get(p[0]) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 0.6, 4.2), squeeze=False)
    marker = "o" if len(rows) <= 30 else None  # dots while they can be told apart

    def points(rs, key):
        rs = [r for r in rs if r.get(key) is not None]
        return [r["step"] for r in rs], rs
    for ax, (key, title, unit, scale) in zip(axes[0], panels):
        steps, rs = points(rows, key)
        ranks = per_rank(rs, key)
        for group, ys in ranks or []:
            ax.plot(steps, [y * scale for y in ys], marker=marker, ms=3, **rank_line(group))
        if not ranks:
            ax.plot(steps, [r[key] * scale for r in rs], marker=marker, ms=4, **your_run(name))
        ref_steps, ref_rs = points(ref_rows or [], key)
        if ref_rs:
            ax.plot(ref_steps, [r[key] * scale for r in ref_rs], **reference(ref_name))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_title(title + (" per rank" if ranks else "") + unit)
        ax.grid(alpha=0.3)
    legend = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    fig.legend(list(legend.values()), list(legend.keys()), loc="upper center", ncol=min(len(legend), 6),
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def trains(rows):
    """Whether a run's metrics.jsonl has a loss: a --dry-run computes none (loss and grad norm null), and its one
    per-step figure, the peak memory, is memory.png's (with the device's capacity) and the report's."""
    return any(r.get("loss") is not None or r.get("grad_norm") is not None for r in rows)


def plot_loss(plt, run, ref, out):
    rows = load_metrics(run)
    if not trains(rows):
        print("%s is a dry run (no loss, no grad norm): no loss.png; its peak memory is in memory.png" % run)
        return
    fig = draw_steps(plt, rows, load_metrics(ref) if ref else None, run_name(run), run_name(ref) if ref else None)
    fig.savefig(os.path.join(out, "loss.png"), dpi=DPI)
    plt.close(fig)


# ---- timeline.png -------------------------------------------------------------------------------

# (category, what the legend calls it, colour), in the legend's order; an event record is zero-length: not drawn.
# A wait is drawn only where it stalls the compute stream (wait_stalls); a host wait in a pale colour where the host
# is ahead of the device, in its own where the compute stream idles because the host blocks (host_stalls).
TRACK_STYLE = [(COMPUTE, "compute (a kernel)", "#4C72B0"), (COLLECTIVE, "collective", "#DD8452"),
               (COPY, "copy", "#8C8C8C"), (MEMSET, "memset", "#B0B0B0"),
               (WAIT, "a wait that stalls compute", "#C44E52"),
               (HOST_SYNC, "host ahead, waits for the device", "#EFE2A6")]
HOST_STALL, HOST_STALL_WORDS, HOST_STALL_COLOUR = "host_stall", "host blocks, compute idle", "#E6A800"
CAT_COLORS = dict([(cat, colour) for cat, _, colour in TRACK_STYLE], **{EVENT: "#55A868"})
CAT_COLORS[HOST_STALL] = HOST_STALL_COLOUR
PHASE_COLORS = {"forward": "#D6E4F0", "backward": "#F6DCC8", "optimizer": "#D5ECD4", "passes": "#E4DCEB"}
LABEL_PT = 7  # module names on the slices
PHASE_PT = 8  # the phase band's labels
SHORT_KINDS = {ALL_GATHER: "AG", REDUCE_SCATTER: "RS", ALL_REDUCE: "AR", BROADCAST: "BC"}
MAX_RANKS = 8  # the timeline draws at most this many ranks (drawn_ranks)
TOL_US = 0.01  # the trace's times are rounded to the nanosecond: a wait ends where its record is, to 10 ns


def step_of(e):
    return e.get("args", {}).get("step", -1)


def pick_step(events, step):
    """step (the trace's args.step, from 0), or by default a traced step in the middle (past the warm-up); -1
    when no slice has a step."""
    steps = sorted({step_of(e) for e in events if step_of(e) >= 0})
    if step is not None:
        return step
    return steps[len(steps) // 2] if steps else -1


def clock_words(meta):
    """What the trace's ts are: otherData.clock 'model' (the CPU backends), 'gpu' (CUDA); older traces: wall time."""
    clock = meta.get("clock")
    if clock == "model":
        return "modelled time on profile %s" % meta.get("device_profile", "?")
    return "GPU time" if clock == "gpu" else "wall time"


def time_unit(span_us):
    """(name, µs per unit) for an axis spanning span_us: ms from 5 ms up, else µs."""
    return ("ms", 1000.0) if span_us >= 5000 else ("µs", 1.0)


def duration_words(us):
    """'630 µs', '116.2 ms', '10,470 ms': a duration as a student reads it (no exponent)."""
    if us < 1000:
        return "%.0f µs" % us
    return "{:,.1f} ms".format(us / 1000.0) if us < 1e6 else "{:,.0f} ms".format(us / 1000.0)


def is_pipeline(meta):
    """A --pp run: its trace's otherData states the pipeline's stages."""
    return bool(meta.get("pipeline"))


def phase_group(phase):
    if phase in FORWARD_PHASES:
        return "forward"
    if phase in BACKWARD_PHASES:
        return "backward"
    return "optimizer" if phase == PHASE_OPTIMIZER else None


def pass_of(e):
    """('F' | 'B', microbatch) of a compute kernel in a microbatch's forward or backward (--ac's recompute is part
    of the backward, as in pipeline.png), else None."""
    a = e.get("args", {})
    group = phase_group(a.get("phase"))
    if group not in ("forward", "backward") or not isinstance(a.get("microbatch"), int):
        return None
    return ("F" if group == "forward" else "B", a["microbatch"])


def phase_spans(events, step):
    """[(label, start_us, end_us)] of one step, in time order: its forward, backward and optimizer, each from the
    first to the last slice the ranks' compute streams ran in it (by args.phase; with --grad-accum a forward and
    a backward per microbatch: 'forward mb0')."""
    spans = {}
    for e in events:
        a = e.get("args", {})
        group = phase_group(a.get("phase"))
        if e.get("tid") != COMPUTE_TID or a.get("step") != step or not group or e.get("dur", 0) <= 0:
            continue
        key = (group, a.get("microbatch"))
        s, t = spans.get(key, (e["ts"], e["ts"] + e["dur"]))
        spans[key] = (min(s, e["ts"]), max(t, e["ts"] + e["dur"]))
    return sorted(((g if mb is None else "%s mb%d" % (g, mb), s, t) for (g, mb), (s, t) in spans.items()),
                  key=lambda span: span[1])


def band_spans(events, step, pipeline):
    """The phase band's spans, [(colour key, texts longest first, start_us, end_us)] in time order: phase_spans',
    each with shorter texts for a narrow span ('forward mb0', 'fwd mb0', 'F0'). A pipeline's microbatches pass
    through the ranks at different times (rank 3 runs B0 while rank 0 runs F3), so one span per microbatch would
    overlap its neighbours: its forwards and backwards are one span, each compute row names its own passes (F3,
    B0), and the optimizer follows."""
    spans = phase_spans(events, step)
    if pipeline:
        passes = [(s, t) for label, s, t in spans if label.split()[0] in ("forward", "backward")]
        mbs = {label.split()[1] for label, _, _ in spans if len(label.split()) > 1}
        rest = [span for span in spans if span[0].split()[0] not in ("forward", "backward")]
        spans = rest
        if passes:
            n = len(mbs)
            words = "forward and backward of %d microbatch%s" % (n, "" if n == 1 else "es")
            spans = sorted(rest + [("passes", min(s for s, _ in passes), max(t for _, t in passes), words)],
                           key=lambda span: span[1])
    out, end = [], -math.inf
    for span in spans:  # one after another: a span that began on another rank before the last ended starts there
        label, s, t = span[:3]
        s, end = max(s, end), max(t, end)
        if t <= s:
            continue
        if label == "passes":
            texts = [span[3] + " (F<k>, B<k> on each compute row)", span[3], "F and B passes", "F/B"]
        else:
            group, _, mb = label.partition(" ")
            short = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}[group]
            texts = [label, "%s %s" % (short, mb) if mb else short, group[0].upper() + mb[2:] if mb else None]
        out.append((label.split()[0], [x for x in texts if x], s, t))
    return out


def host_waits(events, step):
    """{rank: [(start_us, dur_us, what)]}: where each rank's host blocked in this step ('sync:<what>' slices on the
    host's track: it ran ahead, then waited for the device to catch up)."""
    waits = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        if e.get("tid") == HOST_TID and e.get("cat") == HOST_SYNC and step_of(e) == step:
            waits.setdefault(e["pid"], []).append((e["ts"], e["dur"], e["name"].partition(":")[2]))
    return waits


def union(intervals):
    """The sorted disjoint union of [a, b) intervals (touching ones joined), as [(a, b)]."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1] + TOL_US:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def wait_stalls(events):
    """{(rank, stream): [(start_us, end_us)]}: the part of each stream's waits that stalled the compute stream.

    A wait slice runs from when its stream could have started the op queued after it (its previous op's end, or
    the host's enqueue) to the record of the event it waits for. On the compute stream that is compute not
    running: all of it is a stall. Another stream's wait stalls nothing by itself: the all-gather stream waiting
    for compute to free a buffer, or the reduce-scatter stream for the grads, is a stream with nothing it may do
    yet, as idle as one with nothing queued. It holds compute up only while compute waits for an event recorded
    on that stream after it: there, and transitively (the all-gather stream stalled on a copy the compute stream
    waits for ...), the overlap of the two waits is drawn. A wait is matched to its record by the event's name
    ('wait:<event>', '<module>.record:<event>') and time (the wait ends where the record is); a compute wait
    whose record is not in the trace is still a stall."""
    records, waits = {}, {}
    for e in events:
        if e.get("cat") == EVENT and "record:" in e["name"]:
            records.setdefault((e["pid"], e["name"].partition("record:")[2]), []).append(e)
        elif e.get("cat") == WAIT and e.get("dur", 0) > 0:
            waits.setdefault((e["pid"], e["tid"]), []).append(e)

    def record_of(w):
        end = w["ts"] + w["dur"]
        near = [r for r in records.get((w["pid"], w["name"].partition(":")[2]), []) if abs(r["ts"] - end) <= TOL_US]
        return min(near, key=lambda r: abs(r["ts"] - end)) if near else None
    stalls, done = {}, {}  # done: id(wait) -> the intervals of it already followed
    todo = [(w, w["ts"], w["ts"] + w["dur"]) for (pid, tid), ws in waits.items() if tid == COMPUTE_TID for w in ws]
    while todo:
        w, a, b = todo.pop()
        seen = done.setdefault(id(w), [])
        if any(x <= a + TOL_US and b <= y + TOL_US for x, y in seen):
            continue
        seen.append((a, b))
        stalls.setdefault((w["pid"], w["tid"]), []).append((a, b))
        rec = record_of(w)
        if rec is None or rec["tid"] == w["tid"]:
            continue
        for v in waits.get((w["pid"], rec["tid"]), []):  # the recording stream's waits before the record
            lo, hi = max(v["ts"], a), min(v["ts"] + v["dur"], b)
            if v["ts"] + v["dur"] <= rec["ts"] + TOL_US and hi > lo:
                todo.append((v, lo, hi))
    return {k: union(v) for k, v in stalls.items()}


def host_stalls(events, step):
    """{rank: [(start_us, end_us, what)]}: the part of each host wait of this step during which the rank's
    compute stream had nothing to run because the host, blocked, could not queue it. The host waits for the
    device at every step's end (the grad norm's read-back): it ran ahead, and the device is busy until the wait
    ends, so that costs nothing. A wait costs where the compute stream ran dry before the wait ended: from its
    last slice (any: a kernel, a copy, a collective, a wait) to the wait's end."""
    busy = {}
    for e in events:
        if e.get("tid") == COMPUTE_TID and e.get("dur", 0) > 0 and e.get("cat") != EVENT:
            busy.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    busy = {r: union(v) for r, v in busy.items()}
    out = {}
    for rank, waits in host_waits(events, step).items():
        for s, dur, what in waits:
            e = s + dur
            if dur <= 0 or any(a < e - TOL_US and b >= e - TOL_US for a, b in busy.get(rank, [])):
                continue  # compute busy when the wait ends: the host was ahead
            last = max([b for a, b in busy.get(rank, []) if b <= e], default=s)
            if e - max(s, last) > TOL_US:
                out.setdefault(rank, []).append((max(s, last), e, what))
    return out


def label_runs(track, passes=False):
    """[(start_us, end_us, names longest first, category)] worth writing on one stream's slices (sorted by ts):
    each collective ('block2.all_gather', 'block2 AG', 'block2'), each host wait ('host waits for compute
    (optimizer)', 'sync:compute'), each run of kernels of one module ('block2'; copies between them neither end
    nor extend a run, a wait ends it, and an idle gap longer than the run so far; a run whose kernels fill less
    than half of it has no name). passes (a pipeline): a run is one microbatch's pass instead of one module's
    ('F3', 'B0'; recompute is part of B), the schedule a pipeline's compute row is read for."""
    runs, cur = [], None
    for e in track:
        cat, end = e.get("cat"), e["ts"] + e["dur"]
        if cat == COLLECTIVE:
            label, kind = label_and_kind(e["name"])
            short = "%s %s" % (label, SHORT_KINDS.get(kind, kind)) if label else kind
            runs.append((e["ts"], end, [e["name"], short, label or kind], COLLECTIVE))
            cur = None
        elif cat == COMPUTE and (pass_of(e) if passes else e.get("args", {}).get("module")):
            if passes:
                what, mb = pass_of(e)
                names = ["%s%d" % (what, mb)]  # one short name for every pass: the band says what F and B are
            else:
                names = [e["args"]["module"]]
            if cur and cur[2] == names and e["ts"] - cur[1] <= cur[1] - cur[0]:
                cur[1], cur[4] = end, cur[4] + e["dur"]
            else:
                cur = [e["ts"], end, names, COMPUTE, e["dur"]]
                runs.append(cur)
        elif cat == HOST_SYNC:
            what, module = e["name"].partition(":")[2], e.get("args", {}).get("module")
            runs.append((e["ts"], end, ["host waits for %s (%s)" % (what, module), e["name"]], HOST_SYNC))
            cur = None
        elif cat == WAIT:
            cur = None
    return [tuple(r[:4]) for r in runs if len(r) == 4 or r[4] >= 0.5 * (r[1] - r[0])]  # a run: kernels half of it


def text_px(text, points, dpi, em=0.55):
    """The width in pixels of text at `points` (a character ~em of the font's size)."""
    return len(text) * em * points * dpi / 72.0


def fit_label(texts, width_px, points=LABEL_PT, dpi=DPI):
    """The first of texts that fits in width_px (a character ~0.55 em, 1 px either side), else None."""
    for t in texts:
        if t and text_px(t, points, dpi) + 2 <= width_px:
            return t
    return None


def place_band_labels(spans, px, edge_px, points=PHASE_PT, dpi=DPI):
    """[(text, x_px, ha)] for the phase band: each span's longest text that fits inside it, centred; a span too
    narrow for any (the optimizer's, at the step's end) gets its shortest beside it, on the side away from the
    nearer edge, where that leaves every other label clear. No two labels overlap: each is kept only if its box
    (widths estimated generously, 0.62 em, 3 px apart) is clear of those placed before it.
    spans: band_spans' [(key, texts, start, end)]; px(t): a time's x in pixels; edge_px: the axis' (left, right)."""
    placed, boxes = [], []

    def clear(x0, x1):
        return edge_px[0] - 1 <= x0 and x1 <= edge_px[1] + 1 and all(x1 + 3 <= a or b + 3 <= x0 for a, b in boxes)
    later = []
    for _, texts, s, t in spans:
        a, b = px(s), px(t)
        for text in texts:
            w = text_px(text, points, dpi, em=0.62)
            x0 = (a + b - w) / 2
            if w + 4 <= b - a and clear(x0, x0 + w):
                placed.append((text, (a + b) / 2, "center"))
                boxes.append((x0, x0 + w))
                break
        else:
            later.append((texts[-1], a, b))
    for text, a, b in later:
        w = text_px(text, points, dpi, em=0.62)
        right = (a + b) / 2 > (edge_px[0] + edge_px[1]) / 2
        x0, x1 = (b - w - 2, b) if right else (a, a + w + 2)
        if clear(x0, x1):
            placed.append((text, b if right else a, "right" if right else "left"))
            boxes.append((x0, x1))
    return placed


def drawn_ranks(ranks, meta, limit=MAX_RANKS):
    """The ranks the timeline draws: all when at most `limit`; else each pipeline stage's first rank, then the
    lowest ranks, up to `limit` (a dry run at world 64 traces 64 ranks alike)."""
    if len(ranks) <= limit:
        return list(ranks)
    firsts = [min(st["ranks"]) for st in meta.get("pipeline") or [] if st.get("ranks")]
    keep = [r for r in firsts if r in ranks][:limit]
    for r in ranks:
        if len(keep) >= limit:
            break
        if r not in keep:
            keep.append(r)
    return sorted(keep)


def rank_words(ranks):
    """'ranks 0-5, 32, 48': consecutive ranks as a range."""
    parts, run = [], []
    for r in sorted(ranks) + [None]:
        if run and (r is None or r != run[-1] + 1):
            parts.append(str(run[0]) if len(run) == 1 else "%d-%d" % (run[0], run[-1]) if len(run) > 2
                         else "%d, %d" % tuple(run))
            run = []
        if r is not None:
            run.append(r)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def draw_timeline(plt, events, names, meta, step):
    """timeline.png's figure for one step: (fig, main axes, phase strip axes, legend)."""
    sel = [e for e in events if step_of(e) == step and e.get("cat") != EVENT] or events
    traced = sorted({e["pid"] for e in sel})
    ranks = drawn_ranks(traced, meta)
    sel = [e for e in sel if e["pid"] in ranks]
    mine = [e for e in events if e["pid"] in ranks]
    t0 = min(e["ts"] for e in sel)
    span_us = max(e["ts"] + e["dur"] for e in sel) - t0
    unit, per = time_unit(span_us)
    x = lambda ts: (ts - t0) / per  # noqa: E731
    pipeline = is_pipeline(meta)
    rows = sorted({(e["pid"], e["tid"]) for e in sel}, key=lambda k: (k[0], -1 if k[1] == HOST_TID else k[1]))
    fig, (strip, ax) = plt.subplots(2, 1, sharex=True, figsize=(13, 0.42 * len(rows) + 2.0), dpi=DPI,
                                    gridspec_kw={"height_ratios": [0.35, 0.42 * len(rows)]})
    stalls = wait_stalls(mine)
    lost = host_stalls(mine, step)
    by_row, bars = {}, {}
    for e in sorted(sel, key=lambda e: e["ts"]):
        key = (e["pid"], e["tid"])
        by_row.setdefault(key, []).append(e)
        if e.get("cat") == WAIT:
            continue  # drawn where it stalls compute, below
        bars.setdefault(key + (e.get("cat"),), []).append((x(e["ts"]), max(e["dur"], 1) / per))
    for (pid, tid), spans in stalls.items():
        if (pid, tid) in rows:
            bars[(pid, tid, WAIT)] = [(x(a), (b - a) / per) for a, b in spans if b > t0 and a < t0 + span_us]
    for pid, spans in lost.items():
        if (pid, HOST_TID) in rows:
            bars[(pid, HOST_TID, HOST_STALL)] = [(x(a), (b - a) / per) for a, b, _ in spans]
    for (pid, tid, cat), spans in bars.items():
        height = 0.4 if cat == HOST_SYNC else 0.8  # the host ahead: a thin pale bar under its stalls
        ax.broken_barh(spans, (rows.index((pid, tid)) - height / 2, height), facecolors=CAT_COLORS.get(cat, "#999999"),
                       zorder=3 if cat == HOST_STALL else 2)
    for y, key in enumerate(rows):
        if y and key[0] != rows[y - 1][0]:
            ax.axhline(y - 0.5, color="0.5", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d %s" % (p, names.get((p, t), "host" if t == HOST_TID else "stream %d" % t))
                        for p, t in rows], fontsize=8 if len(rows) > 16 else 9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span_us / per * 1.005)
    ax.set_xlabel("%s (%s since the step began)" % (clock_words(meta), unit))
    phases = band_spans(sel, step, pipeline)
    for key, _, s, t in phases:
        strip.axvspan(x(s), x(t), color=PHASE_COLORS[key], ec="white")
        ax.axvline(x(s), color="0.3", lw=0.7, ls=":")
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.tick_params(axis="x", length=0)
    for side in ("left", "right", "top", "bottom"):
        strip.spines[side].set_visible(False)
    who = "%d rank%s" % (len(ranks), "" if len(ranks) == 1 else "s") if ranks == traced else \
        "%s of the %d traced" % (rank_words(ranks), len(traced))
    fig.suptitle("step %d, %s, %s" % (step + 1, who, clock_words(meta)), fontsize=11)
    present = {cat for (_, _, cat), spans in bars.items() if spans}  # a wait only where one stalls in this step
    styles = [(words, colour) for cat, words, colour in TRACK_STYLE if cat in present]
    if ranks[0] in lost:
        total = sum(b - a for a, b, _ in lost[ranks[0]])
        styles.append(("%s (rank %d: %s)" % (HOST_STALL_WORDS, ranks[0], duration_words(total)), HOST_STALL_COLOUR))
    legend = strip.legend([plt.Rectangle((0, 0), 1, 1, color=c) for _, c in styles], [w for w, _ in styles],
                          loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=len(styles), fontsize=8,
                          frameon=False, borderaxespad=0)
    fig.tight_layout(h_pad=0.2)
    px_per_unit = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    x_px = lambda ts: ax.transData.transform((x(ts), 0))[0]  # noqa: E731
    edges = (ax.transData.transform((0, 0))[0], ax.transData.transform((span_us / per * 1.005, 0))[0])
    for text, xp, ha in place_band_labels(phases, x_px, edges, dpi=fig.dpi):
        strip.text(ax.transData.inverted().transform((xp, 0))[0], 0.5, text, ha=ha, va="center", fontsize=PHASE_PT)
    for y, key in enumerate(rows):
        runs = label_runs([e for e in by_row[key] if e.get("cat") != HOST_SYNC], passes=pipeline and
                          key[1] == COMPUTE_TID)
        for s, t, texts, cat in runs:
            text = fit_label(texts, (t - s) / per * px_per_unit, dpi=fig.dpi)
            if text:
                ax.text(x((s + t) / 2), y, text, ha="center", va="center", fontsize=LABEL_PT,
                        color="white" if cat == COMPUTE else "black", clip_on=True)
        if key[1] != HOST_TID:
            continue
        for s, t, texts, _ in label_runs(by_row[key]):  # the host's waits: where it was ahead, where it cost
            stalled = [(a, b) for a, b, _ in lost.get(key[0], []) if s - TOL_US <= a and b <= t + TOL_US]
            for a, b in stalled:
                text = fit_label([HOST_STALL_WORDS, "stall"], (b - a) / per * px_per_unit, dpi=fig.dpi)
                if text:
                    ax.text(x((a + b) / 2), y, text, ha="center", va="center", fontsize=LABEL_PT, clip_on=True,
                            zorder=4)
            if not stalled:
                texts = ["the host is ahead: it %s" % texts[0][5:]] + texts
                text = fit_label(texts, (t - s) / per * px_per_unit, dpi=fig.dpi)
                if text:
                    ax.text(x((s + t) / 2), y, text, ha="center", va="center", fontsize=LABEL_PT, color="0.3",
                            clip_on=True)
    return fig, ax, strip, legend


def plot_timeline(plt, run, out, step):
    events, names, meta = load_trace(run)
    if not events:
        print("no trace events in %s: skipping timeline.png" % run)
        return
    fig = draw_timeline(plt, events, names, meta, pick_step(events, step))[0]
    fig.savefig(os.path.join(out, "timeline.png"), dpi=DPI)
    plt.close(fig)


# ---- memory.png ---------------------------------------------------------------------------------

def memory_series(snap):
    """(xs, {tag: MiB live after each alloc/free}, bands) of a snapshot. x is in steps: the events of step k
    (args.step, from 0) spread evenly over [k+1, k+2), init's over [0, 1), the end's after the last step, so two
    runs line up step by step; bands: (x0, x1, 'init' | step number from 1 as in metrics.jsonl | 'end').
    A snapshot without steps: x = the event's index, no bands."""
    evs = [e for e in snap.get("events", []) if e.get("action") in ("alloc", "free", "free_completed")]
    live, by_tag = {}, {t: 0 for t in snap.get("tags") or []}
    series = {t: [] for t in by_tag}
    for i, e in enumerate(evs):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["tag"], e["size"])
            by_tag[e["tag"]] = by_tag.get(e["tag"], 0) + e["size"]
        elif e["addr"] in live:  # a free_requested block is still held
            tag, size = live.pop(e["addr"])
            by_tag[tag] -= size
        for t in by_tag:
            series.setdefault(t, [0.0] * i).append(by_tag[t] / 2.0 ** 20)
    if not evs or any("step" not in e for e in evs):
        return list(range(len(evs))), series, []
    counts, first = {}, {}
    for i, e in enumerate(evs):
        first.setdefault(e["step"], i)
        counts[e["step"]] = counts.get(e["step"], 0) + 1
    xs = [e["step"] + 1 + (i - first[e["step"]]) / counts[e["step"]] for i, e in enumerate(evs)]
    last = max(counts)
    xs.append(last + 2)  # the last event's bytes hold to the end of its band
    for t in series:
        series[t].append(series[t][-1])
    bands = [(s + 1, s + 2, "init" if s < 0 else "end" if s == last and evs[-1].get("phase") == "end" else str(s + 1))
             for s in sorted(counts)]
    return xs, series, bands


def draw_memory(plt, snap, rank, ref_snap=None, ref_name=None, capacity=None):
    """memory.png's figure: (fig, axes, the peak's label, legend). capacity: the device's bytes (metrics.jsonl's
    hbm_capacity_bytes, a dry run's profile), drawn as a line when the peak comes within a quarter of it: does
    the run fit."""
    xs, series, bands = memory_series(snap)
    tags = list(series)  # colours by the snapshot's tag order: the same tag, the same colour, in every run
    used = [t for t in tags if max(series[t]) > 0]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.stackplot(xs, [series[t] for t in used], labels=used, step="post",
                 colors=["C%d" % (tags.index(t) % 10) for t in used])
    total = [sum(series[t][i] for t in used) for i in range(len(xs))]
    peak_i = max(range(len(xs)), key=lambda i: total[i])
    peak, top = total[peak_i], total[peak_i]
    if ref_snap:
        rxs, rseries, rbands = memory_series(ref_snap)
        ends = [b[-1][0] for b in (bands, rbands) if b and b[-1][2] == "end"]  # up to its or the run's last step
        n = sum(1 for x in rxs if x < min(ends, default=math.inf))
        if n:
            rtotal = [sum(col) for col in zip(*rseries.values())][:n]
            ax.step(rxs[:n], rtotal, where="post", **reference(ref_name))
            top = max(top, max(rtotal))
    ax.axhline(peak, color="0.25", lw=0.8, ls=":")
    right = (xs[peak_i] - xs[0]) > 0.5 * (xs[-1] - xs[0])  # the label reads away from the nearer edge
    label = ax.annotate("peak %.2f MiB" % peak, (xs[peak_i], peak), xytext=(-4 if right else 4, 3),
                        textcoords="offset points", ha="right" if right else "left", va="bottom", fontsize=9,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
    device = capacity / 2.0 ** 20 if capacity else None
    if device and peak >= 0.25 * device:
        ax.axhline(device, color="#C44E52", lw=1.0, ls="--", label="the device's memory (%.2f GiB)%s" % (
            capacity / 2.0 ** 30, "" if peak <= device else ": the run does not fit"))
        top = max(top, device)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(xs[0], bands[-1][1] if bands else xs[-1])
    if bands:
        every = math.ceil(len(bands) / 16.0)
        ax.set_xticks([(b[0] + b[1]) / 2 for b in bands[::every]])
        ax.set_xticklabels([b[2] for b in bands[::every]])
        for b in bands[1:] if len(bands) <= 40 else []:
            ax.axvline(b[0], color="0.4", lw=0.5, alpha=0.5)
        ax.set_xlabel("step (each step's allocator events in host order)")
    else:
        ax.set_xlabel("allocator event (host order)")
    ax.set_ylabel("MiB allocated")
    ax.set_title("rank %d memory by tag%s" % (rank, ", the reference's total dashed" if ref_snap else ""))
    handles, labels = ax.get_legend_handles_labels()
    order = list(reversed(range(len(used)))) + list(range(len(used), len(labels)))  # the stack's order, top first
    legend = ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                       bbox_to_anchor=(1.005, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig, ax, label, legend


def plot_memory(plt, run, out, rank, ref=None):
    snap = open_json(os.path.join(run, "memory_rank%d.json" % rank))
    if not snap or not any(e.get("action") == "alloc" for e in snap.get("events", [])):
        print("no %s in %s: skipping memory.png" % ("allocation events" if snap else "memory_rank%d.json" % rank, run))
        return
    ref_snap = open_json(os.path.join(ref, "memory_rank%d.json" % rank)) if ref else None
    capacity = max([r.get("hbm_capacity_bytes") or 0 for r in load_metrics(run)], default=0)
    fig = draw_memory(plt, snap, rank, ref_snap, run_name(ref) if ref else None, capacity)[0]
    fig.savefig(os.path.join(out, "memory.png"), dpi=DPI)
    plt.close(fig)

# the colours of process groups, by kind (run.json "groups"): a family per kind, a colour per group of it. The mesh's
# shard groups orange and replicate groups purple (HANDOUT's words for stage 09's picture); the pipeline's stage
# groups each a hue of its own (stage 0 and stage 1 must not look alike); the world dark, so that the grad norm's
# one all-reduce stands out; a group hw_fsdp.c made itself in yellows; sends and receives between stages grey.
GROUP_FAMILIES = {"shard": ["#dd8452", "#f2b880", "#c0622c", "#f6d2b0"],
                  "replicate": ["#8172b3", "#b3a8db", "#5a4c8f", "#d4cdef"],
                  "stage": ["#55a868", "#4c9fd8", "#e0b000", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"],
                  "world": ["#222222"], "group": ["#e6ab02", "#a6761d", "#f0d264", "#7a5a00"]}
P2P_COLOUR = "#b0b0b0"
# how a title names the groups of each kind, in the title's order; "p2p": the sends and receives between stages
GROUP_WORDS = [("shard", "the shard groups (rows of the mesh)"), ("replicate", "the replicate groups (its columns)"),
               ("stage", "each pipeline stage's group"), ("group", "the groups hw_fsdp.c made"),
               ("world", "the world"), (P2P, "between neighbouring stages")]
KIND_WORDS = {ALL_GATHER: "all-gathers", REDUCE_SCATTER: "reduce-scatters", ALL_REDUCE: "all-reduces",
              BROADCAST: "broadcasts", BARRIER: "barriers"}
WHAT_ORDER = ["all-gathers", "reduce-scatters", "the grads' all-reduces", "all-reduces", "broadcasts", "barriers",
              "the grad norm's all-reduce", "activations and grads sent"]  # a step's order


def group_of_slice(e):
    """The process group a collective ran in: its args.group; a pipeline's send/receive (args.p2p, no group): P2P."""
    a = e.get("args", {})
    if a.get("group"):
        return a["group"]
    return P2P if a.get("p2p") or a.get("phase") == PHASE_P2P else "world"


def what_ran(slices):
    """'all-gathers and reduce-scatters', "the grad norm's all-reduce", 'activations and grads': one group's (or
    kind's) collectives in words."""
    words = []
    for e in sorted(slices, key=lambda e: e["ts"]):
        label, kind = label_and_kind(e["name"])
        if group_of_slice(e) == P2P:
            w = "activations and grads sent"
        elif kind == ALL_REDUCE and label == "grad_norm":
            w = "the grad norm's all-reduce"
        elif kind == ALL_REDUCE and label:
            w = "the grads' all-reduces"
        else:
            w = KIND_WORDS.get(kind, kind)
        if w not in words:
            words.append(w)
    words.sort(key=lambda w: WHAT_ORDER.index(w) if w in WHAT_ORDER else len(WHAT_ORDER))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def group_colours(kinds, groups):
    """{group name: colour}: by its kind's family (GROUP_FAMILIES), each group of a kind the next colour of it in
    run.json's order; a group run.json does not state, green; P2P grey."""
    of_kind = {}
    for name, kind in kinds.items():
        of_kind.setdefault(kind, []).append(name)
    out = {}
    for g in groups:
        if g == P2P:
            out[g] = P2P_COLOUR
        elif g in kinds:
            pal = GROUP_FAMILIES.get(kinds[g], GROUP_FAMILIES["group"])
            out[g] = pal[of_kind[kinds[g]].index(g) % len(pal)]
        else:
            out[g] = "#55a868"
    return out


def draw_groups(plt, events, names, meta, run_json, step):
    """groups.png's figure: (fig, axes, legend), or None for a run whose collectives all run in the world: every
    collective of one step, on its rank's stream, coloured by its process group; the title says what ran in
    which kind of group, the legend each group's ranks and collectives."""
    coll = [e for e in events if e.get("cat") == COLLECTIVE]
    if not coll or {group_of_slice(e) for e in coll} == {"world"}:
        return None  # a 1-D run without a pipeline: every collective is the world's
    steps = sorted({step_of(e) for e in coll if step_of(e) >= 0})
    if step is None:
        step = steps[len(steps) // 2] if steps else -1
    sel = [e for e in coll if step_of(e) == step] or coll
    ranks = drawn_ranks(sorted({e["pid"] for e in sel}), meta)
    sel = [e for e in sel if e["pid"] in ranks]
    t0 = min(e["ts"] for e in sel)
    span_us = max(e["ts"] + e["dur"] for e in sel) - t0 or 1.0
    unit, per = time_unit(span_us)
    rows = sorted({(e["pid"], e["tid"]) for e in sel})
    kinds = group_kinds(run_json)  # what run.json states the runtime made: {name: kind}
    members = {g.get("name"): g.get("ranks") for g in run_json.get("groups") or [] if isinstance(g, dict)}
    groups = sorted({group_of_slice(e) for e in sel},
                    key=lambda g: ([k for k, _ in GROUP_WORDS].index(kinds.get(g, P2P if g == P2P else "group")),
                                   list(kinds).index(g) if g in kinds else 0))
    colour = group_colours(kinds, groups)
    fig, ax = plt.subplots(figsize=(13, 0.5 * len(rows) + 2.2 + 0.2 * math.ceil(len(groups) / 2.0)))
    least = span_us / per * 0.004  # ~4 px: a collective of a one-rank group (no cost) or the grad norm's is seen
    for e in sel:
        x, w = (e["ts"] - t0) / per, max(e["dur"] / per, least)
        ax.broken_barh([(x, w)], (rows.index((e["pid"], e["tid"])) - 0.4, 0.8), facecolors=colour[group_of_slice(e)],
                       edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d %s" % (p, names.get((p, t), "stream %d" % t)) for p, t in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-least, span_us / per * 1.01)
    ax.set_xlabel("%s (%s since the step's first collective)" % (clock_words(meta), unit))
    parts = []
    for kind, where in GROUP_WORDS:
        mine = [e for e in sel if kinds.get(group_of_slice(e), P2P if group_of_slice(e) == P2P else "group") == kind]
        if mine:
            parts.append("%s %s %s" % (what_ran(mine), "" if kind == P2P else "in", where))
    title = "collectives by process group, step %d: " % (step + 1) + "; ".join(p.replace("  ", " ") for p in parts)
    ax.set_title(wrap(title, 150), fontsize=9)

    def label(g):
        if g == P2P:
            return "sends and receives between stages"
        who = " (%s)" % rank_words(members[g]) if members.get(g) else ""
        alone = ", one rank: nothing moves" if len(members.get(g) or []) == 1 else ""
        return "%s%s: %s%s" % (g, who, what_ran([e for e in sel if group_of_slice(e) == g]), alone)
    legend = ax.legend([plt.Rectangle((0, 0), 1, 1, color=colour[g]) for g in groups], [label(g) for g in groups],
                       loc="upper center", bbox_to_anchor=(0.5, -0.45 / (0.5 * len(rows) + 0.6)),
                       ncol=min(len(groups), 2), fontsize=8, frameon=False)  # under the axis' label
    fig.tight_layout()
    return fig, ax, legend


def wrap(text, width):
    """text broken at spaces into lines of at most `width` characters."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = "%s %s" % (line, word) if line else word
    return "\n".join(lines + [line])


def plot_groups(plt, run, out, step):
    """Collectives by process group: on a 2-D mesh the all-gathers and reduce-scatters run in shard groups and the
    grads' all-reduces in replicate groups; in a pipeline each stage's in its stage group, the activations and
    grads between stages, the grad norm's all-reduce over the world. Which rank talks to which."""
    events, names, meta = load_trace(run)
    drawn = draw_groups(plt, events, names, meta, RunDir(run).run_json, step)
    if drawn:
        drawn[0].savefig(os.path.join(out, "groups.png"), dpi=DPI)
        plt.close(drawn[0])


def draw_backward(plt, events, names, meta, cfg, step, rank):
    """backward.png's figure, (fig, axes), or None when the rank traced no backward: rank `rank`'s compute and comm
    streams through one step's backward, every all-gather and reduce-scatter labelled with its module where the
    name fits (all-gathers above the middle, reduce-scatters below), waits drawn where they stall compute
    (wait_stalls), the axis from the backward's first op (a wait queued before it is not its start)."""
    policy, single = cfg.get("backward_prefetch", "pre"), cfg.get("single_comm_stream", False)
    mine = [e for e in events if e.get("pid") == rank]
    back = [e for e in mine if e.get("args", {}).get("phase") in BACKWARD_PHASES]
    steps = sorted({step_of(e) for e in back if step_of(e) >= 0})
    if not steps:
        return None
    if step is None:
        step = steps[len(steps) // 2]
    sel = [e for e in back if step_of(e) == step and e.get("tid") != HOST_TID and e.get("cat") != EVENT]
    work = [e for e in sel if e.get("cat") != WAIT]
    if not work:
        return None
    t0 = min(e["ts"] for e in work)
    t1 = max(e["ts"] + e["dur"] for e in work)
    tids = sorted({e["tid"] for e in sel})
    unit, per = time_unit(t1 - t0)
    fig, ax = plt.subplots(figsize=(13, 0.8 * len(tids) + 1.8))
    ax.set_xlim(0, (t1 - t0) / per * 1.005)
    for y, tid in enumerate(tids):
        for a, b in wait_stalls(mine).get((rank, tid), []):
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                ax.broken_barh([((lo - t0) / per, (hi - lo) / per)], (y - 0.4, 0.8), facecolors=CAT_COLORS[WAIT])
    fig.tight_layout()
    px_per_unit = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    written = {}  # (stream, above or below): the right end in pixels of the last name written there
    for y, tid in enumerate(tids):
        for e in sorted((e for e in work if e["tid"] == tid), key=lambda e: e["ts"]):
            x, w = (e["ts"] - t0) / per, max(e["dur"], 1) / per
            label, kind = label_and_kind(e["name"])
            colour = {ALL_GATHER: "#dd8452", REDUCE_SCATTER: "#8172b3"}.get(kind, CAT_COLORS.get(e.get("cat"),
                                                                                                  "#999999"))
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
            if e.get("cat") != COLLECTIVE:
                continue
            # the module's name, all-gathers above the middle, reduce-scatters below, centred on the bar; one that
            # would run into the previous name on its line is left out
            text, line = label or kind, (y, kind == ALL_GATHER)
            half = text_px(text, 6, fig.dpi, em=0.62) / 2 + 2
            mid = (x + w / 2) * px_per_unit
            if mid - half >= written.get(line, -math.inf):
                written[line] = mid + half
                ax.text(x + w / 2, y + (-0.22 if kind == ALL_GATHER else 0.22), text, ha="center", va="center",
                        fontsize=6)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get((rank, t), "stream %d" % t) for t in tids])
    ax.set_ylim(len(tids) - 0.5, -0.5)
    ax.set_xlabel("%s (%s since the step's backward began, rank %d)" % (clock_words(meta), unit, rank))
    ax.set_title("backward of step %d: --backward-prefetch %s%s (all-gathers orange, reduce-scatters purple, compute "
                 "blue, waits that stall compute red)" % (step + 1, policy, ", one comm stream" if single else ""),
                 fontsize=9)
    fig.tight_layout()
    return fig, ax


def plot_backward(plt, run, out, step, rank):
    """Rank `rank`'s compute and comm streams through one backward (draw_backward), for a run with a backward-prefetch
    policy other than pre or one comm stream: where the policy issues the all-gathers, and what they queue behind."""
    try:
        with open(os.path.join(run, "run.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return
    if cfg.get("backward_prefetch", "pre") == "pre" and not cfg.get("single_comm_stream", False):
        return
    events, names, meta = load_trace(run)
    drawn = draw_backward(plt, events, names, meta, cfg, step, rank)
    if drawn:
        drawn[0].savefig(os.path.join(out, "backward.png"), dpi=DPI)
        plt.close(drawn[0])


def pipeline_passes(events, step):
    """{rank: [(start, end, 'F'|'B', microbatch)]}: each pass of a microbatch through a rank's stage (its
    forward or backward kernels, first start to last end) in one step."""
    spans = {}
    for e in events:
        a = e.get("args", {})
        if e.get("cat") != COMPUTE or a.get("step") != step or a.get("phase") not in BUSY_PHASES:
            continue
        if not isinstance(a.get("microbatch"), int):
            continue
        key = (e["pid"], "F" if a["phase"] == PHASE_FORWARD else "B", a["microbatch"])
        lo, hi = spans.get(key, (e["ts"], e["ts"] + e["dur"]))
        spans[key] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    out = {}
    for (rank, what, mb), (lo, hi) in spans.items():
        out.setdefault(rank, []).append((lo, hi, what, mb))
    return {r: sorted(v) for r, v in out.items()}


def plot_pipeline(plt, run, out, step):
    """A pipeline run's schedule: per rank, the forward and backward of each microbatch, on the trace's clock."""
    with open(os.path.join(run, "run.json")) as fh:
        cfg = json.load(fh)
    if not cfg.get("pp"):
        return
    events, _, meta = load_trace(run)
    steps = sorted({e["args"].get("step", -1) for e in events if e.get("cat") == COMPUTE
                    and e["args"].get("step", -1) >= 0})
    if not steps:
        return
    if step is None:
        step = steps[len(steps) // 2]
    passes = pipeline_passes(events, step)
    if not passes:
        return
    P, W, M = int(cfg["pp"]), int(cfg["world_size"]), int(cfg.get("microbatches") or cfg["pp"])
    S = W // P
    t0 = min(lo for v in passes.values() for lo, _, _, _ in v)
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(passes) + 1.9))
    colours = {"F": "#4c72b0", "B": "#dd8452"}
    ranks = sorted(passes)
    for y, r in enumerate(ranks):
        for lo, hi, what, mb in passes[r]:
            x, w = (lo - t0) / 1000.0, (hi - lo) / 1000.0
            ax.broken_barh([(x, w)], (y - 0.38, 0.76), facecolors=colours[what], edgecolors="white", linewidth=0.6)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(["rank %d (stage %d)" % (r, r // S) for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("%s (ms since the step's first forward)" % clock_words(meta))
    # the bubble as the grader measures it (gradelib.trace_model.pipeline_bubble): the idle share of each rank's
    # compute kernels in the step's window, so a wait inside a pass counts too (a bar spans it). A dry run's
    # representatives (run.json executed_ranks: one per stage); else every rank's when every rank recorded a trace;
    # else each stage's first rank's (a pipeline dry run traces ranks 0 .. (P-1) x S: tools/simulate.py; a stage's
    # ranks are symmetric), so that each stage weighs the same as in the full mean
    traced = by_rank(events)
    every = all(r in traced for r in range(W))
    ranks = cfg.get("executed_ranks") or (None if every else [p * S for p in range(P) if p * S in traced])
    idle, _ = pipeline_bubble(traced, step, W, ranks=ranks)
    title = ("%s, %d stages x %d microbatches, step %d: F = forward, B = backward of a microbatch\nthe bubble "
             "(compute idle, as the grader measures it): %.1f%% of this step; (P-1)/(M+P-1) = %.1f%% with equal "
             "stages and free transfers" % ("GPipe" if cfg.get("pp_schedule") == "gpipe" else "1F1B", P, M,
                                            step + 1, 100 * idle, 100 * ideal_bubble(P, M)))
    ax.set_title(title, fontsize=9)
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in "FB"], ["forward", "backward"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    px_per_ms = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    for y, r in enumerate(sorted(passes)):  # each bar's name where it fits (many microbatches: narrow bars, no names)
        for lo, hi, what, mb in passes[r]:
            if fit_label(["%s%d" % (what, mb)], (hi - lo) / 1000.0 * px_per_ms, points=7, dpi=fig.dpi):
                ax.text((lo + hi) / 2000.0 - t0 / 1000.0, y, "%s%d" % (what, mb), ha="center", va="center",
                        fontsize=7, color="white")
    fig.savefig(os.path.join(out, "pipeline.png"), dpi=DPI)
    plt.close(fig)
    return title


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--ref", help="reference run directory (its metrics.jsonl and memory_rank<R>.json) drawn dashed "
                    "in loss.png and memory.png")
    ap.add_argument("--out", help="output directory (default RUN/plots)")
    ap.add_argument("--step", type=int, help="step to draw in the timeline, from 1 as in metrics.jsonl (default: a "
                    "traced step in the middle)")
    ap.add_argument("--rank", type=int, default=0)
    a = ap.parse_args()
    for d in [a.run] + ([a.ref] if a.ref else []):
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            print("error: %s has no metrics.jsonl (is it a run directory from train --out?)" % d, file=sys.stderr)
            return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: matplotlib is missing (Debian: apt-get install python3-matplotlib)", file=sys.stderr)
        return 2
    out = a.out or os.path.join(a.run, "plots")
    os.makedirs(out, exist_ok=True)
    plot_loss(plt, a.run, a.ref, out)
    step = None if a.step is None else a.step - 1  # the trace's args.step counts from 0
    plot_timeline(plt, a.run, out, step)
    plot_memory(plt, a.run, out, a.rank, a.ref)
    plot_groups(plt, a.run, out, step)
    plot_backward(plt, a.run, out, step, a.rank)
    plot_pipeline(plt, a.run, out, step)
    print("wrote plots to %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
