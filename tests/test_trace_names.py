"""grader/trace_names.py, the trace's words the grader, the tools and the tests read, against what the
C runtime writes, taken from the runtime itself rather than from its source text:

- the collective kinds: a small C program linked with the runtime (build/libhwfsdp.a) prints
  coll_kind_name() for every CollKind, broadcast and barrier included, which no training run issues;
- categories, the compute stream's and the host's tracks, phases and the kinds a run uses: the trace
  of one step of the HSDP solution (all-gathers, reduce-scatters and all-reduces in one run).
"""
import json
import os
import re
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
#include "runtime/trace.h"

int main(int argc, char **argv) {
    if (argc > 1) { /* the trace categories, in trace_names.CATEGORIES' order */
        const char *cats[] = {TRACE_CAT_COMPUTE, TRACE_CAT_COPY, TRACE_CAT_COLLECTIVE, TRACE_CAT_EVENT,
                              TRACE_CAT_WAIT, TRACE_CAT_HOST_SYNC, TRACE_CAT_MEMSET};
        for (size_t i = 0; i < sizeof cats / sizeof *cats; i++) puts(cats[i]);
        return 0;
    }
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


def _probe(tmp_path):
    """The PROBE program built against the runtime (build/libhwfsdp.a)."""
    assert os.path.isfile(LIB), "%s missing: run make first" % LIB
    cc, cflags, ldflags, ldlibs = make_variable("CC", "CFLAGS", "LDFLAGS", "LDLIBS")
    src, binary = tmp_path / "kinds.c", tmp_path / "kinds"
    src.write_text(PROBE)
    cmd = [cc] + cflags.split() + ["-o", str(binary), str(src), LIB] + ldflags.split() + ldlibs.split()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stderr
    return str(binary)


GENERATOR = os.path.join(ROOT, "build", "tools", "trace_names")


def test_committed_file_is_the_generators_output():
    """grader/trace_names.py is what tools/trace_names.c prints from the runtime's tables (make rewrites it):
    a hand edit, or a table changed without a make, shows here."""
    assert os.path.isfile(GENERATOR), "%s missing: run make first" % GENERATOR
    p = subprocess.run([GENERATOR], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    with open(os.path.join(ROOT, "grader", "trace_names.py"), encoding="utf-8") as fh:
        assert fh.read() == p.stdout, "grader/trace_names.py differs from build/tools/trace_names' output: run make"


def test_phase_sets_partition_the_phases():
    """Every phase is in exactly one of the forward, backward and other sets, and the hooks are inside a pass."""
    import trace_names as tn
    sets = (FORWARD_PHASES, BACKWARD_PHASES, OTHER_PHASES)
    assert sorted(p for s in sets for p in s) == sorted(tn.PHASES)
    assert tn.HOOK_PHASES <= FORWARD_PHASES | BACKWARD_PHASES and "forward" not in tn.HOOK_PHASES
    assert {"pre_forward", "post_backward", "finish_backward"} <= tn.HOOK_PHASES


def test_collective_kinds_are_the_runtimes(tmp_path):
    p = subprocess.run([_probe(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, "coll_kind_name never said '?': %s" % p.stdout
    assert tuple(p.stdout.split()) == COLLECTIVE_KINDS


def test_categories_are_the_runtimes(tmp_path):
    """trace.h's TRACE_CAT_* are trace_names.CATEGORIES, word for word."""
    p = subprocess.run([_probe(tmp_path), "categories"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert tuple(p.stdout.split()) == CATEGORIES


# a call that files a trace slice, up to its category argument (the CPU's clock_trace_op and modelled_clock's
# records, the CUDA backend's cuda_trace_rec): the argument must be a TRACE_CAT_ name, never a string
TRACE_CALLS = {"clock_trace_op": 3, "cuda_trace_rec": 3}


def _call_args(text, start):
    """The top-level arguments of the call whose '(' is at text[start]."""
    depth, args, cur = 0, [], ""
    for ch in text[start:]:
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append(cur.strip())
                return args
        elif ch == "," and depth == 1:
            args.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return args


def test_every_backend_files_slices_under_the_table(tmp_path):
    """The CUDA backend once filed its kernels under "kernel" where the grader reads "compute" (its overlap
    checks could never pass on a GPU): no backend names a category but through trace.h's table. The CUDA
    files cannot run here, so their source is read; the check must find every call it guards."""
    import glob
    seen, bad = 0, []
    for path in sorted(glob.glob(os.path.join(ROOT, "common", "**", "*.c"), recursive=True)):
        text = open(path, encoding="utf-8").read()
        for fn, k in TRACE_CALLS.items():
            for m in re.finditer(r"\b%s\s*\(" % fn, text):
                line_start = text.rfind("\n", 0, m.start()) + 1
                if re.fullmatch(r"\s*(static\s+)?(void|TraceRec)\s+\**", text[line_start:m.start()]):
                    continue  # the definition or a declaration
                args = _call_args(text, m.end() - 1)
                seen += 1
                if len(args) <= k or not args[k].startswith("TRACE_CAT_"):
                    bad.append("%s: %s(...) files under %s" % (os.path.relpath(path, ROOT), fn,
                                                               args[k] if len(args) > k else "?"))
    model = [l for l in open(os.path.join(ROOT, "common", "cpu", "modelled_clock.c")) if ".cat = " in l]
    bad += ["modelled_clock.c: " + l.strip() for l in model  # TRACE_CAT_, or clock_trace_op's own argument passed on
            if ".cat = TRACE_CAT_" not in l and ".cat = cat," not in l]
    assert seen >= 8 and model, (seen, model)  # the CPU's six calls and the CUDA backend's (at least two)
    assert not bad, "\n".join(bad)


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
