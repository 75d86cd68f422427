#!/usr/bin/env python3
"""Pictures of a run directory (written by `train --out DIR`).

    plots.py RUN [--ref REF_RUN] [--out DIR] [--step N] [--rank R]

writes into DIR (default RUN/plots):
  loss.png      loss and grad norm per step (dashed: the reference run)
  timeline.png  one row per (rank, stream) for one step: compute, copies,
                collectives and waits — overlap at a glance
  memory.png    rank R's allocated bytes over the run (host order), stacked by
                tag, with the peak marked
  groups.png    only for a run on a 2-D mesh (--mesh): every rank's collectives
                of one step, coloured by process group (shard groups: rows of
                the mesh; replicate groups: its columns)
  backward.png  only for a run with a backward-prefetch policy other than pre or
                one comm stream (stage 10): rank R's streams during one step's
                backward, each collective labelled with its module
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import glob
import json
import os
import sys

import repo_paths  # noqa: F401  (grader/ on sys.path, for trace_names)
from trace_names import (ALL_GATHER, BACKWARD_PHASES, COLLECTIVE, COMPUTE, COPY, EVENT, HOST_TID, MEMSET,
                         REDUCE_SCATTER, WAIT, label_and_kind)


def load_metrics(run):
    path = os.path.join(run, "metrics.jsonl")
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def step_panel(ax, key, ylabel, title, rows, label, ref_rows):
    """One metric per step on the axes ax: the run's points and, given ref_rows, the reference's dashed line."""
    ax.plot([r["step"] for r in rows], [r[key] for r in rows], "o-", label=label)
    if ref_rows:
        ax.plot([r["step"] for r in ref_rows], [r[key] for r in ref_rows], "k--", label="reference")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def plot_loss(plt, run, ref, out):
    rows = load_metrics(run)
    ref_rows = load_metrics(ref) if ref else []
    has_gn = any(r.get("grad_norm") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if has_gn else 1, figsize=(11 if has_gn else 6, 4), squeeze=False)
    step_panel(axes[0][0], "loss", "loss", "loss", rows, os.path.basename(run.rstrip("/")), ref_rows)
    if has_gn:
        step_panel(axes[0][1], "grad_norm", "grad norm (before clipping)", "grad norm", rows, "run",
                   ref_rows if ref_rows and any(r.get("grad_norm") is not None for r in ref_rows) else None)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)


CAT_COLORS = {COMPUTE: "#4C72B0", COPY: "#8C8C8C", COLLECTIVE: "#DD8452", WAIT: "#C44E52", EVENT: "#55A868",
              MEMSET: "#B0B0B0"}


def load_trace(run):
    events = []
    names = {}
    files = sorted(glob.glob(os.path.join(run, "trace_rank*.json")))
    if not files and os.path.exists(os.path.join(run, "trace.json")):
        files = [os.path.join(run, "trace.json")]
    for path in files:
        with open(path) as fh:
            doc = json.load(fh)
        for e in doc.get("traceEvents", []):
            if e.get("ph") == "X":
                events.append(e)
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
    return events, names


def plot_timeline(plt, run, out, step):
    events, names = load_trace(run)
    if not events:
        print("no trace events in %s: skipping timeline.png" % run)
        return
    steps = sorted({e.get("args", {}).get("step", -1) for e in events if e.get("args", {}).get("step", -1) >= 0})
    if step is None:
        step = steps[len(steps) // 2] if steps else -1  # a step in the middle: past warm-up
    sel = [e for e in events if e.get("args", {}).get("step", -1) == step] or events
    t0 = min(e["ts"] for e in sel)
    rows = sorted({(e["pid"], e["tid"]) for e in sel})
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(rows) + 1.5))
    for y, key in enumerate(rows):
        for e in sel:
            if (e["pid"], e["tid"]) != key:
                continue
            ax.broken_barh([((e["ts"] - t0) / 1000.0, max(e["dur"], 1) / 1000.0)], (y - 0.4, 0.8),
                           facecolors=CAT_COLORS.get(e.get("cat"), "#999999"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d %s" % (p, names.get((p, t), "stream %d" % t)) for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title("stream timeline, step %d (collectives orange, compute blue, waits red)" % step)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in CAT_COLORS.values()]
    ax.legend(handles, list(CAT_COLORS.keys()), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "timeline.png"), dpi=110)
    plt.close(fig)


def plot_memory(plt, run, out, rank):
    path = os.path.join(run, "memory_rank%d.json" % rank)
    if not os.path.exists(path):
        print("no %s: skipping memory.png" % path)
        return
    with open(path) as fh:
        snap = json.load(fh)
    tags = snap.get("tags") or []
    live = {}
    by_tag = {t: 0 for t in tags}
    xs, series = [], {t: [] for t in tags}
    for e in snap.get("events", []):
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = (e["tag"], e["size"])
            by_tag[e["tag"]] = by_tag.get(e["tag"], 0) + e["size"]
        elif act in ("free", "free_completed") and e["addr"] in live:  # free_requested: still held
            tag, size = live.pop(e["addr"])
            by_tag[tag] -= size
        else:
            continue
        for t in by_tag:
            series.setdefault(t, [0] * len(xs))
        xs.append(len(xs))
        for t in series:
            series[t].append(by_tag.get(t, 0) / 2**20)
    if not xs:
        print("no allocation events in %s: skipping memory.png" % path)
        return
    used = [t for t in series if max(series[t]) > 0]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.stackplot(xs, [series[t] for t in used], labels=used, step="post")
    total = [sum(series[t][i] for t in used) for i in range(len(xs))]
    peak_i = max(range(len(xs)), key=lambda i: total[i])
    ax.axhline(total[peak_i], color="k", lw=0.8, ls="--")
    ax.annotate("peak %.2f MiB" % total[peak_i], (peak_i, total[peak_i]), textcoords="offset points",
                xytext=(5, 5))
    ax.set_xlabel("allocator event (host order)")
    ax.set_ylabel("MiB allocated")
    ax.set_title("rank %d memory by tag" % rank)
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)
    plt.close(fig)


GROUP_FAMILIES = {"shard": ["#dd8452", "#f2b880", "#c0622c", "#f6d2b0"],
                  "replicate": ["#8172b3", "#b3a8db", "#5a4c8f", "#d4cdef"], "world": ["#999999"]}


def plot_groups(plt, run, out, step):
    """Collectives by process group: on a 2-D mesh the all-gathers and reduce-scatters run in shard groups
    and the grads' all-reduces in replicate groups; the picture shows which rank talks to which."""
    events, names = load_trace(run)
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

    def colour(g):
        fam = g.rstrip("0123456789")
        pal = GROUP_FAMILIES.get(fam, ["#55a868"])
        idx = int(g[len(fam):]) if g[len(fam):].isdigit() else 0
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
    ax.set_xlabel("ms since the step's first collective")
    ax.set_title("collectives by process group, step %d: all-gathers and reduce-scatters inside the shard groups "
                 "(rows of the mesh), the grads' all-reduces across the replicate groups (its columns)" % step,
                 fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour(g)) for g in groups]
    ax.legend(handles, groups, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "groups.png"), dpi=110)
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
    events, names = load_trace(run)
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
    ax.set_xlabel("ms since the step's backward began (rank %d)" % rank)
    ax.set_title("backward of step %d: --backward-prefetch %s%s (all-gathers orange, reduce-scatters purple, compute "
                 "blue, waits red, events green)" % (step, policy, ", one comm stream" if single else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "backward.png"), dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--ref", help="reference run directory for the loss plot")
    ap.add_argument("--out", help="output directory (default RUN/plots)")
    ap.add_argument("--step", type=int, help="step to draw in the timeline (default: a middle traced step)")
    ap.add_argument("--rank", type=int, default=0)
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.run, "metrics.jsonl")):
        print("error: %s has no metrics.jsonl (is it a run directory from train --out?)" % a.run, file=sys.stderr)
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
    plot_timeline(plt, a.run, out, a.step)
    plot_memory(plt, a.run, out, a.rank)
    plot_groups(plt, a.run, out, a.step)
    plot_backward(plt, a.run, out, a.step, a.rank)
    print("wrote plots to %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
