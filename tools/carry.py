#!/usr/bin/env python3
"""Carry your own code forward into the next stage (make carry STAGE=NN).

    carry.py NN [--force] [--root DIR]

Copies your file of the stage NN builds on (grader/rubric.json's builds_on: stage NN-1 for
02..07, stage 06 for each bonus stage 08, 09, 10, stage 07 for the pipeline's 11 and 11 for 12),
stages/<that>/hw_fsdp.c, over
stages/<NN>/hw_fsdp.c, keeping stage NN's starter beside it as hw_fsdp.starter.c, rewrites
the file's first comment to say what it now is, and prints what stage NN adds: each TODO of
stage NN in the starter, the function it sits in, and the HANDOUT section that explains it.
The starter holds no answer (it stubs every stage up to NN), so nothing official is laid
beside your code. From then on you evolve one file of your own, stage after stage; the
grader reads whatever stages/<NN>/hw_fsdp.c holds.

Refuses (one line, exit status 2) when stage NN is the first stage or does not exist, when
the file it carries from is missing, and when stage NN was carried already
(hw_fsdp.starter.c exists): --force (make carry STAGE=NN FORCE=1) carries again and keeps
the file it replaces as hw_fsdp.c.bak.
"""
import argparse
import os
import re
import shutil
import sys

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest

TODO_CALL = re.compile(r'hw_todo\("(?P<what>(?:[^"\\]|\\.)*)",\s*"(?P<where>[^"]*)"\)')
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
        adds = [t for t in todos(fh.read()) if t[3] == "HANDOUT.md#stage-%s" % sid]
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
    lines.append("")
    lines.append("Your file has none of stage %s's new state (streams, events, fields) yet. The starter holds no "
                 "answer (it stubs every stage up to %s), so" % (sid, sid))
    lines.append("  diff -u %s %s" % (rel(starter), rel(cur_file)))
    lines.append("shows stage %s's declarations and where its TODOs sit (its - lines) beside your own code of the "
                 "earlier stages (its + lines, where the starter has TODO stubs)." % sid)
    lines.append("Then: make grade STAGE=%s" % sid)
    return lines


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
