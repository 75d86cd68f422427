"""tools/plots.py: what the pictures are built from, checked on a small synthetic trace and snapshot (no pixel
comparison): the phase spans, the host's waits, which slices get a name, the timeline's legend and clock, the
memory plot's peak label clear of its legend with the reference overlaid, one legend vocabulary in loss.png; and
`make plots RUN= REF=` end to end on a solution's run against a gzip'd reference directory."""
import os
import subprocess

import pytest

from helpers import ROOT, SOLVED, run_train, solution_bin

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
    copy between its kernels) and block1, a wait, backward of block1 and block0, the optimizer; the host waits
    from t0+20 to the end."""
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
        ev("wait:block1.all_gather_done", "wait", t0 + 200, 10, pid=pid, step=step, phase="pre_backward",
           module="block1"),
        ev("block1.wq_bwd", "compute", t0 + 210, 190, pid=pid, step=step, phase="backward"),
        ev("block0.wq_bwd", "compute", t0 + 400, 200, pid=pid, step=step, phase="backward"),
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
        host = [i for i, w in enumerate(words) if w.startswith("host waits for the device")]
        assert host, words
        assert "rank 0: 630 µs" in words[host[0]]
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles  # matplotlib < 3.7: legendHandles
        colours = [tuple(h.get_facecolor()) for h in handles]
        copy = words.index("copy")
        assert colours[host[0]] not in colours[:host[0]] + colours[host[0] + 1:], "the host's waits share a colour"
        assert colours[copy] != colours[host[0]]
        assert "modelled time on profile teach (µs since the step began)" == ax.get_xlabel()
        assert "modelled time on profile teach" in fig._suptitle.get_text()
        assert [t for t in texts_of(strip)] == ["forward", "backward", "optimizer"]
        names_written = texts_of(ax)
        assert names_written.count("block0") >= 2 * 2  # forward and backward runs, on both ranks
        assert "host waits for compute (optimizer)" in names_written
        assert not any(t.startswith("block1") and "AG" in t or t == "block1.all_gather" for t in names_written), \
            "a 10 µs all-gather of a 700 µs step has no room for its name"
        assert [t.get_text() for t in ax.get_yticklabels()][:4] == [
            "rank 0 host", "rank 0 compute", "rank 0 all_gather", "rank 0 reduce_scatter"]
    finally:
        plt.close(fig)
    for meta, words in (({"clock": "gpu"}, "GPU time"), ({}, "wall time")):
        fig, ax, _, _ = plots.draw_timeline(plt, events, names, meta, 1)
        assert ax.get_xlabel().startswith(words), ax.get_xlabel()
        plt.close(fig)


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
