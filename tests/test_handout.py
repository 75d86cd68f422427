"""The student copy and its staged releases (tools/make_handout.py; instructors only: it needs
solutions/ and git). The full handout's starters hold no line of any stage's solution regions.
Release NN holds stages 01..NN, their reference logs and a rubric listing only them; its
starters hold the earlier stages' solutions (unless --no-earlier-solutions), never one of a
stage it hands out (or of any later stage)."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

import make_handout
import manifest
from gradelib.rubric import load_rubric
from helpers import BUILD, CORPUS, ROOT, STAGES

BEGIN = re.compile(r"^\s*/\* BEGIN SOLUTION: .* \(HANDOUT\.md#stage-(\d\d)\) \*/\s*$")
END = re.compile(r"^\s*/\* END SOLUTION \*/\s*$")

# .git is a folder in a clone, a file in a git worktree
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")), reason="needs the git checkout")


def solution_regions():
    """{stage: [region body, ...]}: the code between BEGIN/END SOLUTION markers, by the stage it solves (a nested
    region's lines count for the inner and the outer one)."""
    out = {}
    for st in STAGES:
        open_ = []  # [tag, body] of every region the line is in
        for line in open(st.solution_src()).read().splitlines():
            m = BEGIN.match(line)
            if m:
                open_.append([m.group(1), []])
            elif END.match(line) and open_:
                tag, body = open_.pop()
                text = "\n".join(l.strip() for l in body if l.strip())
                if text.count("\n") >= 1:  # two lines or more: a one-liner may occur by chance
                    out.setdefault(tag, []).append(text)
            else:
                for _, body in open_:
                    body.append(line)
    return out


TRIVIAL = {"return 0;", "return;", "break;", "continue;", "} else {", "else {", "};"}


def code_lines(text):
    """[(significant line, inside a SOLUTION region)] of a C file: comments stripped (a block comment may span
    lines), whitespace collapsed, braces-only, trivial and short (under 12 characters) lines left out."""
    out, depth, in_comment = [], 0, False
    for line in text.splitlines():
        if BEGIN.match(line):
            depth += 1
            continue
        if END.match(line):
            depth = max(depth - 1, 0)
            continue
        code, i = [], 0
        while i < len(line):
            if in_comment:
                j = line.find("*/", i)
                if j < 0:
                    break
                in_comment, i = False, j + 2
            elif line.startswith("/*", i):
                in_comment, i = True, i + 2
            elif line.startswith("//", i):
                break
            else:
                code.append(line[i])
                i += 1
        c = " ".join("".join(code).split())
        if len(c) >= 12 and c not in TRIVIAL and c.strip("{}; ") != "":
            out.append((c, depth > 0))
    return out


def answer_lines(solution_text):
    """The significant lines inside the solution's regions that occur nowhere outside them in that solution."""
    lines = code_lines(solution_text)
    return {c for c, inside in lines if inside} - {c for c, inside in lines if not inside}


def teardown_removed(text):
    """The starter without its fsdp_destroy (the teardown every starter gives: freeing the state the stages
    allocate, e.g. the AllGatherState, reveals nothing of how a stage uses it)."""
    m = re.search(r"^void fsdp_destroy\(Fsdp \*f\) \{\n.*?^\}\n?", text, re.S | re.M)
    return text[:m.start()] + text[m.end():] if m else text


def leaked_answers(starters, solutions):
    """[(solution stage M, starter stage N, line)] for every answer line of solution M (answer_lines) found in a
    starter of stage N >= M. starters, solutions: {stage id: text}."""
    leaks = []
    for m_id, sol in sorted(solutions.items()):
        answers = answer_lines(sol)
        for n_id, starter in sorted(starters.items()):
            if n_id < m_id:
                continue
            for c in sorted(answers & {c for c, _ in code_lines(teardown_removed(starter))}):
                leaks.append((m_id, n_id, c))
    return leaks
def members(path):
    with tarfile.open(path) as tar:
        return tar.getnames()


def read(path, name):
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read().decode()


@pytest.mark.parametrize("release", [s.id for s in STAGES])
def test_release_holds_its_stages_and_no_later_solution(release, tmp_path):
    out = str(tmp_path / "r.tar.gz")
    make_handout.main(["--release", release, "--out", out])
    names = members(out)
    kept = [s for s in STAGES if s.id <= release]
    stage_dirs = {n.split("/")[2] for n in names if n.startswith("hwfsdp/stages/") and n.count("/") >= 3}
    assert stage_dirs == {s.dir for s in kept}
    refs = {n.split("/")[3] for n in names if n.startswith("hwfsdp/logs/reference/stage") and n.count("/") >= 4}
    assert refs == {"stage" + s.id for s in kept}
    assert not [n for n in names if n.startswith(("hwfsdp/solutions/", "hwfsdp/tests/mutants/"))]
    rubric = json.loads(read(out, "hwfsdp/grader/rubric.json"))
    assert sorted(rubric["stages"]) == [s.id for s in kept]
    # the measured figures ship beside it, cut to the kept stages, and the release's grader accepts the pair
    (tmp_path / "grader" / "figures").mkdir(parents=True)
    for name in manifest.FIGURES:
        rel = "grader/" + manifest.FIGURES[name][0]
        (tmp_path / rel).write_text(read(out, "hwfsdp/" + rel))
    (tmp_path / "grader" / "rubric.json").write_text(read(out, "hwfsdp/grader/rubric.json"))
    shipped = load_rubric(str(tmp_path / "grader" / "rubric.json"))
    assert sorted(shipped["parity_spread"]["runs"]) == [s.id for s in kept]
    assert shipped["overlap_figures"] == manifest.rubric()["overlap_figures"]
    # a starter holds the solutions of the stages before it, so a release may hold a stage's
    # solution only if that stage was handed out in an earlier release
    regions = solution_regions()
    for s in kept:
        starter = "\n".join(l.strip() for l in read(out, "hwfsdp/stages/%s/hw_fsdp.c" % s.dir).splitlines()
                            if l.strip())
        for tag, bodies in regions.items():
            if tag >= release:
                leaked = [b for b in bodies if b in starter]
                assert not leaked, "release %s's stage %s starter holds stage %s's solution:\n%s" % (
                    release, s.id, tag, leaked[0][:300])


def test_the_regions_are_found():
    """The leak checks are only as good as their region parser: every stage has solution regions, a staged
    release's later starter does hold an earlier stage's solution (what releases are for), and every earlier
    stage's answer lines are found in the old kind of starter (keep_earlier) while none is in the committed one."""
    import make_starters
    regions = solution_regions()
    assert sorted(regions) == [s.id for s in STAGES]
    last = STAGES[-1]
    kept, _ = make_starters.convert(open(last.solution_src()).read(), last.id, "x.c", keep_earlier=True)
    later = "\n".join(l.strip() for l in kept.splitlines() if l.strip())
    assert any(b in later for b in regions[STAGES[0].id])
    sols = {s.id: open(s.solution_src()).read() for s in STAGES}
    assert leaked_answers({last.id: kept}, sols)
    assert not leaked_answers({last.id: open(last.starter_src()).read()}, sols)


@pytest.fixture(scope="module")
def full_handout(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("handout") / "h.tar.gz")
    make_handout.main(["--out", out])
    return out


def test_full_handout_holds_every_stage(full_handout):
    out = full_handout
    names = members(out)
    assert {n.split("/")[2] for n in names if n.startswith("hwfsdp/stages/") and n.count("/") >= 3} == \
        {s.dir for s in STAGES}
    assert json.loads(read(out, "hwfsdp/grader/rubric.json")) == json.load(open(os.path.join(ROOT, "grader",
                                                                                             "rubric.json")))
    for path in manifest.figure_paths():  # the measured figures the grader reads beside it, as they are
        rel = os.path.relpath(path, ROOT)
        assert read(out, "hwfsdp/" + rel) == open(path, encoding="utf-8").read(), rel


def test_full_handout_starters_hold_no_solution_region(full_handout):
    """No starter of the full handout holds a line of any stage's solution: for every solution M, the significant
    lines inside its BEGIN/END SOLUTION regions (comments, whitespace and trivial lines left out) minus those that
    occur outside its regions too; no starter of a stage N >= M may contain one."""
    starters = {s.id: read(full_handout, "hwfsdp/stages/%s/hw_fsdp.c" % s.dir) for s in STAGES}
    sols = {s.id: open(s.solution_src()).read() for s in STAGES}
    leaks = leaked_answers(starters, sols)
    assert not leaks, "%d solution lines in the full handout's starters, e.g.\n%s" % (
        len(leaks), "\n".join("solution %s -> starter %s: %s" % l for l in leaks[:10]))


INSTRUCTOR_TARGETS = ("reference", "reference-check", "blas-check", "fsdp2-check", "record-stream-demo", "handout",
                      "gradescope", "starters")


def test_student_readme_lists_what_the_tarball_has(full_handout):
    """The README the student copy ships names nothing it lacks (solutions/, INSTRUCTORS.md, the instructors'
    make targets, grading a class), its students' commands come first (make run, grade, carry before make test),
    and it, the repo's README and HANDOUT.md name the two commands the same way: ./hwfsdp run and ./hwfsdp test."""
    readme = read(full_handout, "hwfsdp/README.md")
    names = members(full_handout)
    assert "solutions/" not in readme and "INSTRUCTORS.md" not in readme and "--class" not in readme, readme
    for target in INSTRUCTOR_TARGETS:
        assert "make %s`" % target not in readme and "make %s " % target not in readme, target
        assert "`make %s" % target in open(os.path.join(ROOT, "INSTRUCTORS.md")).read(), target
    for path in re.findall(r"\]\(([^)#]+)\)", readme):  # every link it holds is in the tarball
        assert "hwfsdp/" + path in names, path
    rows = re.findall(r"^\| `(make \w+|make)[` ]", readme, re.M)
    assert rows[:4] == ["make", "make run", "make grade", "make carry"] and rows[-1] == "make test", rows
    repo = open(os.path.join(ROOT, "README.md")).read()
    handout = open(os.path.join(ROOT, "HANDOUT.md")).read()
    for text in (readme, repo):
        two = text.split("## Two commands", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
        assert [l.split()[0:2] for l in two.strip().splitlines()] == [["./hwfsdp", "run"], ["./hwfsdp", "test"]], two
    used = set(re.findall(r"\./hwfsdp (\w+)", handout))
    assert used and used <= {"run", "test"}, used
    assert "<!-- instructors -->" in repo and "<!-- instructors -->" not in readme


def test_release_keeps_earlier_solutions_unless_asked(tmp_path):
    """A staged release's starter of stage N holds the solutions of the stages before N (today's choice for
    courses); --no-earlier-solutions ships the full handout's answer-free starters instead."""
    rel = STAGES[2]
    regions = solution_regions()
    flat = lambda text: "\n".join(l.strip() for l in text.splitlines() if l.strip())  # noqa: E731
    with_sol, without = str(tmp_path / "a.tar.gz"), str(tmp_path / "b.tar.gz")
    make_handout.main(["--release", rel.id, "--out", with_sol])
    make_handout.main(["--release", rel.id, "--no-earlier-solutions", "--out", without])
    starter = read(with_sol, "hwfsdp/stages/%s/hw_fsdp.c" % rel.dir)
    for earlier in STAGES[:2]:
        assert any(b in flat(starter) for b in regions[earlier.id]), earlier.id
    assert "TODO(stage %s)" % rel.id in starter and "TODO(stage %s)" % STAGES[0].id not in starter
    assert "staged release" in starter.split("*/", 1)[0]
    import manifest as mf
    for path in (with_sol, without):  # each starter's record is its own text's, so make grade tells it untouched
        for s in STAGES[:3]:
            record = read(path, "hwfsdp/stages/%s/%s" % (s.dir, mf.STARTER_RECORD))
            assert record == mf.starter_record(read(path, "hwfsdp/stages/%s/hw_fsdp.c" % s.dir)), (path, s.id)
    for s in STAGES[:3]:
        assert read(without, "hwfsdp/stages/%s/hw_fsdp.c" % s.dir) == open(s.starter_src()).read()
        assert read(without, "hwfsdp/stages/%s/README.md" % s.dir) == \
            open(os.path.join(ROOT, "stages", s.dir, "README.md")).read()
    sols = {s.id: open(s.solution_src()).read() for s in STAGES[:3]}
    assert not leaked_answers({s.id: read(without, "hwfsdp/stages/%s/hw_fsdp.c" % s.dir) for s in STAGES[:3]}, sols)


def _carry(root, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "carry.py")] + list(args) + ["--root", root],
                          capture_output=True, text=True, timeout=60)


def _added(stdout):
    """The lines of make carry's "Stage NN adds" list (its own TODOs)."""
    lines = stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if " adds, in the starter's order" in l) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def test_carry_moves_your_file_forward(tmp_path):
    """make carry STAGE=03: your stage 02 file becomes stage 03's hw_fsdp.c, the starter stays beside it,
    every TODO of stage 03's starter is listed with its HANDOUT anchor, and the carried file builds and
    trains on stage 03's configuration (the grader reads whatever hw_fsdp.c holds)."""
    root = str(tmp_path / "tree")
    shutil.copytree(os.path.join(ROOT, "stages"), os.path.join(root, "stages"))
    prev, cur = STAGES[1], STAGES[2]
    mine = open(prev.solution_src()).read() + "\n/* my own stage %s file */\n" % prev.id
    open(os.path.join(root, "stages", prev.dir, "hw_fsdp.c"), "w").write(mine)
    starter = open(cur.starter_src()).read()

    p = _carry(root, cur.id)
    assert p.returncode == 0, p.stderr
    here = os.path.join(root, "stages", cur.dir)
    carried = open(os.path.join(here, "hw_fsdp.c")).read()
    # your file, under a first comment that says what it now is (your own first comment stays below it)
    assert carried.endswith(mine) and carried.startswith("/* CARRIED into stage %s" % cur.id), carried[:400]
    banner = carried[:len(carried) - len(mine)]
    assert "stage-%s file" % prev.id in banner and "HANDOUT.md#stage-%s" % cur.id in banner
    assert open(os.path.join(here, "hw_fsdp.starter.c")).read() == starter
    listed = _added(p.stdout)
    stubs = re.findall(r'hw_todo\("([^"]*)", "HANDOUT\.md#stage-%s"' % cur.id, starter)
    assert len(stubs) == starter.count("/* TODO(stage %s):" % cur.id) > 0
    assert len(listed) == len(stubs)
    for line, what in zip(listed, stubs):
        assert what in line and "HANDOUT.md#stage-%s" % cur.id in line, line
    assert "warning:" not in p.stdout  # a finished stage 02 file: no warning

    # carried already: one line, exit 2, nothing touched; FORCE keeps the replaced file
    open(os.path.join(here, "hw_fsdp.c"), "a").write("/* stage 03 work */\n")
    p = _carry(root, cur.id)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "carried already" in p.stderr
    assert open(os.path.join(here, "hw_fsdp.c")).read().endswith("/* stage 03 work */\n")
    p = _carry(root, cur.id, "--force")
    assert p.returncode == 0, p.stderr
    assert open(os.path.join(here, "hw_fsdp.c.bak")).read().endswith("/* stage 03 work */\n")
    assert open(os.path.join(here, "hw_fsdp.c")).read() == carried
    # the advice never lays official code beside yours: the starter it names holds no answer of any stage
    assert "holds no answer" in p.stdout and "diff -u" in p.stdout

    # the carried file trains on stage 03's flags
    binary = str(tmp_path / "train")
    b = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=" + os.path.join(here, "hw_fsdp.c"),
                        "OUT=" + binary], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout + b.stderr
    r = subprocess.run([binary, "--flavor", "tiny", "--world", "2", "--seq-len", "16", "--batch-size", "1",
                        "--steps", "2", "--data", CORPUS, "--out", str(tmp_path / "run"), "--quiet"] + cur.flags_at(2),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_carry_follows_builds_on_and_renames_the_banner(tmp_path):
    """Each stage carries from its builds_on (a bonus stage from 06, not from the stage before it), and a carried
    starter's banner ("STARTER for stage ...") becomes one that says what the file now is; carrying it again
    (a file carried before) replaces the CARRIED banner instead of stacking a second one."""
    by_id = {s.id: s for s in STAGES}
    core = [s for s in STAGES if not s.spec.get("bonus")]
    assert STAGES[0].builds_on is None and all(b.builds_on == a.id for a, b in zip(core, core[1:]))
    # 07..10 each on 06; the pipeline's 11 on 07 (its gradient accumulation), 12 on 11; a bonus stage that
    # extends another bonus stage's file (13's flat params on 07's accumulation) carries from that earlier one
    assert all(s.builds_on == core[-1].id or (by_id[s.builds_on].spec.get("bonus") and s.builds_on < s.id)
               for s in STAGES if s.spec.get("bonus") and not s.pipeline)
    pipes = [s for s in STAGES if s.pipeline]
    assert all(b.builds_on == a.id for a, b in zip(pipes, pipes[1:]))
    assert not pipes or by_id[pipes[0].builds_on].spec.get("bonus")
    root = str(tmp_path / "tree")
    shutil.copytree(os.path.join(ROOT, "stages"), os.path.join(root, "stages"))
    six, nine = by_id["06"], by_id["09"]
    mine = open(six.solution_src()).read()
    open(os.path.join(root, "stages", six.dir, "hw_fsdp.c"), "w").write(mine)
    p = _carry(root, "09")
    assert p.returncode == 0, p.stderr
    assert "carried stages/%s/hw_fsdp.c -> stages/%s/hw_fsdp.c" % (six.dir, nine.dir) in p.stdout
    carried = open(os.path.join(root, "stages", nine.dir, "hw_fsdp.c")).read()
    assert carried.endswith(mine) and carried.startswith("/* CARRIED into stage 09")
    listed = _added(p.stdout)
    assert listed and all("HANDOUT.md#stage-09" in l for l in listed)
    # a carried file carried on: one banner, the newest
    p = _carry(root, "10")  # from 06 too
    assert p.returncode == 0, p.stderr
    p = _carry(root, STAGES[1].id)  # stage 01's untouched starter: its STARTER banner is replaced
    assert p.returncode == 0, p.stderr
    text = open(os.path.join(root, "stages", STAGES[1].dir, "hw_fsdp.c")).read()
    assert "STARTER for stage" not in text and text.count("CARRIED into stage") == 1, text[:300]
    p = _carry(root, STAGES[2].id)  # that carried file carried on
    assert p.returncode == 0, p.stderr
    text = open(os.path.join(root, "stages", STAGES[2].dir, "hw_fsdp.c")).read()
    assert text.count("CARRIED into stage") == 1 and text.startswith("/* CARRIED into stage %s" % STAGES[2].id)
    assert "stage-%s file" % STAGES[1].id in text.split("*/", 1)[0], text[:300]


def test_carry_lists_what_the_stages_in_between_add(tmp_path):
    """A stage that builds on one further back (11 on 07): make carry lists, besides the stage's own TODOs, every
    TODO(stage NN) of the stages in between in the starter (09's shard group), the earlier TODOs whose words
    changed since the starter the carried file answered (the shard group in place of the world), and, by the
    starter's line, the include, struct fields, functions and frees the carried file lacks."""
    by_id = {s.id: s for s in STAGES}
    cur = next((s for s in STAGES if s.builds_on and int(s.id) - int(s.builds_on) > 1
                and re.search(r"TODO\(stage (\d\d)\)", open(s.starter_src()).read())
                and any(s.builds_on < t < s.id for t in re.findall(r"TODO\(stage (\d\d)\)",
                                                                      open(s.starter_src()).read()))), None)
    if cur is None:
        pytest.skip("no stage whose starter holds TODOs of a stage between it and the one it builds on")
    prev = by_id[cur.builds_on]
    root = str(tmp_path / "tree")
    shutil.copytree(os.path.join(ROOT, "stages"), os.path.join(root, "stages"))
    here = os.path.join(root, "stages", prev.dir)
    shutil.copyfile(os.path.join(here, "hw_fsdp.c"), os.path.join(here, "hw_fsdp.starter.c"))  # carried there
    mine = open(prev.solution_src()).read()
    open(os.path.join(here, "hw_fsdp.c"), "w").write(mine)
    starter = open(cur.starter_src()).read()
    p = _carry(root, cur.id)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    marks = re.findall(r"/\* TODO\(stage (\d\d)\): (.*?)\.? \*/", starter)
    between = [(t, w) for t, w in marks if prev.id < t < cur.id]
    assert between
    for tag, what in between:  # stage 11: stage 09's shard group, in fsdp_init and the all-gather
        assert "%s  [hw_fsdp.starter.c:" % what in out and "HANDOUT.md#stage-%s]" % tag in out, (what, out)
    assert "also needs the work of stage %s" % between[0][0] in out, out
    old = set(re.findall(r"/\* TODO\(stage (\d\d)\): (.*?)\.? \*/", open(prev.starter_src()).read()))
    changed = [(t, w) for t, w in marks if t <= prev.id and (t, w) not in old]
    section = out.split("words differently", 1)[1].split("\n\n", 1)[0] if changed else ""
    assert [l for l in section.splitlines() if l.startswith("  - ")] == [
        l for l in section.splitlines() if l.startswith("  - ") and any(w in l for _, w in changed)]
    assert len([l for l in section.splitlines() if l.startswith("  - ")]) == len(changed)
    lacks = out.split("your file lacks", 1)[1].split("\n\n", 1)[0]
    for inc in re.findall(r'^#include [<"].*[>"]$', starter, re.M):
        assert (inc in lacks) == (inc not in mine), inc
    if cur.pipeline and not prev.pipeline:
        assert '#include "hw_pipe.h"' in lacks and "function pipe_schedule" in lacks, lacks
    for field in ("shard_pg", "srank, nshards"):
        if field in starter and field not in mine:
            assert "field: " in lacks and field in lacks, (field, lacks)
    for line in lacks.splitlines():  # each names the starter's line, which holds what it lists
        m = re.search(r"\[hw_fsdp\.starter\.c:(\d+)\]$", line.strip())
        if m and "function " in line:
            assert line.split("function ", 1)[1].split()[0] in starter.splitlines()[int(m.group(1)) - 1], line


def test_carry_warns_about_open_todos_and_refuses_bad_stages(tmp_path):
    root = str(tmp_path / "tree")
    shutil.copytree(os.path.join(ROOT, "stages"), os.path.join(root, "stages"))
    p = _carry(root, STAGES[1].id)  # stage 01's untouched starter still stops at its TODOs
    assert p.returncode == 0 and "warning: your stage %s file still has" % STAGES[0].id in p.stdout
    for bad, why in [(STAGES[0].id, "first stage"), ("99", "no such stage"), ("x", "no such stage")]:
        p = _carry(root, bad)
        assert p.returncode == 2 and why in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    shutil.rmtree(os.path.join(root, "stages", STAGES[3].dir))
    p = _carry(root, STAGES[4].id)
    assert p.returncode == 2 and "no such file" in p.stderr, p.stderr


def test_student_tree_builds_around_a_broken_stage(tmp_path):
    """In a student tree a stage file that does not compile yet is said once and left out: make all
    (so make run, make test and grading the other stages) goes on, and no stale binary of it is left."""
    out = str(tmp_path / "r.tar.gz")
    make_handout.main(["--release", STAGES[1].id, "--out", out])
    with tarfile.open(out) as tar:
        tar.extractall(str(tmp_path))
    tree = str(tmp_path / "hwfsdp")
    broken = STAGES[1].dir
    with open(os.path.join(tree, "stages", broken, "hw_fsdp.c"), "a") as fh:
        fh.write("\nthis is not C;\n")
    # reuse this checkout's runtime objects: only the stage binaries get linked
    build = os.path.join(tree, "build")
    prereqs = [os.path.relpath(p, BUILD) for p in
               [os.path.join(BUILD, "libhwfsdp.a")] + glob.glob(os.path.join(BUILD, "common", "driver", "*.o"))]
    for rel_path in prereqs:
        os.makedirs(os.path.dirname(os.path.join(build, rel_path)), exist_ok=True)
        shutil.copy2(os.path.join(BUILD, rel_path), os.path.join(build, rel_path))
    os.makedirs(os.path.join(build, "stages", broken), exist_ok=True)
    open(os.path.join(build, "stages", broken, "train"), "w").write("stale")
    assume_old = [a for p in prereqs for a in ("-o", "build/" + p)]
    p = subprocess.run(["make", "--no-print-directory", "stage-bins"] + assume_old, cwd=tree, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "✗ stages/%s/hw_fsdp.c does not build yet" % broken in p.stdout
    assert os.path.exists(os.path.join(build, "stages", STAGES[0].dir, "train"))
    assert not os.path.exists(os.path.join(build, "stages", broken, "train"))


def test_the_docs_say_what_each_stage_builds_on():
    """What HANDOUT.md and README.md say a stage builds on (make carry's source) is the manifest's builds_on
    (rubric.json): every "stage NN builds on stage MM", the handout's list of where each stage carries from and
    the README's carry row. A new stage or a changed builds_on fails here until the docs say it."""
    by_id = {s.id: s for s in STAGES}
    said = {}  # stage -> what a sentence says it builds on

    def claim(nn, mm, where):
        assert nn in by_id, "%s names stage %s, which the manifest does not have" % (where, nn)
        assert by_id[nn].builds_on == mm, "%s: stage %s builds on %s, the manifest says %s" % (
            where, nn, mm, by_id[nn].builds_on)
        said[nn] = mm
    texts = {}
    for doc in ("HANDOUT.md", "README.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            texts[doc] = fh.read()
        for nn, mm in re.findall(r"stage (\d\d) builds on stage (\d\d)", texts[doc]):
            claim(nn, mm, doc)
    # the handout's sentence: "02 to 07 from the stage before, each bonus stage 08, 09 and 10 from your stage 06, ..."
    m = re.search(r"Each stage carries\s+from the one it builds on: (.*?)\. ", texts["HANDOUT.md"], re.S)
    assert m, "HANDOUT.md no longer says where each stage carries from"
    sentence = " ".join(m.group(1).split())
    lo, hi = re.match(r"(\d\d) to (\d\d) from the stage before", sentence).groups()
    for n in range(int(lo), int(hi) + 1):
        claim("%02d" % n, "%02d" % (n - 1), "HANDOUT.md's carry sentence")
    for group, mm in re.findall(r"((?:\d\d(?:, | and ))*\d\d) from your stage (\d\d)", sentence):
        for nn in re.findall(r"\d\d", group):
            claim(nn, mm, "HANDOUT.md's carry sentence")
    assert set(said) >= {s.id for s in STAGES if s.builds_on}, "HANDOUT.md does not say what %s build on" % sorted(
        {s.id for s in STAGES if s.builds_on} - set(said))
    # README's carry row: "(NN−1; 06 for the bonus stages 08–10, 07 for 11, 11 for 12)"
    row = re.search(r"carry your file of the stage NN builds on \((.*?)\)", texts["README.md"]).group(1)
    named = set()
    for mm, a, b in re.findall(r"(\d\d) for the bonus stages (\d\d)–(\d\d)", row):
        for n in range(int(a), int(b) + 1):
            claim("%02d" % n, mm, "README.md's carry row")
            named.add("%02d" % n)
    for mm, nn in re.findall(r"(\d\d) for (\d\d)\b", row):
        claim(nn, mm, "README.md's carry row")
        named.add(nn)
    for s in STAGES:  # the rest: NN-1
        if s.builds_on and s.id not in named:
            assert int(s.builds_on) == int(s.id) - 1, "README.md's carry row says stage %s builds on the one before" % s.id


def test_the_handout_gives_each_stage_its_points():
    """Every stage's heading in HANDOUT.md ("## Stage 11 — ... (bonus, 4.25 points)") and the advanced track's
    score line say the points rubric.json gives: a check added to a stage (or its points changed) fails here
    until the handout says it."""
    rubric = load_rubric()
    with open(os.path.join(ROOT, "HANDOUT.md"), encoding="utf-8") as fh:
        text = fh.read()
    headings = dict(re.findall(r"^## Stage (\d\d) — .*\((?:bonus, )?([\d.]+) points\)$", text, re.M))
    assert set(headings) == {s.id for s in STAGES}, sorted(headings)
    for s in STAGES:
        points = sum(rubric["stages"][s.id]["checks"].values())
        assert float(headings[s.id]) == points, (s.id, headings[s.id], points)
    bonus = sum(sum(v["checks"].values()) for v in rubric["stages"].values() if v.get("bonus"))
    line = re.search(r"\+ bonus\s+([\d.]+)/([\d.]+) \(stages", text)
    assert line and float(line.group(1)) == float(line.group(2)) == bonus, (line and line.groups(), bonus)
