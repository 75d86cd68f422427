"""Wrong hw_fsdp.c files stopped by the runtime's diagnostics, with the same sentence every time.

Three student bugs taken from tests/mutants/mutants.json (each a text edit of a solution):
a compute stream that copies out of the all-gather buffer without waiting on the all-gather's
event (race detector), a prefetch buffer freed before compute copies out of it (use after free),
and ranks whose collectives disagree (desync check). Each is built once and run 20 times at the
grading config; the verdict is decided in host enqueue order, so all 20 stderr texts must be the
same single line, whatever the thread timing.
"""
import json
import os
import re
import subprocess

import pytest

from helpers import CORPUS, ROOT, apply_mutant

with open(os.path.join(ROOT, "tests", "mutants", "mutants.json")) as _fh:
    MUTANTS = {m["name"]: m for m in json.load(_fh)["mutants"]}
with open(os.path.join(ROOT, "grader", "rubric.json")) as _fh:
    CONFIG = json.load(_fh)["config"]

RUNS = 20
CASES = {
    "missing_wait_before_copy_out": re.escape(
        "error: race on rank 0: compute stream's 'embedding.copy' reads 'embedding.all_gather_buffer' (comm_buffer, "
        "allocated in embedding.pre_forward) written by all_gather stream's 'embedding.all_gather' with no event "
        "wait ordering it (record an event on all_gather after the write and make compute wait for it)"),
    "free_prefetch_buffer_before_copy_out": re.escape(
        "error: use after free on rank 0: compute stream's 'embedding.copy' reads 'embedding.all_gather_buffer' "
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
}


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
    cmd = [binary, "--quiet", "--data", CORPUS, "--out", str(tmp_path / "run"),
           "--flavor", CONFIG["flavor"], "--world", str(CONFIG["world"]), "--seq-len", str(CONFIG["seq_len"]),
           "--batch-size", str(CONFIG["batch_size"]), "--steps", str(CONFIG["steps"]),
           "--link-gbps", str(CONFIG["link_gbps"]), "--link-latency-us", str(CONFIG["link_latency_us"])]
    verdicts = []
    for _ in range(RUNS):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr[-2000:])
        verdicts.append(p.stderr)
    assert len(set(verdicts)) == 1, "verdicts differ between runs:\n" + "\n".join(sorted(set(verdicts)))
    lines = verdicts[0].strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n" + verdicts[0]
    assert re.fullmatch(CASES[name], lines[0]), lines[0]
