#!/usr/bin/env python3
"""Pictures of a run directory (written by `train --out DIR`).

    plots.py RUN [--ref REF_RUN] [--out DIR] [--step N] [--rank R]

writes into DIR (default RUN/plots):
  loss.png      loss, grad norm and peak memory per step: your run, and with --ref the
                reference (dashed); peak memory per rank where the ranks differ by over 1 %
  timeline.png  one row per (rank, stream) for one step on the trace's clock (the modelled
                clock on the CPU): compute, copies, collectives, the streams' waits and the
                host's waits; the forward, backward and optimizer phases along the top;
                module names on the slices wide enough to hold them
  memory.png    rank R's allocated bytes over the run (host order, step by step), stacked by
                tag, with the peak marked; with --ref the reference's total as a dashed line
  groups.png    only for a run on a 2-D mesh (--mesh): every rank's collectives
                of one step, coloured by process group (shard groups: rows of
                the mesh; replicate groups: its columns)
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
from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, BROADCAST, COLLECTIVE, COMPUTE, COMPUTE_TID, COPY,
                         EVENT, FORWARD_PHASES, HOST_SYNC, HOST_TID, MEMSET, REDUCE_SCATTER, WAIT, label_and_kind)
from trace_names import PHASE_FORWARD, PHASE_OPTIMIZER  # the phases (runtime/phase.h)

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


def plot_loss(plt, run, ref, out):
    fig = draw_steps(plt, load_metrics(run), load_metrics(ref) if ref else None, run_name(run),
                     run_name(ref) if ref else None)
    fig.savefig(os.path.join(out, "loss.png"), dpi=DPI)
    plt.close(fig)


# ---- timeline.png -------------------------------------------------------------------------------

# (category, what the legend calls it, colour), in the legend's order; an event record is zero-length: not drawn
TRACK_STYLE = [(COMPUTE, "compute (a kernel)", "#4C72B0"), (COLLECTIVE, "collective", "#DD8452"),
               (COPY, "copy", "#8C8C8C"), (MEMSET, "memset", "#B0B0B0"),
               (WAIT, "stream waits for an event", "#C44E52"), (HOST_SYNC, "host waits for the device", "#E6C229")]
CAT_COLORS = dict([(cat, colour) for cat, _, colour in TRACK_STYLE], **{EVENT: "#55A868"})
PHASE_COLORS = {"forward": "#D6E4F0", "backward": "#F6DCC8", "optimizer": "#D5ECD4"}
LABEL_PT = 7  # module names on the slices
SHORT_KINDS = {ALL_GATHER: "AG", REDUCE_SCATTER: "RS", ALL_REDUCE: "AR", BROADCAST: "BC"}


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


def phase_group(phase):
    if phase in FORWARD_PHASES:
        return "forward"
    if phase in BACKWARD_PHASES:
        return "backward"
    return "optimizer" if phase == PHASE_OPTIMIZER else None


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


def host_waits(events, step):
    """{rank: [(start_us, dur_us, what)]}: where each rank's host blocked in this step ('sync:<what>' slices on the
    host's track: it ran ahead, then waited for the device to catch up)."""
    waits = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        if e.get("tid") == HOST_TID and e.get("cat") == HOST_SYNC and step_of(e) == step:
            waits.setdefault(e["pid"], []).append((e["ts"], e["dur"], e["name"].partition(":")[2]))
    return waits


def label_runs(track):
    """[(start_us, end_us, names longest first, category)] worth writing on one stream's slices (sorted by ts):
    each collective ('block2.all_gather', 'block2 AG', 'block2'), each host wait ('host waits for compute
    (optimizer)', 'sync:compute'), each run of kernels of one module ('block2'; copies between them neither end
    nor extend a run, a wait ends it, and an idle gap longer than the run so far; a run whose kernels fill less
    than half of it has no name)."""
    runs, cur = [], None
    for e in track:
        cat, end = e.get("cat"), e["ts"] + e["dur"]
        if cat == COLLECTIVE:
            label, kind = label_and_kind(e["name"])
            short = "%s %s" % (label, SHORT_KINDS.get(kind, kind)) if label else kind
            runs.append((e["ts"], end, [e["name"], short, label or kind], COLLECTIVE))
            cur = None
        elif cat == COMPUTE and e.get("args", {}).get("module"):
            module = e["args"]["module"]
            if cur and cur[2] == [module] and e["ts"] - cur[1] <= cur[1] - cur[0]:
                cur[1], cur[4] = end, cur[4] + e["dur"]
            else:
                cur = [e["ts"], end, [module], COMPUTE, e["dur"]]
                runs.append(cur)
        elif cat == HOST_SYNC:
            what, module = e["name"].partition(":")[2], e.get("args", {}).get("module")
            runs.append((e["ts"], end, ["host waits for %s (%s)" % (what, module), e["name"]], HOST_SYNC))
            cur = None
        elif cat == WAIT:
            cur = None
    return [tuple(r[:4]) for r in runs if len(r) == 4 or r[4] >= 0.5 * (r[1] - r[0])]  # a run: kernels half of it


def fit_label(texts, width_px, points=LABEL_PT, dpi=DPI):
    """The first of texts that fits in width_px (a character ~0.55 em, 1 px either side), else None."""
    for t in texts:
        if t and len(t) * 0.55 * points * dpi / 72.0 + 2 <= width_px:
            return t
    return None


def draw_timeline(plt, events, names, meta, step):
    """timeline.png's figure for one step: (fig, main axes, phase strip axes, legend)."""
    sel = [e for e in events if step_of(e) == step and e.get("cat") != EVENT] or events
    t0 = min(e["ts"] for e in sel)
    span_us = max(e["ts"] + e["dur"] for e in sel) - t0
    unit, per = time_unit(span_us)
    x = lambda ts: (ts - t0) / per  # noqa: E731
    rows = sorted({(e["pid"], e["tid"]) for e in sel}, key=lambda k: (k[0], -1 if k[1] == HOST_TID else k[1]))
    fig, (strip, ax) = plt.subplots(2, 1, sharex=True, figsize=(13, 0.42 * len(rows) + 2.0), dpi=DPI,
                                    gridspec_kw={"height_ratios": [0.35, 0.42 * len(rows)]})
    by_row, bars = {}, {}
    for e in sorted(sel, key=lambda e: e["ts"]):
        by_row.setdefault((e["pid"], e["tid"]), []).append(e)
        bars.setdefault((e["pid"], e["tid"], e.get("cat")), []).append((x(e["ts"]), max(e["dur"], 1) / per))
    for (pid, tid, cat), spans in bars.items():
        ax.broken_barh(spans, (rows.index((pid, tid)) - 0.4, 0.8), facecolors=CAT_COLORS.get(cat, "#999999"))
    for y, key in enumerate(rows):
        if y and key[0] != rows[y - 1][0]:
            ax.axhline(y - 0.5, color="0.5", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d %s" % (p, names.get((p, t), "host" if t == HOST_TID else "stream %d" % t))
                        for p, t in rows], fontsize=8 if len(rows) > 16 else 9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span_us / per * 1.005)
    ax.set_xlabel("%s (%s since the step began)" % (clock_words(meta), unit))
    phases = phase_spans(sel, step)
    for label, s, t in phases:
        strip.axvspan(x(s), x(t), color=PHASE_COLORS[label.split()[0]], ec="white")
        ax.axvline(x(s), color="0.3", lw=0.7, ls=":")
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.tick_params(axis="x", length=0)
    for side in ("left", "right", "top", "bottom"):
        strip.spines[side].set_visible(False)
    ranks = sorted({p for p, _ in rows})
    fig.suptitle("step %d (the trace's args.step %d), %d rank%s, %s" % (step + 1, step, len(ranks),
                 "" if len(ranks) == 1 else "s", clock_words(meta)), fontsize=11)
    present = {e.get("cat") for e in sel}
    waited = sum(d for _, d, _ in host_waits(sel, step).get(ranks[0], [])) / per
    styles = [(words + (" (rank %d: %.4g %s)" % (ranks[0], waited, unit) if cat == HOST_SYNC else ""), colour)
              for cat, words, colour in TRACK_STYLE if cat in present]
    legend = strip.legend([plt.Rectangle((0, 0), 1, 1, color=c) for _, c in styles], [w for w, _ in styles],
                          loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=len(styles), fontsize=8,
                          frameon=False, borderaxespad=0)
    fig.tight_layout(h_pad=0.2)
    px_per_unit = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
    for label, s, t in phases:  # in its span; too narrow: over its neighbour, on the side away from the edge
        if fit_label([label], (t - s) / per * px_per_unit, points=8, dpi=fig.dpi):
            strip.text(x((s + t) / 2), 0.5, label, ha="center", va="center", fontsize=8)
        else:
            right = x(s) > 0.5 * span_us / per
            strip.text(x(t) if right else x(s), 0.5, label + " " if right else " " + label, va="center",
                       ha="right" if right else "left", fontsize=8)
    for y, key in enumerate(rows):
        for s, t, texts, cat in label_runs(by_row[key]):
            text = fit_label(texts, (t - s) / per * px_per_unit, dpi=fig.dpi)
            if text:
                ax.text(x((s + t) / 2), y, text, ha="center", va="center", fontsize=LABEL_PT,
                        color="white" if cat == COMPUTE else "black", clip_on=True)
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


def draw_memory(plt, snap, rank, ref_snap=None, ref_name=None):
    """memory.png's figure: (fig, axes, the peak's label, legend)."""
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
    fig = draw_memory(plt, snap, rank, ref_snap, run_name(ref) if ref else None)[0]
    fig.savefig(os.path.join(out, "memory.png"), dpi=DPI)
    plt.close(fig)

GROUP_FAMILIES = {"shard": ["#dd8452", "#f2b880", "#c0622c", "#f6d2b0"],
                  "replicate": ["#8172b3", "#b3a8db", "#5a4c8f", "#d4cdef"], "world": ["#999999"]}


def plot_groups(plt, run, out, step):
    """Collectives by process group: on a 2-D mesh the all-gathers and reduce-scatters run in shard groups
    and the grads' all-reduces in replicate groups; the picture shows which rank talks to which."""
    events, names, meta = load_trace(run)
    coll = [e for e in events if e.get("cat") == COLLECTIVE]
    groups = sorted({e.get("args", {}).get("group", "world") for e in coll})
    if not coll or groups == ["world"]:
        return  # a 1-D run: every collective is the world's
    steps = sorted({e["args"].get("step", -1) for e in coll if e["args"].get("step", -1) >= 0})
    if step is None:
        step = steps[len(steps) // 2] if steps else -1
    sel = [e for e in coll if e["args"].get("step", -1) == step] or coll
    t0 = min(e["ts"] for e in sel)
    rows = sorted({(e["pid"], e["tid"]) for e in sel})

    kinds = group_kinds(RunDir(run).run_json)  # what run.json states the runtime made: {name: kind}
    of_kind = {}
    for name, kind in kinds.items():
        of_kind.setdefault(kind, []).append(name)

    def colour(g):
        pal = GROUP_FAMILIES.get(kinds.get(g), ["#55a868"])
        idx = of_kind[kinds[g]].index(g) if g in kinds else 0
        return pal[idx % len(pal)]
    fig, ax = plt.subplots(figsize=(13, 0.5 * len(rows) + 1.8))
    for y, key in enumerate(rows):
        for e in sel:
            if (e["pid"], e["tid"]) != key:
                continue
            g = e["args"].get("group", "world")
            x, w = (e["ts"] - t0) / 1000.0, max(e["dur"], 1) / 1000.0
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour(g), edgecolors="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d %s" % (p, names.get((p, t), "stream %d" % t)) for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("%s (ms since the step's first collective)" % clock_words(meta))
    ax.set_title("collectives by process group, step %d: all-gathers and reduce-scatters inside the shard groups "
                 "(rows of the mesh), the grads' all-reduces across the replicate groups (its columns)" % (step + 1),
                 fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour(g)) for g in groups]
    ax.legend(handles, groups, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "groups.png"), dpi=DPI)
    plt.close(fig)


def plot_backward(plt, run, out, step, rank):
    """Rank `rank`'s compute and comm streams through one backward, every all-gather and reduce-scatter labelled
    with its module: where the policy issues the all-gathers, and what they queue behind."""
    try:
        with open(os.path.join(run, "run.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return
    policy, single = cfg.get("backward_prefetch", "pre"), cfg.get("single_comm_stream", False)
    if policy == "pre" and not single:
        return
    events, names, meta = load_trace(run)
    back = [e for e in events if e.get("pid") == rank and e.get("args", {}).get("phase") in BACKWARD_PHASES]
    steps = sorted({e["args"].get("step", -1) for e in back if e["args"].get("step", -1) >= 0})
    if not steps:
        return
    if step is None:
        step = steps[len(steps) // 2]
    sel = [e for e in back if e["args"].get("step") == step and e.get("tid") != HOST_TID]
    if not sel:
        return
    t0 = min(e["ts"] for e in sel)
    tids = sorted({e["tid"] for e in sel})
    fig, ax = plt.subplots(figsize=(13, 0.8 * len(tids) + 1.8))
    for y, tid in enumerate(tids):
        for e in sel:
            if e["tid"] != tid:
                continue
            x, w = (e["ts"] - t0) / 1000.0, max(e["dur"], 1) / 1000.0
            label, kind = label_and_kind(e["name"])
            colour = {ALL_GATHER: "#dd8452", REDUCE_SCATTER: "#8172b3"}.get(kind, CAT_COLORS.get(e.get("cat"),
                                                                                                  "#999999"))
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
            if e.get("cat") == COLLECTIVE:  # the module's name, all-gathers above the middle, reduce-scatters below
                ax.text(x + w / 2, y + (-0.22 if kind == ALL_GATHER else 0.22), label or kind,
                        ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get((rank, t), "stream %d" % t) for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("%s (ms since the step's backward began, rank %d)" % (clock_words(meta), rank))
    ax.set_title("backward of step %d: --backward-prefetch %s%s (all-gathers orange, reduce-scatters purple, compute "
                 "blue, waits red, events green)" % (step + 1, policy, ", one comm stream" if single else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "backward.png"), dpi=DPI)
    plt.close(fig)


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
            ax.text(x + w / 2, y, "%s%d" % (what, mb), ha="center", va="center", fontsize=7, color="white")
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
