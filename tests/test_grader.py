"""The autograder, graded: the solutions score full marks, the starters score zero on
their TODOs, every mutant in tests/mutants/mutants.json loses exactly the points of the
checks it breaks and the first failure it is told is the one that names its cause (its
"lead"), and a wrong reference log never makes a wrong answer pass.

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
from gradelib.trace_model import group_kinds, group_of, runtime_groups

import manifest
from gradelib.checks import CHECKS, OVERLAP_CHECKS, overlap_runs
from gradelib.rubric import stage_variants
from helpers import ROOT, apply_mutant, assert_overlap_figures

GRADER = os.path.join(ROOT, "grader", "grade.py")
REFERENCE = os.path.join(ROOT, "logs", "reference")
RUBRIC = manifest.load()  # rubric.json with its measured figures (grader/figures/)
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

    # the overlap checks' figures: the modelled clock's, so exactly those grader/figures/overlap.json documents, on the main run and
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
        # a starter stubs every stage up to its own: it stops at the first TODO its run reaches, often an earlier one
        m = re.search(r"HANDOUT\.md#stage-(\d\d)", reason)
        assert reason.startswith("TODO not implemented:") and m and m.group(1) <= stage, reason
        for c in st["checks"]:
            assert not c["ok"] and c["points"] == 0 and c["reason"].startswith("not graded: the run failed")
    # xv6 style: the failed run's line is followed by its indented reason, once, then one line naming every
    # check it left ungraded (results.json still has each check's entry)
    lines = out.splitlines()
    assert sum(1 for l in lines if l.startswith("    TODO not implemented:")) == len(res["stages"])
    assert not [l for l in lines if CHECK_LINE.match(l)], "a failed run prints no line per check"
    for stage in res["stages"]:
        i = next(i for i, l in enumerate(lines) if l.startswith("== stage %s == " % stage) and "run FAILED" in l)
        assert lines[i + 1].startswith("    TODO not implemented:"), lines[i:i + 3]
        assert lines[i + 2].startswith("== stage %s == not graded (the run failed): %s" % (
            stage, check_labels(stage)[0])), lines[i:i + 3]
        assert all(label in lines[i + 2] for label in check_labels(stage)), lines[i + 2]
        assert lines[i + 3].startswith("stage %s: 0/" % stage), lines[i:i + 4]
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
        # the failure that names the mutant's cause: a check it fails, or a run that fails
        runs = ["run"] + ["run:" + v for v in stage_variants(RUBRIC, m["stage"])]
        assert m["lead"] in set(runs) | (valid if m["expect_fail"] == ["*"] else set(m["expect_fail"])), m["name"]


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
    out, res = grade(tmp_path / "out", *args)
    st = res["stages"][mutant["stage"]]
    checks = {c["key"]: c for c in st["checks"]}
    assert [c["name"] for c in st["checks"]] == check_labels(mutant["stage"])
    assert list(checks) == check_keys(mutant["stage"])
    assert_leads(mutant, out, st)
    if mutant["expect_fail"] == ["*"]:
        # a failed build or run: its reason is said once, every check fails pointing at it (a check
        # whose files the run wrote before failing adds whether they pass), but a check that can judge the
        # partial record a runtime error leaves (Check.partial) and fails on it says why, on that record: the
        # message is the run's reason, or such a check's when the mutant names the cause the runtime error is a
        # symptom of (then only such checks may fail on the partial record: no other says anything of its own)
        assert not st["run"]["ok"], "the run was expected to fail"
        on_partial = [c["reason"] for c in checks.values() if c.get("partial")
                      and not c["reason"].startswith("not graded: the run failed")]
        if mutant["expect_message"] in st["run"]["reason"]:
            assert not on_partial, on_partial
        else:
            assert any(mutant["expect_message"] in r for r in on_partial), (st["run"]["reason"], on_partial)
        assert st["points"] == 0
        for c in checks.values():
            assert not c["ok"] and c["points"] == 0
            if c.get("partial"):
                assert CHECKS[c["key"]].partial and c["reason"] and "\n" not in c["reason"], c
                assert c["reason"].startswith(("not graded: the run failed", "before the runtime error: ")), c
            else:
                assert c["reason"].startswith("not graded: the run failed"), c
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


def assert_leads(mutant, out, st):
    """The failure the grader says first is the mutant's "lead", the one that names its cause: results.json's
    "lead" and, on stdout, the first failed check said (a 'most likely cause' line naming it when more than one
    failure is said), the run's reason when the run failed."""
    assert st["lead"] == mutant["lead"], "%s leads, the cause is %s (order said: %s)" % (
        st["lead"], mutant["lead"], st["failed_order"])
    lines = out.splitlines()
    failed = [m.group(2) for m in map(CHECK_LINE.match, lines) if m and m.group(3) == "FAIL"]
    likely = [l for l in lines if " == most likely cause: " in l]
    if mutant["lead"] == "run":
        assert st["failed_order"] == ["run"] and not failed and not likely, lines
        return
    if mutant["lead"].startswith("run:"):
        assert len(st["failed_order"]) == 1 or likely[0].split(" == most likely cause: ")[1].startswith(
            "the run on "), lines
        return
    label = CHECKS[mutant["lead"]].label
    # a check said on its own line leads them; one that fails on the files a failed run wrote is named on the
    # 'most likely cause' line, before the run's reason
    assert failed[:1] == [label] if failed else not st["run"]["ok"] and len(st["failed_order"]) > 1, lines
    assert len(st["failed_order"]) == 1 or likely[0].split(" == most likely cause: ")[1].startswith(
        (label + " (read it first: ", label + ", on the files the run wrote before failing: ")), likely


def grade_mutant(tmp_path, name):
    """(stdout, results.json's entry of its stage) of grading mutant `name` into tmp_path/name."""
    mutant = next(m for m in MUTANTS if m["name"] == name)
    (tmp_path / name).mkdir()
    src = apply_mutant(mutant, str(tmp_path / name / "hw_fsdp.c"))
    out, res = grade(tmp_path / name / "out", "--file", src, "--stage", mutant["stage"])
    return out, res["stages"][mutant["stage"]]


def test_clip_names_the_grad_norms_cause(tmp_path):
    """Grads W times too large (the reduce-scatter sums): the clip coefficient's line gives the grad norm's
    cause, the same sentence, not a suspect of its own; without such evidence (AdamW clipped with the local norm
    while the norm logged is the global one) it keeps its own."""
    _, st = grade_mutant(tmp_path, "reduce_scatter_sums_instead_of_averaging")
    why = {c["key"]: c["reason"] for c in st["checks"]}
    cause = ("the reduce-scatter over the 4 ranks sums (op sum in the trace, world in step 1, every module): the "
             "grads come out 4 times the mean, so the norm too; it must average (RED_AVG), not sum")
    assert why["grad_norm"].endswith(": 4.00 times too large: " + cause), why["grad_norm"]
    assert re.fullmatch(r"step 1, rank 0: AdamW applied clip coefficient [\d.]+, the reference [\d.]+ \(max_norm "
                        r"0\.5 / global grad norm\): it divided by a grad norm 4\.00 times the reference's, for the "
                        r"cause grad norm parity names: " + re.escape(cause), why["clip"]), why["clip"]
    _, st = grade_mutant(tmp_path, "clip_with_the_local_norm")
    why = {c["key"]: c["reason"] for c in st["checks"]}
    assert why["clip"].endswith("(max_norm 0.5 / global grad norm): clipped less than the reference: total_sumsq "
                                "must be the sum over every rank's shards (all-reduce with RED_SUM) of the squared "
                                "gradients"), why["clip"]


def test_a_failed_run_says_its_cause_once_and_what_it_left_ungraded(tmp_path):
    """The run's reason once under its line, then one line naming every check it left ungraded (a check whose
    files the run wrote before failing says there that they pass); results.json keeps an entry per check. A
    failed variant run likewise: its reason under its own line, one line for the checks it left ungraded."""
    out, st = grade_mutant(tmp_path, "pre_backward_does_not_all_gather")
    lines = out.splitlines()
    cause = [i for i, l in enumerate(lines) if "has no unsharded data for the backward" in l]
    assert len(cause) == 1 and lines[cause[0]].startswith("    runtime error: head: norm.weight"), lines
    labels = check_labels("02")
    assert lines[cause[0] + 1] == "== stage 02 == not graded (the run failed): " + ", ".join(
        l + (" (the files the run wrote before failing pass it)" if l == "DTensors" else "") for l in labels)
    assert lines[cause[0] + 2].startswith("stage 02: 0/"), lines
    assert [c["name"] for c in st["checks"]] == labels
    assert {c["reason"] for c in st["checks"]} == {"not graded: the run failed", "not graded: the run failed; "
                                                   "the files it wrote before failing pass this check"}

    out, st = grade_mutant(tmp_path, "recompute_guard_is_the_zero2_flag")
    lines = out.splitlines()
    cause = [i for i, l in enumerate(lines) if "has no unsharded data for the backward" in l]
    assert len(cause) == 1 and "run FAILED" in lines[cause[0] - 1] and "--reshard-after-forward=true --ac" in \
        lines[cause[0] - 1], lines
    ungraded = [l for l in lines if " not graded " in l]
    failed = [c["name"] for c in st["checks"] if not c["ok"]]
    assert ungraded == ["== stage 06 == not graded (the run on --reshard-after-forward=true --ac failed): "
                        + ", ".join(failed)], ungraded
    assert not [l for l in lines if CHECK_LINE.match(l) and CHECK_LINE.match(l).group(3) == "FAIL"], lines
    assert all(c["reason"].startswith("on --reshard-after-forward=true --ac the run failed: runtime error: block1: ")
               for c in st["checks"] if not c["ok"])


def test_a_failed_run_says_the_dtensors_it_wrote_fail(tmp_path):
    """A sharding bug that also stops the run (stage 12's shard count taken from the world, not the stage's shard
    group; the run then reads NaN padding): the DTensors every rank wrote right after fsdp_init fail the check, and
    the "not graded" line says so with the check's reason (the handout's promise: the DTensors verdict whenever
    the run wrote them), never a bare "DTensors"."""
    pipes = [s for s in manifest.stages() if s.pipeline and s.shards_at(4) > 1]
    if not pipes:
        pytest.skip("no pipeline stage with more than one shard per stage in this release")
    st12 = pipes[0]
    mutant = {"name": "pipeline_split_over_the_world", "base": os.path.relpath(st12.solution_src(), ROOT),
              "replace": [["    f->srank = pg_rank(f->shard_pg);\n    f->nshards = pg_size(f->shard_pg);",
                           "    f->srank = dev_rank(f->dev);\n    f->nshards = dev_world_size(f->dev);"]]}
    src = apply_mutant(mutant, str(tmp_path / "hw_fsdp.c"))
    out, res = grade(tmp_path / "out", "--file", src, "--stage", st12.id)
    st = res["stages"][st12.id]
    assert not st["run"]["ok"]
    dt = next(c for c in st["checks"] if c["key"] == "dtensors")
    prefix = "not graded: the run failed; the files it wrote before failing fail this check: "
    assert dt["reason"].startswith(prefix) and dt["points"] == 0, dt
    why = dt["reason"][len(prefix):]
    assert "split over the %d ranks of its pipeline stage" % st12.shards_at(4) in why, why
    line = next(l for l in out.splitlines() if l.startswith("== stage %s == not graded (the run failed): " % st12.id))
    assert "%s (the files the run wrote before failing FAIL it: %s)" % (dt["name"], why) in line, line


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
    # the trace showed the norm's all-reduce in the shard group: sqrt(R) is then not its doing
    assert mesh_grad_norm_hint(math.sqrt(R), R, S, norm_group_right=True) == ""


class HintContext:
    """What the evidence-based hints read of a Context (gradelib/hints.py), made up by a test: the mesh's
    flags, per rank the trace's collectives of one step and the grad_state notes of the run and the
    reference."""

    def __init__(self, R, S, mesh=True, traces=None, clip=None, got=None, ref=None, K=1):
        self.world = R * S
        self.flags = (["--mesh=%dx%d" % (R, S)] if mesh else []) + (["--grad-accum=%d" % K] if K > 1 else [])
        self.tol = {}
        self.cuda = False
        self._traces, self._clip, self._got, self._ref = traces or {}, clip, got, ref
        # run.json's groups as the runtime states them, worked out by hand: the world; with the mesh, rows
        # shard<i> of S ranks and columns replicate<j> of R ranks (rank = i * S + j)
        groups = [{"name": "world", "kind": "world", "ranks": list(range(R * S))}]
        if mesh:
            groups += [{"name": "shard%d" % i, "kind": "shard", "ranks": [i * S + j for j in range(S)]}
                       for i in range(R)]
            groups += [{"name": "replicate%d" % j, "kind": "replicate", "ranks": [i * S + j for i in range(R)]}
                       for j in range(S)]
        self._run_json = {"groups": groups}

    def run_json(self):
        return self._run_json

    def groups(self):
        return runtime_groups(self._run_json)

    def group_kind(self, name):
        return group_kinds(self._run_json).get(name)

    def group_of(self, rank, kind):
        return group_of(self._run_json, rank, kind)

    def parity_tol(self, metric):
        """(against the reference, against the baseline): the measured tolerance of every float32 run."""
        return 2e-6, 2e-6

    def trace(self, rank):
        return self._traces[rank]

    def metrics(self):
        return [{"loss": 1.0, "clip_coef_min_per_rank": self._clip}]

    def module_order(self):
        return ["embedding", "head"], {"embedding": 4, "head": 4}

    def grad_states(self, rank, reference=False):
        return (self._ref if reference else self._got)[rank]


def norm_all_reduce(group, op="sum", ts=10.0):
    return {"name": "grad_norm.all_reduce", "cat": "collective", "ts": ts, "dur": 1.0,
            "args": {"step": 0, "phase": "optimizer", "module": "optimizer", "bytes": 4, "group": group, "op": op}}


def step_marker():
    """A collective of the step that is not the norm's (a module's all-gather), so the trace covers it."""
    return {"name": "head.all_gather", "cat": "collective", "ts": 1.0, "dur": 1.0,
            "args": {"step": 0, "phase": "pre_forward", "module": "head", "bytes": 64, "group": "world"}}


@pytest.mark.parametrize("R,S", [(2, 2), (2, 3), (3, 2), (4, 1)])
def test_norm_hint_names_the_group_from_the_trace(R, S):
    """The norm's hint reads the group and op of its all-reduce in the trace. What each choice does is worked
    out here from the mesh, not read from the grader: rank i*S+j holds shard j; over the world every shard is
    summed once per replica (R times: the norm sqrt(R) too large); over the replicate group (the R ranks
    holding the same shard) each rank sums R copies of its own shard and nothing of the other S-1, so ranks
    of different shards disagree; an average over the shard group leaves 1/S of the sum; no all-reduce leaves
    each rank its own shard."""
    from gradelib.hints import norm_reduction_hint, norm_reduction_ok
    W = R * S

    def ctx(groups_of_rank, op="sum"):
        traces = {r: [step_marker()] + [norm_all_reduce(g, op) for g in groups_of_rank(r)] for r in range(W)}
        return HintContext(R, S, traces=traces, clip=[0.5 + 0.1 * (r % S) for r in range(W)])

    right = ctx(lambda r: ["shard%d" % (r // S)])
    assert norm_reduction_hint(right, 1, 1.3) == "" and norm_reduction_ok(right, 1) is True
    world = ctx(lambda r: ["world"])
    h = norm_reduction_hint(world, 1, math.sqrt(R))
    assert norm_reduction_ok(world, 1) is False
    if R > 1:
        assert "ran in world (%d ranks, sum)" % W in h and "count %d times" % R in h, h
        assert "sqrt(%d) = %.2f" % (R, math.sqrt(R)) in h and "shard group shard0" in h, h
    else:
        assert h == "", h
    if R > 1 and S > 1:
        h = norm_reduction_hint(ctx(lambda r: ["replicate%d" % (r % S)]), 1, 1.2)
        assert "ran in replicate0 (%d ranks, sum)" % R in h, h
        assert "each rank sums %d copies of its own shard's squares and nothing of the other %d shard" % (R, S - 1) in h, h
        assert "the ranks disagree (their clip coefficients: 0.5 on ranks 0, %d" % S in h, h
    if R > 1 and S == 1:  # the replicate group is the world: every rank sums the one shard R times
        h = norm_reduction_hint(ctx(lambda r: ["replicate0"]), 1, 2.0)
        assert "count %d times" % R in h, h
    if S > 1:
        h = norm_reduction_hint(ctx(lambda r: ["shard%d" % (r // S)], op="avg"), 1, 0.7)
        assert "ran in shard0 (%d ranks, avg)" % S in h and "count only 1/%d" % S in h, h
        h = norm_reduction_hint(ctx(lambda r: []), 1, 0.7)
        assert "no all-reduce of the norm's sum of squares" in h and "all-reduced before the square root" in h, h
    # a trace that does not cover the step, or a group the mesh does not name: no evidence, the ratio decides
    assert norm_reduction_hint(HintContext(R, S, traces={r: [] for r in range(W)}), 1, 2.0) == ""
    assert norm_reduction_hint(ctx(lambda r: ["somewhere"]), 1, 2.0) == ""
    # another all-reduce in the optimizer (a vector of per-param sums?) may be part of the norm: no verdict
    vector = dict(norm_all_reduce("world"), name="per_param_sumsq.all_reduce")
    vector["args"] = dict(vector["args"], bytes=84)
    assert norm_reduction_hint(HintContext(R, S, traces={r: [step_marker(), vector] for r in range(W)}), 1, 2.0) == ""


def grad_note(step, micro, state, previous=None, kind=1):
    """A grad_state note (probes.h) of a made-up state {module: [floats]} of one kind (0: kept Param.grad,
    1: grad shards), with its dot product with the previous microbatch's state."""
    sq = {m: sum(x * x for x in v) for m, v in state.items()}
    dot = {m: sum(x * y for x, y in zip(v, previous[m])) for m, v in state.items()} if previous else None
    by = {m: [sq[m] if kind == 0 else None, sq[m] if kind == 1 else None, dot[m] if dot else None] for m in state}
    n = 2 * len(state)  # two params per module
    return {"step": step, "microbatch": micro, "by_module": by,
            "unsharded_grad_sumsq": sum(sq.values()) if kind == 0 else 0, "unsharded_grads": n if kind == 0 else 0,
            "grad_shard_sumsq": sum(sq.values()) if kind == 1 else 0, "grad_shards": n if kind == 1 else 0,
            "grad_shards_unreadable": 0, "dot_previous": sum(dot.values()) if dot else None,
            "dot_params": n if dot else 0}


@pytest.mark.parametrize("c,d,names,advice", [
    (0.25, 1.0, ("0.25 (1/W)", "1"), "the earlier microbatches' grads are divided by W = 4"),
    (0.0, 1.0, ("nothing", "1"), "what the earlier microbatches left is gone"),
    (1.0, 4.0, ("1", "4 (W)"), "microbatch 1's gradient is W = 4 times too large"),
    (1.0, 0.0, ("1", "nothing"), "microbatch 1's gradient never reached the grad shards"),
    (0.7, 1.3, ("0.7", "1.3"), "both parts must be 1"),
])
def test_grad_state_hint_splits_the_accumulated_state(c, d, names, advice):
    """Two microbatches accumulate into the grad shards: the reference holds A after the first and A + B after
    the second; a student's second state c*A + d*B (made up here from random A and B) is split back into
    (c, d) from the notes' sums of squares and dot products, which the hint names."""
    import random
    from gradelib.hints import grad_state_hint
    rng = random.Random(7)
    mods = ("embedding", "head")
    A = {m: [rng.gauss(0, 1) for _ in range(50)] for m in mods}
    B = {m: [rng.gauss(0, 1) for _ in range(50)] for m in mods}
    AB = {m: [a + b for a, b in zip(A[m], B[m])] for m in mods}
    X = {m: [c * a + d * b for a, b in zip(A[m], B[m])] for m in mods}
    ref = {r: {(0, 0): grad_note(0, 0, A), (0, 1): grad_note(0, 1, AB, A)} for r in range(4)}
    got = {r: {(0, 0): grad_note(0, 0, A), (0, 1): grad_note(0, 1, X, A)} for r in range(4)}
    h = grad_state_hint(HintContext(1, 4, mesh=False, got=got, ref=ref, K=2), 1, 2)
    assert h.startswith("after microbatch 1 of step 1 on rank 0"), h
    assert "after microbatch 0 they matched" in h, h
    assert "into %s x what the earlier microbatches left + %s x microbatch 1's gradient" % names in h, h
    assert advice in h, h


def test_grad_state_hint_names_the_first_microbatch_that_differs():
    """A state off from the first microbatch is named there, with its factor (1/W of the values: 1/W^2 of the
    sum of squares, in every module); a state the reference keeps and the run does not, by its counts; a run
    whose every state matches is told the grads reaching the optimizer are right."""
    import random
    from gradelib.hints import grad_state_hint
    rng = random.Random(8)
    A = {m: [rng.gauss(0, 1) for _ in range(20)] for m in ("embedding", "head")}
    ref = {r: {(0, 0): grad_note(0, 0, A)} for r in range(4)}
    quarter = {m: [x / 4 for x in v] for m, v in A.items()}
    got = {r: {(0, 0): grad_note(0, 0, quarter if r == 2 else A)} for r in range(4)}
    h = grad_state_hint(HintContext(1, 4, mesh=False, got=got, ref=ref, K=2), 1, 2)
    assert h.startswith("after microbatch 0 of step 1 on rank 2"), h
    assert "hold 0.0625 x the reference's sum of squares (0.25 (1/W) x its norm, in every module alike)" in h, h
    kept = {r: {(0, 0): grad_note(0, 0, A, kind=0)} for r in range(4)}
    h = grad_state_hint(HintContext(1, 4, mesh=False, got=ref, ref=kept, K=2), 1, 2)
    assert "Param.grad is kept for 0 params and DTensor.grad set for 4, the reference's 4 and 0" in h, h
    h = grad_state_hint(HintContext(1, 4, mesh=False, got=ref, ref=ref, K=2), 1, 2)
    assert h.startswith("the gradient state after every microbatch matches the reference's up to step 1"), h
    assert grad_state_hint(HintContext(1, 4, mesh=False, got=ref, ref={r: {} for r in range(4)}, K=2), 1, 2) == ""


# ------------------------------------------------------------ the checkpoint (rubric "save")

class CheckpointContext:
    """What flat_checkpoint reads of a Context: the run's and the baseline's checkpoints (as read_checkpoint returns
    them), the tolerances, and one rank's DTensors dump (where a wrong element lies)."""

    def __init__(self, got, want, pieces=None):
        self.got, self.want, self.pieces = got, want, pieces or {}
        self.tol, self.cuda = dict(RUBRIC["tolerances"]), False

    def checkpoint(self):
        return self.got

    def baseline_checkpoint(self):
        return self.want

    def ranks(self):
        return sorted(self.pieces)

    def dtensors(self, rank):
        return {"params": [{"name": n, "row_offset": lo, "local_rows": hi - lo} for n, (lo, hi) in
                           self.pieces[rank].items()]}


def test_flat_checkpoint_names_what_is_wrong():
    """flat_checkpoint on made-up checkpoints: equal ones pass; each failure names the first wrong entry and what
    is wrong: the step, a missing name (no AdamW state at all said as such), an extra one, the dtype, the shape,
    values off at an element (with the rank whose piece holds every wrong one, and whose values they are)."""
    import array
    from gradelib.context import Tensor
    from gradelib.util import CheckFailed

    def f32(shape, values):
        return Tensor("F32", shape, array.array("f", values))

    def ckpt(step="6", **over):
        t = {"w": f32([2, 3], [1, 2, 3, 4, 5, 6]), "optim.w.exp_avg": f32([2, 3], [0.5] * 6),
             "optim.w.exp_avg_sq": f32([2, 3], [0.25] * 6)}
        t.update(over)
        return {"format": "pt", "step": step}, {k: v for k, v in t.items() if v is not None}

    def fails(got, pieces=None):
        with pytest.raises(CheckFailed) as e:
            CHECKS["flat_checkpoint"](CheckpointContext(got, ckpt(), pieces))
        return str(e.value)

    near = [1, 2, 3, 4, 5, 6 * (1 + 0.5 * RUBRIC["tolerances"]["checkpoint_rel"])]
    assert "3 tensors at step 6" in CHECKS["flat_checkpoint"](CheckpointContext(ckpt(w=f32([2, 3], near)), ckpt()))
    assert "says step 5, the baseline's (saved at the same step) 6" in fails(ckpt(step="5"))
    assert "holds no AdamW state (2 entries" in fails(ckpt(**{"optim.w.exp_avg": None, "optim.w.exp_avg_sq": None}))
    assert fails(ckpt(w=None)).startswith("the checkpoint has no w (1 of the baseline's 3 entries missing)")
    assert "holds \"x\", which the baseline's does not" in fails(ckpt(x=f32([1], [0])))
    assert fails(ckpt(w=Tensor("BF16", [2, 3], None))) == "w is BF16 in the checkpoint, F32 in the baseline's"
    assert fails(ckpt(w=f32([6], [1, 2, 3, 4, 5, 6]))).startswith("w has shape [6] in the checkpoint, [2, 3] in")
    why = fails(ckpt(w=f32([2, 3], [1, 2, 3, 4, 5, 7])), pieces={0: {"w": (0, 4)}, 1: {"w": (4, 6)}})
    assert why.startswith("w: 1 of its 6 values differ from the baseline's by more than 7e-05 of its largest |value| 6, "
                          "the first at element 5 (row 1, column 2), in rank 1's piece [4, 6) of the 6 elements (every "
                          "wrong element lies in it): 7, the baseline's 6: --save gathers each rank's piece from "
                          "DTensor.local"), why
    why = fails(ckpt(**{"optim.w.exp_avg_sq": f32([2, 3], [0.5] * 6)}))
    assert "its values are the baseline's optim.w.exp_avg: --save gathers each rank's AdamW state" in why, why
    nan = fails(ckpt(**{"optim.w.exp_avg": f32([2, 3], [0.5] * 5 + [float("nan")])}))
    assert nan.startswith("optim.w.exp_avg: 1 of its 6 values differ") and ": nan, the baseline's 0.5" in nan, nan


def test_baseline_with_save_is_one_more_run(tmp_path):
    """Baselines.get: a run with --save serves the calls without it too; a call with save after one without runs
    the baseline again, with --save into its own dir."""
    from gradelib.runner import CHECKPOINT, Baselines, RunResult

    class Runner:
        def __init__(self):
            self.runs = []

        def build(self, src, out, log):
            return True, "", 0.0

        def run(self, binary, flags, run_dir, log, steps):
            self.runs.append(flags)
            return RunResult(run_dir, True, "", 0.0, [binary] + flags)

    for first in (False, True):
        runner = Runner()
        b = Baselines(runner, str(tmp_path / str(first)))
        b._build = lambda: (True, "", "train")
        flags = ["--steps", "6"]
        runs = [b.get(flags, 6, save=first), b.get(flags, 6, save=True), b.get(flags, 6)]
        assert len(runner.runs) == (1 if first else 2), runner.runs
        assert runner.runs[-1][-2:] == ["--save", os.path.join(runs[1].dir, CHECKPOINT)], runner.runs
        assert runs[2] is runs[1] and runs[1].dir.endswith("-save")


# ------------------------------------------------------------ resource limits

def rubric_with_limits(tmp_path, **limits):
    rubric = json.loads(json.dumps(RUBRIC))
    rubric["limits"].update(limits)
    path = tmp_path / "rubric.json"
    manifest.save(rubric, str(path))
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


# ------------------------------------------------------- which stages a plain grade.py grades

def test_plain_grade_skips_the_bonus_stages_left_as_their_starters(tmp_path):
    """With no --stage the grader grades every core stage and the bonus stages the student started: changed
    from the starter as shipped (stages/NN/.starter.sha256), or carried (hw_fsdp.starter.c beside it); one
    line names the others. --stage grades a stage whatever its file holds."""
    tree = tmp_path / "copy"
    by_id = {s.id: s for s in manifest.stages()}
    bonus = [s for s in STAGES if RUBRIC["stages"][s].get("bonus")]
    assert len(bonus) >= 3, bonus
    untouched, changed, carried = bonus[0], bonus[1], bonus[2]  # any further bonus stage has no file at all
    for sid in (untouched, changed, carried):
        d = tree / "stages" / by_id[sid].dir
        d.mkdir(parents=True)
        src = os.path.join(ROOT, "stages", by_id[sid].dir)
        for name in ("hw_fsdp.c", manifest.STARTER_RECORD):
            shutil.copyfile(os.path.join(src, name), str(d / name))
    with open(str(tree / "stages" / by_id[changed].dir / "hw_fsdp.c"), "a") as fh:
        fh.write("/* a first line of my own */\n")
    shutil.copyfile(os.path.join(ROOT, "stages", by_id[carried].dir, "hw_fsdp.c"),
                    str(tree / "stages" / by_id[carried].dir / "hw_fsdp.starter.c"))
    out, res = grade(tmp_path / "out", "--tree", tree)
    graded = sorted(res["stages"])
    core = [s for s in STAGES if not RUBRIC["stages"][s].get("bonus")]
    assert graded == sorted(core + [changed, carried]), graded
    assert res["skipped"][untouched] == "unchanged from its starter", res["skipped"]
    assert ("bonus stage %s skipped: unchanged from its starter; `make grade STAGE=%s` grades one" % (untouched, untouched)
            in out.splitlines()), out
    assert "Score: 0/%s + bonus 0/" % res["max_score"] in out
    out, res = grade(tmp_path / "one", "--tree", tree, "--stage", untouched)
    assert sorted(res["stages"]) == [untouched] and "skipped" not in out
    assert res["stages"][untouched]["run"]["reason"].startswith("TODO not implemented:")
    assert re.search(r"^Score: bonus 0/[0-9.]+ \(stage %s\)$" % untouched, out, re.M), out


def test_score_line_reads_right_with_only_bonus_stages():
    from gradelib.cli import score_line
    a, b = [s for s in STAGES if RUBRIC["stages"][s].get("bonus")][:2]
    assert score_line(0, 0, 4.5, 4.5, [a], False) == "Score: bonus 4.5/4.5 (stage %s)" % a
    assert score_line(20, 22, 4.5, 9, [a, b], True) == "Score: 20/22 + bonus 4.5/9 (stages %s, %s)" % (a, b)
    assert score_line(3, 22, 0, 0, [], True) == "Score: 3/22"


def test_starter_records_match_the_starters():
    """Each stage's .starter.sha256 is its shipped starter's (tools/make_starters.py writes both; make test's
    make_starters.py --check keeps them in step), so a plain `make grade` in the instructors' tree, whose stages/
    are the starters, grades the core stages only."""
    for st in manifest.stages():
        assert st.started(ROOT) == (False, "unchanged from its starter"), st.id


def test_every_stage_grades_the_untouched_bonus_starters_too(tmp_path):
    """--every-stage: the plain grade's skipping turned off (the bonus starters then stop at their TODOs)."""
    out, res = grade(tmp_path, "--every-stage")
    assert sorted(res["stages"]) == STAGES and res["skipped"] == {} and "skipped" not in out
    for stage in STAGES:
        assert res["stages"][stage]["run"]["reason"].startswith("TODO not implemented:"), stage


def test_lead_order_says_the_cause_before_what_it_moves():
    """lead_order, on made-up failures: a run the runtime stopped with its diagnosis first, then the checks by how
    directly they name a cause (Check.tier), within a tier the one whose failure shows in the earlier step, then
    the rubric's order; a variant's run that failed without a diagnosis (NaN, a crash) after them; a failed main run
    alone (its checks are ungraded)."""
    from gradelib.cli import FAILED_ITSELF, MAIN_RUN_FAILED, lead_order
    from gradelib.runner import RUNTIME_ERROR, RunResult
    ok = RunResult("d", True, "", 0.0, [])
    keys = list(RUBRIC["stages"]["12"]["checks"])
    tiers = {k: CHECKS[k].tier for k in keys}
    assert tiers["pp_collectives"] < tiers["peak_memory"] < tiers["loss"] and tiers["pp_schedule"] < tiers["pp_bubble"]
    own = dict.fromkeys(["loss", "peak_memory", "pp_bubble", "pp_collectives", "pp_schedule"], FAILED_ITSELF)
    order = lead_order(own, {}, keys, ok, {})
    assert order[:2] == ["pp_schedule", "pp_collectives"] and order[-1] == "loss", order  # tier, then the rubric
    # within a tier the earlier step leads, whatever the rubric's order
    both = {"grad_norm": FAILED_ITSELF, "clip": FAILED_ITSELF}
    assert lead_order(both, {"grad_norm": 3, "clip": 1}, keys, ok, {}) == ["clip", "grad_norm"]
    assert lead_order(both, {"grad_norm": 1, "clip": 1}, keys, ok, {}) == ["grad_norm", "clip"]
    # a variant's run: before everything when the runtime said why, after the checks when it did not
    stopped = RunResult("d", False, RUNTIME_ERROR + "race on rank 0: ...", 0.0, [])
    nan = RunResult("d", False, "loss not finite at step 1: ...", 0.0, [])
    failed = dict(own, host_waits="pp_4x2", dtensors="pp12_ac")
    order = lead_order(failed, {}, keys, ok, {"pp_4x2": stopped, "pp12_ac": nan})
    assert order[0] == "run:pp_4x2" and order[-1] == "run:pp12_ac" and order[1] == "pp_schedule", order
    assert lead_order(dict.fromkeys(keys), {}, keys, RunResult("d", False, RUNTIME_ERROR, 0.0, []), {}) == [
        MAIN_RUN_FAILED]
