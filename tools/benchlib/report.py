"""results/bench.md from the figures measure.py collected (the dict saved as bench.json):
the sections' tables, a few sentences on this run's numbers, and the targets (shown, never
asserted: the bench reports, it does not judge)."""
import os

import manifest  # grader/manifest.py: the stages
from trace_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
# the memory tags (MemTag)
from trace_names import (TAG_ACTIVATION, TAG_COMM_BUFFER, TAG_GRAD_SHARD, TAG_OPTIM_STATE, TAG_PARAM_SHARD, TAG_TEMP,
                         TAG_UNSHARDED_GRAD, TAG_UNSHARDED_PARAM)

from . import advanced, flat, pipeline
from .figures import MIB, fmt, fmt_mib, fmt_s, runs_section, section, table

# the static notes (optimisations applied, opportunities left), appended to a full run's report
NOTES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_notes.md")


def markdown(R):
    """The whole report (bench.md; stdout shows it too) of the run's figures R."""
    L = []
    L.append("# hwFSDP benchmarks%s" % (" (quick mode)" if R["quick"] else ""))
    L.append("")
    L.append("Measured side by side in one run on `%s` (%d cores), %s; total %.0f s. Two clocks: **modelled** "
             "figures are priced on the device profile `%s` from program order alone (exact: one number per "
             "configuration, the last step's); **wall** figures are this machine's, median [min–max] over steps, "
             "and hold no link or PCIe time." % (R["host"], R["cores"], R["date"], R["total_s"],
                                                R.get("device_profile", "teach")))
    L.append("")
    s = R["sgemm"]
    L.append("## 0. Machine: OpenBLAS SGEMM")
    L.append("")
    L.append("n=%d square, 2 threads, best of %d: **%.1f GFLOP/s** (median %.1f)." % (
        s["n"], s["repeats"], s["gflops_best"], s["gflops_median"]))
    L.append("")
    t = R["throughput"]
    section(L, "1. Throughput vs PyTorch (one rank, %s, fp32, 2 threads, batch %d × seq %d, steps %s)" % (
                t["flavor"], t["batch"], t["seq_len"], t["median_over_steps"]), None,
            ["run", "tokens/s", "step ms", "vs PyTorch (median; fastest steps)", "model GFLOP/s", "of SGEMM"],
            [(name, fmt_s(r["tokens_per_s"]), fmt_s(r["step_ms"]),
              ("%.2f×; %.2f×" % (r["vs_pytorch"], r["vs_pytorch_best"])) if "vs_pytorch" in r
              else ("1.00×" if "pytorch" in name else "–"),
              "%.1f" % r["achieved_gflops"], "%.0f %%" % (100 * r["of_sgemm"])) for name, r in t["runs"].items()],
            "%d interleaved round%s of each program; steps %s of every round pooled." % (
                t["rounds"], "s" if t["rounds"] > 1 else "", t["median_over_steps"]))
    L.append("FLOPs per token: %s = %s (non-embedding params %s)." % (
        t["flops_formula"], fmt(t["flops_per_token"]), fmt(t["non_embedding_params"])))
    if "pytorch_skipped" in t:
        L.append("PyTorch skipped: %s." % t["pytorch_skipped"])
    else:
        L.append("Same init and data: step-1 loss differs by %.1e (relative)." % t["loss_step1_rel_diff"])
    L.append("")
    sc = R["scaling"]
    section(L, "2. Scaling of the emulation (%s, global batch %d × seq %d, steps %s)" % (
                sc["solution"], sc["global_batch"], sc["seq_len"], sc["median_over_steps"]), None,
            ["flavour", "world", "batch/rank", "tokens/s", "step ms", "vs world 1"],
            [(r["flavor"], r["world"], r["batch_per_rank"], fmt_s(r["tokens_per_s"]), fmt_s(r["step_ms"], 1),
              "%.2f×" % r["vs_world1"]) for r in sc["rows"]])
    ov = overlap_sections(R)
    o = ov[0]
    L.append("## 3. Overlap and kernel FLOPs / peak (%s, global batch %d × seq %d, profile %s, link %s)" % (
        o["flavor"], o["batch"] * o["world"], o["seq_len"], o["device_profile"], o["link"]))
    L.append("")
    for o in ov:
        overlap_table(L, o)
    peaks = ov[0]["peak_flops"]
    L.append("Modelled step: the last step (%d) on the modelled clock, metrics.jsonl model_step_ms (the slowest "
             "rank's). Exposed comm: the time rank 0's compute stream (tid 0) spends in collectives and `wait` "
             "slices in that step, as ms and %% of the modelled step, then split by phase (forward / backward / "
             "other: data, grad norm, optimizer). Kernel FLOPs / peak = the FLOPs rank 0's kernels declared in the "
             "step (trace args.flops) / (modelled step × the profile's peak for the matmuls' math, otherData."
             "peak_flops: f32 %s GFLOP/s, bf16 %s GFLOP/s under --param-dtype bf16). Wall: this machine's step "
             "and tokens/s over steps %s, median [min–max]; the ranks share its %d cores and no link time is "
             "in it." % (ov[0]["model_step"], fmt(peaks["f32"] / 1e9), fmt(peaks["bf16"] / 1e9), ov[0]["wall_steps"],
                          R["cores"]))
    L.append("")
    m = R["memory"]
    L.append("## 4. Memory (%s, world %d, batch %d × seq %d, rank 0, max over 2 steps)" % (
        m["flavor"], m["world"], m["batch"], m["seq_len"]))
    L.append("")
    table(L, ["stage", "measured MiB", "model MiB", "measured / model", "peak at (replay)", "model's peak at"],
          [("%s %s" % (r["stage"], r["flags"]), "%.3f" % (r["measured_peak_bytes_rank0"] / MIB),
            "%.3f" % (r["model_peak_bytes"] / MIB), "%.4f" % r["ratio_measured_over_model"], r["replay_peak_at"],
            r["model_peak_at"]) for r in m["rows"]])
    L.append("")
    L.append("Live set at the peak by tag, replayed from memory_rank0.json (model in brackets), MiB:")
    L.append("")
    tags = [TAG_PARAM_SHARD, TAG_OPTIM_STATE, TAG_GRAD_SHARD, TAG_UNSHARDED_PARAM, TAG_UNSHARDED_GRAD, TAG_COMM_BUFFER,
            TAG_ACTIVATION, TAG_TEMP]
    table(L, ["stage"] + tags,
          [[r["stage"]] + ["%.2f (%.2f)" % (r["replay_live_by_tag"].get(t, 0) / MIB, r["model_by_tag"].get(t, 0) / MIB)
                           for t in tags] for r in m["rows"]])
    L.append("")
    L.append("Model: " + " ".join(m["model"].split()))
    L.append("")
    runs_section(L, R.get("accum", {}), "4b. Gradient accumulation",
                 "One optimizer step over the same batch, split into K microbatches; link %(link)s. Between "
                 "microbatches: what microbatch 0's finish_backward leaves alive. Modelled step: the last step on the "
                 "modelled clock, its exposed communication in brackets.",
                 ["case", "peak MiB", "unsharded grads between MiB", "grad shards between MiB",
                  "unsharded params between MiB", "reduce-scatters (MB)", "all-gathers (MB)",
                  "modelled step ms (exposed comm)", "wall step ms"],
                 lambda r: (r["case"], fmt_mib(r["peak_bytes_rank0"]), fmt_mib(r["between_unsharded_grad_bytes"]),
                            fmt_mib(r["between_grad_shard_bytes"]), fmt_mib(r["between_unsharded_param_bytes"]),
                            coll_count_mb(r["collectives"], REDUCE_SCATTER),
                            coll_count_mb(r["collectives"], ALL_GATHER), model_step(r), fmt_s(r["step_ms"], 1)),
                 "Sync every microbatch keeps only grad shards between microbatches and reduce-scatters K times; "
                 "sync on the last keeps every module's unsharded grads (the whole model) and reduce-scatters "
                 "once; keeping the params too (reshard after forward and backward off) all-gathers once per "
                 "step at the cost of the whole unsharded model.", steps="step %d")
    runs_section(L, R.get("mixed_precision", {}), "4c. Mixed precision",
                 "The same weights and batches under each policy; link %(link)s. Bytes: rank 0's collectives of the "
                 "last step (trace). High-water: the most bytes of the tag alive in any hook (hook_memory records). "
                 "Drift: the largest relative difference from the float32 run over the steps. Modelled step: the "
                 "last step on the modelled clock, its exposed communication in brackets.",
                 ["policy", "all-gather MB/step", "reduce-scatter MB/step", "unsharded params MiB",
                  "comm buffers MiB", "temp MiB", "peak MiB", "modelled step ms (exposed comm)",
                  "kernel FLOPs / peak", "wall step ms", "loss drift", "grad-norm drift"],
                 lambda r: (r["case"], "%.2f" % (r["all_gather_bytes"] / 1e6),
                            "%.2f" % (r["reduce_scatter_bytes"] / 1e6), fmt_mib(r["unsharded_param_high_bytes"]),
                            fmt_mib(r["comm_buffer_high_bytes"]), fmt_mib(r["temp_high_bytes"]),
                            fmt_mib(r["peak_bytes_rank0"]), model_step(r),
                            "%s of %s" % (pct(r["model"]["kernel_flops_over_peak"]), r["model"]["math"]),
                            fmt_s(r["step_ms"], 1), "%.1e" % r["loss_rel_vs_fp32"], "%.1e" % r["grad_norm_rel_vs_fp32"]),
                 "bfloat16 params halve the all-gather bytes and the unsharded params; the reduce-scatter halves "
                 "only with a bfloat16 reduce. The bfloat16 runs' matmuls are priced at the profile's bfloat16 peak "
                 "and their kernel FLOPs are divided by it. The drift is bfloat16's precision reaching the loss, not a bug: "
                 "the non-sharded baseline under the same policy agrees with the sharded run to float32 rounding. "
                 "Under bfloat16 params the activations and their gradients are bfloat16 too (2 bytes; "
                 "common/model/kernels.h lists what stays float32), so the temp column and the peak fall with them.")
    hs = R.get("hsdp", {})
    if hs.get("rows"):
        hsdp_section(L, hs)
    advanced.render(L, R)
    pipeline.render(L, R)
    flat.render(L, R)
    g = R["grading"]
    L.append("## 5. Grading time")
    L.append("")
    if "skipped" in g:
        L.append("Skipped: %s." % g["skipped"])
    else:
        L.append("`%s`: %s s (%d run%s; last line: %s)." % (g["command"], fmt_s(g["wall_s"], 1), g["repeats"],
                                                          "s" if g["repeats"] > 1 else "", g["last_line"]))
    L.append("")
    p = R["profile"]
    section(L, "6. Where a baseline step goes (%s, batch %d × seq %d, world 1, step %d: %.0f ms wall, %.3f ms "
            "modelled on %s; compute-stream trace)" % (p["flavor"], p["batch"], p["seq_len"], p["step"], p["step_ms"],
                                                       p["model_step_ms"], p["device_profile"]), None,
            ["kernel", "wall ms", "% of wall step", "modelled ms", "% of modelled step"],
            [(r["kernel"], "%.1f" % r["ms"], "%.1f" % (100 * r["share_of_step"]), "%.3f" % r["model_ms"],
              "%.1f" % (100 * r["share_of_model_step"])) for r in p["rows"]],
            "Wall: args.wall_dur_us, where this machine spends the step (what tools/bench_notes.md's CPU work "
            "started from). Modelled: the profile's roofline for the same kernels.")
    L.append("## Targets (shown, not asserted)")
    L.append("")
    for line in R["targets"]:
        L.append("- " + line)
    L.append("")
    L.append("## Notes")
    L.append("")
    L.append("### What this run measured")
    L.append("")
    for line in run_notes(R):
        L.append("- " + line)
    L.append("")
    if os.path.exists(NOTES) and not R["quick"]:
        with open(NOTES) as fh:
            L.append(fh.read().rstrip())
        L.append("")
    return "\n".join(L)


def markdown_only(R):
    """The report of a --only run (tools/bench.py): the tables of the sections it ran, nothing else."""
    L = ["# hwFSDP benchmarks, sections %s%s" % (", ".join(R["only"]), " (quick mode)" if R["quick"] else ""), "",
         "Run %s; total %.0f s. Modelled figures only where a section says so (exact: one number per "
         "configuration)." % (R["date"], R["total_s"]), ""]
    advanced.render(L, R)
    pipeline.render(L, R)
    flat.render(L, R)
    return "\n".join(L)


def overlap_sections(R):
    """The overlap section of every world the bench ran, the first (the target's) first."""
    return [R["overlap"]] + [R[k] for k in sorted(R) if k.startswith("overlap_world")]


def pct(x):
    return "%.1f %%" % (100 * x)


def overlap_table(L, o):
    """Append one world's overlap table to the lines L."""
    L.append("**World %d, batch %d × seq %d per rank**" % (o["world"], o["batch"], o["seq_len"]))
    L.append("")
    table(L, ["stage", "modelled step ms", "exposed comm ms (% of step)", "exposed fwd / bwd / other ms",
              "kernel FLOPs / peak", "wall step ms", "wall tokens/s"],
          [("%s %s" % (r["stage"], r["flags"]), "%.3f" % r["model"]["model_step_ms"],
            "%.3f (%s)" % (r["model"]["exposed_comm_ms"], pct(r["model"]["exposed_comm_fraction"])),
            " / ".join("%.3f" % r["model"]["exposed_comm_ms_by_phase"][p] for p in ("forward", "backward", "other")),
            "%s of %s" % (pct(r["model"]["kernel_flops_over_peak"]), r["model"]["math"]), fmt_s(r["step_ms"], 1),
            fmt_s(r["tokens_per_s"])) for r in o["rows"]])
    L.append("")
    if o.get("not_at_this_world"):
        L.append("Not run at world %d (the mesh needs another world size): %s." % (
            o["world"], ", ".join(o["not_at_this_world"])))
        L.append("")


def model_step(r):
    """'12.345 (1.234)': a row's modelled step and its exposed communication, ms."""
    return "%.3f (%.3f)" % (r["model"]["model_step_ms"], r["model"]["exposed_comm_ms"])


def coll_count_mb(colls, kind):
    """'8 (1.23)': how many collectives of the kind a step ran and their MB."""
    c = colls.get(kind, {})
    return "%d (%.2f)" % (c.get("count", 0), c.get("bytes", 0) / 1e6)


def coll_summary(colls):
    """'16 AG/shard(2), 8 AR/replicate(2)': count, kind and group (its size in brackets) of a step's collectives."""
    abbrev = {ALL_GATHER: "AG", REDUCE_SCATTER: "RS", ALL_REDUCE: "AR"}
    return ", ".join("%d %s/%s(%d)" % (c["count"], abbrev.get(c["kind"], c["kind"]), c["group"].rstrip("0123456789"),
                                       c["ranks"]) for c in colls)


def hsdp_section(L, hs):
    """Append section 4d (FSDP vs HSDP vs DDP across two nodes) to the lines L."""
    section(L, "4d. HSDP across nodes (%s, %s, world %d = %d nodes × %d ranks, batch %d × seq %d per rank, "
            "%d steps)" % (hs["solution"], hs["flavor"], hs["world"], hs["nodes"], hs["ranks_per_node"],
                           hs["batch"], hs["seq_len"], hs["steps"]),
            "Link model `%s`: a collective whose group's ranks span both nodes runs at the inter-node link, "
            "10× slower. Bytes and collectives: rank 0's in the last step (trace args.bytes: the whole buffer; a "
            "one-rank group moves nothing), split by whether the group spans nodes. Modelled link time: the "
            "trace's durations of those collectives, the runtime's ring model (coll_common.c coll_link_time_us: "
            "(n−1)/n · bytes / bandwidth + (n−1) · latency per pass, two passes for an all-reduce), summed over "
            "the step. Exposed comm and step: rank 0's last step on the modelled clock (exposed: its compute "
            "stream's time in collectives and waits)." % hs["link"],
            ["run", "mesh R×S", "inter-node MB/step", "intra-node MB/step", "collectives/step", "param shards MiB",
             "peak MiB", "modelled link ms (inter-node)", "modelled exposed comm ms", "modelled step ms",
             "loss (last step)"],
            [(r["case"], "%d×%d" % tuple(r["mesh"]), "%.2f" % (r["inter_node_bytes"] / 1e6),
              "%.2f" % (r["intra_node_bytes"] / 1e6), coll_summary(r["collectives"]),
              "%.2f" % (r["param_shard_bytes"] / MIB), "%.2f" % (r["peak_bytes_rank0"] / MIB),
              "%.3f (%.3f)" % (r["modelled_comm_ms"], r["modelled_inter_node_ms"]),
              "%.3f" % r["model"]["exposed_comm_ms"], "%.3f" % r["model"]["model_step_ms"],
              "%.6f" % r["loss_last"]) for r in hs["rows"]])
    if hs["loss_max_rel_diff"] == 0:
        L.append("The three runs train the same model on the same batches: their losses are equal at every step "
                 "(to the digits metrics.jsonl prints).")
    elif hs["losses_agree"]:
        L.append("The three runs train the same model on the same batches: their losses agree at every step "
                 "within %.1e (relative; tolerance %.0e)." % (hs["loss_max_rel_diff"], hs["loss_rtol"]))
    else:
        L.append("**The losses differ: %.1e relative at worst (tolerance %.0e). The three runs train the same "
                 "model on the same batches, so one of them is wrong.**" % (hs["loss_max_rel_diff"], hs["loss_rtol"]))
    L.append("")
    L.append("FSDP over the world sends every all-gather (each module twice a step) and reduce-scatter across the "
             "slow link. HSDP keeps them inside a node and sends only each module's grad shard across, in an "
             "all-reduce over the R replicas: 1/S of the reduce-scatter's bytes, once a step. DDP all-reduces whole "
             "grads across. So the shard dimension, with the heavy and frequent traffic, goes on the fast link and "
             "the replicate dimension on the slow one; the price is S/W of the model in param shards and optimizer "
             "state per rank instead of 1/W. Prefetching hides the link time behind compute until it exceeds "
             "compute: the modelled link time says what each layout's traffic costs, the exposed comm how much "
             "of it shows in the step.")
    L.append("")


def run_notes(R):
    """A few sentences on this run's numbers (the static list of opportunities is tools/bench_notes.md)."""
    out = []
    t = R["throughput"]
    b = t["runs"]["baseline"]
    line = "One rank, %s: the baseline runs %s tokens/s (%.0f %% of the %.0f GFLOP/s SGEMM ceiling at %s " \
           "FLOPs per token)" % (t["flavor"], fmt(b["tokens_per_s"]["median"]), 100 * b["of_sgemm"],
                                 R["sgemm"]["gflops_best"], fmt(t["flops_per_token"]))
    if "vs_pytorch" in b:
        line += "; %.2f× PyTorch eager by medians, %.2f× by fastest steps" % (b["vs_pytorch"], b["vs_pytorch_best"])
    out.append(line + ". Spread between min and max is load from other processes on the 2 cores; "
               "the fastest steps are the least disturbed figure.")
    sc = [r for r in R["scaling"]["rows"] if r["world"] == 4]
    out.append("Emulated ranks share the same cores, so tokens/s cannot grow with the world size; "
               "world 4 keeps " + ", ".join("%.2f× of world 1 on %s" % (r["vs_world1"], r["flavor"]) for r in sc) +
               " (the rest is the emulation's overhead: stream threads, copies, collectives).")
    ov = {r["stage"][:2]: r["model"] for r in R["overlap"]["rows"]}
    if "02" in ov and "04" in ov:
        out.append("On the modelled clock (%s, world %d), exposed communication is %.1f %% of the step for 02 "
                   "(blocking), %.1f %% for 03 (forward prefetch) and %.1f %% for 04 (backward overlap too); the step "
                   "takes %.3f ms (02) vs %.3f ms (04), declared kernel FLOPs / (step x the peak) %.1f %% vs %.1f %%." % (
                       R["overlap"]["device_profile"], R["overlap"]["world"], 100 * ov["02"]["exposed_comm_fraction"],
                       100 * ov.get("03", ov["02"])["exposed_comm_fraction"], 100 * ov["04"]["exposed_comm_fraction"],
                       ov["02"]["model_step_ms"], ov["04"]["model_step_ms"], 100 * ov["02"]["kernel_flops_over_peak"],
                       100 * ov["04"]["kernel_flops_over_peak"]))
    worst = max(abs(r["ratio_measured_over_model"] - 1) for r in R["memory"]["rows"])
    out.append("Every peak matches the analytic model within %.2f %%: the allocator counts requested bytes in "
               "host call order, so the peak is a deterministic function of the sizes and the hook schedule." % (
                   100 * worst))
    hs = {r["case"].split(",")[0].split()[0]: r for r in R.get("hsdp", {}).get("rows", [])}
    if {"FSDP", "HSDP", "DDP"} <= set(hs):
        f, h, d = hs["FSDP"], hs["HSDP"], hs["DDP"]
        out.append("Across 2 nodes with a 10× slower link between them, HSDP sends %.2f MB per step over that link, "
                   "FSDP over the world %.2f MB and DDP %.2f MB; the link model's time for them is %.3f, %.3f and "
                   "%.3f ms per step, the modelled steps %.3f, %.3f and %.3f ms." % (
                       h["inter_node_bytes"] / 1e6, f["inter_node_bytes"] / 1e6, d["inter_node_bytes"] / 1e6,
                       h["modelled_inter_node_ms"], f["modelled_inter_node_ms"], d["modelled_inter_node_ms"],
                       h["model"]["model_step_ms"], f["model"]["model_step_ms"], d["model"]["model_step_ms"]))
    g = R["grading"]
    if "wall_s" in g:
        out.append("Grading: %s took %.1f s." % (g["command"], g["wall_s"]["median"]))
    return out


# the runtime's single-rank throughput against PyTorch eager on this CPU, by medians (tools/bench_notes.md)
VS_PYTORCH_TARGET = 2.0


def targets(R):
    """One line per target with its figure and ✓ or ✗."""
    out = []
    t = R["throughput"]["runs"].get("baseline", {})
    if "vs_pytorch" in t:
        out.append("single-rank throughput ≥ %.1f× PyTorch eager: %.2f× %s (OpenBLAS core %s)" % (
            VS_PYTORCH_TARGET, t["vs_pytorch"], "✓" if t["vs_pytorch"] >= VS_PYTORCH_TARGET else "✗",
            R["throughput"].get("openblas_core", "unknown")))
    for r in R["overlap"]["rows"]:
        if r["stage"].startswith("04"):
            f = r["model"]["exposed_comm_fraction"]
            out.append("stage 04 exposes < 10%% of its step as communication (world %d, modelled on %s): %.1f %% %s" % (
                R["overlap"]["world"], R["overlap"]["device_profile"], 100 * f, "✓" if f < 0.1 else "✗"))
    worst = max(abs(r["ratio_measured_over_model"] - 1) for r in R["memory"]["rows"])
    out.append("peaks within 5%% of the analytic model: worst %.2f %% %s" % (100 * worst, "✓" if worst <= 0.05 else "✗"))
    hs = R.get("hsdp", {})
    if hs.get("rows"):
        out.append("FSDP, HSDP and DDP train the same model: losses within %.0e of each other: %.1e %s" % (
            hs["loss_rtol"], hs["loss_max_rel_diff"], "✓" if hs["losses_agree"] else "✗"))
    g = R["grading"]
    if "wall_s" in g and not R["quick"]:
        out.append("grading of all %d stages < 60 s: %.1f s %s" % (len(manifest.stages()), g["wall_s"]["median"],
                                                                 "✓" if g["wall_s"]["median"] < 60 else "✗"))
    return out
