#!/usr/bin/env python3
"""Carry your own code forward into the next stage (make carry STAGE=NN).

    carry.py NN [--force] [--root DIR]

Copies your file of the stage NN builds on (grader/rubric.json's builds_on: stage NN-1 for
02..07, stage 06 for each bonus stage 08, 09, 10, stage 07 for the pipeline's 11 and 11 for 12),
stages/<that>/hw_fsdp.c, over
stages/<NN>/hw_fsdp.c, keeping stage NN's starter beside it as hw_fsdp.starter.c, rewrites
the file's first comment to say what it now is, and prints what stage NN adds: each TODO of
stage NN in the starter, the function it sits in, and the HANDOUT section that explains it.
When stage NN builds on a stage further back (11 on 07), it also lists what your file lacks
from the stages in between: the starter's TODOs of those stages (stage 09's shard group for
stage 11), the earlier stages' TODOs whose text in stage NN's starter asks for more than the
one your file answered (by the `TODO(stage NN)` markers: "over the shard group" where stage
07 said the world), and, line by line in the starter, the includes, struct fields, functions
and frees that it has and your file has not. The starter holds no answer (it stubs every
stage up to NN), so nothing official is laid beside your code. From then on you evolve one
file of your own, stage after stage; the grader reads whatever stages/<NN>/hw_fsdp.c holds.

Refuses (one line, exit status 2) when stage NN is the first stage or does not exist, when
the file it carries from is missing, and when stage NN was carried already
(hw_fsdp.starter.c exists): --force (make carry STAGE=NN FORCE=1) carries again and keeps
the file it replaces as hw_fsdp.c.bak.
"""
import argparse
import hashlib
import os
import re
import shutil
import sys

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest

TODO_CALL = re.compile(r'hw_todo\("(?P<what>(?:[^"\\]|\\.)*)",\s*"(?P<where>HANDOUT\.md#stage-\d\d|[^"]*?)'
                       r'(?:; [^"]*)?"\)')  # where: the anchor (an earlier stage's stub says more after "; ")
FUNC_START = re.compile(r"^(?:static\s+)?[A-Za-z_][\w \*]*?\b(?P<name>[A-Za-z_]\w*)\s*\([^;]*$")


BANNER_MARK = ("STARTER for stage", "CARRIED into stage")


class CarryError(Exception):
    pass


def carried_banner(src_id, sid, title):
    return ("/* CARRIED into stage %s (%s): your own stage-%s file, brought here by\n"
            " * `make carry STAGE=%s`. Add what stage %s asks for: its TODO(stage %s) items, which\n"
            " * `make carry` listed and hw_fsdp.starter.c (beside this file) shows; see HANDOUT.md#stage-%s. */\n"
            % (sid, title, src_id, sid, sid, sid, sid))


def rewrite_banner(text, src_id, sid, title):
    """Your file with its first comment replaced by one saying what it now is, when that comment is a starter's or
    an earlier carry's banner; otherwise the new banner goes on top and your comments stay."""
    body = text
    stripped = text.lstrip()
    if stripped.startswith("/*"):
        end = stripped.find("*/")
        if end >= 0 and any(m in stripped[:end] for m in BANNER_MARK):
            body = stripped[end + 2:].lstrip("\n")
    return carried_banner(src_id, sid, title) + body


def todos(text):
    """[(line, function, what, where)] for every hw_todo stub of a starter, in file order."""
    out, func = [], "?"
    for lineno, line in enumerate(text.split("\n"), 1):
        m = FUNC_START.match(line)
        if m and not line.startswith((" ", "\t", "#", "/", "}")):
            func = m.group("name")
        for t in TODO_CALL.finditer(line):
            out.append((lineno, func, t.group("what"), t.group("where")))
    return out


TODO_MARK = re.compile(r"/\* TODO\(stage (?P<tag>\d\d)\): (?P<what>.*?)\.? \*/")
INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"][^>\"]+[>\"]")
FUNC_DEF = re.compile(r"^(?:static\s+)?(?:inline\s+)?(?:const\s+)?[A-Za-z_]\w*(?:\s+|\s*\*+\s*)(?:\*\s*)*"
                      r"(?P<name>[A-Za-z_]\w*)\s*\(")
STRUCT_START = re.compile(r"^(?:typedef\s+)?struct\s*(?P<tag>\w+)?\s*\{\s*$")
FREE_CALL = re.compile(r"\b(?:dev_free|dev_event_destroy|free)\s*\(")


def strip_comments(text):
    """text with every /* */ and // comment blanked out, line breaks kept (so line numbers stay)."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)


def todo_marks(text):
    """[(line, stage tag, what)] of every `/* TODO(stage NN): what. */` marker, in file order."""
    return [(n, m.group("tag"), m.group("what")) for n, line in enumerate(text.split("\n"), 1)
            for m in TODO_MARK.finditer(line)]


def functions(text):
    """{name: line} of the functions a C file defines at file scope (a body follows, not a `;`)."""
    lines, out = strip_comments(text).split("\n"), {}
    for i, line in enumerate(lines):
        m = FUNC_DEF.match(line)
        if not m or line.startswith(("typedef", "struct", "return", "else")):
            continue
        rest = "\n".join(lines[i:i + 8])
        body, proto = rest.find("{"), rest.find(";")
        if body >= 0 and (proto < 0 or body < proto):
            out.setdefault(m.group("name"), i + 1)
    return out


def declared_names(decl):
    """The names one struct field declaration declares: `int srank, nshards` -> [srank, nshards]."""
    decl = re.sub(r"\[[^\]]*\]", "", decl)
    decl = re.sub(r"\([^()]*\)\s*\(", "(", decl)  # a function pointer: (*name)(args) -> (*name
    out = []
    for part in decl.split(","):
        names = re.findall(r"[A-Za-z_]\w*", part)
        if names:
            out.append(names[-1])
    return out


def structs(text):
    """{struct name: [(line, declaration, [names])]} of the file-scope structs (`struct Fsdp {` and
    `typedef struct {...} Group;`), by their tag or typedef name."""
    lines, out = strip_comments(text).split("\n"), {}
    i = 0
    while i < len(lines):
        m = STRUCT_START.match(lines[i])
        if not m:
            i += 1
            continue
        fields, j = [], i + 1
        while j < len(lines) and not lines[j].startswith("}"):
            for decl in lines[j].split(";")[:-1]:
                if decl.strip():
                    fields.append((j + 1, " ".join(decl.split()) + ";", declared_names(decl)))
            j += 1
        end = lines[j] if j < len(lines) else ""
        name = m.group("tag") or (re.findall(r"[A-Za-z_]\w*", end) or ["?"])[0]
        out[name] = fields
        i = j + 1
    return out


def frees(text):
    """[(line, call)] of the frees (dev_free, dev_event_destroy, free) outside the comments, each call as written
    (`dev_free(f->dev, g->ag_flat)`: what it frees, whatever guards it)."""
    out = []
    for n, line in enumerate(strip_comments(text).split("\n"), 1):
        for m in FREE_CALL.finditer(line):
            depth, end = 0, len(line)
            for i in range(m.end() - 1, len(line)):
                depth += {"(": 1, ")": -1}.get(line[i], 0)
                if depth == 0:
                    end = i + 1
                    break
            out.append((n, " ".join(line[m.start():end].split())))
    return out


def starter_text(st, root):
    """The starter of stage st as this tree has it (hw_fsdp.starter.c when carried, else hw_fsdp.c while it is the
    starter as shipped, else made from its solution in the instructors' tree), or None."""
    d = os.path.join(root, "stages", st.dir)
    sol = os.path.join(root, "solutions", st.dir, "hw_fsdp.c")
    for path in (os.path.join(d, "hw_fsdp.starter.c"), os.path.join(d, "hw_fsdp.c")):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        if path.endswith("starter.c"):
            return text
        shipped = manifest.read_starter_record(os.path.join(d, manifest.STARTER_RECORD))
        if shipped and hashlib.sha256(text.encode("utf-8")).hexdigest() == shipped:
            return text
    if os.path.isfile(sol):
        import make_starters
        with open(sol, encoding="utf-8") as fh:
            return make_starters.convert(fh.read(), st.id, sol)[0]
    return None


def missing_lines(starter, mine, starter_name):
    """The lines that name, in the starter, what it declares and `mine` lacks: includes, struct fields (and the
    fields mine has that the starter's struct dropped), functions, frees."""
    out = []
    where = lambda n: "[%s:%d]" % (starter_name, n)  # noqa: E731
    have = {" ".join(l.split()) for l in mine.split("\n") if INCLUDE.match(l)}
    for n, line in enumerate(starter.split("\n"), 1):
        if INCLUDE.match(line) and " ".join(line.split()) not in have:
            out.append("  - %s  %s" % (line.strip(), where(n)))
    ours = structs(mine)
    for name, fields in structs(starter).items():
        if name not in ours:
            out.append("  - struct %s: the whole struct (%d fields)  %s" % (name, len(fields), where(fields[0][0] - 1
                                                                                                  if fields else 0)))
            continue
        mine_names = {x for _, _, names in ours[name] for x in names}
        theirs = {x for _, _, names in fields for x in names}
        for n, decl, names in fields:
            if not set(names) <= mine_names:
                out.append("  - struct %s field: %s  %s" % (name, decl, where(n)))
        gone = [x for _, _, names in ours[name] for x in names if x not in theirs]
        if gone and any(not set(names) <= mine_names for _, _, names in fields):
            out.append("    (your struct %s also has %s, which the starter's has not: the fields above may replace "
                       "%s)" % (name, ", ".join(gone), "it" if len(gone) == 1 else "them"))
    mine_funcs = functions(mine)
    for name, n in sorted(functions(starter).items(), key=lambda kv: kv[1]):
        if name not in mine_funcs:
            out.append("  - function %s  %s" % (name, where(n)))
    freed = lambda call: (call.split("(", 1)[0], re.findall(r"[A-Za-z_]\w*", call)[-1])  # noqa: E731 (dev_free, ag_flat)
    mine_frees = {freed(call) for _, call in frees(mine)}
    funcs = sorted(functions(starter).items(), key=lambda kv: kv[1])
    for n, stmt in frees(starter):
        inside = next((f for f, start in reversed(funcs) if start <= n), None)
        if freed(stmt) not in mine_frees and inside in mine_funcs:  # a free in a function listed above goes with it
            out.append("  - free: %s;  %s" % (stmt, where(n)))
    return out


def carry(stage_id, root=ROOT, force=False):
    """Do the carry; returns the lines to print. CarryError says why it cannot."""
    stages = manifest.stages()
    ids = [s.id for s in stages]
    sid = stage_id.zfill(2) if stage_id.isdigit() else stage_id
    if sid not in ids:
        raise CarryError("STAGE=%s: no such stage (stages: %s)" % (stage_id, ", ".join(ids)))
    cur = stages[ids.index(sid)]
    if not cur.builds_on:
        raise CarryError("stage %s is the first stage: there is no earlier file to carry (start from its starter)" % sid)
    if cur.builds_on not in ids:
        raise CarryError("stage %s builds on stage %s, which is not in this release" % (sid, cur.builds_on))
    prev = stages[ids.index(cur.builds_on)]
    prev_file = os.path.join(root, "stages", prev.dir, "hw_fsdp.c")
    cur_dir = os.path.join(root, "stages", cur.dir)
    cur_file = os.path.join(cur_dir, "hw_fsdp.c")
    starter = os.path.join(cur_dir, "hw_fsdp.starter.c")
    if not os.path.isfile(prev_file):
        raise CarryError("%s: no such file (nothing to carry into stage %s)" % (os.path.relpath(prev_file, root), sid))
    if not os.path.isdir(cur_dir):
        raise CarryError("%s: no such directory (is stage %s in this release?)" % (os.path.relpath(cur_dir, root), sid))
    lines = []
    if os.path.exists(starter):
        if not force:
            raise CarryError("stage %s was carried already (%s exists); FORCE=1 carries again and keeps the "
                             "current file as hw_fsdp.c.bak" % (sid, os.path.relpath(starter, root)))
        if os.path.exists(cur_file):
            shutil.copyfile(cur_file, cur_file + ".bak")
            lines.append("kept your current %s as hw_fsdp.c.bak" % os.path.relpath(cur_file, root))
    else:
        if not os.path.isfile(cur_file):
            raise CarryError("%s: no such file (the starter of stage %s)" % (os.path.relpath(cur_file, root), sid))
        os.replace(cur_file, starter)
    with open(prev_file, encoding="utf-8", errors="replace") as fh:
        mine = fh.read()
    with open(starter, encoding="utf-8", errors="replace") as fh:
        starter_src = fh.read()
    adds = [t for t in todos(starter_src) if t[3] == "HANDOUT.md#stage-%s" % sid]
    with open(cur_file, "w", encoding="utf-8") as fh:
        fh.write(rewrite_banner(mine, prev.id, sid, cur.title or cur.dir))

    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    lines += ["carried %s -> %s" % (rel(prev_file), rel(cur_file)),
              "the starter of stage %s is kept beside it: %s" % (sid, rel(starter))]
    # the stubs of your earlier stages still in your file (a stub of this stage, e.g. stage 01's
    # fsdp_pre_backward, is part of what this stage adds)
    left = [t for t in todos(mine) if t[3].startswith("HANDOUT.md#stage-") and t[3][-2:] < sid]
    if left:
        lines.append("warning: your stage %s file still has %d TODO stub%s (%s): the run stops there until "
                     "you fill %s" % (prev.id, len(left), "" if len(left) == 1 else "s",
                                     "; ".join(w for _, _, w, _ in left[:3]) + ("; ..." if len(left) > 3 else ""),
                                     "it" if len(left) == 1 else "them"))
    lines.append("")
    lines.append("Stage %s (%s) adds, in the starter's order (HANDOUT.md#stage-%s):" % (sid, cur.title or cur.dir, sid))
    for lineno, func, what, where in adds:
        lines.append("  - %s: %s  [%s:%d, %s]" % (func, what, os.path.basename(starter), lineno, where))
    if not adds:
        lines.append("  (the starter has no TODO stubs)")
    lines += lacks(stages, cur, prev, starter_src, mine, root)
    lines.append("")
    lines.append("Your file has none of stage %s's new state (streams, events, fields) yet. The starter holds no "
                 "answer (it stubs every stage up to %s), so" % (sid, sid))
    lines.append("  diff -u %s %s" % (rel(starter), rel(cur_file)))
    lines.append("shows stage %s's declarations and where its TODOs sit (its - lines) beside your own code of the "
                 "earlier stages (its + lines, where the starter has TODO stubs)." % sid)
    lines.append("Then: make grade STAGE=%s" % sid)
    return lines


def lacks(stages, cur, prev, starter_src, mine, root):
    """The lines that list what a file carried from `prev` lacks for `cur` besides cur's own TODOs: the TODOs of
    the stages in between (by the starter's TODO(stage NN) markers), the earlier TODOs whose text changed since
    prev's starter, and the includes, fields, functions and frees of the starter that mine has not."""
    name = "hw_fsdp.starter.c"
    funcs = sorted(functions(starter_src).items(), key=lambda kv: kv[1])
    func_at = lambda n: next((f for f, start in reversed(funcs) if start <= n), "?")  # noqa: E731
    marks = todo_marks(starter_src)
    between = [m for m in marks if prev.id < m[1] < cur.id]
    out = []
    if between:
        tags = sorted({t for _, t, _ in between})
        out += ["", "Stage %s also needs the work of stage%s %s, which your stage %s file was written before (the "
                "starter's TODO(stage %s) stubs):" % (cur.id, "s" if len(tags) > 1 else "", ", ".join(tags), prev.id,
                                                      "/".join(tags))]
        out += ["  - %s: %s  [%s:%d, HANDOUT.md#stage-%s]" % (func_at(n), what, name, n, tag)
                for n, tag, what in between]
        for tag in tags:
            st = next((s for s in stages if s.id == tag), None)
            if st and st.started(root)[0]:
                out.append("  (your own stage %s code for these is in stages/%s/hw_fsdp.c)" % (tag, st.dir))
    # the earlier stages' TODOs as prev's starter put them, or (prev's starter gone: the student began there and
    # never carried) as the starter of a stage prev builds on puts those of its own stages and before
    seen, back = None, prev
    while back is not None:
        seen = starter_text(back, root)
        if seen is not None:
            break
        back = next((s for s in stages if s.id == back.builds_on), None)
    if seen is not None:
        known = {(tag, what) for _, tag, what in todo_marks(seen)}
        changed = [m for m in marks if m[1] <= back.id and (m[1], m[2]) not in known]
        if changed:
            out += ["", "Earlier stages' TODOs that stage %s's starter words differently from stage %s's starter%s: "
                    "your code there may need what the new words ask for:"
                    % (cur.id, back.id, "" if back is prev else " (stage %s's is not here to compare with)" % prev.id)]
            out += ["  - %s: %s  [%s:%d, HANDOUT.md#stage-%s]" % (func_at(n), what, name, n, tag)
                    for n, tag, what in changed]
    decl = missing_lines(starter_src, mine, name)
    if decl:
        out += ["", "What the starter has and your file lacks (merge these by hand; the lines are the starter's):"]
        out += decl
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="carry.py", description="Carry your file of the stage NN builds on into stage NN.")
    ap.add_argument("stage", help="the stage to carry into (e.g. 03)")
    ap.add_argument("--force", action="store_true", help="carry again over an already carried stage")
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        for line in carry(args.stage, os.path.abspath(args.root), args.force):
            print(line)
    except (CarryError, manifest.ManifestError) as e:
        print("carry: error: %s" % e, file=sys.stderr)
        return 2
    except OSError as e:
        print("carry: error: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
