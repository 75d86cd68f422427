"""What a stage's checks read: the run's files, the reference logs and the non-sharded baseline.

Context loads each file once per stage and checks the shape of every entry the checks use,
so that a malformed file (a crash mid-write, a student's stray write) fails the check with a
sentence naming the file and the entry, never a KeyError or a traceback
(tests/test_grader_fuzz.py mutates every file to hold the loaders to that).
"""
import array
import gzip
import json
import math
import os
import struct
import sys

import manifest
from trace_names import COLLECTIVE

from .runner import CHECKPOINT, SAVED_DIR
from .rubric import (MAIN_RUN, REMEASURE, baseline_flags, parity_tolerances, stage_config, stage_only_flags,
                     tolerances, variant_label)
from .trace_model import Trace, TraceError, by_rank, checked_slices, group_kinds, group_of, runtime_groups
from .util import CheckFailed, fmt_bytes, is_finite, is_int, is_num, mp_policy, one_line, read_json, relpath, short


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


class Tensor:
    """One tensor of a safetensors file: dtype ("F32"), shape, numel, and its float32 values (read_checkpoint)."""

    def __init__(self, dtype, shape, values):
        self.dtype, self.shape, self.values = dtype, shape, values
        self.numel = math.prod(shape)


CHECKPOINT_MAX_BYTES = 1 << 31  # far above the grading model's (tiny: 1.6 MB with the AdamW state)


def read_checkpoint(path, what="your run's checkpoint"):
    """(metadata, {name: Tensor} in the file's order) of a safetensors file as the driver's --save writes it
    (checkpoint.c): an 8-byte little-endian header length N, N bytes of a JSON object (name -> {dtype, shape,
    data_offsets} and "__metadata__": strings), then the data. Each entry checked: a known dtype, a shape of
    dimensions, offsets in the data that hold exactly numel elements; F32 values decoded (other dtypes: values
    None, the check says the dtype). CheckFailed naming the file and the entry otherwise."""
    name = relpath(path)
    try:
        size = os.path.getsize(path)
        if size > CHECKPOINT_MAX_BYTES:
            raise CheckFailed("%s is %d bytes, more than a checkpoint of the grading model can be (%s)"
                              % (name, size, what))
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise CheckFailed("%s is missing (%s)" % (name, what))
    except OSError as e:
        raise CheckFailed("%s cannot be read (%s)" % (name, e.strerror or e))
    if len(raw) < 8:
        raise CheckFailed("%s is %d bytes: not a safetensors file (%s)" % (name, len(raw), what))
    n = struct.unpack("<Q", raw[:8])[0]
    if n > len(raw) - 8:
        raise CheckFailed("%s: its header says %d bytes of JSON, the file holds %d after the length (%s)"
                          % (name, n, len(raw) - 8, what))
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckFailed("%s: its header is not valid JSON (%s)" % (name, one_line(str(e))))
    if not isinstance(header, dict):
        raise CheckFailed("%s: its header is not a JSON object (%s)" % (name, what))
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckFailed("%s: __metadata__ is %s, not an object of strings" % (name, short(meta)))
    data = memoryview(raw)[8 + n:]
    tensors = {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        where = "%s: %s" % (name, short(key, 80))
        if not isinstance(e, dict):
            raise CheckFailed("%s is %s, not a JSON object" % (where, short(e)))
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not (isinstance(dtype, str) and dtype in DTYPE_BYTES):
            raise CheckFailed("%s: dtype is %s, not one of %s" % (where, short(dtype), ", ".join(DTYPE_BYTES)))
        if not (isinstance(shape, list) and len(shape) <= 8 and all(is_int(d) and 0 <= d < 2 ** 40 for d in shape)):
            raise CheckFailed("%s: shape is %s, not a list of dimensions" % (where, short(shape)))
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets) and
                0 <= offsets[0] <= offsets[1] <= len(data)):
            raise CheckFailed("%s: data_offsets is %s, not [begin, end] inside the file's %d bytes of data"
                              % (where, short(offsets), len(data)))
        numel = math.prod(shape)
        if offsets[1] - offsets[0] != numel * DTYPE_BYTES[dtype]:
            raise CheckFailed("%s: data_offsets %s hold %d bytes, its shape %s in %s takes %d" % (
                where, offsets, offsets[1] - offsets[0], shape, dtype, numel * DTYPE_BYTES[dtype]))
        values = None
        if dtype == "F32":
            values = array.array("f")
            values.frombytes(data[offsets[0]:offsets[1]])
            if sys.byteorder != "little":
                values.byteswap()
        tensors[key] = Tensor(dtype, shape, values)
    return meta, tensors


# safetensors' dtypes and their sizes in bytes
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


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
    ("local_in_allocation", lambda v: v is None or isinstance(v, bool), "true, false or null"),
    ("local_matches_init", lambda v: v is None or isinstance(v, bool), "true, false or null"),
    ("padding_is_zero", lambda v: v is None or isinstance(v, bool), "true, false or null"),
]


# The partial record of a rank whose host reported the runtime error that stopped the run (runtime.h,
# dev_record_partial): its enqueued ops in host order (traceEvents, each at its enqueue's modelled time, dur 0)
# and its memory notes so far (events).
PARTIAL_FILE = "partial_rank%d.json"


class Context:
    """What a stage's checks read: the run's files, the reference, the baseline. Files are read once.

    cuda: the run is on a GPU (grade.py --cuda), so the baseline run on the same GPU is the ground truth
    for loss and grad norm (the reference logs come from the CPU).
    partial: the run stopped at a runtime error, and trace(r) and memory(r) read the partial record it left
    (PARTIAL_FILE) for the ranks that have one (ranks()); only the checks registered partial=True read it."""

    def __init__(self, rubric, stage, run, ref_root, baselines, cuda=False, variant=None, partial=False, saved=None):
        self.rubric, self.stage, self.run, self.ref_root, self.baselines = rubric, stage, run, ref_root, baselines
        self.cuda, self.variant, self.partial, self.saved = cuda, variant, partial, saved
        self.label = variant_label(rubric, variant, stage)
        self.cfg = stage_config(rubric, stage, variant)
        self.world, self.steps = int(self.cfg["world"]), int(self.cfg["steps"])
        self.tol = tolerances(rubric, variant)
        self.parity = parity_tolerances(rubric, stage, variant)
        self.flags = stage_only_flags(rubric, stage, variant)
        self.forward_only = "--forward-only" in self.flags
        self.failed_at = {}  # check key -> the first step its failure shows in (CheckFailed.step), None if not a step
        self._cache = {}

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def parity_tol(self, metric):
        """(tolerance against the reference log, tolerance against the baseline) of metric (loss, grad_norm) on
        this run, from the spread measured between correct implementations (grader/figures/parity_spread.json). With
        --cuda (a GPU sums in another order than the CPU the spreads were measured on) each is at least
        tolerances.cuda_<metric>_rel, a round number that is not measured: the loss and grad norm compare with
        the baseline on the same GPU, the clip coefficients with the (CPU) reference."""
        if metric not in self.parity:
            raise CheckFailed("rubric.json has no measured %s spread for stage %s, run %s (instructors: %s)"
                              % (metric, self.stage, self.variant or MAIN_RUN, REMEASURE))
        ref, base = self.parity[metric]
        if self.cuda:
            least = self.tol["cuda_%s_rel" % metric]
            return max(least, ref), max(least, base)
        return ref, base

    def path(self, name):
        return os.path.join(self.run.dir, name)

    def partial_view(self):
        """A Context of the same run reading its partial record (Context.partial), or None when the run left
        none (it did not stop at a runtime error, or nothing had been asked of it: see runtime.h)."""
        if self.run.ok or not any(os.path.isfile(self.path(PARTIAL_FILE % r)) for r in range(self.world)):
            return None
        return Context(self.rubric, self.stage, self.run, self.ref_root, self.baselines, cuda=self.cuda,
                       variant=self.variant, partial=True, saved=self.saved)

    def ranks(self):
        """The ranks whose record the checks read: every rank, or on a partial record the ones that left one."""
        if not self.partial:
            return list(range(self.world))
        return self._memo("partial_ranks", lambda: [r for r in range(self.world)
                                                    if os.path.isfile(self.path(PARTIAL_FILE % r))])

    def partial_record(self, rank):
        """The rank's partial record, checked: an object marked "partial": true, of this rank, with the error
        line, its traceEvents and its events (notes) lists."""
        def load():
            name = PARTIAL_FILE % rank
            data = read_json(self.path(name))
            if not isinstance(data, dict):
                raise CheckFailed("%s is not a JSON object" % name)
            if data.get("partial") is not True:
                raise CheckFailed("%s: partial is %s, not true" % (name, short(data.get("partial"))))
            if not (is_int(data.get("rank")) and data["rank"] == rank):
                raise CheckFailed("%s: rank is %s, not %d" % (name, short(data.get("rank")), rank))
            if not isinstance(data.get("error"), str):
                raise CheckFailed("%s: error is %s, not the runtime error's line" % (name, short(data.get("error"))))
            for key in ("traceEvents", "events"):
                if not isinstance(data.get(key), list):
                    raise CheckFailed("%s: %s is not a list" % (name, key))
            for i, e in enumerate(data["events"]):
                if not isinstance(e, dict):
                    raise CheckFailed("%s: event %d is not a JSON object" % (name, i))
            return data
        return self._memo(("partial", rank), load)

    def run_json(self):
        """The run's run.json (its configuration and what the runtime states it used: common/runtime/facts.h)."""
        return self._memo("run_json", lambda: read_json(self.path("run.json")))

    def groups(self):
        """{name: ranks} of the process groups the runtime made for the run (trace_model.runtime_groups)."""
        def load():
            try:
                return runtime_groups(self.run_json())
            except ValueError as e:
                raise CheckFailed(str(e))
        return self._memo("groups", load)

    def group_kind(self, name):
        """The kind of the group the trace calls `name` ("world", "shard", "replicate", "stage", "group"); None when
        run.json states no such group."""
        return group_kinds(self.run_json()).get(name)

    def group_of(self, rank, kind):
        """The runtime's group of `kind` ("shard", "replicate", "stage") holding `rank`; None when run.json states
        none."""
        return group_of(self.run_json(), rank, kind)

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
        if self.partial:  # its notes so far, under "events" as in a snapshot
            return self.partial_record(rank)

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

    def _reference_gz(self, name):
        """A gzipped JSON file of the reference run (the reference log; instructors: make reference)."""
        path = os.path.join(self.reference_dir(), name)
        try:
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return path, json.load(fh)
        except FileNotFoundError:
            raise CheckFailed("%s is missing (the reference log; instructors: make reference)" % relpath(path))
        except (OSError, EOFError, ValueError, RecursionError) as e:
            raise CheckFailed("%s cannot be read (%s): instructors: make reference" % (relpath(path), e))

    def reference_memory(self, rank):
        """The reference's snapshot of the rank (memory_rank<r>.json.gz), events checked to be objects."""
        def load():
            path, data = self._reference_gz("memory_rank%d.json.gz" % rank)
            events = data.get("events") if isinstance(data, dict) else None
            if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
                raise CheckFailed("%s has no list of events (instructors: make reference)" % relpath(path))
            return data
        return self._memo(("refmem", rank), load)

    def reference_trace(self):
        """{rank: [slice]} of the reference's trace (trace.json.gz: every rank, pid = rank), its well-formed "X"
        events."""
        def load():
            path, data = self._reference_gz("trace.json.gz")
            if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
                raise CheckFailed("%s has no traceEvents (instructors: make reference)" % relpath(path))
            return by_rank(e for e in Trace(data).events if is_int(e.get("pid")) and is_finite(e.get("ts"))
                           and is_finite(e.get("dur")) and isinstance(e.get("args"), dict))
        return self._memo("reftrace", load)

    def hook_memory(self, rank, reference=False):
        """{(step, module, hook, microbatch): note} of the rank's "hook_memory" notes (probes.h), each checked;
        microbatch -1 when the run does not accumulate."""
        name = "the reference's memory_rank%d.json.gz" % rank if reference else "memory_rank%d.json" % rank
        data = self.reference_memory(rank) if reference else self.memory(rank)
        out = {}
        for i, e in enumerate(data.get("events", [])):
            if e.get("kind") != "hook_memory":
                continue
            bad = [k for k in ("module", "hook") if not isinstance(e.get(k), str)]
            bad += [k for k in ("step", "entry_bytes", "high_water_bytes") if not (is_int(e.get(k)) and abs(e[k]) < 2 ** 53)]
            bad += [k for k in ("microbatch",) if k in e and not (is_int(e[k]) and 0 <= e[k] < 2 ** 31)]
            bad += [k for k in ("high_water_by_tag", "exit_by_tag") if not (
                isinstance(e.get(k), dict) and all(is_int(v) and 0 <= v < 2 ** 53 for v in e[k].values()))]
            bad += [k for k in ("host_exit_by_tag",) if k in e and not (
                isinstance(e[k], dict) and all(is_int(v) and 0 <= v < 2 ** 53 for v in e[k].values()))]
            if bad:
                raise CheckFailed("%s: event %d (hook_memory): %s is %s" % (name, i, bad[0], short(e.get(bad[0]))))
            out[(e["step"], e["module"], e["hook"], e.get("microbatch", -1))] = e
        if not out:
            raise CheckFailed("%s holds no hook_memory records" % name)
        return out

    def grad_padding(self, rank):
        """The rank's "grad_padding" notes (probes.h: a DTensor.grad whose padding rows are not zero before the
        optimizer; none in a correct run), each checked, in the snapshot's order."""
        name = "memory_rank%d.json" % rank
        out = []
        for i, e in enumerate(self.memory(rank).get("events", [])):
            if e.get("kind") != "grad_padding":
                continue
            bad = [k for k in ("module", "param") if not isinstance(e.get(k), str)]
            bad += [k for k in ("step", "local_rows", "padded_rows", "padding_values", "nonzero", "nan", "params")
                    if not (is_int(e.get(k)) and 0 <= e[k] < 2 ** 53)]
            if bad:
                raise CheckFailed("%s: event %d (grad_padding): %s is %s" % (name, i, bad[0], short(e.get(bad[0]))))
            out.append(e)
        return out

    def grad_states(self, rank, reference=False):
        """{(step, microbatch): note} of the rank's "grad_state" notes (probes.h: the gradient state after each
        microbatch of a --grad-accum run, as sums of squares), each checked; {} when the run has none."""
        name = "the reference's memory_rank%d.json.gz" % rank if reference else "memory_rank%d.json" % rank
        data = self.reference_memory(rank) if reference else self.memory(rank)

        def num(v):  # a dot product: finite, or null for a non-finite one
            return v is None or is_finite(v)

        def sumsq(v):  # a sum of squares: finite and not negative, or null
            return v is None or is_finite(v) and v >= 0

        out = {}
        for i, e in enumerate(data.get("events", [])):
            if e.get("kind") != "grad_state":
                continue
            bad = [k for k in ("step", "microbatch") if not (is_int(e.get(k)) and 0 <= e[k] < 2 ** 31)]
            bad += [k for k in ("unsharded_grads", "grad_shards", "grad_shards_unreadable", "dot_params")
                    if not (is_int(e.get(k)) and 0 <= e[k] < 2 ** 31)]
            bad += [k for k in ("unsharded_grad_sumsq", "grad_shard_sumsq") if k not in e or not sumsq(e[k])]
            bad += [k for k in ("dot_previous",) if k not in e or not num(e[k])]
            mods = e.get("by_module")
            if not (isinstance(mods, dict) and all(isinstance(v, list) and len(v) == 3 and sumsq(v[0]) and
                                                   sumsq(v[1]) and num(v[2]) for v in mods.values())):
                bad.append("by_module")
            if bad:
                raise CheckFailed("%s: event %d (grad_state): %s is %s" % (name, i, bad[0], short(e.get(bad[0]))))
            out[(e["step"], e["microbatch"])] = e
        return out

    def trace(self, rank):
        """The rank's slices (trace_rank<r>.json), each checked (trace_model.checked_slices)."""
        def load():
            name = (PARTIAL_FILE if self.partial else "trace_rank%d.json") % rank
            try:
                return checked_slices(self.partial_record(rank) if self.partial else read_json(self.path(name)),
                                      name)
            except TraceError as e:
                raise CheckFailed(str(e))
        return self._memo(("trace", rank), load)

    def notes(self, rank):
        """The hook_check entries of the rank's snapshot (what the runtime saw live after each hook)."""
        out = []
        for i, e in enumerate(self.memory(rank).get("events", [])):
            if e.get("kind") != "hook_check":
                continue
            bad = [k for k in ("module", "hook") if not isinstance(e.get(k), str)]
            bad += [k for k in ("step",) if not is_int(e.get(k))]
            bad += [k for k in ("unsharded_param_live_bytes", "unsharded_grad_live_bytes", "unsharded_param_bytes",
                                "unsharded_param_elems", "unsharded_f32_bytes")
                    if k in e and not (is_int(e[k]) and abs(e[k]) < 2 ** 53)]
            bad += [k for k in ("microbatch", "requires_gradient_sync", "reshard_after_backward")
                    if k in e and not (is_int(e[k]) and 0 <= e[k] < 2 ** 31)]
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

    def flat(self):
        """The stage lays its params out flat (rubric "flat": stage 13's PLACEMENT_FLAT units)."""
        return bool(self.rubric["stages"][self.stage].get("flat"))

    def units(self):
        """The FSDP units in forward order, [(label, [modules], unsharded bytes)]: on a flat stage each unit's
        modules share one flat buffer of W x S floats (label: its first module, which names its collectives; the
        units as rank 0's DTensor dump groups them by flat_unit, S its flat_shard_numel); else one unit per
        module, its bytes the module's params'."""
        def load():
            order, size = self.module_order()
            if not self.flat():
                return [(m, [m], size[m]) for m in order]
            first, S = {}, {}  # module -> its unit's first module index; flat_unit -> S
            for p in self.dtensors(0)["params"]:
                fu, s = p.get("flat_unit"), p.get("flat_shard_numel")
                if p["placement"] != "Flat" or not (is_int(fu) and is_int(s) and 0 <= fu < len(order) and s >= 0):
                    raise CheckFailed("dtensors_rank0.json: %s is not a Flat piece with a flat_unit and a "
                                      "flat_shard_numel (placement %s): the units cannot be read (DTensors says more)"
                                      % (p["name"], short(p["placement"])))
                if first.setdefault(p["module"], fu) != fu or S.setdefault(fu, s) != s:
                    raise CheckFailed("dtensors_rank0.json: %s's flat_unit or flat_shard_numel differs from its "
                                      "module's or unit's other params (DTensors says more)" % p["name"])
            units = []
            for m in order:
                if units and first[m] == first[units[-1][1][0]]:
                    units[-1][1].append(m)
                    continue
                if order[first[m]] != m or any(first[m] == first[u[1][0]] for u in units):
                    raise CheckFailed("dtensors_rank0.json: %s's flat_unit %d is not a run of consecutive modules "
                                      "that starts at it (DTensors says more)" % (m, first[m]))
                units.append((m, [m], 4 * self.world * S[first[m]]))
            return units
        return self._memo("units", load)

    def unit_of(self, module):
        """(label, [modules], bytes) of the unit holding module (Context.units)."""
        return next(u for u in self.units() if module in u[1])

    def collectives(self, kind):
        """[(rank, event)] for collectives named '<label>.<kind>', all ranks (those of a partial record)."""
        out = []
        for r in self.ranks():
            out += [(r, e) for e in self.trace(r) if e.get("cat") == COLLECTIVE and e["name"].endswith("." + kind)]
        return out

    def reference_dir(self, stage=None, sub=None):
        """logs/reference/stageNN, its variant's subfolder for a variant's context, or `sub` of it."""
        d = os.path.join(self.ref_root, "stage" + (stage or self.stage))
        sub = sub or (self.variant if stage in (None, self.stage) else None)
        return os.path.join(d, sub) if sub else d

    def reference_metrics(self, stage=None, sub=None, expect=None):
        """A reference log, after checking it was recorded with the configuration the rubric asks for."""
        d = self.reference_dir(stage, sub)
        rows = read_metrics(os.path.join(d, "metrics.jsonl"), "the reference log; instructors: make reference")
        run = read_json(os.path.join(d, "run.json"))
        mine = stage in (None, self.stage) and sub is None
        want = self.cfg if mine else stage_config(self.rubric, stage or self.stage)
        flags = expect if expect is not None else self.flags if mine else stage_only_flags(self.rubric, stage)
        batch = int(manifest.flag_value(flags, "--batch-size", want["batch_size"]))  # a pipeline stage sets its own
        pairs = [("flavor", want["flavor"]), ("world_size", want["world"]), ("seq_len", want["seq_len"]),
                 ("batch_size", batch), ("steps", want["steps"]), ("ac", manifest.ac_mode(flags)[0]),
                 ("ac_every", manifest.ac_mode(flags)[1]),
                 ("forward_only", "--forward-only" in flags),
                 ("reshard_after_forward", "--reshard-after-forward=false" not in flags),
                 ("param_dtype", mp_policy(flags)[0]), ("reduce_dtype", mp_policy(flags)[1])]
        pairs += [(key, want[key]) for key in ("max_norm", "n_kv_heads") if key in want]
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

    def saves(self):
        """The stage's main run has a twin with --save (rubric "save": Runner.run_saving), whose checkpoint the
        checks compare with the baseline's; the baseline then runs with --save too (one run serves both)."""
        return self.variant is None and manifest.Stage(self.stage, self.rubric["stages"][self.stage]).save

    def baseline_metrics(self):
        def load():
            run = self.baselines.get(baseline_flags(self.rubric, self.stage, self.variant), self.steps,
                                     save=self.saves())
            if not run.ok:
                raise CheckFailed("the non-sharded baseline run failed (%s): see %s"
                                  % (run.reason, relpath(os.path.join(run.dir, "log.txt"))))
            rows = read_metrics(os.path.join(run.dir, "metrics.jsonl"), "the baseline run")
            if len(rows) != self.steps:
                raise CheckFailed("the baseline run has %d steps, not %d" % (len(rows), self.steps))
            return rows
        return self._memo("baseline", load)

    def checkpoint(self):
        """(metadata, {name: Tensor}) of the checkpoint the main run's twin with --save wrote at its last step
        (Runner.run_saving: SAVED_DIR/CHECKPOINT in the run's dir)."""
        def load():
            if self.saved is not None and not self.saved.ok:
                log = relpath(os.path.join(self.saved.dir, "log.txt"))
                raise CheckFailed("the run with --save (the grading configuration once more, writing its checkpoint "
                                  "at step %d) failed: %s (log: %s)" % (self.steps, one_line(self.saved.reason), log))
            return read_checkpoint(self.path(os.path.join(SAVED_DIR, CHECKPOINT)),
                                   "the checkpoint --save writes at step %d" % self.steps)
        return self._memo("checkpoint", load)

    def baseline_checkpoint(self):
        """(metadata, {name: Tensor}) of the non-sharded baseline's checkpoint at the same step (its run with --save,
        Baselines.get)."""
        def load():
            run = self.baselines.get(baseline_flags(self.rubric, self.stage, self.variant), self.steps, save=True)
            if not run.ok:
                raise CheckFailed("the non-sharded baseline run with --save failed (%s): see %s"
                                  % (run.reason, relpath(os.path.join(run.dir, "log.txt"))))
            return read_checkpoint(os.path.join(run.dir, CHECKPOINT), "the baseline's checkpoint")
        return self._memo("baseline_checkpoint", load)

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
            elif e.get("action") in ("free", "free_completed") and addr in live:
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
