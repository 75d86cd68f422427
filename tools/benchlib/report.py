"""results/bench.md from the figures measure.py collected (the dict saved as bench.json):
the sections' tables, a few sentences on this run's numbers, and the targets (shown, never
asserted: the bench reports, it does not judge)."""
import os

from trace_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

from . import advanced
from .figures import MIB, fmt, fmt_mib, fmt_s, runs_section, section, table

# the static notes (optimisations applied, opportunities left), appended to a full run's report
NOTES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_notes.md")


def markdown(R):
    """The whole report (bench.md; stdout shows it too) of the run's figures R."""
    L = []
    L.append("# hwFSDP benchmarks%s" % (" (quick mode)" if R["quick"] else ""))
    L.append("")
    L.append("Measured side by side in one run on `%s` (%d cores), %s; total %.0f s. Timings: median "
             "[min–max] over steps." % (R["host"], R["cores"], R["date"], R["total_s"]))
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
    L.append("## 3. Overlap (%s, seq %d, traced steps %s)" % (
        R["overlap"]["flavor"], R["overlap"]["seq_len"], R["overlap"]["traced_steps"]))
    L.append("")
    L.append("Each world has its own link calibration. World %d gives every rank a core of its own, as every GPU "
             "is its own device (the graded figure); world %d runs more ranks than cores, so a collective also "
             "waits for peers the OS has descheduled, which no real cluster does (shown for comparison)." % (
                 R["overlap"]["world"], R["overlap_oversubscribed"]["world"]) if "overlap_oversubscribed" in R else
             "One link calibration for the world.")
    L.append("")
    for o in [R["overlap"]] + ([R["overlap_oversubscribed"]] if "overlap_oversubscribed" in R else []):
        overlap_table(L, o)
    L.append("Exposed communication = time the compute stream (tid 0) spends in collectives or `wait` slices, "
             "mean over ranks, divided by the step time.")
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
    tags = ["param_shard", "optim_state", "grad_shard", "unsharded_param", "unsharded_grad", "comm_buffer",
            "activation", "temp"]
    table(L, ["stage"] + tags,
          [[r["stage"]] + ["%.2f (%.2f)" % (r["replay_live_by_tag"].get(t, 0) / MIB, r["model_by_tag"].get(t, 0) / MIB)
                           for t in tags] for r in m["rows"]])
    L.append("")
    L.append("Model: " + " ".join(m["model"].split()))
    L.append("")
    runs_section(L, R.get("accum", {}), "4b. Gradient accumulation",
                 "One optimizer step over the same batch, split into K microbatches; link %(link)s. Between "
                 "microbatches: what microbatch 0's finish_backward leaves alive.",
                 ["case", "peak MiB", "unsharded grads between MiB", "grad shards between MiB",
                  "unsharded params between MiB", "reduce-scatters (MB)", "all-gathers (MB)", "step ms"],
                 lambda r: (r["case"], fmt_mib(r["peak_bytes_rank0"]), fmt_mib(r["between_unsharded_grad_bytes"]),
                            fmt_mib(r["between_grad_shard_bytes"]), fmt_mib(r["between_unsharded_param_bytes"]),
                            coll_count_mb(r["collectives"], REDUCE_SCATTER),
                            coll_count_mb(r["collectives"], ALL_GATHER), fmt_s(r["step_ms"], 1)),
                 "Sync every microbatch keeps only grad shards between microbatches and reduce-scatters K times; "
                 "sync on the last keeps every module's unsharded grads (the whole model) and reduce-scatters "
                 "once; keeping the params too (reshard after forward and backward off) all-gathers once per "
                 "step at the cost of the whole unsharded model.", steps="step %d")
    runs_section(L, R.get("mixed_precision", {}), "4c. Mixed precision",
                 "The same weights and batches under each policy; link %(link)s. Bytes: rank 0's collectives of the "
                 "last step (trace). High-water: the most bytes of the tag alive in any hook (hook_memory records). "
                 "Drift: the largest relative difference from the float32 run over the steps.",
                 ["policy", "all-gather MB/step", "reduce-scatter MB/step", "unsharded params MiB",
                  "comm buffers MiB", "temp MiB", "peak MiB", "step ms", "loss drift", "grad-norm drift"],
                 lambda r: (r["case"], "%.2f" % (r["all_gather_bytes"] / 1e6),
                            "%.2f" % (r["reduce_scatter_bytes"] / 1e6), fmt_mib(r["unsharded_param_high_bytes"]),
                            fmt_mib(r["comm_buffer_high_bytes"]), fmt_mib(r["temp_high_bytes"]),
                            fmt_mib(r["peak_bytes_rank0"]), fmt_s(r["step_ms"], 1), "%.1e" % r["loss_rel_vs_fp32"],
                            "%.1e" % r["grad_norm_rel_vs_fp32"]),
                 "bfloat16 params halve the all-gather bytes and the unsharded params; the reduce-scatter halves "
                 "only with a bfloat16 reduce. The drift is bfloat16's precision reaching the loss, not a bug: "
                 "the non-sharded baseline under the same policy agrees with the sharded run to float32 rounding. "
                 "The temp column includes the widened weights (this runtime's float32 kernels read bfloat16 "
                 "weights through a float32 copy of one param at a time; a GPU kernel reads the 16-bit words "
                 "directly), which stay under the other scratch buffers' high-water here.")
    hs = R.get("hsdp", {})
    if hs.get("rows"):
        hsdp_section(L, hs)
    advanced.render(L, R)
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
    section(L, "6. Where a baseline step goes (%s, batch %d × seq %d, world 1, step %d: %.0f ms; compute-stream "
            "trace)" % (p["flavor"], p["batch"], p["seq_len"], p["step"], p["step_ms"]), None,
            ["kernel", "ms", "% of step"],
            [(r["kernel"], "%.1f" % r["ms"], "%.1f" % (100 * r["share_of_step"])) for r in p["rows"]])
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


def overlap_table(L, o):
    """Append one world's overlap calibration and table to the lines L."""
    c = o["calibration"]
    L.append("**World %d, batch %d per rank** — link model **--link-gbps %g --link-latency-us %g**. Calibration: %s "
             "without a link model spends %.1f ms per rank and step in compute kernels; its %d collectives move "
             "%.2f MB per step, which at that link take %.1f ms (%.0f %% of compute; target %.0f %%)." % (
                 o["world"], o["batch"], o["link_gbps"], o["link_latency_us"], c["stage"],
                 c["compute_ms_per_rank_step"], c["collectives_per_step"], c["collective_bytes_per_step"] / 1e6,
                 o["modelled_link_ms_per_step"], 100 * o["modelled_link_ms_per_step"] / c["compute_ms_per_rank_step"],
                 100 * c["target_comm_share_of_compute"]))
    L.append("")
    table(L, ["stage", "step ms", "compute ms/rank", "exposed comm (% of step)"],
          [("%s %s" % (r["stage"], r["flags"]), fmt_s(r["step_ms"], 1), fmt_s(r["compute_ms"], 1),
            fmt_s(r["exposed_comm_fraction"], 1, 100)) for r in o["rows"]])
    L.append("")
    if o.get("not_at_this_world"):
        L.append("Not run at world %d (the mesh needs another world size): %s." % (
            o["world"], ", ".join(o["not_at_this_world"])))
        L.append("")


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
            "runtime's ring formula, (n−1)/n · bytes / bandwidth + (n−1) · latency per collective (an all-reduce "
            "twice that), summed over the step. Exposed comm: the compute stream's time in collectives and waits "
            "(mean over ranks). Times pool %d interleaved round%s, steps 2..%d." % (
                hs["link"], hs["rounds"], "s" if hs["rounds"] > 1 else "", hs["steps"]),
            ["run", "mesh R×S", "inter-node MB/step", "intra-node MB/step", "collectives/step", "param shards MiB",
             "peak MiB", "modelled link ms (inter-node)", "exposed comm ms", "step ms", "loss (last step)"],
            [(r["case"], "%d×%d" % tuple(r["mesh"]), "%.2f" % (r["inter_node_bytes"] / 1e6),
              "%.2f" % (r["intra_node_bytes"] / 1e6), coll_summary(r["collectives"]),
              "%.2f" % (r["param_shard_bytes"] / MIB), "%.2f" % (r["peak_bytes_rank0"] / MIB),
              "%.1f (%.1f)" % (r["modelled_comm_ms"], r["modelled_inter_node_ms"]), fmt_s(r["exposed_comm_ms"], 1),
              fmt_s(r["step_ms"], 1), "%.6f" % r["loss_last"]) for r in hs["rows"]])
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
             "compute: the modelled time says what each layout costs, the step time (ranks as threads sharing "
             "this machine's cores) how much of it shows.")
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
    ov = {r["stage"][:2]: r for r in R["overlap"]["rows"]}
    if "02" in ov and "04" in ov:
        line = ("With communication modelled at about half of compute (world %d), exposed communication is "
                "%.0f %% of the step for 02 (blocking), %.0f %% for 03 (forward prefetch) and %.0f %% for 04 "
                "(backward overlap too); step time %s ms (02) vs %s ms (04)" % (
                       R["overlap"]["world"], 100 * ov["02"]["exposed_comm_fraction"]["median"],
                       100 * ov.get("03", ov["02"])["exposed_comm_fraction"]["median"],
                       100 * ov["04"]["exposed_comm_fraction"]["median"], fmt(ov["02"]["step_ms"]["median"]),
                       fmt(ov["04"]["step_ms"]["median"])))
        o4 = [r for r in R.get("overlap_oversubscribed", {}).get("rows", []) if r["stage"].startswith("04")]
        if o4:
            line += ("; with %d ranks on %d cores 04 exposes %.0f %%, most of it collectives waiting for a "
                     "descheduled peer" % (R["overlap_oversubscribed"]["world"], R["cores"],
                                          100 * o4[0]["exposed_comm_fraction"]["median"]))
        out.append(line + ".")
    worst = max(abs(r["ratio_measured_over_model"] - 1) for r in R["memory"]["rows"])
    out.append("Every peak matches the analytic model within %.2f %%: the allocator counts requested bytes in "
               "host call order, so the peak is a deterministic function of the sizes and the hook schedule." % (
                   100 * worst))
    hs = {r["case"].split(",")[0].split()[0]: r for r in R.get("hsdp", {}).get("rows", [])}
    if {"FSDP", "HSDP", "DDP"} <= set(hs):
        f, h, d = hs["FSDP"], hs["HSDP"], hs["DDP"]
        out.append("Across 2 nodes with a 10× slower link between them, HSDP sends %.2f MB per step over that link, "
                   "FSDP over the world %.2f MB and DDP %.2f MB; the link model's time for them is %.0f, %.0f and "
                   "%.0f ms per step, the measured steps %s, %s and %s ms (medians)." % (
                       h["inter_node_bytes"] / 1e6, f["inter_node_bytes"] / 1e6, d["inter_node_bytes"] / 1e6,
                       h["modelled_inter_node_ms"], f["modelled_inter_node_ms"], d["modelled_inter_node_ms"],
                       fmt(h["step_ms"]["median"]), fmt(f["step_ms"]["median"]), fmt(d["step_ms"]["median"])))
    g = R["grading"]
    if "wall_s" in g:
        out.append("Grading: %s took %.1f s." % (g["command"], g["wall_s"]["median"]))
    return out


def targets(R):
    """One line per target with its figure and ✓ or ✗."""
    out = []
    t = R["throughput"]["runs"].get("baseline", {})
    if "vs_pytorch" in t:
        out.append("single-rank throughput ≥ 1.0× PyTorch: %.2f× %s" % (t["vs_pytorch"], "✓" if t["vs_pytorch"] >= 1 else "✗"))
    for r in R["overlap"]["rows"]:
        if r["stage"].startswith("04"):
            f = r["exposed_comm_fraction"]["median"]
            out.append("stage 04 exposes < 10%% of its step as communication (world %d on %d cores): %.1f %% %s" % (
                R["overlap"]["world"], R["cores"], 100 * f, "✓" if f < 0.1 else "✗"))
    worst = max(abs(r["ratio_measured_over_model"] - 1) for r in R["memory"]["rows"])
    out.append("peaks within 5%% of the analytic model: worst %.2f %% %s" % (100 * worst, "✓" if worst <= 0.05 else "✗"))
    hs = R.get("hsdp", {})
    if hs.get("rows"):
        out.append("FSDP, HSDP and DDP train the same model: losses within %.0e of each other: %.1e %s" % (
            hs["loss_rtol"], hs["loss_max_rel_diff"], "✓" if hs["losses_agree"] else "✗"))
    g = R["grading"]
    if "wall_s" in g and not R["quick"]:
        out.append("grading of all %d stages < 60 s: %.1f s %s" % (len(R["memory"]["rows"]), g["wall_s"]["median"],
                                                                 "✓" if g["wall_s"]["median"] < 60 else "✗"))
    return out
