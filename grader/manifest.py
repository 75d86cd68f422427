#!/usr/bin/env python3
"""The stages, as grader/rubric.json lists them: the one place that does, and the one reader of that file
and of the measured figures beside it (grader/figures/*.json).

Every tool reads the stages through this module (Python) or through the Makefile
include it writes:

    from manifest import stages, stage         # grader/ on sys.path (tools: import repo_paths first)
    for s in stages(): s.id, s.dir, s.flags, s.forward_only, ...

    grader/manifest.py mk              the Makefile include (the Makefile writes it to build/stages.mk)
    grader/manifest.py list            one line per stage: "NN dir flag flag ..." (for shell scripts)

Adding a stage is one entry in rubric.json plus solutions/NN_name/hw_fsdp.c.

rubric.json is written by hand. What tools measure lives beside it in grader/figures/, one file per
block, each written whole by its tool (FIGURES: the overlap figures, the parity spreads); load() gives
the rubric with those blocks in it, as the grader reads it, and write_figures() is how a tool stores one.
Standard library only.
"""
import hashlib
import json
import os
import re
import sys

from trace_names import ALL_GATHER, REDUCE_SCATTER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUBRIC_PATH = os.path.join(ROOT, "grader", "rubric.json")

# The measured blocks of the rubric: block name -> (its file beside rubric.json, the command that writes it whole,
# when to run that command). Never in rubric.json itself (load_json refuses them there).
FIGURES = {
    "overlap_figures": ("figures/overlap.json", "tools/overlap_figures.py --write",
                        "after a change to the runtime's cost model, the device profile, a solution or the variants "
                        "(then make reference)"),
    "parity_spread": ("figures/parity_spread.json", "tools/parity_spread.py --write",
                      "after any change to the solutions, the runtime, tests/mutants/equivalents.json or the stages "
                      "and variants (after make reference)"),
}
GENERATED_KEY = "generated"  # each figure file's header: what wrote it and how to write it again
PREFETCH_KINDS = ("forward", "backward")
STREAM_KINDS = (ALL_GATHER, REDUCE_SCATTER)  # the collectives a stage runs on a stream of their own


class ManifestError(ValueError):
    """The rubric cannot be used: one line that names the entry."""


class Stage:
    """One entry of rubric.json's "stages", with what the tools derive from it."""

    def __init__(self, sid, spec):
        self.id = sid                         # "03"
        self.number = int(sid)
        self.dir = spec["dir"]                # "03_forward_overlap"
        self.title = spec.get("title", "")
        self.goal = spec.get("goal", "")
        self.fill = spec.get("fill", "")
        self.graded_on = spec.get("graded_on", "")
        self.question = spec.get("question", "")  # asked in the stage's README, answered there, read by instructors
        self.flags = list(spec.get("flags", []))
        self.honours = list(spec.get("honours", []))  # the flags (rubric.json "flags") its hooks follow
        self.prefetch = list(spec.get("prefetch", []))
        self.streams = list(spec.get("streams", []))  # all_gather / reduce_scatter: on their own stream
        self.config = dict(spec.get("config", {}))
        self.checks = dict(spec.get("checks", {}))
        self.builds_on = spec.get("builds_on")  # "06": the stage whose file `make carry` brings here (None: the first)
        self.spec = spec

    # what the flags make the training loop do
    @property
    def forward_only(self):
        return "--forward-only" in self.flags

    @property
    def ac(self):
        """Some activation checkpointing (--ac, --ac-every N or --ac-op): ac_mode(self.flags) says which."""
        return ac_mode(self.flags)[0] != "none"

    @property
    def zero2(self):
        return "--reshard-after-forward=false" in self.flags

    @property
    def pipeline(self):
        """P of the stage's --pp (stages 11 and 12: pipeline parallelism), 0 without one."""
        return int(flag_value(self.flags, "--pp", "0"))

    def flags_at(self, world):
        """The stage's flags for a run at `world` ranks: a 2-D --mesh=RxS keeps its shard size S where S divides
        the world (R' = world / S), else becomes 1xworld; a --pp=P keeps P stages where P divides the world, else
        takes the largest divisor of the world below P: the same stage runs at any world (tests, sanitizers,
        bench); every other flag is kept."""
        out = []
        for f in self.flags:
            if f.startswith("--mesh="):
                s = int(f[len("--mesh="):].replace(",", "x").split("x")[1])
                f = "--mesh=%dx%d" % ((world // s, s) if world % s == 0 else (1, world))
            elif f.startswith("--pp="):
                p = int(f[len("--pp="):])
                f = "--pp=%d" % max(d for d in range(1, min(p, world) + 1) if world % d == 0)
            out.append(f)
        return out

    def shards_at(self, world):
        """How many ranks a param is split over at `world` ranks: S of the stage's --mesh there, world / P with
        --pp, else the world."""
        for f in self.flags_at(world):
            if f.startswith("--mesh="):
                return int(f[len("--mesh="):].split("x")[1])
            if f.startswith("--pp="):
                return world // int(f[len("--pp="):])
        return world

    @property
    def backward_prefetch(self):
        """--backward-prefetch's policy (stage 10): pre (the default), post or none."""
        return next((f.split("=", 1)[1] for f in self.flags if f.startswith("--backward-prefetch=")), "pre")

    @property
    def flat(self):
        """The stage lays its params out flat (rubric "flat": PLACEMENT_FLAT, stage 13, FSDP1's FlatParameter)."""
        return bool(self.spec.get("flat"))

    @property
    def save(self):
        """The grader also runs the stage's main configuration with --save and compares the checkpoint it writes at
        the last step with the non-sharded baseline's (rubric "save": stage 13's flat_checkpoint)."""
        return bool(self.spec.get("save"))

    @property
    def offload(self):
        return "--offload-params" in self.flags

    def solution_src(self, root=ROOT):
        return os.path.join(root, "solutions", self.dir, "hw_fsdp.c")

    def starter_src(self, root=ROOT):
        return os.path.join(root, "stages", self.dir, "hw_fsdp.c")

    def started(self, root=ROOT):
        """(started, why): has the student begun this stage in root/stages/? A carried stage (make carry left
        hw_fsdp.starter.c beside it) has; otherwise hw_fsdp.c is compared with the sha256 of the starter as it
        was shipped (STARTER_RECORD, written by tools/make_starters.py), whatever that starter holds. With no
        record to compare with the stage counts as started (it is graded)."""
        d = os.path.join(root, "stages", self.dir)
        src = os.path.join(d, "hw_fsdp.c")
        if not os.path.isfile(src):
            return False, "no stages/%s/hw_fsdp.c" % self.dir
        if os.path.exists(os.path.join(d, "hw_fsdp.starter.c")):
            return True, "carried"
        shipped = read_starter_record(os.path.join(d, STARTER_RECORD))
        if shipped is None:
            return True, "no record of its starter to compare with"
        with open(src, "rb") as fh:
            same = hashlib.sha256(fh.read()).hexdigest() == shipped
        return (False, "unchanged from its starter") if same else (True, "changed")

    def __repr__(self):
        return "Stage(%s)" % self.dir


def by_reason(pairs):
    """[(ids, why)] from [(stage id, why)]: the stages that share a reason, in first-seen order, the reason said
    of several ("unchanged from their starters") where it names one ("unchanged from its starter")."""
    groups = {}
    for sid, why in pairs:
        groups.setdefault(why, []).append(sid)
    return [(ids, why.replace("its starter", "their starters") if len(ids) > 1 else why) for why, ids in groups.items()]


# Beside each starter, the sha256 of hw_fsdp.c as tools/make_starters.py wrote it (sha256sum's format), so that a
# student tree, which has no solutions/ to regenerate it from, can tell an untouched starter (Stage.started).
STARTER_RECORD = ".starter.sha256"


def starter_record(text):
    """The STARTER_RECORD file's content for a starter whose hw_fsdp.c is `text`."""
    return "%s  hw_fsdp.c\n" % hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_starter_record(path):
    """The hex digest a STARTER_RECORD file holds, or None (missing or unreadable)."""
    try:
        with open(path, encoding="utf-8") as fh:
            m = re.match(r"([0-9a-f]{64}) ", fh.read())
    except (OSError, UnicodeDecodeError):
        return None
    return m.group(1) if m else None


# The contract field each flag sets (common/hw_fsdp.h: FsdpConfig, or the Module field the loop sets): a stage
# whose solution reads the field honours the flag (tests/test_manifest.py; --ac has no field: from stage 05 on
# the hooks keep a training state for the recompute).
# In a pipeline stage (--pp) the schedule sets requires_gradient_sync and reshard_after_backward and the runtime
# the shard group (hw_pipe.h), so there those fields honour no flag, and --pp-schedule's field is
# PipeInfo.schedule.
PIPELINE_FLAG_FIELDS = {"--grad-sync": None, "--reshard-after-backward": None, "--mesh": None,
                        "--pp-schedule": "schedule"}

FLAG_FIELDS = {
    "--reshard-after-forward": "reshard_after_forward",
    "--grad-sync": "requires_gradient_sync",
    "--reshard-after-backward": "reshard_after_backward",
    "--param-dtype": "param_dtype",
    "--reduce-dtype": "reduce_dtype",
    "--mesh": "shard_group",
    "--backward-prefetch": "backward_prefetch",
    "--single-comm-stream": "single_comm_stream",
    "--offload-params": "offload_params",
    "--pp-schedule": "schedule",
    "--bucket-mb": "bucket_bytes",
}


def flag_fields(stage):
    """FLAG_FIELDS as they apply to a stage: a pipeline stage's loop sets the fields --grad-sync and --mesh set
    elsewhere, so reading them honours no flag there."""
    out = dict(FLAG_FIELDS)
    if stage.pipeline:
        for flag, field in PIPELINE_FLAG_FIELDS.items():
            if field is None:
                out.pop(flag, None)
            else:
                out[flag] = field
    else:
        out.pop("--pp-schedule", None)
    return out


def flag_value(flags, name, default=None):
    """The value of --name=V or --name V in a command line (the last one wins, as in the runtime's option
    parser), else default."""
    value = default
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def flag_groups(flags):
    """[(name, [tokens])]: a command line cut before each --flag, each group the flag and the values after it (the
    runtime's option parser: a token that does not start with -- is the value of the flag before it)."""
    out = []
    for f in flags:
        if f.startswith("--") or not out:
            out.append((f.split("=", 1)[0], [f]))
        else:
            out[-1][1].append(f)
    return out


def override_flags(base, over):
    """(base without every flag that `over` sets, [(name, the dropped tokens)]): base + over then names each flag
    once, with over's value (the runtime would take the last of two silently)."""
    names = {name for name, _ in flag_groups(over)}
    kept, dropped = [], []
    for name, tokens in flag_groups(base):
        if name in names:
            dropped.append((name, tokens))
        else:
            kept += tokens
    return kept, dropped


AC_FLAGS = ("--ac", "--ac-every", "--ac-op")  # the runtime's activation-checkpointing modes (options.c)


def ac_mode(flags):
    """(mode, every) of the activation checkpointing a command line asks for, as run.json's "ac" and "ac_every"
    state it: ("full", 0) for --ac, ("every", N) for --ac-every N, ("op", 0) for --ac-op, ("none", 0). Which blocks
    then recompute is the runtime's rule (model.h ac_block_recomputes), stated in run.json's recompute_blocks."""
    every = flag_value(flags, "--ac-every")
    if every is not None:
        return "every", int(every)
    if "--ac-op" in flags:
        return "op", 0
    return ("full" if "--ac" in flags else "none"), 0


def run_flags(rubric, stage, variant=None):
    """The stage's own flags (--ac, --forward-only, ...) on one graded run: with the variant's drops and
    additions (None: the grading configuration)."""
    flags = list(rubric["stages"][stage].get("flags", []))
    if variant:
        v = rubric["variants"][variant]
        drop = set(v.get("drop_flags", []))
        flags = [f for f in flags if f not in drop] + [f for f in v.get("add_flags", []) if f not in flags]
    return flags


def run_settings(rubric, stage, variant=None):
    """The settings (rubric.json "flags") one graded run of the stage sets: a setting "--name=value" when the
    run passes it (or passes no --name and value is the flag's default), "--name" when it passes --name or
    any --name=value."""
    flags = run_flags(rubric, stage, variant)
    names = {f.split("=", 1)[0] for f in flags}
    out = set()
    for name, spec in rubric.get("flags", {}).items():
        if name == "about":
            continue
        for setting in spec["settings"]:
            if "=" not in setting:
                if any(f == setting or f.startswith(setting + "=") for f in flags):
                    out.add(setting)
            elif setting in flags or (name not in names and setting == "%s=%s" % (name, spec.get("default"))):
                out.add(setting)
    return out


def interacting_pairs(rubric, stage):
    """[(a, b, hooks)]: the pairs of settings of two different flags the stage honours that change a common
    hook (rubric.json "flags"), hooks the ones they share."""
    spec = rubric.get("flags", {})
    honoured = rubric["stages"][stage].get("honours", [])
    out = []
    for i, x in enumerate(honoured):
        for y in honoured[i + 1:]:
            common = sorted(set(spec[x]["changes"]) & set(spec[y]["changes"]))
            if common:
                out += [(a, b, common) for a in spec[x]["settings"] for b in spec[y]["settings"]]
    return out


def flag_coverage(rubric):
    """What the graded runs leave out, one sentence each (empty: every setting a stage honours is graded, and
    every interacting pair of them is set together by some graded run)."""
    problems = []
    spec = rubric.get("flags", {})
    flag_of = {x: n for n, f in spec.items() if n != "about" for x in f["settings"]}

    def exercised(settings, s, beside=()):
        """`s` is set by a run with `settings` and no other of them (but those in `beside`) masks it."""
        masks = set(spec[flag_of[s]].get("masked_by", [])) - set(beside)
        return s in settings and not masks & settings

    for sid in sorted(rubric["stages"]):
        runs = [None] + list(rubric["stages"][sid].get("variants", []))
        sets = {v: run_settings(rubric, sid, v) for v in runs}
        for name in rubric["stages"][sid].get("honours", []):
            for setting in spec[name]["settings"]:
                if not any(exercised(s, setting) for s in sets.values()):
                    problems.append("stage %s honours %s but no graded run sets %s" % (sid, name, setting))
        for a, b, hooks in interacting_pairs(rubric, sid):
            if not any(exercised(s, a, [b]) and exercised(s, b, [a]) for s in sets.values()):
                problems.append("stage %s: no graded run sets both %s and %s (both change %s)"
                                % (sid, a, b, ", ".join(hooks)))
    return problems


def _short(value, limit=80):
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_json(path=RUBRIC_PATH):
    """rubric.json as a dict; ManifestError (one line) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError) as e:
        raise ManifestError("cannot read the rubric %s: %s" % (path, " ".join(str(e).split())[:300]))
    if not isinstance(data, dict):
        raise ManifestError("%s: the rubric must be a JSON object, got %s" % (path, _short(data)))
    for name, (rel_path, tool, _) in FIGURES.items():
        if name in data:  # a rubric from before the figures had their own files: say where they went
            raise ManifestError("%s: %s is measured, not written by hand: it lives in grader/%s, which %s writes; "
                                "delete the entry" % (path, name, rel_path, tool))
    return data


def spec_sha256(path=RUBRIC_PATH):
    """The sha256 of rubric.json's bytes (what a reference tree records it was made under)."""
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def figures_path(name, rubric_path=RUBRIC_PATH):
    """The file of the measured block `name` (FIGURES) that goes with the rubric at rubric_path (beside it)."""
    return os.path.join(os.path.dirname(os.path.abspath(rubric_path)), FIGURES[name][0])


def figure_paths(rubric_path=RUBRIC_PATH):
    """Every figure file of the rubric at rubric_path (whether it exists or not)."""
    return [figures_path(name, rubric_path) for name in FIGURES]


def load_figures(name, rubric_path=RUBRIC_PATH):
    """The measured block `name` as its file holds it, without its header key; None when there is no file."""
    path = figures_path(name, rubric_path)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError) as e:
        raise ManifestError("cannot read the measured figures %s: %s" % (path, " ".join(str(e).split())[:300]))
    if not isinstance(data, dict):
        raise ManifestError("%s: the figures must be a JSON object, got %s" % (path, _short(data)))
    data.pop(GENERATED_KEY, None)
    return data


def load(path=RUBRIC_PATH):
    """The rubric as the grader reads it: rubric.json with each measured block (FIGURES) from its file beside it
    (a block whose file is missing is left out); ManifestError (one line) when a file cannot be read."""
    data = load_json(path)
    for name in FIGURES:
        block = load_figures(name, path)
        if block is not None:
            data[name] = block
    return data


def _flat_json(value):
    """A dict whose values are all numbers, strings or lists of them: one line."""
    def leaf(v):
        return not isinstance(v, (dict, list)) or (isinstance(v, list) and all(not isinstance(x, (dict, list))
                                                                              for x in v))
    return isinstance(value, dict) and all(leaf(v) for v in value.values())


def _json_text(value, indent=0):
    """JSON with one line per innermost record (a run's figures), as a reviewer diffs it."""
    if not isinstance(value, dict) or not value or _flat_json(value):
        return json.dumps(value, ensure_ascii=False)
    pad = " " * (indent + 2)
    items = ["%s%s: %s" % (pad, json.dumps(k), _json_text(v, indent + 2)) for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def figures_text(name, block):
    """The whole file of the measured block `name`: its header (GENERATED_KEY) first, then the block."""
    rel_path, tool, when = FIGURES[name]
    header = ("Written whole by %s: do not edit. Regenerate it with that command %s. The grader reads it with "
              "grader/rubric.json (grader/manifest.py load)." % (tool, when))
    return _json_text(dict([(GENERATED_KEY, header)] + [(k, v) for k, v in block.items() if k != GENERATED_KEY])) + "\n"


def write_figures(name, block, rubric_path=RUBRIC_PATH):
    """Store the measured block `name` in its own file (figures_path), written whole; the path written."""
    path = figures_path(name, rubric_path)
    text = figures_text(name, block)
    back = json.loads(text)
    back.pop(GENERATED_KEY)
    if back != {k: v for k, v in block.items() if k != GENERATED_KEY}:
        raise ManifestError("%s: the figures did not read back as written (not writing)" % path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)
    return path


def save(data, path):
    """Write a rubric as load() returns it: the hand-written part to `path`, each measured block it holds to its
    file beside it (and a block it lacks removed there), so that load(path) gives `data` back. For tests and tools
    that make a rubric of their own (a release, an edited copy)."""
    spec = {k: v for k, v in data.items() if k not in FIGURES}
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(spec, indent=2, ensure_ascii=False) + "\n")
    for name in FIGURES:
        if name in data:
            write_figures(name, data[name], path)
        elif os.path.exists(figures_path(name, path)):
            os.unlink(figures_path(name, path))


def validate_stages(rubric, name="rubric.json"):
    """ManifestError naming the first stage entry the tools cannot use."""
    def bad(where, what, value):
        raise ManifestError("%s: %s must be %s, got %s" % (name, where, what, _short(value)))

    def str_list(where, value):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad(where, "a list of strings", value)

    stages_ = rubric.get("stages")
    if not isinstance(stages_, dict) or not stages_:
        bad("stages", "a non-empty JSON object", stages_)
    for sid, spec in stages_.items():
        where = "stages." + sid
        if not re.fullmatch(r"[0-9]{2}", sid):
            bad(where, "named by its two-digit number (e.g. \"03\")", sid)
        if not isinstance(spec, dict):
            bad(where, "a JSON object", spec)
        d = spec.get("dir")
        if not (isinstance(d, str) and re.fullmatch(re.escape(sid) + r"_[a-z0-9_]+", d)):
            bad(where + ".dir", "\"%s_<name>\" (lower case, digits, _; so no two stages share one)" % sid, d)
        for key in ("title", "goal", "fill", "graded_on", "question"):
            if not isinstance(spec.get(key, ""), str):
                bad("%s.%s" % (where, key), "a string", spec.get(key))
        if not isinstance(spec.get("bonus", False), bool):
            bad(where + ".bonus", "true or false", spec.get("bonus"))
        if not isinstance(spec.get("save", False), bool):
            bad(where + ".save", "true or false", spec.get("save"))
        if "builds_on" in spec:
            b = spec["builds_on"]
            if not (isinstance(b, str) and b in stages_ and b < sid):
                bad(where + ".builds_on", "an earlier stage of this rubric (the one whose file `make carry` brings "
                    "into stage %s)" % sid, b)
        elif sid != min(stages_):
            bad(where + ".builds_on", "the earlier stage this one builds on (every stage but the first names one)",
                None)
        str_list(where + ".flags", spec.get("flags", []))
        for f in spec.get("flags", []):
            if not re.fullmatch(r"--[a-z0-9-]+(=[A-Za-z0-9._-]+)?", f):
                bad(where + ".flags", "flags of the form --name or --name=value", f)
        str_list(where + ".streams", spec.get("streams", []))
        for k in spec.get("streams", []):
            if k not in STREAM_KINDS:
                bad(where + ".streams", "a list of %s" % " / ".join(STREAM_KINDS), k)
        str_list(where + ".prefetch", spec.get("prefetch", []))
        for p in spec.get("prefetch", []):
            if p not in PREFETCH_KINDS:
                bad(where + ".prefetch", "a list of %s" % " / ".join(PREFETCH_KINDS), p)
    flags = rubric.get("flags", {})
    if not isinstance(flags, dict):
        bad("flags", "a JSON object", flags)
    for name, f in flags.items():
        if name == "about":
            continue
        where = "flags." + name
        if not re.fullmatch(r"--[a-z0-9-]+", name):
            bad(where, "named by the flag (--name)", name)
        if not isinstance(f, dict):
            bad(where, "a JSON object", f)
        str_list(where + ".settings", f.get("settings"))
        str_list(where + ".changes", f.get("changes"))
        str_list(where + ".masked_by", f.get("masked_by", []))
        if not f["settings"] or not f["changes"]:
            bad(where, "an object with settings and changes, both non-empty", f)
        for setting in f["settings"]:
            if setting != name and not setting.startswith(name + "="):
                bad(where + ".settings", "%s or %s=value" % (name, name), setting)
    for sid, spec in stages_.items():
        str_list("stages.%s.honours" % sid, spec.get("honours", []))
        for name in spec.get("honours", []):
            if name not in flags or name == "about":
                bad("stages.%s.honours" % sid, "flags listed in rubric.json \"flags\" (%s)"
                    % ", ".join(k for k in flags if k != "about"), name)
    job = rubric.get("main_job", {"stage": sorted(stages_)[-1]})
    if not (isinstance(job, dict) and isinstance(job.get("stage"), str) and job["stage"] in stages_):
        bad("main_job.stage", "one of the stages (%s)" % ", ".join(sorted(stages_)), job)


_cache = {}


def rubric(path=RUBRIC_PATH):
    """The rubric with its measured figures (load; validated for its stages), read once per process and path."""
    if path not in _cache:
        data = load(path)
        validate_stages(data, os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)
        _cache[path] = data
    return _cache[path]


def stages(data=None):
    """Every stage, in number order."""
    data = rubric() if data is None else data
    return [Stage(sid, data["stages"][sid]) for sid in sorted(data["stages"])]


def flag_stage(flag, data=None):
    """The stage that teaches a flag: the first, in number order, whose hooks honour it (stages.NN.honours) or
    whose graded run sets it (stages.NN.flags); None for a flag no stage teaches. The runtime's messages name
    flags and features, never stage numbers: the grader adds the stage from here."""
    def name(f):
        return f.split("=", 1)[0]
    for s in stages(data):
        if flag in s.honours or flag in map(name, s.flags):
            return s
    return None


def stage(key, data=None):
    """A stage by number ("03", "3", 3) or by folder ("03_forward_overlap"); KeyError if none."""
    text = str(key)
    if text.isdigit():
        text = "%02d" % int(text)
    for s in stages(data):
        if text in (s.id, s.dir):
            return s
    raise KeyError(key)


def stage_variants(data, stage):
    """The variants a stage is graded on besides its main configuration, in rubric order."""
    return list(data["stages"][stage].get("variants", []))


def variant_label(data, variant, stage=None):
    """How the grader names a run: the variant's label, or the grading configuration (None). A flat stage's run
    (stage 13) reads the variant's flat_label where it has one: the same world means other things there."""
    if not variant:
        return "the grading configuration"
    v = data["variants"][variant]
    flat = stage is not None and bool(data["stages"][stage].get("flat"))
    return v.get("flat_label", v["label"]) if flat else v["label"]


def main_job_stage(data=None):
    data = rubric() if data is None else data
    return stage(data.get("main_job", {}).get("stage", sorted(data["stages"])[-1]), data)


def makefile(data=None):
    """The Makefile include: the stages' folders and flags as make variables."""
    all_ = stages(data)
    lines = ["# Generated from grader/rubric.json by grader/manifest.py: do not edit.",
             "STAGE_IDS := " + " ".join(s.id for s in all_),
             "STAGE_DIRS := " + " ".join(s.dir for s in all_),
             "# stages that train (a backward and an optimizer step): make longrun",
             "TRAINING_STAGE_DIRS := " + " ".join(s.dir for s in all_ if not s.forward_only),
             "MAIN_JOB_DIR := " + main_job_stage(data).dir]
    for s in all_:
        lines.append("STAGE_FLAGS_%s := %s" % (s.dir, " ".join(s.flags)))
        lines.append("STAGE_FLAGS_W3_%s := %s" % (s.dir, " ".join(s.flags_at(3))))  # the asan runs' world
    return "\n".join(lines) + "\n"


def main(argv):
    try:
        if argv[:1] == ["mk"] and len(argv) == 1:
            sys.stdout.write(makefile())
        elif argv[:1] == ["list"] and len(argv) == 1:
            for s in stages():
                print(" ".join([s.id, s.dir] + s.flags))
        else:
            sys.stderr.write("usage: grader/manifest.py mk | list\n")
            return 2
    except ManifestError as e:
        sys.stderr.write("manifest.py: error: %s\n" % e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
