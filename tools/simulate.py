#!/usr/bin/env python3
"""simulate.py — a stage's own hooks on a modelled GPU cluster (a dry run: train --dry-run).

    tools/simulate.py --stage 04 --flavor 8B --world 8 --profile h100-sxm [--flags="--ac --param-dtype bf16"]
    tools/simulate.py --stage 08 --flavor 8B --sweep 8,16,32,64 --flags="--ac --param-dtype bf16"
    tools/simulate.py --compare            the dry runs of torchtitan's published FSDP2 configurations, side by side

The driver, the model's schedule and the stage's hw_fsdp.c run as in training; every kernel, copy and
collective is priced on the device profile's modelled clock and executed nowhere; every allocation is
counted as in a real run, with no memory behind it. The report (printed, and report.md / report.json in
the run directory) reads what the run wrote:
  modelled step time         metrics.jsonl model_step_ms of the last step (the max over ranks)
  tokens/s per GPU           local batch x sequence / that step time (with --pp P: a data shard's batch / P)
  MFU                        torchtitan's formula: (6 x non-embedding params + 12 x layers x heads x
                             head_dim x seq) FLOPs per token x tokens/s/GPU / the profile's dense BF16 peak,
                             whatever the run's math was (as torchtitan quotes it)
  memory per rank            rank 0's peak from step 2 on (torchtitan reads memory there), by tag, from the
                             memory snapshot; and the peak at init (the full model fsdp_init receives)
  exposed communication      rank 0's compute stream in collectives and waits, by phase (the trace)
  device memory              the profile's HBM capacity (run.json hbm_capacity_bytes) and whether every rank's
                             allocations of every step stayed within it (run.json fits); a configuration that does
                             not fit is marked so in the title, the table and --compare's table, with the run's
                             out-of-memory line (train exits 5 then, every file written: driver/step_log.h)
and draws the timeline and memory plots (tools/plots.py). --sweep draws tokens/s/GPU and memory against
the world size (sweep.png). By default STAGE is your stages/NN (build/stages/NN_*/train); --solutions takes
the instructors' solution. Ranks >= 1 record no trace (--trace-ranks 1): FSDP's ranks are symmetric and a
64-rank trace is gigabytes. Above 64 ranks (up to 16,384) train executes one representative rank per class of
symmetric ranks (rank 0; with --pp each stage's first) and prices every collective on its full group
(train --dry-run-ranks; run.json "executed_ranks"): a 70B step at 512 ranks takes seconds.
"""
import argparse
import json
import os
import re
import subprocess
import sys

from repo_paths import ROOT

import manifest
from benchlib.memory_model import flops_per_token, model_dims, n_params, replay_peak
from benchlib.traces import step_on_model_clock
from gradelib.trace_model import RunDir
import trace_names as tn

BUILD = os.environ.get("HWFSDP_BUILD", os.path.join(ROOT, "build"))
GIB = 1024.0 ** 3

# torchtitan's published FSDP2 figures (tokens/s/GPU; memory GiB; MFU %), each with its configuration and source.
# The A100 rows' MFU counted the embedding in the parameters (torchtitan fixed its formula a week later);
# the H100 rows ran on Grand Teton H100s: HBM2e at 2.4 TB/s and 500 W, below the SXM5 datasheet's profile.
TORCHTITAN = [
    {"row": "8B, 8 H100, FSDP", "flavor": "8B", "world": 8, "profile": "h100-sxm", "batch": 2, "seq": 8192,
     "ac": "selective (per op)", "precision": "bf16 params, fp32 reduce", "compile": False, "tps": 5762,
     "memory_gib": 82.4, "mfu": None,
     "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1 (docs/performance.md, 2025-01)"},
    {"row": "8B, 8 H100, FSDP + torch.compile", "flavor": "8B", "world": 8, "profile": "h100-sxm", "batch": 2,
     "seq": 8192, "ac": "selective (per op)", "precision": "bf16 params, fp32 reduce", "compile": True, "tps": 6667,
     "memory_gib": 77.0, "mfu": None, "source": "the same table"},
    {"row": "8B, 64 A100, FSDP", "flavor": "8B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 8192,
     "ac": "selective (per op)", "precision": "bf16 params, fp32 reduce", "compile": False, "tps": 2973,
     "memory_gib": None, "mfu": 58.2, "source": "torchtitan docs/performance.md (2024-04, commit 1ea476e9)"},
    {"row": "70B, 64 A100, FSDP", "flavor": "70B", "world": 64, "profile": "a100-80g", "batch": 1, "seq": 8192,
     "ac": "full", "precision": "bf16 params, fp32 reduce", "compile": False, "tps": 331, "memory_gib": None,
     "mfu": 51.7, "source": "the same table"},
]
# our side of every row: stage 08's solution (FSDP2's MixedPrecisionPolicy) with the row's own activation
# checkpointing (torchtitan's per-op selective AC is --ac-op, full is --ac)
COMPARE_STAGE, COMPARE_FLAGS = "08", ["--param-dtype", "bf16"]
AC_FLAG = {"selective (per op)": "--ac-op", "full": "--ac"}


def model_name(flavor):
    """What a flavour is, for titles: the published models by name and release ("Llama 3 8B": the flavours 8B
    and 70B are Llama 3's; "Llama 2 7B", "Llama 3.1 405B" for llama2-7B, llama3.1-405B), this project's own
    (tiny, debugmodel, 1B) as flavours."""
    m = re.fullmatch(r"llama(\d+(?:\.\d+)?)-(\d+B)", flavor)
    if m:
        return "Llama %s %s" % m.groups()
    if flavor in ("8B", "70B"):
        return "Llama 3 %s" % flavor
    return "the %s flavour" % flavor


def fail(msg):
    print("simulate.py: " + msg, file=sys.stderr)
    sys.exit(2)


def binary(stage, solutions):
    path = os.path.join(BUILD, "solutions" if solutions else "stages", stage.dir, "train")
    if not os.access(path, os.X_OK):
        fail("%s is not built (run make first)" % path)
    return path


GPUS_PER_NODE = 8  # a DGX / HGX node: NVLink inside, the profile's InfiniBand between nodes


EXIT_OVER_CAPACITY = 5  # train's exit status when a rank went past the profile's memory (driver/step_log.h)


def dry_run_cmd(exe, stage, flavor, world, profile, batch, seq, steps, flags, out):
    """The train command of one dry run into out (above 64 ranks train executes one representative rank per
    class of symmetric ranks: --dry-run-ranks)."""
    cmd = [exe, "--dry-run", "--flavor", flavor, "--world", str(world), "--device-profile", profile,
           "--ranks-per-node", str(min(world, GPUS_PER_NODE)),
           "--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps), "--warmup-steps", "0",
           "--profile-steps", str(steps), "--trace-ranks", "1", "--quiet", "--out", out]
    return cmd + stage.flags_at(world) + list(flags)


def dry_run(exe, stage, flavor, world, profile, batch, seq, steps, flags, out):
    """Run one dry run into out; its report. A failed run is one line and exit status 2; one that went past the
    device's memory (exit status 5) is reported, marked as not fitting, with its out-of-memory line."""
    cmd = dry_run_cmd(exe, stage, flavor, world, profile, batch, seq, steps, flags, out)
    os.makedirs(out, exist_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode not in (0, EXIT_OVER_CAPACITY):
        last = (p.stderr.strip().splitlines() or ["exit status %d" % p.returncode])[-1]
        fail("the dry run of stage %s (%s, world %d) failed: %s" % (stage.id, flavor, world, last))
    r = report(out, stage)
    oom = [l for l in p.stderr.splitlines() if "out of device memory" in l]
    if (p.returncode == EXIT_OVER_CAPACITY) != (r["fits"] is False) or (r["fits"] is False and len(oom) != 1):
        fail("the dry run of stage %s (%s, world %d) exited %d with run.json's fits %s and %d out-of-memory lines" % (
            stage.id, flavor, world, p.returncode, r["fits"], len(oom)))
    r["over_capacity_line"] = oom[0] if oom else None
    return r


def peaks(memory_json, last_step):
    """(init peak bytes, steady peak bytes, by tag at it, where): rank 0's most bytes at init (before step 1) and
    in the last step (0-based), replaying its memory snapshot (replay_peak)."""
    steady, where, by_tag, _ = replay_peak(memory_json, last_step)
    with open(memory_json) as fh:
        init = max((e["current_bytes"] for e in json.load(fh)["events"]
                    if e.get("action") == "alloc" and e["step"] < 0), default=0)
    return init, steady, by_tag, where


def compute_by_class(events, step):
    """Rank 0's compute stream in `step` (the trace's 0-based step), ms per kind of work: each kernel class
    (args.class: matmul, attention, elementwise, the runtime's own words) and the copies and memsets."""
    out = {}
    for e in events:
        if e["pid"] != 0 or e["tid"] != tn.COMPUTE_TID or e["args"].get("step") != step:
            continue
        if e.get("cat") == tn.COMPUTE:
            what = e["args"].get(tn.KERNEL_ARGS[0])
        elif e.get("cat") in (tn.COPY, tn.MEMSET):
            what = "copies and memsets"
        else:
            continue
        if what:
            out[what] = out.get(what, 0.0) + e["dur"] / 1e3
    return out


def report(run_dir, stage):
    run = RunDir(run_dir)
    rj, metrics = run.run_json, run.metrics()
    last = metrics[-1]
    events = run.events()  # every rank's trace read once: the clock's figures, the meta and attention below
    clock = step_on_model_clock(run_dir, last["step"] - 1, last["model_step_ms"], events=events)
    dims = model_dims(rj)
    T = rj["seq_len"]
    # tokens per GPU and step: a rank's batch; with --pp P the P ranks of a data shard share its batch
    B = rj["batch_size"] / (rj.get("pp") or 1)
    step_s = last["model_step_ms"] / 1e3
    tps = B * T / step_s
    meta = run.meta
    fpt = flops_per_token(dims, T)
    init, steady, by_tag, where = peaks(os.path.join(run_dir, "memory_rank0.json"), last["step"] - 1)
    by_class = compute_by_class(events, last["step"] - 1)
    attn_ms = by_class.get(tn.COST_ATTENTION, 0.0)
    return {
        "stage": stage.id, "flavor": rj["flavor"], "world": rj["world_size"], "mesh": rj.get("mesh"),
        "device_profile": meta["device_profile"], "batch": B, "seq_len": T, "ac": rj.get("ac"),
        "param_dtype": rj.get("param_dtype"), "reduce_dtype": rj.get("reduce_dtype"),
        "reshard_after_forward": rj.get("reshard_after_forward"), "n_params": n_params(dims),
        "steps": len(metrics), "model_step_ms": last["model_step_ms"], "tokens_per_s_per_gpu": tps,
        "flops_per_token": fpt, "mfu": fpt * tps / meta["peak_flops"]["bf16"],
        "kernel_flop_utilization": clock["flop_utilization"], "matmul_math": clock["math"],
        "exposed_comm_ms_by_phase": clock["exposed_comm_ms_by_phase"], "exposed_comm_ms": clock["exposed_comm_ms"],
        "compute_ms": clock["compute_ms"], "collective_ms": clock["collective_ms"], "attention_ms": attn_ms,
        "compute_ms_by_class": by_class,
        "init_peak_bytes": init, "steady_peak_bytes": steady, "steady_peak_by_tag": by_tag, "steady_peak_at": where,
        # the profile's device memory (None: a profile with no limit, like teach) and whether the run stayed within it
        "hbm_capacity_bytes": rj.get("hbm_capacity_bytes"), "fits": rj.get("fits"),
        "run_dir": run_dir,
    }


def fit_mark(r, capacity=False):
    """What the title and the tables say of a configuration that went past the device's memory ("" if it fits,
    or the profile has no capacity); capacity: with the capacity (where the line does not state it)."""
    if r["fits"] is not False:
        return ""
    return "does not fit" + (" in %.0f GiB" % (r["hbm_capacity_bytes"] / GIB) if capacity else "")


AC_WORDS = {"none": "no activation checkpointing", "full": "full activation checkpointing",
            "every": "selective activation checkpointing (every N-th block)",
            "op": "selective activation checkpointing (per op)"}


def render(r):
    """The report as markdown lines."""
    cap = r["hbm_capacity_bytes"]
    L = ["# Dry run: stage %s, %s, %d modelled GPUs (%s%s)%s" % (
        r["stage"], model_name(r["flavor"]), r["world"], r["device_profile"],
        ", %.0f GiB each" % (cap / GIB) if cap else "", ": " + fit_mark(r) if fit_mark(r) else ""), ""]
    L.append("Local batch %d x sequence %d, %s, params %s, reduce %s%s; %s parameters. No math ran: every figure "
             "is the modelled clock's or the allocator's." % (
                 r["batch"], r["seq_len"], AC_WORDS.get(r["ac"], "activation checkpointing %s" % r["ac"]),
                 r["param_dtype"], r["reduce_dtype"], "" if r["reshard_after_forward"] in (None, True)
                 else ", no reshard after forward (ZeRO-2)", "{:,}".format(r["n_params"])))
    L += ["", "| figure | value |", "| --- | --- |",
          "| modelled step (step %d) | %.1f ms |" % (r["steps"], r["model_step_ms"]),
          "| tokens/s per GPU | %.0f |" % r["tokens_per_s_per_gpu"],
          "| MFU (torchtitan's formula: %.3g FLOPs/token against the dense BF16 peak) | %.1f%% |" % (
              r["flops_per_token"], 100 * r["mfu"]),
          "| declared kernel FLOPs / (step x the %s peak) | %.1f%% |" % (r["matmul_math"],
                                                                      100 * r["kernel_flop_utilization"]),
          "| peak memory per rank, step %d on | %.2f GiB (%s) |" % (r["steps"], r["steady_peak_bytes"] / GIB,
                                                                      r["steady_peak_at"]),
          "| peak memory at init (the full model fsdp_init receives) | %.2f GiB%s |" % (
              r["init_peak_bytes"] / GIB, " (past the device's memory, which init is not held to: torchtitan builds "
              "the model on the meta device)" if cap and r["init_peak_bytes"] > cap else "")]
    for tag, b in sorted(r["steady_peak_by_tag"].items(), key=lambda kv: -kv[1]):
        L.append("| &nbsp;&nbsp;%s at the peak | %.2f GiB |" % (tag, b / GIB))
    if cap:  # the profile's HBM: every rank's allocations of every step held to it (init is not: step_log.h)
        L.append("| device memory per GPU (%s's HBM), every rank and step | %.2f GiB: %s |" % (
            r["device_profile"], cap / GIB, "**%s**" % fit_mark(r) if fit_mark(r) else "fits"))
    ph = r["exposed_comm_ms_by_phase"]
    L.append("| exposed communication (forward / backward / other) | %.1f / %.1f / %.1f ms (%.1f%% of the step) |" % (
        ph["forward"], ph["backward"], ph["other"], 100 * r["exposed_comm_ms"] / r["model_step_ms"]))
    L.append("| compute stream busy / collectives on any stream | %.1f / %.1f ms |" % (r["compute_ms"],
                                                                                    r["collective_ms"]))
    for what, ms in sorted(r["compute_ms_by_class"].items(), key=lambda kv: -kv[1]):
        L.append("| &nbsp;&nbsp;%s on the compute stream | %.1f ms (%.1f%% of the step) |" % (
            what, ms, 100 * ms / r["model_step_ms"]))
    if r.get("over_capacity_line"):
        L += ["", "A GPU would have stopped with its out-of-memory error; the dry run went on to price the step:", "",
              "    " + r["over_capacity_line"]]
    bf16 = r["param_dtype"] == "bf16"
    L += ["", "How it was priced (common/runtime/profile.c): each kernel as it declares itself, FLOPs at its math's "
          "peak times its class's efficiency, or its bytes at 80%% of HBM bandwidth, whichever is longer. Matmuls "
          "%s at 70%% of the peak; flash attention (the causal half, no T x T tensor) in %s at 40%% (%.0f ms of this "
          "step, %.0f%% of compute); element-wise ops bandwidth-bound; activations %s; collectives on the ring "
          "model of the profile's links." % (
              r["matmul_math"], "bf16" if bf16 else "float32", r["attention_ms"],
              100 * r["attention_ms"] / max(r["compute_ms"], 1e-9),
              "in bfloat16 (2 bytes; rstd, lse and the logits the loss reads in float32)" if bf16
              else "in float32")]
    return L


def plots(run_dir, step):
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plots.py"), run_dir, "--step", str(step)],
                   capture_output=True, text=True, cwd=ROOT)


def write_report(r):
    L = render(r)
    with open(os.path.join(r["run_dir"], "report.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    with open(os.path.join(r["run_dir"], "report.json"), "w") as fh:
        json.dump(r, fh, indent=1)
    print("\n".join(L))
    print("\nrun directory: %s (report.md, plots/: timeline and memory)" % r["run_dir"])


def sweep(exe, stage, a, worlds):
    rows = []
    for w in worlds:
        out = os.path.join(a.out, "world%d" % w)
        print("dry run: stage %s, %s, world %d ..." % (stage.id, a.flavor, w), flush=True)
        rows.append(dry_run(exe, stage, a.flavor, w, a.profile, a.batch, a.seq, a.steps, a.flags.split(), out))
    L = ["# Sweep: stage %s, %s on %s, local batch %d x %d" % (stage.id, model_name(a.flavor), a.profile, a.batch,
                                                               a.seq),
         "", "| world | modelled step ms | tokens/s/GPU | MFU | peak GiB/rank | exposed comm ms |",
         "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        L.append("| %d | %.1f | %.0f | %.1f%% | %.2f%s | %.1f |" % (
            r["world"], r["model_step_ms"], r["tokens_per_s_per_gpu"], 100 * r["mfu"], r["steady_peak_bytes"] / GIB,
            " (%s)" % fit_mark(r, True) if fit_mark(r) else "", r["exposed_comm_ms"]))
    print("\n".join(L))
    with open(os.path.join(a.out, "sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(a.out, "sweep.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        print("(matplotlib missing: no sweep.png)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ws = [r["world"] for r in rows]
    ax[0].plot(ws, [r["tokens_per_s_per_gpu"] for r in rows], "o-")
    ax[0].set(xlabel="modelled GPUs (8 per node)", ylabel="tokens/s per GPU",
              title="throughput (modelled clock)")
    ax[1].plot(ws, [r["steady_peak_bytes"] / GIB for r in rows], "o-", color="C1")
    ax[1].set(xlabel="modelled GPUs (8 per node)", ylabel="GiB per rank",
              title="peak memory per rank (step 2)")
    for x in ax:
        x.set_xscale("log", base=2)
        x.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        x.set_xticks(ws, [str(w) for w in ws])
        x.set_ylim(bottom=0)
    fig.suptitle("stage %s, %s, %s, %s" % (stage.id, model_name(a.flavor), a.profile, a.flags or "no flags"))
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "sweep.png"), dpi=100)
    print("wrote %s" % os.path.join(a.out, "sweep.png"))


def compare_row(t, r):
    """The --compare table's row of torchtitan's row t against the dry run's report r (marked where it does not
    fit the profile's memory)."""
    diff = ["torch.compile"] if t["compile"] else ["-"]
    return "| %s, batch %d x %d | %d | %.0f | %s | %.1f%% | %s | %.1f GiB%s | %s |" % (
        t["row"], t["batch"], t["seq"], t["tps"], r["tokens_per_s_per_gpu"],
        "%.1f%%" % t["mfu"] if t["mfu"] else "not published", 100 * r["mfu"],
        "%.1f GiB" % t["memory_gib"] if t["memory_gib"] else "not published", r["steady_peak_bytes"] / GIB,
        ", **%s**" % fit_mark(r, True) if fit_mark(r) else "", "; ".join(diff))


def compare(a):
    stage = manifest.stage(COMPARE_STAGE)
    exe = binary(stage, True)
    L = ["| configuration | torchtitan tokens/s/GPU | dry run tokens/s/GPU | "
         "torchtitan MFU | dry run MFU | torchtitan memory | dry run memory/rank | what differs |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    rows, done = [], {}
    for t in TORCHTITAN:
        ac = AC_FLAG[t["ac"]]
        key = "%s-w%d-%s-b%d-%s" % (t["flavor"], t["world"], t["profile"], t["batch"], ac.strip("-"))
        if key not in done:  # torch.compile's row is the same dry run
            print("dry run: %s ..." % t["row"], flush=True)
            done[key] = dry_run(exe, stage, t["flavor"], t["world"], t["profile"], t["batch"], t["seq"], a.steps,
                                COMPARE_FLAGS + [ac], os.path.join(a.out, key))
            print("\n".join(render(done[key])) + "\n")
        r = done[key]
        rows.append({"torchtitan": t, "dry_run": r})
        L.append(compare_row(t, r))
    print("\n".join(L))
    with open(os.path.join(a.out, "compare.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(a.out, "compare.md"), "w") as fh:
        fh.write("\n".join(L) + "\n\nSources: " + "; ".join(sorted({t["source"] for t in TORCHTITAN})) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="04", help="stage number (default 04)")
    ap.add_argument("--solutions", action="store_true", help="the solution's hw_fsdp.c instead of stages/NN's")
    ap.add_argument("--flavor", default="8B", help="train --flavor (default 8B, Llama 3's): also 70B, llama2-7B, "
                    "llama2-13B, llama2-70B, llama3.1-8B, llama3.1-70B, llama3.1-405B, and tiny, debugmodel, 1B")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--profile", default="h100-sxm", help="device profile (train --device-profile)")
    ap.add_argument("--batch", type=int, default=1, help="local batch (sequences per rank; default 1)")
    ap.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    ap.add_argument("--steps", type=int, default=2, help="steps (default 2: the report reads the last)")
    ap.add_argument("--flags", default="", help="more train flags, one string: --flags=\"--ac --param-dtype bf16\"")
    ap.add_argument("--sweep", help="world sizes, comma-separated (e.g. 8,16,32,64): one dry run each and sweep.png")
    ap.add_argument("--compare", action="store_true", help="torchtitan's published configurations, side by side")
    ap.add_argument("--out", help="run directory (default runs/simulate/...)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be at least 2 (memory is read from step 2 on)")
    if a.compare:
        a.out = a.out or os.path.join(ROOT, "runs", "simulate", "compare")
        compare(a)
        return 0
    try:
        stage = manifest.stage(a.stage)
    except KeyError:
        fail("no stage %r (stages: %s)" % (a.stage, ", ".join(s.id for s in manifest.stages())))
    exe = binary(stage, a.solutions)
    if a.sweep:
        try:
            worlds = [int(w) for w in a.sweep.split(",")]
        except ValueError:
            fail("--sweep takes world sizes separated by commas (got %r)" % a.sweep)
        a.out = a.out or os.path.join(ROOT, "runs", "simulate", "sweep-%s-%s" % (stage.id, a.flavor))
        sweep(exe, stage, a, worlds)
        return 0
    a.out = a.out or os.path.join(ROOT, "runs", "simulate", "%s-%s-w%d-%s" % (stage.id, a.flavor, a.world, a.profile))
    r = dry_run(exe, stage, a.flavor, a.world, a.profile, a.batch, a.seq, a.steps, a.flags.split(), a.out)
    plots(a.out, a.steps)
    write_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
