"""Bench sections of stage 13 (tools/bench.py): flat parameters and buckets against per-parameter FSDP2, and one
8-GPU node of a 3B Llama under DDP, ZeRO-2 and FSDP (the MLX-style row).

4j, flat parameters: stage 07's solution (FSDP2: each parameter sharded on dim 0, copy-in, copy-out and chunk-cat
in batched launches) against stage 13's (FSDP1's FlatParameter: one flat unit per module, then with --bucket-mb
25 and 100, and a bucket of about two of the model's modules), both under their stage flags (--grad-accum 2
--grad-sync last); on the debugmodel at the bench's profile (teach unless --device-profile) and on Llama 3 8B at
64 modelled H100s (dry runs). Each row reads its run's own files: rank 0's trace of the last step (launches,
collectives, exposed communication on the modelled clock), metrics.jsonl (peak, modelled step), run.json (the
flat units).

4k, one node: Llama 3.2 3B's shape by flags on 8 modelled H100s (dry runs): DDP (the 2-D mesh stage at W x 1),
ZeRO-2 (the stage that teaches --reshard-after-forward=false) and FSDP (stage 13's base, one microbatch): rank 0's
peak and the modelled tokens/s, beside what one real system (MLX's FSDP) measured.

Numbers only, never asserted. Rendered by render().
"""
import json
import os

import manifest  # grader/manifest.py: the stages
from trace_names import ALL_GATHER, ALL_REDUCE, COLLECTIVE, COMPUTE, COPY, MEMSET, REDUCE_SCATTER, label_and_kind

from .figures import MIB, fmt, section, table
from .measure import first_stage, hsdp, log
from .traces import step_on_model_clock, trace_events

GIB = 2.0 ** 30

# A launch: an op the host enqueues that runs on a device stream (a kernel, a copy, a memset, a collective).
# Event records and waits order the streams and host syncs stop the host; none of them is work.
LAUNCH_CATEGORIES = (COMPUTE, COPY, MEMSET, COLLECTIVE)

# What one real system measured (a review of MLX's FSDP, quoted by issue 50): FSDP without sharding the model
# (ZeRO-2-like) against DDP, a 3.7B model on 8 GPUs. Quoted beside the table, never fitted or compared by a rule.
MLX_QUOTE = {"model": "3.7B", "gpus": 8, "zero2_tokens_per_s": 197e3, "ddp_tokens_per_s": 200e3,
             "zero2_peak_gb": 99, "ddp_peak_gb": 127}

# Llama 3.2 3B's shape (its config.json: dim 3072, 28 layers, 24 heads of 128, 8 kv heads, vocab 128256, FFN
# 8192 = multiple_of 256 and ffn_dim_multiplier 1.0 in torchtitan's rule), on the 8B flavour's rope and norm.
# The runtime does not tie the embedding and the output, so the model holds 3.6B params (3.2B tied).
LLAMA32_3B = ["--flavor", "8B", "--dim", 3072, "--n-layers", 28, "--n-heads", 24, "--n-kv-heads", 8,
              "--vocab-size", 128256, "--multiple-of", 256, "--ffn-dim-multiplier", 1.0]

# A dry run on H100s, 8 to a node, the profile's own links; one rank traced (a 64-rank run's traces are large).
H100 = ["--dry-run", "--device-profile", "h100-sxm", "--ranks-per-node", 8, "--warmup-steps", 0, "--trace-ranks", 1,
        "--collective-timeout-s", 0]


def flat_stage():
    return first_stage(lambda s: s.flat)


def step_counts(events, step, rank=0):
    """One rank's launches and collectives in one step (0-based) of a run's trace slices:
    {"launches": n, "by_category": {cat: n}, "collectives": {kind: {"count": n, "bytes": b}}}."""
    launches, by_cat, colls = 0, {}, {}
    for e in events:
        if e["pid"] != rank or e["args"].get("step") != step or e.get("cat") not in LAUNCH_CATEGORIES:
            continue
        launches += 1
        by_cat[e["cat"]] = by_cat.get(e["cat"], 0) + 1
        if e["cat"] == COLLECTIVE:
            c = colls.setdefault(label_and_kind(e["name"])[1], {"count": 0, "bytes": 0})
            c["count"] += 1
            c["bytes"] += e["args"].get("bytes", 0)
    return {"launches": launches, "by_category": by_cat, "collectives": colls}


def run_row(case, flags, run_dir, met):
    """A table row of one run from its own files: rank 0's last step in the trace (launches, collectives,
    exposed communication on the modelled clock), metrics.jsonl (peak over steps and ranks, the modelled step),
    run.json (the flat units, none for a per-parameter stage)."""
    with open(os.path.join(run_dir, "run.json")) as fh:
        rj = json.load(fh)
    last = met[-1]
    ev = trace_events(run_dir)
    units = rj.get("flat_units")
    return dict(step_counts(ev, last["step"] - 1), case=case, flags=" ".join(str(f) for f in flags),
                units=units, n_params=rj["n_params"],
                peak_bytes=max(max(m["peak_mem_bytes_per_rank"]) for m in met),
                model=step_on_model_clock(run_dir, last["step"] - 1, last["model_step_ms"], events=ev),
                fits=last.get("fits"))


def _cases(small_bucket_mb):
    """(name, stage key, extra flags) of the flat table: 'base' is the per-parameter stage, 'flat' stage 13."""
    return [("per-parameter (FSDP2)", "base", []), ("flat, a unit per module", "flat", []),
            ("flat, --bucket-mb 25", "flat", ["--bucket-mb", 25]),
            ("flat, --bucket-mb 100", "flat", ["--bucket-mb", 100]),
            ("flat, --bucket-mb %g (about two modules)" % small_bucket_mb, "flat", ["--bucket-mb", small_bucket_mb])]


def _flat_table(bench, stages, tag, common, small_bucket_mb, what):
    rows = []
    for name, key, flags in _cases(small_bucket_mb):
        st = stages[key]
        d = os.path.join(bench.work, "flat", "%s_%s%s" % (tag, st.id, "_b%g" % flags[1] if flags else ""))
        met = bench.train(bench.solution(st), d, *common, *st.flags, *flags, what="%s %s %s" % (st.dir, what, name))
        row = run_row(name, ["stage", st.id] + list(st.flags) + flags, d, met)
        rows.append(row)
        log("flat, %s: %-40s units %-3s launches %5d  AG %4d  RS %4d  modelled: exposed comm %.3f ms, step %.3f ms  "
            "peak %.3f GiB" % (what, name, len(row["units"]) if row["units"] else "-", row["launches"],
                               row["collectives"].get(ALL_GATHER, {}).get("count", 0),
                               row["collectives"].get(REDUCE_SCATTER, {}).get("count", 0),
                               row["model"]["exposed_comm_ms"], row["model"]["model_step_ms"], row["peak_bytes"] / GIB))
    return rows


def section_flat(bench, cfg):
    """Section 4j (the flat table on the bench's model and, unless --quick, on 8B at 64 modelled H100s) and 4k
    (one node of 8 modelled H100s, a 3B model: DDP, ZeRO-2, FSDP; not under --quick)."""
    st13 = flat_stage()
    if st13 is None:
        return {"skipped": "no stage lays its params out flat"}
    stages = {"base": manifest.stage(st13.builds_on), "flat": st13}
    quick = cfg.get("quick")
    c = dict(flavor="tiny", world=2, batch=2, seq=32, steps=2, small_bucket_mb=0.2) if quick else \
        dict(flavor="debugmodel", world=4, batch=2, seq=128, steps=3, small_bucket_mb=4)
    link = ["--link-gbps", 10, "--link-latency-us", 5]  # the grading link model (the cases sections' CASE_LINK)
    common = ["--flavor", c["flavor"], "--world", c["world"], "--batch-size", c["batch"], "--seq-len", c["seq"],
              "--steps", c["steps"], "--profile-steps", c["steps"]] + link
    res = {"solutions": [stages["base"].dir, st13.dir],
           "small": dict(c, link=" ".join(str(x) for x in link),
                         rows=_flat_table(bench, stages, "small", common, c["small_bucket_mb"], c["flavor"]))}
    if quick:
        res["llama3_8b"] = res["one_node"] = {"skipped": "--quick"}
        return res
    e = dict(flavor="8B", world=64, batch=2, seq=8192, steps=2, small_bucket_mb=1000)
    extra8 = ["--ac"] + H100
    common8 = ["--flavor", "8B", "--world", 64, "--batch-size", 2, "--seq-len", 8192, "--steps", 2,
               "--profile-steps", 2] + extra8
    res["llama3_8b"] = dict(e, flags=" ".join(str(x) for x in extra8),
                            rows=_flat_table(bench, stages, "8b", common8, e["small_bucket_mb"], "8B on 64 H100s"))
    res["one_node"] = section_one_node(bench)
    return res


def section_one_node(bench):
    """Llama 3.2 3B's shape on one node of 8 modelled H100s, --ac, batch 1 x seq 4096 per GPU, float32 (the stages
    below have no mixed precision): DDP, ZeRO-2 and FSDP; rank 0's peak and the modelled tokens/s of the whole node
    (8 x 4096 tokens / the last step's model_step_ms)."""
    ddp, zero2, fsdp = first_stage(hsdp), first_stage(lambda s: s.zero2), manifest.stage(flat_stage().builds_on)
    if ddp is None or zero2 is None:
        return {"skipped": "stages with a 2-D mesh and with ZeRO-2 are needed"}
    W, B, T = 8, 1, 4096
    common = LLAMA32_3B + ["--world", W, "--batch-size", B, "--seq-len", T, "--steps", 2, "--profile-steps", 2,
                           "--ac"] + H100
    cases = [("DDP", ddp, ["--mesh", "%d,1" % W]), ("ZeRO-2", zero2, list(zero2.flags)),
             ("FSDP", fsdp, ["--grad-accum", 1])]  # stage 07's solution at one microbatch: FSDP2
    rows = []
    for name, st, flags in cases:
        d = os.path.join(bench.work, "flat", "3b_%s" % name.lower().replace("-", ""))
        met = bench.train(bench.solution(st), d, *common, *flags, what="%s 3B %s" % (st.dir, name))
        with open(os.path.join(d, "run.json")) as fh:
            n_params = json.load(fh)["n_params"]
        last = met[-1]
        row = {"case": name, "stage": st.dir, "flags": " ".join(str(f) for f in flags), "n_params": n_params,
               "peak_bytes_rank0": max(m["peak_mem_bytes_per_rank"][0] for m in met),
               "model_step_ms": last["model_step_ms"], "tokens_per_s": W * B * T / (last["model_step_ms"] / 1e3),
               "fits": last.get("fits")}
        rows.append(row)
        log("one node, 3B: %-7s (%s %s)  peak %.2f GiB  modelled step %.1f ms  %.0f tokens/s" % (
            name, st.dir, row["flags"], row["peak_bytes_rank0"] / GIB, row["model_step_ms"], row["tokens_per_s"]))
    return {"world": W, "batch": B, "seq_len": T, "flags": " ".join(str(x) for x in ["--ac"] + H100),
            "model_flags": " ".join(str(x) for x in LLAMA32_3B), "rows": rows, "quote": MLX_QUOTE}


def _count(r, kind):
    return r["collectives"].get(kind, {}).get("count", 0)


def _units(r):
    """'8 (1 module each)', '4 (2, 2, 2, 2)' or '–' for a per-parameter run."""
    u = r["units"]
    if not u:
        return "– (per parameter)"
    sizes = [len(x) for x in u]
    if len(u) == 1:
        return "1 (all %d modules)" % sizes[0]
    if len(set(sizes)) == 1:
        return "%d (%d module%s each)" % (len(u), sizes[0], "s" if sizes[0] > 1 else "")
    return "%d (%s modules)" % (len(u), ", ".join(map(str, sizes)))


def flat_rows(rows, unit):
    """The cells of the flat table's rows (section 4j); the peak in `unit` bytes (MIB or GIB)."""
    base = rows[0]["model"]["model_step_ms"]
    return [(r["case"], _units(r), fmt(r["launches"]), _count(r, ALL_GATHER), _count(r, REDUCE_SCATTER),
             _count(r, ALL_REDUCE), "%.3f" % r["model"]["exposed_comm_ms"], "%.2f" % (r["peak_bytes"] / unit),
             "%.3f (%+.2f %%)" % (r["model"]["model_step_ms"], 100 * (r["model"]["model_step_ms"] / base - 1)))
            for r in rows]


def flat_header(unit):
    return ["case", "flat units", "launches/step", "all-gathers/step", "reduce-scatters/step", "all-reduces/step",
            "modelled exposed comm ms", "peak %s (largest rank)" % ("GiB" if unit == GIB else "MiB"),
            "modelled step ms (vs per-parameter)"]


def ratio(x, key):
    """ZeRO-2's figure over DDP's in the one-node rows (section 4k)."""
    by = {r["case"]: r[key] for r in x["rows"]}
    return by["ZeRO-2"] / by["DDP"]


def one_node_rows(x):
    """The cells of the one-node table's rows (section 4k), each against DDP's."""
    d = next(r for r in x["rows"] if r["case"] == "DDP")
    return [(r["case"], "%s %s" % (r["stage"], r["flags"]), "%.2f (%.2f× DDP)" % (
                r["peak_bytes_rank0"] / GIB, r["peak_bytes_rank0"] / d["peak_bytes_rank0"]),
             "%s (%.3f× DDP)" % (fmt(r["tokens_per_s"]), r["tokens_per_s"] / d["tokens_per_s"]),
             "%.1f" % r["model_step_ms"]) for r in x["rows"]]


def render(L, R):
    """Append sections 4j and 4k to the report lines L."""
    x = R.get("flat", {})
    if not x or "skipped" in x:
        return
    s = x["small"]
    intro = ("Stage 07's solution (per-parameter FSDP2: each parameter sharded on dim 0, copy-in, copy-out and "
             "chunk-cat as batched launches) against stage 13's (a flat buffer per unit: the all-gather's output is "
             "the params' storage, the flat gradient the reduce-scatter's input), both with --grad-accum 2 "
             "--grad-sync last. Rank 0's last step in its trace: launches (kernels, copies, memsets and collectives "
             "it enqueued on its streams), collectives by kind (the all-reduce is the grad norm's), exposed "
             "communication (its compute stream's time in collectives and waits, modelled clock); the peak is the "
             "largest rank's over the steps (metrics.jsonl), the modelled step the last one's.")
    section(L, "4j. Flat parameters and buckets (%s, %s, world %d, batch %d × seq %d per rank, link %s, %d steps)" % (
                " vs ".join(x["solutions"]), s["flavor"], s["world"], s["batch"], s["seq"], s["link"], s["steps"]),
            intro + " The model holds %.2f MiB of float32 params." % (4 * s["rows"][0]["n_params"] / MIB),
            flat_header(MIB), flat_rows(s["rows"], MIB))
    e = x.get("llama3_8b", {})
    if e and "skipped" not in e:
        L.append("**Llama 3 8B on %d modelled H100s** (%d nodes of 8, dry run: priced, not computed; batch %d × seq %d "
                 "per rank, `%s`; %.2f GiB of float32 params):" % (
                     e["world"], e["world"] // 8, e["batch"], e["seq"], e["flags"], 4 * e["rows"][0]["n_params"] / GIB))
        L.append("")
        table(L, flat_header(GIB), flat_rows(e["rows"], GIB))
        L.append("")
    L.append("A flat unit needs no copy-in, copy-out or chunk-cat (its params and grads are views of the buffers "
             "the collectives read and write), so it launches fewer ops per step with the same number of "
             "collectives. A bucket merges modules until they hold at least B MiB of float32 params: fewer, "
             "larger all-gathers and reduce-scatters (each pays its latency once), at the price of a larger "
             "unsharded unit alive at once (the peak) and of compute that waits for the whole bucket's all-gather "
             "(exposed communication). Where every module holds more than B MiB already, a bucket changes nothing (the "
             "units column); where the whole model holds less, one unit takes it all: hence a row with a bucket of "
             "about two of the model's modules in each table.")
    L.append("")
    o = x.get("one_node", {})
    if o and "skipped" not in o:
        q = o["quote"]
        n = o["rows"][0]["n_params"]
        section(L, "4k. One node, a 3B model: DDP, ZeRO-2 and FSDP (the MLX-style row)",
                "Llama 3.2 3B's shape (`%s`: %.2fB params, the output not tied to the embedding) on %d modelled "
                "H100s, batch %d × seq %d per GPU, float32 params, grads and AdamW state (the three stages have no "
                "mixed precision), `%s`. Peak: rank 0's over the steps; tokens/s: %d × %d tokens / the last "
                "step's modelled time." % (o["model_flags"], n / 1e9, o["world"], o["batch"], o["seq_len"], o["flags"],
                                           o["world"], o["seq_len"] * o["batch"]),
                ["layout", "solution and flags", "peak GiB per GPU", "modelled tokens/s (node)", "modelled step ms"],
                one_node_rows(o),
                "What one real system measured, quoted, not a target and not fitted: a review of MLX's FSDP ran "
                "FSDP without sharding the model (ZeRO-2-like) against DDP for a %s model on %d GPUs: %s vs %s "
                "tokens/s and %d vs %d GB peak (%.3f× and %.2f× DDP). Their model size, precision, batch and hardware "
                "differ from ours or are unknown to us, their ZeRO-2-like layout keeps the whole model on every GPU "
                "where ours (FSDP2's reshard_after_forward=False) shards it between steps, and our figures are "
                "modelled (dry runs priced on the h100-sxm profile): compare the ratios, not the figures. Ours: "
                "ZeRO-2 at %.3f× DDP's tokens/s and %.2f× its peak." % (
                    q["model"], q["gpus"], fmt(q["zero2_tokens_per_s"]), fmt(q["ddp_tokens_per_s"]), q["zero2_peak_gb"],
                    q["ddp_peak_gb"], q["zero2_tokens_per_s"] / q["ddp_tokens_per_s"],
                    q["zero2_peak_gb"] / q["ddp_peak_gb"], ratio(o, "tokens_per_s"), ratio(o, "peak_bytes_rank0")))
