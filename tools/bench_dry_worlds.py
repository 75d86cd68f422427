#!/usr/bin/env python3
"""bench_dry_worlds.py — what a dry run of a large world costs this machine: wall time and peak memory.

    tools/bench_dry_worlds.py [--out DIR] [--stage 08] [--case 70B:512] [--case 8B:16384]

Each case is stage 08's solution (FSDP2 with bf16 params, full activation checkpointing) on h100-sxm, 8 GPUs a
node, local batch 1 x 8192, two steps: Llama 3 70B on 512 ranks and Llama 3 8B on 16,384 by default (issue 48's
budget: 70B at 512 ranks within 2 minutes and 4 GiB on 2 cores; 16,384 ranks in minutes). Above 64 ranks train
executes one representative rank per class of symmetric ranks (train --dry-run-ranks; runtime.h:
WorldConfig.rep_stride), so its cost is a few ranks' whatever the world.

Two figures per case, each the process tree's wall time and peak resident memory (wait4's rusage: the largest
of the process and its children):
  train       the train binary alone, with tools/simulate.py's command (simulate.dry_run_cmd)
  simulate    the whole tool, `tools/simulate.py --solutions ...`: train, the report, the plots
The modelled figures (step time, tokens/s/GPU, memory per rank) are the report's. Nothing is asserted: the
tests (tests/test_represent.py) check that these worlds run; this says what they cost.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from repo_paths import ROOT

import manifest
import simulate

FLAGS = ["--ac", "--param-dtype", "bf16"]
BATCH, SEQ, STEPS, PROFILE = 1, 8192, 2, "h100-sxm"


def measure(cmd):
    """(wall s, peak RSS bytes, exit status) of cmd and its children."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if p.returncode not in (0, simulate.EXIT_OVER_CAPACITY):
        sys.exit("bench_dry_worlds.py: %s failed (%d): %s" % (" ".join(cmd[:8]), p.returncode, err.strip()[-500:]))
    return wall, usage.ru_maxrss * 1024, p.returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="08")
    ap.add_argument("--case", action="append", help="FLAVOR:WORLD (default 70B:512 and 8B:16384)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_dry_worlds"))
    a = ap.parse_args(argv)
    stage = manifest.stage(a.stage)
    exe = simulate.binary(stage, True)
    rows = []
    for case in a.case or ["70B:512", "8B:16384"]:
        flavor, world = case.split(":")
        world = int(world)
        out = os.path.join(a.out, "%s-w%d" % (flavor, world))
        cmd = simulate.dry_run_cmd(exe, stage, flavor, world, PROFILE, BATCH, SEQ, STEPS, FLAGS, out + "-train")
        os.makedirs(out + "-train", exist_ok=True)
        print("dry run: stage %s, %s, world %d ..." % (stage.id, flavor, world), flush=True)
        t_wall, t_rss, _ = measure(cmd)
        sim = [sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--solutions", "--stage", stage.id,
               "--flavor", flavor, "--world", str(world), "--profile", PROFILE, "--batch", str(BATCH), "--seq",
               str(SEQ), "--steps", str(STEPS), "--flags=" + " ".join(FLAGS), "--out", out]
        s_wall, s_rss, _ = measure(sim)
        with open(os.path.join(out, "report.json")) as fh:
            r = json.load(fh)
        with open(os.path.join(out, "run.json")) as fh:
            executed = json.load(fh).get("executed_ranks")
        rows.append({"flavor": flavor, "world": world, "executed_ranks": executed, "train_wall_s": t_wall,
                     "train_peak_rss_bytes": t_rss, "simulate_wall_s": s_wall, "simulate_peak_rss_bytes": s_rss,
                     "model_step_ms": r["model_step_ms"], "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                     "steady_peak_bytes": r["steady_peak_bytes"], "fits": r["fits"]})
    L = ["| model | world | executed ranks | train: wall, peak RSS | simulate.py: wall, peak RSS | modelled step "
         "| tokens/s/GPU | memory/rank |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ex = r["executed_ranks"] or []
        L.append("| %s | %d | %s | %.1f s, %.0f MiB | %.1f s, %.0f MiB | %.0f ms | %.0f | %.2f GiB%s |" % (
            simulate.model_name(r["flavor"]), r["world"], ", ".join(map(str, ex[:4])) + (", ..." if len(ex) > 4 else ""),
            r["train_wall_s"], r["train_peak_rss_bytes"] / 2 ** 20, r["simulate_wall_s"],
            r["simulate_peak_rss_bytes"] / 2 ** 20, r["model_step_ms"], r["tokens_per_s_per_gpu"],
            r["steady_peak_bytes"] / 2 ** 30, "" if r["fits"] is not False else " (does not fit)"))
    print("\n".join(L))
    with open(os.path.join(a.out, "bench_dry_worlds.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
