#!/usr/bin/env python3
"""Benchmarks of the hwFSDP runtime, measured side by side in one run (make bench).

    tools/bench.py [--quick] [--out results] [--device-profile NAME] [--only SECTION ...]

Sections (results/bench.json, results/bench.md, and a table on stdout):
  sgemm       the machine's OpenBLAS fp32 rate (tools/bench_sgemm.c, n=2048, 2 threads, best of 5)
  throughput  one rank, fp32, 2 threads: build/baseline/train and solution 04 at --world 1
              vs tools/torch_llama.py (same init, data, optimizer); tokens/s and model FLOP/s
  scaling     solution 04 at world 1, 2, 4 on tiny and debugmodel, same global batch
  overlap     the solutions of every training stage but activation checkpointing at world 4 and 2,
              at the device profile's link: the step on the modelled clock, its exposed
              communication (by phase) and kernel FLOPs / (step x peak), beside the wall-clock step and tokens/s
  memory      peak bytes per rank of every stage's solution next to an analytic model of the sizes
  accum       gradient accumulation (stage 07): K = 1, 2, 4, sync every / last / params kept: peak,
              what lives between microbatches, collectives and bytes per step, modelled and wall step
  hsdp        stage 09 on 2 nodes of 2 ranks, the link between nodes 10x slower: FSDP over the world vs
              HSDP (shard in a node, all-reduce across) vs DDP; bytes on each link, the link model's time
              for them, param shards, peak, modelled exposed comm and step, and the losses (which must agree)
  prefetch    backward prefetch pre / post / none, two comm streams or one (stage 10): peak, backward
              high-water, modelled exposed comm and step on a slow link
  offload     CPU offload (stage 10) off, and on over a fast and a slow PCIe model: device and host
              peaks, host-device copies per step, modelled exposed comm and step
  pipeline    pipeline parallelism (stages 11, 12): the bubble against the number of microbatches for
              GPipe and 1F1B beside (P-1)/(M+P-1), the first stage's activations; PP x FSDP against FSDP
              on two links (a slow link between nodes); the same at Llama 3 8B on 16 modelled H100s (dry run)
  grading     wall time of `make grade SOLUTIONS=1`
  profile     where a baseline step spends its compute-stream time, wall and modelled (the runtime's trace)

Two clocks. Modelled figures (model_step_ms, the trace's ts/dur) come from program order priced on a
device profile (common/runtime/profile.c; --device-profile, default teach): exact, one number per
configuration, so the bench takes the last step's and prints no spread. Wall-clock figures (step_ms,
tokens/s) are medians over steps (warm-up skipped) with min and max; they hold no link or PCIe time.
The bench never fails on noise: it exits 0 unless a binary fails. --quick (tiny flavour, few steps,
torch skipped when absent) is the smoke test's mode (tests/test_bench.py). --only runs the named sections that
stand alone (ALONE below) and writes their figures and tables to bench-<names>.json and .md, leaving bench.json be.

The work is done by tools/benchlib/ (measure, memory_model, report); the stages come from
grader/manifest.py.
"""
import argparse
import json
import os
import sys
import time

from benchlib import advanced, flat, measure, pipeline, report
from benchlib.measure import BASELINE, ROOT, Bench, BinaryFailed, manifest


# The sections that need no other section's figures and render on their own: what --only can run.
ALONE = {"prefetch": advanced.section_prefetch, "offload": advanced.section_offload,
         "pipeline": pipeline.section_pipeline, "flat": flat.section_flat}


def write_json(R, out, name="bench.json"):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as fh:
        json.dump(R, fh, indent=1)


def run_only(bench, cfg, names, out):
    """--only: the named sections of ALONE, their figures in out/bench-<names>.json and tables in .md."""
    t0 = time.perf_counter()
    R = {"quick": cfg["quick"], "only": names, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": cfg}
    stem = "bench-" + "-".join(names)
    try:
        for name in names:
            R[name] = ALONE[name](bench, cfg)
    except BinaryFailed as e:
        print("error: " + str(e), file=sys.stderr)
        R["failures"] = bench.failures
        write_json(R, out, stem + ".json")
        return 1
    R["total_s"] = time.perf_counter() - t0
    write_json(R, out, stem + ".json")
    md = report.markdown_only(R)
    with open(os.path.join(out, stem + ".md"), "w") as fh:
        fh.write(md + "\n")
    print()
    print(md)
    print("wrote %s.json and .md (%.0f s)" % (os.path.relpath(os.path.join(out, stem), ROOT), R["total_s"]))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny flavour, few steps (the smoke test's mode, < 40 s)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results"), help="where bench.json and bench.md go")
    ap.add_argument("--work", help="scratch run directories (default build/bench)")
    ap.add_argument("--device-profile", help="price every training run on this device profile (the runtime's "
                    "--device-profile: teach, a100-80g, h100-sxm; default: the runtime's, teach)")
    ap.add_argument("--only", nargs="+", choices=sorted(ALONE), metavar="SECTION",
                    help="run only these sections (%s) into bench-<names>.json/.md" % ", ".join(sorted(ALONE)))
    args = ap.parse_args(argv)
    bench = Bench(args.work, args.device_profile)
    for b in [BASELINE] + [bench.solution(st) for st in manifest.stages()]:
        if not os.path.exists(b):
            print("error: %s is missing: run `make` first (make bench does)" % os.path.relpath(b, ROOT), file=sys.stderr)
            return 1
    cfg = measure.configs(args.quick)
    if args.only:
        return run_only(bench, cfg, args.only, args.out)
    t0 = time.perf_counter()
    R = {"quick": args.quick, "host": os.uname().nodename, "cores": os.cpu_count(),
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": cfg}
    try:
        R["sgemm"] = measure.section_sgemm(bench, cfg)
        R["throughput"] = measure.section_throughput(bench, cfg, R["sgemm"])
        R["scaling"] = measure.section_scaling(bench, cfg)
        for i, W in enumerate(cfg["ov_worlds"]):  # the first world's is the overlap target's
            R["overlap" if i == 0 else "overlap_world%d" % W] = measure.section_overlap(bench, cfg, W)
        R["device_profile"] = R["overlap"]["device_profile"]  # what the modelled figures were priced on
        R["memory"] = measure.section_memory(bench, cfg)
        R["accum"] = measure.section_accum(bench, cfg)
        R["mixed_precision"] = measure.section_mixed_precision(bench, cfg)
        R["hsdp"] = measure.section_hsdp(bench, cfg)
        R["prefetch"] = advanced.section_prefetch(bench, cfg)
        R["offload"] = advanced.section_offload(bench, cfg)
        R["pipeline"] = pipeline.section_pipeline(bench, cfg)
        R["flat"] = flat.section_flat(bench, cfg)
        R["profile"] = measure.section_profile(bench, cfg)
        R["grading"] = measure.section_grading(bench, cfg)
    except BinaryFailed as e:
        print("error: " + str(e), file=sys.stderr)
        R["failures"] = bench.failures
        write_json(R, args.out)  # what was measured before the failure
        return 1
    R["total_s"] = time.perf_counter() - t0
    R["targets"] = report.targets(R)
    write_json(R, args.out)
    md = report.markdown(R)
    with open(os.path.join(args.out, "bench.md"), "w") as fh:
        fh.write(md + "\n")
    print()
    print(md.split("\n### Optimisation opportunities")[0])
    print("wrote %s and %s (%.0f s)" % (os.path.relpath(os.path.join(args.out, "bench.json"), ROOT),
                                        os.path.relpath(os.path.join(args.out, "bench.md"), ROOT), R["total_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
