"""grade.py --class: a fixture class graded in one batch (instructors only: the fixtures are built from
solutions/). Two copies of the same solution (a folder and a tarball) must get the same full marks, the
starter and the misbehaving submissions 0, and none of them may disturb the batch: the reference logs,
the class's own files and the other students' results stay as they were, no process outlives the
grading, and every run directory goes back to the grader. A second, small class is graded on a stage
with overlap checks while every core is kept busy: the overlap figures are the modelled clock's, so the
points and the figures are those of an idle machine."""
import contextlib
import csv
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tarfile

import pytest

import class_fixtures as cf
import manifest
from gradelib import classroom
from gradelib.util import fmt_points, relpath
from helpers import ROOT, SOLVED, assert_overlap_figures, sandbox_tmp

STAGES = [s.id for s in SOLVED[:2]]  # stages 01-02: the misbehaving submissions need no more
# under load: the first stage with both overlap checks, and the one whose solution reads the lowest figures
_FIGURES = manifest.rubric()["overlap_figures"]["solutions"]
_BOTH = [s.id for s in SOLVED if {"ag_overlap", "rs_overlap"} <= set(s.checks)]
LOADED_STAGES = sorted({_BOTH[0], min(_BOTH, key=lambda s: min(f[0] for f in _FIGURES[s].values()))})
GRADE = os.path.join(ROOT, "grader", "grade.py")


def _files_under(path):
    out = {}
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), path)] = fh.read()
    return out


def _procs_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as fh:
                    if text.encode() in fh.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def _reachable_tmp(request):
    """A fresh folder the sandbox's users can reach (helpers.sandbox_tmp: not in the clone, which may sit in a
    mode-700 home)."""
    return pathlib.Path(sandbox_tmp(request, "test-class-"))


@pytest.fixture(scope="module")
def graded(request):
    tmp = _reachable_tmp(request)
    klass, out, ref = str(tmp / "submissions"), str(tmp / "out"), str(tmp / "reference")
    shutil.copytree(os.path.join(ROOT, "logs", "reference"), ref)  # a copy: a failed sandbox must not hurt main's
    rubric = manifest.load()
    rubric["limits"]["run_file_size_mib"] = 64  # the spamming submission hits it sooner
    rubric_path = str(tmp / "rubric.json")
    manifest.save(rubric, rubric_path)  # with its measured figures beside it (tmp/figures/)

    cf.write_tree(os.path.join(klass, "alice"), STAGES)
    cf.write_tree(str(tmp / "bob" / "hwfsdp"), STAGES)
    with tarfile.open(os.path.join(klass, "bob.tar.gz"), "w:gz") as tar:
        tar.add(str(tmp / "bob" / "hwfsdp"), arcname="hwfsdp")
    cf.write_tree(os.path.join(klass, "carol"), STAGES, starter=True)
    cf.write_tree(os.path.join(klass, "dave"), STAGES, "crash")
    cf.write_tree(os.path.join(klass, "eve"), STAGES, "hang")
    targets = [os.path.join(ref, "stage%s" % STAGES[0], "metrics.jsonl"), os.path.join(out, "intruder.txt"),
               os.path.join(out, "alice", "results.json"), os.path.join(ROOT, "grader", "rubric.json")]
    cf.write_tree(os.path.join(klass, "mallory"), STAGES, outside=targets)
    cf.write_tree(os.path.join(klass, "oscar"), STAGES, "forkbomb")
    cf.write_tree(os.path.join(klass, "peggy"), STAGES, "orphan")
    cf.write_tree(os.path.join(klass, "trent"), STAGES, "spam")
    open(os.path.join(klass, "notes.txt"), "w").write("not a submission\n")

    rubric_before = open(os.path.join(ROOT, "grader", "rubric.json"), "rb").read()
    cmd = [sys.executable, GRADE, "--class", klass, "--out", out, "--reference", ref, "--rubric", rubric_path,
           "--timeout", "15"] + [a for s in STAGES for a in ("--stage", s)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    return {"p": p, "out": out, "ref": ref, "tmp": tmp, "rubric_before": rubric_before}


SPIN = "import time\nend = time.process_time() + %d\nwhile time.process_time() < end:\n    pass\n"


@contextlib.contextmanager
def busy_cores(n, cpu_seconds=300):
    """n processes that spin on a core each, never sleeping; each ends by itself after cpu_seconds of CPU time
    (should this test die before its finally) and is killed, by its own pid, when the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN % cpu_seconds], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def test_class_under_load_grades_overlap_as_an_idle_machine(request):
    """The solutions (full marks) and the starters (0) on LOADED_STAGES, two students at a time, while a
    spinning process per core keeps the machine loaded: the overlap checks read the modelled clock, so the
    solutions pass them with exactly the figures grader/figures/overlap.json documents, as alone."""
    tmp = _reachable_tmp(request)
    klass, out, ref = str(tmp / "submissions"), str(tmp / "out"), str(tmp / "reference")
    shutil.copytree(os.path.join(ROOT, "logs", "reference"), ref)
    cf.write_tree(os.path.join(klass, "solved"), LOADED_STAGES)
    cf.write_tree(os.path.join(klass, "starter"), LOADED_STAGES, starter=True)
    cmd = [sys.executable, GRADE, "--class", klass, "--out", out, "--reference", ref, "--jobs", "2"]
    cmd += [a for s in LOADED_STAGES for a in ("--stage", s)]
    with busy_cores(os.cpu_count() or 2) as spinners:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert all(s.poll() is None for s in spinners), "a spinning process ended early: the load was not there"
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.reader(open(os.path.join(out, "scores.csv"))))
    per = [fmt_points(sum(s.checks.values())) for s in SOLVED if s.id in LOADED_STAGES]
    full = fmt_points(sum(sum(s.checks.values()) for s in SOLVED if s.id in LOADED_STAGES))
    got = {r[0]: r[1:] for r in rows[1:]}
    assert got == {"solved": per + [full, full, "0"], "starter": ["0"] * len(per) + ["0", full, "0"]}, p.stdout
    results = json.load(open(os.path.join(out, "solved", "results.json")))
    rubric = manifest.load()
    for stage in LOADED_STAGES:
        checks = {c["key"]: c for c in results["stages"][stage]["checks"]}
        want = rubric["overlap_figures"]["solutions"][stage]
        assert set(want) == {"ag_overlap", "rs_overlap"}
        run_dir = os.path.join(out, "solved", "runs", "stage" + stage)
        for key, f in assert_overlap_figures(stage, run_dir, want).items():
            assert checks[key]["ok"] and checks[key]["detail"].startswith("%.1f%% of " % (100 * f.compute_share))


def _report(out, who):
    path = os.path.join(out, who, "report.md")
    return open(path).read() if os.path.exists(path) else "(no %s)" % path


# what mallory writes that the grader checks after each student (INSTRUCTORS.md, the sandbox): without root
# its runs are the instructor's own, so these are written, restored from memory and mallory is not graded
def _mallory_changed(graded):
    return [os.path.join(graded["ref"], "stage%s" % STAGES[0], "metrics.jsonl"),
            os.path.join(ROOT, "grader", "rubric.json")]


def test_class_scores(graded):
    p, out = graded["p"], graded["out"]
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.reader(open(os.path.join(out, "scores.csv"))))
    assert rows[0] == ["student"] + ["stage" + s for s in STAGES] + ["total", "max", "bonus"]
    full = fmt_points(sum(sum(s.checks.values()) for s in SOLVED[:2]))
    per = [fmt_points(sum(s.checks.values())) for s in SOLVED[:2]]
    got = {r[0]: r[1:] for r in rows[1:]}
    # the same solution as a folder and as a tarball: the same (full) points; peggy's leftover process
    # and, as root, mallory's writes elsewhere cost nothing as long as they cannot disturb anything
    for who in ("alice", "bob", "peggy") + (("mallory",) if os.geteuid() == 0 else ()):
        assert got[who] == per + [full, full, "0"], (who, got[who], p.stdout, _report(out, who))
    zero = ["carol", "dave", "eve", "oscar", "trent"]
    if os.geteuid() != 0:
        # without root mallory runs as the instructor and does write the grader's inputs: they are restored,
        # it is graded again alone, writes them again and is not graded; its row and report say why
        zero.append("mallory")
        assert "warning: not root, so each submission runs as you" in p.stdout, p.stdout
        said = [line for line in p.stdout.splitlines() if line.startswith("== mallory == ")]
        assert len(said) == 1 and said[0].startswith(
            "== mallory == NOT GRADED: its runs write outside their run directory ("), p.stdout
        assert any("restored; they will be graded again" in line and "mallory" in line
                   for line in p.stdout.splitlines()), p.stdout
        report = _report(out, "mallory")
        assert "**Not graded:** its runs write outside their run directory (" in report, report
        for path in _mallory_changed(graded):
            assert relpath(path) in said[0] and relpath(path) in report, (path, said[0], report)
    for who in zero:
        assert got[who] == ["0"] * len(STAGES) + ["0", full, "0"], (who, got[who])
    assert set(got) == {"alice", "bob", "carol", "dave", "eve", "mallory", "oscar", "peggy", "trent"}
    assert "skipped notes.txt" in p.stdout


@pytest.mark.parametrize("who,says", [
    ("carol", "TODO not implemented"),
    ("dave", "crashed with SIGSEGV"),
    ("eve", "no progress after 15 s"),
    ("oscar", "stopped as a fork bomb"),
    ("trent", "the file-size limit"),
])
def test_class_reports_say_why(graded, who, says):
    report = open(os.path.join(graded["out"], who, "report.md")).read()
    assert says in report, report
    assert "runs/stage%s" % STAGES[0] in report  # the run directories are named
    assert "**loss parity**" in report  # failing checks listed by name
    # the run's reason is said once; its ungraded checks share one line instead of repeating it
    assert "- not graded (the run failed, " in report and "not graded: the run failed" not in report, report


def test_class_batch_is_not_disturbed(graded):
    """As root nothing outside a run directory is written. Without root (INSTRUCTORS.md, the sandbox) the
    grader's inputs are restored from memory, but mallory's other writes stay: intruder.txt and lines added to
    alice's results.json after she was graded; her score (scores.csv, report.md) comes from memory."""
    out, ref = graded["out"], graded["ref"]
    assert _files_under(ref) == _files_under(os.path.join(ROOT, "logs", "reference"))
    assert open(os.path.join(ROOT, "grader", "rubric.json"), "rb").read() == graded["rubric_before"]
    intruder = os.path.join(out, "intruder.txt")
    if os.geteuid() == 0:
        assert not os.path.exists(intruder)
        alice = json.load(open(os.path.join(out, "alice", "results.json")))
    else:
        lines = open(intruder).read().splitlines()
        assert lines and set(lines) == {"tampered"}, lines[:5]
        text = open(os.path.join(out, "alice", "results.json")).read()
        alice, end = json.JSONDecoder().raw_decode(text)
        assert text[end:].split() and set(text[end:].split()) == {"tampered"}, text[end:][:200]
        assert "**Score: %s/%s**" % (fmt_points(alice["score"]), fmt_points(alice["max_score"])) in \
            _report(out, "alice")
    assert alice["score"] == alice["max_score"] > 0
    # peggy's grandchild was started (it wrote its marker) and did not outlive the grading
    assert os.path.exists(os.path.join(out, "peggy", "runs", "stage%s" % STAGES[0], "orphan-alive"))
    assert not _procs_mentioning(out)
    # the run directories are the grader's again: regular files and folders only
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(out):
            for name in dirnames + filenames:
                st = os.lstat(os.path.join(dirpath, name))
                assert st.st_uid == 0, os.path.join(dirpath, name)
    else:  # the runs were the instructor's own: no other owner, and no link or FIFO left for a check to follow
        for dirpath, dirnames, filenames in os.walk(out):
            for name in dirnames + filenames:
                st = os.lstat(os.path.join(dirpath, name))
                assert st.st_uid == os.geteuid() and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)), \
                    (os.path.join(dirpath, name), st.st_uid, oct(st.st_mode))


def test_collect_takes_only_the_stage_files(tmp_path):
    """collect() reads hw_fsdp.c files only, never through a link, from folders, tarballs and zips."""
    import zipfile
    dirs = [s.dir for s in SOLVED[:2]]
    tree = tmp_path / "t"
    (tree / "x" / "stages" / dirs[0]).mkdir(parents=True)
    (tree / "x" / "stages" / dirs[0] / "hw_fsdp.c").write_text("int a;\n")
    (tree / "x" / "stages" / dirs[1]).mkdir(parents=True)
    os.symlink("/etc/hostname", str(tree / "x" / "stages" / dirs[1] / "hw_fsdp.c"))
    (tree / "x" / "Makefile").write_text("all:\n")
    files, notes = classroom.collect(str(tree), dirs)
    assert files == {dirs[0]: b"int a;\n"} and any("not a regular file" in n for n in notes)

    tpath = str(tmp_path / "s.tar")
    with tarfile.open(tpath, "w") as tar:
        tar.add(str(tree / "x" / "stages" / dirs[0] / "hw_fsdp.c"), arcname="../../stages/%s/hw_fsdp.c" % dirs[0])
        tar.add(str(tree / "x" / "stages" / dirs[0] / "hw_fsdp.c"), arcname="a/stages/%s/hw_fsdp.c" % dirs[0])
        tar.add(str(tree / "x" / "stages" / dirs[1] / "hw_fsdp.c"), arcname="a/stages/%s/hw_fsdp.c" % dirs[1])
    files, notes = classroom.collect(tpath, dirs)
    assert files == {dirs[0]: b"int a;\n"}, files  # the '..' path is not taken, the link is not followed

    zpath = str(tmp_path / "s.zip")
    with zipfile.ZipFile(zpath, "w") as z:
        z.writestr("me/stages/%s/hw_fsdp.c" % dirs[1], "int b;\n")
        z.writestr("me/deep/down/and/deeper/still/stages/%s/hw_fsdp.c" % dirs[0], "int c;\n")
    files, _ = classroom.collect(zpath, dirs)
    assert files == {dirs[1]: b"int b;\n"}
    open(str(tmp_path / "bad.tar.gz"), "wb").write(b"not a tarball")
    files, notes = classroom.collect(str(tmp_path / "bad.tar.gz"), dirs)
    assert files == {} and "not a readable tarball" in notes[0]
    assert classroom.student_name("Ann Lee.tar.gz") == "Ann_Lee"


def test_inputs_changed_and_restored(tmp_path):
    """What protects a batch run without root: the grader's inputs are compared after each student and
    written back from memory."""
    ref = tmp_path / "ref"
    (ref / "stage01").mkdir(parents=True)
    (ref / "stage01" / "metrics.jsonl").write_text("good\n")
    rubric = tmp_path / "rubric.json"
    rubric.write_text("{}\n")
    inputs = classroom.Inputs(str(ref), str(rubric))
    assert inputs.changed() == []
    (ref / "stage01" / "metrics.jsonl").write_text("tampered\n")
    (ref / "extra.json").write_text("{}")
    changed = inputs.changed()
    assert sorted(changed) == sorted([str(ref / "stage01" / "metrics.jsonl"), str(ref / "extra.json")])
    inputs.restore(changed)
    assert inputs.changed() == [] and (ref / "stage01" / "metrics.jsonl").read_text() == "good\n"


# grade.py with its default out folder (gradelib.cli.DEFAULT_OUT) moved to argv[1]; its own arguments follow
GRADE_WITH_DEFAULT = ("import sys; sys.path.insert(0, %r); from gradelib import cli; cli.DEFAULT_OUT = sys.argv[1]; "
                      "sys.exit(cli.main(sys.argv[2:]))" % os.path.join(ROOT, "grader"))


def _out_of_reach_default(tmp_path):
    """A run of grade.py (args -> CompletedProcess) whose default grade-runs/ is as in a clone in a mode-700
    home (root's /root): out of the sandbox's users' reach. Without root there are no such users (the runs are
    the instructor's own), so grade-runs/ stays the default there and an --out there is taken."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o700)
    default = home / "hw" / "grade-runs"

    def grade(*args):
        return subprocess.run([sys.executable, "-c", GRADE_WITH_DEFAULT, str(default)] + [str(a) for a in args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    return home, default, grade


def _fallback_said(request, stdout, home):
    """The one line naming where the runs went instead of the default (removed after the test)."""
    said = [line for line in stdout.splitlines() if "cannot reach" in line]
    assert len(said) == 1 and ("no o+x on %s" % home) in said[0], stdout
    fallback = said[0].rsplit(" go to ", 1)[1]
    request.addfinalizer(lambda: shutil.rmtree(fallback, ignore_errors=True))
    assert os.path.isdir(fallback) and not fallback.startswith(str(home)), said
    return fallback


def test_class_default_out_out_of_reach_goes_to_a_temp_folder(request, tmp_path):
    """From a clone in a mode-700 home, grade.py --class without --out grades into a fresh folder in /tmp
    that the sandbox's users can reach, said in one line; an --out given there is refused in one line, before
    anything is graded. Without root both grade into grade-runs/ itself, nothing said about reach."""
    home, default, grade = _out_of_reach_default(tmp_path)
    klass = tmp_path / "submissions"
    cf.write_tree(str(klass / "alice"), STAGES[:1])
    p = grade("--class", klass, "--stage", STAGES[0])
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    full = fmt_points(sum(SOLVED[0].checks.values()))
    if os.geteuid() != 0:
        for given in ((), ("--out", default)):
            if given:
                p = grade("--class", klass, "--stage", STAGES[0], *given)
                out = p.stdout
                assert p.returncode == 0, out + p.stderr
            assert "cannot reach" not in out + p.stderr and "runs in %s" % default in out, out + p.stderr
            assert "warning: not root, so each submission runs as you" in out, out
            rows = list(csv.reader(open(str(default / "scores.csv"))))
            assert rows[1] == ["alice", full, full, full, "0"], out
            os.unlink(str(default / "scores.csv"))
        return
    fallback = _fallback_said(request, out, home)
    assert "reports go to %s" % fallback in out and "runs in %s" % fallback in out, out
    rows = list(csv.reader(open(os.path.join(fallback, "scores.csv"))))
    assert rows[1] == ["alice", full, full, full, "0"], out
    assert not os.path.exists(str(default))

    p = grade("--class", klass, "--stage", STAGES[0], "--out", default)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.strip() == ("grade.py: error: the sandbox's users cannot reach %s (they need o+x on %s): "
                                "choose another --out" % (default, home)), p.stderr
    assert not os.path.exists(str(default / "alice"))


def test_sandbox_default_out_out_of_reach_goes_to_a_temp_folder(request, tmp_path):
    """The same for grade.py --sandbox (one grader): its default grade-runs/ out of reach, the runs and
    results.json go to a fresh folder in /tmp, said in one line. Without root: into grade-runs/ itself."""
    home, default, grade = _out_of_reach_default(tmp_path)
    p = grade("--sandbox", "--solutions", "--stage", STAGES[0])
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    if os.geteuid() != 0:
        assert "cannot reach" not in out + p.stderr and "sandbox: each run as you (not root" in out, out + p.stderr
        results = json.load(open(str(default / "results.json")))
        assert results["score"] == results["max_score"] > 0, out
        return
    fallback = _fallback_said(request, out, home)
    assert "results go to %s" % fallback in out, out
    results = json.load(open(os.path.join(fallback, "results.json")))
    assert results["score"] == results["max_score"] > 0, out
    assert not os.path.exists(str(default))


def test_class_usage_errors(tmp_path):
    for args, says in [(["--class", str(tmp_path / "nope")], "no such directory"),
                       (["--class", str(tmp_path), "--solutions"], "exclude each other"),
                       (["--class", str(tmp_path), "--jobs", "0"], "at least 1")]:
        p = subprocess.run([sys.executable, GRADE] + args + ["--out", str(tmp_path / "o")], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, GRADE, "--class", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "no submissions" in p.stderr


def test_reports_name_calls_to_review(graded):
    """A hw_fsdp.c that opens files or forks is named to the instructor (a note, not points); the
    solutions have none of those calls, so the note never cries wolf on them."""
    out = graded["out"]
    assert "fopen (line" in open(os.path.join(out, "mallory", "report.md")).read()
    assert "fork (line" in open(os.path.join(out, "oscar", "report.md")).read()
    assert "Calls to review" not in open(os.path.join(out, "alice", "report.md")).read()
    for s in SOLVED:
        assert classroom.calls_to_review(open(s.solution_src()).read()) == [], s.dir
    assert classroom.calls_to_review('/* fopen( */ // system(\nx = fopen("a(", "w"); printf("fork(");') == \
        ["fopen (line 2)"]


def test_restored_inputs_keep_their_times(tmp_path):
    """A grader input a submission rewrote is put back with its old modification time too: a rubric restored with
    a new one made build/stages.mk look stale, and two students' builds then remade it at once (a lost mv)."""
    from gradelib.classroom import Inputs
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / "metrics.jsonl").write_text('{"step": 1}\n')
    rubric = tmp_path / "rubric.json"
    rubric.write_text("{}\n")
    for p in (ref / "metrics.jsonl", rubric):
        os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    inputs = Inputs(str(ref), str(rubric))
    rubric.write_text('{"tampered": 1}\n')
    assert inputs.changed() == [str(rubric)]
    inputs.restore(inputs.changed())
    assert rubric.read_text() == "{}\n" and inputs.changed() == []
    assert os.stat(rubric).st_mtime_ns == 1_000_000_000_000_000_000
