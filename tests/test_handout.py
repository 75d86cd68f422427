"""The student copy and its staged releases (tools/make_handout.py; instructors only: it needs
solutions/ and git). Release NN holds stages 01..NN, their reference logs and a rubric listing
only them; no release holds a solution of a stage it hands out (or of any later stage)."""
import json
import os
import re
import sys
import tarfile

import pytest

from helpers import ROOT, STAGES

sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_handout  # noqa: E402

BEGIN = re.compile(r"^\s*/\* BEGIN SOLUTION: .* \(HANDOUT\.md#stage-(\d\d)\) \*/\s*$")
END = re.compile(r"^\s*/\* END SOLUTION \*/\s*$")

pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs the git checkout")


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
