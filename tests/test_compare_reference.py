"""tools/compare_reference.py (make reference-check) on copies of a published reference run: what
the machine changes between two runs of the same program passes (the wall clock, the host, the heap's
addresses), anything the program determines is caught and named, the modelled timeline included."""
import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

import manifest
from helpers import ROOT
from trace_names import COLLECTIVE, WAIT, WALL_ARGS

TOOL = os.path.join(ROOT, "tools", "compare_reference.py")
STAGE = os.path.join(ROOT, "logs", "reference", "stage04")
RUBRIC_STAGES = list(manifest.load()["parity_spread"]["runs"])


def run_tool(old, new, *more):
    p = subprocess.run([sys.executable, TOOL, str(old), str(new)] + list(more), capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout + p.stderr


def stored_band(stage, run, metric):
    """The BLAS band grader/figures/parity_spread.json stores for one graded run's metric (tools/parity_spread.py
    --write)."""
    return manifest.load()["parity_spread"]["runs"][stage][run][metric]["band"]


def edit_json(path, change):
    """Rewrite the (possibly gzip'd) JSON file at path through change(obj)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        obj = json.load(f)
    change(obj)
    with opener(path, "wt") as f:
        json.dump(obj, f)


def edit_metrics(path, change):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        change(row)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def trees(tmp_path):
    if not os.path.isdir(STAGE):
        pytest.skip("no logs/reference/stage04 in this checkout")
    old, new = tmp_path / "old" / "stage04", tmp_path / "new" / "stage04"
    shutil.copytree(STAGE, old)
    shutil.copytree(STAGE, new)
    return old, new


def shift_wall_clock(new):
    """What a second run of the same program on a busy machine, another day, changes: the wall clock (metrics'
    step_ms and tokens_per_s, the trace's wall_* args), the host's name and the heap's addresses."""
    edit_metrics(str(new / "metrics.jsonl"), lambda r: r.update(step_ms=r["step_ms"] * 3, tokens_per_s=1.0))
    edit_json(str(new / "run.json"), lambda r: r.update(host="another-machine"))

    def trace(t):
        walls = 0
        for e in t["traceEvents"]:
            for k in WALL_ARGS:
                if k in e.get("args", {}):
                    e["args"][k] = e["args"][k] * 3 + 1000.0
                    walls += 1
        assert walls, "the reference trace has no wall-clock args (%s): make reference" % ", ".join(WALL_ARGS)
    edit_json(str(new / "trace.json.gz"), trace)

    def memory(m):
        for e in m["events"]:
            if "addr" in e:  # notes have none
                e["addr"] += 4096
        m["live_at_end"].reverse()
        m["reserved_bytes"] += 4096
    edit_json(str(new / "memory_rank0.json.gz"), memory)


def test_identical_trees_agree(trees):
    old, new = trees
    rc, out = run_tool(old.parent, new.parent)
    assert rc == 0 and " 0 differ" in out, out
    assert int(out.splitlines()[-1].split()[0]) >= 10, out  # metrics, run.json, 4 dtensors, 4 snapshots, the trace


def test_the_machines_share_is_left_out(trees):
    old, new = trees
    shift_wall_clock(new)
    rc, out = run_tool(old.parent, new.parent)
    assert rc == 0 and " 0 differ" in out, out


def bump_loss(new):
    """Past what another BLAS kernel explains: twice the band measured for stage 04's loss (which counts at least
    float32's resolution 2**-23)."""
    k = 1 + 2 * max(stored_band("04", "main", "loss"), 2.0 ** -23)
    edit_metrics(str(new / "metrics.jsonl"), lambda r: r.update(loss=r["loss"] * k))


def bump_a_clip_coefficient(new):
    k = 1 + 2 * max(stored_band("04", "main", "grad_norm"), 2.0 ** -23)
    edit_metrics(str(new / "metrics.jsonl"), lambda r: r["clip_coef_min_per_rank"].__setitem__(
        0, r["clip_coef_min_per_rank"][0] * k) if r["step"] == 3 else None)


def grow_an_allocation(new):
    def memory(m):
        next(e for e in m["events"] if e.get("action") == "alloc")["size"] += 64
    edit_json(str(new / "memory_rank2.json.gz"), memory)


def rename_a_collective(new):
    def trace(t):
        first = next(e for e in t["traceEvents"] if e.get("cat") == COLLECTIVE and "all_gather" in e["name"])
        first["name"] = first["name"].replace("all_gather", "all_reduce")
    edit_json(str(new / "trace.json.gz"), trace)


def reorder_a_track(new):
    def trace(t):
        ev = t["traceEvents"]
        xs = [i for i, e in enumerate(ev) if e.get("ph") == "X" and e["tid"] == 0 and e["pid"] == 1]
        a, b = next((a, b) for a, b in zip(xs, xs[1:]) if (ev[a]["name"], ev[a]["args"]) != (ev[b]["name"], ev[b]["args"]))
        ev[a], ev[b] = ev[b], ev[a]
    edit_json(str(new / "trace.json.gz"), trace)


def move_a_slice(new):
    """One nanosecond later on the modelled clock: the program's timeline changed."""
    def trace(t):
        next(e for e in t["traceEvents"] if e.get("cat") == COLLECTIVE)["ts"] += 0.001
    edit_json(str(new / "trace.json.gz"), trace)


def stretch_a_slice(new):
    def trace(t):
        next(e for e in t["traceEvents"] if e.get("cat") == "compute")["dur"] += 0.001
    edit_json(str(new / "trace.json.gz"), trace)


def drop_a_wait(new):
    """A stream that no longer stalls on an event: traced iff it stalled in modelled time, so a difference."""
    def trace(t):
        t["traceEvents"].remove(next(e for e in t["traceEvents"] if e.get("cat") == WAIT))
    edit_json(str(new / "trace.json.gz"), trace)


def another_device_profile(new):
    edit_json(str(new / "trace.json.gz"), lambda t: t["otherData"].update(device_profile="a100-80g"))


def slow_the_modelled_step(new):
    edit_metrics(str(new / "metrics.jsonl"), lambda r: r.update(model_step_ms=r["model_step_ms"] + 1e-3))


def allocate_later(new):
    """The host's modelled time of an allocation."""
    def memory(m):
        next(e for e in m["events"] if e.get("action") == "alloc")["time_us"] += 1.0
    edit_json(str(new / "memory_rank1.json.gz"), memory)


def change_a_shard(new):
    edit_json(str(new / "dtensors_rank1.json"), lambda d: d["params"][0].update(local_rows=d["params"][0]["local_rows"] + 1))


def drop_a_file(new):
    os.remove(str(new / "dtensors_rank3.json"))


@pytest.mark.parametrize("change,named", [
    (bump_loss, "metrics.jsonl"), (bump_a_clip_coefficient, "metrics.jsonl"),
    (grow_an_allocation, "memory_rank2.json.gz"),
    (rename_a_collective, "trace.json.gz"), (reorder_a_track, "trace.json.gz"),
    (change_a_shard, "dtensors_rank1.json"), (drop_a_file, "dtensors_rank3.json"),
    (move_a_slice, "trace.json.gz"), (stretch_a_slice, "trace.json.gz"), (drop_a_wait, "trace.json.gz"),
    (another_device_profile, "trace.json.gz"), (slow_the_modelled_step, "metrics.jsonl"),
    (allocate_later, "memory_rank1.json.gz")])
def test_what_the_program_determines_is_caught(trees, change, named):
    old, new = trees
    shift_wall_clock(new)  # a real rebuild differs there too: it must not hide the change
    change(new)
    rc, out = run_tool(old.parent, new.parent)
    assert rc == 1 and " 1 differ" in out, out
    assert "stage04/" + named in out, out


def test_bad_arguments_are_one_line(tmp_path):
    rc, out = run_tool(tmp_path / "nowhere", tmp_path)
    assert rc == 2 and "is not a folder" in out and "Traceback" not in out, out
    (tmp_path / "empty").mkdir()
    rc, out = run_tool(tmp_path / "empty", tmp_path)
    assert rc == 2 and "holds no reference files" in out, out


def test_every_graded_run_has_a_measured_band():
    """reference-check on another machine needs the band of each BLAS-dependent figure: measured across OpenBLAS
    kernels and thread counts by tools/parity_spread.py --write, not chosen."""
    data = manifest.load()
    runs = data["parity_spread"]["runs"]

    def bound(run):
        """a float32 run's figures move in their last bits (below 1e-4); a run that reduce-scatters in bfloat16
        rounds each grad to 8 mantissa bits before the sum, and another kernel's last-bit change flips some of
        those roundings: its grad norm's band is bounded by a quarter of one bfloat16 step, 2**-10, instead"""
        flags = data["variants"][run].get("add_flags", []) if run in data["variants"] else []
        return 2.0 ** -10 if "--reduce-dtype=bf16" in flags else 1e-4

    bands = [(run, f["band"], bound(run)) for by_run in runs.values() for run, by_metric in by_run.items()
             for f in by_metric.values()]
    assert bands and all(isinstance(b, float) and 0 <= b < limit for _, b, limit in bands), bands
    assert any(limit < 2.0 ** -10 for _, _, limit in bands)


def rubric_with_band(tmp_path, band, stages=("04",)):
    """The rubric with the bands of these stages set to band (None: no band at all)."""
    rubric = manifest.load()
    for stage in stages:
        for by_metric in rubric["parity_spread"]["runs"][stage].values():
            for fig in by_metric.values():
                fig.pop("band", None) if band is None else fig.update(band=band)
    path = tmp_path / "rubric.json"
    manifest.save(rubric, str(path))  # the bands go to figures/parity_spread.json beside it
    return str(path)


def test_another_kernels_rounding_is_within_the_band(trees, tmp_path):
    """What another machine's OpenBLAS kernel changes (the loss, the grad norm and the clip coefficients in their
    last bits) passes within the band and is named as such; one past the band is named with the band (never
    below float32's resolution 2**-23); a rubric with no bands compares bit for bit."""
    old, new = trees
    shift_wall_clock(new)
    edit_metrics(str(new / "metrics.jsonl"), lambda r: r.update(
        loss=r["loss"] * (1 + 3e-7), grad_norm=r["grad_norm"] * (1 - 2e-7),
        clip_coef_max_per_rank=[c * (1 + 2e-7) for c in r["clip_coef_max_per_rank"]]))
    rc, out = run_tool(old.parent, new.parent, "--rubric", rubric_with_band(tmp_path, 1e-6))
    assert rc == 0 and " 0 differ; 1 file equal only within the BLAS band" in out, out
    assert "within the BLAS band: stage04/metrics.jsonl: loss rel 3e-07 <= 1e-06, grad_norm rel 2e-07 <= 1e-06, " \
        "clip_coef_max_per_rank rel 2e-07 <= 1e-06 (stage 04 main)" in out, out
    rc, out = run_tool(old.parent, new.parent, "--rubric", rubric_with_band(tmp_path, 1e-7))
    assert rc == 1 and " 1 differ" in out and "step 1: loss" in out, out
    assert "(rel 3e-07): beyond the BLAS band 1.19e-07 (stage 04 main, at least float32's resolution" in out, out
    rc, out = run_tool(old.parent, new.parent, "--rubric", rubric_with_band(tmp_path, None, stages=RUBRIC_STAGES))
    assert rc == 1 and " 1 differ" in out and "beyond the BLAS band 0 (no band in the rubric)" in out, out


def test_an_unreadable_rubric_is_one_line(trees, tmp_path):
    old, new = trees
    rc, out = run_tool(old.parent, new.parent, "--rubric", str(tmp_path / "none.json"))
    assert rc == 2 and "cannot read the bands from" in out and "Traceback" not in out, out


def test_grad_state_probes_move_within_their_band(tmp_path):
    """The memory snapshots' grad_state notes (gradient sums of squares and dot products, stage 07's gradient
    accumulation) are BLAS-dependent: within the run's grad_state_band they pass and are named, past it they are
    a difference; their counts stay exact."""
    src = os.path.join(ROOT, "logs", "reference", "stage07")
    if not os.path.isdir(src):
        pytest.skip("no logs/reference/stage07 in this checkout")
    old, new = tmp_path / "old" / "stage07", tmp_path / "new" / "stage07"
    shutil.copytree(src, old)
    shutil.copytree(src, new)

    def nudge(key, k):
        def memory(m):
            e = next(e for e in m["events"] if e.get("kind") == "grad_state" and e[key])
            e[key] = e[key] * k if isinstance(e[key], float) else e[key] + 1
        return memory
    rubric = manifest.load()

    def with_band(band):
        rubric["parity_spread"]["runs"]["07"]["main"]["grad_norm"]["grad_state_band"] = band
        path = tmp_path / "rubric.json"
        manifest.save(rubric, str(path))
        return "--rubric", str(path)
    edit_json(str(new / "memory_rank1.json.gz"), nudge("unsharded_grad_sumsq", 1 + 3e-7))
    rc, out = run_tool(old.parent, new.parent, *with_band(1e-6))
    assert rc == 0 and "within the BLAS band: stage07/memory_rank1.json.gz: grad_state rel 3e-07 <= 1e-06 " \
        "(stage 07 main)" in out, out
    rc, out = run_tool(old.parent, new.parent, *with_band(1e-7))
    assert rc == 1 and " 1 differ" in out and "(grad_state) unsharded_grad_sumsq: " in out and \
        "beyond the BLAS band 1.19e-07 (stage 07 main, at least float32's resolution 2**-23)" in out, out
    shutil.rmtree(new)
    shutil.copytree(src, new)
    edit_json(str(new / "memory_rank2.json.gz"), nudge("unsharded_grads", None))
    rc, out = run_tool(old.parent, new.parent, *with_band(0.5))
    assert rc == 1 and "stage07/memory_rank2.json.gz: events: [" in out and "unsharded_grads" in out, out
