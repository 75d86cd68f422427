"""make gradescope: the autograder zip set up and run as Gradescope does (setup.sh once, run_autograder
per submission, AUTOGRADER_ROOT standing in for /autograder), on fixture submissions: a solution, the
starter, a crashing one, a hanging one, a submission with no file, and a lone hw_fsdp.c for a one-stage
assignment. Every results.json must validate against Gradescope's results format (the schema below,
written from Gradescope's autograder specification) and score what the submission deserves.
Instructors only (the fixtures come from solutions/)."""
import json
import os
import shutil
import stat
import subprocess
import zipfile

import jsonschema
import pytest

import class_fixtures as cf
import make_gradescope
from helpers import SOLVED, sandbox_tmp

VIS = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
FMT = {"enum": ["text", "html", "simple_format", "md", "ansi"]}
TEST = {"type": "object", "additionalProperties": False,
        "required": ["name", "score", "max_score"],
        "properties": {"score": {"type": "number"}, "max_score": {"type": "number", "minimum": 0},
                       "status": {"enum": ["passed", "failed"]}, "name": {"type": "string", "minLength": 1},
                       "name_format": FMT, "number": {"type": "string"}, "output": {"type": "string"},
                       "output_format": FMT, "tags": {"type": "array", "items": {"type": "string"}},
                       "visibility": VIS, "extra_data": {"type": "object"}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["score", "tests"],
          "properties": {"score": {"type": "number"}, "execution_time": {"type": "number", "minimum": 0},
                         "output": {"type": "string"}, "output_format": FMT, "test_output_format": FMT,
                         "test_name_format": FMT, "visibility": VIS, "stdout_visibility": VIS,
                         "extra_data": {"type": "object"}, "tests": {"type": "array", "items": TEST},
                         "leaderboard": {"type": "array"}}}

STAGES = [s.id for s in SOLVED[:2]]


def extract(zpath, dest):
    """unzip as Gradescope does it: the modes kept (setup.sh and run_autograder stay executable)."""
    with zipfile.ZipFile(zpath) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)


def autograder(tmp, name, stage_args):
    root = os.path.join(tmp, name)
    zpath = os.path.join(tmp, name + ".zip")
    make_gradescope.main(stage_args + ["--out", zpath])
    extract(zpath, os.path.join(root, "source"))
    env = dict(os.environ, AUTOGRADER_ROOT=root)
    p = subprocess.run([os.path.join(root, "source", "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return root, zpath


def submit(root, fill):
    """Run run_autograder on a submission that fill(submission_dir) writes; the results.json."""
    sub = os.path.join(root, "submission")
    shutil.rmtree(sub, ignore_errors=True)
    shutil.rmtree(os.path.join(root, "results"), ignore_errors=True)
    os.makedirs(sub)
    fill(sub)
    env = dict(os.environ, AUTOGRADER_ROOT=root, HWFSDP_GRADE_TIMEOUT="15")
    p = subprocess.run([os.path.join(root, "source", "run_autograder")], env=env, capture_output=True, text=True,
                       timeout=900, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.load(open(os.path.join(root, "results", "results.json")))
    jsonschema.validate(data, SCHEMA)
    return data


@pytest.fixture(scope="module")
def tmp(request):
    return sandbox_tmp(request, "test-gradescope-")  # reachable by the sandbox's users, wherever the clone is


@pytest.fixture(scope="module")
def two_stages(tmp):
    return autograder(tmp, "ag", [a for s in STAGES for a in ("--stage", s)])


def test_zip_layout(two_stages):
    _, zpath = two_stages
    with zipfile.ZipFile(zpath) as z:
        names = z.namelist()
        modes = {i.filename: (i.external_attr >> 16) for i in z.infolist()}
        cfg = json.loads(z.read("gradescope.json"))
    for f in ("setup.sh", "run_autograder"):
        assert f in names and modes[f] & stat.S_IXUSR, f
    assert cfg == {"stages": STAGES, "visibility": "visible"}
    assert not [n for n in names if n.startswith(("solutions/", "tests/"))]
    assert "grader/rubric.json" in names and "logs/reference/stage%s/metrics.jsonl" % STAGES[0] in names
    # the measured figures the grader reads beside the rubric (its overlap bars, its parity tolerances)
    assert {"grader/figures/overlap.json", "grader/figures/parity_spread.json"} <= set(names)


def _points(stage_ids):
    return sum(sum(s.checks.values()) for s in SOLVED if s.id in stage_ids)


def _check_tests(data, stage_ids):
    names = {s.id: s for s in SOLVED}
    expected = [(sid, k) for sid in stage_ids for k in names[sid].checks]
    assert len(data["tests"]) == len(expected)
    assert sum(t["max_score"] for t in data["tests"]) == _points(stage_ids)
    assert data["score"] == sum(t["score"] for t in data["tests"])
    for t in data["tests"]:
        assert (t["status"] == "passed") == (t["score"] == t["max_score"]), t
        assert t["output"], t


def test_solution_scores_full(two_stages):
    root, _ = two_stages
    data = submit(root, lambda sub: cf.write_tree(os.path.join(sub, "hwfsdp"), STAGES))
    _check_tests(data, STAGES)
    assert data["score"] == _points(STAGES) > 0, data["output"]


@pytest.mark.parametrize("kind,says", [("starter", "TODO not implemented"), ("crash", "crashed with SIGSEGV"),
                                       ("hang", "no progress after 15 s")])
def test_broken_submissions_score_zero_and_say_why(two_stages, kind, says):
    root, _ = two_stages
    if kind == "starter":
        fill = lambda sub: cf.write_tree(sub, STAGES, starter=True)  # noqa: E731
    else:
        fill = lambda sub: cf.write_tree(sub, STAGES, kind)  # noqa: E731
    data = submit(root, fill)
    _check_tests(data, STAGES)
    assert data["score"] == 0
    assert all(says in t["output"] for t in data["tests"]), [t["output"] for t in data["tests"]][:2]
    assert "(above)" not in json.dumps(data)  # Gradescope has no "above"
    assert all(t["output"].startswith("not graded: the run failed: ") for t in data["tests"]), data["tests"][0]


def test_empty_submission_says_what_to_upload(two_stages):
    root, _ = two_stages
    data = submit(root, lambda sub: open(os.path.join(sub, "notes.txt"), "w").write("hi\n"))
    _check_tests(data, STAGES)
    assert data["score"] == 0 and "No hw_fsdp.c found" in data["output"]


def test_one_stage_assignment_takes_a_lone_file(tmp):
    root, _ = autograder(tmp, "ag1", ["--stage", STAGES[0], "--visibility", "after_due_date"])
    data = submit(root, lambda sub: open(os.path.join(sub, "hw_fsdp.c"), "w").write(cf.source(STAGES[0])))
    _check_tests(data, STAGES[:1])
    assert data["score"] == _points(STAGES[:1])
    assert {t["visibility"] for t in data["tests"]} == {"after_due_date"}


def test_schema_rejects_what_gradescope_would():
    """The schema above is only worth something if it catches a malformed results file."""
    good = {"score": 1.0, "tests": [{"name": "a", "score": 1.0, "max_score": 1.0, "status": "passed"}]}
    jsonschema.validate(good, SCHEMA)
    for bad in ({"tests": []}, dict(good, visibility="public"),
                dict(good, tests=[{"name": "a", "score": 1.0, "max_points": 1.0}]),
                dict(good, tests=[{"name": "a", "score": "1", "max_score": 1.0}])):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
