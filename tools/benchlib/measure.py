"""The bench's measurements: each section runs training binaries (and PyTorch, the grader,
an SGEMM probe) and returns its figures as a dict for results/bench.json.

A Bench holds what one run shares: the scratch directory and the binaries that failed.
The stages come from grader/manifest.py; the few the bench singles out are named below.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict

import manifest  # grader/manifest.py: the stages, from grader/rubric.json
from gradelib.rubric import load_rubric, parity_tolerances
from gradelib.runner import openblas_core
from gradelib.trace_model import runtime_groups
from repo_paths import ROOT
from trace_names import ALL_GATHER, ALL_REDUCE, COLLECTIVE, COMPUTE, COMPUTE_TID, REDUCE_SCATTER, label_and_kind
from trace_names import PHASE_FINISH_BACKWARD  # the phases (runtime/phase.h)
# the memory tags (MemTag)
from trace_names import (TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD, TAG_TEMP,
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)

from .figures import MIB, fmt_mib, fmt_s, stats, tps_stats
from .memory_model import flops_per_token, memory_model, mesh_shape, model_dims, n_params, replay_peak
from .traces import last_step_on_model_clock, trace_events, trace_meta

BUILD = os.path.join(ROOT, "build")
BASELINE = os.path.join(BUILD, "baseline", "train")
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
TORCH_LLAMA = os.path.join(ROOT, "tools", "torch_llama.py")

# The stages the bench singles out, by number on purpose:
FULL_FSDP = "04"  # prefetch both ways: throughput, scaling, and the overlap target
PYTORCH = "pytorch 1.13 eager"


def log(msg):
    """A progress line on stdout, flushed: a full bench takes minutes."""
    print(msg, flush=True)


class BinaryFailed(Exception):
    """A program the bench ran exited non-zero; the message has its command and output's tail."""


class Bench:
    """One bench run: where scratch runs go, and one line per binary that failed."""

    def __init__(self, work=None, device_profile=None):
        self.work = os.path.abspath(work) if work else os.path.join(BUILD, "bench")
        self.failures = []  # the bench exits 1 when a binary failed
        # every training run is priced on this profile (None: the runtime's default, teach)
        self.profile_flags = ["--device-profile", device_profile] if device_profile else []

    @staticmethod
    def solution(st):
        """build/solutions/<dir>/train of a manifest Stage."""
        return os.path.join(BUILD, "solutions", st.dir, "train")

    def run(self, cmd, what, timeout=600, env=None):
        """Run cmd from ROOT; return (CompletedProcess, wall seconds). BinaryFailed if it fails."""
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        if p.returncode != 0:
            msg = "%s failed (exit %d): %s\n%s" % (what, p.returncode, " ".join(cmd), (p.stdout + p.stderr)[-1500:])
            self.failures.append(msg.splitlines()[0])
            raise BinaryFailed(msg)
        return p, time.perf_counter() - t0

    def train(self, binary, out, *flags, what=None):
        """Run a training binary into run directory `out`; return its metrics (list of dicts)."""
        shutil.rmtree(out, ignore_errors=True)
        cmd = [binary, "--out", out, "--quiet", "--data", CORPUS, "--no-poison"] + [
            str(f) for f in self.profile_flags + list(flags)]
        self.run(cmd, what or os.path.relpath(binary, ROOT))
        with open(os.path.join(out, "metrics.jsonl")) as fh:
            return [json.loads(l) for l in fh if l.strip()]


def configs(quick):
    """What each section runs: --quick is the smoke test's mode (tiny flavour, few steps)."""
    if quick:
        return dict(quick=True, sgemm_n=512,
                    tp_flavor="tiny", tp_batch=4, tp_seq=64, tp_steps=4, tp_first=3, tp_rounds=1, prof_steps=3,
                    sc_flavors=["tiny"], sc_seq=64, sc_gbatch=4, sc_steps=3, sc_first=2,
                    ov_flavor="tiny", ov_worlds=[4], ov_gbatch=8, ov_seq=32, ov_steps=3,
                    mem_flavor="tiny", mem_world=4, mem_batch=2, mem_seq=32, grade_repeats=1,
                    acc_flavor="tiny", acc_world=2, acc_batch=4, acc_seq=32, acc_steps=2,
                    mp_flavor="tiny", mp_world=2, mp_batch=2, mp_seq=32, mp_steps=2,
                    hs_flavor="tiny", hs_world=4, hs_ranks_per_node=2, hs_batch=2, hs_seq=32, hs_steps=2)
    return dict(quick=False, sgemm_n=2048,
                tp_flavor="debugmodel", tp_batch=8, tp_seq=256, tp_steps=8, tp_first=3, tp_rounds=2, prof_steps=3,
                sc_flavors=["tiny", "debugmodel"], sc_seq=128, sc_gbatch=8, sc_steps=6, sc_first=3,
                ov_flavor="debugmodel", ov_worlds=[4, 2], ov_gbatch=8, ov_seq=128, ov_steps=8,
                mem_flavor="debugmodel", mem_world=4, mem_batch=2, mem_seq=128, grade_repeats=1,
                acc_flavor="debugmodel", acc_world=2, acc_batch=4, acc_seq=128, acc_steps=4,
                mp_flavor="debugmodel", mp_world=2, mp_batch=4, mp_seq=128, mp_steps=6,
                hs_flavor="debugmodel", hs_world=4, hs_ranks_per_node=2, hs_batch=1, hs_seq=128, hs_steps=6)


def section_sgemm(bench, cfg):
    """The machine's OpenBLAS fp32 rate (tools/bench_sgemm.c, 2 threads, best of 5): the ceiling."""
    os.makedirs(bench.work, exist_ok=True)
    exe = os.path.join(bench.work, "bench_sgemm")
    src = os.path.join(ROOT, "tools", "bench_sgemm.c")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        bench.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-o", exe, src, "-lopenblas"], "gcc bench_sgemm.c")
    p, _ = bench.run([exe, str(cfg["sgemm_n"]), "2", "5"], "bench_sgemm")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    log("sgemm n=%d, 2 threads: %.1f GFLOP/s (best of %d)" % (r["n"], r["gflops_best"], r["repeats"]))
    return r


def torch_available():
    p = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    return p.returncode == 0


def section_throughput(bench, cfg, sgemm):
    """One rank: the baseline and the full FSDP solution vs tools/torch_llama.py (same init,
    data and optimizer); tokens/s and model FLOP/s."""
    fl, B, T, steps, first = cfg["tp_flavor"], cfg["tp_batch"], cfg["tp_seq"], cfg["tp_steps"], cfg["tp_first"]
    common = ["--flavor", fl, "--world", 1, "--batch-size", B, "--seq-len", T, "--steps", steps,
              "--blas-threads", 2, "--profile-steps", 0]
    wd = os.path.join(bench.work, "throughput")
    os.makedirs(wd, exist_ok=True)
    init = os.path.join(wd, "init.safetensors")
    bench.run([BASELINE, "--flavor", fl, "--save-init", init, "--out", os.path.join(wd, "init"), "--quiet"],
              "save-init")
    tokens = B * T
    sol = "solution %s (world 1)" % FULL_FSDP
    programs = [("baseline", BASELINE, "baseline"),
                (sol, bench.solution(manifest.stage(FULL_FSDP)), "sol" + FULL_FSDP)]
    res = {"flavor": fl, "batch": B, "seq_len": T, "steps": steps, "median_over_steps": "%d..%d" % (first, steps),
           "threads": 2, "dtype": "fp32", "runs": {},
           # the kernel family OpenBLAS runs here: the ratio to PyTorch (MKL-DNN) depends on it (tools/bench_notes.md)
           "openblas_core": openblas_core(BASELINE) or "unknown"}
    log("throughput: %s, batch %d x seq %d, world 1, 2 threads, steps %d..%d, OpenBLAS core %s" % (
        fl, B, T, first, steps, res["openblas_core"]))
    have_torch = torch_available()
    if not have_torch:
        res["pytorch_skipped"] = "torch is not importable by %s" % sys.executable
    pooled = defaultdict(lambda: {"tps": [], "ms": [], "loss1": None})

    def pool(name, met):
        pooled[name]["tps"] += [tokens / (m["step_ms"] / 1e3) for m in met if m["step"] >= first]
        pooled[name]["ms"] += [m["step_ms"] for m in met if m["step"] >= first]
        pooled[name]["loss1"] = met[0]["loss"]

    # Rounds interleave the three programs so that load from elsewhere hits them alike;
    # steps first..N of every round are pooled.
    for rnd in range(cfg["tp_rounds"]):
        for name, binary, tag in programs:
            d = os.path.join(wd, "%s_r%d" % (tag, rnd))
            met = bench.train(binary, d, *common, "--load", init)
            with open(os.path.join(d, "run.json")) as fh:
                rj = json.load(fh)
            dims = model_dims(rj)
            pool(name, met)
        if have_torch:
            out = os.path.join(wd, "torch_r%d.jsonl" % rnd)
            cmd = [sys.executable, TORCH_LLAMA, "--init", init, "--data", CORPUS, "--dim", dims["D"],
                   "--n-layers", dims["L"], "--n-heads", dims["H"], "--n-kv-heads", dims["KV"],
                   "--vocab-size", dims["V"], "--multiple-of", rj["multiple_of"], "--seq-len", T,
                   "--batch-size", B, "--steps", steps, "--threads", 2, "--out", out]
            if rj.get("ffn_dim_multiplier"):
                cmd += ["--ffn-dim-multiplier", rj["ffn_dim_multiplier"]]
            bench.run([str(c) for c in cmd], "tools/torch_llama.py")
            with open(out) as fh:
                pool(PYTORCH, [json.loads(l) for l in fh if l.strip()])
    res["rounds"] = cfg["tp_rounds"]
    for name, p in pooled.items():
        res["runs"][name] = {"tokens_per_s": stats(p["tps"]), "step_ms": stats(p["ms"]), "loss_step1": p["loss1"]}
        log("  %-24s %s tokens/s" % (name, fmt_s(res["runs"][name]["tokens_per_s"])))
    if have_torch:
        t = res["runs"][PYTORCH]["tokens_per_s"]
        for name, _, _ in programs:
            r = res["runs"][name]
            r["vs_pytorch"] = r["tokens_per_s"]["median"] / t["median"]
            r["vs_pytorch_best"] = r["tokens_per_s"]["max"] / t["max"]  # fastest step vs fastest step
        res["loss_step1_rel_diff"] = abs(res["runs"]["baseline"]["loss_step1"] - pooled[PYTORCH]["loss1"]) \
            / abs(pooled[PYTORCH]["loss1"])
    else:
        log("  pytorch: skipped (%s)" % res["pytorch_skipped"])
    fpt = flops_per_token(dims, T)
    res["flops_per_token"] = fpt
    res["flops_formula"] = ("6 * non-embedding params + 12 * L * T * (H * hd)  "
                            "(forward+backward = 3x forward; full T x T attention)")
    res["non_embedding_params"] = n_params(dims) - dims["V"] * dims["D"]
    for name, r in res["runs"].items():
        r["achieved_gflops"] = r["tokens_per_s"]["median"] * fpt / 1e9
        r["of_sgemm"] = r["achieved_gflops"] / sgemm["gflops_best"]
    return res


def section_scaling(bench, cfg):
    """The full FSDP solution at world 1, 2, 4 with the same global batch."""
    st = manifest.stage(FULL_FSDP)
    res = {"solution": st.dir, "seq_len": cfg["sc_seq"], "global_batch": cfg["sc_gbatch"],
           "steps": cfg["sc_steps"], "median_over_steps": "%d..%d" % (cfg["sc_first"], cfg["sc_steps"]), "rows": []}
    wd = os.path.join(bench.work, "scaling")
    for fl in cfg["sc_flavors"]:
        base = None
        for W in (1, 2, 4):
            B = cfg["sc_gbatch"] // W
            met = bench.train(bench.solution(st), os.path.join(wd, "%s_w%d" % (fl, W)), "--flavor", fl, "--world", W,
                              "--batch-size", B, "--seq-len", cfg["sc_seq"], "--steps", cfg["sc_steps"],
                              "--profile-steps", 0)
            s = tps_stats(met, cfg["sc_gbatch"] * cfg["sc_seq"], cfg["sc_first"])
            base = base or s["median"]
            row = {"flavor": fl, "world": W, "batch_per_rank": B, "tokens_per_s": s, "vs_world1": s["median"] / base,
                   "step_ms": stats([m["step_ms"] for m in met if m["step"] >= cfg["sc_first"]])}
            res["rows"].append(row)
            log("scaling: %-10s world %d  %s tokens/s  (%.2fx world 1)" % (fl, W, fmt_s(s), row["vs_world1"]))
    return res


def fits(st, W):
    """Whether a stage's flags run at world W: a --mesh R,S needs R*S ranks."""
    R, S = mesh_shape(st.flags, W)
    return R * S == W


def overlap_stages(W):
    """The stages whose communication schedules the overlap section compares at world W: every
    stage that trains, but activation checkpointing, which runs its base stage's schedule with
    a recompute added (its row would only measure the extra compute), and a mesh that needs
    another world; and the pipeline stages, which have a section of their own (pipeline)."""
    return [st for st in manifest.stages() if not st.forward_only and not st.ac and fits(st, W) and not st.pipeline]


def section_overlap(bench, cfg, W):
    """Overlap at world W with the global batch cfg["ov_gbatch"] split over the ranks: every schedule at the
    device profile's own link. The step on the modelled clock (rank 0's last step: exact, the same on every
    run), the compute stream's time in collectives and waits (exposed communication, by phase), the kernels'
    declared FLOPs / (step x the profile's peak); beside them the wall-clock step time and tokens/s (median over steps 2..N)."""
    fl, T, N = cfg["ov_flavor"], cfg["ov_seq"], cfg["ov_steps"]
    B = max(1, cfg["ov_gbatch"] // W)
    wd = os.path.join(bench.work, "overlap_world%d" % W)
    base_flags = ["--flavor", fl, "--world", W, "--batch-size", B, "--seq-len", T, "--steps", N, "--profile-steps", N]
    res = {"flavor": fl, "world": W, "batch": B, "seq_len": T, "steps": N, "wall_steps": "2..%d" % N,
           "model_step": N, "rows": [],
           "not_at_this_world": ["%s %s" % (st.dir, " ".join(st.flags)) for st in manifest.stages() if not fits(st, W)]}
    log("overlap, world %d, batch %d x seq %d per rank (%d cores)" % (W, B, T, os.cpu_count()))
    for st in overlap_stages(W):
        d = os.path.join(wd, st.dir)
        met = bench.train(bench.solution(st), d, *base_flags, *st.flags_at(W))
        mod = last_step_on_model_clock(d, met)
        wall = [m for m in met if m["step"] >= 2]
        row = {"stage": st.dir, "flags": " ".join(st.flags_at(W)), "model": mod,
               "step_ms": stats([m["step_ms"] for m in wall]), "tokens_per_s": stats([m["tokens_per_s"] for m in wall])}
        res["rows"].append(row)
        res["device_profile"], res["peak_flops"] = mod["device_profile"], trace_meta(d)["peak_flops"]
        with open(os.path.join(d, "run.json")) as fh:
            rj = json.load(fh)
        res["link"] = "--link-gbps %g --link-latency-us %g" % (rj["link_gbps"], rj["link_latency_us"])
        log("  %-28s modelled step %.3f ms  exposed comm %.3f ms (%.1f %%)  FLOP util %.1f %% of %s  "
            "| wall: step %s ms, %s tokens/s" % (
                row["stage"], mod["model_step_ms"], mod["exposed_comm_ms"], 100 * mod["exposed_comm_fraction"],
                100 * mod["kernel_flops_over_peak"], mod["math"], fmt_s(row["step_ms"], 1), fmt_s(row["tokens_per_s"])))
    return res


def section_memory(bench, cfg):
    """Every stage's peak bytes (rank 0, 2 steps) next to the analytic model of the sizes."""
    fl, W, B, T = cfg["mem_flavor"], cfg["mem_world"], cfg["mem_batch"], cfg["mem_seq"]
    wd = os.path.join(bench.work, "memory")
    res = {"flavor": fl, "world": W, "batch": B, "seq_len": T, "steps": 2, "rank": 0, "rows": [],
           "model": memory_model.__doc__.strip()}
    for st in manifest.stages():
        if accumulates(st) or mixed_precision(st) or not fits(st, W) or st.pipeline:
            continue  # the model has no microbatches, float32 params only (4b, 4c), one stage per rank (pipeline)
        d = os.path.join(wd, st.dir)
        met = bench.train(bench.solution(st), d, "--flavor", fl, "--world", W, "--batch-size", B, "--seq-len", T,
                          "--steps", 2, "--profile-steps", 0, *st.flags_at(W))
        measured = max(max(m["peak_mem_bytes_per_rank"]) for m in met)
        measured_r0 = max(m["peak_mem_bytes_per_rank"][0] for m in met)
        with open(os.path.join(d, "run.json")) as fh:
            dims = model_dims(json.load(fh))
        model_bytes, model_where, model_tags = memory_model(dims, B, T, st.shards_at(W), st)  # split over S (09)
        peak, where, live, names = replay_peak(os.path.join(d, "memory_rank0.json"))
        row = {"stage": st.dir, "flags": " ".join(st.flags_at(W)), "measured_peak_bytes": measured,
               "measured_peak_bytes_rank0": measured_r0, "model_peak_bytes": model_bytes,
               "ratio_measured_over_model": measured_r0 / model_bytes, "model_peak_at": model_where,
               "model_by_tag": model_tags, "replay_peak_bytes": peak, "replay_peak_at": where,
               "replay_live_by_tag": live, "replay_live_names": names}
        res["rows"].append(row)
        log("memory: %-28s measured %7.2f MiB  model %7.2f MiB  ratio %.3f  (peak: %s; model: %s)" % (
            st.dir, measured / MIB, model_bytes / MIB, row["ratio_measured_over_model"], where, model_where))
        for t in sorted(set(live) | set(model_tags)):
            log("      %-16s live %8.3f MiB   model %8.3f MiB" % (t, live.get(t, 0) / MIB, model_tags.get(t, 0) / MIB))
    return res


def section_grading(bench, cfg):
    """Wall time of grading the solutions (`make grade SOLUTIONS=1`; one stage in quick mode)."""
    if not os.path.exists(os.path.join(ROOT, "grader", "grade.py")):
        return {"skipped": "grader/grade.py does not exist"}
    dry = subprocess.run(["make", "-n", "grade", "SOLUTIONS=1"], cwd=ROOT, capture_output=True, text=True)
    has_target = dry.returncode == 0 and "grade.py" in dry.stdout  # a phony target without a recipe does nothing
    first = manifest.stages()[0]
    if cfg["quick"]:
        out = os.path.join(bench.work, "grade-runs")
        cmd = [sys.executable, "grader/grade.py", "--solutions", "--stage", first.id, "--out", out]
        what = "grader/grade.py --solutions --stage %s (quick mode: one stage)" % first.id
    elif has_target:
        cmd = ["make", "-s", "grade", "SOLUTIONS=1"]
        what = "make grade SOLUTIONS=1"
    else:
        out = os.path.join(bench.work, "grade-runs")
        cmd = [sys.executable, "grader/grade.py", "--solutions", "--out", out]
        what = "grader/grade.py --solutions (the Makefile has no grade target yet)"
    times, last = [], None
    for _ in range(cfg["grade_repeats"]):
        p, dt = bench.run(cmd, what)
        times.append(dt)
        last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    res = {"command": what, "wall_s": stats(times), "last_line": last, "repeats": len(times)}
    log("grading: %s: %s s (%s)" % (what, fmt_s(res["wall_s"], 1), last))
    return res


# the runtime's trace names a linear layer's kernel after its weight
MATMULS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def section_profile(bench, cfg):
    """Compute-stream time by kernel of the baseline (world 1) for one traced step: on the wall clock (args.wall_dur_us,
    where this machine spends it: what the CPU optimisations of tools/bench_notes.md worked from) and on the
    modelled clock (the device profile's price for the same kernels)."""
    fl, B, T, steps = cfg["tp_flavor"], cfg["tp_batch"], cfg["tp_seq"], cfg["prof_steps"]
    d = os.path.join(bench.work, "profile")
    met = bench.train(BASELINE, d, "--flavor", fl, "--world", 1, "--batch-size", B, "--seq-len", T, "--steps", steps,
                      "--blas-threads", 2, "--profile-steps", steps)
    ev = [e for e in trace_events(d) if e["tid"] == COMPUTE_TID and e["args"].get("step") == steps - 1]
    by = defaultdict(lambda: [0.0, 0.0])  # wall ms, modelled ms
    for e in ev:
        name = e["name"].split(".", 1)[-1] if "." in e["name"] else e["name"]
        name = name.replace("_bwd", " bwd")
        if e.get("cat") == COMPUTE and name in MATMULS:
            name = "matmul fwd"
        elif e.get("cat") == COMPUTE and name.endswith(" bwd") and name.split()[0] in MATMULS:
            name = "matmul bwd"
        elif e.get("cat") != COMPUTE:
            name = "%s (%s)" % (name, e.get("cat"))
        by[name][0] += e["args"]["wall_dur_us"] / 1e3
        by[name][1] += e["dur"] / 1e3
    step_ms, model_ms = met[-1]["step_ms"], met[-1]["model_step_ms"]
    rows = sorted(({"kernel": k, "ms": w, "share_of_step": w / step_ms, "model_ms": m,
                    "share_of_model_step": m / model_ms} for k, (w, m) in by.items()), key=lambda r: -r["ms"])
    res = {"flavor": fl, "batch": B, "seq_len": T, "step": steps, "step_ms": step_ms, "model_step_ms": model_ms,
           "device_profile": trace_meta(d)["device_profile"],
           "traced_ms": sum(w for w, _ in by.values()), "rows": rows[:14]}
    log("profile: baseline step %d: %.1f ms wall (%.3f ms modelled), top: %s" % (steps, step_ms, model_ms, ", ".join(
        "%s %.0f%%" % (r["kernel"], 100 * r["share_of_step"]) for r in rows[:5])))
    return res


def step_collectives(run_dir, step):
    """{kind: [count, bytes]} of rank 0's collectives in one step of a run (its trace)."""
    colls = defaultdict(lambda: [0, 0])
    for e in trace_events(run_dir):
        if e["pid"] == 0 and e.get("cat") == COLLECTIVE and e["args"].get("step") == step:
            _, kind = label_and_kind(e["name"])
            colls[kind][0] += 1
            colls[kind][1] += e["args"].get("bytes", 0)
    return colls


def first_stage(picks):
    """The first manifest Stage that picks(stage) is true of; None when there is none."""
    return next((s for s in manifest.stages() if picks(s)), None)


# The link of the sections that run one solution under several flags (cases) at the grading link model.
CASE_LINK = ["--link-gbps", 10, "--link-latency-us", 5]


def case_config(cfg, prefix):
    """A cases section's flavor, world, batch, seq and steps: configs()' keys that start with prefix + '_'."""
    return {k: cfg[prefix + "_" + k] for k in ("flavor", "world", "batch", "seq", "steps")}


def case_figures(st, c, link):
    """The head of a cases section's figures (bench.json), with its rows still to come."""
    return {"solution": st.dir, "flavor": c["flavor"], "world": c["world"], "batch": c["batch"], "seq_len": c["seq"],
            "steps": c["steps"], "link": " ".join(str(x) for x in link), "rows": []}


def train_cases(bench, st, c, section, link, cases):
    """Train st's solution once per case (name, flags) with config c (case_config) and every step traced, each
    in work/section/<name, spaces as underscores, other punctuation dropped>; yields name, flags, that directory
    and the metrics."""
    for name, flags in cases:
        d = os.path.join(bench.work, section, re.sub(r"[^A-Za-z0-9_.-]", "", name.replace(" ", "_")))
        met = bench.train(bench.solution(st), d, "--flavor", c["flavor"], "--world", c["world"], "--batch-size",
                          c["batch"], "--seq-len", c["seq"], "--steps", c["steps"], "--profile-steps", c["steps"],
                          *link, *flags, what="%s %s" % (st.dir, name))
        yield name, flags, d, met


def accumulates(st):
    return any(f.startswith("--grad-accum") for f in st.flags)


def section_accum(bench, cfg):
    """Gradient accumulation's trade-off (stage 07's solution): K = 1, 2, 4 microbatches of one batch, each
    mode; rank 0's peak, the unsharded grads and grad shards alive between microbatches (from the memory
    snapshot's finish_backward records), the collectives and their bytes per step (from the trace), the last
    step on the modelled clock at the grading link model, and the wall-clock step time."""
    st = first_stage(accumulates)
    if st is None:
        return {"skipped": "no stage accumulates gradients"}
    c = case_config(cfg, "acc")
    N = c["steps"]
    cases = [("K=1", [])]
    for K in (2, 4):
        cases += [("K=%d sync every" % K, ["--grad-accum", K, "--grad-sync", "every"]),
                  ("K=%d sync last" % K, ["--grad-accum", K, "--grad-sync", "last"]),
                  ("K=%d sync last, params kept" % K, ["--grad-accum", K, "--grad-sync", "last",
                                                       "--reshard-after-backward=false",
                                                       "--reshard-after-forward=false"])]
    res = case_figures(st, c, CASE_LINK)
    for name, flags, d, met in train_cases(bench, st, c, "accum", CASE_LINK, cases):
        colls = step_collectives(d, N - 1)
        with open(os.path.join(d, "memory_rank0.json")) as fh:
            between = [e for e in json.load(fh)["events"] if e.get("kind") == "hook_memory"
                       and e.get("hook") == PHASE_FINISH_BACKWARD and e.get("step") == N - 1
                       and e.get("microbatch", 0) == 0]
        tags = between[0]["exit_by_tag"] if between and flags else None  # K = 1: no "between"
        steps = list(range(1, N))
        row = {"case": name, "flags": " ".join(str(f) for f in flags),
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "between_unsharded_grad_bytes": None if tags is None else tags.get(TAG_UNSHARDED_GRAD, 0),
               "between_grad_shard_bytes": None if tags is None else tags.get(TAG_GRAD_SHARD, 0),
               "between_unsharded_param_bytes": None if tags is None else tags.get(TAG_UNSHARDED_PARAM, 0),
               "collectives": {k: {"count": c, "bytes": b} for k, (c, b) in colls.items()},
               "model": last_step_on_model_clock(d, met),
               "step_ms": stats([m["step_ms"] for m in met if m["step"] - 1 in steps]),
               "loss_last": met[-1]["loss"]}
        res["rows"].append(row)
        log("accum: %-28s peak %7.2f MiB  between: ugrad %s gshard %s uparam %s MiB  RS %d (%.2f MB) "
            "AG %d (%.2f MB)  modelled step %.3f ms (exposed comm %.3f)  wall step %s ms" % (
                name, row["peak_bytes_rank0"] / MIB, fmt_mib(row["between_unsharded_grad_bytes"]),
                fmt_mib(row["between_grad_shard_bytes"]), fmt_mib(row["between_unsharded_param_bytes"]),
                colls[REDUCE_SCATTER][0], colls[REDUCE_SCATTER][1] / 1e6, colls[ALL_GATHER][0],
                colls[ALL_GATHER][1] / 1e6, row["model"]["model_step_ms"], row["model"]["exposed_comm_ms"],
                fmt_s(row["step_ms"], 1)))
    return res


def mixed_precision(st):
    return any(f.startswith("--param-dtype") for f in st.flags)


def section_mixed_precision(bench, cfg):
    """Mixed precision's bytes, memory and precision (stage 08's solution): float32, bfloat16 params with a
    float32 reduce-scatter, and both in bfloat16, trained from the same weights on the same batches; rank 0's
    all-gather and reduce-scatter bytes of the last step (trace), the high-water of its unsharded params and
    communication buffers (the hook_memory records), its peak, the last step on the modelled clock (bfloat16
    matmuls are priced at the profile's bfloat16 peak, and their declared FLOPs divided by it), the
    wall-clock step time, and how far loss and grad norm move from the float32 run."""
    st = first_stage(mixed_precision)
    if st is None:
        return {"skipped": "no stage has a mixed-precision policy"}
    c = case_config(cfg, "mp")
    cases = [("fp32", []), ("bf16 params, fp32 reduce", ["--param-dtype", "bf16"]),
             ("bf16 params, bf16 reduce", ["--param-dtype", "bf16", "--reduce-dtype", "bf16"])]
    res = case_figures(st, c, CASE_LINK)
    ref = None
    for name, flags, d, met in train_cases(bench, st, c, "mixed_precision", CASE_LINK, cases):
        colls = step_collectives(d, c["steps"] - 1)
        with open(os.path.join(d, "memory_rank0.json")) as fh:
            notes = [e for e in json.load(fh)["events"] if e.get("kind") == "hook_memory"]
        high = {t: max((e["high_water_by_tag"].get(t, 0) for e in notes), default=0)
                for t in (TAG_UNSHARDED_PARAM, TAG_COMM_BUFFER, TAG_TEMP)}
        ref = ref or met
        row = {"case": name, "flags": " ".join(str(f) for f in flags),
               "all_gather_bytes": colls[ALL_GATHER][1], "reduce_scatter_bytes": colls[REDUCE_SCATTER][1],
               "unsharded_param_high_bytes": high[TAG_UNSHARDED_PARAM], "comm_buffer_high_bytes": high[TAG_COMM_BUFFER],
               "temp_high_bytes": high[TAG_TEMP],
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "model": last_step_on_model_clock(d, met),
               "step_ms": stats([m["step_ms"] for m in met if m["step"] > 1]),
               "loss_last": met[-1]["loss"],
               "loss_rel_vs_fp32": max(abs(m["loss"] / r["loss"] - 1) for m, r in zip(met, ref)),
               "grad_norm_rel_vs_fp32": max(abs(m["grad_norm"] / r["grad_norm"] - 1) for m, r in zip(met, ref))}
        res["rows"].append(row)
        log("mixed precision: %-26s AG %.2f MB  RS %.2f MB  unsharded params %.2f MiB  comm %.2f MiB  peak %.2f MiB  "
            "modelled step %.3f ms (FLOP util %.1f %% of %s)  wall step %s ms  loss %.6f (max rel %.1e vs fp32)  "
            "grad norm max rel %.1e" % (
                name, row["all_gather_bytes"] / 1e6, row["reduce_scatter_bytes"] / 1e6,
                row["unsharded_param_high_bytes"] / MIB, row["comm_buffer_high_bytes"] / MIB,
                row["peak_bytes_rank0"] / MIB, row["model"]["model_step_ms"], 100 * row["model"]["kernel_flops_over_peak"],
                row["model"]["math"], fmt_s(row["step_ms"], 1), row["loss_last"], row["loss_rel_vs_fp32"],
                row["grad_norm_rel_vs_fp32"]))
    return res


def hsdp(st):
    return any(f.startswith("--mesh") for f in st.flags)


# The HSDP section's two links: inside a node, and 10x slower between nodes.
HSDP_LINK = {"link_gbps": 10, "link_latency_us": 5, "inter_link_gbps": 1, "inter_link_latency_us": 50}


def layout_loss_rtol(*stage_ids):
    """How far (relative) the losses of runs that train the same model on the same batches over different parallel
    layouts may differ: each layout sums in its own order, and each correct run lies within the grader's measured
    tolerance of the non-sharded baseline (grader/figures/parity_spread.json: the spread of correct runs over BLAS
    kernels, thread counts and reorderings, times the margin), so two of them within the sum of their stages'
    tolerances. Runs on one layout that differ only in schedule sum in the same order: those agree bit for bit."""
    rubric = load_rubric()
    return sum(parity_tolerances(rubric, s)["loss"][1] for s in stage_ids)


def step_collectives_by_group(run_dir, step, rj):
    """Rank 0's collectives of one step (its trace) by kind and process group, each with the group's
    size, whether its ranks span nodes, and its time on the modelled clock (the trace's durations: the link
    model of common/runtime/coll_common.c coll_link_time_us, at the inter-node link when the group spans
    nodes)."""
    W = rj["world_size"]
    per_node, groups = rj.get("ranks_per_node") or W, runtime_groups(rj)
    out = {}
    for e in trace_events(run_dir):
        if e["pid"] != 0 or e.get("cat") != COLLECTIVE or e["args"].get("step") != step:
            continue
        kind, group = label_and_kind(e["name"])[1], e["args"]["group"]
        members = groups[group]
        c = out.setdefault((kind, group), {"kind": kind, "group": group, "ranks": len(members),
                                           "spans_nodes": len({r // per_node for r in members}) > 1,
                                           "count": 0, "bytes": 0, "modelled_ms": 0.0})
        c["count"] += 1
        c["bytes"] += e["args"].get("bytes", 0)
        c["modelled_ms"] += e["dur"] / 1e3
    order = [ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE]
    return sorted(out.values(), key=lambda c: (order.index(c["kind"]) if c["kind"] in order else len(order),
                                               -c["ranks"], c["group"]))


def section_hsdp(bench, cfg):
    """FSDP over the world vs HSDP vs DDP (stage 09's solution) on 2 nodes whose link is 10x slower than
    the link inside a node, trained from the same seed on the same batches: rank 0's collectives of the
    last step by group (trace) and the bytes of those whose group spans nodes, their time on the modelled
    clock, the param shards (memory snapshot) and peak, the last step's exposed communication and step time
    on the modelled clock, the loss. Batch 1 per rank: the step's compute is then small next to FSDP's link
    time over the slow link, so the layouts' link costs dominate the step."""
    st = first_stage(hsdp)
    if st is None:
        return {"skipped": "no stage builds a 2-D mesh"}
    fl, W, P, B, T, N = (cfg["hs_flavor"], cfg["hs_world"], cfg["hs_ranks_per_node"], cfg["hs_batch"],
                         cfg["hs_seq"], cfg["hs_steps"])
    link = ["--ranks-per-node", P] + [x for k, v in HSDP_LINK.items() for x in ("--" + k.replace("_", "-"), v)]
    wd = os.path.join(bench.work, "hsdp")
    cases = [("FSDP over the world", []),
             ("HSDP, shard in a node", ["--mesh", "%d,%d" % (W // P, P)]),
             ("DDP, replicate only", ["--mesh", "%d,1" % W])]
    res = {"solution": st.dir, "flavor": fl, "world": W, "ranks_per_node": P, "nodes": W // P, "batch": B,
           "seq_len": T, "steps": N, "link": " ".join(str(x) for x in link),
           "loss_rtol": layout_loss_rtol(st.id, st.id), "rows": []}
    for name, flags in cases:
        d = os.path.join(wd, name.split(",")[0].split()[0].lower())
        met = bench.train(bench.solution(st), d, "--flavor", fl, "--world", W, "--batch-size", B,
                          "--seq-len", T, "--steps", N, "--profile-steps", N, *link, *flags,
                          what="%s %s" % (st.dir, name))
        with open(os.path.join(d, "run.json")) as fh:
            rj = json.load(fh)
        colls = step_collectives_by_group(d, N - 1, rj)
        moving = [c for c in colls if c["ranks"] > 1]  # a one-rank group copies, it moves nothing
        _, _, live, _ = replay_peak(os.path.join(d, "memory_rank0.json"))
        res["rows"].append({
            "case": name, "flags": " ".join(flags), "mesh": rj.get("mesh") or [1, W], "collectives": colls,
            "inter_node_bytes": sum(c["bytes"] for c in moving if c["spans_nodes"]),
            "intra_node_bytes": sum(c["bytes"] for c in moving if not c["spans_nodes"]),
            "modelled_comm_ms": sum(c["modelled_ms"] for c in colls),
            "modelled_inter_node_ms": sum(c["modelled_ms"] for c in colls if c["spans_nodes"]),
            "param_shard_bytes": live.get(TAG_PARAM_SHARD, 0), "optim_state_bytes": live.get(TAG_OPTIM_STATE, 0),
            "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
            "model": last_step_on_model_clock(d, met),
            "losses": [m["loss"] for m in met], "loss_last": met[-1]["loss"]})
    ref = res["rows"][0]["losses"]
    for row in res["rows"]:
        row["loss_rel_vs_first"] = max(abs(a / b - 1) for a, b in zip(row.pop("losses"), ref))
        log("hsdp: %-24s inter-node %6.2f MB  intra-node %6.2f MB  modelled link %7.3f ms (inter-node %7.3f)  "
            "param shards %.2f MiB  peak %.2f MiB  modelled: exposed comm %.3f ms, step %.3f ms  loss %.6f" % (
                row["case"], row["inter_node_bytes"] / 1e6, row["intra_node_bytes"] / 1e6, row["modelled_comm_ms"],
                row["modelled_inter_node_ms"], row["param_shard_bytes"] / MIB, row["peak_bytes_rank0"] / MIB,
                row["model"]["exposed_comm_ms"], row["model"]["model_step_ms"], row["loss_last"]))
    res["loss_max_rel_diff"] = max(r["loss_rel_vs_first"] for r in res["rows"])
    res["losses_agree"] = res["loss_max_rel_diff"] <= res["loss_rtol"]
    if not res["losses_agree"]:
        log("hsdp: the rows' losses differ by %.1e (relative; tolerance %.0e)" % (res["loss_max_rel_diff"], res["loss_rtol"]))
    return res
