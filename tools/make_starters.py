#!/usr/bin/env python3
"""Generate the student starters (stages/) from the solutions (solutions/).

A solution marks the code a stage asks for:

    /* BEGIN SOLUTION: what the student writes (HANDOUT.md#stage-03) */
    ...code...
    /* END SOLUTION */

For stage NN, regions tagged stage-NN become a TODO stub that stops the run
with a message naming the TODO (hw_todo, exit status 3); regions tagged with
another stage keep their code (stage N's starter contains the earlier stages'
solutions) and lose only their marker lines.

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

def convert(text, stage, src_name):
    out, stack, todos = [], [], []
    for lineno, line in enumerate(text.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            if stack:
                raise SystemExit(f"{src_name}:{lineno}: nested BEGIN SOLUTION")
            stub = m.group("stage") == stage
            stack.append(stub)
            if stub:
                ind, what = m.group("indent"), m.group("what")
                where = f"HANDOUT.md#stage-{stage}"
                todos.append(what)
                out.append(f"{ind}/* TODO(stage {stage}): {what}. */")
                c_what = what.replace("\\", "\\\\").replace('"', '\\"')
                out.append(f'{ind}hw_todo("{c_what}", "{where}");')
            continue
        if END.match(line):
            if not stack:
                raise SystemExit(f"{src_name}:{lineno}: END SOLUTION without BEGIN")
            stack.pop()
            continue
        if stack and stack[-1]:
            continue  # solution code of this stage: dropped
        out.append(line)
    if stack:
        raise SystemExit(f"{src_name}: BEGIN SOLUTION without END")
    if not todos:
        raise SystemExit(f"{src_name}: no BEGIN SOLUTION region tagged stage-{stage}")
    banner = (f"/* STARTER for stage {stage} — this is your file. Fill every TODO(stage {stage}) below\n"
              f" * (each one stops the run until you do; see HANDOUT.md#stage-{stage}).\n"
              f" * Generated from the instructors' solution by tools/make_starters.py. */\n")
    return banner + "\n".join(out), todos


def readme(st, todos):
    """A stage's README.md from its manifest entry (title, goal, fill, graded_on) and its TODOs."""
    stage, dirname = st.id, st.dir
    lines = [f"# Stage {stage} — {st.title}", "", st.goal, "",
             f"**Your file:** `stages/{dirname}/hw_fsdp.c`. **What to fill:** {st.fill}.", "",
             "The TODOs in it:", ""]
    lines += [f"- {t}" for t in todos]
    lines += ["", f"**Graded on:** {st.graded_on}. Run `make grade STAGE={stage}`; details in "
              f"[HANDOUT.md](../../HANDOUT.md#stage-{stage}).", ""]
    return "\n".join(lines)


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
        with open(src) as fh:
            starter, todos = convert(fh.read(), st.id, src)
        wanted = {"hw_fsdp.c": starter, "README.md": readme(st, todos),
                  manifest.STARTER_RECORD: manifest.starter_record(starter)}  # what `make grade` compares with
        for name, content in wanted.items():
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
