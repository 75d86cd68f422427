"""The autograder, graded: the solutions score full marks, the starters score zero on
their TODOs, every mutant in tests/mutants/mutants.json loses exactly the points of the
checks it breaks, and a wrong reference log never makes a wrong answer pass.

Every test grades into its own tmp_path (the grader builds and runs there), so the
file is safe to run in parallel. No wall-clock assertions (the grader prints its own time);
the overlap checks read the modelled clock, so their figures are asserted exactly.
"""
import fcntl
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import manifest
from gradelib.checks import CHECKS, OVERLAP_CHECKS, overlap_runs
from gradelib.rubric import stage_variants
from helpers import ROOT, apply_mutant, assert_overlap_figures

GRADER = os.path.join(ROOT, "grader", "grade.py")
REFERENCE = os.path.join(ROOT, "logs", "reference")
with open(os.path.join(ROOT, "grader", "rubric.json")) as _fh:
    RUBRIC = json.load(_fh)
with open(os.path.join(ROOT, "tests", "mutants", "mutants.json")) as _fh:
    MUTANTS = json.load(_fh)["mutants"]
STAGES = [s.id for s in manifest.stages()]
SOL01 = os.path.relpath(manifest.stage("01").solution_src(), ROOT)  # "solutions/01_.../hw_fsdp.c"
CHECK_LINE = re.compile(r"^== stage (\d\d) == (.+): (OK|FAIL) \(\d+\.\ds\)$")
FIGURES = RUBRIC["overlap_figures"]  # what each overlap check reads of the solutions and some mutants
OVERLAP_STAGES = [s for s in STAGES if set(RUBRIC["stages"][s]["checks"]) & set(OVERLAP_CHECKS)]


@pytest.fixture(scope="session", autouse=True)
def built():
    """The runtime must be built before graders run side by side (each then only compiles its own file);
    the lock keeps parallel workers (pytest -n) from building the same objects at once."""
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    with open(os.path.join(ROOT, "build", ".test_grader.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.run(["make", "-s", "--no-print-directory", "all"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, "make failed:\n" + p.stdout[-3000:] + p.stderr[-3000:]


def grade(out, *args):
    """Run grade.py into `out`; returns (stdout, results.json). The grader exits 0 whatever the score."""
    p = subprocess.run([sys.executable, GRADER, "--out", str(out)] + [str(a) for a in args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, "grade.py exited %d:\n%s\n%s" % (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    with open(os.path.join(str(out), "results.json")) as fh:
        return p.stdout, json.load(fh)


def check_keys(stage):
    return list(RUBRIC["stages"][stage]["checks"])


def check_labels(stage):
    """The labels the grader prints for the stage's checks, in rubric order."""
    return [CHECKS[k].label for k in check_keys(stage)]


def copy_reference(tmp_path):
    ref = tmp_path / "reference"
    shutil.copytree(REFERENCE, ref)
    return ref


def rewrite_metrics(path, change):
    with open(path) as fh:
        rows = [json.loads(l) for l in fh if l.strip()]
    change(rows)
    with open(path, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))


# ------------------------------------------------------------------ whole trees

def test_solutions_score_full_marks(tmp_path):
    out, res = grade(tmp_path, "--solutions")
    assert sorted(res["stages"]) == STAGES
    for stage, st in res["stages"].items():
        assert st["run"]["ok"], (stage, st["run"]["reason"])
        assert [c["name"] for c in st["checks"]] == check_labels(stage)
        for c in st["checks"]:
            assert c["ok"] and c["points"] == c["max_points"] and c["reason"] == "", (stage, c)
            assert set(c) >= {"ok", "points", "reason", "seconds"}
    # the advanced track's points are extra: outside the total
    core = [s for s in RUBRIC["stages"].values() if not s.get("bonus")]
    bonus = [s for s in RUBRIC["stages"].values() if s.get("bonus")]
    assert res["score"] == res["max_score"] == sum(sum(s["checks"].values()) for s in core)
    assert res["bonus_score"] == res["bonus_max_score"] == sum(sum(s["checks"].values()) for s in bonus)
    assert "Score: %g/%g" % (res["score"], res["max_score"]) in out
    assert not bonus or " + bonus %g/%g" % (res["bonus_score"], res["bonus_max_score"]) in out
    assert re.search(r"^graded %d stages in \d+\.\d s$" % len(STAGES), out, re.M), out[-500:]
    # the points per stage the handout promises
    assert res["stages"]["01"]["max_points"] == 3.25 and res["stages"]["02"]["max_points"] == 3.25
    lines = [l for l in out.splitlines() if CHECK_LINE.match(l)]
    assert len(lines) == sum(len(s["checks"]) for s in RUBRIC["stages"].values())
    assert all(l.endswith(")") and ": OK (" in l for l in lines)

    # the overlap checks' figures: the modelled clock's, so exactly those rubric.json documents, on the main run and
    # every variant (tools/overlap_figures.py measures them with the grader's own function), and every overlap check
    # a stage grades has a run it applies to
    from overlap_figures import differences, measure
    assert differences(RUBRIC, measure(RUBRIC, str(tmp_path))) == []
    for stage in OVERLAP_STAGES:
        details = {c["key"]: c["detail"] for c in res["stages"][stage]["checks"]}
        for key in set(RUBRIC["stages"][stage]["checks"]) & set(OVERLAP_CHECKS):
            runs = overlap_runs(RUBRIC, stage, key)
            assert runs, (stage, key)
            if None in runs:  # the printed line says the main run's figures, to its precision
                f = assert_overlap_figures(stage, tmp_path / ("stage" + stage), {key: FIGURES["solutions"][stage][key]})[key]
                assert details[key].startswith("%.1f%% of " % (100 * f.compute_share)), details[key]
                assert "(%.1f%% of " % (100 * f.collective_share) in details[key], details[key]
            else:
                assert details[key].startswith("graded on "), details[key]


def test_starters_score_zero_on_their_todos(tmp_path):
    out, res = grade(tmp_path)
    assert res["score"] == 0 and res["max_score"] > 0
    for stage, st in res["stages"].items():
        reason = st["run"]["reason"]
        assert not st["run"]["ok"]
        assert reason.startswith("TODO not implemented:") and "HANDOUT.md#stage-%s" % stage in reason, reason
        for c in st["checks"]:
            assert not c["ok"] and c["points"] == 0 and c["reason"].startswith("not graded: the run failed (above)")
    # xv6 style: the failed run's line is followed by its indented reason, once; each FAIL line by its own
    lines = out.splitlines()
    assert sum(1 for l in lines if l.startswith("    TODO not implemented:")) == len(res["stages"])
    for i, l in enumerate(lines):
        m = CHECK_LINE.match(l)
        if m and m.group(3) == "FAIL":
            assert lines[i + 1].startswith("    not graded: the run failed (above)"), lines[i:i + 2]
    assert "Score: 0/" in out


# --------------------------------------------------------------------- mutants

def test_mutants_file_is_sound():
    names = [m["name"] for m in MUTANTS]
    assert len(names) == len(set(names)) and len(names) >= 14
    for m in MUTANTS:
        assert os.path.isfile(os.path.join(ROOT, m["base"])), m["name"]
        assert m["stage"] in RUBRIC["stages"], m["name"]
        assert m["replace"] and all(len(pair) == 2 and pair[0] != pair[1] for pair in m["replace"]), m["name"]
        assert m["expect_message"], m["name"]
        valid = set(check_keys(m["stage"]))
        if m["expect_fail"] != ["*"]:
            assert m["expect_fail"] and set(m["expect_fail"]) <= valid, (m["name"], set(m["expect_fail"]) - valid)
        assert set(m.get("may_fail", [])) <= valid, m["name"]


def test_overlap_bars_keep_their_margins():
    """Each overlap bar is overlap_share_min of the solution's own figure on the run (so every solution reads 1 /
    overlap_share_min times its bar), and every documented mutant that must fail the check reads at least 5x under
    the bar of its run, every one that passes at least 5x over it: a change to the cost model that squeezes a margin
    shows here, with the figures, before a student's schedule lands on the wrong side."""
    share = RUBRIC["tolerances"]["overlap_share_min"]
    assert share <= 0.2, share  # the solution itself sits 5x over its bar
    by_name = {m["name"]: m for m in MUTANTS}
    seen = set()
    for name, figs in FIGURES["mutants"].items():
        m = by_name[name]
        for key, (got, _) in figs.items():
            bar = share * FIGURES["solutions"][m["stage"]][key][0]
            if key in m["expect_fail"]:
                assert got * 5 <= bar, (name, key, got, bar)
                seen.add(key)
            else:
                assert got >= 5 * bar * (1 - 1e-9), (name, key, got, bar)  # the solution's own figure: exactly 5x
    assert seen >= {"ag_overlap", "rs_overlap"}, seen


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m["name"] for m in MUTANTS])
def test_mutant_loses_exactly_its_points(mutant, tmp_path):
    src = apply_mutant(mutant, str(tmp_path / "hw_fsdp.c"))
    args = ["--file", src, "--stage", mutant["stage"]]
    if "timeout_s" in mutant:
        args += ["--timeout", mutant["timeout_s"]]
    _, res = grade(tmp_path / "out", *args)
    st = res["stages"][mutant["stage"]]
    checks = {c["key"]: c for c in st["checks"]}
    assert [c["name"] for c in st["checks"]] == check_labels(mutant["stage"])
    assert list(checks) == check_keys(mutant["stage"])
    if mutant["expect_fail"] == ["*"]:
        # a failed build or run: its reason is said once, every check fails pointing at it (a check
        # whose files the run wrote before failing adds whether they pass)
        assert not st["run"]["ok"], "the run was expected to fail"
        assert mutant["expect_message"] in st["run"]["reason"], st["run"]["reason"]
        assert st["points"] == 0
        for c in checks.values():
            assert not c["ok"] and c["points"] == 0 and c["reason"].startswith("not graded: the run failed (above)")
        return
    assert st["run"]["ok"], st["run"]["reason"]
    failed = {n for n, c in checks.items() if not c["ok"]}
    assert failed - set(mutant.get("may_fail", [])) == set(mutant["expect_fail"]), {n: checks[n]["reason"]
                                                                                   for n in failed}
    for n, c in checks.items():
        assert c["points"] == (0 if n in failed else c["max_points"]), c
    if mutant["name"] in FIGURES["mutants"]:  # a mutant whose overlap the rubric documents reads exactly that
        got = assert_overlap_figures(mutant["stage"], tmp_path / "out" / ("stage" + mutant["stage"]),
                                     FIGURES["mutants"][mutant["name"]])
        for key, f in got.items():
            said = checks[key]["reason"] or checks[key]["detail"]
            assert said.startswith("%.1f%% of " % (100 * f.compute_share)), said
    reasons = [checks[n]["reason"] for n in mutant["expect_fail"]]
    assert any(mutant["expect_message"] in r for r in reasons), reasons
    assert all(r and "\n" not in r for r in reasons)


@pytest.mark.parametrize("R,S", [(2, 2), (2, 3), (3, 2), (4, 1)])
def test_grad_norm_hint_names_the_mesh_factor(R, S):
    """On an R x S mesh each wrong reduction leaves its own factor on the norm (worked out here from the math,
    not read from the grader): a replica all-reduce that sums gives R, a reduce-scatter that sums S, a sum of
    squares all-reduced over the world, where every shard counts R times, sqrt(R). The hint names that one."""
    from gradelib.checks import mesh_grad_norm_hint
    replicas, row = "across the %d replicas" % R, "inside the %d-rank shard group" % S
    h = mesh_grad_norm_hint(float(R), R, S)
    assert replicas in h and (row in h) == (R == S), h
    if S > 1:
        h = mesh_grad_norm_hint(float(S), R, S)
        assert row in h and (replicas in h) == (R == S), h
    h = mesh_grad_norm_hint(math.sqrt(R), R, S)
    assert "shard group only" in h and "sqrt(R)" in h, h
    for ratio in (1.0, 0.5, R * S * 1.5):
        assert mesh_grad_norm_hint(ratio, R, S) == "", ratio


# ------------------------------------------------------------ resource limits

def rubric_with_limits(tmp_path, **limits):
    rubric = json.loads(json.dumps(RUBRIC))
    rubric["limits"].update(limits)
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    return path


def edited_solution(tmp_path, base, old, new):
    return apply_mutant({"name": "edited", "base": base, "replace": [[old, new]]}, str(tmp_path / "hw_fsdp.c"))


def test_cpu_time_limit_is_named(tmp_path):
    """A host loop that never ends, with a wall limit far away: the CPU-time limit stops it (SIGXCPU)."""
    hang = next(m for m in MUTANTS if m["name"] == "hang_spins_forever")
    src = apply_mutant(hang, str(tmp_path / "hw_fsdp.c"))
    rubric = rubric_with_limits(tmp_path, run_cpu_s=2)
    _, res = grade(tmp_path / "out", "--file", src, "--stage", "01", "--rubric", rubric, "--timeout", 120)
    reason = res["stages"]["01"]["run"]["reason"]
    assert reason.startswith("crashed with SIGXCPU") and "2 s of CPU time per run" in reason, reason


def test_memory_limit_is_named(tmp_path):
    """An allocation of 32 GiB fails under the grader's address-space limit and the reason says which limit."""
    src = edited_solution(tmp_path, SOL01,
                          "void fsdp_post_forward(Fsdp *f, Module *mod) { reshard(f, mod->fsdp); }",
                          "void fsdp_post_forward(Fsdp *f, Module *mod) {\n    reshard(f, mod->fsdp);\n"
                          "    dev_alloc_f32(f->dev, (size_t)8 << 30, MEM_TEMP, \"hoard\");\n}")
    rubric = rubric_with_limits(tmp_path, run_address_space_gib=4)
    _, res = grade(tmp_path / "out", "--file", src, "--stage", "01", "--rubric", rubric)
    reason = res["stages"]["01"]["run"]["reason"]
    assert re.fullmatch(r"runtime error: rank \d: out of memory allocating 34359738368 bytes for 'hoard' \(\d+ bytes "
                        r"allocated now\) \(the grader's memory limit: 4 GiB of address space per run\)", reason), reason


# ---------------------------------------------------------- wrong references

def test_corrupt_reference_fails_the_right_answer_and_says_so(tmp_path):
    ref = copy_reference(tmp_path)

    def corrupt(rows):
        rows[2]["loss"] *= 1.001
    rewrite_metrics(ref / "stage02" / "metrics.jsonl", corrupt)
    _, res = grade(tmp_path / "out", "--solutions", "--stage", "02", "--reference", ref)
    checks = {c["name"]: c for c in res["stages"]["02"]["checks"]}
    loss = checks["loss parity"]
    assert not loss["ok"]
    assert "step 3" in loss["reason"] and "reference disagrees with the baseline" in loss["reason"], loss["reason"]
    assert all(c["ok"] for n, c in checks.items() if n != "loss parity")


def test_wrong_reference_cannot_make_a_wrong_answer_pass(tmp_path):
    """The reference is replaced by the wrong answer's own numbers: the baseline still catches it."""
    mutant = next(m for m in MUTANTS if m["name"] == "shard_offset_rank_times_local_rows")
    src = apply_mutant(mutant, str(tmp_path / "hw_fsdp.c"))
    grade(tmp_path / "first", "--file", src, "--stage", "01")
    ref = copy_reference(tmp_path)
    shutil.copy(tmp_path / "first" / "stage01" / "metrics.jsonl", ref / "stage01" / "metrics.jsonl")

    _, res = grade(tmp_path / "wrong", "--file", src, "--stage", "01", "--reference", ref)
    loss = {c["name"]: c for c in res["stages"]["01"]["checks"]}["loss parity"]
    assert not loss["ok"]
    assert "matches the reference log but not the non-sharded baseline" in loss["reason"], loss["reason"]

    _, res = grade(tmp_path / "right", "--solutions", "--stage", "01", "--reference", ref)
    loss = {c["name"]: c for c in res["stages"]["01"]["checks"]}["loss parity"]
    assert not loss["ok"] and "reference disagrees with the baseline" in loss["reason"], loss["reason"]


def test_reference_from_another_configuration_is_called_stale(tmp_path):
    ref = copy_reference(tmp_path)
    run_json = ref / "stage01" / "run.json"
    cfg = json.loads(run_json.read_text())
    cfg["seq_len"] = cfg["seq_len"] * 2
    run_json.write_text(json.dumps(cfg))
    _, res = grade(tmp_path / "out", "--solutions", "--stage", "01", "--reference", ref)
    checks = {c["name"]: c for c in res["stages"]["01"]["checks"]}
    assert not checks["loss parity"]["ok"] and "stale" in checks["loss parity"]["reason"]
    assert checks["DTensors"]["ok"]


# ------------------------------------------------------------------- usage

@pytest.mark.parametrize("args,message", [
    (["--stage", "99"], "unknown stage '99'"),
    (["--file", SOL01], "--file needs exactly one --stage"),
    (["--file", SOL01, "--stage", "01", "--stage", "02"], "--file needs exactly one --stage"),
    (["--file", "/nonexistent/hw_fsdp.c", "--stage", "01"], "no such file"),
    (["--reference", "/nonexistent/reference"], "no such directory"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_usage_errors_exit_2_with_one_line(args, message, tmp_path):
    p = subprocess.run([sys.executable, GRADER, "--out", str(tmp_path)] + args, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grade.py: error: ") and message in lines[0], p.stderr
