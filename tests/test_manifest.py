"""The stage manifest (grader/rubric.json, read through grader/manifest.py) is the only
place that lists the stages: the tree agrees with it, its Makefile include says what it
says, a broken entry is one clear line, and no code file lists stages on its own."""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import BUILD, ROOT, STAGES, manifest

# Code that may name stage folders: the manifest itself, the stages' own files
# (generated banners), published logs and documentation are not code.
CODE = re.compile(r"(\.(py|c|h|cu|sh|mk)|/Makefile|^Makefile|^hwfsdp)$")
ALLOWED = ("grader/rubric.json", "grader/manifest.py", "solutions/", "stages/", "logs/",
           "tests/test_manifest.py")  # this file: the lint's own examples


def code_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: %s" % out.stderr.strip())
    return [f for f in out.stdout.split() if CODE.search(f) and not f.startswith(ALLOWED)
            and os.path.isfile(os.path.join(ROOT, f))]


def test_tree_matches_manifest():
    """Every solutions/ and stages/ folder is a manifest stage (the manifest may list more:
    a student release ships only some)."""
    dirs = {s.dir for s in STAGES}
    for top in ("solutions", "stages"):
        path = os.path.join(ROOT, top)
        if os.path.isdir(path):
            extra = sorted(set(os.listdir(path)) - dirs)
            assert not extra, "%s/%s is not in grader/rubric.json's stages" % (top, extra[0])
    assert [s.id for s in STAGES] == sorted(s.id for s in STAGES)


def test_makefile_include_is_the_manifest():
    subprocess.run(["make", "-s", os.path.relpath(os.path.join(BUILD, "stages.mk"), ROOT),
                    "BUILD=" + os.path.relpath(BUILD, ROOT)], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(BUILD, "stages.mk")) as fh:
        text = fh.read()
    assert text == manifest.makefile()
    assert "STAGE_DIRS := " + " ".join(s.dir for s in STAGES) + "\n" in text
    for s in STAGES:
        assert "STAGE_FLAGS_%s := %s\n" % (s.dir, " ".join(s.flags)) in text


def test_no_code_file_names_a_stage_folder():
    """Paths are built from the manifest (Stage.dir, Stage.solution_src(), $(STAGE_DIRS))."""
    names = [s.dir for s in STAGES]
    found = []
    for f in code_files():
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                found += ["%s:%d: %s" % (f, n, d) for d in names if d in line]
    assert not found, "stage folders named outside the manifest:\n" + "\n".join(found)


# Two or more stage numbers in one literal list, set, or dict, or a shell `case` on them:
# how a stage list written by hand looks.
LITERAL_LIST = re.compile(r"""["']\d\d["']\s*,\s*["']\d\d["']"""        # "02", "03"
                          r"""|["']\d\d["']\s*:.*["']\d\d["']\s*:"""     # {"01": .., "05": ..}
                          r"""|\b\d\d\*\).*\b\d\d\*\)""")                # case $s in 01*) ..;; 05*)


def test_no_code_file_lists_stages():
    found = []
    for f in code_files():
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if LITERAL_LIST.search(line):
                    found.append("%s:%d: %s" % (f, n, line.strip()))
    assert not found, "stages listed outside the manifest:\n" + "\n".join(found)


def test_the_lint_finds_what_it_looks_for():
    """The two checks above are only as good as their patterns: they must fire on the
    shapes of stage lists this project used to have."""
    for text in ('for s in ["02", "03", "04", "05", "06"]:', 'FLAGS = {"01": ["--forward-only"], "05": ["--ac"]}',
                 "case $s in 01*) x;; 05*) y;; esac"):
        assert LITERAL_LIST.search(text), text
    for text in ('solution_bin("04")', 'grade("--stage", "01")', "x = 0.05, y = 10",
                 '["--seq-len", "32", "--batch-size", "2", "--steps", "10"]', 'ov.get("03", ov["02"])'):
        assert not LITERAL_LIST.search(text), text


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["stages"].update({"7": r["stages"]["01"]}), 'stages.7 must be named by its two-digit number'),
    # stage 01 is in every release (make handout RELEASE=01 holds it alone)
    (lambda r: r["stages"]["01"].update(dir="01 forward"), 'stages.01.dir must be "01_<name>"'),
    (lambda r: r["stages"]["01"].update(dir="02_forward"), 'stages.01.dir must be "01_<name>"'),
    (lambda r: r["stages"]["01"].update(flags="--ac"), "stages.01.flags must be a list of strings"),
    (lambda r: r["stages"]["01"].update(prefetch=["sideways"]), "stages.01.prefetch must be a list of forward / backward"),
    (lambda r: r.update(main_job={"stage": "99"}), "main_job.stage must be one of the stages"),
    (lambda r: r["stages"]["01"].update(builds_on="01"), "stages.01.builds_on must be an earlier stage"),
    (lambda r: r["stages"].update({"99": dict(r["stages"]["01"], dir="99_more")}),
     "stages.99.builds_on must be the earlier stage this one builds on"),
    (lambda r: r.update(stages={}), "stages must be a non-empty JSON object"),
])
def test_a_broken_entry_is_one_clear_line(tmp_path, edit, message):
    import copy
    import json
    rubric = copy.deepcopy(manifest.load_json())
    edit(rubric)
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    with pytest.raises(manifest.ManifestError) as e:
        manifest.rubric(str(path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "manifest.py"), "list"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0
    assert p.stdout.splitlines() == [" ".join([s.id, s.dir] + s.flags) for s in STAGES]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "manifest.py"), "bogus"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith("usage:")


def test_handout_explains_every_check():
    """HANDOUT.md's Grading section explains every check under the name the grader prints: each
    name appears in a bold label (the list of what the checks mean)."""
    from gradelib.checks import CHECKS
    with open(os.path.join(ROOT, "HANDOUT.md"), encoding="utf-8") as fh:
        text = fh.read()
    grading = text[text.index("## Grading"):text.index("## Traces and snapshots")]
    words = " | ".join(" ".join(b.split()) for b in re.findall(r"\*\*(.+?)\*\*", grading, re.S)).lower()
    names = [c.label for c in CHECKS.values()]
    missing = [n for n in names if n.lower() not in words]
    assert not missing, "checks HANDOUT.md#grading does not name: %s" % missing


def test_handout_score_examples_match_the_rubric():
    """A score line HANDOUT.md shows as an example ("Score: 22/22 + bonus 8.75/8.75 (stages 07, 08)") has the
    rubric's totals: the core stages' points, the bonus stages' and their numbers, as the grader prints them.
    A staged release's rubric lists fewer stages than the handout describes: nothing to compare there."""
    with open(os.path.join(ROOT, "HANDOUT.md"), encoding="utf-8") as fh:
        text = " ".join(fh.read().split())
    described = set(re.findall(r'<a id="stage-(\d\d)"></a>', text))
    if described - {st.id for st in STAGES}:
        pytest.skip("a staged release: its rubric lists stages %s of the handout's %s"
                    % (", ".join(st.id for st in STAGES), ", ".join(sorted(described))))
    core = sum(sum(st.spec["checks"].values()) for st in STAGES if not st.spec.get("bonus"))
    bonus = [st for st in STAGES if st.spec.get("bonus")]
    fmt = lambda x: ("%g" % x)  # noqa: E731  (the grader's points: 4.5, 22)
    examples = re.findall(r"Score: (\d[\d.]*)/(\d[\d.]*)(?: \+ bonus (\d[\d.]*)/(\d[\d.]*) \(stages? ([\d, ]+)\))?", text)
    assert examples, "HANDOUT.md shows no example score line"
    for got, total, bgot, btotal, which in examples:
        assert got == total == fmt(core), (got, total, core)
        if bonus:
            assert bgot == btotal == fmt(sum(sum(st.spec["checks"].values()) for st in bonus)), (bgot, btotal)
            assert which.replace(" ", "").split(",") == [st.id for st in bonus], which


def test_flags_at_another_world_resize_only_the_mesh():
    """A stage's flags run at any world (tests, sanitizers, bench): a 2-D --mesh keeps its shard size where it
    divides the world and becomes 1 x world where it does not; no other flag changes."""
    st = manifest.Stage("99", {"dir": "99_x", "flags": ["--ac", "--mesh=2x2"]})
    assert st.flags_at(4) == ["--ac", "--mesh=2x2"]
    assert st.flags_at(6) == ["--ac", "--mesh=3x2"]
    assert st.flags_at(2) == ["--ac", "--mesh=1x2"]
    assert st.flags_at(3) == ["--ac", "--mesh=1x3"]
    assert st.flags_at(1) == ["--ac", "--mesh=1x1"]
    assert [st.shards_at(w) for w in (1, 2, 3, 4, 6)] == [1, 2, 3, 2, 2]
    plain = manifest.Stage("98", {"dir": "98_y", "flags": ["--reshard-after-forward=false"]})
    assert plain.flags_at(3) == plain.flags and plain.shards_at(3) == 3


# ------------------------------------------------------------------ flag coverage (rubric.json "flags")

# the variants issue 33 added so that every interacting pair of settings is graded together
PAIR_VARIANTS = ["sync_every_keep_params", "accum_zero2_ac", "accum_zero2_sync_every", "mp_zero2_ac",
                 "mp_zero2_reduce_bf16", "hsdp_zero2_ac", "all_pre", "all_post", "all_none", "zero2_pre",
                 "zero2_post", "zero2_none"]


def _need_stages(*ids):
    """Skip where a staged release's rubric lists fewer stages (its variants go with them)."""
    missing = [i for i in ids if i not in manifest.rubric()["stages"]]
    if missing:
        pytest.skip("a staged release: no stage %s in its rubric" % ", ".join(missing))


def _rubric_copy():
    import copy
    return copy.deepcopy(manifest.rubric())


def test_every_setting_and_interacting_pair_is_graded():
    """Every flag setting a stage honours is set by one of its graded runs (the grading configuration or a
    variant), and every pair of settings that change a common hook by one run together."""
    assert manifest.flag_coverage(manifest.rubric()) == []


def test_flag_coverage_fails_without_the_pair_variants():
    """The coverage property is not vacuous: the variants before issue 33 graded each flag alone, and the
    check names what that leaves out (the pairs the unseen bugs lived in among them)."""
    _need_stages("06", "07", "08", "09", "10")
    r = _rubric_copy()
    for s in r["stages"].values():
        s["variants"] = [v for v in s.get("variants", []) if v not in PAIR_VARIANTS]
    problems = manifest.flag_coverage(r)
    said = "\n".join(problems)
    assert "stage 07: no graded run sets both --grad-sync=every and --reshard-after-backward=false" in said
    assert "stage 08 honours --reshard-after-forward but no graded run sets --reshard-after-forward=false" in said
    assert "stage 10: no graded run sets both --single-comm-stream and --offload-params" in said
    # each pair variant is needed: without it some pair or setting goes ungraded
    for v in PAIR_VARIANTS:
        r = _rubric_copy()
        for s in r["stages"].values():
            s["variants"] = [x for x in s.get("variants", []) if x != v]
        assert manifest.flag_coverage(r), "%s covers nothing no other run covers" % v


def test_a_new_flag_needs_a_graded_run():
    """A stage that gains a flag (a setting in rubric.json "flags" it honours) fails coverage until a graded
    run sets it, with every flag it interacts with."""
    _need_stages("06")
    r = _rubric_copy()
    r["flags"]["--single-comm-stream"]["changes"].append("post_forward")
    r["stages"]["06"]["honours"].append("--single-comm-stream")
    problems = manifest.flag_coverage(r)
    assert "stage 06 honours --single-comm-stream but no graded run sets --single-comm-stream" in problems
    assert any(p.startswith("stage 06: no graded run sets both --ac and --single-comm-stream") for p in problems)


def _reads(src, field):
    """The solution reads the contract field (cfg->field, mod->field, cfg->mp.field, cfg->mesh->field)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", open(src).read(), flags=re.S)  # code, not comments
    return re.search(r"(->|\.)%s\b" % field, text) is not None


@pytest.mark.parametrize("stage", [s.id for s in STAGES])
def test_honours_is_what_the_solution_reads(stage):
    """A stage honours a flag exactly when its solution reads the contract field the flag sets
    (manifest.FLAG_FIELDS), and --ac from the stage whose own flags first ask for it on (every later
    solution carries that stage's training state): a stage that starts reading another field fails here
    until the manifest says it honours the flag, and then the coverage test until a graded run sets it."""
    s = manifest.stage(stage)
    src = s.solution_src()
    if not os.path.isfile(src):
        pytest.skip("%s is not in this release" % os.path.relpath(src, ROOT))
    first_ac = min(t.id for t in STAGES if "--ac" in t.flags)
    derived = {flag for flag, field in manifest.flag_fields(s).items() if _reads(src, field)}
    if stage >= first_ac:
        derived.add("--ac")
    assert sorted(derived) == sorted(s.honours), "stage %s's solution reads the fields of %s" % (stage, sorted(derived))
    # every flag the manifest names has a field (or is --ac): the table covers the flags the rubric grades
    assert set(manifest.rubric()["flags"]) - {"about", "--ac"} <= set(manifest.FLAG_FIELDS)


def test_stage_01_is_graded_where_two_ranks_own_no_rows(tmp_path):
    """Sharding follows torch.chunk on dim 0: ceil(d0 / W) rows a rank, the trailing ranks fewer or none. Some
    graded run of the first stage (its configuration or a variant) has a param that two ranks own no rows of, and
    one of them where rank x ceil(d0 / W) is not d0 (where an empty rank starts), so no wrong row_offset rule for
    an empty rank passes by luck. The params' first dims come from the run.json a one-step baseline writes."""
    from gradelib.rubric import stage_config
    from gradelib.util import chunk
    rubric = manifest.rubric()
    first = STAGES[0].id
    model_keys = ("flavor", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of")
    found = []
    for v in [None] + list(rubric["stages"][first].get("variants", [])):
        cfg = stage_config(rubric, first, v)
        out = tmp_path / (v or "main")
        cmd = [os.path.join(BUILD, "baseline", "train"), "--world", "1", "--seq-len", "16", "--batch-size", "1",
               "--steps", "1", "--profile-steps", "0", "--quiet", "--out", str(out)]
        for k in model_keys:
            if k in cfg:
                cmd += ["--" + k.replace("_", "-"), str(cfg[k])]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        with open(str(out / "run.json")) as fh:
            m = json.load(fh)
        head_dim = m["dim"] // m["n_heads"]
        rows = {"vocab": m["vocab_size"], "dim": m["dim"], "kv": m["n_kv_heads"] * head_dim, "hidden": m["hidden_dim"]}
        world = cfg["world"]
        for name, d0 in rows.items():
            empty = [r for r in range(world) if chunk(d0, world, r)[2] == 0]  # (padded, start, rows) of rank r
            if len(empty) >= 2 and any(chunk(d0, world, r)[1] != d0 for r in empty):
                found.append((v, name, d0, world, empty))
    assert found, "no graded run of stage %s has a param with two ranks that own no rows" % first


def test_flag_stage_is_the_first_that_teaches_it():
    """manifest.flag_stage (the grader's map from the runtime's flags to the course's stages): for every flag a
    stage honours or grades with, the stage it names uses the flag and no earlier stage does; the runner adds
    it to a runtime error that names the flag."""
    from gradelib.runner import taught_in
    stages = manifest.stages()

    def uses(s, flag):
        return flag in s.honours or any(f.split("=", 1)[0] == flag for f in s.flags)
    flags = {f for s in stages for f in s.honours} | {f.split("=", 1)[0] for s in stages for f in s.flags}
    assert flags
    for flag in sorted(flags):
        got = manifest.flag_stage(flag)
        assert got is not None and uses(got, flag), flag
        assert not any(uses(s, flag) for s in stages if s.id < got.id), flag
        assert taught_in("error: %s: something" % flag) == " (%s: stage %s)" % (flag, got.id)
    assert manifest.flag_stage("--no-such-flag") is None and taught_in("error: out of memory") == ""


def test_a_flat_stage_names_its_split_variants_as_it_splits():
    """A variant that changes how params split (another world, other KV heads) and that per-param stages run too
    says rows in its label; a flat stage splits whole units, so each such variant it runs carries a flat_label,
    which the grader prints for that stage and only for it."""
    data = manifest.rubric()
    split_keys = {"world", "n_kv_heads", "n_heads", "dim", "vocab_size"}
    flat = [sid for sid, s in data["stages"].items() if s.get("flat")]
    if not flat:
        pytest.skip("this tree has no flat stage")
    for sid in flat:
        for v in data["stages"][sid].get("variants", []):
            spec = data["variants"][v]
            shared = any(v in s.get("variants", []) for s in data["stages"].values() if not s.get("flat"))
            if shared and split_keys & set(spec.get("config", {})):
                assert spec.get("flat_label"), "variant %s splits params (%s) but has no flat_label for stage %s" % (
                    v, ", ".join(sorted(split_keys & set(spec["config"]))), sid)
                assert manifest.variant_label(data, v, sid) == spec["flat_label"]
    for sid, s in data["stages"].items():
        if not s.get("flat"):
            for v in s.get("variants", []):
                assert manifest.variant_label(data, v, sid) == data["variants"][v]["label"], (sid, v)
