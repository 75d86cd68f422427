"""tools/plots.py: what the pictures are built from, checked on small synthetic traces and snapshots (no pixel
comparison): the phase spans, the host's waits, which slices get a name, the timeline's legend and clock, waits
drawn only where they stall compute (not on an idle stream), the host's waits a loss only where compute runs dry,
a pipeline's passes named once per compute row with no text overlapping another, groups.png's colours and title
for what the run has (each pipeline stage its colour, the world's all-reduce seen), the memory plot's peak label
clear of its legend with the reference overlaid, one legend vocabulary in loss.png, no loss.png for a dry run;
and on real runs: `make plots RUN= REF=` end to end against a gzip'd reference directory, a dry run, a pipeline."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, SOLVED, run_train, solution_bin, trace_events

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import plots  # noqa: E402  (tools/ is on sys.path: tests/conftest.py)
from trace_names import COPY, HOST_SYNC  # noqa: E402

META = {"clock": "model", "device_profile": "teach"}


def ev(name, cat, ts, dur, tid=0, pid=0, step=0, phase="forward", module=None, **args):
    a = dict(step=step, phase=phase, module=module or name.split(".")[0], **args)
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": a}


def one_step(pid=0, step=0, t0=0.0):
    """A rank's step 0: the comm stream's all-gathers from t0-50 (before compute starts), forward of block0 (a
    copy between its kernels) and block1, a wait (block1's all-gather, recorded 10 µs late), backward of block1
    and block0, the optimizer; the reduce-scatter stream waits for the grads (recorded by compute at t0+600) from
    t0 on, idle; the host waits from t0+20 to the end, while compute is busy (it runs ahead)."""
    return [
        ev("block0.all_gather", "collective", t0 - 50, 50, tid=1, pid=pid, step=step, phase="pre_forward",
           module="embedding"),
        ev("block1.all_gather", "collective", t0, 10, tid=1, pid=pid, step=step, phase="pre_forward",
           module="block0"),
        ev("block0.wq", "compute", t0, 40, pid=pid, step=step),
        ev("block0.copy", COPY, t0 + 40, 5, pid=pid, step=step, phase="pre_forward", module="block1"),
        ev("block0.w1", "compute", t0 + 45, 55, pid=pid, step=step),
        ev("block1.record:copy_out_done", "event", t0 + 100, 0, pid=pid, step=step),
        ev("block1.wq", "compute", t0 + 100, 100, pid=pid, step=step),
        ev("wait:grads_ready", "wait", t0, 600, tid=2, pid=pid, step=step, phase="post_backward", module="block0"),
        ev("wait:block1.all_gather_done", "wait", t0 + 200, 10, pid=pid, step=step, phase="pre_backward",
           module="block1"),
        ev("block1.record:block1.all_gather_done", "event", t0 + 210, 0, tid=1, pid=pid, step=step,
           phase="pre_backward"),
        ev("block1.wq_bwd", "compute", t0 + 210, 190, pid=pid, step=step, phase="backward"),
        ev("block0.wq_bwd", "compute", t0 + 400, 200, pid=pid, step=step, phase="backward"),
        ev("block0.record:grads_ready", "event", t0 + 600, 0, pid=pid, step=step, phase="post_backward"),
        ev("block0.reduce_scatter", "collective", t0 + 600, 30, tid=2, pid=pid, step=step, phase="post_backward"),
        ev("adamw", "compute", t0 + 600, 50, pid=pid, step=step, phase="optimizer", module="optimizer"),
        ev("sync:compute", HOST_SYNC, t0 + 20, 630, tid=1000, pid=pid, step=step, phase="optimizer",
           module="optimizer"),
    ]


def trace(ranks=2):
    events = []
    for pid in range(ranks):
        events += one_step(pid, 0, 0.0) + one_step(pid, 1, 1000.0)
    names = {}
    for pid in range(ranks):
        names.update({(pid, 0): "compute", (pid, 1): "all_gather", (pid, 2): "reduce_scatter", (pid, 1000): "host"})
    return events, names


def test_phase_spans_come_from_the_compute_stream_of_one_step():
    events, _ = trace()
    assert plots.phase_spans(events, 0) == [("forward", 0, 200), ("backward", 200, 600), ("optimizer", 600, 650)]
    assert plots.phase_spans(events, 1)[0] == ("forward", 1000, 1200)
    assert plots.phase_spans(events, 7) == []


def test_phase_spans_per_microbatch():
    events = []
    for mb in range(2):
        events += [ev("block0.wq", "compute", 100 * mb, 40, microbatch=mb),
                   ev("block0.wq_bwd", "compute", 100 * mb + 40, 60, phase="backward", microbatch=mb)]
    events.append(ev("adamw", "compute", 200, 10, phase="optimizer"))
    assert [s[0] for s in plots.phase_spans(events, 0)] == ["forward mb0", "backward mb0", "forward mb1",
                                                            "backward mb1", "optimizer"]


def test_host_waits_are_the_host_tracks_sync_slices_of_the_step():
    events, _ = trace()
    assert plots.host_waits(events, 0) == {0: [(20, 630, "compute")], 1: [(20, 630, "compute")]}
    assert plots.host_waits(events, 1)[1] == [(1020.0, 630, "compute")]


def test_label_runs_merge_a_modules_kernels_and_name_each_collective():
    events, _ = trace()
    compute = sorted((e for e in events if e["pid"] == 0 and e["tid"] == 0 and e["args"]["step"] == 0),
                     key=lambda e: e["ts"])
    runs = plots.label_runs(compute)
    # block0's two kernels are one run (the copy between them does not end it); the wait ends block1's forward run
    assert [(s, t, texts[0]) for s, t, texts, _ in runs] == [
        (0, 100, "block0"), (100, 200, "block1"), (210, 400, "block1"), (400, 600, "block0"),
        (600, 650, "optimizer")]
    gap = [ev("block0.wq", "compute", 0, 40), ev("block0.wk", "compute", 60, 40), ev("block0.wv", "compute", 201, 9)]
    assert [r[:2] for r in plots.label_runs(gap)] == [(0, 100), (201, 210)], "idle longer than the run: a new run"
    sparse = [ev("block0.wq", "compute", 0, 100), ev("block0.wk", "compute", 190, 10),
              ev("block0.wv", "compute", 400, 10)]
    assert plots.label_runs(sparse) == [], "kernels filling less than half of their run: no name"
    comm = [e for e in events if e["pid"] == 0 and e["tid"] == 1 and e["args"]["step"] == 0]
    assert plots.label_runs(comm)[0] == (-50, 0, ["block0.all_gather", "block0 AG", "block0"], "collective")
    host = [e for e in events if e["pid"] == 0 and e["tid"] == 1000 and e["args"]["step"] == 0]
    assert plots.label_runs(host)[0][2] == ["host waits for compute (optimizer)", "sync:compute"]


def test_fit_label_takes_the_longest_text_that_fits():
    texts = ["block0.all_gather", "block0 AG", "block0"]
    assert plots.fit_label(texts, 500) == "block0.all_gather"
    assert plots.fit_label(texts, 60) == "block0 AG"
    assert plots.fit_label(texts, 40) == "block0"
    assert plots.fit_label(texts, 10) is None


def texts_of(ax):
    return [t.get_text() for t in ax.texts]


def test_timeline_legend_clock_phases_and_names():
    events, names = trace()
    fig, ax, strip, legend = plots.draw_timeline(plt, events, names, META, 0)
    try:
        words = [t.get_text() for t in legend.get_texts()]
        assert "host ahead, waits for the device" in words and "a wait that stalls compute" in words, words
        assert not any(w.startswith("host blocks") for w in words), "compute busy to the wait's end: no host stall"
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles  # matplotlib < 3.7: legendHandles
        colours = [tuple(h.get_facecolor()) for h in handles]
        assert len(set(colours)) == len(colours), "two legend entries share a colour"
        assert "modelled time on profile teach (µs since the step began)" == ax.get_xlabel()
        title = fig._suptitle.get_text()
        assert title.startswith("step 1, 2 ranks, modelled time on profile teach"), title
        assert "args.step" not in title, "one step numbering: from 1, as metrics.jsonl"
        assert [t for t in texts_of(strip)] == ["forward", "backward", "optimizer"]
        names_written = texts_of(ax)
        assert names_written.count("block0") >= 2 * 2  # forward and backward runs, on both ranks
        assert "the host is ahead: it waits for compute (optimizer)" in names_written
        assert not any(t.startswith("block1") and "AG" in t or t == "block1.all_gather" for t in names_written), \
            "a 10 µs all-gather of a 700 µs step has no room for its name"
        assert [t.get_text() for t in ax.get_yticklabels()][:4] == [
            "rank 0 host", "rank 0 compute", "rank 0 all_gather", "rank 0 reduce_scatter"]
        assert no_overlap(fig, strip.texts) and no_overlap(fig, legend.get_texts())
    finally:
        plt.close(fig)
    for meta, words in (({"clock": "gpu"}, "GPU time"), ({}, "wall time")):
        fig, ax, _, _ = plots.draw_timeline(plt, events, names, meta, 1)
        assert ax.get_xlabel().startswith(words), ax.get_xlabel()
        assert fig._suptitle.get_text().startswith("step 2, "), fig._suptitle.get_text()
        plt.close(fig)


def no_overlap(fig, texts):
    """No two of the text artists' boxes overlap (as the renderer draws them)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in texts if t.get_text() and t.get_visible()]
    for i, (a, box) in enumerate(boxes):
        for b, other in boxes[i + 1:]:
            assert not box.overlaps(other), "%r overlaps %r" % (a, b)
    return True


def wait_bars(ax, colour=plots.CAT_COLORS["wait"]):
    """{row: [(x, width)]} of the wait bars drawn on a timeline's axes."""
    from matplotlib.colors import to_rgba
    out = {}
    for c in ax.collections:
        if tuple(c.get_facecolor()[0]) != to_rgba(colour):
            continue
        for path in c.get_paths():
            v = path.vertices
            out.setdefault(int(round((v[:, 1].min() + v[:, 1].max()) / 2)), []).append(
                (v[:, 0].min(), v[:, 0].max() - v[:, 0].min()))
    return out


def test_a_wait_is_drawn_where_it_stalls_compute_not_on_an_idle_stream():
    events, names = trace()
    # compute's wait is a stall; the reduce-scatter stream waiting 600 µs for the grads while compute runs is idle
    assert plots.wait_stalls(events) == {(0, 0): [(200, 210), (1200, 1210)], (1, 0): [(200, 210), (1200, 1210)]}
    fig, ax, _, _ = plots.draw_timeline(plt, events, names, META, 0)
    try:
        rows = [t.get_text() for t in ax.get_yticklabels()]
        drawn = wait_bars(ax)
        assert sorted(rows[y] for y in drawn) == ["rank 0 compute", "rank 1 compute"], drawn
        assert all(abs(w - 10) < 1e-6 for bars in drawn.values() for _, w in bars)
    finally:
        plt.close(fig)


def test_a_comm_streams_wait_is_drawn_where_compute_waits_behind_it():
    """compute waits 100..150 for an all-gather the all-gather stream queued behind its own wait (60..140, for a
    buffer stream 2 frees at 140), and stream 2 waited 90..130 for stream 3: each is drawn where the wait it holds
    up runs, transitively; stream 2's earlier idle wait is not."""
    events = [
        ev("block0.wq", "compute", 0, 100),
        ev("wait:ag_done", "wait", 100, 50, module="block1"),
        ev("block1.wq", "compute", 150, 50, module="block1"),
        ev("wait:buf_free", "wait", 60, 80, tid=1),
        ev("block1.all_gather", "collective", 140, 10, tid=1),
        ev("block1.record:ag_done", "event", 150, 0, tid=1),
        ev("wait:early", "wait", 0, 50, tid=2),
        ev("block0.record:early", "event", 50, 0, tid=3),
        ev("wait:x", "wait", 90, 40, tid=2),
        ev("block0.copy", COPY, 130, 10, tid=2),
        ev("block0.record:buf_free", "event", 140, 0, tid=2),
        ev("block0.record:x", "event", 130, 0, tid=3),
    ]
    assert plots.wait_stalls(events) == {(0, 0): [(100, 150)], (0, 1): [(100, 140)], (0, 2): [(100, 130)]}


def test_host_stalls_only_where_compute_runs_dry():
    """The host blocking in a hook (sync on an event at 50 that lands at 300) while compute ran out of work at 100:
    200 µs lost; waiting at the step's end for compute that runs until the wait ends: the host was ahead."""
    events = [ev("block0.wq", "compute", 0, 100),
              ev("sync:event block1.all_gather_done", HOST_SYNC, 50, 250, tid=1000, phase="pre_forward"),
              ev("block1.wq", "compute", 305, 200, module="block1"),
              ev("sync:compute", HOST_SYNC, 320, 185, tid=1000, phase="optimizer")]
    assert plots.host_stalls(events, 0) == {0: [(100, 300, "event block1.all_gather_done")]}
    names = {(0, 0): "compute", (0, 1000): "host"}
    fig, ax, _, legend = plots.draw_timeline(plt, events, names, META, 0)
    try:
        words = [t.get_text() for t in legend.get_texts()]
        assert "host blocks, compute idle (rank 0: 200 µs)" in words, words
        assert "host blocks, compute idle" in texts_of(ax)
    finally:
        plt.close(fig)


def pipeline_trace(P=2, M=4, f=10.0, b=20.0, hop=1.0):
    """A 1F1B pipeline of P one-rank stages over M microbatches (stage p on rank p): each pass two kernels, a
    forward f long and a backward b, a transfer `hop` between stages; then each rank's optimizer. Returns (events,
    names, meta)."""
    order = {}
    for p in range(P):
        warm = min(P - p, M)
        seq = [("F", m) for m in range(warm)]
        for m in range(M):
            seq.append(("B", m))
            if warm + m < M:
                seq.append(("F", warm + m))
        order[p] = seq
    end, free, idx = {}, [0.0] * P, [0] * P
    while any(idx[p] < len(order[p]) for p in range(P)):
        for p in range(P):
            if idx[p] >= len(order[p]):
                continue
            what, m = order[p][idx[p]]
            dep = (("F", p - 1, m) if p else None) if what == "F" else (("B", p + 1, m) if p < P - 1 else ("F", p, m))
            if dep and dep not in end:
                continue
            start = max(free[p], end[dep] + hop if dep else 0.0)
            end[(what, p, m)] = free[p] = start + (f if what == "F" else b)
            idx[p] += 1
    events = []
    for (what, p, m), t in end.items():
        d = f if what == "F" else b
        phase = "forward" if what == "F" else "backward"
        for k in range(2):
            events.append(ev("block%d.k%d" % (p, k), "compute", t - d + k * d / 2, d / 2, pid=p, phase=phase,
                             module="block%d" % p, microbatch=m))
    last = max(end.values())
    for p in range(P):
        events.append(ev("adamw", "compute", last + 2, 3, pid=p, phase="optimizer", module="optimizer"))
        events.append(ev("sync:compute", HOST_SYNC, 1, last + 4, tid=1000, pid=p, phase="optimizer",
                         module="optimizer"))
    names = {}
    for p in range(P):
        names.update({(p, 0): "compute", (p, 1000): "host"})
    meta = dict(META, pipeline=[{"stage": p, "modules": ["block%d" % p], "ranks": [p]} for p in range(P)])
    return events, names, meta


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_pipeline_timeline_names_each_pass_once_and_no_label_overlaps(P, M):
    events, names, meta = pipeline_trace(P, M)
    assert len([s for s in plots.phase_spans(events, 0) if s[0] != "optimizer"]) == 2 * M  # they overlap in time
    fig, ax, strip, legend = plots.draw_timeline(plt, events, names, meta, 0)
    try:
        band = texts_of(strip)
        assert band[0].startswith("forward and backward of %d microbatches" % M) and band[1:] in (["opt"], []), band
        assert no_overlap(fig, strip.texts) and no_overlap(fig, ax.texts) and no_overlap(fig, legend.get_texts())
        rows = [t.get_text() for t in ax.get_yticklabels()]
        passes = ["%s%d" % (w, m) for w in "FB" for m in range(M)]
        for p in range(P):
            y = rows.index("rank %d compute" % p)
            written = [t.get_text() for t in ax.texts if round(t.get_position()[1]) == y]
            assert sorted(written) == sorted(passes), (p, written)  # one name per microbatch's pass, each once
    finally:
        plt.close(fig)


def test_drawn_ranks_keep_each_stage_and_stay_few():
    assert plots.drawn_ranks(list(range(4)), {}) == [0, 1, 2, 3]
    assert plots.drawn_ranks(list(range(64)), {}) == list(range(8))
    meta = {"pipeline": [{"stage": p, "ranks": list(range(16 * p, 16 * p + 16))} for p in range(4)]}
    assert plots.drawn_ranks(list(range(64)), meta) == [0, 1, 2, 3, 4, 16, 32, 48]  # each stage's first rank
    assert plots.rank_words([0, 1, 2, 3, 4, 16, 32, 48]) == "ranks 0-4, 16, 32, 48"


TAGS = ["param", "param_shard", "unsharded_param", "grad_shard", "unsharded_grad", "activation", "optim_state",
        "comm_buffer", "temp"]


def snapshot(peak_step=0, big_mib=8, steps=3):
    """A run's memory in the runtime's nine tags: init allocates the params (big_mib when peak_step is -1, else
    1 MiB) and their 1 MiB of shards, then frees the params; each step allocates half a MiB of each other tag
    (activations: big_mib in step peak_step, else 1 MiB) and free them; step 2 asks to free the shards
    (free_requested: still held); the end allocates and frees a temp."""
    mib = lambda n: int(n * (1 << 20))  # noqa: E731
    big = lambda step: mib(big_mib if step == peak_step else 1)  # noqa: E731
    events = [{"action": "alloc", "addr": 1, "size": big(-1), "tag": "param", "step": -1, "phase": "init"},
              {"action": "alloc", "addr": 2, "size": mib(1), "tag": "param_shard", "step": -1, "phase": "init"},
              {"action": "free", "addr": 1, "step": -1, "phase": "init"}]
    addr = 10
    for step in range(steps):
        for tag in TAGS[2:]:
            addr += 1
            events.append({"action": "alloc", "addr": addr, "size": big(step) if tag == "activation" else mib(0.5),
                           "tag": tag, "step": step, "phase": "forward"})
        for a in range(addr - len(TAGS) + 3, addr + 1):
            events.append({"action": "free", "addr": a, "step": step, "phase": "backward"})
        if step == 2:
            events.append({"action": "free_requested", "addr": 2, "step": step, "phase": "backward"})
    events += [{"action": "alloc", "addr": 99, "size": mib(1), "tag": "temp", "step": steps, "phase": "end"},
               {"action": "free", "addr": 99, "step": steps, "phase": "end"}]
    return {"tags": TAGS, "events": events}


def test_memory_series_line_the_steps_up():
    xs, series, bands = plots.memory_series(snapshot())
    assert [b[2] for b in bands] == ["init", "1", "2", "3", "end"]
    n = 2 * (len(TAGS) - 2)  # a step's allocs and frees
    assert xs[:3] == [0, 1 / 3, 2 / 3] and all(1 <= x < 2 for x in xs[3:3 + n])
    assert all(3 <= x < 4 for x in xs[3 + 2 * n:3 + 3 * n])
    assert max(series["activation"]) == 8 and max(series["param"]) == 1 and max(series["temp"]) == 1
    assert series["param"][-1] == 0 and series["param_shard"][-1] == 1, "a free_requested block is still held"
    assert xs[-1] == bands[-1][1] and len(xs) == len(series["param"])


@pytest.mark.parametrize("peak_step", [-1, 0, 2])
def test_memory_peak_label_is_clear_of_the_legend_and_the_reference_overlaid(peak_step):
    fig, ax, label, legend = plots.draw_memory(plt, snapshot(peak_step), 0, snapshot(1, big_mib=4), "stage04")
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        box, leg = label.get_window_extent(r), legend.get_window_extent(r)
        assert not box.overlaps(leg), (box, leg)
        assert leg.x0 >= ax.bbox.x1 and fig.bbox.contains(leg.x1, leg.y0), "the legend beside the axes, in the figure"
        assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1), (box, ax.bbox)
        assert label.get_text() == ("peak 9.00 MiB" if peak_step < 0 else "peak 12.00 MiB")
        refs = [line for line in ax.get_lines() if line.get_label() == "reference (stage04)"]
        assert refs and max(refs[0].get_ydata()) == 8
        assert max(refs[0].get_xdata()) < 4, "the reference's end is not drawn (it need not line up with the run's)"
    finally:
        plt.close(fig)
    fig, ax, label, legend = plots.draw_memory(plt, snapshot(peak_step), 0, snapshot(1, steps=5), "stage04")
    try:
        refs = [line for line in ax.get_lines() if line.get_label() == "reference (stage04)"]
        assert max(refs[0].get_xdata()) < 4, "a reference with more steps stops at the run's last step"
        assert "reference (stage04)" in [t.get_text() for t in legend.get_texts()]
        assert [t.get_text() for t in legend.get_texts() if t.get_text() in TAGS] == TAGS[::-1]  # the stack's order
    finally:
        plt.close(fig)


def test_loss_panels_share_one_legend_vocabulary():
    rows = [{"step": s, "loss": 5.0 - s, "grad_norm": 1.0 + s, "peak_mem_bytes": 3 << 20,
             "peak_mem_bytes_per_rank": [3 << 20, 2 << 20, 3 << 20]} for s in (1, 2, 3)]
    ref = [{"step": s, "loss": 5.1 - s, "grad_norm": 1.1 + s, "peak_mem_bytes": 3 << 20} for s in (1, 2, 3)]
    fig = plots.draw_steps(plt, rows, ref, "mine", "stage04")
    try:
        axes = fig.get_axes()
        assert len(axes) == 3
        style = {}
        for ax in axes:
            for line in ax.get_lines():
                key = (line.get_color(), line.get_linestyle())
                assert style.setdefault(line.get_label(), key) == key, line.get_label()
        assert set(style) == {"your run (mine)", "reference (stage04)", "ranks 0, 2", "rank 1"}
        assert [line.get_label() for line in axes[1].get_lines()] == ["your run (mine)", "reference (stage04)"]
        assert {line.get_label() for line in axes[2].get_lines()} == {"ranks 0, 2", "rank 1", "reference (stage04)"}
        assert axes[2].get_title() == "peak memory per rank (MiB)"
        assert len(fig.legends) == 1 and {t.get_text() for t in fig.legends[0].get_texts()} == set(style)
        assert not any(ax.get_legend() for ax in axes), "one legend for the figure, none per panel"
    finally:
        plt.close(fig)


@pytest.mark.skipif("04" not in [s.id for s in SOLVED], reason="no stage 04 solution (the student tree)")
def test_make_plots_with_a_reference(tmp_path):
    run = tmp_path / "run"
    run_train(solution_bin("04"), run, "--world", 2, "--steps", 2, "--profile-steps", 2, timeout=120)
    ref = os.path.join(ROOT, "logs", "reference", "stage04")
    p = subprocess.run(["make", "-s", "plots", "RUN=%s" % run, "REF=%s" % ref], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    for name in ("loss.png", "timeline.png", "memory.png"):
        assert (run / "plots" / name).stat().st_size > 10000, name


PIPELINE = [s for s in SOLVED if s.pipeline]


@pytest.mark.skipif(not PIPELINE or not os.path.isdir(os.path.join(ROOT, "logs", "reference")),
                    reason="no pipeline solution or no logs/reference here")
def test_one_bubble_for_the_grader_the_plot_and_the_bench(tmp_path):
    """The pipeline bubble has one definition (gradelib.trace_model.pipeline_bubble): on one run of the first
    pipeline stage's solution, in its grading configuration, the grader's pp_bubble line, pipeline.png's title
    and the bench's figure name the same step and the same share."""
    import re
    from benchlib.pipeline import bubble
    from gradelib.checks import run_check
    from gradelib.context import Context
    from gradelib.rubric import load_rubric, stage_flags
    from gradelib.runner import RunResult
    st = PIPELINE[0]
    rubric = load_rubric()
    run = tmp_path / "run"
    run_train(solution_bin(st), run, *stage_flags(rubric, st.id))
    ctx = Context(rubric, st.id, RunResult(str(run), True, "", 0.0, []), os.path.join(ROOT, "logs", "reference"),
                  None)
    ok, reason, detail = run_check(ctx, "pp_bubble")
    assert ok, reason
    m = re.search(r"bubble (\d+\.\d)% in step (\d+)", detail)
    assert m, detail
    share, step = m.group(1), int(m.group(2))
    title = plots.plot_pipeline(plt, str(run), str(tmp_path), step - 1)
    assert "step %d:" % step in title and "as the grader measures it): %s%% of this step" % share in title, title
    world = int(ctx.world)
    assert "%.1f" % (100 * bubble(str(run), world, step - 1)) == share


def groups_trace(kind):
    """A step of 4 ranks' collectives and run.json's groups: kind 'pipeline' (two stages of two ranks, FSDP inside
    each, sends between them, the grad norm over the world) or 'hsdp' (a 2x2 mesh, the norm over the shard group)."""
    events = []
    if kind == "pipeline":
        groups = [{"name": "world", "kind": "world", "ranks": [0, 1, 2, 3]},
                  {"name": "stage0", "kind": "stage", "ranks": [0, 1]},
                  {"name": "stage1", "kind": "stage", "ranks": [2, 3]}]
        of = lambda r: "stage%d" % (r // 2)  # noqa: E731
        norm = "world"
    else:
        groups = [{"name": "world", "kind": "world", "ranks": [0, 1, 2, 3]},
                  {"name": "shard0", "kind": "shard", "ranks": [0, 1]},
                  {"name": "shard1", "kind": "shard", "ranks": [2, 3]},
                  {"name": "replicate0", "kind": "replicate", "ranks": [0, 2]},
                  {"name": "replicate1", "kind": "replicate", "ranks": [1, 3]}]
        of = lambda r: "shard%d" % (r // 2)  # noqa: E731
        norm = None
    for r in range(4):
        events += [ev("block0.all_gather", "collective", 0, 500, tid=1, pid=r, group=of(r)),
                   ev("block0.reduce_scatter", "collective", 5000, 500, tid=2, pid=r, group=of(r),
                      phase="post_backward"),
                   ev("grad_norm.all_reduce", "collective", 9990, 1, pid=r, group=norm or of(r), phase="optimizer")]
        if kind == "pipeline":
            events.append(ev("send act mb0 to %d" % (r + 2), "collective", 1000, 10, pid=r, phase="p2p", module="pipe",
                             p2p="send %d 0 act" % (r + 2)) if r < 2 else
                          ev("recv act mb0 from %d" % (r - 2), "collective", 1000, 10, pid=r, phase="p2p",
                             module="pipe", p2p="recv %d 0 act" % (r - 2)))
        else:
            events.append(ev("block0.all_reduce", "collective", 5500, 500, tid=2, pid=r, group="replicate%d" % (r % 2),
                             phase="post_backward"))
    names = {}
    for r in range(4):
        names.update({(r, 0): "compute", (r, 1): "all_gather", (r, 2): "reduce_scatter"})
    return events, names, {"groups": groups}


def test_groups_of_a_pipeline_each_stage_its_colour_and_the_world_seen():
    events, names, run_json = groups_trace("pipeline")
    fig, ax, legend = plots.draw_groups(plt, events, names, META, run_json, 0)
    try:
        title = ax.get_title()
        assert "each pipeline stage's group" in title and "the grad norm's all-reduce in the world" in title, title
        assert "activations and grads sent between neighbouring stages" in title, title
        assert "replicate" not in title and "shard" not in title, "a pipeline run has neither"
        words = [t.get_text() for t in legend.get_texts()]
        assert words == ["stage0 (ranks 0, 1): all-gathers and reduce-scatters",
                         "stage1 (ranks 2, 3): all-gathers and reduce-scatters",
                         "world (ranks 0-3): the grad norm's all-reduce", "sends and receives between stages"], words
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles
        colours = [tuple(h.get_facecolor()) for h in handles]
        assert len(set(colours)) == 4, "stage 0, stage 1, the world and the sends each a colour of their own"
        from matplotlib.colors import to_rgba
        world = [c for c in ax.collections if tuple(c.get_facecolor()[0]) == to_rgba(colours[2])]
        widths = [p.vertices[:, 0].max() - p.vertices[:, 0].min() for c in world for p in c.get_paths()]
        assert len(widths) == 4 and min(widths) >= 0.003 * ax.get_xlim()[1], "the 1 µs all-reduce is seen"
        assert no_overlap(fig, [ax.title] + legend.get_texts() + [ax.xaxis.label])
    finally:
        plt.close(fig)


def test_groups_of_a_mesh_keep_the_handouts_words_and_colours():
    events, names, run_json = groups_trace("hsdp")
    fig, ax, legend = plots.draw_groups(plt, events, names, META, run_json, 0)
    try:
        title = ax.get_title().replace("\n", " ")
        assert "reduce-scatters and the grad norm's all-reduce in the shard groups (rows of the mesh)" in title
        assert "the grads' all-reduces in the replicate groups (its columns)" in title, title
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles
        colours = {t.get_text().split()[0]: h.get_facecolor() for t, h in zip(legend.get_texts(), handles)}
        from matplotlib.colors import to_hex
        assert {to_hex(colours["shard0"]), to_hex(colours["shard1"])} <= set(plots.GROUP_FAMILIES["shard"])
        assert to_hex(colours["replicate0"]) in plots.GROUP_FAMILIES["replicate"]  # HANDOUT: orange and purple
    finally:
        plt.close(fig)
    only_world = [e for e in events if e["args"]["group"] == "world"] or [ev("x.all_gather", "collective", 0, 1,
                                                                              group="world")]
    assert plots.draw_groups(plt, only_world, names, META, run_json, 0) is None, "a 1-D run has no groups.png"


def test_a_dry_run_draws_no_empty_panel(tmp_path):
    rows = [{"step": s, "loss": None, "grad_norm": None, "dry_run": True, "peak_mem_bytes": 3 << 30} for s in (1, 2)]
    assert not plots.trains(rows) and plots.trains([{"step": 1, "loss": 2.0}])
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots.plot_loss(plt, str(run), None, str(tmp_path))
    assert not (tmp_path / "loss.png").exists(), "a dry run has no loss: no loss.png with two peak-memory points"


@pytest.mark.skipif("04" not in [s.id for s in SOLVED], reason="no stage 04 solution (the student tree)")
def test_a_real_dry_run_timeline_is_not_red(tmp_path):
    """A dry run of stage 04's solution: no loss.png, and the timeline's waits only inside compute's own waits."""
    run = tmp_path / "run"
    run_train(solution_bin("04"), run, "--dry-run", "--flavor", "debugmodel", "--world", 2, "--steps", 2,
              "--profile-steps", 2, timeout=120)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plots.py"), str(run)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "no loss.png" in p.stdout, p.stdout + p.stderr
    assert sorted(os.listdir(run / "plots")) == ["memory.png", "timeline.png"]
    events = trace_events(run)
    stalls = plots.wait_stalls(events)
    for (rank, tid), spans in stalls.items():
        mine = plots.union((e["ts"], e["ts"] + e["dur"]) for e in events
                           if e["pid"] == rank and e["tid"] == 0 and e["cat"] == "wait")
        for a, b in spans:
            assert any(x - 0.01 <= a and b <= y + 0.01 for x, y in mine), (rank, tid, a, b)
    waits = sum(e["dur"] for e in events if e["cat"] == "wait")
    drawn = sum(b - a for spans in stalls.values() for a, b in spans)
    assert drawn < 0.2 * waits, "the streams' idle waits are not drawn (%.0f of %.0f µs drawn)" % (drawn, waits)


@pytest.mark.skipif(not [s for s in SOLVED if s.pipeline], reason="no pipeline solution (the student tree)")
def test_a_real_pipeline_runs_plots_read(tmp_path):
    """The last pipeline stage's solution in its grading configuration: the timeline names each pass on each
    compute row once, no text overlaps another; groups.png's stages each a colour."""
    from gradelib.rubric import load_rubric, stage_flags
    st = [s for s in SOLVED if s.pipeline][-1]
    run = tmp_path / "run"
    run_train(solution_bin(st), run, *stage_flags(load_rubric(), st.id))
    events, names, meta = plots.load_trace(str(run))
    step = plots.pick_step(events, None)
    fig, ax, strip, legend = plots.draw_timeline(plt, events, names, meta, step)
    try:
        assert no_overlap(fig, strip.texts) and no_overlap(fig, legend.get_texts())
        rows = [t.get_text() for t in ax.get_yticklabels()]
        for y, row in enumerate(rows):
            written = [t for t in ax.texts if round(t.get_position()[1]) == y]
            assert no_overlap(fig, written), row
        M = int(plots.RunDir(str(run)).run_json["microbatches"])
        assert texts_of(strip)[0].startswith("forward and backward of %d microbatches" % M)
        compute = [t.get_text() for t in ax.texts if round(t.get_position()[1]) == rows.index("rank 0 compute")]
        assert len(compute) == len(set(compute)) and set(compute) <= {"%s%d" % (w, m) for w in "FB" for m in range(M)}
    finally:
        plt.close(fig)
    fig, ax, legend = plots.draw_groups(plt, events, names, meta, plots.RunDir(str(run)).run_json, step)
    try:
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles
        colours = {t.get_text().split()[0]: tuple(h.get_facecolor()) for t, h in zip(legend.get_texts(), handles)}
        stages = [c for name, c in colours.items() if name.startswith("stage")]
        assert len(stages) >= 2 and len(set(stages)) == len(stages), colours
        assert "world" in colours and "replicate" not in ax.get_title()
    finally:
        plt.close(fig)
