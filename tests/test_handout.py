"""The student copy and its staged releases (tools/make_handout.py; instructors only: it needs
solutions/ and git). Release NN holds stages 01..NN, their reference logs and a rubric listing
only them; no release holds a solution of a stage it hands out (or of any later stage)."""
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
from helpers import BUILD, CORPUS, ROOT, STAGES

BEGIN = re.compile(r"^\s*/\* BEGIN SOLUTION: .* \(HANDOUT\.md#stage-(\d\d)\) \*/\s*$")
END = re.compile(r"^\s*/\* END SOLUTION \*/\s*$")

# .git is a folder in a clone, a file in a git worktree
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")), reason="needs the git checkout")


def solution_regions():
    """{stage: [region body, ...]}: the code between BEGIN/END SOLUTION markers, by the stage it solves."""
    out = {}
    for st in STAGES:
        lines, tag, body = open(st.solution_src()).read().splitlines(), None, []
        for line in lines:
            m = BEGIN.match(line)
            if m:
                tag, body = m.group(1), []
            elif END.match(line) and tag:
                text = "\n".join(l.strip() for l in body if l.strip())
                if text.count("\n") >= 1:  # two lines or more: a one-liner may occur by chance
                    out.setdefault(tag, []).append(text)
                tag = None
            elif tag:
                body.append(line)
    return out


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
    """The leak check above is only as good as its region parser: every stage has solution regions,
    and a later stage's starter does hold an earlier stage's solution (what releases are for)."""
    regions = solution_regions()
    assert sorted(regions) == [s.id for s in STAGES]
    later = "\n".join(l.strip() for l in open(STAGES[-1].starter_src()).read().splitlines() if l.strip())
    assert any(b in later for b in regions[STAGES[0].id])


def test_full_handout_holds_every_stage(tmp_path):
    out = str(tmp_path / "h.tar.gz")
    make_handout.main(["--out", out])
    names = members(out)
    assert {n.split("/")[2] for n in names if n.startswith("hwfsdp/stages/") and n.count("/") >= 3} == \
        {s.dir for s in STAGES}
    assert json.loads(read(out, "hwfsdp/grader/rubric.json")) == json.load(open(os.path.join(ROOT, "grader",
                                                                                             "rubric.json")))


def _carry(root, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "carry.py")] + list(args) + ["--root", root],
                          capture_output=True, text=True, timeout=60)


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
    assert open(os.path.join(here, "hw_fsdp.c")).read() == mine
    assert open(os.path.join(here, "hw_fsdp.starter.c")).read() == starter
    listed = [l for l in p.stdout.splitlines() if l.startswith("  - ")]
    stubs = re.findall(r'hw_todo\("([^"]*)"', starter)
    assert len(stubs) == starter.count("/* TODO(stage %s):" % cur.id) > 0
    assert len(listed) == len(stubs)
    for line, what in zip(listed, stubs):
        assert what in line and "HANDOUT.md#stage-%s" % cur.id in line, line
    assert "TODO stub" not in p.stdout  # a finished stage 02 file: no warning

    # carried already: one line, exit 2, nothing touched; FORCE keeps the replaced file
    open(os.path.join(here, "hw_fsdp.c"), "a").write("/* stage 03 work */\n")
    p = _carry(root, cur.id)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "carried already" in p.stderr
    assert open(os.path.join(here, "hw_fsdp.c")).read().endswith("/* stage 03 work */\n")
    p = _carry(root, cur.id, "--force")
    assert p.returncode == 0, p.stderr
    assert open(os.path.join(here, "hw_fsdp.c.bak")).read().endswith("/* stage 03 work */\n")
    assert open(os.path.join(here, "hw_fsdp.c")).read() == mine

    # the carried file trains on stage 03's flags
    binary = str(tmp_path / "train")
    b = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=" + os.path.join(here, "hw_fsdp.c"),
                        "OUT=" + binary], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout + b.stderr
    r = subprocess.run([binary, "--flavor", "tiny", "--world", "2", "--seq-len", "16", "--batch-size", "1",
                        "--steps", "2", "--data", CORPUS, "--out", str(tmp_path / "run"), "--quiet"] + cur.flags_at(2),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr


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
