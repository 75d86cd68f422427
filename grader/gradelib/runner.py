"""Building a hw_fsdp.c and running the binary in isolation, and saying in one line why a run failed.

A Runner holds what every build and run of one grading shares: the rubric's limits, the
wall-clock limit of a run, and the backend (the CPU runtime, or the CUDA one with --cuda).
Each run is a child process in its own session with resource limits, so that a student's
binary can neither hang nor crash the grader; classify_run turns its exit status and the
tail of its log into the reason every check of the stage then reports.

With a Sandbox (grade.py --sandbox; --class and the Gradescope autograder always use one) a
run is also contained: as root it runs as an unprivileged user of its own (the slot's uid),
so it can write nowhere but its run directory and /tmp and its process count is limited; in
every mode the grader adopts whatever the run leaves behind (a subreaper) and kills it, a
run that starts more processes than a training run needs or fills its run directory past
the limit is stopped, and afterwards the run directory goes back to the grader holding
regular files and directories only (no link or FIFO for a check to follow or block on).
"""
import ctypes
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time

import manifest

from .util import ROOT, is_int, relpath

# the training binary's exit statuses: a runtime error, a TODO stub reached (common/util.h), a NaN loss
# (common/train_main.c)
EXIT_FATAL, EXIT_TODO, EXIT_NAN = 2, 3, 4
RUNTIME_ERROR = "runtime error: "  # how a run's reason opens when the runtime stopped it with a diagnosis
# a stage whose rubric entry says "save": its main configuration runs once more into <run dir>/SAVED_DIR with
# --save, writing CHECKPOINT at the last step (the baseline's run with --save writes it into its own dir)
SAVED_DIR, CHECKPOINT = "checkpoint", "checkpoint.safetensors"

SIGNAL_HINTS = {
    "SIGSEGV": "a bad pointer: a Param.data/grad used after it was freed or set to NULL, or a copy out of bounds",
    "SIGBUS": "a bad pointer or a misaligned access",
    "SIGABRT": "an abort: a failed assert or heap corruption found by malloc (a write out of bounds?)",
    "SIGFPE": "an integer division by zero",
    "SIGILL": "an illegal instruction: the compiler's trap for a NULL dereference it could prove",
    "SIGXCPU": "the CPU-time limit: an endless loop?",
    "SIGXFSZ": "the file-size limit: a run writing huge files?",
    "SIGKILL": "killed from outside (out of memory?)",
}


class RunResult:
    def __init__(self, run_dir, ok, reason, seconds, cmd):
        self.dir, self.ok, self.reason, self.seconds, self.cmd = run_dir, ok, reason, seconds, cmd


class Runner:
    """Builds hw_fsdp.c files with make and runs the binaries under `limits` (rubric.json's "limits").

    cuda: build against the CUDA runtime (make impl-cuda) instead of the CPU one (make impl); the
    checks then take the non-sharded baseline on the same GPU as the ground truth (Context.cuda)."""

    def __init__(self, limits, timeout_s, cuda=False, sandbox=None):
        self.limits, self.timeout_s, self.cuda, self.sandbox = limits_for_backend(limits, cuda), timeout_s, cuda, sandbox

    def build(self, src, out_bin, log_path):
        """make impl SRC=src OUT=out_bin (impl-cuda with cuda); (ok, reason, seconds). The reason is the build's first
        error line: the compiler's, or tools/check_shared_state.py's for state the rank threads would share."""
        if os.path.exists(out_bin):
            os.remove(out_bin)
        cmd = ["make", "-s", "--no-print-directory", "impl-cuda" if self.cuda else "impl", "SRC=" + src,
               "OUT=" + out_bin]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=self.limits["build_timeout_s"])
            output, rc = p.stdout.decode("utf-8", "replace"), p.returncode
        except subprocess.TimeoutExpired as e:
            output, rc = (e.stdout or b"").decode("utf-8", "replace"), None
        seconds = time.monotonic() - t0
        with open(log_path, "a") as log:
            log.write("$ %s\n%s" % (" ".join(cmd), output))
        if rc == 0 and os.path.exists(out_bin):
            return True, "", seconds
        if rc is None:
            return False, "build timed out after %g s" % self.limits["build_timeout_s"], seconds
        first = next((l for l in output.splitlines() if re.search(r"(^|: )(fatal )?error:|undefined reference", l)),
                     None)
        if first is None:
            first = next((l for l in output.splitlines() if l.strip()), "make exited with status %s" % rc)
        first = first.replace(ROOT + os.sep, "").strip()
        if first.startswith("common/"):  # not the student's file: say so, or they will hunt in the wrong place
            return False, "build failed in the runtime, not in your file (run make): " + first, seconds
        return False, "build failed: " + first, seconds

    def run(self, binary, flags, run_dir, log_path, steps, one_stream=False):
        """Train with `flags` into run_dir (log appended to log_path); a RunResult with the reason if it failed.
        one_stream: the stage runs everything on the compute stream (the hints say so)."""
        cmd = [binary] + list(flags) + ["--out", run_dir, "--quiet"]
        if self.sandbox is not None:
            rc, seconds, stopped = self.sandbox.run(cmd, log_path, run_dir, self.timeout_s, self.limits)
            if stopped:
                return RunResult(run_dir, False, stopped, seconds, cmd)
        else:
            rc, seconds = run_limited(cmd, log_path, self.timeout_s, self.limits)
        ok, reason = classify_run(rc, log_path, run_dir, self.timeout_s, steps, self.limits, one_stream)
        return RunResult(run_dir, ok, reason, seconds, cmd)

    def run_saving(self, binary, flags, run_dir, steps, one_stream=False):
        """The main run's configuration once more, with --save: its checkpoint at the last step lands in
        run_dir/SAVED_DIR/CHECKPOINT (a run of its own, so the main run's trace and snapshots, which the other
        checks compare with the reference's, hold no checkpoint gather, and a checkpoint the runtime refuses
        fails only the checkpoint's check). A RunResult of that run."""
        d = os.path.join(run_dir, SAVED_DIR)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return self.run(binary, list(flags) + ["--save", os.path.join(d, CHECKPOINT)], d, os.path.join(d, "log.txt"),
                        steps, one_stream)


class Baselines:
    """The non-sharded baseline, run once per distinct configuration per grader invocation."""

    def __init__(self, runner, out_root):
        self.runner, self.out_root = runner, out_root
        self.cache = {}
        self.built = None

    def _build(self):
        """A private copy of the baseline, built like any hw_fsdp.c: no race with another grader relinking
        build/baseline/train while this one runs it."""
        if self.built is None:
            d = os.path.join(self.out_root, "baseline-bin")
            os.makedirs(d, exist_ok=True)
            ok, reason, _ = self.runner.build(os.path.join(ROOT, "common", "driver", "baseline.c"), os.path.join(d, "train"),
                                              os.path.join(d, "log.txt"))
            self.built = (ok, reason, os.path.join(d, "train"))
        return self.built

    def get(self, flags, steps, save=False):
        """The baseline's run with `flags`, run once and cached. save: a run that also wrote its checkpoint at the
        last step into its dir (--save <dir>/CHECKPOINT); such a run serves the calls without save too (the same
        flags, the same numbers), and a call with save after one without runs the baseline again with it."""
        key = tuple(flags)
        if key not in self.cache or (save and not self.cache[key][1]):
            ok, reason, binary = self._build()
            tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
            run_dir = os.path.join(self.out_root, "baseline-" + tag + ("-save" if save else ""))
            if not ok:
                self.cache[key] = (RunResult(run_dir, False, "the baseline did not build: " + reason, 0.0, []), save)
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
                extra = ["--save", os.path.join(run_dir, CHECKPOINT)] if save else []
                self.cache[key] = (self.runner.run(binary, list(flags) + extra, run_dir,
                                                   os.path.join(run_dir, "log.txt"), steps), save)
        return self.cache[key][0]


def limits_for_backend(limits, cuda):
    """The rubric's limits as they apply to one backend. A CUDA process maps the GPU's memory
    and the driver's own reservations into its address space (tens of GiB of virtual space
    before the first cudaMalloc; cudaSetDevice fails with "out of memory" under RLIMIT_AS), so
    --cuda runs have no address-space limit: the GPU's own memory bounds them instead."""
    if not cuda:
        return limits
    return dict(limits, run_address_space_gib=None)


def _limit_child(limits):
    """preexec_fn: resource limits for a student's binary (generous: they catch runaways).
    run_address_space_gib None: no RLIMIT_AS (CUDA runs, limits_for_backend)."""
    def apply():
        cpu = int(limits["run_cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        if limits["run_address_space_gib"] is not None:
            space = int(limits["run_address_space_gib"] * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (space, space))
        fsize = int(limits["run_file_size_mib"] * (1 << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _log_command(log, cmd):
    """The command line at the top of a run's log (binary log file, flushed before the child writes)."""
    log.write(("$ %s\n" % " ".join(relpath(c) if os.path.isabs(c) else c for c in cmd)).encode())
    log.flush()


def run_limited(cmd, log_path, timeout_s, limits, cwd=ROOT):
    """Run cmd with stdout+stderr appended to log_path. Returns (returncode or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        _log_command(log, cmd)
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_limit_child(limits), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, time.monotonic() - t0


def tail_lines(path, n=200):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-n:]


def last_completed_step(run_dir):
    """The last step metrics.jsonl records (0 if none); a killed run may leave a torn last line."""
    last = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(row, dict) and is_int(row.get("step")):
                    last = max(last, row["step"])
    except OSError:
        return 0
    return last


def describe_signal(num):
    try:
        name = signal.Signals(num).name
    except ValueError:
        return "crashed with signal %d" % num
    desc = (signal.strsignal(num) or name).lower()
    text = "crashed with %s (%s)" % (name, desc)
    hint = SIGNAL_HINTS.get(name)
    return text + ": " + hint if hint else text


def classify_run(rc, log_path, run_dir, timeout_s, steps, limits=None, one_stream=False):
    """(ok, reason) for a finished (or killed) training run; `limits` names the rubric's limit a run hit."""
    lines = tail_lines(log_path)
    if rc is None:
        done = last_completed_step(run_dir)
        where = ("last completed step: %d of %d" % (done, steps)) if done else "no step completed"
        return False, ("no progress after %g s: a deadlock? ranks waiting in mismatched collectives or an event "
                       "never recorded (%s)" % (timeout_s, where))
    if rc == 0:
        return True, ""
    if rc < 0:
        reason = describe_signal(-rc)
        if limits and -rc == signal.SIGXCPU:
            reason += " (the grader allows %g s of CPU time per run)" % limits["run_cpu_s"]
        if limits and -rc == signal.SIGXFSZ:
            reason += " (the grader allows files up to %g MiB)" % limits["run_file_size_mib"]
        return False, reason
    if rc == EXIT_TODO:
        todo = [l.strip() for l in lines if "TODO not implemented:" in l]
        return False, todo[-1] if todo else "TODO not implemented (exit status 3)"
    errors = [l.strip() for l in lines if l.startswith("error: ")]
    if rc == EXIT_NAN:
        m = None
        for l in errors:
            m = re.search(r"error: (loss|grad_norm) is not finite at step (\d+)", l) or m
        what = "%s not finite at step %s" % (m.group(1), m.group(2)) if m else "loss/grad_norm not finite"
        if one_stream:  # stages 01-02: one stream, so no wait can be missing
            return False, (what + ": fresh allocations are NaN-filled and everything here runs on the compute stream "
                           "in order, so some memory was never written: padding rows not zeroed, a copy with the "
                           "wrong offset or count, a buffer read after it was freed, or a division by zero")
        return False, (what + ": fresh allocations are NaN-filled, so this is usually compute reading a buffer "
                       "before it was written (a missing dev_stream_wait_event?) or a division by zero")
    if rc == EXIT_FATAL and errors:
        reason = RUNTIME_ERROR + errors[-1][len("error: "):] + taught_in(errors[-1])
        if limits and limits["run_address_space_gib"] is not None and "out of memory" in reason:
            reason += " (the grader's memory limit: %g GiB of address space per run)" % limits["run_address_space_gib"]
        return False, reason
    last = errors[-1] if errors else (lines[-1].strip() if lines else "")
    return False, "exited with status %d%s" % (rc, (": " + last) if last else "")


def taught_in(line):
    """" (--flag: stage NN)" for the first flag a runtime message names that a stage teaches (manifest.flag_stage:
    the runtime speaks of flags, the course of stages), or ""."""
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
        st = manifest.flag_stage(flag)
        if st is not None:
            return " (%s: stage %s)" % (flag, st.id)
    return ""


# ---- the sandbox ---------------------------------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36
SANDBOX_UID_BASE = 61000  # slot k runs as uid/gid 61000 + k (no /etc/passwd entry needed)


def _proc_table():
    """{pid: (ppid, uid)} of every process now (Linux /proc; a process gone while reading is skipped)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as fh:
                ppid = uid = None
                for line in fh:
                    if line.startswith("PPid:"):
                        ppid = int(line.split()[1])
                    elif line.startswith("Uid:"):
                        uid = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
        if ppid is not None and uid is not None:
            table[int(name)] = (ppid, uid)
    return table


def descendants(root_pid, table=None):
    """The pids below root_pid in the process tree."""
    table = _proc_table() if table is None else table
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def unreachable_by_others(path):
    """The first folder on path's way without o+x (a user of no group of ours cannot pass it), or None."""
    path = os.path.abspath(path)
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return path
        except FileNotFoundError:
            pass
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


# What a run reads of the grader's tree: it starts in ROOT (entered before it becomes the sandbox's
# user, Runner.run's cwd) and opens the driver's default --data, data/corpus.txt, from there. So ROOT and
# data/ need o+x and the corpus o+r, but the folders above ROOT need nothing: a clone in a mode-700
# home (root's /root, a new user's home on recent Debian) is graded as well as one in /srv.
RUN_READS = (("", stat.S_IXOTH, "o+x"), ("data", stat.S_IXOTH, "o+x"),
             (os.path.join("data", "corpus.txt"), stat.S_IROTH, "o+r"))


def sandbox_reach_error(out_root, who="user"):
    """One line (no "grade.py: error:") saying what the sandbox's `who` ("user", "users") cannot reach to
    run: out_root, where the binaries are built and the runs write, or what a run reads in the tree
    (RUN_READS); None when they can."""
    they = "it needs" if who == "user" else "they need"
    for rel, bit, name in RUN_READS:
        path = os.path.join(ROOT, rel) if rel else ROOT
        try:
            if not os.stat(path).st_mode & bit:
                return "the sandbox's %s cannot read %s (%s %s on %s)" % (who, os.path.join(ROOT, RUN_READS[-1][0]),
                                                                          they, name, path)
        except FileNotFoundError:
            pass  # a missing corpus is the run's own one-line error
    blocked = unreachable_by_others(out_root)
    if blocked:
        return "the sandbox's %s cannot reach %s (%s o+x on %s): choose another --out" % (
            who, relpath(out_root), they, blocked)
    return None


def openblas_core(binary, coretype=None):
    """The core type (kernel family) OpenBLAS picks for binary, under OPENBLAS_CORETYPE=coretype if given
    (OPENBLAS_VERBOSE=2 makes it name it), or None if it does not say. Kernels round differently in the last bits:
    what a machine's runs can differ by (tools/parity_spread.py, make reference-check)."""
    env = dict(os.environ, OPENBLAS_VERBOSE="2")
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.findall(r"^Core: (\S+)", p.stdout + p.stderr, re.M)
    return found[-1] if found else None


def reachable_temp_dir(prefix):
    """A fresh folder (mode 755) that the sandbox's users can reach, in the first temp folder they can pass
    ($TMPDIR, /var/tmp, /tmp), or None. mkdtemp: no one can have made it beforehand."""
    for base in (tempfile.gettempdir(), "/var/tmp", "/tmp"):
        if os.path.isdir(base) and unreachable_by_others(base) is None:
            try:
                path = tempfile.mkdtemp(prefix=prefix, dir=base)
                os.chmod(path, 0o755)
            except OSError:
                continue
            return path
    return None


class Sandbox:
    """Containment for the runs of untrusted binaries (see the module's docstring).

    slot: which of the concurrent graders this is (its uid as root); max_procs: processes a run
    may have at once (a training run is one process with threads); max_dir_mib: what its run
    directory may hold."""

    def __init__(self, slot=0, max_procs=8, max_dir_mib=2048, nproc=512):
        self.slot, self.max_procs, self.max_dir_mib, self.nproc = slot, max_procs, max_dir_mib, nproc
        self.root = os.geteuid() == 0
        self.uid = SANDBOX_UID_BASE + slot if self.root else None
        self.subreaper = False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self.subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            pass

    def describe(self):
        how = ("as uid %d, which can write only its run directory and /tmp" % self.uid if self.root else
               "as you (not root: a submission could write to your files; run as root, e.g. in a container, "
               "for a user of its own)")
        return "sandbox: each run %s; at most %d processes; leftovers %s" % (
            how, self.max_procs, "adopted and killed" if self.subreaper else "killed by process group")

    def _preexec(self, limits, nproc_limit):
        base = _limit_child(limits)
        uid = self.uid

        def apply():
            base()
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc_limit, nproc_limit))
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
        return apply

    def _own_tasks(self):
        """Tasks (threads count) of our own uid: RLIMIT_NPROC counts them all, so a run's limit sits above."""
        n = 0
        me = os.getuid()
        for pid, (_, uid) in _proc_table().items():
            if uid == me:
                try:
                    n += len(os.listdir("/proc/%d/task" % pid))
                except OSError:
                    pass
        return n

    def _members(self):
        """The run's processes: everything below this grader (a subreaper keeps orphans there), and as
        root every process of the slot's user."""
        table = _proc_table()
        mine = set(descendants(os.getpid(), table))
        if self.uid is not None:
            mine |= {p for p, (_, uid) in table.items() if uid == self.uid}
        mine.discard(os.getpid())
        return mine

    def _kill_all(self, proc):
        for _ in range(50):  # a process forking while we kill: go round until none is left
            pids = self._members()
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self._reap(proc)
            time.sleep(0.01)
        self._reap(proc)

    def _reap(self, proc):
        if proc.returncode is None:
            try:
                proc.wait(timeout=0)
            except subprocess.TimeoutExpired:
                pass
        while True:  # orphans adopted by the subreaper
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _dir_mib(self, path):
        total = 0
        for dirpath, dirnames, filenames in os.walk(path):
            for f in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except OSError:
                    pass
        return total / 1048576.0

    def _prepare(self, run_dir):
        if self.uid is not None:
            os.makedirs(os.path.join(run_dir, "tmp"), exist_ok=True)
            for d in (run_dir, os.path.join(run_dir, "tmp")):
                os.chown(d, self.uid, self.uid)
                os.chmod(d, 0o755)

    def _restore(self, run_dir):
        """Give run_dir back to the grader: regular files and directories only, owned by the grader."""
        removed = []
        for dirpath, dirnames, filenames in os.walk(run_dir, topdown=True):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    os.unlink(p)
                    removed.append(name)
                    if name in dirnames:
                        dirnames.remove(name)
                    continue
                if self.uid is not None:
                    os.lchown(p, 0, 0)
                    os.chmod(p, (st.st_mode & 0o755) | (0o755 if stat.S_ISDIR(st.st_mode) else 0o644))
        if self.uid is not None:
            os.lchown(run_dir, 0, 0)
        return removed

    def run(self, cmd, log_path, run_dir, timeout_s, limits):
        """run_limited, contained. Returns (returncode or None, seconds, reason the sandbox stopped it or '')."""
        self._prepare(run_dir)
        nproc = self.nproc if self.root else self._own_tasks() + self.nproc
        env = dict(os.environ, HOME=run_dir, TMPDIR=os.path.join(run_dir, "tmp") if self.uid is not None else run_dir)
        t0 = time.monotonic()
        stopped = ""
        with open(log_path, "ab") as log:
            _log_command(log, cmd)
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=self._preexec(limits, nproc), env=env, start_new_session=True)
            rc, polls = None, 0
            while True:
                try:
                    rc = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                polls += 1
                if time.monotonic() - t0 > timeout_s:
                    break
                n = len(self._members())
                if n > self.max_procs:
                    stopped = ("started %d processes (a training run is one process with threads): stopped as a "
                               "fork bomb" % n)
                    break
                if polls % 5 == 0 and self._dir_mib(run_dir) > self.max_dir_mib:
                    stopped = "wrote more than %g MiB into its run directory: stopped" % self.max_dir_mib
                    break
            self._kill_all(proc)  # what is left: the run itself when stopped, anything it started
        seconds = time.monotonic() - t0
        removed = self._restore(run_dir)
        if self._dir_mib(run_dir) > self.max_dir_mib:
            for dirpath, _, filenames in os.walk(run_dir):
                for f in filenames:
                    if f != "log.txt":
                        os.unlink(os.path.join(dirpath, f))
            stopped = stopped or "wrote more than %g MiB into its run directory" % self.max_dir_mib
        if removed:
            with open(log_path, "a") as log:
                log.write("grader: removed what is not a regular file from the run directory: %s\n"
                          % ", ".join(sorted(removed)[:10]))
        return rc, seconds, stopped
