"""Grading a whole class: grade.py --class SUBMISSIONS [--out class-runs] [--jobs 2] [--stage NN ...].

SUBMISSIONS holds one entry per student: a folder, or a tarball (.tar, .tar.gz, .tgz, .tar.bz2,
.tar.xz) or a .zip, named after the student. From each, only the files
<somewhere>/NN_name/hw_fsdp.c are taken (a regular file of at most 2 MiB, at most 5 folders
deep; the shallowest one when there are several), copied into OUT/<student>/submitted/stages/,
and graded there by a grade.py of its own (--tree, --sandbox) into OUT/<student>/runs/.
JOBS students are graded at once, each in its own sandbox slot (see runner.Sandbox).

Written: OUT/scores.csv (student, points per stage, total, max), and per student
OUT/<student>/report.md (per stage: points, the failing checks and their messages, the run
directories), OUT/<student>/results.json and OUT/<student>/grade.txt (the grader's lines).

The grader's own inputs (the reference logs, the rubric, the runtime it links every binary
with, the grader) are fingerprinted before the batch; after each student they are compared,
and restored from the copy in memory if anything changed them, the students graded meanwhile
then graded again (as root nothing can change them: every run is an unprivileged user).
"""
import concurrent.futures
import csv
import io
import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
import zipfile

import manifest

from .rubric import stage_variants
from .runner import SANDBOX_UID_BASE, _proc_table, sandbox_reach_error
from .util import NOT_GRADED, ROOT, fmt_points, one_line, relpath

ARCHIVES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tbz2", ".txz", ".tar", ".zip")
MAX_FILE = 2 << 20        # one hw_fsdp.c
MAX_ARCHIVE = 256 << 20   # a student's tarball
MAX_MEMBERS = 100000
MAX_DEPTH = 6             # path components down to hw_fsdp.c (student/hwfsdp/stages/NN_name/hw_fsdp.c is 4)


def student_name(entry):
    """The student's name from the entry's: archive suffix off, anything but [A-Za-z0-9._@+-] as '_'."""
    base = entry
    for suf in ARCHIVES:
        if base.lower().endswith(suf):
            base = base[:-len(suf)]
            break
    name = re.sub(r"[^A-Za-z0-9._@+-]", "_", base).strip(".") or "student"
    return name[:80]


def _pick(found, stage_dirs, notes):
    """{stage dir: bytes} from [(path parts, bytes or reason)], the shallowest per stage."""
    files = {}
    for d in stage_dirs:
        cands = sorted((len(parts), "/".join(parts), data) for parts, data in found if parts[-2] == d)
        if not cands:
            continue
        depth, path, data = cands[0]
        if isinstance(data, str):
            notes.append("%s: %s (stage %s not graded from it)" % (path, data, d))
            continue
        if len(cands) > 1:
            notes.append("stage %s: %d files named %s/hw_fsdp.c; graded the shallowest, %s" % (d, len(cands), d, path))
        files[d] = data
    return files


def _wanted(parts, stage_dirs):
    return (len(parts) >= 2 and parts[-1] == "hw_fsdp.c" and parts[-2] in stage_dirs and len(parts) <= MAX_DEPTH
            and ".." not in parts and "" not in parts)


def collect(path, stage_dirs):
    """({stage dir: source bytes}, [notes]) from a student's folder or archive; never follows a link."""
    notes, found = [], []
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(path):
            rel = os.path.relpath(dirpath, path)
            parts = [] if rel == "." else rel.split(os.sep)
            if len(parts) >= MAX_DEPTH:
                dirnames[:] = []
            for f in filenames:
                full = parts + [f]
                if not _wanted(full, stage_dirs):
                    continue
                p = os.path.join(dirpath, f)
                fst = os.lstat(p)
                if not stat.S_ISREG(fst.st_mode):
                    found.append((full, "not a regular file"))
                elif fst.st_size > MAX_FILE:
                    found.append((full, "larger than %d MiB" % (MAX_FILE >> 20)))
                else:
                    with open(p, "rb") as fh:
                        found.append((full, fh.read(MAX_FILE)))
    elif not stat.S_ISREG(st.st_mode):
        return {}, ["not a folder, a tarball or a zip: nothing graded"]
    elif st.st_size > MAX_ARCHIVE:
        return {}, ["the archive is larger than %d MiB: nothing graded" % (MAX_ARCHIVE >> 20)]
    elif path.lower().endswith(".zip"):
        try:
            with zipfile.ZipFile(path) as z:
                for info in z.infolist()[:MAX_MEMBERS]:
                    parts = [p for p in info.filename.split("/") if p not in ("", ".")]
                    if not _wanted(parts, stage_dirs) or info.is_dir():
                        continue
                    if stat.S_ISLNK(info.external_attr >> 16):
                        found.append((parts, "a symbolic link"))
                    elif info.file_size > MAX_FILE:
                        found.append((parts, "larger than %d MiB" % (MAX_FILE >> 20)))
                    else:
                        with z.open(info) as fh:
                            found.append((parts, fh.read(MAX_FILE)))
        except (zipfile.BadZipFile, OSError, RuntimeError, ValueError, EOFError) as e:
            return {}, ["not a readable zip (%s): nothing graded" % one_line(str(e), 200)]
    else:
        try:
            with tarfile.open(path, "r:*") as tar:
                for n, m in enumerate(tar):
                    if n >= MAX_MEMBERS:
                        notes.append("more than %d members: the rest not read" % MAX_MEMBERS)
                        break
                    parts = [p for p in m.name.split("/") if p not in ("", ".")]
                    if not _wanted(parts, stage_dirs):
                        continue
                    if not m.isreg():
                        found.append((parts, "not a regular file"))
                    elif m.size > MAX_FILE:
                        found.append((parts, "larger than %d MiB" % (MAX_FILE >> 20)))
                    else:
                        found.append((parts, tar.extractfile(m).read(MAX_FILE)))
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            return {}, ["not a readable tarball (%s): nothing graded" % one_line(str(e), 200)]
    return _pick(found, stage_dirs, notes), notes


# ---- the grader's own inputs -------------------------------------------------------------------

def _input_files(reference, rubric_path):
    """Every file the grading of one student reads besides the student's: reference, rubric, grader,
    runtime sources and the built runtime, the data."""
    paths = [rubric_path, os.path.join(ROOT, "Makefile"), os.path.join(ROOT, "data", "corpus.txt")]
    paths += manifest.figure_paths(rubric_path)  # the measured figures beside the rubric (grader/figures/)
    tops = [reference, os.path.join(ROOT, "grader"), os.path.join(ROOT, "common"), os.path.join(ROOT, "mk")]
    build = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))
    paths.append(os.path.join(build, "libhwfsdp.a"))
    tops.append(os.path.join(build, "common", "driver"))
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            paths += [os.path.join(dirpath, f) for f in filenames if not f.endswith(".pyc")]
    return sorted(set(p for p in paths if os.path.isfile(p)))


class Inputs:
    """The grader's inputs held in memory: changed() says which differ now, restore() writes them back."""

    def __init__(self, reference, rubric_path):
        self.files = {}
        self.times = {}  # (atime, mtime) in ns: a restored file keeps them, so make sees nothing new to rebuild
        for p in _input_files(reference, rubric_path):
            with open(p, "rb") as fh:
                self.files[p] = fh.read()
            st = os.stat(p)
            self.times[p] = (st.st_atime_ns, st.st_mtime_ns)
        self.reference = reference

    def changed(self):
        out = []
        for p, data in self.files.items():
            try:
                with open(p, "rb") as fh:
                    if fh.read() != data:
                        out.append(p)
            except OSError:
                out.append(p)
        for dirpath, _, filenames in os.walk(self.reference):  # a file added to the reference logs
            out += [os.path.join(dirpath, f) for f in filenames if os.path.join(dirpath, f) not in self.files]
        return out

    def restore(self, paths):
        for p in paths:
            if p in self.files:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p + ".restore", "wb") as fh:
                    fh.write(self.files[p])
                os.utime(p + ".restore", ns=self.times[p])
                os.replace(p + ".restore", p)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass


# ---- grading -----------------------------------------------------------------------------------

def _worker_cmd(args, submitted, dest, stages, slot):
    cmd = [sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--tree", submitted,
           "--out", os.path.join(dest, "runs"), "--json", os.path.join(dest, "results.json"),
           "--reference", os.path.abspath(args.reference), "--rubric", os.path.abspath(args.rubric),
           "--sandbox", "--slot", str(slot)]
    for s in stages:
        cmd += ["--stage", s]
    if args.timeout:
        cmd += ["--timeout", "%g" % args.timeout]
    return cmd


def _worker_deadline(rubric, stages, timeout_s):
    lim = rubric["limits"]
    per = [lim["build_timeout_s"] + 2 * (1 + len(stage_variants(rubric, s))) * (timeout_s + 10) + 60 for s in stages]
    return sum(per) + lim["build_timeout_s"] + 60


def _kill_slot(proc, slot):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if os.geteuid() == 0:
        uid = SANDBOX_UID_BASE + slot
        for pid, (_, u) in _proc_table().items():
            if u == uid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def grade_one(args, stages, dest, slot, deadline_s):
    """Run the student's grader; (results dict or None, why it has none)."""
    submitted = os.path.join(dest, "submitted")
    for f in ("results.json", "grade.txt"):
        try:
            os.unlink(os.path.join(dest, f))
        except FileNotFoundError:
            pass
    shutil.rmtree(os.path.join(dest, "runs"), ignore_errors=True)
    cmd = _worker_cmd(args, submitted, dest, stages, slot)
    with open(os.path.join(dest, "grade.txt"), "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            _kill_slot(proc, slot)
            proc.wait()
            return None, "grading did not finish in %g s" % deadline_s
    try:
        with open(os.path.join(dest, "results.json")) as fh:
            return json.load(fh), ""
    except (OSError, ValueError) as e:
        return None, "the grader wrote no results (exit status %s: %s); see %s" % (
            rc, one_line(str(e), 200), relpath(os.path.join(dest, "grade.txt")))


# calls a hw_fsdp.c has no need for: they can reach past the runtime (files, processes, the loader), so an
# instructor reads those lines (a note in the report, never points: printf-style calls are not listed)
REVIEW = re.compile(r"\b(fopen|freopen|fdopen|open|openat|creat|fwrite|write|pwrite|unlink|remove|rename|truncate|"
                    r"mmap|system|popen|fork|vfork|clone|exec[lv]p?e?|posix_spawnp?|dlopen|dlsym|syscall|ptrace|kill|"
                    r"atexit|on_exit|signal|sigaction|asm|__asm__)\s*\(")


def calls_to_review(src):
    """['fopen (line 12)', ...] in a submitted file, comments and strings blanked first."""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), src, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        out += ["%s (line %d)" % (m.group(1), n) for m in REVIEW.finditer(line)]
    return out


def report_text(student, results, why, notes, stages, review=None):
    lines = ["# %s" % student, ""]
    if review:
        lines += ["Calls to review (a hw_fsdp.c needs none of them; they can reach past the runtime):"]
        lines += ["- %s: %s" % (d, ", ".join(c[:12]) + (" ..." if len(c) > 12 else "")) for d, c in review.items()]
        lines.append("")
    if notes:
        lines += ["Submission:"] + ["- %s" % n for n in notes] + [""]
    if results is None:
        lines += ["**Not graded:** %s" % why, ""]
        return "\n".join(lines)
    lines.append("**Score: %s/%s**%s" % (fmt_points(results["score"]), fmt_points(results["max_score"]),
                                         " + bonus %s/%s" % (fmt_points(results["bonus_score"]),
                                                             fmt_points(results["bonus_max_score"]))
                                         if results.get("bonus_max_score") else ""))
    lines.append("")
    for sid in stages:
        r = results["stages"].get(sid)
        if r is None:
            continue
        lines.append("## Stage %s — %s/%s%s" % (sid, fmt_points(r["points"]), fmt_points(r["max_points"]),
                                              " (bonus)" if r.get("bonus") else ""))
        lines.append("")
        lines.append("- source: `%s`" % r["source"])
        lines.append("- run: `%s`%s" % (r["run"]["dir"], "" if r["run"]["ok"] else " — FAILED: " + r["run"]["reason"]))
        for v in r.get("variants", {}).values():
            lines.append("- also on %s: `%s`%s" % (v["label"], v["dir"], "" if v["ok"] else " — FAILED: " + v["reason"]))
        failing = [c for c in r["checks"] if c["ok"] is False]  # None: not graded on this backend (--cuda)
        # a failed run's checks all point at its reason (said above): one line for them, not one each
        ungraded = [c for c in failing if c["reason"].startswith(NOT_GRADED)]
        failing = [c for c in failing if c not in ungraded]
        if failing:
            lines.append("- failing checks:")
            for c in failing:
                lines.append("  - **%s** (%s point%s): %s" % (c["name"], fmt_points(c["max_points"]),
                                                           "" if c["max_points"] == 1 else "s", c["reason"]))
        if ungraded:
            lost = sum(c["max_points"] for c in ungraded)
            lines.append("- not graded (the run failed, %s point%s): %s" % (
                fmt_points(lost), "" if lost == 1 else "s", ", ".join("**%s**" % c["name"] for c in ungraded)))
        if not failing and not ungraded:
            lines.append("- every check passed")
        lines.append("")
    return "\n".join(lines)


def grade_class(args, rubric, stages, out_root, say):
    t0 = time.monotonic()
    stage_dirs = [rubric["stages"][s]["dir"] for s in stages]
    sub_root = os.path.abspath(args.klass)
    entries, names = [], {}
    for e in sorted(os.listdir(sub_root)):
        path = os.path.join(sub_root, e)
        if e.startswith(".") or os.path.abspath(path) == out_root:
            continue
        if not os.path.isdir(path) and not e.lower().endswith(ARCHIVES):
            say("skipped %s: not a folder, a tarball or a zip" % e)
            continue
        name = student_name(e)
        if name in names:
            names[name] += 1
            name = "%s~%d" % (name, names[name])
        else:
            names[name] = 1
        entries.append((name, path))
    if not entries:
        say("grade.py: error: --class %s: no submissions in it (one folder or tarball per student)" % args.klass,
            sys.stderr)
        return 2

    if os.geteuid() == 0:  # (constructing a Sandbox here would make this process a subreaper too)
        blocked = sandbox_reach_error(out_root, "users")
        if blocked:
            say("grade.py: error: %s" % blocked, sys.stderr)
            return 2
    inputs = Inputs(os.path.abspath(args.reference), os.path.abspath(args.rubric))
    say("grading %d student%s, %d at a time, stage%s %s; runs in %s" % (
        len(entries), "" if len(entries) == 1 else "s", args.jobs, "" if len(stages) == 1 else "s",
        " ".join(stages), relpath(out_root)))
    if os.geteuid() != 0:
        say("warning: not root, so each submission runs as you and could write to your files (the grader's own "
            "inputs are checked and restored after each student); run as root in a container for a user per run")
    prepared = []
    for name, path in entries:
        dest = os.path.join(out_root, name)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        submitted = os.path.join(dest, "submitted")
        os.makedirs(os.path.join(submitted, "stages"))
        os.chmod(submitted, 0o700)  # another student's run cannot read it
        try:
            files, notes = collect(path, stage_dirs)
        except OSError as e:
            files, notes = {}, ["could not be read: %s" % e]
        for d, data in files.items():
            os.makedirs(os.path.join(submitted, "stages", d))
            with open(os.path.join(submitted, "stages", d, "hw_fsdp.c"), "wb") as fh:
                fh.write(data)
        missing = [d for d in stage_dirs if d not in files]
        if missing:
            notes.append("no hw_fsdp.c for %s (0 points there)" % ", ".join(missing))
        prepared.append((name, dest, notes))

    deadline = _worker_deadline(rubric, stages, args.timeout or rubric["limits"]["run_timeout_s"])
    slots = queue.Queue()
    for k in range(args.jobs):
        slots.put(k)
    lock = threading.Lock()
    state = {"running": set(), "tainted": set()}
    done = {}

    def job(item):
        name, dest, notes = item
        slot = slots.get()
        with lock:
            state["running"].add(name)
        t1 = time.monotonic()
        try:
            results, why = grade_one(args, stages, dest, slot, deadline)
        finally:
            with lock:
                changed = inputs.changed()
                if changed:  # someone's run wrote the grader's inputs: put them back, regrade who ran meanwhile
                    inputs.restore(changed)
                    state["tainted"] |= state["running"]
                    say("warning: %s changed while grading %s: restored; they will be graded again" % (
                        ", ".join(relpath(p) for p in changed[:3]) + (" ..." if len(changed) > 3 else ""),
                        ", ".join(sorted(state["running"]))))
                state["running"].discard(name)
            slots.put(slot)
        done[name] = (results, why, notes, time.monotonic() - t1)
        with lock:
            if name not in state["tainted"]:
                _say_student(say, name, dest, results, why, done[name][3])

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        list(ex.map(job, prepared))
    for name, dest, notes in prepared:  # graded again, one at a time, nothing else running
        if name not in state["tainted"]:
            continue
        t1 = time.monotonic()
        results, why = grade_one(args, stages, dest, 0, deadline)
        changed = inputs.changed()
        if changed:
            inputs.restore(changed)
            results, why = None, ("its runs write outside their run directory (%s): not graded"
                                  % ", ".join(relpath(p) for p in changed[:3]))
        done[name] = (results, why, notes, time.monotonic() - t1)
        _say_student(say, name, dest, results, why, done[name][3])

    csv_path = os.path.join(out_root, "scores.csv")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["student"] + ["stage%s" % s for s in stages] + ["total", "max", "bonus"])
    bonus = [rubric["stages"][s].get("bonus", False) for s in stages]  # advanced track: extra, outside the total
    max_total = sum(sum(rubric["stages"][s]["checks"].values()) for s, b in zip(stages, bonus) if not b)
    for name, dest, notes in prepared:
        results, why, _, _ = done[name]
        per = [(results or {}).get("stages", {}).get(s, {}).get("points", 0) for s in stages]
        w.writerow([name] + [fmt_points(p) for p in per] + [
            fmt_points(sum(p for p, b in zip(per, bonus) if not b)), fmt_points(max_total),
            fmt_points(sum(p for p, b in zip(per, bonus) if b))])
        review = {}
        for d in stage_dirs:
            path = os.path.join(dest, "submitted", "stages", d, "hw_fsdp.c")
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    found = calls_to_review(fh.read())
                if found:
                    review[d] = found
        with open(os.path.join(dest, "report.md"), "w") as fh:
            fh.write(report_text(name, results, why, notes, stages, review) + "\n")
    with open(csv_path + ".tmp", "w") as fh:
        fh.write(buf.getvalue())
    os.replace(csv_path + ".tmp", csv_path)
    say("scores: %s" % relpath(csv_path))
    say("graded %d student%s in %.1f s" % (len(prepared), "" if len(prepared) == 1 else "s", time.monotonic() - t0))
    return 0


def _say_student(say, name, dest, results, why, seconds):
    if results is None:
        say("== %s == NOT GRADED: %s (%.1fs)" % (name, why, seconds))
    else:
        say("== %s == %s/%s (%.1fs; report: %s)" % (name, fmt_points(results["score"]),
                                                    fmt_points(results["max_score"]), seconds,
                                                    relpath(os.path.join(dest, "report.md"))))
