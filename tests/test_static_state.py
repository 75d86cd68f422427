"""State shared by the rank threads is refused at build time, with one line that names it.

The ranks are threads of one process, so a writable file-scope or function-static variable in a student's
hw_fsdp.c is one copy every rank reads and writes: a race whose symptom changed from run to run (a SIGSEGV,
a watchdog timeout, a race on a random rank). The build (make impl, the stage and solution binaries, the
CUDA build's) runs tools/check_shared_state.py on the file's object and fails with one line instead, the
same on every build; static const tables and static functions stay allowed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, STAGES

CHECK = os.path.join(ROOT, "tools", "check_shared_state.py")
ADVICE = ("writable state shared by every rank: ranks are threads of one process, so a file-scope or static "
          "variable exists once and every rank reads and writes the same copy; keep per-rank state in your "
          "struct Fsdp (fsdp_init returns it, every hook gets it) or per module in mod->fsdp, and declare a table "
          "you only read const (static const int t[], static const char *const names[])")
FIRST = STAGES[0]  # stage 01: the one stage every student tree has (a release of stage 01 alone too)
HOOK = "void fsdp_pre_forward(Fsdp *f, Module *mod) { unshard(f, mod->fsdp); }"

needs_readelf = pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("gcc") is None,
                                   reason="readelf and gcc are the build's (Debian: binutils, gcc)")


def starter_with(tmp_path, before="", body=""):
    """Stage 01's starter with `before` put above fsdp_pre_forward and `body` at its start; (path, line of the
    first line of `before`)."""
    with open(os.path.join(ROOT, "stages", FIRST.dir, "hw_fsdp.c")) as fh:
        text = fh.read()
    assert text.count(HOOK) == 1, "stage %s's starter changed its fsdp_pre_forward: update HOOK" % FIRST.id
    line = text[:text.index(HOOK)].count("\n") + 1
    text = text.replace(HOOK, before + HOOK.replace("{ ", "{ " + body, 1))
    path = tmp_path / "hw_fsdp.c"
    path.write_text(text)
    return str(path), line


def make_impl(src, out):
    return subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=" + src, "OUT=" + out,
                           "PYTHON=" + sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=600)


def check(src, obj):
    return subprocess.run([sys.executable, CHECK, src, obj], capture_output=True, text=True, timeout=60)


def compile_c(tmp_path, code, *flags):
    """A snippet compiled as the build compiles a student's file (-O2 -g); (source, object)."""
    src, obj = tmp_path / "snippet.c", tmp_path / "snippet.o"
    src.write_text(code)
    subprocess.run(["gcc", "-std=c11", "-O2", "-g", "-c", str(src), "-o", str(obj)] + list(flags), check=True)
    return str(src), str(obj)


@needs_readelf
@pytest.mark.parametrize("kind, before, body, desc", [
    ("file scope", "static int calls;\n", "calls++; ", "static int at file scope"),
    ("function-static", "", "static int calls = 0; if (calls++ < 0) return; ", "static int in fsdp_pre_forward"),
])
def test_a_shared_counter_fails_the_build_with_one_line(kind, before, body, desc, tmp_path):
    """A starter with a static counter incremented in a hook: make impl fails with the one line, no binary left;
    the check run 20 times on the object says the same sentence every time."""
    src, line = starter_with(tmp_path, before, body)
    expected = "%s:%d: error: 'calls' (%s) is %s" % (src, line, desc, ADVICE)
    out = str(tmp_path / "train")
    p = make_impl(src, out)
    assert p.returncode != 0 and not os.path.exists(out) and not os.path.exists(out + ".o"), p.stdout + p.stderr
    errors = [l for l in (p.stdout + p.stderr).splitlines() if "error:" in l]
    assert errors[0] == expected, errors
    # the object again (the build removed its own), as the build compiles it
    obj = str(tmp_path / "hw_fsdp.o")
    subprocess.run(["gcc", "-std=c11", "-O2", "-g", "-D_GNU_SOURCE", "-pthread", "-I" + os.path.join(ROOT, "common"),
                    "-c", src, "-o", obj], check=True)
    said = set()
    for _ in range(20):
        r = check(src, obj)
        assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout)
        said.add(r.stderr)
    assert said == {expected + "\n"}


@needs_readelf
def test_the_grader_says_the_line_as_the_build_failure(tmp_path):
    """grade.py --file --stage 01 on the counter: 0 points, and the run's reason is the line (not "build failed in
    the runtime"), before anything runs."""
    src, line = starter_with(tmp_path, "static int calls;\n", "calls++; ")
    out = str(tmp_path / "grade")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--file", src, "--stage", FIRST.id,
                        "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=600)
    reason = "build failed: %s:%d: error: 'calls' (static int at file scope) is %s" % (src, line, ADVICE)
    assert "    " + reason in p.stdout.splitlines(), p.stdout + p.stderr
    with open(os.path.join(out, "results.json")) as fh:
        results = json.load(fh)
    assert "stage %s: 0/" % FIRST.id in p.stdout and reason in json.dumps(results), p.stdout


@needs_readelf
def test_const_tables_and_static_functions_build(tmp_path):
    """static const tables (in .rodata, or .data.rel.ro for a table of pointers) and a static function pass."""
    before = ("static const int table[] = {1, 2, 3};\n"
              "static const char *const names[] = {\"embedding\", \"block\", \"head\"};\n"
              "static int pick(int i) { return table[i % 3]; }\n")
    body = "if (pick(mod->index) < 0 || !names[mod->kind][0]) return; "
    src, _ = starter_with(tmp_path, before, body)
    out = str(tmp_path / "train")
    p = make_impl(src, out)
    assert p.returncode == 0 and os.access(out, os.X_OK) and not os.path.exists(out + ".o"), p.stdout + p.stderr


@needs_readelf
@pytest.mark.parametrize("code, flags, first, more", [
    # a plain global, with -fcommon too (a COMMON symbol, in no section yet)
    ("int total;\nint f(void) { return ++total; }\n", [], "'total' (int at file scope)", ""),
    ("int total;\nint f(void) { return ++total; }\n", ["-fcommon"], "'total' (int at file scope)", ""),
    # initialised (.data), a struct, a pointer
    ("static int n = 3;\nint f(void) { return ++n; }\n", [], "'n' (static int at file scope)", ""),
    ("struct S { int a; };\nstatic struct S s;\nint f(void) { return ++s.a; }\n", [],
     "'s' (static struct S at file scope)", ""),
    ("static float *buf;\nfloat *f(float *p) { float *o = buf; buf = p; return o; }\n", [],
     "'buf' (static float * at file scope)", ""),
    # several: the first in the file named in full, the others with their lines
    ("static int a;\nint f(void) { static double t; t += 1; return ++a + (int)t; }\n", [],
     "'a' (static int at file scope)", " and 1 more ('t' line 2) are"),
])
def test_the_check_names_each_kind_of_shared_variable(code, flags, first, more, tmp_path):
    src, obj = compile_c(tmp_path, code, *flags)
    r = check(src, obj)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("%s:" % src) and (": error: %s%s" % (first, more or " is")) in lines[0] \
        and lines[0].endswith(ADVICE), lines


@needs_readelf
@pytest.mark.parametrize("code", [
    "static const int table[] = {1, 2, 3};\nint f(int i) { return table[i & 1]; }\n",
    "static const char *const names[] = {\"a\", \"b\"};\nconst char *f(int i) { return names[i & 1]; }\n",
    "static int g(int x) { return 2 * x; }\nint f(int i) { return g(i); }\n",
    # one copy per thread, hence per rank: not shared
    "static _Thread_local int n;\nint f(void) { return ++n; }\n",
])
def test_the_check_passes_what_is_not_shared(code, tmp_path):
    for pie in ("-fPIE", "-fno-PIE"):
        src, obj = compile_c(tmp_path, code, pie)
        r = check(src, obj)
        assert r.returncode == 0 and r.stderr == "", r.stderr


@needs_readelf
@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "build-cuda", "libhwfsdp_cuda.a")),
                    reason="make cuda not run yet (it builds the CUDA runtime that make impl-cuda links with)")
def test_the_cuda_build_refuses_it_too(tmp_path):
    """make impl-cuda (grade.py --cuda) checks the object as make impl does: the same line."""
    src, line = starter_with(tmp_path, "", "static int calls = 0; if (calls++ < 0) return; ")
    out = str(tmp_path / "train")
    p = subprocess.run(["make", "-s", "--no-print-directory", "impl-cuda", "SRC=" + src, "OUT=" + out,
                        "PYTHON=" + sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and not os.path.exists(out), p.stdout + p.stderr
    assert [l for l in (p.stdout + p.stderr).splitlines() if "error:" in l][0] == \
        "%s:%d: error: 'calls' (static int in fsdp_pre_forward) is %s" % (src, line, ADVICE)
