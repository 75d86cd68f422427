"""What the runtime states it used (common/runtime/facts.h: run.json's and trace.json's otherData "groups",
"device_mesh", "pipeline", "vocab"), against an independent derivation from the run itself: the ranks that issued
collectives on each group (the trace's args.group), the modules whose forward each rank ran, and the flags
the test passed. And compare_reference's treatment of facts an older reference lacks."""
import io
import json
import os
import sys

import pytest

from helpers import ROOT, SOLVED, run_train, solution_bin
import trace_names as tn

sys.path.insert(0, os.path.join(ROOT, "tools"))
import compare_reference  # noqa: E402  (tools/)


def _stage_with(flag):
    return next((s for s in SOLVED if any(flag in f for f in s.flags)), None)


def _run(tmp_path, stage, *flags):
    run_train(solution_bin(stage), tmp_path, "--flavor", "tiny", "--world", "4", "--steps", "1", *flags)
    with open(tmp_path / "run.json") as fh:
        run = json.load(fh)
    with open(tmp_path / "trace.json") as fh:
        trace = json.load(fh)
    return run, trace


def _issuers_by_group(trace):
    """{group name: the ranks (pids) that issued a collective on it}."""
    out = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == tn.COLLECTIVE and "group" in e.get("args", {}):
            out.setdefault(e["args"]["group"], set()).add(e["pid"])
    return out


def _check_common(run, trace):
    facts = {k: run[k] for k in ("groups", "device_mesh", "pipeline", "vocab")}
    assert {k: trace["otherData"][k] for k in facts} == facts, "run.json and the trace state different facts"
    assert run["vocab"] == {"phases": list(tn.PHASES), "mem_tags": list(tn.MEM_TAGS),
                            "collective_kinds": list(tn.COLLECTIVE_KINDS)}
    groups = {g["name"]: g for g in run["groups"]}
    assert run["groups"][0] == {"name": "world", "kind": "world", "ranks": [0, 1, 2, 3]}
    for name, ranks in _issuers_by_group(trace).items():  # every group a collective used, with its issuers
        assert name in groups, (name, sorted(groups))
        assert set(groups[name]["ranks"]) == ranks, (name, groups[name]["ranks"], ranks)
    return groups


@pytest.mark.skipif(_stage_with("--mesh") is None, reason="no HSDP solution here")
def test_hsdp_mesh_and_groups(tmp_path):
    run, trace = _run(tmp_path, _stage_with("--mesh"), "--mesh", "2,2")
    groups = _check_common(run, trace)
    assert run["device_mesh"] == {"shape": [2, 2], "dims": ["replicate", "shard"]}
    assert run["mesh"] == [2, 2], "the --mesh flag's own key stays as it was"
    assert run["pipeline"] is None
    # --mesh 2,2: rows of 2 ranks shard, columns replicate (rank = row * 2 + column)
    want = {"shard0": [0, 1], "shard1": [2, 3], "replicate0": [0, 2], "replicate1": [1, 3]}
    assert {n: (g["kind"], g["ranks"]) for n, g in groups.items() if n != "world"} == {
        n: (n.rstrip("01"), r) for n, r in want.items()}


@pytest.mark.skipif(_stage_with("--pp") is None, reason="no pipeline solution here")
def test_pipeline_stage_map(tmp_path):
    run, trace = _run(tmp_path, _stage_with("--pp"), "--pp", "2")
    groups = _check_common(run, trace)
    # the modules whose forward each rank ran, in the order it ran them
    ran = {}
    for e in sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == tn.COMPUTE
                     and e["args"].get("phase") == tn.PHASE_FORWARD), key=lambda e: e["ts"]):
        mods = ran.setdefault(e["pid"], [])
        if e["args"]["module"] not in mods:
            mods.append(e["args"]["module"])
    derived = {}
    for rank, mods in sorted(ran.items()):
        derived.setdefault(tuple(mods), []).append(rank)
    stated = {tuple(s["modules"]): s["ranks"] for s in run["pipeline"]}
    assert stated == derived, (stated, derived)
    assert [s["stage"] for s in run["pipeline"]] == [0, 1]
    assert run["pipeline"][0]["modules"][0] == "embedding" and run["pipeline"][-1]["modules"][-1] == "head"
    # each stage's FSDP group is the stage's ranks
    for s in run["pipeline"]:
        g = groups["stage%d" % s["stage"]]
        assert g["kind"] == "stage" and g["ranks"] == s["ranks"]
    assert run["device_mesh"] == {"shape": [2], "dims": ["shard"]}


def _tree(root, run):
    os.makedirs(root / "01", exist_ok=True)
    (root / "01" / "run.json").write_text(json.dumps(run))


def test_compare_reference_leaves_new_facts_out(tmp_path):
    """A reference written before the runtime stated its facts still compares equal, and says the new keys
    were not compared; where both have a fact, a difference in it counts."""
    old, new = {"flavor": "tiny", "world": 4}, {"flavor": "tiny", "world": 4, "groups": [], "vocab": {}}
    _tree(tmp_path / "old", old)
    _tree(tmp_path / "new", new)
    out = io.StringIO()
    compared, differ, _ = compare_reference.compare(str(tmp_path / "old"), str(tmp_path / "new"), out=out)
    assert (compared, differ) == (1, 0), out.getvalue()
    assert "new, not compared" in out.getvalue() and "groups, vocab" in out.getvalue()

    _tree(tmp_path / "old2", dict(old, groups=[{"name": "world"}]))
    out = io.StringIO()
    compared, differ, _ = compare_reference.compare(str(tmp_path / "old2"), str(tmp_path / "new"), out=out)
    assert differ == 1 and "groups" in out.getvalue(), out.getvalue()
