"""tools/fsdp2_check.py (make fsdp2-check): the stage solutions against real PyTorch FSDP2.

- The comparisons, on made-up numbers: each one fails on the difference it exists for (a loss
  2e-6 off, one all-gather too many, a wrong row offset, a changed shard value).
- Bad input: one line, exit status 2.
- The tool itself on stage 02's grading configuration, and on a mutant of stage 05's solution
  that all-gathers again for the recompute (same numbers, one all-gather too many: only the
  collective counts catch it), when a torch >= 2.6 with fully_shard is importable from
  build/fsdp2-venv (make fsdp2-check makes it) or from this interpreter; skipped with the
  reason otherwise (CI has Debian's torch 1.13). They assert on the tool's comparisons (its
  logs/fsdp2-style json), not only on its exit status.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import BUILD, ROOT, apply_mutant, manifest

sys.path.insert(0, os.path.join(ROOT, "tools"))
import fsdp2_check as fc  # noqa: E402

TOOL = os.path.join(ROOT, "tools", "fsdp2_check.py")
TOL = fc.tolerances("02")


# ---------------------------------------------------------------------------- the comparisons

def metrics_rows(losses, norms):
    return [{"step": i + 1, "loss": l, "grad_norm": g} for i, (l, g) in enumerate(zip(losses, norms))]


def test_steps_agree_within_tolerance():
    c = metrics_rows([6.0, 5.5], [1.0, 0.9])
    t = metrics_rows([6.0 * (1 + 3e-7), 5.5], [1.0, 0.9 * (1 - 5e-7)])
    rows, max_l, max_g, fails = fc.compare_steps(c, t, TOL)
    assert not fails
    assert max_l == pytest.approx(3e-7, rel=1e-3) and max_g == pytest.approx(5e-7, rel=1e-3)
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("what", ["loss", "grad_norm", "nan", "steps", "missing_norm"])
def test_steps_differ(what):
    c = metrics_rows([6.0, 5.5], [1.0, 0.9])
    t = metrics_rows([6.0, 5.5], [1.0, 0.9])
    if what == "loss":
        t[1]["loss"] *= 1 + 2e-6
    elif what == "grad_norm":
        t[0]["grad_norm"] *= 1 - 2e-6
    elif what == "nan":
        c[1]["loss"] = float("nan")
    elif what == "steps":
        t = t[:1]
    else:
        c[0]["grad_norm"] = None
    _, _, _, fails = fc.compare_steps(c, t, TOL)
    assert len(fails) == 1, fails
    assert {"loss": "step 2: loss", "grad_norm": "step 1: grad_norm", "nan": "step 2: loss is nan",
            "steps": "2 steps in the C run, 1", "missing_norm": "step 1: grad_norm is None"}[what] in fails[0]


def counts(ag_dtype="f32"):
    out = {}
    for mod in ("embedding", "block0", "head"):
        out[(0, -1, mod, "all_gather", "forward", ag_dtype)] = 1
        out[(0, -1, mod, "all_gather", "backward", ag_dtype)] = 1
        out[(0, -1, mod, "reduce_scatter", "backward", "f32")] = 1
    return out


def test_collectives_equal_and_differ():
    equal, diffs, summary = fc.compare_collectives([counts(), counts()], [counts(), counts()])
    assert equal and not diffs
    assert summary["block0 all_gather backward"] == 1 and len(summary) == 9
    extra = counts()
    extra[(0, -1, "block0", "all_gather", "backward", "f32")] = 2  # an all-gather twice in backward (recompute?)
    equal, diffs, _ = fc.compare_collectives([counts(), counts()], [counts(), extra])
    assert not equal and diffs == ["rank 1 step 1: block0 all-gather (f32) in backward: 1 in the C run, 2 in FSDP2's"]
    # the same counts in another element type differ: a float32 all-gather where FSDP2 moves bfloat16
    equal, diffs, _ = fc.compare_collectives([counts()], [counts("bf16")])
    assert not equal and "rank 0 step 1: embedding all-gather (f32) in forward: 1 in the C run, 0 in FSDP2's" in diffs
    equal, diffs, _ = fc.compare_collectives([{}, {}], [{}, {}])
    assert not equal and "no collective of a module in the C trace" in diffs


def layout(name="layers.0.attention.wk.weight", **kw):
    p = {"name": name, "module": "block0", "global_shape": [16, 64], "mesh": [0, 1, 2, 3, 4], "placement": "Shard(0)",
         "local_rows": 0, "padded_rows": 4, "row_offset": 16, "row_numel": 64, "global_rows": 16,
         "local_matches_init": True, "padding_is_zero": True, "mesh_is_world": True}
    p.update(kw)
    return p


def test_layouts():
    assert fc.compare_layouts([layout()], [layout()], 4) == []
    diffs = fc.compare_layouts([layout()], [layout(row_offset=12)], 4)
    assert diffs == ["rank 4: layers.0.attention.wk.weight row_offset is 16 in the C run, 12 in FSDP2's"]
    diffs = fc.compare_layouts([layout(padding_is_zero=False)], [layout(padding_is_zero=False)], 0)
    assert any("the C shard is not the initial weights' rows" in d for d in diffs)
    diffs = fc.compare_layouts([layout()], [layout(name="x")], 0)
    assert diffs[0].startswith("rank 0: layers.0.attention.wk.weight only")


def test_values():
    rng = np.random.default_rng(0)
    full = {"w": rng.standard_normal((6, 3)).astype(np.float32)}
    lay = [[{"name": "w", "row_offset": 0, "local_rows": 3}], [{"name": "w", "row_offset": 3, "local_rows": 3}]]
    shards = [{"w": full["w"][:3].copy()}, {"w": full["w"][3:].copy()}]
    summary, fails = fc.compare_values(full, shards, lay, 1e-3, 1e-2, exact=True)
    assert not fails and summary["bitwise_identical"] == summary["shards"] == 2
    shards[1]["w"][2, 1] += 5e-6  # 5e-3 lr: within 1e-2 lr when trained, a failure without a step
    summary, fails = fc.compare_values(full, shards, lay, 1e-3, 1e-2, exact=False)
    assert not fails and summary["bitwise_identical"] == 1
    assert summary["max_abs_over_lr"] == pytest.approx(5e-3, rel=0.05) and summary["worst"] == "w (rank 1)"
    _, fails = fc.compare_values(full, shards, lay, 1e-3, 1e-2, exact=True)
    assert len(fails) == 1 and "1 of 2 shards differ" in fails[0]
    shards[0]["w"][0, 0] += 2e-5  # 2e-2 lr
    _, fails = fc.compare_values(full, shards, lay, 1e-3, 1e-2, exact=False)
    assert len(fails) == 1 and "w (rank 0)" in fails[0]


def test_stage_tolerances_table():
    assert fc.tolerances("04") == fc.TOLERANCES["default"]
    assert fc.tolerances("08")["values_lr"] is None  # mixed precision: reported, not judged


# ---------------------------------------------------------------------------- bad input

def run_tool(*args, python=sys.executable, timeout=60):
    return subprocess.run([python, TOOL] + list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_unknown_stage_is_one_line():
    p = run_tool("42", "--no-install")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["fsdp2-check: error: unknown stage '42' (stages: %s)"
                                             % ", ".join(sorted(fc.load_rubric()["stages"]))]


def test_no_venv_and_no_install_is_one_line(tmp_path):
    if fc.suitable(sys.executable):
        pytest.skip("%s has a suitable torch: the tool would use it" % sys.executable)
    # --binary: any executable passes the build check (the test holds without a build)
    first = manifest.stages()[0].id  # a staged release may hold stage 01 only
    p = run_tool(first, "--no-install", "--venv", str(tmp_path / "none"), "--binary", sys.executable)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no venv at" in lines[0] and "--no-install" in lines[0], p.stderr


# ---------------------------------------------------------------------------- the tool, for real

def fsdp2_python():
    """(python, None) with torch >= 2.6 and fully_shard, or (None, why not)."""
    if not os.path.isdir(os.path.join(ROOT, "solutions")):
        return None, "a student tree: the comparison runs the solutions (instructors' tree)"
    venv = os.path.join(BUILD, "fsdp2-venv")
    candidates = [fc.venv_python(venv)] if os.path.exists(os.path.join(venv, fc.READY)) else []
    for python in candidates + [sys.executable]:
        if fc.suitable(python):
            return python, None
    return None, ("no torch >= %d.%d with torch.distributed.fsdp.fully_shard in %s or %s (make fsdp2-check "
                  "installs one)" % (fc.MIN_TORCH + (fc.shown(venv), sys.executable)))


def test_stage02_against_fsdp2(tmp_path):
    python, why = fsdp2_python()
    if python is None:
        pytest.skip(why)
    out = tmp_path / "logs"
    p = run_tool("02", "--main-only", "--no-install", "--out", str(out), "--work", str(tmp_path / "work"),
                 python=python, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.load(open(out / "stage02.json"))
    assert rec["pass"] and rec["failures"] == []
    assert rec["world"] == 4 and rec["steps"] == 6 and len(rec["per_step"]) == 6
    for row in rec["per_step"]:
        assert row["loss_rel"] <= 1e-6 and row["grad_norm_rel"] <= 1e-6, row
        assert 0 < row["grad_norm_fsdp2"] and 0 < row["loss_fsdp2"]
    assert rec["dtensors"]["layout_identical"] and rec["dtensors"]["layout_differences"] == []
    values = rec["dtensors"]["values"]
    assert values["shards"] == 4 * 21 and values["max_abs_over_lr"] <= 1e-2
    coll = rec["collectives"]
    assert coll["identical"] and coll["steps_compared"] == 6
    # what FSDP2 did in step 1 on rank 0: each module all-gathered in forward and again in
    # backward (resharded after forward), its grads reduce-scattered once
    modules = ["block0", "block1", "embedding", "head"]
    assert coll["step1_rank0"] == {"%s %s" % (m, k): 1 for m in modules
                                   for k in ("all_gather backward", "all_gather forward", "reduce_scatter backward")}
    table = open(out / "table.txt").read()
    assert "stage02" in table and "PASS" in table and "FAIL" not in table


def test_extra_recompute_all_gather_is_caught(tmp_path):
    python, why = fsdp2_python()
    if python is None:
        pytest.skip(why)
    with open(os.path.join(ROOT, "tests", "mutants", "mutants.json")) as fh:
        mutant = next(m for m in json.load(fh)["mutants"] if m["name"] == "recompute_all_gathers_again")
    src, binary = tmp_path / "hw_fsdp.c", tmp_path / "train"
    apply_mutant(mutant, str(src))
    p = subprocess.run(["make", "-s", "impl", "SRC=%s" % src, "OUT=%s" % binary], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "logs"
    p = run_tool("05", "--main-only", "--no-install", "--binary", str(binary), "--out", str(out), "--work",
                 str(tmp_path / "work"), python=python, timeout=900)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.load(open(out / "stage05.json"))
    assert not rec["pass"] and rec["max_loss_rel"] <= 1e-6 and rec["max_grad_norm_rel"] <= 1e-6
    assert rec["dtensors"]["layout_identical"] and not rec["collectives"]["identical"]
    want = "rank 0 step 1: block1 all-gather (f32) in backward: 2 in the C run, 1 in FSDP2's"
    assert want in rec["collectives"]["differences"]
    assert "FAIL" in open(out / "table.txt").read()
