"""grader/rubric.json for grading: loading it (through grader/manifest.py, its one reader, with the measured
figures beside it), checking it, and the command lines it gives each stage.

The stage entries' structure (folder, title, flags, prefetch, the main job) is checked by
grader/manifest.py, which every tool shares; this module checks only what grading adds on
top: the configuration, the limits, the tolerances, the checks and their points (a check's label,
and whether a variant may run it, are declared with the check: checks/), the no-AC reference.
A rubric that fails either is a UsageError of one line (exit status 2), never a crash mid-grading.
"""
import math

import manifest

from manifest import stage_variants, variant_label  # noqa: F401  (the grader's modules import them from here)

from .checks import CHECKS, blocking_stage
from .util import UsageError, is_finite, is_int, one_line, relpath, short

RUBRIC_PATH = manifest.RUBRIC_PATH

CONFIG_KEYS = {"flavor": "name", "world": "world", "seq_len": "count", "batch_size": "count", "steps": "count",
               "profile_steps": "count0", "link_gbps": "number0", "link_latency_us": "number0", "max_norm": "number0",
               "n_kv_heads": "count"}
OPTIONAL_CONFIG = {"max_norm", "n_kv_heads"}  # absent: the binary's default (the flavour's n_kv_heads, max norm 1)
LIMIT_KEYS = {"build_timeout_s": 1e7, "run_timeout_s": 1e7, "run_cpu_s": 1e7, "run_address_space_gib": 1e6,
              "run_file_size_mib": 1e9}
TOLERANCE_KEYS = ["cuda_loss_rel", "cuda_grad_norm_rel", "peak_mem_band_rel", "overlap_share_min",
                  "prefetch_extra_unsharded_modules", "prefetch_max_modules_ahead",
                  "recompute_all_gathers_per_module_step", "activation_memory_max_ratio", "hook_memory_slack_rel",
                  "hook_memory_slack_min_bytes", "pp_bubble_slack", "checkpoint_rel", "cuda_checkpoint_rel"]

# Loss and grad norm parity: the tolerances come from the spread measured between correct implementations
# (tools/parity_spread.py, grader/figures/parity_spread.json), per stage, run and metric.
PARITY_METRICS = ("loss", "grad_norm")
SPREAD_FLOOR = 2.0 ** -23  # float32's resolution: a spread is never counted below it (another machine's BLAS)
MAIN_RUN = "main"  # parity_spread's name for a stage's run on the grading configuration
REMEASURE = "tools/parity_spread.py --write measures it"


def _dict(value):
    return value if isinstance(value, dict) else {}


def round_up_one_digit(x):
    """x > 0 rounded up to one significant digit: 1.2e-6 -> 2e-6, 3e-4 -> 3e-4, 9.6e-4 -> 1e-3. The 1e-9 slack
    keeps a value that is one digit times a power of ten in floating point (3e-5 / 1e-5 = 3.0000000000000004)
    from going up a digit."""
    exp = math.floor(math.log10(x))
    digit = math.ceil(x / 10.0 ** exp - 1e-9)
    if digit >= 10:
        digit, exp = 1, exp + 1
    return float("%de%d" % (digit, exp))


def tolerance_from_spread(spread, margin):
    """The tolerance a measured spread gives: the spread (never below SPREAD_FLOOR) times the margin, rounded up
    to one significant digit."""
    return round_up_one_digit(max(spread, SPREAD_FLOOR) * margin)


def run_checks(rubric, stage, variant=None):
    """The checks one run of a stage is graded on: the stage's on its main run; on a variant those of the stage's
    that the variant lists (grade.py runs a variant's check only beside the stage's)."""
    checks = list(rubric["stages"][stage]["checks"])
    return [k for k in checks if k in rubric["variants"][variant]["checks"]] if variant else checks


def parity_metrics(rubric, stage, variant=None):
    """The metrics whose tolerance the run's checks read: loss (loss parity), grad_norm (grad norm parity, and the
    clip coefficient: max_norm / the grad norm)."""
    checks = set(run_checks(rubric, stage, variant))
    return [m for m, keys in (("loss", {"loss"}), ("grad_norm", {"grad_norm", "clip"})) if checks & keys]


def parity_tolerances(rubric, stage, variant=None):
    """{metric: (tolerance against the reference log, tolerance against the non-sharded baseline)} of one run,
    from its measured spread (grader/figures/parity_spread.json: spread_ref, gap_base); a metric without figures is
    left out (load_rubric has refused a rubric that lacks one the run's checks need)."""
    block = _dict(rubric.get("parity_spread"))
    margin = block.get("margin")
    figures = _dict(_dict(_dict(block.get("runs")).get(stage)).get(variant or MAIN_RUN))
    out = {}
    for metric in PARITY_METRICS:
        f = _dict(figures.get(metric))
        if all(is_finite(f.get(k)) and f[k] >= 0 for k in ("spread_ref", "gap_base")) and is_finite(margin) and \
                margin > 0:
            out[metric] = (tolerance_from_spread(f["spread_ref"], margin), tolerance_from_spread(f["gap_base"], margin))
    return out


def load_rubric(path=RUBRIC_PATH, spread=True):
    """The rubric with its measured figures (manifest.load), checked. Read on every call, not through manifest.rubric()'s cache: the tests load many
    rubrics from one path. spread=False: without the measured spreads (tools/parity_spread.py and
    make_reference.py, which run before there is one to read)."""
    try:
        rubric = manifest.load(path)
    except manifest.ManifestError as e:
        raise UsageError(one_line(str(e)))
    validate_rubric(rubric, relpath(path), spread=spread)
    return rubric


def validate_rubric(rubric, name, spread=True):
    """UsageError naming the first entry of the rubric the grader cannot use (spread=False: the parity_spread
    block is not required)."""
    def bad(where, what, value):
        raise UsageError("%s: %s must be %s, got %s" % (name, where, what, short(value, 80)))

    def obj(where, value):
        if not isinstance(value, dict):
            bad(where, "a JSON object", value)
        return value

    def config_value(where, kind, v):
        if kind == "name" and not (isinstance(v, str) and v):
            bad(where, "a non-empty string", v)
        if kind == "world" and not (is_int(v) and 1 <= v <= 64):
            bad(where, "an integer in [1, 64]", v)
        if kind in ("count", "count0") and not (is_int(v) and (0 if kind == "count0" else 1) <= v <= 10 ** 9):
            bad(where, "an integer >= %d" % (0 if kind == "count0" else 1), v)
        if kind == "number0" and not (is_finite(v) and 0 <= v <= 1e12):
            bad(where, "a number >= 0", v)

    def str_list(where, value):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad(where, "a list of strings", value)

    for key in ("config", "limits", "tolerances", "baseline"):
        obj(key, rubric.get(key))
    if "check_names" in rubric:  # a rubric from before the checks carried their labels: say where they went
        raise UsageError("%s: check_names is no longer read: each check's label is declared with the check "
                         "(@check(key, label=...) in grader/gradelib/checks/); delete the entry" % name)
    for key, kind in CONFIG_KEYS.items():
        if key in OPTIONAL_CONFIG and key not in rubric["config"]:
            continue
        config_value("config." + key, kind, rubric["config"].get(key))
    for key, most in LIMIT_KEYS.items():
        v = rubric["limits"].get(key)
        if not (is_finite(v) and 0 < v <= most):
            bad("limits." + key, "a number in (0, %g]" % most, v)
    for where, tol in [("tolerances", rubric["tolerances"])] + [
            ("variants.%s.tolerances" % k, v.get("tolerances")) for k, v in _dict(rubric.get("variants")).items()
            if isinstance(v, dict) and isinstance(v.get("tolerances"), dict)]:
        for key in ("loss_rel", "grad_norm_rel"):
            if key in tol:  # a rubric from before the measured spreads: say where they went
                raise UsageError("%s: %s.%s is no longer read: the loss and grad-norm tolerances come from the "
                                 "spread measured per stage and run (parity_spread; %s), grade.py --cuda reads "
                                 "tolerances.cuda_%s; delete the entry" % (name, where, key, REMEASURE, key))
    for key in TOLERANCE_KEYS:
        v = rubric["tolerances"].get(key)
        if not (is_finite(v) and v >= 0):
            bad("tolerances." + key, "a number >= 0", v)
    str_list("baseline.keep_flags", rubric["baseline"].get("keep_flags"))
    try:
        manifest.validate_stages(rubric, name)
    except manifest.ManifestError as e:
        raise UsageError(one_line(str(e)))
    for stage, spec in rubric["stages"].items():
        where = "stages." + stage
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
        if "flat_checkpoint" in checks and spec.get("save") is not True:
            bad(where + ".save", "true (flat_checkpoint reads the checkpoint of the stage's run with --save)",
                spec.get("save"))
        if "activation_memory" in checks:
            ref = obj(where + ".no_ac_reference", spec.get("no_ac_reference"))
            if not (isinstance(ref.get("dir"), str) and ref["dir"]):
                bad(where + ".no_ac_reference.dir", "a non-empty string", ref.get("dir"))
            str_list(where + ".no_ac_reference.drop_flags", ref.get("drop_flags"))
            if not (isinstance(ref.get("solution"), str) and ref["solution"] in rubric["stages"]):
                bad(where + ".no_ac_reference.solution", "one of the stages (%s)" % ", ".join(sorted(rubric["stages"])),
                    ref.get("solution"))
    variants = obj("variants", rubric.get("variants", {}))
    for vname, v in variants.items():
        where = "variants." + vname
        if vname == "about":
            continue
        obj(where, v)
        if not (isinstance(v.get("label"), str) and v["label"]):
            bad(where + ".label", "a non-empty string", v.get("label"))
        for key in ("flat_label", "flat_why"):
            if key in v and not (isinstance(v[key], str) and v[key]):
                bad(where + "." + key, "a non-empty string", v[key])
        for key, value in obj(where + ".config", v.get("config", {})).items():
            if key not in CONFIG_KEYS:
                bad(where + ".config", "keys of config (%s)" % ", ".join(CONFIG_KEYS), key)
            config_value("%s.config.%s" % (where, key), CONFIG_KEYS[key], value)
        for key in ("add_flags", "drop_flags", "checks"):
            str_list("%s.%s" % (where, key), v.get(key, []))
        for key, value in obj(where + ".tolerances", v.get("tolerances", {})).items():
            if key not in TOLERANCE_KEYS:
                bad(where + ".tolerances", "keys of tolerances (%s)" % ", ".join(TOLERANCE_KEYS), key)
            if not (is_finite(value) and value >= 0):
                bad("%s.tolerances.%s" % (where, key), "a number >= 0", value)
        if not v.get("checks"):
            bad(where + ".checks", "a non-empty list of checks", v.get("checks"))
        for key in v["checks"]:
            if key not in CHECKS:
                bad(where + ".checks", "keys among %s" % ", ".join(CHECKS), key)
            if CHECKS[key].variants == "every":
                raise UsageError("%s: %s.checks: %s (%s) is graded on every variant of a stage that grades it, "
                                 "by itself: do not list it" % (name, where, key, CHECKS[key].label))
            if not CHECKS[key].variants:
                raise UsageError("%s: %s.checks: %s (%s) grades the main run only, a variant cannot run it; a "
                                 "variant may list %s" % (name, where, key, CHECKS[key].label, ", ".join(
                                     k for k, c in CHECKS.items() if c.variants is True)))
    for stage, spec in rubric["stages"].items():
        names = spec.get("variants", [])
        str_list("stages.%s.variants" % stage, names)
        for vname in names:
            if vname == "about" or vname not in variants:
                bad("stages.%s.variants" % stage, "names of variants (%s)" % ", ".join(
                    sorted(k for k in variants if k != "about")), vname)
    figures = obj("overlap_figures", rubric.get("overlap_figures", {}))
    for part in ("solutions", "variants", "mutants"):
        obj("overlap_figures." + part, figures.get(part, {}))
    if spread:
        validate_parity_spread(rubric, name)
    # after the loop: manifest.stages() reads every stage's config and checks
    graded = any("prefetch_bound" in spec["checks"] for spec in rubric["stages"].values())
    if graded and blocking_stage(rubric) is None:
        bad("stages", "an object with a stage that trains without prefetch (the prefetch bound compares with it)",
            sorted(rubric["stages"]))


def validate_parity_spread(rubric, name):
    """Every graded run (each stage's main run and its variants) has the measured figures of each metric its
    checks compare (parity_metrics): a UsageError of one line naming the first that has none."""
    def bad(where, what, value):
        raise UsageError("%s: %s must be %s, got %s" % (name, where, what, short(value, 80)))

    block = rubric.get("parity_spread")
    if not isinstance(block, dict):
        raise UsageError("%s: parity_spread is missing: the loss and grad-norm tolerances come from the spread "
                         "measured between correct implementations (%s)" % (name, REMEASURE))
    margin = block.get("margin")
    if not (is_finite(margin) and 1 <= margin <= 1e6):
        bad("parity_spread.margin", "a number in [1, 1e6]", margin)
    runs = block.get("runs")
    if not isinstance(runs, dict):
        bad("parity_spread.runs", "a JSON object", runs)
    for stage in rubric["stages"]:
        for variant in [None] + stage_variants(rubric, stage):
            where = "parity_spread.runs.%s.%s" % (stage, variant or MAIN_RUN)
            for metric in parity_metrics(rubric, stage, variant):
                f = _dict(_dict(runs.get(stage)).get(variant or MAIN_RUN)).get(metric)
                if f is None:
                    raise UsageError("%s: %s has no measured %s spread (stage %s%s is graded on %s; %s)" % (
                        name, where, metric, stage, ", variant " + variant if variant else "", metric, REMEASURE))
                for key in ("spread_ref", "gap_base"):
                    v = f.get(key) if isinstance(f, dict) else None
                    if not (is_finite(v) and 0 <= v < 1):
                        bad("%s.%s.%s" % (where, metric, key), "a number in [0, 1)", v)


def stage_config(rubric, stage, variant=None):
    """The common configuration with the stage's overrides (e.g. stage 05's seq_len), then the variant's."""
    cfg = dict(rubric["config"])
    cfg.update(rubric["stages"][stage].get("config", {}))
    if variant:
        cfg.update(rubric["variants"][variant].get("config", {}))
    return cfg


def tolerances(rubric, variant=None):
    """The tolerances, with a variant's own where it loosens one (its "why" says why). Loss and grad norm parity
    read parity_tolerances instead (cuda_*_rel: grade.py --cuda only)."""
    tol = dict(rubric["tolerances"])
    if variant:
        tol.update(rubric["variants"][variant].get("tolerances", {}))
    return tol


def config_flags(cfg):
    flags = ["--flavor", str(cfg["flavor"]), "--world", str(cfg["world"]), "--seq-len", str(cfg["seq_len"]),
             "--batch-size", str(cfg["batch_size"]), "--steps", str(cfg["steps"]),
             "--link-gbps", "%g" % cfg["link_gbps"], "--link-latency-us", "%g" % cfg["link_latency_us"],
             "--profile-steps", str(cfg["profile_steps"])]
    if "max_norm" in cfg:
        flags += ["--max-norm", "%g" % cfg["max_norm"]]
    if "n_kv_heads" in cfg:
        flags += ["--n-kv-heads", str(cfg["n_kv_heads"])]
    return flags


def stage_only_flags(rubric, stage, variant=None):
    """The stage's own flags (--ac, --forward-only, ...) with the variant's drops and additions."""
    return manifest.run_flags(rubric, stage, variant)


def stage_flags(rubric, stage, variant=None):
    return config_flags(stage_config(rubric, stage, variant)) + stage_only_flags(rubric, stage, variant)


def baseline_flags(rubric, stage, variant=None):
    """One rank with the global batch: the same sequences as the W ranks see together. A pipeline run (--pp P,
    stages 11 and 12) has S = W / P data shards of --batch-size sequences, split into --microbatches M: the
    baseline takes the S shards' batch as M accumulated microbatches (--grad-accum M, reduced once), the sum a
    pipeline stage accumulates, and the model's shape flags (--n-layers) the stage passes."""
    cfg = stage_config(rubric, stage, variant)
    own = stage_only_flags(rubric, stage, variant)
    keep = set(rubric["baseline"]["keep_flags"])
    pp = manifest.flag_value(own, "--pp")
    if pp is None:
        cfg["batch_size"] = cfg["batch_size"] * cfg["world"]
        cfg["world"] = 1
        return config_flags(cfg) + [f for f in own if f in keep]
    shards = cfg["world"] // int(pp)
    cfg["batch_size"] = int(manifest.flag_value(own, "--batch-size", cfg["batch_size"])) * shards
    cfg["world"] = 1
    model = [f for f in own if f.split("=", 1)[0] in ("--n-layers",)]
    accum = ["--grad-accum=%s" % manifest.flag_value(own, "--microbatches", pp), "--grad-sync=last"]
    return config_flags(cfg) + model + accum + [f for f in own if f in keep]


def parse_stage(rubric, text):
    """The stage's key ("03") for its number ("3", "03") or its folder (NN_name)."""
    try:
        return manifest.stage(text.strip(), rubric).id
    except KeyError:
        raise UsageError("unknown stage '%s' (stages: %s)" % (text, ", ".join(sorted(rubric["stages"]))))
