"""Smoke test of the benchmarks (tools/bench.py --quick): every section is there and holds
numbers. No wall-clock timing is asserted: the bench reports, it does not judge. Modelled figures
(the runtime's modelled clock) are exact, and are asserted only against an independent reading of
the run's own files (trace, metrics) or against a second bench run, never against numbers copied
from the bench's output."""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers import BASELINE, ROOT, STAGES, metrics, trace_events

BENCH = os.path.join(ROOT, "tools", "bench.py")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(ROOT, "solutions")) or not os.path.exists(BASELINE),
    reason="the bench runs the instructors' solutions/ and needs `make` first")


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def timing(s):
    return number(s["median"]) and number(s["min"]) and number(s["max"]) and s["min"] <= s["median"] <= s["max"]


def run_bench(out):
    """tools/bench.py --quick into out/results (scratch runs in out/work): (bench.json, bench.md, stdout)."""
    p = subprocess.run([sys.executable, BENCH, "--quick", "--out", str(out / "results"), "--work", str(out / "work")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out / "results" / "bench.json") as fh:
        data = json.load(fh)
    with open(out / "results" / "bench.md") as fh:
        md = fh.read()
    return data, md, p.stdout


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def bench(bench_dir):
    return run_bench(bench_dir)


def modelled(x, path=""):
    """{path: figure} of every modelled figure in a bench.json: the "model" dicts of the rows, the
    "modelled_*" figures (the trace's collective durations) and the profile's model_step_ms (its rows are
    ordered by wall time, so they are left out)."""
    out = {}
    if isinstance(x, dict):
        for k, v in x.items():
            if k == "model" or k.startswith("modelled") or k == "model_step_ms":
                out[path + "/" + k] = v
            else:
                out.update(modelled(v, path + "/" + k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out.update(modelled(v, "%s[%d]" % (path, i)))
    return out


def test_every_section_is_there(bench):
    data, md, stdout = bench
    for key in ("sgemm", "throughput", "scaling", "overlap", "memory", "hsdp", "profile", "grading", "targets"):
        assert key in data, key
    titles = ["## 1. Throughput", "## 2. Scaling", "## 3. Overlap", "## 4. Memory", "## 5. Grading"]
    if data["hsdp"].get("rows"):
        titles.append("## 4d. HSDP")
    if any(s.flat for s in STAGES):  # section 4j (its rows: test_flat_rows_are_their_runs)
        assert data["flat"]["small"]["rows"] and data["flat"]["one_node"] == {"skipped": "--quick"}
        titles.append("## 4j. Flat parameters and buckets")
    for title in titles:
        assert title in md and title in stdout, title


# The ideal bubble of P equal stages with free transfers, worked by hand for the P the bench runs (4): each stage
# computes in M of the M + P - 1 slots of a pass and idles in the other P - 1, so it idles (P-1)/(M+P-1) of the step:
# M = 1: 3/4, M = 2: 3/5, M = 4: 3/7, M = 8: 3/11, M = 16: 3/19.
IDEAL_BUBBLE = {(4, 1): 0.75, (4, 2): 0.6, (4, 4): 0.428571, (4, 8): 0.272727, (4, 16): 0.157895}


def check_pipeline(pp):
    """Section 4g-4h (tools/benchlib/pipeline.py), from its definitions: the ideal bubble is the hand-worked
    (P-1)/(M+P-1) above (the P and M the runs ran with: test_pipeline_rows_are_their_runs); the measured bubble
    never below it; GPipe and 1F1B hold the same at M <= P, and 1F1B less on stage 0 past it; the two cases on two
    links train the same numbers."""
    rows = pp["bubble"]["rows"]
    P = pp["bubble"]["stages"]
    assert {r["schedule"] for r in rows} == {"gpipe", "1f1b"} and len(rows) >= 6
    for r in rows:
        assert (P, r["microbatches"]) in IDEAL_BUBBLE, (
            "no hand-worked ideal bubble for P=%d, M=%d here: add it to IDEAL_BUBBLE" % (P, r["microbatches"]))
        assert r["ideal_bubble"] == pytest.approx(IDEAL_BUBBLE[P, r["microbatches"]], abs=1e-6), r
        assert r["ideal_bubble"] - 0.01 <= r["bubble"] < 1 and number(r["model_step_ms"])
    by = {(r["schedule"], r["microbatches"]): r for r in rows}
    top = max(r["microbatches"] for r in rows)
    assert top > P
    assert by["1f1b", top]["stage0_activation_peak_bytes"] < by["gpipe", top]["stage0_activation_peak_bytes"]
    for m in {r["microbatches"] for r in rows if r["microbatches"] <= P}:
        g, f = by["gpipe", m]["stage0_activation_peak_bytes"], by["1f1b", m]["stage0_activation_peak_bytes"]
        assert abs(g - f) <= 0.05 * g, (m, g, f)
    two = pp["two_links"]["rows"]
    assert all(number(r["model_step_ms"]) for r in two)
    # two layouts of one batch sum in different orders: equal within the grader's measured tolerances, not bitwise
    t = pp["two_links"]
    losses = [r["loss_last"] for r in two]
    assert 0 < t["loss_rtol"] < 1e-4 and t["losses_agree"], t
    assert max(losses) - min(losses) <= t["loss_rtol"] * max(losses)
    # the same layout on the other link changes only when transfers finish: the same sums, bit for bit
    for case in {r["case"] for r in two}:
        assert len({r["loss_last"] for r in two if r["case"] == case}) == 1, case


def test_sections_hold_numbers(bench):
    data = bench[0]
    assert number(data["sgemm"]["gflops_best"]) and data["sgemm"]["gflops_best"] > 0
    tp = data["throughput"]
    assert number(tp["flops_per_token"]) and tp["flops_per_token"] > 0
    assert {"baseline", "solution 04 (world 1)"} <= set(tp["runs"])
    for r in tp["runs"].values():
        assert timing(r["tokens_per_s"]) and number(r["achieved_gflops"]) and number(r["of_sgemm"])
    if "pytorch_skipped" not in tp:
        assert number(tp["runs"]["baseline"]["vs_pytorch"])
        assert tp["loss_step1_rel_diff"] < 1e-4  # same init and data on both sides
    assert sorted(r["world"] for r in data["scaling"]["rows"]) == [1, 2, 4]
    assert all(timing(r["tokens_per_s"]) for r in data["scaling"]["rows"])
    ov = data["overlap"]
    assert ov["device_profile"] == data["device_profile"] == "teach"  # the runtime's default
    # every stage that trains, but activation checkpointing (04's schedule plus a recompute)
    assert [r["stage"][:2] for r in ov["rows"]] == [s.id for s in STAGES
                                                    if not (s.forward_only or s.ac or s.pipeline)]
    for r in ov["rows"]:
        assert timing(r["step_ms"]) and timing(r["tokens_per_s"])  # the wall clock: a spread
        m = r["model"]  # the modelled clock: one figure each
        assert all(number(m[k]) for k in ("model_step_ms", "exposed_comm_ms", "exposed_comm_fraction",
                                          "kernel_flops_over_peak", "compute_ms", "collective_ms"))
        assert 0 < m["exposed_comm_ms"] <= m["model_step_ms"] and 0 < m["kernel_flops_over_peak"] <= 1
        assert m["exposed_comm_ms"] == pytest.approx(sum(m["exposed_comm_ms_by_phase"].values()), rel=1e-12)
        assert m["math"] == ("bf16" if "--param-dtype=bf16" in r["flags"] else "f32")
    rows = {r["stage"][:2]: r["model"] for r in ov["rows"]}
    # on teach (compute and link time of the same order) overlap shortens the step; a profile whose steps are
    # bound by the host's launches can show the opposite (prefetching enqueues more ops)
    assert rows["04"]["model_step_ms"] < rows["02"]["model_step_ms"]
    mem = data["memory"]["rows"]
    accum = [s.id for s in STAGES if any(f.startswith("--grad-accum") for f in s.flags)]
    mixed = [s.id for s in STAGES if any(f.startswith("--param-dtype") for f in s.flags)]
    # the model has no microbatches and float32 params only
    # the model has no microbatches, float32 params only and a whole model per rank
    assert [r["stage"][:2] for r in mem] == [s.id for s in STAGES if s.id not in accum + mixed and not s.pipeline]
    for r in mem:
        assert r["measured_peak_bytes"] > 0 and r["model_peak_bytes"] > 0 and number(r["ratio_measured_over_model"])
        assert r["replay_peak_bytes"] == r["measured_peak_bytes_rank0"]  # the replay finds the metrics' peak
    if accum:  # gradient accumulation: K = 1, then 2 and 4 in three modes each
        rows = {r["case"]: r for r in data["accum"]["rows"]}
        assert len(rows) == 7 and all(r["peak_bytes_rank0"] > 0 and timing(r["step_ms"]) and
                                      number(r["model"]["model_step_ms"]) for r in rows.values())
        n = lambda case, kind: rows[case]["collectives"][kind]["count"]  # noqa: E731
        # one reduce-scatter per module without sync, K per module with it; kept params all-gather once
        assert n("K=4 sync every", "reduce_scatter") == 4 * n("K=1", "reduce_scatter") == 4 * n("K=4 sync last",
                                                                                                "reduce_scatter")
        assert n("K=2 sync last, params kept", "all_gather") == n("K=1", "all_gather") // 2
        assert rows["K=2 sync last"]["between_unsharded_grad_bytes"] > 0 == rows["K=2 sync every"][
            "between_unsharded_grad_bytes"]
    if mixed:  # float32, bf16 params, bf16 params and reduce: bytes exactly halved where the policy says
        rows = {r["case"]: r for r in data["mixed_precision"]["rows"]}
        f32, bf, both = rows["fp32"], rows["bf16 params, fp32 reduce"], rows["bf16 params, bf16 reduce"]
        assert 2 * bf["all_gather_bytes"] == f32["all_gather_bytes"] == 2 * both["all_gather_bytes"] > 0
        assert bf["reduce_scatter_bytes"] == f32["reduce_scatter_bytes"] == 2 * both["reduce_scatter_bytes"] > 0
        assert 2 * bf["unsharded_param_high_bytes"] == f32["unsharded_param_high_bytes"] > 0
        assert f32["loss_rel_vs_fp32"] == 0 and 0 < bf["loss_rel_vs_fp32"] < 1e-2
        assert all(timing(r["step_ms"]) for r in rows.values())
        assert f32["model"]["math"] == "f32" and bf["model"]["math"] == both["model"]["math"] == "bf16"
    if any(any(f.startswith("--mesh") for f in s.flags) for s in STAGES):
        check_hsdp(data["hsdp"])
    if any(s.backward_prefetch != "pre" or s.offload for s in STAGES):  # stage 10: policies and offload
        pf = {r["case"]: r for r in data["prefetch"]["rows"]}
        assert len(pf) == 5 and data["prefetch"]["losses_agree"]
        assert all(r["peak_bytes_rank0"] > 0 and number(r["model"]["model_step_ms"]) for r in pf.values())
        # one comm stream: post queues each all-gather behind the previous module's reduce-scatter
        assert pf["post, one comm stream"]["model"]["model_step_ms"] >= pf["pre, one comm stream"]["model"][
            "model_step_ms"]
        # pre holds the next module's all-gather buffer in the backward, post and none do not: never less
        # (how much more depends on what else peaks there: the full bench's table)
        assert pf["pre"]["backward_high_bytes"] >= pf["post"]["backward_high_bytes"] >= pf["none"]["backward_high_bytes"]
        off = {r["case"]: r for r in data["offload"]["rows"]}
        assert len(off) == 3 and data["offload"]["losses_agree"]
        base, fast = off["no offload"], off["offload, PCIe 16 GB/s"]
        assert base["host_peak_bytes_rank0"] == 0 < fast["host_peak_bytes_rank0"]
        assert fast["device_shard_state_bytes"] == 0 < base["device_shard_state_bytes"]
        assert fast["peak_bytes_rank0"] < base["peak_bytes_rank0"]
        assert fast["h2d"][0] > 0 and fast["d2h"][0] > 0 and base["h2d"] == [0, 0]
        # the same copies over a slower PCIe model: a longer modelled step
        slow = off["offload, PCIe 0.05 GB/s"]
        assert base["model"]["model_step_ms"] <= fast["model"]["model_step_ms"] < slow["model"]["model_step_ms"]
    if any(s.pipeline for s in STAGES):  # pipeline: the bubble against M, PP x FSDP on two links
        check_pipeline(data["pipeline"])
    g = data["grading"]
    assert "skipped" in g or timing(g["wall_s"])
    assert data["profile"]["rows"] and all(number(r["ms"]) and number(r["model_ms"]) for r in data["profile"]["rows"])


def test_pipeline_rows_are_their_runs(bench, bench_dir):
    """Section 4g-4h against the runs' own files (work/pipeline/): each bubble row's P, M and schedule are those
    its run.json records (the flags the binary ran with), so the hand-worked ideal checked in check_pipeline is that
    of the run; each two-link row's last loss is its run's (metrics.jsonl), and both layouts trained the same global
    batch (run.json: --batch-size x world / pp)."""
    if not any(s.pipeline for s in STAGES):
        pytest.skip("no pipeline stage in this release")
    pp = bench[0]["pipeline"]
    work = bench_dir / "work" / "pipeline"
    b = pp["bubble"]
    for r in b["rows"]:
        with open(work / ("%s_m%d" % (r["schedule"], r["microbatches"])) / "run.json") as fh:
            rj = json.load(fh)
        assert (rj["pp"], rj["microbatches"], rj["pp_schedule"], rj["world_size"]) == (
            b["stages"], r["microbatches"], r["schedule"], b["world"]), (r, rj)
        assert r["ideal_bubble"] == pytest.approx(IDEAL_BUBBLE[rj["pp"], rj["microbatches"]], abs=1e-6), r
    t = pp["two_links"]
    runs = sorted(work.glob("twolink_*"))
    assert len(runs) == len(t["rows"]) == 4, runs
    for d in runs:
        with open(d / "run.json") as fh:
            rj = json.load(fh)
        pipelined = rj.get("pp", 1) > 1
        row = [r for r in t["rows"]
               if r["inter_link_gbps"] == rj["inter_link_gbps"] and ("--pp" in r["flags"]) == pipelined]
        assert len(row) == 1, (d.name, rj["inter_link_gbps"], pipelined)
        assert row[0]["loss_last"] == metrics(d)[-1]["loss"], (d.name, row[0])
        assert rj["batch_size"] * rj["world_size"] // rj.get("pp", 1) == t["global_batch"], (d.name, rj)


def check_hsdp(hs):
    """FSDP over the world, HSDP with a node per row, DDP: the groups, bytes and shards each mesh implies."""
    assert (hs["world"], hs["ranks_per_node"]) == (4, 2)
    rows = {tuple(r["mesh"]): r for r in hs["rows"]}
    assert sorted(rows) == [(1, 4), (2, 2), (4, 1)]
    fsdp, hsdp, ddp = rows[(1, 4)], rows[(2, 2)], rows[(4, 1)]
    # same model, same batches: the losses agree (the report flags it when they do not)
    assert hs["losses_agree"] and hs["loss_max_rel_diff"] <= hs["loss_rtol"] <= 1e-5
    assert fsdp["loss_last"] == pytest.approx(hsdp["loss_last"], rel=hs["loss_rtol"])
    assert fsdp["loss_last"] == pytest.approx(ddp["loss_last"], rel=hs["loss_rtol"])

    def colls(r):
        return {(c["kind"], c["group"].rstrip("0123456789")): c for c in r["collectives"]}

    f, h, d = colls(fsdp), colls(hsdp), colls(ddp)
    # FSDP: every collective over the world, across both nodes
    assert {g for _, g in f} == {"world"} and all(c["spans_nodes"] and c["ranks"] == 4 for c in f.values())
    assert fsdp["intra_node_bytes"] == 0 < fsdp["inter_node_bytes"]
    # HSDP: all-gathers and reduce-scatters inside a node, only the grad shards' all-reduce across
    assert not h["all_gather", "shard"]["spans_nodes"] and not h["reduce_scatter", "shard"]["spans_nodes"]
    rep = h["all_reduce", "replicate"]
    assert rep["spans_nodes"] and rep["ranks"] == 2 and rep["count"] == h["reduce_scatter", "shard"]["count"]
    assert hsdp["inter_node_bytes"] == rep["bytes"] and 2 * rep["bytes"] == h["reduce_scatter", "shard"]["bytes"]
    assert h["all_gather", "shard"]["count"] == f["all_gather", "world"]["count"] == 2 * rep["count"]
    # DDP: one-rank shard groups move nothing; whole grads all-reduced across nodes
    assert d["all_reduce", "replicate"]["ranks"] == 4 and ddp["intra_node_bytes"] == 0
    assert ddp["inter_node_bytes"] == d["all_reduce", "replicate"]["bytes"] and d["all_gather", "shard"]["ranks"] == 1
    # the slow link: HSDP moves least across it, in the link model too; shards grow with the replicas
    assert hsdp["inter_node_bytes"] < ddp["inter_node_bytes"] < fsdp["inter_node_bytes"]
    assert hsdp["modelled_inter_node_ms"] < ddp["modelled_inter_node_ms"] < fsdp["modelled_inter_node_ms"]
    assert 0 < fsdp["param_shard_bytes"] < hsdp["param_shard_bytes"] < ddp["param_shard_bytes"]
    assert fsdp["peak_bytes_rank0"] < hsdp["peak_bytes_rank0"] < ddp["peak_bytes_rank0"]
    for r in rows.values():
        assert number(r["model"]["model_step_ms"]) and number(r["model"]["exposed_comm_ms"])
        assert r["modelled_comm_ms"] == pytest.approx(sum(c["modelled_ms"] for c in r["collectives"]), rel=1e-12)
        assert r["modelled_comm_ms"] == pytest.approx(r["model"]["collective_ms"], rel=1e-12)


def overlap_run(bench_dir, data, stage_id):
    """The overlap section's row and run directory of a stage (the first world's)."""
    ov = data["overlap"]
    row = next(r for r in ov["rows"] if r["stage"][:2] == stage_id)
    return row, bench_dir / "work" / ("overlap_world%d" % ov["world"]) / row["stage"]


def test_kernel_flops_over_peak_from_the_trace(bench, bench_dir):
    """Every overlap row's kernel FLOPs / (step x peak), recomputed from its run's own files: the FLOPs rank 0's kernels
    declared in the last step (trace_rank0.json args.flops), that step's model_step_ms (metrics.jsonl) and the
    profile's peak for the matmuls' math (otherData.peak_flops: bf16 under --param-dtype bf16, f32 otherwise)."""
    data = bench[0]
    for r in data["overlap"]["rows"]:
        _, d = overlap_run(bench_dir, data, r["stage"][:2])
        last = metrics(d)[-1]
        with open(d / "trace_rank0.json") as fh:
            doc = json.load(fh)
        assert doc["otherData"]["clock"] == "model"
        flops = sum(e["args"].get("flops", 0) for e in doc["traceEvents"]
                    if e.get("ph") == "X" and e.get("cat") == "compute" and e["args"].get("step") == last["step"] - 1)
        peak = doc["otherData"]["peak_flops"]["bf16" if "--param-dtype=bf16" in r["flags"] else "f32"]
        assert flops > 0
        assert r["model"]["model_step_ms"] == last["model_step_ms"]
        assert r["model"]["kernel_flops_over_peak"] == pytest.approx(flops / (last["model_step_ms"] / 1e3 * peak), rel=1e-9)


def test_blocking_stage_exposes_all_its_communication(bench, bench_dir):
    """The stage without comm streams runs every collective on its compute stream: its exposed communication is
    the whole time of its collectives (trace durations: the link model's), and it waits for nothing else."""
    data = bench[0]
    blocking = next(s for s in STAGES if not s.forward_only and not s.streams)
    row, d = overlap_run(bench_dir, data, blocking.id)
    step = metrics(d)[-1]["step"] - 1
    ev = [e for e in trace_events(d) if e["pid"] == 0 and e["args"].get("step") == step]
    colls = [e for e in ev if e.get("cat") == "collective"]
    assert colls and all(e["tid"] == 0 for e in colls) and not any(e.get("cat") == "wait" for e in ev)
    assert row["model"]["exposed_comm_ms"] == pytest.approx(sum(e["dur"] for e in colls) / 1e3, rel=1e-9)
    assert row["model"]["exposed_comm_ms"] == pytest.approx(row["model"]["collective_ms"], rel=1e-12)


def test_modelled_figures_repeat(bench, tmp_path):
    """A second bench run of the same configuration gives every modelled figure again, to the last bit
    (the wall-clock ones move)."""
    first = modelled(bench[0])
    again = modelled(run_bench(tmp_path)[0])
    assert len(first) > 40 and set(first) == set(again)
    differ = [k for k in first if first[k] != again[k]]
    assert not differ, differ[:5]


# ---- section 4j: flat parameters and buckets (tools/benchlib/flat.py) --------------------------------------------

def test_flat_step_counts_on_fabricated_slices():
    """flat.step_counts on hand-made slices: a launch is a kernel, copy, memset or collective of the rank and step
    asked for, on any of its streams; event records, waits and host syncs are not; collectives count by kind with
    their bytes."""
    from benchlib import flat

    def sl(cat, pid=0, step=1, tid=0, name="block0.fwd", nbytes=None):
        args = {"step": step}
        if nbytes is not None:
            args["bytes"] = nbytes
        return {"ph": "X", "cat": cat, "pid": pid, "tid": tid, "name": name, "args": args, "ts": 0, "dur": 1}

    ev = [sl("compute"), sl("compute", tid=0), sl("copy", name="block0.copy_in"), sl("memset"),
          sl("collective", tid=1, name="block0.all_gather", nbytes=100),
          sl("collective", tid=1, name="block1.all_gather", nbytes=50),
          sl("collective", tid=2, name="block0.reduce_scatter", nbytes=40),
          sl("collective", name="grad_norm.all_reduce", nbytes=4),
          sl("event", tid=1), sl("wait", tid=0), sl("host_sync", tid=1000),  # not launches
          sl("compute", pid=1), sl("collective", pid=1, name="block0.all_gather", nbytes=100),  # another rank
          sl("compute", step=0), sl("collective", step=0, name="block0.all_gather", nbytes=100)]  # another step
    got = flat.step_counts(ev, step=1, rank=0)
    assert got["launches"] == 8
    assert got["by_category"] == {"compute": 2, "copy": 1, "memset": 1, "collective": 4}
    assert got["collectives"] == {"all_gather": {"count": 2, "bytes": 150}, "reduce_scatter": {"count": 1, "bytes": 40},
                                  "all_reduce": {"count": 1, "bytes": 4}}
    assert flat.step_counts(ev, step=1, rank=1)["launches"] == 2 and flat.step_counts(ev, step=0)["launches"] == 2


def test_flat_rows_are_their_runs(tmp_path):
    """Section 4j in its quick configuration (tiny, world 2: five runs of a second or so), each row against its run's
    own files read here independently: rank 0's last step in trace_rank0.json (launches: every slice but event,
    wait and host_sync; collectives by name), metrics.jsonl (peak, modelled step), run.json (the flat units); then
    what the layouts imply: the per-parameter run has no units, the flat runs launch fewer ops (no copy-in, copy-out,
    chunk-cat) with the per-parameter run's collectives when a unit is a module, and a unit of n modules takes one
    reduce-scatter per step (--grad-sync last) and a module's all-gathers, n times fewer; the table has a row each."""
    from benchlib import flat
    from benchlib.measure import Bench

    if not any(s.flat for s in STAGES):
        pytest.skip("no flat stage in this release")
    res = flat.section_flat(Bench(str(tmp_path / "work")), {"quick": True})
    rows = res["small"]["rows"]
    assert res["llama3_8b"] == {"skipped": "--quick"} and len(rows) == 5
    runs = sorted((tmp_path / "work" / "flat").iterdir())
    assert len(runs) == 5
    by_flags = {}
    for d in runs:
        with open(d / "run.json") as fh:
            rj = json.load(fh)
        by_flags[(rj.get("flat_units") is not None, rj.get("bucket_mb"))] = (d, rj)
    for r in rows:
        key = (r["units"] is not None, float(r["flags"].split("--bucket-mb ")[1]) if "--bucket-mb" in r["flags"] else None)
        d, rj = by_flags[key]
        met = metrics(d)
        assert r["units"] == rj.get("flat_units") and r["n_params"] == rj["n_params"]
        assert r["peak_bytes"] == max(max(m["peak_mem_bytes_per_rank"]) for m in met)
        assert r["model"]["model_step_ms"] == met[-1]["model_step_ms"]
        with open(d / "trace_rank0.json") as fh:
            ev = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0
                  and e["args"].get("step") == met[-1]["step"] - 1]
        assert r["launches"] == sum(e["cat"] not in ("event", "wait", "host_sync") for e in ev) > 0
        for kind in ("all_gather", "reduce_scatter"):
            assert r["collectives"][kind]["count"] == sum(e["cat"] == "collective" and e["name"].endswith("." + kind)
                                                          for e in ev), (r["case"], kind)
    per_param, per_module = rows[0], rows[1]
    assert per_param["units"] is None and all(r["units"] for r in rows[1:])
    n_modules = len(per_module["units"])
    assert all(len(u) == 1 for u in per_module["units"]) and n_modules > 1
    # the same collectives (their bytes differ by the flat buffers' padding to W equal chunks)
    assert {k: c["count"] for k, c in per_module["collectives"].items()} == {
        k: c["count"] for k, c in per_param["collectives"].items()}
    ag_per_module = per_module["collectives"]["all_gather"]["count"] // n_modules
    for r in rows[1:]:
        assert r["launches"] < per_param["launches"], r["case"]
        assert sum(len(u) for u in r["units"]) == n_modules
        assert r["collectives"]["reduce_scatter"]["count"] == len(r["units"]), r["case"]
        assert r["collectives"]["all_gather"]["count"] == ag_per_module * len(r["units"]), r["case"]
    assert len(rows[2]["units"]) == 1 and 1 < len(rows[4]["units"]) < n_modules  # the whole model; about two modules
    L = []
    flat.render(L, {"flat": res})
    md = "\n".join(L)
    assert "## 4j. Flat parameters and buckets" in md and "4k." not in md
    table_rows = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith(("| case", "| ---"))]
    assert [l.split(" | ")[0][2:] for l in table_rows] == [r["case"] for r in rows]
