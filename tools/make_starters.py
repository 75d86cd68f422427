#!/usr/bin/env python3
"""Generate the student starters (stages/) from the solutions (solutions/).

A solution marks the code a stage asks for:

    /* BEGIN SOLUTION: what the student writes (HANDOUT.md#stage-03) */
    ...code...
    /* END SOLUTION */

Solution NN marks every piece of code that answers a stage up to NN, each region tagged with
the stage that asks for it. For stage NN, every region tagged NN or earlier becomes a TODO
stub that stops the run with a message naming the TODO (hw_todo, exit status 3; an earlier
stage's stub also says to run `make carry STAGE=NN` if the student did the stage NN builds
on, grader/rubric.json's builds_on: an untouched starter stops at one of those first): the
committed stages/ (what the full handout ships) holds no answer of any stage, and a student
who did the earlier stages carries their own file forward (make carry STAGE=NN). Regions
tagged with a later stage keep their code; every marker line goes. A region may hold a region
of the same or a later stage (whole statements inside a block of the outer one): stubbing the
outer one drops what it holds, and the inner region's TODO follows the outer stub.

Staged releases (tools/make_handout.py --release NN) instead keep the earlier stages'
solutions in each starter (published after the earlier deadlines): convert(...,
keep_earlier=True) stubs only the stage's own regions.

    tools/make_starters.py            write stages/NN_name/{hw_fsdp.c,README.md,.starter.sha256}
    tools/make_starters.py --check    exit 1 (and say which file) if stages/ is out of date
"""
import os
import re
import sys

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest  # the stages: grader/rubric.json
BEGIN = re.compile(r"^(?P<indent>\s*)/\* BEGIN SOLUTION: (?P<what>.*) \(HANDOUT\.md#stage-(?P<stage>\d\d)\) \*/\s*$")
END = re.compile(r"^\s*/\* END SOLUTION \*/\s*$")

def todo_where(tag, stage, carry_from=None):
    """The second argument of a stub's hw_todo, which its message prints after "see": the HANDOUT section of the
    stage that asks for it; for a stub of an earlier stage in a starter of a stage that builds on another's file
    (carry_from: its builds_on), also how to bring that file here instead (the run of an untouched starter stops
    at such a stub first)."""
    where = f"HANDOUT.md#stage-{tag}"
    if carry_from and tag < stage:
        where += f"; did stage {carry_from} already? `make carry STAGE={stage}` brings your file here"
    return where


def convert(text, stage, src_name, keep_earlier=False, carry_from=None):
    """(starter text, [TODO what]) of stage `stage` from a solution's text. Stubs the regions tagged
    `stage` and, unless keep_earlier, those of every earlier stage (their stubs' messages say to run
    `make carry STAGE=stage` when carry_from, the stage it builds on, is given)."""
    out, stack, todos = [], [], []
    for lineno, line in enumerate(text.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            tag = m.group("stage")
            if stack and tag < stack[-1][0]:
                raise SystemExit(f"{src_name}:{lineno}: a region of stage {tag} inside one of stage {stack[-1][0]} "
                                 "(a nested region belongs to the same or a later stage)")
            stub = tag == stage or (tag < stage and not keep_earlier)
            dropping = any(st for _, st in stack)  # inside a stubbed region: its code is gone already
            stack.append((tag, stub or dropping))
            if stub:
                # a region nested in a stubbed one: its TODO follows the outer stub's
                ind, what = m.group("indent"), m.group("what")
                if dropping:
                    ind = next((l[:len(l) - len(l.lstrip())] for l in reversed(out) if l.strip()), ind)
                where = todo_where(tag, stage, carry_from)
                todos.append((tag, what))
                out.append(f"{ind}/* TODO(stage {tag}): {what}. */")
                c_what = what.replace("\\", "\\\\").replace('"', '\\"')
                out.append(f'{ind}hw_todo("{c_what}", "{where}");')
            continue
        if END.match(line):
            if not stack:
                raise SystemExit(f"{src_name}:{lineno}: END SOLUTION without BEGIN")
            stack.pop()
            continue
        if any(st for _, st in stack):
            continue  # solution code of a stubbed stage: dropped
        out.append(line)
    if stack:
        raise SystemExit(f"{src_name}: BEGIN SOLUTION without END")
    if not any(tag == stage for tag, _ in todos):
        raise SystemExit(f"{src_name}: no BEGIN SOLUTION region tagged stage-{stage}")
    return banner(stage, keep_earlier) + "\n".join(out), todos


def banner(stage, keep_earlier):
    """The starter's first comment: what the file is."""
    if keep_earlier:
        return (f"/* STARTER for stage {stage} (staged release) — this is your file. Fill every TODO(stage {stage})\n"
                f" * below (each one stops the run until you do; see HANDOUT.md#stage-{stage}). The code of the\n"
                f" * earlier stages is the instructors' solution, published after their deadlines.\n"
                f" * Generated from the instructors' solution by tools/make_starters.py. */\n")
    first = min(s.id for s in manifest.stages())
    if stage == first:  # nothing earlier to stub
        return (f"/* STARTER for stage {stage} — this is your file. Fill every TODO(stage {stage}) below\n"
                f" * (each one stops the run until you do; see HANDOUT.md#stage-{stage}).\n"
                f" * Generated from the instructors' solution by tools/make_starters.py. */\n")
    return (f"/* STARTER for stage {stage} — it stubs every stage up to {stage}: each TODO(stage NN) below stops\n"
            f" * the run until you fill it (see HANDOUT.md#stage-NN). If you did the earlier stages, do not\n"
            f" * start here: run `make carry STAGE={stage}`, which carries your own file into this stage and\n"
            f" * lists what stage {stage} adds. Starting from scratch, fill the TODOs stage by stage from\n"
            f" * stage {first}. Generated from the instructors' solution by tools/make_starters.py. */\n")


def readme(st, todos):
    """A stage's README.md from its manifest entry (title, goal, fill, graded_on, question) and its TODOs."""
    stage, dirname = st.id, st.dir
    lines = [f"# Stage {stage} — {st.title}", "", st.goal, "",
             f"**Your file:** `stages/{dirname}/hw_fsdp.c`. **What to fill:** {st.fill}.", "",
             f"The TODOs of stage {stage} in it:", ""]
    lines += [f"- {t}" for tag, t in todos if tag == stage]
    earlier = [(tag, t) for tag, t in todos if tag != stage]
    if earlier:
        lines += ["", f"This starter also stubs every earlier stage's work ({len(earlier)} more TODOs, stages "
                  f"{', '.join(sorted({tag for tag, _ in earlier}))}): it holds no answer. If you did those stages, "
                  f"run `make carry STAGE={stage}` instead: it carries your own file into this stage (the starter "
                  f"stays beside it as `hw_fsdp.starter.c`) and lists what stage {stage} adds."]
    lines += ["", f"**Graded on:** {st.graded_on}. Run `make grade STAGE={stage}`; details in "
              f"[HANDOUT.md](../../HANDOUT.md#stage-{stage}).", ""]
    if st.question:
        lines += ["## Question", "", st.question, "",
                  "`make grade` does not read this section: your instructors do. Answer below the line, with the "
                  "figures of your own runs (the command and what it printed).", "", "---", "",
                  "*Your answer:*", ""]
    return "\n".join(lines)


def starter_files(st, keep_earlier=False):
    """{file name: text} of stage st's folder made from its solution: the starter, its README and the record of
    the starter's hash that `make grade` compares with (Stage.started)."""
    src = st.solution_src()
    with open(src, encoding="utf-8") as fh:
        starter, todos = convert(fh.read(), st.id, src, keep_earlier, None if keep_earlier else st.builds_on)
    return {"hw_fsdp.c": starter, "README.md": readme(st, todos),
            manifest.STARTER_RECORD: manifest.starter_record(starter)}


def main():
    check = "--check" in sys.argv[1:]
    sol_root, stage_root = os.path.join(ROOT, "solutions"), os.path.join(ROOT, "stages")
    if not os.path.isdir(sol_root):
        print("no solutions/ here (the student tree): nothing to generate or check")
        return 0
    stale = []
    for st in manifest.stages():
        src = st.solution_src()
        if not os.path.isfile(src):
            print(f"error: stage {st.id} is in grader/rubric.json but {os.path.relpath(src, ROOT)} does not exist")
            return 1
        d = st.dir
        for name, content in starter_files(st).items():
            path = os.path.join(stage_root, d, name)
            have = open(path).read() if os.path.exists(path) else None
            if have == content:
                continue
            if check:
                stale.append(os.path.relpath(path, ROOT))
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(content)
                print(f"wrote {os.path.relpath(path, ROOT)}")
    if check and stale:
        print("stages/ is out of date with solutions/ (run tools/make_starters.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
