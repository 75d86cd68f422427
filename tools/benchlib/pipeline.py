"""Bench section of the pipeline stages (tools/bench.py): 4g, pipeline parallelism (stages 11 and 12).

- the bubble against M: stage 11's solution on P = 4 stages of one rank, GPipe and 1F1B, the same global
  batch split into M = 1 .. 16 microbatches: the modelled step, the measured bubble (the stages' mean idle
  share of the step, as the grader's pp_bubble measures it) beside (P-1)/(M+P-1), and the first stage's peak of
  live activation bytes (GPipe holds M microbatches there, 1F1B at most P);
- PP x FSDP against FSDP alone on the two-link model: 8 ranks as 2 nodes of 4, the link between the nodes
  10x slower than inside one. FSDP over all 8 ranks (stage 07's solution, the same microbatches accumulated,
  the reduce-scatter on the last) crosses the slow link with every all-gather and reduce-scatter; 2 pipeline
  stages of 4 shards (stage 12's solution, a stage per node) cross it only with the activations and their
  grads;
- the same comparison at Llama 3 8B on 16 modelled H100s (2 nodes of 8), as a dry run (--dry-run: priced,
  not computed).
Numbers only, never asserted. Rendered by render().
"""
import os

from gradelib.trace_model import RunDir, activation_peaks, ideal_bubble, pipeline_bubble

from .figures import MIB, fmt_mib, section
from .measure import first_stage, layout_loss_rtol, log


def _pipeline_stage(fsdp):
    return first_stage(lambda s: s.pipeline and (("--reshard-after-forward=false" in s.flags) == fsdp))


def _accum_stage():
    return first_stage(lambda s: any(f.startswith("--grad-accum") for f in s.flags))


def bubble(run_dir, world, step):
    """The stages' mean idle share of `step` on the modelled clock, as the grader's pp_bubble measures it."""
    return pipeline_bubble(RunDir(run_dir).traces(), step, world)[0]


def activation_peak(run_dir, rank, step):
    """The most bytes tagged activation live at once on `rank` during `step`, from its memory snapshot."""
    return activation_peaks(RunDir(run_dir).memory(rank)["events"], step + 1)[step][0]


def _last(met, key):
    return met[-1][key]


def section_pipeline(bench, cfg):
    st11, st12, st07 = _pipeline_stage(False), _pipeline_stage(True), _accum_stage()
    if st11 is None or st12 is None or st07 is None:
        return {"skipped": "stages 07, 11 and 12's solutions are needed"}
    quick = cfg.get("quick")
    res = {"solutions": [st11.dir, st12.dir, st07.dir]}

    # 1. the bubble against M
    P, W, steps = 4, 4, 3
    flavor, seq, batch = ("tiny", 32, 8) if quick else ("debugmodel", 128, 16)
    ms = [1, 2, 4, 8] if quick else [1, 2, 4, 8, 16]
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            d = os.path.join(bench.work, "pipeline", "%s_m%d" % (schedule, m))
            met = bench.train(bench.solution(st11), d, "--flavor", flavor, "--world", W, "--n-layers", 4,
                              "--seq-len", seq, "--batch-size", batch, "--steps", steps, "--profile-steps", steps,
                              "--pp", P, "--microbatches", m, "--pp-schedule", schedule,
                              what="%s %s M=%d" % (st11.dir, schedule, m))
            row = {"schedule": schedule, "microbatches": m, "model_step_ms": _last(met, "model_step_ms"),
                   "bubble": bubble(d, W, steps - 1), "ideal_bubble": ideal_bubble(P, m),
                   "stage0_activation_peak_bytes": activation_peak(d, 0, steps - 1)}
            rows.append(row)
            log("pipeline: %-5s M=%-2d  modelled step %.3f ms  bubble %.1f %% (ideal %.1f %%)  stage 0 activations "
                "%.2f MiB" % (schedule, m, row["model_step_ms"], 100 * row["bubble"], 100 * row["ideal_bubble"],
                              row["stage0_activation_peak_bytes"] / MIB))
    res["bubble"] = {"flavor": flavor, "world": W, "stages": P, "n_layers": 4, "seq_len": seq, "batch": batch,
                     "rows": rows}

    # 2. PP x FSDP vs FSDP on two links, the link between the nodes 10x and 100x slower than inside one
    M = 4
    W2, per_node = (4, 2) if quick else (8, 4)
    base = ["--flavor", flavor, "--n-layers", 4, "--seq-len", seq, "--steps", steps, "--profile-steps", steps]
    b_shard = max(M, batch // (W2 // 2))  # a pipeline shard's batch: M microbatches of at least one sequence
    G = b_shard * (W2 // 2)  # the global batch, the same for both: the pipeline has W2 / 2 data shards
    cases = [("FSDP over all %d ranks" % W2, st07, ["--world", W2, "--batch-size", max(1, G // W2)]),
             ("PP 2 x FSDP %d (a stage per node)" % (W2 // 2), st12,
              ["--world", W2, "--batch-size", b_shard, "--pp", 2, "--microbatches", M, "--reshard-after-forward=false"])]
    rows2 = []
    for inter in (10, 1):
        link = ["--link-gbps", 100, "--link-latency-us", 5, "--ranks-per-node", per_node, "--inter-link-gbps", inter,
                "--inter-link-latency-us", 20]
        for name, stage, flags in cases:
            d = os.path.join(bench.work, "pipeline", "twolink_%s_%d" % (stage.id, inter))
            met = bench.train(bench.solution(stage), d, *base, *link, *flags, what="%s %s" % (stage.dir, name))
            rows2.append({"case": name, "inter_link_gbps": inter, "flags": " ".join(str(f) for f in flags),
                          "model_step_ms": _last(met, "model_step_ms"),
                          "peak_bytes_max": max(_last(met, "peak_mem_bytes_per_rank")), "loss_last": _last(met, "loss")})
            log("pipeline, two links (%d Gbit/s between nodes): %-34s modelled step %.3f ms  peak %.2f MiB  loss %.6f"
                % (inter, name, rows2[-1]["model_step_ms"], rows2[-1]["peak_bytes_max"] / MIB, rows2[-1]["loss_last"]))
    losses = [r["loss_last"] for r in rows2]
    rtol = layout_loss_rtol(st07.id, st12.id)
    res["two_links"] = {"world": W2, "ranks_per_node": per_node,
                        "link": "--link-gbps 100 --link-latency-us 5 --inter-link-latency-us 20",
                        "global_batch": G, "rows": rows2,
                        # two layouts of one batch sum in different orders: equal within the measured band
                        "loss_rtol": rtol, "loss_max_rel_diff": (max(losses) - min(losses)) / max(map(abs, losses)),
                        "losses_agree": max(losses) - min(losses) <= rtol * max(map(abs, losses))}

    # 3. at 8B, dry runs on 16 modelled H100s
    if quick:
        res["llama3_8b"] = {"skipped": "--quick"}
        return res
    link8 = ["--device-profile", "h100-sxm", "--ranks-per-node", 8, "--link-gbps", 3600, "--link-latency-us", 3,
             "--inter-link-gbps", 400, "--inter-link-latency-us", 10]
    base8 = ["--flavor", "8B", "--seq-len", 8192, "--steps", 2, "--profile-steps", 1, "--trace-ranks", 1, "--ac",
             "--dry-run", "--collective-timeout-s", 0]
    cases8 = [("FSDP over 16", st07, ["--world", 16, "--batch-size", 2]),
              ("PP 2 x FSDP 8", st12, ["--world", 16, "--batch-size", 4, "--pp", 2, "--microbatches", 4,
                                       "--reshard-after-forward=false"])]
    rows3 = []
    for name, stage, flags in cases8:
        d = os.path.join(bench.work, "pipeline", "8b_%s" % stage.id)
        met = bench.train(bench.solution(stage), d, *base8, *link8, *flags, what="%s 8B %s" % (stage.dir, name))
        rows3.append({"case": name, "flags": " ".join(str(f) for f in flags), "model_step_ms": _last(met, "model_step_ms"),
                      "peak_bytes_rank0": _last(met, "peak_mem_bytes_per_rank")[0]})
        log("pipeline, 8B dry run: %-16s modelled step %.1f ms  rank 0 peak %.1f GiB" % (
            name, rows3[-1]["model_step_ms"], rows3[-1]["peak_bytes_rank0"] / 2 ** 30))
    res["llama3_8b"] = {"world": 16, "link": " ".join(str(x) for x in link8), "global_batch_sequences": 32,
                        "rows": rows3}
    return res


def render(L, R):
    x = R.get("pipeline", {})
    if not x or "skipped" in x:
        return
    b = x["bubble"]
    section(L, "4g. Pipeline parallelism (stages 11, 12)",
            "Stage 11's solution on %d stages of one rank (%s, --n-layers %d, batch %d x seq %d), the same batch "
            "split into M microbatches. Bubble: the stages' mean idle share of the last step on the modelled clock "
            "(the grader's pp_bubble); ideal: (P-1)/(M+P-1) with equal stages and free transfers. Stage 0's "
            "activations: its peak of live activation bytes." % (b["stages"], b["flavor"], b["n_layers"],
                                                                   b["batch"], b["seq_len"]),
            ["schedule", "M", "modelled step ms", "bubble", "ideal", "stage 0 activations MiB"],
            [(r["schedule"], r["microbatches"], "%.3f" % r["model_step_ms"], "%.1f %%" % (100 * r["bubble"]),
              "%.1f %%" % (100 * r["ideal_bubble"]), fmt_mib(r["stage0_activation_peak_bytes"])) for r in b["rows"]],
            "GPipe and 1F1B have the same bubble; what 1F1B saves is memory on the early stages once M > P. The "
            "bubble stays above the ideal: the last stage holds the head and the loss and sets the pace, and every "
            "pass pays fixed costs (its FSDP copies and launches, each transfer's latency), so past some M the "
            "smaller ideal bubble no longer pays for the extra passes.")
    t = x["two_links"]
    section(L, "4h. PP x FSDP against FSDP on two links",
            "%d ranks as nodes of %d, %s, the link between nodes at 10 or 1 Gbit/s; the same global batch of %d "
            "sequences. FSDP's all-gathers and reduce-scatters span both nodes; the pipeline's shard groups stay "
            "inside a node and only the activations and their grads cross." % (
                t["world"], t["ranks_per_node"], t["link"], t["global_batch"]),
            ["case", "between nodes", "flags", "modelled step ms", "peak MiB (max rank)", "last loss"],
            [(r["case"], "%d Gbit/s" % r["inter_link_gbps"], r["flags"], "%.3f" % r["model_step_ms"],
              fmt_mib(r["peak_bytes_max"]), "%.6f" % r["loss_last"]) for r in t["rows"]],
            "On a fast enough link FSDP over every rank wins: its communication hides under compute and the pipeline "
            "pays its bubble. When the link between nodes is slow, FSDP's all-gathers and reduce-scatters across it "
            "cost more than the bubble, and the pipeline, whose only traffic across nodes is one activation per "
            "microbatch each way, wins. %s" % (
                "The two layouts sum in different orders; their last losses differ by %.1e (relative), within %.0e "
                "(the grader's measured tolerances against the non-sharded baseline of the two stages, added)."
                % (t["loss_max_rel_diff"], t["loss_rtol"]) if t["losses_agree"] else
                "**The last losses differ by %.1e (relative), more than %.0e (the two stages' measured tolerances "
                "against the baseline, added): the two layouts train the same model on the same batches, so one "
                "of them is wrong.**" % (t["loss_max_rel_diff"], t["loss_rtol"])))
    e = x.get("llama3_8b", {})
    if e and "skipped" not in e:
        section(L, "4i. The same at Llama 3 8B (dry run)",
                "16 modelled H100s (2 nodes of 8), %s, sequence 8192, 32 sequences per step, --ac; priced, not "
                "computed (--dry-run)." % e["link"],
                ["case", "flags", "modelled step ms", "rank 0 peak GiB"],
                [(r["case"], r["flags"], "%.1f" % r["model_step_ms"], "%.1f" % (r["peak_bytes_rank0"] / 2 ** 30))
                 for r in e["rows"]],
                "The pipeline keeps each stage's params unsharded from its first forward to its last backward "
                "(float32 here: the solutions of 11 and 12 have no mixed precision), which is what its peak pays "
                "for the traffic it saves.")
