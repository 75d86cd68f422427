"""stages/ is generated from solutions/ and in sync; every starter builds,
runs, and stops at its first TODO with a message naming it (exit status 3)."""
import os
import subprocess
import sys

import pytest

from helpers import BUILD, CORPUS, ROOT, SOLVED

STAGES = [s.dir for s in SOLVED]
FLAGS = {s.dir: s.flags_at(2) for s in SOLVED}  # the starters run at world 2


def test_stages_in_sync_with_solutions():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_starters.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_generator_refuses_unbalanced_markers(tmp_path):
    import make_starters
    good = "int f(void) {\n    /* BEGIN SOLUTION: do it (HANDOUT.md#stage-02) */\n    return 1;\n    /* END SOLUTION */\n}\n"
    out, todos = make_starters.convert(good, "02", "x.c")
    assert 'hw_todo("do it", "HANDOUT.md#stage-02");' in out and "return 1;" not in out and todos == ["do it"]
    kept, _ = make_starters.convert(good + good.replace("stage-02", "stage-03"), "03", "x.c")
    assert "return 1;" in kept and "BEGIN SOLUTION" not in kept  # other stages' code stays, markers go
    with pytest.raises(SystemExit):
        make_starters.convert(good.replace("    /* END SOLUTION */\n", ""), "02", "x.c")
    with pytest.raises(SystemExit):
        make_starters.convert(good, "05", "x.c")  # no region for the stage


@pytest.mark.parametrize("stage", STAGES)
def test_starter_stops_at_a_named_todo(stage, tmp_path):
    binary = os.path.join(BUILD, "stages", stage, "train")
    flags = FLAGS[stage]
    p = subprocess.run([binary, "--world", "2", "--steps", "2", "--data", CORPUS, "--out", str(tmp_path), "--quiet"]
                       + flags, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "TODO not implemented:" in p.stderr and "HANDOUT.md#stage-%s" % stage[:2] in p.stderr, p.stderr


@pytest.mark.parametrize("stage", STAGES)
def test_starter_contains_previous_stage_solution(stage):
    """Stage N's starter stubs only stage N's regions: no TODO of an earlier stage."""
    text = open(os.path.join(ROOT, "stages", stage, "hw_fsdp.c")).read()
    n = int(stage[:2])
    for earlier in range(1, n):
        assert "TODO(stage %02d)" % earlier not in text
    assert "TODO(stage %02d)" % n in text
