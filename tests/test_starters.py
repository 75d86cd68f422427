"""stages/ is generated from solutions/ and in sync; every starter builds,
runs, and stops at its first TODO with a message naming it (exit status 3);
stage NN's starter stubs every stage up to NN (it holds no answer)."""
import os
import re
import subprocess
import sys

import pytest

from helpers import BUILD, CORPUS, ROOT, SOLVED

STAGES = [s.dir for s in SOLVED]
FLAGS = {s.dir: s.flags_at(2) for s in SOLVED}  # the starters run at world 2


def test_stages_in_sync_with_solutions():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_starters.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_generator_refuses_unbalanced_markers(tmp_path):
    import make_starters
    good = "int f(void) {\n    /* BEGIN SOLUTION: do it (HANDOUT.md#stage-02) */\n    return 1;\n    /* END SOLUTION */\n}\n"
    out, todos = make_starters.convert(good, "02", "x.c")
    assert 'hw_todo("do it", "HANDOUT.md#stage-02");' in out and "return 1;" not in out and todos == [("02", "do it")]
    two = good + good.replace("stage-02", "stage-03").replace("do it", "do more")
    stubbed, todos = make_starters.convert(two, "03", "x.c")  # the full handout: every stage up to 03 stubbed
    assert "return 1;" not in stubbed and "BEGIN SOLUTION" not in stubbed and \
        todos == [("02", "do it"), ("03", "do more")] and 'hw_todo("do it", "HANDOUT.md#stage-02");' in stubbed
    carried, _ = make_starters.convert(two, "03", "x.c", carry_from="02")  # an earlier stub says to carry
    assert 'hw_todo("do it", "HANDOUT.md#stage-02; did stage 02 already? `make carry STAGE=03` brings your file ' \
        'here");' in carried and 'hw_todo("do more", "HANDOUT.md#stage-03");' in carried
    kept, todos = make_starters.convert(two, "03", "x.c", keep_earlier=True)  # a staged release
    assert "return 1;" in kept and "BEGIN SOLUTION" not in kept and todos == [("03", "do more")]
    # a region nested in an earlier stage's: stubbing the outer one lists the inner TODO after it
    nested = ("int f(void) {\n    /* BEGIN SOLUTION: outer (HANDOUT.md#stage-02) */\n    if (1) {\n"
              "        /* BEGIN SOLUTION: inner (HANDOUT.md#stage-03) */\n        return 2;\n        /* END SOLUTION */\n"
              "    }\n    /* END SOLUTION */\n    return 1;\n}\n")
    out, todos = make_starters.convert(nested, "03", "x.c")
    assert todos == [("02", "outer"), ("03", "inner")] and "if (1)" not in out and "return 2;" not in out
    out, todos = make_starters.convert(nested, "03", "x.c", keep_earlier=True)
    assert todos == [("03", "inner")] and "if (1)" in out and "return 2;" not in out
    with pytest.raises(SystemExit):  # an earlier stage's region inside a later one's
        make_starters.convert(nested.replace("stage-02", "stage-04"), "04", "x.c")
    with pytest.raises(SystemExit):
        make_starters.convert(good.replace("    /* END SOLUTION */\n", ""), "02", "x.c")
    with pytest.raises(SystemExit):
        make_starters.convert(good, "05", "x.c")  # no region for the stage


def _stubs(text):
    """[(what, anchor)] of the starter's hw_todo stubs."""
    return re.findall(r'hw_todo\("((?:[^"\\]|\\.)*)",\s*"(HANDOUT\.md#stage-\d\d)(?:; [^"]*)?"\)', text)


@pytest.mark.parametrize("stage", STAGES)
def test_starter_stops_at_a_named_todo(stage, tmp_path):
    """The starter stops at the first TODO its run reaches (often an earlier stage's: it stubs them all), with a
    message that names one of its own stubs and that stub's HANDOUT section; an earlier stage's stub in the
    starter of a stage that builds on another's file also says to run `make carry STAGE=NN` (the manifest's
    builds_on), so an untouched starter's first message says how to bring your own file here."""
    binary = os.path.join(BUILD, "stages", stage, "train")
    flags = FLAGS[stage]
    p = subprocess.run([binary, "--world", "2", "--steps", "2", "--data", CORPUS, "--out", str(tmp_path), "--quiet"]
                       + flags, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 3, (p.returncode, p.stderr)
    m = re.search(r"TODO not implemented: (.*) \(see (HANDOUT\.md#stage-(\d\d))(; [^\n]*)?\)\n", p.stderr)
    assert m, p.stderr
    st = next(s for s in SOLVED if s.dir == stage)
    if st.builds_on and m.group(3) < st.id:
        assert m.group(4) == "; did stage %s already? `make carry STAGE=%s` brings your file here" % (
            st.builds_on, st.id), p.stderr
    else:
        assert m.group(4) is None, p.stderr
    stubs = _stubs(open(os.path.join(ROOT, "stages", stage, "hw_fsdp.c")).read())
    assert (m.group(1), m.group(2)) in [(w.replace('\\"', '"'), a) for w, a in stubs], (m.group(0), stubs)
    assert m.group(3) <= stage[:2]


@pytest.mark.parametrize("stage", STAGES)
def test_starter_stubs_every_stage_up_to_its_own(stage):
    """Stage N's starter (the full handout's) holds no answer: it has TODOs of stage N and of the first stage (whose
    sharding every later stage needs), none of a later stage, and each TODO's stub names the stage of its comment.
    tests/test_handout.py holds every starter to "no line of any solution region" against solutions/."""
    text = open(os.path.join(ROOT, "stages", stage, "hw_fsdp.c")).read()
    n, first = stage[:2], STAGES[0][:2]
    tagged = re.findall(r"TODO\(stage (\d\d)\)", text.split("*/", 1)[1])  # past the banner
    assert n in tagged and first in tagged, tagged
    assert max(tagged) == n, tagged
    pairs = re.findall(r"/\* TODO\(stage (\d\d)\): .*\. \*/\n\s*hw_todo\(\"(?:[^\"\\\\]|\\\\.)*\", \"HANDOUT\.md#stage-(\d\d)(?:; [^\"]*)?\"\);", text)
    assert len(pairs) == len(tagged) and all(a == b for a, b in pairs), pairs
    if n != first:
        assert "make carry STAGE=%s" % n in text.split("*/", 1)[0]  # the banner says how to carry instead


def test_a_readme_asks_its_stages_question():
    """A stage whose manifest entry has a question asks it in its README under its own heading, with the line
    the answer goes below; a stage without one has no such section (make_starters renders what the manifest says,
    and nothing else)."""
    asked = [s for s in SOLVED if s.question]
    if not asked:
        pytest.skip("no stage of this tree asks a question")
    for s in SOLVED:
        with open(os.path.join(ROOT, "stages", s.dir, "README.md"), encoding="utf-8") as fh:
            text = fh.read()
        if s.question:
            head, _, answer = text.partition("## Question\n")
            assert s.question in answer and "*Your answer:*" in answer.split("---", 1)[-1], s.dir
        else:
            assert "## Question" not in text, s.dir
