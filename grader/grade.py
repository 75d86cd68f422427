#!/usr/bin/env python3
"""The hwFSDP autograder.

    grade.py                              grade every stage in stages/
    grade.py --stage 03                   one stage (repeat --stage for several)
    grade.py --solutions                  grade solutions/ instead (they score full marks)
    grade.py --file my/hw_fsdp.c --stage 03
    grade.py --out grade-runs --json results.json --reference logs/reference

For each stage: build the hw_fsdp.c (make impl) into OUT/stageNN/train, run it
on the stage's configuration from grader/rubric.json in a child process with a
wall-clock limit and resource limits, then run the stage's checks against the
run's files, the reference logs and a non-sharded baseline run. A failed
build or run fails every check of the stage with the reason; nothing a
student's code does can crash the grader.

Exit status: 0 whenever grading happened (the score says how it went),
2 for a usage error of the grader itself.
Standard library only (python3 >= 3.9).
"""
import argparse
import hashlib
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUBRIC_PATH = os.path.join(ROOT, "grader", "rubric.json")

FORWARD_PHASES = {"pre_forward", "forward", "post_forward"}
BACKWARD_PHASES = {"pre_backward", "recompute.pre_forward", "recompute", "recompute.post_forward", "backward",
                   "post_backward", "finish_backward"}
EXIT_FATAL, EXIT_TODO, EXIT_NAN = 2, 3, 4


class UsageError(Exception):
    """A mistake in how the grader was called (exit status 2)."""


class CheckFailed(Exception):
    """Raised inside a check: the check fails with this one-line reason."""


# ------------------------------------------------------------------ rubric

def load_rubric(path=RUBRIC_PATH):
    """The rubric, checked: a broken one is a usage error (one line, exit 2), never a crash mid-grading."""
    try:
        with open(path, encoding="utf-8") as fh:
            rubric = json.load(fh)
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError("cannot read the rubric %s: %s" % (path, one_line(str(e))))
    validate_rubric(rubric, relpath(path))
    return rubric


CONFIG_KEYS = {"flavor": "name", "world": "world", "seq_len": "count", "batch_size": "count", "steps": "count",
               "profile_steps": "count0", "link_gbps": "number0", "link_latency_us": "number0"}
LIMIT_KEYS = {"build_timeout_s": 1e7, "run_timeout_s": 1e7, "run_cpu_s": 1e7, "run_address_space_gib": 1e6,
              "run_file_size_mib": 1e9}
TOLERANCE_KEYS = ["loss_rel", "grad_norm_rel", "peak_mem_band_rel", "ag_overlap_min", "rs_overlap_min",
                  "prefetch_extra_unsharded_modules", "prefetch_max_modules_ahead",
                  "recompute_all_gathers_per_module_step", "activation_memory_max_ratio"]


def validate_rubric(rubric, name):
    """UsageError naming the first entry of the rubric the grader cannot use."""
    def bad(where, what, value):
        raise UsageError("%s: %s must be %s, got %s" % (name, where, what, short(value, 80)))

    def obj(where, value):
        if not isinstance(value, dict):
            bad(where, "a JSON object", value)
        return value

    def str_list(where, value):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad(where, "a list of strings", value)

    def config_value(where, kind, v):
        if kind == "name" and not (isinstance(v, str) and v):
            bad(where, "a non-empty string", v)
        if kind == "world" and not (is_int(v) and 1 <= v <= 64):
            bad(where, "an integer in [1, 64]", v)
        if kind in ("count", "count0") and not (is_int(v) and (0 if kind == "count0" else 1) <= v <= 10 ** 9):
            bad(where, "an integer >= %d" % (0 if kind == "count0" else 1), v)
        if kind == "number0" and not (is_finite(v) and 0 <= v <= 1e12):
            bad(where, "a number >= 0", v)

    obj("the rubric", rubric)
    for key in ("config", "limits", "tolerances", "check_names", "stages", "baseline"):
        obj(key, rubric.get(key))
    for key, kind in CONFIG_KEYS.items():
        config_value("config." + key, kind, rubric["config"].get(key))
    for key, most in LIMIT_KEYS.items():
        v = rubric["limits"].get(key)
        if not (is_finite(v) and 0 < v <= most):
            bad("limits." + key, "a number in (0, %g]" % most, v)
    for key in TOLERANCE_KEYS:
        v = rubric["tolerances"].get(key)
        if not (is_finite(v) and v >= 0):
            bad("tolerances." + key, "a number >= 0", v)
    str_list("baseline.keep_flags", rubric["baseline"].get("keep_flags"))
    if not rubric["stages"]:
        bad("stages", "a non-empty object", rubric["stages"])
    for stage, spec in rubric["stages"].items():
        where = "stages." + stage
        if not (stage.isdigit() and stage.isascii()):
            bad(where, "named by its number (e.g. \"03\")", stage)
        obj(where, spec)
        if not (isinstance(spec.get("dir"), str) and spec["dir"]):
            bad(where + ".dir", "a non-empty string", spec.get("dir"))
        if not isinstance(spec.get("title", ""), str):
            bad(where + ".title", "a string", spec.get("title"))
        str_list(where + ".flags", spec.get("flags", []))
        for key, v in obj(where + ".config", spec.get("config", {})).items():
            if key not in CONFIG_KEYS:
                bad(where + ".config", "keys of config (%s)" % ", ".join(CONFIG_KEYS), key)
            config_value("%s.config.%s" % (where, key), CONFIG_KEYS[key], v)
        checks = obj(where + ".checks", spec.get("checks"))
        for key, points in checks.items():
            if key not in CHECKS:
                bad(where + ".checks", "keys among %s" % ", ".join(CHECKS), key)
            if not (is_finite(points) and 0 <= points <= 1e6):
                bad("%s.checks.%s" % (where, key), "a number of points >= 0", points)
            if not isinstance(rubric["check_names"].get(key), str):
                bad("check_names." + key, "a string", rubric["check_names"].get(key))
        if "activation_memory" in checks:
            ref = obj(where + ".no_ac_reference", spec.get("no_ac_reference"))
            if not (isinstance(ref.get("dir"), str) and ref["dir"]):
                bad(where + ".no_ac_reference.dir", "a non-empty string", ref.get("dir"))
            str_list(where + ".no_ac_reference.drop_flags", ref.get("drop_flags"))
        if "prefetch_bound" in checks and "02" not in rubric["stages"]:
            bad("stages", "an object with stage 02 (the prefetch bound compares with it)", sorted(rubric["stages"]))


def stage_config(rubric, stage):
    """The common configuration with the stage's overrides (e.g. stage 05's seq_len)."""
    cfg = dict(rubric["config"])
    cfg.update(rubric["stages"][stage].get("config", {}))
    return cfg


def config_flags(cfg):
    return ["--flavor", str(cfg["flavor"]), "--world", str(cfg["world"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch_size"]), "--steps", str(cfg["steps"]),
            "--link-gbps", "%g" % cfg["link_gbps"], "--link-latency-us", "%g" % cfg["link_latency_us"],
            "--profile-steps", str(cfg["profile_steps"])]


def stage_flags(rubric, stage):
    return config_flags(stage_config(rubric, stage)) + list(rubric["stages"][stage].get("flags", []))


def baseline_flags(rubric, stage):
    """One rank with the global batch: the same sequences as the W ranks see together."""
    cfg = stage_config(rubric, stage)
    cfg["batch_size"] = cfg["batch_size"] * cfg["world"]
    cfg["world"] = 1
    keep = set(rubric["baseline"]["keep_flags"])
    return config_flags(cfg) + [f for f in rubric["stages"][stage].get("flags", []) if f in keep]


def check_name(rubric, key):
    return rubric["check_names"][key]


# ---------------------------------------------------------------- helpers

def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def is_int(x):
    return type(x) is int  # not bool


def is_num(x):
    """A JSON number the checks can do float arithmetic and %g with (NaN and infinities included)."""
    return type(x) is float or (type(x) is int and abs(x) < 2 ** 63)


def is_finite(x):
    return is_num(x) and math.isfinite(x)


def short(value, limit=60):
    """A JSON value for a message: compact, cut."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return one_line(text, limit)


def one_line(text, limit=2000):
    """A reason as one printable line: newlines, other control characters and unpaired surrogates escaped
    (they come from files a student's run wrote), very long text cut."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fmt_bytes(n):
    if abs(n) < 100 * 1024:
        return "%d bytes" % n
    return "%.2f MiB" % (n / 1048576.0)


def fmt_points(p):
    return ("%.2f" % p).rstrip("0").rstrip(".")


def relpath(path):
    try:
        r = os.path.relpath(path, ROOT)
    except ValueError:
        return path
    return path if r.startswith("..") else r


def read_json(path, top=dict):
    """The file's JSON value, which must be a `top` (dict: an object); CheckFailed naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except FileNotFoundError:
        raise CheckFailed("%s is missing: the run did not write it" % relpath(path))
    except OSError as e:
        raise CheckFailed("%s cannot be read (%s)" % (relpath(path), e.strerror or e))
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CheckFailed("%s is not valid JSON (%s)" % (relpath(path), e))
    if top is not None and not isinstance(value, top):
        raise CheckFailed("%s is not a JSON %s" % (relpath(path), "object" if top is dict else top.__name__))
    return value


def read_metrics(path, what="your run", world=None):
    """metrics.jsonl rows, checked: each an object whose loss/grad_norm are numbers or null and, with
    `world`, whose peak_mem_bytes_per_rank lists `world` byte counts."""
    name = relpath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [l for l in fh if l.strip()]
    except FileNotFoundError:
        raise CheckFailed("%s is missing (%s)" % (name, what))
    except OSError as e:
        raise CheckFailed("%s cannot be read (%s)" % (name, e.strerror or e))
    except ValueError as e:  # not UTF-8
        raise CheckFailed("%s is not valid JSON lines (%s)" % (name, e))
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise CheckFailed("%s is not valid JSON lines (line %d: %s)" % (name, i + 1, e))
        if not isinstance(row, dict):
            raise CheckFailed("%s line %d is not a JSON object" % (name, i + 1))
        for key in ("loss", "grad_norm"):
            if row.get(key) is not None and not is_num(row[key]):
                raise CheckFailed("%s line %d: %s is %s, not a number" % (name, i + 1, key, short(row[key])))
        rows.append(row)
    if world is not None:
        check_peak_lists(rows, name, world)
    return rows


def check_peak_lists(rows, name, world):
    """Every row's peak_mem_bytes_per_rank is a list of `world` byte counts (what Context.peaks reads)."""
    for i, row in enumerate(rows):
        peaks = row.get("peak_mem_bytes_per_rank")
        if not (isinstance(peaks, list) and len(peaks) == world and all(is_int(p) and 0 <= p < 2 ** 53 for p in peaks)):
            raise CheckFailed("%s line %d: peak_mem_bytes_per_rank is %s, not %d byte counts (one per rank)"
                              % (name, i + 1, short(peaks), world))


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


def union_intervals(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def covered(a, b, merged):
    """Length of [a, b) covered by the sorted disjoint intervals `merged`."""
    total = 0.0
    for x, y in merged:
        if y <= a:
            continue
        if x >= b:
            break
        total += min(y, b) - max(x, a)
    return total


# ------------------------------------------------------------- processes

def _limit_child(limits):
    """preexec_fn: resource limits for a student's binary (generous: they catch runaways)."""
    def apply():
        cpu = int(limits["run_cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        space = int(limits["run_address_space_gib"] * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (space, space))
        fsize = int(limits["run_file_size_mib"] * (1 << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_limited(cmd, log_path, timeout_s, limits, cwd=ROOT):
    """Run cmd with stdout+stderr appended to log_path. Returns (returncode or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(("$ %s\n" % " ".join(relpath(c) if os.path.isabs(c) else c for c in cmd)).encode())
        log.flush()
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


def describe_signal(num):
    try:
        name = signal.Signals(num).name
    except ValueError:
        return "crashed with signal %d" % num
    desc = (signal.strsignal(num) or name).lower()
    text = "crashed with %s (%s)" % (name, desc)
    hint = SIGNAL_HINTS.get(name)
    return text + ": " + hint if hint else text


def classify_run(rc, log_path, run_dir, timeout_s, steps, limits=None):
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
        return False, (what + ": fresh allocations are NaN-filled, so this is usually compute reading a buffer "
                       "before it was written (a missing dev_stream_wait_event?) or a division by zero")
    if rc == EXIT_FATAL and errors:
        reason = "runtime error: " + errors[-1][len("error: "):]
        if limits and "out of memory" in reason:
            reason += " (the grader's memory limit: %g GiB of address space per run)" % limits["run_address_space_gib"]
        return False, reason
    last = errors[-1] if errors else (lines[-1].strip() if lines else "")
    return False, "exited with status %d%s" % (rc, (": " + last) if last else "")


# --cuda: build against the CUDA runtime (make impl-cuda) and take the non-sharded baseline run on
# the same GPU as the ground truth for loss and grad norm (the reference logs come from the CPU).
CUDA_MODE = False


def build(src, out_bin, log_path, limits):
    """make impl SRC=src OUT=out_bin (impl-cuda with --cuda); (ok, reason, seconds)."""
    if os.path.exists(out_bin):
        os.remove(out_bin)
    cmd = ["make", "-s", "--no-print-directory", "impl-cuda" if CUDA_MODE else "impl", "SRC=" + src, "OUT=" + out_bin]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=limits["build_timeout_s"])
        output, rc = p.stdout.decode("utf-8", "replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = (e.stdout or b"").decode("utf-8", "replace"), None
    seconds = time.monotonic() - t0
    with open(log_path, "a") as log:
        log.write("$ %s\n%s" % (" ".join(cmd), output))
    if rc == 0 and os.path.exists(out_bin):
        return True, "", seconds
    if rc is None:
        return False, "build timed out after %g s" % limits["build_timeout_s"], seconds
    first = next((l for l in output.splitlines() if re.search(r"(^|: )(fatal )?error:|undefined reference", l)), None)
    if first is None:
        first = next((l for l in output.splitlines() if l.strip()), "make exited with status %s" % rc)
    first = first.replace(ROOT + os.sep, "").strip()
    if first.startswith("common/"):  # not the student's file: say so, or they will hunt in the wrong place
        return False, "build failed in the runtime, not in your file (run make): " + first, seconds
    return False, "build failed: " + first, seconds


# ---------------------------------------------------------------- the run

class RunResult:
    def __init__(self, run_dir, ok, reason, seconds, cmd):
        self.dir, self.ok, self.reason, self.seconds, self.cmd = run_dir, ok, reason, seconds, cmd


def run_binary(binary, flags, run_dir, log_path, limits, timeout_s, steps):
    cmd = [binary] + list(flags) + ["--out", run_dir, "--quiet"]
    rc, seconds = run_limited(cmd, log_path, timeout_s, limits)
    ok, reason = classify_run(rc, log_path, run_dir, timeout_s, steps, limits)
    return RunResult(run_dir, ok, reason, seconds, cmd)


class Baselines:
    """The non-sharded baseline, run once per distinct configuration per grader invocation."""

    def __init__(self, out_root, limits, timeout_s):
        self.out_root, self.limits, self.timeout_s = out_root, limits, timeout_s
        self.cache = {}
        self.built = None

    def _build(self):
        """A private copy of the baseline, built like any hw_fsdp.c: no race with another grader relinking
        build/baseline/train while this one runs it."""
        if self.built is None:
            d = os.path.join(self.out_root, "baseline-bin")
            os.makedirs(d, exist_ok=True)
            ok, reason, _ = build(os.path.join(ROOT, "common", "driver", "baseline.c"), os.path.join(d, "train"),
                                  os.path.join(d, "log.txt"), self.limits)
            self.built = (ok, reason, os.path.join(d, "train"))
        return self.built

    def get(self, flags, steps):
        key = tuple(flags)
        if key not in self.cache:
            ok, reason, binary = self._build()
            tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
            run_dir = os.path.join(self.out_root, "baseline-" + tag)
            if not ok:
                self.cache[key] = RunResult(run_dir, False, "the baseline did not build: " + reason, 0.0, [])
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
                self.cache[key] = run_binary(binary, flags, run_dir, os.path.join(run_dir, "log.txt"),
                                             self.limits, self.timeout_s, steps)
        return self.cache[key]


# --------------------------------------------------------------- context

def _shape_ok(v):
    return isinstance(v, list) and 1 <= len(v) <= 8 and all(is_int(d) and 0 <= d < 2 ** 40 for d in v)


# What the checks read from each param of dtensors_rank<r>.json: (key, test, what it must be).
DTENSOR_FIELDS = [
    ("name", lambda v: isinstance(v, str), "a string"),
    ("module", lambda v: isinstance(v, str), "a string"),
    ("global_shape", _shape_ok, "a list of 1 to 8 dimensions"),
    ("mesh", lambda v: isinstance(v, list), "a list"),
    ("mesh_is_world", lambda v: isinstance(v, bool), "true or false"),
    ("placement", lambda v: isinstance(v, str), "a string"),
] + [(k, is_int, "an integer") for k in ("local_rows", "padded_rows", "row_offset", "row_numel", "global_rows")] + [
    ("has_local", lambda v: isinstance(v, bool), "true or false"),
    ("local_matches_init", lambda v: v is None or isinstance(v, bool), "true, false or null"),
    ("padding_is_zero", lambda v: v is None or isinstance(v, bool), "true, false or null"),
]


class Context:
    """What a stage's checks read: the run's files, the reference, the baseline. Files are read once."""

    def __init__(self, rubric, stage, run, ref_root, baselines):
        self.rubric, self.stage, self.run, self.ref_root, self.baselines = rubric, stage, run, ref_root, baselines
        self.cfg = stage_config(rubric, stage)
        self.world, self.steps = int(self.cfg["world"]), int(self.cfg["steps"])
        self.tol = rubric["tolerances"]
        self.flags = rubric["stages"][stage].get("flags", [])
        self.forward_only = "--forward-only" in self.flags
        self._cache = {}

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def path(self, name):
        return os.path.join(self.run.dir, name)

    # Every loader checks the shape of what the checks read, so that a malformed file (a crash mid-write, a
    # student's stray write) fails the check with a sentence naming the file and the entry, not a KeyError.

    def metrics(self):
        def load():
            rows = read_metrics(self.path("metrics.jsonl"), world=self.world)
            if len(rows) != self.steps:
                raise CheckFailed("metrics.jsonl has %d steps, the run was asked for %d" % (len(rows), self.steps))
            return rows
        return self._memo("metrics", load)

    def dtensors(self, rank):
        def load():
            name = "dtensors_rank%d.json" % rank
            data = read_json(self.path(name))
            params = data.get("params")
            if not isinstance(params, list):
                raise CheckFailed("%s has no params list" % name)
            for i, p in enumerate(params):
                where = "%s: param %d" % (name, i)
                if not isinstance(p, dict):
                    raise CheckFailed("%s is not a JSON object" % where)
                for key, ok, what in DTENSOR_FIELDS:
                    if key not in p:
                        raise CheckFailed("%s has no %s" % (where, key))
                    if not ok(p[key]):
                        raise CheckFailed("%s: %s is %s, not %s" % (where, key, short(p[key]), what))
            return data
        return self._memo(("dt", rank), load)

    def memory(self, rank):
        def load():
            name = "memory_rank%d.json" % rank
            data = read_json(self.path(name))
            events = data.get("events", [])
            if not isinstance(events, list):
                raise CheckFailed("%s: events is not a list" % name)
            for i, e in enumerate(events):
                if not isinstance(e, dict):
                    raise CheckFailed("%s: event %d is not a JSON object" % (name, i))
            return data
        return self._memo(("mem", rank), load)

    def trace(self, rank):
        def load():
            name = "trace_rank%d.json" % rank
            events = read_json(self.path(name)).get("traceEvents", [])
            if not isinstance(events, list):
                raise CheckFailed("%s: traceEvents is not a list" % name)
            out = []
            for i, e in enumerate(events):
                if not isinstance(e, dict):
                    raise CheckFailed("%s: event %d is not a JSON object" % (name, i))
                if e.get("ph") != "X":
                    continue
                where = "%s: event %d" % (name, i)
                if not isinstance(e.get("name"), str):
                    raise CheckFailed("%s has no name" % where)
                for key in ("ts", "dur"):
                    if not is_finite(e.get(key)) or (key == "dur" and e[key] < 0):
                        raise CheckFailed("%s (%s): %s is %s, not a finite%s number" % (
                            where, one_line(e["name"], 80), key, short(e.get(key)), " non-negative" if key == "dur" else ""))
                args = e.get("args", {})
                if not isinstance(args, dict):
                    raise CheckFailed("%s (%s): args is not a JSON object" % (where, one_line(e["name"], 80)))
                bad = [k for k in ("module", "phase") if k in args and not isinstance(args[k], str)]
                if "step" in args and not is_int(args["step"]) or e.get("cat") == "collective" and "step" not in args:
                    bad.append("step")
                if bad:
                    raise CheckFailed("%s (%s): args.%s is %s" % (where, one_line(e["name"], 80), bad[0],
                                                                  short(args.get(bad[0]))))
                out.append(e)
            return out
        return self._memo(("trace", rank), load)

    def notes(self, rank):
        """The hook_check entries of the rank's snapshot (what the runtime saw live after each hook)."""
        out = []
        for i, e in enumerate(self.memory(rank).get("events", [])):
            if e.get("kind") != "hook_check":
                continue
            bad = [k for k in ("module", "hook") if not isinstance(e.get(k), str)]
            bad += [k for k in ("step",) if not is_int(e.get(k))]
            bad += [k for k in ("unsharded_param_live_bytes", "unsharded_grad_live_bytes")
                    if k in e and not (is_int(e[k]) and abs(e[k]) < 2 ** 53)]
            if bad:
                raise CheckFailed("memory_rank%d.json: event %d (hook_check): %s is %s"
                                  % (rank, i, bad[0], short(e.get(bad[0]))))
            out.append(e)
        return out

    def module_order(self):
        """Modules in forward order with their unsharded param bytes, from rank 0's DTensor dump."""
        def load():
            order, size = [], {}
            for p in self.dtensors(0)["params"]:
                mod = p["module"]
                if mod not in size:
                    order.append(mod)
                    size[mod] = 0
                size[mod] += 4 * math.prod(p["global_shape"])
            if not order:
                raise CheckFailed("dtensors_rank0.json lists no params")
            return order, size
        return self._memo("modules", load)

    def collectives(self, kind):
        """[(rank, event)] for collectives named '<label>.<kind>', all ranks."""
        out = []
        for r in range(self.world):
            out += [(r, e) for e in self.trace(r) if e.get("cat") == "collective" and e["name"].endswith("." + kind)]
        return out

    def reference_dir(self, stage=None, sub=None):
        d = os.path.join(self.ref_root, "stage" + (stage or self.stage))
        return os.path.join(d, sub) if sub else d

    def reference_metrics(self, stage=None, sub=None, expect=None):
        """A reference log, after checking it was recorded with the configuration the rubric asks for."""
        d = self.reference_dir(stage, sub)
        rows = read_metrics(os.path.join(d, "metrics.jsonl"), "the reference log; instructors: make reference")
        run = read_json(os.path.join(d, "run.json"))
        want = stage_config(self.rubric, stage or self.stage)
        flags = expect if expect is not None else self.rubric["stages"][stage or self.stage].get("flags", [])
        pairs = [("flavor", want["flavor"]), ("world_size", want["world"]), ("seq_len", want["seq_len"]),
                 ("batch_size", want["batch_size"]), ("steps", want["steps"]), ("ac", "--ac" in flags),
                 ("forward_only", "--forward-only" in flags),
                 ("reshard_after_forward", "--reshard-after-forward=false" not in flags)]
        for key, value in pairs:
            if run.get(key) != value:
                raise CheckFailed("the reference log %s was recorded with %s = %s, the rubric runs %s: it is stale "
                                  "(instructors: make reference)" % (relpath(d), key, json.dumps(run.get(key)),
                                                                     json.dumps(value)))
        if len(rows) != self.steps:
            raise CheckFailed("the reference log %s has %d steps, not %d (instructors: make reference)"
                              % (relpath(d), len(rows), self.steps))
        check_peak_lists(rows, relpath(os.path.join(d, "metrics.jsonl")), self.world)
        return rows

    def baseline_metrics(self):
        def load():
            run = self.baselines.get(baseline_flags(self.rubric, self.stage), self.steps)
            if not run.ok:
                raise CheckFailed("the non-sharded baseline run failed (%s): see %s"
                                  % (run.reason, relpath(os.path.join(run.dir, "log.txt"))))
            rows = read_metrics(os.path.join(run.dir, "metrics.jsonl"), "the baseline run")
            if len(rows) != self.steps:
                raise CheckFailed("the baseline run has %d steps, not %d" % (len(rows), self.steps))
            return rows
        return self._memo("baseline", load)

    def peaks(self, rows):
        """Per rank, the peak over all steps (rows from read_metrics with world: the lists are checked)."""
        return [max((r["peak_mem_bytes_per_rank"][k] for r in rows), default=0) for k in range(self.world)]

    def where_peak(self, rank):
        """Where the rank's memory peaked and the largest tags then, from its snapshot (for the message)."""
        try:
            events = self.memory(rank).get("events", [])
        except CheckFailed:
            return ""
        live, by_tag, best = {}, {}, None
        for e in events:  # only decorates a message: entries of the wrong shape are skipped
            addr = e.get("addr")
            if not is_int(addr):
                continue
            if e.get("action") == "alloc":
                tag, size = e.get("tag"), e.get("size")
                if not (isinstance(tag, str) and is_int(size) and 0 <= size < 2 ** 53):
                    continue
                live[addr] = (tag, size)
                by_tag[tag] = by_tag.get(tag, 0) + size
            elif e.get("action") == "free" and addr in live:
                tag, size = live.pop(addr)
                by_tag[tag] -= size
            else:
                continue
            step, current = e.get("step"), e.get("current_bytes")
            if is_int(step) and step >= 0 and is_int(current) and (best is None or current > best[0]):
                best = (current, e, dict(by_tag))
        if best is None:
            return ""
        _, e, tags = best
        top = sorted(((v, k) for k, v in tags.items() if v > 0), reverse=True)[:3]
        return "your peak: step %d, %s.%s; largest then: %s" % (
            e["step"] + 1, one_line(str(e.get("module", "?")), 80), one_line(str(e.get("phase", "?")), 80),
            ", ".join("%s %s" % (k, fmt_bytes(v)) for v, k in top))


# ---------------------------------------------------------------- checks

def near(x, target, tol):
    return target > 0 and abs(x / target - 1) <= tol


def series_check(ctx, key, tol, label, hint):
    """Step-by-step comparison of metrics[key] with the reference log and the baseline run."""
    got = ctx.metrics()
    ref = ctx.reference_metrics()
    base = ctx.baseline_metrics()
    ref_name = relpath(os.path.join(ctx.reference_dir(), "metrics.jsonl"))
    for i in range(ctx.steps):
        step = i + 1
        g, r, b = got[i].get(key), ref[i].get(key), base[i].get(key)
        if r is None or b is None:
            raise CheckFailed("step %d %s missing in the %s" % (step, label, "reference log" if r is None else "baseline run"))
        if g is None:
            if key not in got[i]:
                raise CheckFailed("step %d has no %s in metrics.jsonl" % (step, label))
            raise CheckFailed("step %d %s is not finite (null in metrics.jsonl)" % (step, label))
        if CUDA_MODE:
            if rel(g, b) > tol:
                raise CheckFailed("step %d %s %.6g vs the non-sharded baseline on the same GPU %.6g (rel %.1e > %g): %s"
                                  % (step, label, g, b, rel(g, b), tol, hint(step, g, b)))
            continue
        ok_ref, ok_base, ref_vs_base = rel(g, r) <= tol, rel(g, b) <= tol, rel(r, b) <= tol
        if ok_ref and ok_base:
            continue
        if not ref_vs_base:
            if ok_base:
                raise CheckFailed("step %d %s %.6g matches the non-sharded baseline (%.6g) but not the reference log "
                                  "(%.6g): the reference disagrees with the baseline, so %s is stale or corrupt "
                                  "(instructors: make reference)" % (step, label, g, b, r, ref_name))
            if ok_ref:
                raise CheckFailed("step %d %s %.6g matches the reference log but not the non-sharded baseline (%.6g, "
                                  "rel %.1e > %g): the reference disagrees with the baseline, and the baseline is the "
                                  "ground truth" % (step, label, g, b, rel(g, b), tol))
            raise CheckFailed("step %d %s %.6g vs non-sharded baseline %.6g (rel %.1e > %g; the reference log %.6g "
                              "disagrees with the baseline too): %s" % (step, label, g, b, rel(g, b), tol, r,
                                                                       hint(step, g, b)))
        raise CheckFailed("step %d %s %.6g vs reference %.6g (rel %.1e > %g): %s"
                          % (step, label, g, r, rel(g, r), tol, hint(step, g, r)))
    return ""


def check_loss(ctx):
    def hint(step, g, r):
        if step == 1:
            return ("wrong already at step 1, before any update: the forward is wrong (shard row offsets, padding, "
                    "the all-gather's copy-out layout)")
        if ctx.forward_only:
            return ("right at step 1, wrong from step %d although --forward-only never changes the weights: state "
                    "carried between steps (a buffer read before it is written? a missing wait?)" % step)
        return ("right at step 1, wrong from step %d: the forward is right and the update is not (backward unshard, "
                "reduce-scatter layout or average, grad norm and clipping, AdamW on the local rows, the next "
                "all-gather reading the updated shards)" % step)
    return series_check(ctx, "loss", ctx.tol["loss_rel"], "loss", hint)


def check_grad_norm(ctx):
    W = ctx.world

    def hint(step, g, r):
        ratio = g / r if r else float("inf")
        if near(ratio, W, 0.1):
            return "%.2f times too large, about W = %d: are you averaging the reduce-scatter over %d ranks (RED_AVG, not RED_SUM)?" % (ratio, W, W)
        if near(ratio, 1.0 / W, 0.1):
            return "%.2f times the reference, about 1/W: is the average applied twice?" % ratio
        if near(ratio, math.sqrt(W), 0.15):
            return "%.2f times too large, about sqrt(W): is the norm's all-reduce a SUM of the squares, taken once?" % ratio
        if ratio < 0.85 and ratio > 0.5 / math.sqrt(W):
            return ("%.2f times the reference (about 1/sqrt(W) = %.2f is one rank's share): is the sum of squares "
                    "all-reduced over the ranks before the square root?" % (ratio, 1 / math.sqrt(W)))
        if step == 1:
            return ("wrong at step 1 with the loss right: the backward side is wrong (chunk-cat layout of the "
                    "reduce-scatter input, the average, the norm over your local rows only, not the padding)")
        return ("right until step %d: the previous update went wrong (optimizer on the local rows, clipping, "
                "grads of the previous step freed and not reused)" % (step - 1))
    return series_check(ctx, "grad_norm", ctx.tol["grad_norm_rel"], "grad_norm", hint)


def check_peak_memory(ctx):
    band = ctx.tol["peak_mem_band_rel"]
    got = ctx.peaks(ctx.metrics())
    ref = ctx.peaks(ctx.reference_metrics())
    for r in range(ctx.world):
        if rel(got[r], ref[r]) <= band:
            continue
        if ref[r] <= 0:
            raise CheckFailed("rank %d peak %s vs a reference peak of 0 bytes: the reference log %s is corrupt "
                              "(instructors: make reference)" % (r, fmt_bytes(got[r]),
                                                                 relpath(ctx.reference_dir())))
        where = ctx.where_peak(r)
        if got[r] > ref[r]:
            hint = ("more than the reference: something is freed late or never (unsharded params after forward or "
                    "backward, grads after the reduce-scatter, all-gather buffers, optimizer state)")
        else:
            hint = ("less than the reference: is a buffer the stage needs missing (prefetched params, "
                    "ZeRO-2's kept params) or freed while still in use?")
        raise CheckFailed("rank %d peak %s vs reference %s (%+.1f%%, band +-%g%%): %s%s"
                          % (r, fmt_bytes(got[r]), fmt_bytes(ref[r]), 100.0 * (got[r] - ref[r]) / ref[r],
                             100 * band, hint, ("; " + where) if where else ""))
    return ""


def check_dtensors(ctx):
    W = ctx.world
    for rank in range(W):
        d = ctx.dtensors(rank)
        params = d.get("params", [])
        if not params:
            raise CheckFailed("dtensors_rank%d.json lists no params" % rank)
        for p in params:
            name, shape = p["name"], p["global_shape"]
            rows = shape[0]
            padded = -(-rows // W)
            start = rank * padded
            local = max(0, min(rows, start + padded) - start)
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            who = "rank %d: %s" % (rank, name)
            if p["placement"] != "Shard(0)":
                raise CheckFailed("%s has placement %s, expected Shard(0): every param is sharded on dim 0"
                                  % (who, p["placement"]))
            if not p["mesh_is_world"] or p["mesh"] != list(range(W)):
                raise CheckFailed("%s's mesh is %s, expected the world %s: use FsdpConfig.mesh"
                                  % (who, p["mesh"], list(range(W))))
            if p["global_rows"] != rows or p["row_numel"] != row_numel:
                raise CheckFailed("%s says global_rows %s x row_numel %s, the param is %s"
                                  % (who, p["global_rows"], p["row_numel"], "x".join(map(str, shape))))
            if p["padded_rows"] != padded:
                raise CheckFailed("%s padded_rows %s, expected ceil(%d / %d) = %d: every rank's shard is padded to "
                                  "the first chunk's size, as torch.chunk splits" % (who, p["padded_rows"], rows, W, padded))
            if p["local_rows"] != local:
                raise CheckFailed("%s local_rows %s, expected %d: torch.chunk gives rank r rows [r*%d, min(%d, "
                                  "(r+1)*%d))" % (who, p["local_rows"], local, padded, rows, padded))
            if local and p["row_offset"] != start:
                raise CheckFailed("%s row_offset %s, expected %d = rank %d x %d padded rows: shard offsets follow "
                                  "torch.chunk" % (who, p["row_offset"], start, rank, padded))
            if not p["has_local"]:
                raise CheckFailed("%s has no local storage (DTensor.local is NULL)" % who)
            if p["local_matches_init"] is not True:
                raise CheckFailed("%s's local shard does not hold rows [%d, %d) of the initial value: copy from "
                                  "row_offset x row_numel elements into Param.data, before freeing it"
                                  % (who, start, start + local))
            if p["padding_is_zero"] is not True:
                raise CheckFailed("%s's padding rows (%d..%d) are not zero: zero them (fresh memory is NaN-filled)"
                                  % (who, local, padded))
    return ""


def _notes_check(ctx, hook, field, want_zero, what, advice):
    seen = 0
    for rank in range(ctx.world):
        for n in ctx.notes(rank):
            if n.get("hook") != hook or field not in n:
                continue
            seen += 1
            live = int(n[field])
            if want_zero and live:
                raise CheckFailed("%s's %s still live after its %s (%s, step %d, rank %d): %s"
                                  % (n["module"], what, hook, fmt_bytes(live), n["step"] + 1, rank, advice))
            if not want_zero and not live:
                raise CheckFailed("%s's %s freed by its %s (step %d, rank %d): %s"
                                  % (n["module"], what, hook, n["step"] + 1, rank, advice))
    if not seen:
        raise CheckFailed("the memory snapshots hold no %s checks (memory_rank*.json)" % hook)
    return ""


def check_freed_after_forward(ctx):
    return _notes_check(ctx, "post_forward", "unsharded_param_live_bytes", True, "unsharded params",
                        "reshard: dev_free every unsharded Param.data (and set it to NULL)")


def check_freed_after_backward(ctx):
    return _notes_check(ctx, "post_backward", "unsharded_param_live_bytes", True, "unsharded params",
                        "post_backward reshards after the reduce-scatter is queued")


def check_grads_freed(ctx):
    return _notes_check(ctx, "post_backward", "unsharded_grad_live_bytes", True, "unsharded grads",
                        "free each Param.grad once it is copied into the reduce-scatter input")


def check_params_kept(ctx):
    return _notes_check(ctx, "post_forward", "unsharded_param_live_bytes", False, "unsharded params were",
                        "with --reshard-after-forward=false post_forward keeps the params for the backward")


def _overlap(ctx, kind, phases, need, advice):
    """Share of the model's compute (kernels on the compute stream, in `phases`) that ran while a `kind`
    collective of the same rank was in flight.

    Measured from the compute side on purpose: on a CPU with fewer cores than ranks a collective's slice
    mostly waits for ranks the OS has descheduled, so "share of collective time under compute" is small
    and noisy (1-10% for correct schedules), while "share of compute under a collective" is large for an
    overlapped schedule and exactly 0 for a serialized one (a collective on the compute stream cannot run
    during that stream's kernels)."""
    what = kind.replace("_", "-")
    events = ctx.collectives(kind)
    if not events:
        raise CheckFailed("no %s in the trace (trace_rank*.json)" % what)
    compute_total = compute_covered = comm_total = comm_covered = 0.0
    for r in range(ctx.world):
        trace = ctx.trace(r)
        kernels = [(e["ts"], e["ts"] + e["dur"]) for e in trace
                   if e.get("cat") == "compute" and e.get("tid") == 0]
        in_flight = union_intervals([(e["ts"], e["ts"] + e["dur"]) for rr, e in events if rr == r])
        busy = union_intervals(kernels)
        for e in trace:
            if e.get("cat") == "compute" and e.get("tid") == 0 and e.get("args", {}).get("phase") in phases:
                compute_total += e["dur"]
                compute_covered += covered(e["ts"], e["ts"] + e["dur"], in_flight)
        for a, b in in_flight:
            comm_total += b - a
            comm_covered += covered(a, b, busy)
    if compute_total <= 0:
        raise CheckFailed("no %s compute kernels in the trace" % "/".join(sorted(phases)))
    frac = compute_covered / compute_total
    comm_frac = comm_covered / comm_total if comm_total > 0 else 0.0
    detail = "%.0f%% of %s compute ran during %ss (%.0f%% of %s time under compute)" % (
        100 * frac, "/".join(sorted(phases)), what, 100 * comm_frac, what)
    if frac >= need:
        return detail
    on_compute = all(e.get("tid") == 0 for _, e in events)
    raise CheckFailed("%.1f%% of %s compute ran while a%s %s was in flight (need >= %g%%)%s: %s"
                      % (100 * frac, "/".join(sorted(phases)), "n" if what[0] == "a" else "", what, 100 * need,
                         " (your %ss run on the compute stream)" % what if on_compute else "", advice))


def check_ag_overlap(ctx):
    return _overlap(ctx, "all_gather", {"forward"}, ctx.tol["ag_overlap_min"],
                    "are the all-gathers on their own stream, the next module's issued (prefetched) before this one "
                    "computes, with compute waiting on an event rather than the host?")


def check_rs_overlap(ctx):
    return _overlap(ctx, "reduce_scatter", {"backward", "recompute"}, ctx.tol["rs_overlap_min"],
                    "are the reduce-scatters on their own stream, so that module i's reduce-scatter runs while "
                    "module i-1's backward computes?")


def check_prefetch_bound(ctx):
    order, size = ctx.module_order()
    index = {m: i for i, m in enumerate(order)}
    largest = max(size.values())
    extra = ctx.tol["prefetch_extra_unsharded_modules"] * largest
    got = ctx.peaks(ctx.metrics())
    ref02 = ctx.peaks(ctx.reference_metrics(stage="02", expect=ctx.rubric["stages"]["02"].get("flags", [])))
    for r in range(ctx.world):
        if got[r] > ref02[r] + extra:
            raise CheckFailed("rank %d peak %s exceeds stage 02's %s + %d x the largest module's unsharded params "
                              "(%s): is your prefetch unbounded?" % (r, fmt_bytes(got[r]), fmt_bytes(ref02[r]),
                                                                     ctx.tol["prefetch_extra_unsharded_modules"],
                                                                     fmt_bytes(largest)))
    # The peak can sit in a part of the step the prefetch does not touch: also check how far ahead each
    # all-gather is issued (the trace names the module gathered and the module whose hook issued it).
    most = ctx.tol["prefetch_max_modules_ahead"]
    for r, e in ctx.collectives("all_gather"):
        label = e["name"][: -len(".all_gather")]
        host, phase = e["args"].get("module"), e["args"].get("phase")
        if label not in index or host not in index:
            continue
        ahead = index[label] - index[host] if phase in FORWARD_PHASES else index[host] - index[label]
        if phase in FORWARD_PHASES | BACKWARD_PHASES and ahead > most:
            raise CheckFailed("step %d: %s's %s issued %s's all-gather, %d modules ahead (at most %d): is your "
                              "prefetch unbounded? Keep at most two modules unsharded"
                              % (e["args"]["step"] + 1, host, phase, label, ahead, most))
    return ""


def check_recompute(ctx):
    order, _ = ctx.module_order()
    want = ctx.tol["recompute_all_gathers_per_module_step"]
    per = {}
    for r, e in ctx.collectives("all_gather"):
        label = e["name"][: -len(".all_gather")]
        per.setdefault((r, e["args"]["step"], label), []).append(e["args"].get("phase", "?"))
    if not per:
        raise CheckFailed("no all-gather in the trace")
    steps = sorted({s for (_, s, _) in per})
    unknown = sorted({l for (_, _, l) in per} - set(order))
    if unknown:
        raise CheckFailed("all-gathers labelled %s: label each with its module's name (coll_all_gather(..., mod->name))"
                          % ", ".join(unknown))
    for s in steps:
        for r in range(ctx.world):
            for mod in order:
                phases = per.get((r, s, mod), [])
                if len(phases) == want:
                    continue
                if len(phases) > want:
                    advice = ("does the recompute all-gather again? In PRE_BACKWARD the forward hooks "
                              "(called again by the recompute) must return at once")
                else:
                    advice = "every module is unsharded once for the forward and once for the backward"
                raise CheckFailed("%s: %d all-gathers in step %d on rank %d (expected %d: forward and backward; "
                                  "issued in %s): %s" % (mod, len(phases), s + 1, r, want,
                                                         ", ".join(phases) or "none", advice))
    return ""


def check_activation_memory(ctx):
    spec = ctx.rubric["stages"][ctx.stage]["no_ac_reference"]
    flags = [f for f in ctx.flags if f not in spec["drop_flags"]]
    no_ac = ctx.peaks(ctx.reference_metrics(sub=spec["dir"], expect=flags))
    got = ctx.peaks(ctx.metrics())
    ratio = ctx.tol["activation_memory_max_ratio"]
    for r in range(ctx.world):
        if got[r] > ratio * no_ac[r]:
            raise CheckFailed("rank %d peak %s is not below %g x the peak without --ac (%s, %s): recompute should "
                              "save activation memory; is something kept alive through the recompute (a second "
                              "all-gather, params never resharded)?" % (r, fmt_bytes(got[r]), ratio,
                                                                       fmt_bytes(no_ac[r]),
                                                                       relpath(ctx.reference_dir(sub=spec["dir"]))))
    return "%.0f%% of the peak without --ac" % (100.0 * max(g / max(n, 1) for g, n in zip(got, no_ac)))


def check_zero2_no_backward_all_gather(ctx):
    bad = [(r, e) for r, e in ctx.collectives("all_gather") if e["args"].get("phase") in BACKWARD_PHASES]
    if bad:
        r, e = bad[0]
        raise CheckFailed("%d all-gathers in backward (first: %s in %s.%s, step %d, rank %d): with "
                          "reshard_after_forward = 0 post_forward keeps the params, so the backward needs none"
                          % (len(bad), e["name"], e["args"].get("module"), e["args"].get("phase"),
                             e["args"]["step"] + 1, r))
    return ""


CHECKS = {
    "loss": check_loss,
    "grad_norm": check_grad_norm,
    "peak_memory": check_peak_memory,
    "dtensors": check_dtensors,
    "freed_after_forward": check_freed_after_forward,
    "freed_after_backward": check_freed_after_backward,
    "grads_freed": check_grads_freed,
    "ag_overlap": check_ag_overlap,
    "rs_overlap": check_rs_overlap,
    "prefetch_bound": check_prefetch_bound,
    "recompute": check_recompute,
    "activation_memory": check_activation_memory,
    "zero2_no_backward_all_gather": check_zero2_no_backward_all_gather,
    "zero2_params_kept": check_params_kept,
}


# ---------------------------------------------------------------- grading

def say(line, stream=None):
    stream = stream or sys.stdout
    try:
        try:
            stream.write(line + "\n")
        except UnicodeEncodeError:  # a terminal that is not UTF-8 and a name that is not ASCII
            stream.write(line.encode("ascii", "backslashreplace").decode("ascii") + "\n")
        stream.flush()
    except BrokenPipeError:  # `grade.py | head`: keep grading (the results file still gets written)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())


def run_check(ctx, key):
    """(ok, reason, detail) of one check, reason and detail one printable line each."""
    try:
        return True, "", one_line(CHECKS[key](ctx) or "")
    except CheckFailed as e:
        return False, one_line(str(e)) or "failed", ""
    except Exception as e:  # a grader bug: a failed check that says so, not a crash (tests/test_grader_fuzz.py)
        return False, one_line("could not check (%s: %s)" % (type(e).__name__, e)), ""


def grade_stage(rubric, stage, src, out_root, ref_root, baselines, timeout_s):
    """Build, run and check one stage; prints its lines and returns its result dict."""
    spec = rubric["stages"][stage]
    limits = rubric["limits"]
    run_dir = os.path.join(out_root, "stage" + stage)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log_path = os.path.join(run_dir, "log.txt")
    binary = os.path.join(run_dir, "train")
    prefix = "== stage %s ==" % stage
    steps = int(stage_config(rubric, stage)["steps"])

    t0 = time.monotonic()
    try:
        if not os.path.exists(src):
            run = RunResult(run_dir, False, "no such file: %s" % relpath(src), 0.0, [])
        else:
            ok, reason, build_s = build(src, binary, log_path, limits)
            if ok:
                run = run_binary(binary, stage_flags(rubric, stage), run_dir, log_path, limits, timeout_s, steps)
            else:
                run = RunResult(run_dir, False, reason, build_s, [])
    except (OSError, subprocess.SubprocessError) as e:  # make or the binary could not even be started
        run = RunResult(run_dir, False, "could not build or run: %s" % e, 0.0, [])
    run_s = time.monotonic() - t0
    run.reason = one_line(run.reason)  # it quotes the student's log: one printable line
    say("%s %s: %s (%.1fs; log: %s)" % (prefix, relpath(src), "built and ran" if run.ok else "run FAILED", run_s,
                                         relpath(log_path)))

    ctx = Context(rubric, stage, run, ref_root, baselines)
    checks = []
    for key, points in spec["checks"].items():
        name = check_name(rubric, key)
        t1 = time.monotonic()
        detail = ""
        if not run.ok:
            ok, reason = False, run.reason
        else:
            ok, reason, detail = run_check(ctx, key)
        seconds = time.monotonic() - t1
        say("%s %s: %s (%.1fs)" % (prefix, name, "OK" if ok else "FAIL", seconds))
        if not ok:
            say("    " + reason)
        checks.append({"key": key, "name": name, "ok": ok, "points": points if ok else 0, "max_points": points,
                       "reason": reason, "detail": detail, "seconds": round(seconds, 3)})
    got = sum(c["points"] for c in checks)
    total = sum(c["max_points"] for c in checks)
    say("stage %s: %s/%s points" % (stage, fmt_points(got), fmt_points(total)))
    return {"stage": stage, "dir": spec["dir"], "title": spec.get("title", ""), "source": relpath(src),
            "run": {"ok": run.ok, "reason": run.reason, "seconds": round(run_s, 3), "dir": relpath(run_dir),
                    "command": [relpath(c) if os.path.isabs(c) else c for c in run.cmd]},
            "points": got, "max_points": total, "checks": checks}


def parse_stage(rubric, text):
    t = text.strip()
    for key, spec in rubric["stages"].items():
        if t in (key, spec["dir"]) or (t.isdigit() and int(t) == int(key)):
            return key
    raise UsageError("unknown stage '%s' (stages: %s)" % (text, ", ".join(sorted(rubric["stages"]))))


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    ap = _Parser(prog="grade.py", description="Grade hwFSDP stages (see HANDOUT.md#grading).")
    ap.add_argument("--stage", action="append", default=[], help="stage to grade (01..06); repeatable; default all")
    ap.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    ap.add_argument("--file", help="grade this hw_fsdp.c (needs exactly one --stage)")
    ap.add_argument("--out", default=os.path.join(ROOT, "grade-runs"), help="where runs go (default grade-runs/)")
    ap.add_argument("--json", help="results file (default OUT/results.json)")
    ap.add_argument("--reference", default=os.path.join(ROOT, "logs", "reference"),
                    help="reference logs (default logs/reference/)")
    ap.add_argument("--rubric", default=RUBRIC_PATH, help=argparse.SUPPRESS)
    ap.add_argument("--cuda", action="store_true",
                    help="build against the CUDA backend (make cuda) and run on the GPU; loss and grad norm are "
                         "compared with the baseline run on the same GPU")
    ap.add_argument("--timeout", type=float, help="wall-clock limit per run in seconds (default: the rubric's)")
    return ap.parse_args(argv)


def main(argv=None):
    t_start = time.monotonic()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        rubric = load_rubric(args.rubric)
        stages = [parse_stage(rubric, s) for s in args.stage] or sorted(rubric["stages"])
        stages = sorted(set(stages))
        if args.file and (len(stages) != 1 or not args.stage):
            raise UsageError("--file needs exactly one --stage (e.g. --file my/hw_fsdp.c --stage 03)")
        if args.file and args.solutions:
            raise UsageError("--file and --solutions exclude each other")
        if args.file and not os.path.isfile(args.file):
            raise UsageError("--file %s: no such file" % args.file)
        if not os.path.isdir(args.reference):
            raise UsageError("--reference %s: no such directory" % args.reference)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError("--timeout must be positive")
        if args.cuda:
            global CUDA_MODE
            CUDA_MODE = True
        out_root = os.path.abspath(args.out)
        try:
            os.makedirs(out_root, exist_ok=True)
        except OSError as e:
            raise UsageError("--out %s: cannot create the directory (%s)" % (args.out, e.strerror or e))
    except UsageError as e:
        say("grade.py: error: %s" % one_line(str(e)), sys.stderr)
        return 2

    timeout_s = args.timeout or rubric["limits"]["run_timeout_s"]
    baselines = Baselines(out_root, rubric["limits"], timeout_s)
    tree = "file" if args.file else "solutions" if args.solutions else "stages"
    results = []
    for stage in stages:
        src = os.path.abspath(args.file) if args.file else os.path.join(ROOT, tree, rubric["stages"][stage]["dir"],
                                                                          "hw_fsdp.c")
        results.append(grade_stage(rubric, stage, src, out_root, os.path.abspath(args.reference), baselines,
                                   timeout_s))
    score = sum(r["points"] for r in results)
    total = sum(r["max_points"] for r in results)
    elapsed = time.monotonic() - t_start
    say("Score: %s/%s" % (fmt_points(score), fmt_points(total)))
    json_path = args.json or os.path.join(out_root, "results.json")
    summary = {"score": score, "max_score": total, "seconds": round(elapsed, 3), "tree": tree,
               "reference": relpath(os.path.abspath(args.reference)),
               "stages": {r["stage"]: r for r in results}}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path + ".tmp", "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(json_path + ".tmp", json_path)
    except OSError as e:
        say("could not write %s: %s" % (json_path, e), sys.stderr)
    say("results: %s" % relpath(os.path.abspath(json_path)))
    say("graded %d stage%s in %.1f s" % (len(results), "" if len(results) == 1 else "s", elapsed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
