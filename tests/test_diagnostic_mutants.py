"""Wrong hw_fsdp.c files stopped by the runtime's diagnostics, with the same sentence every time.

Student bugs taken from tests/mutants/mutants.json (each a text edit of a solution):
a compute stream that copies out of the all-gather buffer without waiting on the all-gather's
event (race detector), a prefetch buffer freed before compute copies out of it (use after free),
a backward prefetch turned the wrong way (the race it causes), and ranks whose collectives disagree
(desync check). Each is built once and run 20 times as the grader runs
the stage whose solution the mutant edits (grading_command: gradelib.rubric.stage_flags, the rubric's config with
the stage's overrides and its own flags, then --out and --quiet, the command grader/gradelib/runner.py runs); the
verdict is decided in host enqueue order, so all 20 stderr texts must be the same single line, whatever the
thread timing, and so must the partial record the reporting rank leaves (the same bytes).

Then the sentences that name a bug's cause, each from a mutant run once the same way: who freed the params the
backward finds missing, and what the params check finds in a Param's rows instead of its shard; and a --forward-only
run, whose grad norm is said to be not computed rather than nan.
"""
import json
import os
import re
import shutil
import subprocess

import pytest

import manifest
from gradelib.rubric import load_rubric, stage_flags
from helpers import CORPUS, ROOT, apply_mutant

with open(os.path.join(ROOT, "tests", "mutants", "mutants.json")) as _fh:
    MUTANTS = {m["name"]: m for m in json.load(_fh)["mutants"]}

RUNS = 20
CASES = {
    "missing_wait_before_copy_out": re.escape(
        "error: race on rank 0: compute stream's 'embedding.copy_out' reads 'embedding.all_gather_buffer' (comm_buffer, "
        "allocated in embedding.pre_forward) written by all_gather stream's 'embedding.all_gather' with no event "
        "wait ordering it (record an event on all_gather after the write and make compute wait for it)"),
    "free_prefetch_buffer_before_copy_out": re.escape(
        "error: use after free on rank 0: compute stream's 'embedding.copy_out' reads 'embedding.all_gather_buffer' "
        "(comm_buffer, allocated in embedding.pre_forward, freed in embedding.pre_forward) after its dev_free (free "
        "a buffer only after enqueuing the last op that uses it)"),
    # rank 0 skips block0's all-gather, so its third collective is the head's while the others gather block1
    "deadlock_rank0_skips_an_all_gather": re.escape(
        "error: collective mismatch on stream 'compute' #2: rank 0 all_gather 4176 f32 (head); "
        "rank 1 all_gather 12320 f32 (block1); rank 2 all_gather 12320 f32 (block1); "
        "rank 3 all_gather 12320 f32 (block1)"),
    # unpadded shards: rank 3 holds fewer embedding rows than the others
    "no_padding": r"error: collective mismatch on stream 'compute' #0: (rank [012] all_gather (\d+) f32 \(embedding\); )"
                  r"{3}rank 3 all_gather (?!\2)\d+ f32 \(embedding\)",
    # a backward prefetch turned the wrong way: the race it causes stops the run; the partial record it leaves is
    # what names the direction (the grader's prefetch schedule check)
    "backward_prefetches_the_module_just_done": re.escape(
        "error: race on rank 0: compute stream's 'optimizer.adamw' writes 'layers.0.attention_norm.weight' "
        "(param_shard, allocated in fsdp.init) while all_gather stream's 'embedding.copy_in' may still read it: no "
        "event wait orders the read before the write (record an event on all_gather after the read and make compute "
        "wait for it)"),
}
# The cases whose error the reporting rank's host thread decides (the race detector, lowest rank first): each
# leaves that rank's partial record (runtime.h, dev_record_partial), the same bytes on every run. (A collective
# mismatch is found by a stream worker, which leaves none.)
PARTIAL = {"missing_wait_before_copy_out": "partial_rank0.json", "free_prefetch_buffer_before_copy_out":
           "partial_rank0.json", "backward_prefetches_the_module_just_done": "partial_rank0.json"}


def grading_command(name, binary, run_dir):
    """The grader's command for the stage whose solution mutant `name` edits (its "base": solutions/<stage dir>/):
    runner.run's [binary] + stage_flags + --out, --quiet (the data: the default, data/corpus.txt from ROOT)."""
    stage = manifest.stage(os.path.basename(os.path.dirname(MUTANTS[name]["base"])))
    return [binary] + stage_flags(load_rubric(), stage.id) + ["--out", str(run_dir), "--quiet"]


def build_mutant(name, tmp_path):
    src = apply_mutant(MUTANTS[name], str(tmp_path / "hw_fsdp.c"))
    binary = tmp_path / "train"
    p = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=%s" % src, "OUT=%s" % binary],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return str(binary)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mutant_stopped_with_the_same_sentence_every_run(name, tmp_path):
    binary = build_mutant(name, tmp_path)
    cmd = grading_command(name, binary, tmp_path / "run")
    verdicts, records = [], set()
    for _ in range(RUNS):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr[-2000:])
        verdicts.append(p.stderr)
        left = sorted(f for f in os.listdir(tmp_path / "run") if f.startswith("partial_rank"))
        assert left == ([PARTIAL[name]] if name in PARTIAL else []), left
        for f in left:
            with open(tmp_path / "run" / f, "rb") as fh:
                records.add(fh.read())
    assert len(set(verdicts)) == 1, "verdicts differ between runs:\n" + "\n".join(sorted(set(verdicts)))
    assert len(records) <= 1, "the partial records differ between runs"
    if name in PARTIAL:
        record = json.loads(records.pop())
        assert record["partial"] is True and "error: " + record["error"] == verdicts[0].strip(), record["error"]
    lines = verdicts[0].strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n" + verdicts[0]
    assert re.fullmatch(CASES[name], lines[0]), lines[0]


# The sentences that name a bug's cause, once each (one run: which rank reports first may vary, so a rank the
# bug does not pin is matched by pattern): who freed the params the backward finds missing (the allocator's
# event log), and what the params check finds in the rows instead of the shard.
MESSAGES = {
    "recompute_reshards_before_backward": re.escape(
        "error: block1: layers.1.attention_norm.weight has no unsharded data for the backward (Param.data is NULL): "
        "its unsharded buffer 'layers.1.attention_norm.weight' was freed in block1's fsdp_post_forward during the "
        "backward's recompute, after fsdp_pre_backward, and nothing gathered it again"),
    "pre_backward_does_not_all_gather": re.escape(
        "error: head: norm.weight has no unsharded data for the backward (Param.data is NULL): its unsharded buffer "
        "'norm.weight' was freed in head's fsdp_post_forward during the forward, and fsdp_pre_backward did not "
        "all-gather it again"),
    "copy_out_skips_the_last_rank": re.escape(
        "error: params check on rank 3: before embedding's compute (after its pre_forward, step 1), rows [195, 259) "
        "of tok_embeddings.weight's Param.data should hold this rank's current shard; they hold NaN in 4096 of their "
        "4096 values, which were never written (fresh memory is NaN-filled): the copy-out did not reach these rows, "
        "or compute read them before the all-gather filled them"),
    "copy_out_of_one_param_from_its_neighbours_segment": (r"error: params check on rank \d: before block0's "
        r"compute \(after its pre_forward, step 1\), rows \[\d+, \d+\) of layers\.0\.attention\.wv\.weight's "
        + re.escape("Param.data should hold this rank's current shard; they hold layers.0.attention.wk.weight's "
                    "shard instead: the copy-out took another param's segment (a wrong offset in the flat buffer, "
                    "or another module's all-gather output)")),
    "copy_out_from_the_first_params_segment": (r"error: params check on rank \d: before block0's compute "
        r"\(after its pre_forward, step 1\), rows \[\d+, \d+\) of layers\.0\.attention\.wq\.weight's "
        + re.escape("Param.data should hold this rank's current shard; they hold other values: the copy-out's "
                    "offsets or counts are wrong (rank r's rows of param j start at r x S + offset(j) of the "
                    "all-gather output)")),
    "params_not_freed_after_backward": (r"error: params check on rank \d: before embedding's compute \(after "
        r"its pre_forward, step 2\), rows \[\d+, \d+\) of tok_embeddings\.weight's "
        + re.escape("Param.data should hold this rank's current shard; they hold last step's shard, stale values "
                    "from before the optimizer's update (params kept from the last step instead of resharded after "
                    "backward and gathered again, or an all-gather that read the shards before the optimizer wrote "
                    "them)")),
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_mutant_stopped_with_its_cause_in_one_sentence(name, tmp_path):
    binary = build_mutant(name, tmp_path)
    pattern = MESSAGES[name]
    p = subprocess.run(grading_command(name, binary, tmp_path / "run"), capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n" + p.stderr
    assert re.fullmatch(pattern, lines[0]), lines[0]


def test_forward_only_says_the_grad_norm_was_not_computed(tmp_path):
    """--forward-only runs no backward: its step lines say the grad norm was not computed, never nan, and
    metrics.jsonl has it null without marking the step bad."""
    from helpers import metrics, solution_bin
    p = subprocess.run([solution_bin("01"), "--forward-only", "--world", "4", "--steps", "2", "--data", CORPUS,
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    steps = [l for l in p.stdout.splitlines() if l.startswith("step:")]
    assert len(steps) == 2 and all("  grad_norm: not computed (--forward-only)  memory: " in l for l in steps), steps
    assert "nan" not in p.stdout.lower()
    rows = metrics(tmp_path / "run")
    assert [r["grad_norm"] for r in rows] == [None, None] and not any("nan" in r for r in rows), rows
