"""grader/trace_names.py, the trace's words the grader, the tools and the tests read, against what the
C runtime writes, taken from the runtime itself rather than from its source text:

- the collective kinds: a small C program linked with the runtime (build/libhwfsdp.a) prints
  coll_kind_name() for every CollKind, broadcast and barrier included, which no training run issues;
- categories, the compute stream's and the host's tracks, phases and the kinds a run uses: the trace
  of one step of the HSDP solution (all-gathers, reduce-scatters and all-reduces in one run).
"""
import json
import os
import subprocess

import pytest

from helpers import ROOT, SOLVED, run_train, solution_bin
from trace_names import (ALL_GATHER, ALL_REDUCE, BACKWARD_PHASES, CATEGORIES, COLLECTIVE, COLLECTIVE_KINDS, COMPUTE,
                         COMPUTE_TID, FORWARD_PHASES, HOST_SYNC, HOST_TID, MEMSET, OTHER_PHASES, REDUCE_SCATTER,
                         WAIT, WALL_ARGS, label_and_kind)

LIB = os.path.join(ROOT, "build", "libhwfsdp.a")
# every CollKind from 0 until coll_kind_name answers "?" (past the last kind)
PROBE = r"""
#include <stdio.h>
#include <string.h>

#include "runtime/coll.h"

int main(void) {
    for (int kind = 0; kind < 64; kind++) {
        const char *name = coll_kind_name(kind);
        if (strcmp(name, "?") == 0) return 0;
        puts(name);
    }
    return 1;
}
"""


def make_variable(*names):
    """The Makefile's values of the named variables (the flags every runtime binary is built with)."""
    rule = "hwfsdp-print-vars: ; @printf '%%s\\n' %s" % " ".join('"$(%s)"' % n for n in names)
    p = subprocess.run(["make", "-s", "--no-print-directory", "--eval", rule, "hwfsdp-print-vars"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.split("\n")[:len(names)]


def test_collective_kinds_are_the_runtimes(tmp_path):
    assert os.path.isfile(LIB), "%s missing: run make first" % LIB
    cc, cflags, ldflags, ldlibs = make_variable("CC", "CFLAGS", "LDFLAGS", "LDLIBS")
    src, binary = tmp_path / "kinds.c", tmp_path / "kinds"
    src.write_text(PROBE)
    cmd = [cc] + cflags.split() + ["-o", str(binary), str(src), LIB] + ldflags.split() + ldlibs.split()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stderr
    p = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, "coll_kind_name never said '?': %s" % p.stdout
    assert tuple(p.stdout.split()) == COLLECTIVE_KINDS


@pytest.mark.skipif(not any("--mesh" in f for s in SOLVED for f in s.flags), reason="no HSDP solution here")
def test_a_run_writes_only_the_names_we_read(tmp_path):
    stage = next(s for s in SOLVED if any("--mesh" in f for f in s.flags))
    run_train(solution_bin(stage), tmp_path, "--flavor", "tiny", "--world", "4", "--steps", "1", *stage.flags)
    with open(tmp_path / "trace.json") as fh:
        events = json.load(fh)["traceEvents"]
    slices = [e for e in events if e.get("ph") == "X"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}

    cats = {e["cat"] for e in slices}
    # every category but the CUDA backend's memset: a wait is traced iff a stream stalled on the modelled clock,
    # which is the program's doing, so the same every run (this one's compute stream stalls on its all-gathers)
    assert set(CATEGORIES) - {MEMSET} <= cats <= set(CATEGORIES), cats
    assert any(e["cat"] == WAIT and e["tid"] == COMPUTE_TID for e in slices)
    # the wall clock's args: every kernel has them, and they are all the args named wall_*
    assert {k for e in slices for k in e["args"] if k.startswith("wall")} == set(WALL_ARGS)
    assert all(set(WALL_ARGS) <= set(e["args"]) for e in slices if e["cat"] == COMPUTE)
    kinds = {label_and_kind(e["name"])[1] for e in slices if e["cat"] == COLLECTIVE}
    assert {ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE} <= kinds <= set(COLLECTIVE_KINDS), kinds
    phases = {e["args"].get("phase") for e in slices}
    assert phases <= FORWARD_PHASES | BACKWARD_PHASES | OTHER_PHASES, phases - (FORWARD_PHASES | BACKWARD_PHASES
                                                                                | OTHER_PHASES)
    for rank in range(4):
        assert tracks[(rank, COMPUTE_TID)] == "compute" and tracks[(rank, HOST_TID)] == "host", tracks
    assert {e["tid"] for e in slices if e["cat"] == HOST_SYNC} == {HOST_TID}
    assert any(e["cat"] == COMPUTE and e["tid"] == COMPUTE_TID for e in slices)
