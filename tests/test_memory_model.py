"""The analytic memory model (tools/benchlib/memory_model.py, section 4 of the bench) against
the runtime. For every stage of grader/manifest.py that has a solution, rank 0's measured
peak (metrics.jsonl, what the bench compares) and the live set at that peak by tag (replayed
from memory_rank0.json) equal the model's prediction to the byte. The model computes from
the sizes and the stage's manifest entry alone, so this tests both sides: the allocations
the solution makes and the schedule the manifest says it keeps.

A training stage peaks in its backward, where the forward prefetch no longer counts; each
one also runs --forward-only, whose peak is in the forward (prefetch, ZeRO-2's unsharded
params and AC's transient saved set there)."""
import json
import os

import pytest

from helpers import BUILD, ROOT, metrics, run_train

import manifest
from benchlib.memory_model import memory_model, model_dims, recomputes, replay_peak

pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "solutions")),
                                reason="compares the instructors' solutions/ with the model")

B, T = 2, 32
# rank 0 holds padded shards: at world 2 of the tiny flavour's 259 vocabulary rows, at
# world 3 also of its 64- and 32-row params
WORLDS = (2, 3)
# a stage with a --mesh (HSDP) runs at R*S ranks instead: shards over 2 ranks, and over 3 (padded)
MESHES = ((2, 2), (2, 3))


def accumulates(st):
    return any(f.startswith("--grad-accum") for f in st.flags)


def mixed_precision(st):
    return any(f.startswith("--param-dtype") for f in st.flags)


def with_flags(st, flags):
    return manifest.Stage(st.id, dict(st.spec, flags=flags))


def cases():
    """(stage, world, id) as the manifest has them, and each training stage forward only. A stage that
    accumulates gradients (07) is left out: the model has no microbatches; what lives between them
    is held to its analytic size by the grader (accum_grads, accum_reshard). So is a mixed-precision
    stage (08): the model's params are float32; its unsharded params are held to 2 bytes per element
    by the grader (mp_params) and to half of float32's by test_solutions. A pipeline stage (11, 12) too: a
    rank holds one stage's modules and several microbatches' activations; the grader holds each rank's
    activations to the schedule's count and its peak to the reference (pp_activations, peak_memory)."""
    for st in manifest.stages():
        if accumulates(st) or mixed_precision(st) or st.pipeline:
            continue
        if any(f.startswith("--mesh") for f in st.flags):
            plain = [f for f in st.flags if not f.startswith("--mesh")]
            runs = [(with_flags(st, plain + ["--mesh=%dx%d" % m]), m[0] * m[1], "%s+%dx%d" % (st.dir, *m))
                    for m in MESHES]
        else:
            runs = [(st, w, st.dir) for w in WORLDS]
        for s, world, sid in runs:
            yield s, world, "%s-%d" % (sid, world)
            if s.backward_prefetch != "pre" or s.offload:  # stage 10: the other policies, and offload
                for extra, tag in ((["--backward-prefetch=pre"], "+pre"), (["--backward-prefetch=none"], "+none"),
                                   (["--offload-params"], "+offload")):
                    flags = [f for f in s.flags
                             if not (extra[0].startswith("--backward") and f.startswith("--backward"))]
                    yield with_flags(s, flags + extra), world, "%s%s-%d" % (sid, tag, world)
            if not s.forward_only:
                yield with_flags(s, s.flags + ["--forward-only"]), world, "%s+forward-only-%d" % (sid, world)
            if s.ac:  # the selective modes: every 2nd block (of three), per op
                plain = [f for f in s.flags if f != "--ac"]
                for extra, tag in ((["--ac-every=2", "--n-layers=3"], "+every2"), (["--ac-op"], "+op")):
                    yield with_flags(s, plain + extra), world, "%s%s-%d" % (sid, tag, world)


CASES = list(cases())


@pytest.mark.parametrize("st,world", [(c, w) for c, w, _ in CASES], ids=[i for _, _, i in CASES])
def test_rank0_peak_is_the_model(st, world, tmp_path):
    if not os.path.exists(st.solution_src()):
        pytest.skip("no solutions/%s" % st.dir)
    binary = os.path.join(BUILD, "solutions", st.dir, "train")
    assert os.path.exists(binary), "%s is not built: run make" % os.path.relpath(binary, ROOT)
    run_train(binary, tmp_path, "--flavor", "tiny", "--world", world, "--batch-size", B, "--seq-len", T,
              "--steps", 2, "--profile-steps", 0, "--no-poison", *st.flags_at(world))
    with open(tmp_path / "run.json") as fh:
        run = json.load(fh)
    dims = model_dims(run)
    # the model restates the runtime's recompute rule: the run says which blocks it followed
    assert run["recompute_blocks"] == ["block%d" % j for j in range(dims["L"]) if recomputes(st.flags, j)]
    # the params are split over the shard group: the world, or S of a 2-D mesh (stage 09; rank 0 is chunk 0)
    model_bytes, model_at, model_tags = memory_model(dims, B, T, st.shards_at(world), st)
    measured = max(m["peak_mem_bytes_per_rank"][0] for m in metrics(tmp_path))
    _, replay_at, live, _ = replay_peak(str(tmp_path / "memory_rank0.json"))
    assert (measured, live) == (model_bytes, model_tags), (
        "%s %s at world %d: measured %d bytes at %s, the model predicts %d at %s" % (
            st.dir, " ".join(st.flags_at(world)), world, measured, replay_at, model_bytes, model_at))
