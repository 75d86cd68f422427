"""The checks: one function per key of rubric.json's stages.NN.checks, declared with all the grader
knows of it: @check(key, label=..., tier=..., variants=...) registers a Check in CHECKS (registry.py).

A check takes the stage's Context and returns a detail line ("" or what it measured), or raises
CheckFailed with a one-line reason that says what is wrong and where to look. run_check runs one
and turns anything else it raises into a failed check that says so: grading never crashes.
rubric.json gives the points per stage and names checks by key, never by label.

One module per feature, imported here in the order of the stage that first grades its checks (01 up),
which is the order of CHECKS:

    registry.py         Check, CHECKS, @check, run_check
    common.py           what several features share (notes, intervals, sizes)
    parity.py           loss parity, grad norm parity, clip coefficient
    memory.py           peak memory
    sharding.py         DTensors
    lifetimes.py        params / grads freed after their hooks, memory inside hooks
    overlap.py          no host wait in a hook; the overlap measure and the five overlap checks
    prefetch.py         prefetch memory bound, prefetch schedule (stages 03, 04)
    recompute.py        activation checkpointing (stage 05)
    zero2.py            ZeRO-2 (stage 06)
    accumulation.py     gradient accumulation (stage 07)
    mixed_precision.py  mixed precision (stage 08)
    hsdp.py             the 2-D mesh (stage 09)
    offload.py          backward prefetch policy and CPU offload (stage 10)
    pipeline.py         pipeline parallelism (stages 11, 12): the schedule's checks
    flat.py             flat parameters (stage 13): params as views of the all-gather output
The measures they take of a run (overlap, the bubble, pass order, activation peaks) are gradelib.trace_model's.
"""
from .registry import CHECKS, Check, check, run_check  # first: the feature modules register into it
from . import parity, memory, sharding, lifetimes, overlap, prefetch, recompute, zero2
from . import accumulation, mixed_precision, hsdp, offload, pipeline, flat

# what the rest of the grader, the tools and the tests import from here
from .overlap import OVERLAP_CHECKS, overlap_figures, overlap_runs, overlap_transfers
from .parity import mesh_grad_norm_hint
from .prefetch import blocking_stage

__all__ = ["CHECKS", "Check", "check", "run_check", "OVERLAP_CHECKS", "overlap_figures", "overlap_runs",
           "overlap_transfers", "mesh_grad_norm_hint", "blocking_stage",
           "parity", "memory", "sharding", "lifetimes", "overlap", "prefetch", "recompute", "zero2", "accumulation",
           "mixed_precision", "hsdp", "offload", "pipeline", "flat"]
