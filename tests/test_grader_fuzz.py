"""Mutation fuzzing of the grader's readers: a malformed artifact fails a check with a one-line
reason (or, for the rubric, is a one-line usage error with exit status 2), never a traceback.

The artifacts are real: the published reference run of each stage (logs/reference/stageNN,
its merged trace split back into trace_rank<r>.json) stands in for a student's run, the
reference and the baseline. Each test mutates one kind of file a few hundred times with a
fixed seed (byte flips, truncation, garbage bytes, deleted keys, values of the wrong type,
huge numbers, NaN, deep nesting, invalid UTF-8 and surrogates) and runs, in process, every
check of grader/gradelib/checks/ that reads it. Only CheckFailed may come out of a check.
No build and no binary: pure Python, about 10 s.

    /usr/bin/python3 -m pytest -q tests/test_grader_fuzz.py
    GRADER_FUZZ_MUTATIONS=3000 GRADER_FUZZ_SEED=7 /usr/bin/python3 -m pytest -q tests/test_grader_fuzz.py   # longer, other inputs
"""
import gzip
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import traceback
import zlib

import pytest

from helpers import ROOT, manifest

from gradelib.checks import CHECKS, run_check
from gradelib.context import PARTIAL_FILE, Context
from gradelib.rubric import RUBRIC_PATH, baseline_flags, load_rubric, parse_stage, stage_config, stage_flags
from gradelib.runner import CHECKPOINT, SAVED_DIR, RunResult, last_completed_step
from gradelib.util import CheckFailed, UsageError, is_int, one_line
from trace_names import COLLECTIVE, COMPUTE

REFERENCE = os.path.join(ROOT, "logs", "reference")
MUTATIONS = int(os.environ.get("GRADER_FUZZ_MUTATIONS", "400"))
SEED = int(os.environ.get("GRADER_FUZZ_SEED", "20251122"))
# Keep the snapshots to the init and the first two steps: the same structure, a third of the bytes.
# Traces stay whole: the overlap checks measure the whole run's modelled timeline, and make_reference publishes
# only runs that pass their own checks, so the pristine files pass every check (test_pristine_world_passes).
KEEP_STEPS = 2

pytestmark = pytest.mark.skipif(not os.path.isdir(REFERENCE), reason="no logs/reference")


# ------------------------------------------------------------------ the world

class FakeBaselines:
    """The stage's baseline run, already on disk (gradelib.runner.Baselines would build and run it): the reference
    metrics, which agree with the baseline's within the tolerances."""

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def get(self, flags, steps, save=False):
        return RunResult(self.run_dir, True, "", 0.0, [])


def write_checkpoint(path, params, step):
    """A safetensors file as the driver's --save writes it (checkpoint.c) for params [(name, shape)] from a DTensors
    dump: each weight and its optim.<name>.exp_avg / exp_avg_sq in float32, made-up values (the same for the run's
    and the baseline's: the check compares the two), the step in the metadata."""
    header, blobs, off = {}, [], 0
    for kind in ("", ".exp_avg", ".exp_avg_sq"):
        for name, shape in params:
            n = 1
            for d in shape:
                n *= d
            data = struct.pack("<%df" % n, *((i % 97) * 0.01 - 0.4 for i in range(n)))
            header[("optim." + name + kind) if kind else name] = {"dtype": "F32", "shape": shape,
                                                                  "data_offsets": [off, off + len(data)]}
            blobs.append(data)
            off += len(data)
    header["__metadata__"] = {"format": "pt", "step": str(step)}
    text = json.dumps(header, separators=(",", ":")).encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _step_of(e):
    args = e.get("args") if "args" in e else e
    return args.get("step", -1) if isinstance(args, dict) else -1


class World:
    """Pristine run, reference and baseline directories, and the parsed files each check reads."""

    def __init__(self, root):
        self.root = root
        self.rubric = load_rubric()
        self.stages = sorted(self.rubric["stages"])
        self.world = int(self.rubric["config"]["world"])
        self.ref = os.path.join(root, "reference")
        self.runs = {}
        for stage in self.stages:
            src = os.path.join(REFERENCE, "stage" + stage)
            ref = os.path.join(self.ref, "stage" + stage)
            run = os.path.join(root, "runs", stage)
            os.makedirs(run)
            shutil.copytree(src, ref, ignore=shutil.ignore_patterns("*.png", "*.gz", "dtensors*"))
            shutil.copy(os.path.join(src, "metrics.jsonl"), run)
            shutil.copy(os.path.join(src, "run.json"), run)  # what the runtime states it used: groups, rules
            for r in range(self.world):
                shutil.copy(os.path.join(src, "dtensors_rank%d.json" % r), run)
                with gzip.open(os.path.join(src, "memory_rank%d.json.gz" % r)) as fh:
                    snap = json.load(fh)
                snap["events"] = [e for e in snap["events"] if _step_of(e) < KEEP_STEPS]
                self._dump(os.path.join(run, "memory_rank%d.json" % r), snap)
                with gzip.open(os.path.join(ref, "memory_rank%d.json.gz" % r), "wt") as fh:  # the same steps
                    json.dump(snap, fh, separators=(",", ":"))
            shutil.copy(os.path.join(src, "trace.json.gz"), ref)  # a pipeline's bubble check reads the reference's
            with gzip.open(os.path.join(src, "trace.json.gz")) as fh:
                merged = json.load(fh)["traceEvents"]
            for r in range(self.world):
                events = [e for e in merged if e.get("pid") == r]
                self._dump(os.path.join(run, "trace_rank%d.json" % r), {"traceEvents": events})
            if partial_checks(self.rubric, stage):
                self._dump(os.path.join(run, PARTIAL_FILE % 0), partial_record(run))
            self.runs[stage] = run
            os.makedirs(os.path.join(root, "baseline", stage))
            shutil.copy(os.path.join(src, "metrics.jsonl"), os.path.join(root, "baseline", stage))
            if manifest.stage(stage, self.rubric).save:  # the run's twin with --save and the baseline's checkpoints
                with open(os.path.join(src, "dtensors_rank0.json")) as fh:
                    params = [(p["name"], p["global_shape"]) for p in json.load(fh)["params"]]
                step = stage_config(self.rubric, stage)["steps"]
                write_checkpoint(os.path.join(run, SAVED_DIR, CHECKPOINT), params, step)
                write_checkpoint(os.path.join(root, "baseline", stage, CHECKPOINT), params, step)
        # every file's bytes, and each stage's loaded files (shared by all contexts: checks only read them)
        self.pristine_bytes = {}
        for d, _, files in os.walk(root):
            for f in files:
                with open(os.path.join(d, f), "rb") as fh:
                    self.pristine_bytes[os.path.join(d, f)] = fh.read()
        self.loaded = {}
        for stage in self.stages:
            ctx = self.context(stage, seed_cache=False)
            for key in self.rubric["stages"][stage]["checks"]:
                CHECKS[key](ctx)
            ctx.metrics()
            ctx.run_json()
            for r in range(self.world):
                ctx.dtensors(r), ctx.memory(r), ctx.trace(r)
            self.loaded[stage] = dict(ctx._cache)
        self.fingerprint = self._fingerprint()

    @staticmethod
    def _dump(path, obj):
        with open(path, "w") as fh:
            json.dump(obj, fh, separators=(",", ":"))

    def _fingerprint(self):
        return zlib.crc32(json.dumps([sorted(map(repr, v.items())) for _, v in sorted(self.loaded.items())]).encode())

    def context(self, stage, rubric=None, seed_cache=True, drop=(), partial=False):
        """The stage's Context; partial: the one reading the partial record (partial_rank0.json), of a run
        that failed, nothing loaded beforehand."""
        run = RunResult(self.runs[stage], not partial, "" if not partial else "runtime error: race", 0.0, [])
        baselines = FakeBaselines(os.path.join(self.root, "baseline", stage))
        if partial:
            return Context(rubric or self.rubric, stage, run, self.ref, baselines).partial_view()
        ctx = Context(rubric or self.rubric, stage, run, self.ref, baselines)
        if seed_cache:
            ctx._cache.update({k: v for k, v in self.loaded[stage].items() if k not in drop})
        return ctx

    def restore(self, path):
        with open(path, "wb") as fh:
            fh.write(self.pristine_bytes[path])


def partial_checks(rubric, stage):
    """The stage's checks that can judge a failed run's partial record (Check.partial)."""
    return [k for k in rubric["stages"][stage]["checks"] if CHECKS[k].partial]


def partial_record(run):
    """A partial record as the runtime leaves it at a runtime error (runtime.h, dev_record_partial), made of the run's
    rank 0: its trace in time order cut in the middle of the last step, each slice at its start with no duration,
    and its memory notes of the steps before."""
    with open(os.path.join(run, "trace_rank0.json")) as fh:
        events = json.load(fh)["traceEvents"]
    with open(os.path.join(run, "memory_rank0.json")) as fh:
        notes = [e for e in json.load(fh)["events"] if "kind" in e]
    slices = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    last = max(_step_of(e) for e in slices)
    in_last = [e["ts"] for e in slices if _step_of(e) == last]
    cut = in_last[len(in_last) // 2]
    kept = [dict(e, dur=0) for e in slices if _step_of(e) < last or e["ts"] < cut]
    return {"partial": True, "rank": 0, "error": "race on rank 0: a fuzzed run's runtime error",
            "traceEvents": [e for e in events if e.get("ph") != "X"] + kept,
            "events": [e for e in notes if _step_of(e) < last]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(str(tmp_path_factory.mktemp("grader_fuzz")))


# ------------------------------------------------------------------ mutations

RAW = "@@raw%d@@"


def garbage(rng, depth=0):
    """A value of a random kind; some are raw JSON text substituted after dumping."""
    kinds = ["null", "true", "neg", "zero", "big", "huge", "nan", "inf", "float", "empty", "str", "ctrl", "uni",
             "surrogate", "list", "dict", "nested", "deep", "digits", "badtoken"]
    k = rng.choice(kinds)
    if k == "null":
        return None
    if k == "true":
        return rng.choice([True, False])
    if k == "neg":
        return -rng.randint(1, 10 ** 6)
    if k == "zero":
        return rng.choice([0, 0.0, -0.0])
    if k == "big":
        return rng.choice([2 ** 53 + 1, 2 ** 63, 2 ** 64, 10 ** 30])
    if k == "huge":
        return 10 ** rng.randint(300, 1000)
    if k == "nan":
        return float("nan")
    if k == "inf":
        return rng.choice([float("inf"), float("-inf")])
    if k == "float":
        return rng.choice([0.5, -1e-300, 1e300, 3.0, 1.7976931348623157e308])
    if k == "empty":
        return rng.choice(["", [], {}])
    if k == "str":
        return rng.choice(["x", "Shard(0)", "embedding", "alloc", "all_gather", "collective", "compute",
                           "block0.all_gather", "hook_check", "post_forward", "X" * 5000])
    if k == "ctrl":
        return "a\nb\r\x00\x1b[31m\t"
    if k == "uni":
        return "é\u2028\U0001F600\ufeff"
    if k == "surrogate":
        return "\ud800x\udfff"
    if k == "list":
        return [garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))] if depth < 3 else []
    if k == "dict":
        return {rng.choice(["a", "step", "ts", "name", ""]): garbage(rng, depth + 1)} if depth < 3 else {}
    if k == "nested":
        v = 1
        for _ in range(rng.randint(2, 60)):
            v = [v] if rng.random() < 0.5 else {"k": v}
        return v
    return RAW  # raw text: deep, digits, badtoken


def raw_text(rng):
    return rng.choice([
        "[" * 100000 + "]" * 100000,                    # RecursionError in json
        "1" * 5000,                                     # beyond Python's int digit limit
        "NaN", "-Infinity", "1e999", "-0", "1E-400",
        '"\\ud800"', '"\\u0000"', "tru", "nul", '"unterminated',
    ])


def pick_node(rng, root, bias_events):
    """(container, key) of a random node, walking down from the root."""
    node, parent, key = root, None, None
    for depth in range(8):
        if isinstance(node, dict) and node:
            keys = list(node)
            k = rng.choice(keys)
            if bias_events and "traceEvents" in node:
                k = "traceEvents"
            elif bias_events and "events" in node and rng.random() < 0.8:
                k = "events"
            elif bias_events and "params" in node and rng.random() < 0.8:
                k = "params"
        elif isinstance(node, list) and node:
            k = rng.randrange(len(node))
            if bias_events and isinstance(node[k], dict):
                # prefer the entries the checks read
                for _ in range(20):
                    e = node[k]
                    if e.get("ph") == "X" and e.get("cat") in (COLLECTIVE, COMPUTE) or \
                            e.get("kind") == "hook_check" or e.get("action") in ("alloc", "free") or "placement" in e:
                        break
                    k = rng.randrange(len(node))
        else:
            break
        parent, key, node = node, k, node[k]
        if depth >= 1 and rng.random() < 0.35:
            break
    return parent, key


def mutate_value(rng, doc, bias_events=True):
    """Mutate one node of a parsed JSON document; returns (new document, description, raw substitutions)."""
    wrapper = {"doc": doc}  # so that the whole document can be replaced too
    what, subs = _mutate_node(rng, wrapper, bias_events)
    return wrapper.get("doc"), what, subs


def _mutate_node(rng, root, bias_events):
    parent, key = pick_node(rng, root, bias_events)
    op = rng.random()
    if op < 0.25 and isinstance(parent, dict):
        del parent[key]
        return "deleted %r" % (key,), {}
    if op < 0.35 and isinstance(parent, list):
        del parent[key]
        return "deleted item %d" % key, {}
    value = garbage(rng)
    subs = {}
    if value == RAW:
        value = RAW % 0
        subs[value] = raw_text(rng)
    parent[key] = value
    return "%r set to %s" % (key, repr(value)[:60]), subs


def dumps(doc, subs):
    text = json.dumps(doc, separators=(",", ":"))
    for placeholder, raw in subs.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode("utf-8", "surrogatepass")


def mutate_bytes(rng, data):
    ops = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["flip", "truncate", "delete", "insert", "duplicate", "empty"])
        n = len(data)
        if op == "flip" and n:
            i = rng.randrange(n)
            data = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
        elif op == "truncate" and n:
            data = data[:rng.randrange(n)]
        elif op == "delete" and n:
            i = rng.randrange(n)
            data = data[:i] + data[i + rng.randint(1, 64):]
        elif op == "insert":
            i = rng.randrange(n + 1)
            junk = rng.choice([b"\x00", b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\n", b"{", b"]", b",,",
                               b'"', b"NaN", b"\\", bytes(rng.randrange(256) for _ in range(8))])
            data = data[:i] + junk + data[i:]
        elif op == "duplicate" and n:
            i = rng.randrange(n)
            data = data[:i] + data[i:i + rng.randint(1, 200)] * 2 + data[i + 200:]
        elif op == "empty":
            data = b"" if rng.random() < 0.3 else data
        ops.append(op)
    return "bytes: " + "+".join(ops), data


def mutate_checkpoint(rng, raw):
    """(description, new bytes) of a safetensors file: its bytes, or one node of its JSON header (the length in
    front rewritten, or now and then left as it was)."""
    if rng.random() < 0.4:
        return mutate_bytes(rng, raw)
    n = struct.unpack("<Q", raw[:8])[0]
    doc, what, subs = mutate_value(rng, json.loads(raw[8:8 + n]), bias_events=False)
    text = dumps(doc, subs)
    length = n if rng.random() < 0.1 else len(text)
    return "header: " + what, struct.pack("<Q", length) + text + raw[8 + n:]


def mutate_file(rng, raw, jsonl):
    """(description, new bytes) for a file's pristine bytes."""
    if rng.random() < 0.3:
        return mutate_bytes(rng, raw)
    if jsonl:
        lines = raw.decode().splitlines()
        op = rng.random()
        i = rng.randrange(len(lines))
        if op < 0.15:
            del lines[i]
            return "deleted line %d" % (i + 1), ("\n".join(lines) + "\n").encode()
        if op < 0.25:
            lines.insert(i, rng.choice(["[]", "1", "null", '"x"', "{}", '{"step": 1}', "[" * 3000 + "]" * 3000]))
            return "inserted a line at %d" % (i + 1), ("\n".join(lines) + "\n").encode()
        row, what, subs = mutate_value(rng, json.loads(lines[i]), bias_events=False)
        lines[i] = dumps(row, subs).decode("utf-8", "surrogatepass")
        return "line %d: %s" % (i + 1, what), ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    doc, what, subs = mutate_value(rng, json.loads(raw))
    return what, dumps(doc, subs)


# ------------------------------------------------------------------ running the checks

def run_checks(ctx, keys, failures, what):
    """Every check in keys: returns normally or raises CheckFailed with a one-line reason."""
    for key in keys:
        try:
            CHECKS[key](ctx)
        except CheckFailed as e:
            reason = one_line(str(e))
            if not reason or "\n" in reason:
                failures.append("%s: check %s: empty or multi-line reason %r" % (what, key, str(e)[:200]))
        except Exception:  # noqa: BLE001 -- exactly what this test hunts
            failures.append("%s: check %s raised\n%s" % (what, key, traceback.format_exc(limit=4)))


def checks_reading(world, stage, reader):
    keys = list(world.rubric["stages"][stage]["checks"])
    reads = {
        "metrics": {"loss", "grad_norm", "peak_memory", "prefetch_bound", "activation_memory"},
        "reference_metrics": {"loss", "grad_norm", "peak_memory"},
        "run_json": {"loss", "grad_norm", "peak_memory"},
        "own_run_json": {"hsdp_collectives", "hsdp_memory", "prefetch_policy", "grad_norm"},
        "baseline_metrics": {"loss", "grad_norm"},
        "dtensors": {"dtensors", "prefetch_bound", "recompute"},
        "memory": {"freed_after_forward", "freed_after_backward", "grads_freed", "zero2_params_kept",
                   "peak_memory", "dtensors"},
        "trace": {"ag_overlap", "rs_overlap", "prefetch_bound", "recompute", "zero2_no_backward_all_gather"},
        "checkpoint": {"flat_checkpoint"},
    }[reader]
    return [k for k in keys if k in reads]


def report(failures):
    if failures:
        pytest.fail("%d mutations crashed the grader; the first:\n%s" % (len(failures), "\n\n".join(failures[:3])),
                    pytrace=False)


# ------------------------------------------------------------------ tests

def test_pristine_world_passes(world):
    for stage in world.stages:
        ctx = world.context(stage)
        for key in world.rubric["stages"][stage]["checks"]:
            ok, reason, _ = run_check(ctx, key)
            assert ok, (stage, key, reason)


def test_pristine_partial_records_pass(world):
    """A partial record cut in the middle of a correct run's last step passes every check that judges one: what the
    run did not reach is no fault."""
    stages = [s for s in world.stages if partial_checks(world.rubric, s)]
    assert stages
    for stage in stages:
        ctx = world.context(stage, partial=True)
        assert ctx is not None and ctx.ranks() == [0], stage
        for key in partial_checks(world.rubric, stage):
            ok, reason, _ = run_check(ctx, key)
            assert ok, (stage, key, reason)


@pytest.mark.parametrize("reader", ["metrics", "reference_metrics", "run_json", "own_run_json", "baseline_metrics",
                                    "dtensors", "memory", "trace", "partial", "checkpoint"])
def test_mutated_artifacts_fail_checks_cleanly(world, reader):
    rng = random.Random(SEED + zlib.crc32(reader.encode()))
    failures = []
    stages = [s for s in world.stages if (partial_checks(world.rubric, s) if reader == "partial" else
                                          checks_reading(world, s, reader))]
    for n in range(MUTATIONS):
        stage = rng.choice(stages)
        rank = rng.randrange(world.world)
        drop = ()
        if reader == "metrics":
            path, drop = os.path.join(world.runs[stage], "metrics.jsonl"), ("metrics",)
        elif reader == "reference_metrics":
            path = os.path.join(world.ref, "stage" + rng.choice(["02", stage, stage]), "metrics.jsonl")
            if stage == "05" and rng.random() < 0.3:
                path = os.path.join(world.ref, "stage05", "no_ac", "metrics.jsonl")
        elif reader == "run_json":
            path = os.path.join(world.ref, "stage" + stage, "run.json")
        elif reader == "own_run_json":
            path, drop = os.path.join(world.runs[stage], "run.json"), ("run_json", "groups")
        elif reader == "baseline_metrics":
            path, drop = os.path.join(world.root, "baseline", stage, "metrics.jsonl"), ("baseline",)
        elif reader == "dtensors":
            path, drop = os.path.join(world.runs[stage], "dtensors_rank%d.json" % rank), (("dt", rank), "modules")
        elif reader == "memory":
            path, drop = os.path.join(world.runs[stage], "memory_rank%d.json" % rank), (("mem", rank),)
        elif reader == "partial":
            path = os.path.join(world.runs[stage], PARTIAL_FILE % 0)
        elif reader == "checkpoint":
            path, drop = os.path.join(world.runs[stage], SAVED_DIR, CHECKPOINT), ("checkpoint",)
        else:
            path, drop = os.path.join(world.runs[stage], "trace_rank%d.json" % rank), (("trace", rank),)
        what, data = (mutate_checkpoint(rng, world.pristine_bytes[path]) if reader == "checkpoint" else
                      mutate_file(rng, world.pristine_bytes[path], path.endswith(".jsonl")))
        what = "#%d %s stage %s %s: %s" % (n, reader, stage, os.path.relpath(path, world.root), what)
        with open(path, "wb") as fh:
            fh.write(data)
        try:
            if reader == "partial":
                ctx = world.context(stage, partial=True)
                run_checks(ctx, partial_checks(world.rubric, stage), failures, what)
                continue
            ctx = world.context(stage, drop=drop)
            run_checks(ctx, checks_reading(world, stage, reader), failures, what)
            if reader == "memory":
                try:
                    assert isinstance(ctx.where_peak(rank), str)
                except Exception:  # noqa: BLE001
                    failures.append("%s: where_peak raised\n%s" % (what, traceback.format_exc(limit=4)))
            if reader == "metrics":
                try:
                    assert is_int(last_completed_step(world.runs[stage]))
                except Exception:  # noqa: BLE001
                    failures.append("%s: last_completed_step raised\n%s" % (what, traceback.format_exc(limit=4)))
        finally:
            world.restore(path)
    report(failures)
    assert world._fingerprint() == world.fingerprint, "a check modified the parsed files it was given"


def test_mutated_artifacts_keep_the_evidence_hints_clean(world):
    """The grad norm's hints from the evidence (gradelib/hints.py) read the run's and the reference's grad_state
    notes and the trace's reductions, but only once the check has failed, which a pristine world never does:
    they are called here directly on mutated snapshots (run and reference, stage 07) and traces. Each gives a
    one-line hint or "" (norm_reduction_ok: True, False or None), never an exception."""
    from gradelib.hints import grad_reduction_hint, grad_state_hint, norm_reduction_hint, norm_reduction_ok
    import manifest
    stages = [s for s in manifest.stages(world.rubric) if s.id in world.runs]
    accum = next((s.id for s in stages if any(f.startswith("--grad-accum") for f in s.flags)), None)
    mesh = next((s.id for s in stages if any(f.startswith("--mesh") for f in s.flags)), None)
    trains = next((s.id for s in stages if not s.forward_only), None)
    if accum is None:
        pytest.skip("a staged release: no --grad-accum stage in its rubric")
    traced = [s for s in (mesh, accum, trains) if s]
    rng = random.Random(SEED + zlib.crc32(b"hints"))
    failures = []
    for n in range(MUTATIONS):
        which = rng.choice(["memory", "reference_memory", "trace"])
        stage = rng.choice(traced) if which == "trace" else accum
        rank = rng.randrange(world.world)
        if which == "memory":
            path, drop = os.path.join(world.runs[stage], "memory_rank%d.json" % rank), (("mem", rank),)
        elif which == "reference_memory":
            path, drop = os.path.join(world.ref, "stage" + accum, "memory_rank%d.json.gz" % rank), (("refmem", rank),)
        else:
            path, drop = os.path.join(world.runs[stage], "trace_rank%d.json" % rank), (("trace", rank),)
        raw = world.pristine_bytes[path]
        gz = path.endswith(".gz")
        what, data = mutate_file(rng, gzip.decompress(raw) if gz else raw, False)
        what = "#%d %s stage %s %s: %s" % (n, which, stage, os.path.relpath(path, world.root), what)
        with open(path, "wb") as fh:
            fh.write(gzip.compress(data) if gz else data)
        try:
            ctx = world.context(stage, drop=drop)
            for fn, args in ((grad_state_hint, (ctx, 2, 2)), (norm_reduction_hint, (ctx, 1, 1.5)),
                             (grad_reduction_hint, (ctx, 1, 1.5)), (norm_reduction_ok, (ctx, 1))):
                try:
                    out = fn(*args)
                    ok = out in (True, False, None) if fn is norm_reduction_ok else (
                        isinstance(out, str) and "\n" not in out)
                    if not ok:
                        failures.append("%s: %s gave %r" % (what, fn.__name__, out))
                except Exception:  # noqa: BLE001 -- exactly what this test hunts
                    failures.append("%s: %s raised\n%s" % (what, fn.__name__, traceback.format_exc(limit=4)))
        finally:
            world.restore(path)
    report(failures)
    assert world._fingerprint() == world.fingerprint, "a hint modified the parsed files it was given"


def figures_beside(tmp_path):
    """The measured figures (grader/figures/) copied beside a rubric written to tmp_path/rubric.json, as
    manifest.load reads them: the rubric's own entries are what a test edits."""
    for name in manifest.FIGURES:
        dst = manifest.figures_path(name, str(tmp_path / "rubric.json"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(manifest.figures_path(name), dst)


def test_mutated_rubric_is_a_usage_error_or_usable(world, tmp_path):
    rng = random.Random(SEED + zlib.crc32(b"rubric"))
    with open(RUBRIC_PATH, "rb") as fh:
        pristine = fh.read()
    path = str(tmp_path / "rubric.json")
    figures_beside(tmp_path)
    failures, usable = [], 0
    for n in range(MUTATIONS):
        what, data = mutate_file(rng, pristine, False)
        what = "#%d rubric: %s" % (n, what)
        with open(path, "wb") as fh:
            fh.write(data)
        try:
            rubric = load_rubric(path)
        except UsageError as e:
            if not str(e) or "\n" in str(e):
                failures.append("%s: bad usage error %r" % (what, str(e)[:200]))
            continue
        except Exception:  # noqa: BLE001
            failures.append("%s: load_rubric raised\n%s" % (what, traceback.format_exc(limit=4)))
            continue
        usable += 1
        try:
            for stage in rubric["stages"]:
                parse_stage(rubric, stage)
                stage_flags(rubric, stage)
                baseline_flags(rubric, stage)
                for key in rubric["stages"][stage]["checks"]:
                    assert isinstance(CHECKS[key].label, str)
            for text in ("03", "3", manifest.stage("03").dir, "x"):
                try:
                    parse_stage(rubric, text)
                except UsageError:
                    pass
        except Exception:  # noqa: BLE001
            failures.append("%s: a usable rubric crashed the grader\n%s" % (what, traceback.format_exc(limit=4)))
            continue
        # the checks of one stage the run directories have, under this rubric
        stage = rng.choice([s for s in world.stages if s in rubric["stages"]] or [None])
        if stage is not None:
            ctx = world.context(stage, rubric=rubric, drop=("metrics", "baseline", "modules"))
            run_checks(ctx, list(rubric["stages"][stage]["checks"]), failures, what)
    report(failures)
    assert usable > MUTATIONS // 10, "too few mutations left a usable rubric (%d): the test lost its reach" % usable


def test_unexpected_exception_in_a_check_is_a_failed_check(world, monkeypatch):
    def broken(ctx):
        raise KeyError("ts\nsecond line")
    monkeypatch.setitem(CHECKS, "loss", broken)
    ok, reason, detail = run_check(world.context("01"), "loss")
    assert not ok and reason.startswith("could not check (KeyError: ") and "\n" not in reason


def test_one_line():
    assert one_line("plain text: ok") == "plain text: ok"
    assert one_line("a\nb\x1b[0m\ud800") == "a\\nb\\x1b[0m\\ud800"
    assert len(one_line("x" * 10000)) == 2000


@pytest.mark.parametrize("content,message", [
    (b"{not json", "cannot read the rubric"),
    (b"[]", "the rubric must be a JSON object"),
    (b"[" * 100000 + b"]" * 100000, "cannot read the rubric"),
    (b'{"config": {}}', "limits must be a JSON object, got null"),
    (None, "tolerances.cuda_loss_rel must be a number >= 0, got \"tiny\""),
    (None, "stages.02.checks must be a JSON object"),
    (None, "no_ac_reference.solution must be one of the stages"),
], ids=["not-json", "array", "deep", "no-flavor", "tolerance-string", "checks-list", "no-ac-solution"])
def test_cli_bad_rubric_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "rubric.json"
    figures_beside(tmp_path)
    if content is None:
        rubric = json.loads(open(RUBRIC_PATH).read())
        if "loss_rel" in message:
            rubric["tolerances"]["cuda_loss_rel"] = "tiny"
        elif "no_ac_reference" in message:  # a stage that does not exist
            for spec in rubric["stages"].values():
                if "no_ac_reference" in spec:
                    spec["no_ac_reference"]["solution"] = "99"
        else:
            rubric["stages"]["02"]["checks"] = ["loss"]
        content = json.dumps(rubric).encode()
    path.write_bytes(content)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--rubric", str(path),
                        "--out", str(tmp_path / "out"), "--stage", "01"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("grade.py: error: ") and message in lines[0], p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["stages"]["02"]["checks"].update(lost=1), 'stages.02.checks must be keys among loss, grad_norm, '),
    (lambda r: r["variants"]["uneven"]["checks"].append("lost"), 'variants.uneven.checks must be keys among loss, '),
    (lambda r: r["variants"]["uneven"]["checks"].append("prefetch_bound"),
     "variants.uneven.checks: prefetch_bound (prefetch memory bound) grades the main run only, a variant cannot run "
     "it; a variant may list loss, grad_norm, "),
    (lambda r: r["variants"]["uneven"]["checks"].append("ag_overlap"),
     "variants.uneven.checks: ag_overlap (all-gather overlap) is graded on every variant of a stage that grades it, "
     "by itself: do not list it"),
    (lambda r: r["variants"]["uneven"].update(checks=[]), "variants.uneven.checks must be a non-empty list of checks"),
    (lambda r: r.update(check_names={"loss": "loss parity"}), "check_names is no longer read"),
], ids=["unknown-check", "variant-unknown-check", "variant-main-run-check", "variant-every-run-check",
        "variant-no-checks", "check-names"])
def test_rubric_names_only_checks_the_grader_has(tmp_path, edit, message):
    """rubric.json names checks by key; the checks themselves (label, whether a variant may run them) live
    in gradelib/checks/: a key it does not have, or a variant listing a check of the main run only, is
    one line naming the entry."""
    with open(RUBRIC_PATH) as fh:
        rubric = json.load(fh)
    edit(rubric)
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    figures_beside(tmp_path)
    with pytest.raises(UsageError) as e:
        load_rubric(str(path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_out_is_a_file_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grader", "grade.py"), "--out", str(blocker / "out"),
                        "--stage", "01"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "grade.py: error: --out " in lines[0] and "cannot create the directory" in lines[0], \
        p.stderr
