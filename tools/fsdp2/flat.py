"""A flat stage (rubric "flat": stage 13, FSDP1-style FlatParameter units) against FSDP1
(tools/fsdp1_torch.py), or against FSDP2 when the torch has no FSDP1 (runner.choose_references).

Against FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, use_orig_params=False):
- loss and grad norm every step (compare.compare_steps, TOLERANCES["13"]); FSDP1's own float32 total
  norm (clip_grad_norm_) against the float64 one (dtensor_norm_rel, as FSDP2's DTensor norm);
- the units: per rank, the C run's dtensors_rank<r>.json flat_units against FSDP1's FlatParameters,
  unit by unit: the module, the parameters (as a set: the orders differ, see below), the flat size
  (unpadded) and S, the shard size (FSDP1 pads only the end, to W x S: S = ceil(flat size / W) on both
  sides when the solution pads nothing else);
- the flat shards BY NAME: FSDP1 lays a unit's parameters out in registration order (wq, wk, wv, wo,
  w1, w2, w3, attention_norm, ffn_norm), the C runtime in its module order (attention_norm first), so
  rank r's S elements hold other parameters on the two sides. unflatten reads each FSDP1 shard through
  flat_param._fqns and _shard_param_infos as (parameter, first element, 1-D piece); the pieces must
  tile every parameter exactly once over the ranks (coverage_failures), the elements no parameter
  covers must be zero, FSDP1's initial pieces must be the initial weights' elements (bitwise), and
  after training the pieces (and AdamW's exp_avg / exp_avg_sq) are compared with the C run's --save,
  the full tensors by torchtitan name, element range by element range (compare.compare_values on 1-D
  views). The C run's own pieces are held to the initial weights by its dtensors dump
  (local_matches_init, padding_is_zero, per unit padding_is_zero);
- the collectives per rank, step, microbatch, unit and phase, with their bytes, as stages 01-12's
  (an all-gather's output and a reduce-scatter's input are W x S floats on both sides).
What FSDP1 cannot run (fsdp1_gaps): --bucket-mb units of several modules (FSDP1 wraps a module; no
module holds exactly a bucket's consecutive modules), and --reshard-after-backward that differs from
FSDP1's rule after a backward without sync (FULL_SHARD frees, SHARD_GRAD_OP keeps). Such a run is
compared on the same numbers with FSDP1 on one unit per module and the nearest strategy: loss, grad
norm and the trained values by name (the arithmetic does not depend on the units or on when params
are freed); the units (buckets only) and the collectives are not, each with its why_not.

Against FSDP2 (the fallback): loss, grad norm, FSDP2's DTensor norm and the trained values by name
(FSDP2's Shard(0) rows of the C run's --save tensors, compare.compare_values as for stages 01-12);
not compared: the layouts (Flat against Shard(0)) and the collectives' bytes (W x S against the sum
of padded rows); the collective counts per module and phase only where every unit is one module.
"""
import json
import os

from gradelib.trace_model import RunDir, runtime_groups

from .compare import (compare_collectives, compare_norm_definition, compare_sizes, compare_steps, compare_values,
                      counts_and_sizes)
from .read import c_collectives, read_jsonl, read_safetensors, torch_collectives, without_single_rank_groups
from .runner import Failure

STATE = ("exp_avg", "exp_avg_sq")


def fsdp1_gaps(job):
    """What FSDP1 cannot reproduce of this flat run: {"units": why or None, "collectives": why or None}."""
    gaps = {"units": None, "collectives": None}
    bucket = next((u for u in job.get("flat_units") or [] if len(u) > 1), None)
    if bucket:
        gaps["units"] = ("--bucket-mb: the C run's unit %s holds %d modules the model calls one after another; "
                         "FSDP1 wraps one module per unit, and no module holds exactly them, so FSDP1 ran one unit "
                         "per module" % ("+".join(bucket), len(bucket)))
        gaps["collectives"] = gaps["units"]
        return gaps
    if job["grad_accum"] > 1:
        fsdp1_frees = job["grad_sync_every"] or job["reshard_after_forward"]
        if job["reshard_after_backward"] != fsdp1_frees:
            gaps["collectives"] = (
                "--reshard-after-backward=%s: FSDP1 has no such switch; after microbatches 0..K-2's backward it "
                "frees the unsharded flat parameter when it syncs or under FULL_SHARD and keeps it under "
                "SHARD_GRAD_OP without sync (_should_free_in_backward), which here (%s, --grad-sync %s) %s it"
                % ("true" if job["reshard_after_backward"] else "false",
                   "FULL_SHARD" if job["reshard_after_forward"] else "SHARD_GRAD_OP",
                   "every" if job["grad_sync_every"] else "last", "frees" if fsdp1_frees else "keeps"))
    return gaps


def unflatten(shard, unit):
    """One rank's flat shard of an FSDP1 unit by parameter: ({fqn: (first element, 1-D piece)}, the elements no
    parameter covers). unit: tools/fsdp1_torch.py's record (fqns, numels, shard_param_infos [in_shard,
    offset_in_shard, numel_in_shard, intra_param_start_idx, intra_param_end_idx (inclusive)])."""
    import numpy as np
    shard = np.asarray(shard).reshape(-1)
    covered = np.zeros(shard.shape[0], dtype=bool)
    pieces = {}
    if not (len(unit["fqns"]) == len(unit["numels"]) == len(unit["shard_param_infos"])):
        raise Failure("unit %s: %d fqns, %d numels, %d shard infos" % (unit["module"], len(unit["fqns"]),
                                                                      len(unit["numels"]),
                                                                      len(unit["shard_param_infos"])))
    for fqn, numel, (in_shard, off, n, start, end) in zip(unit["fqns"], unit["numels"], unit["shard_param_infos"]):
        if not in_shard:
            continue
        if n != end - start + 1 or start < 0 or end >= numel or off < 0 or off + n > shard.shape[0]:
            raise Failure("unit %s: %s's shard info (offset %s, numel %s, elements %s..%s of %d) does not fit a "
                          "shard of %d" % (unit["module"], fqn, off, n, start, end, numel, shard.shape[0]))
        if covered[off:off + n].any():
            raise Failure("unit %s: %s overlaps another parameter in the shard" % (unit["module"], fqn))
        covered[off:off + n] = True
        pieces[fqn] = (start, shard[off:off + n])
    return pieces, shard[~covered]


def coverage_failures(units_per_rank):
    """The pieces of every parameter over the ranks (shard_param_infos) must tile its elements exactly once."""
    spans = {}
    numels = {}
    for units in units_per_rank:
        for u in units:
            for fqn, numel, (in_shard, _, n, start, _) in zip(u["fqns"], u["numels"], u["shard_param_infos"]):
                numels[fqn] = numel
                if in_shard:
                    spans.setdefault(fqn, []).append((start, start + n))
    fails = []
    for fqn, numel in numels.items():
        at = 0
        for a, b in sorted(spans.get(fqn, [])):
            if a != at:
                fails.append("%s: elements %d..%d %s over the ranks' FSDP1 shards"
                             % (fqn, min(a, at), max(a, at) - 1, "held twice" if a < at else "in no shard"))
                break
            at = b
        else:
            if at != numel:
                fails.append("%s: elements %d..%d in no FSDP1 shard" % (fqn, at, numel - 1))
    return fails


def flat_pieces(units, tensors, prefix):
    """One rank's FSDP1 shards by name, as compare.compare_values reads a rank: ({name or optim.<name>.<state>:
    1-D piece}, [{"name", "row_offset", "local_rows"}]: the piece's first element and length in the flattened
    parameter), and the uncovered elements of each unit's shard ({module: array}). prefix: "flat." (after
    training, with AdamW's state when the file holds it) or "init."."""
    shards, layout, padding = {}, [], {}
    for u in units:
        key = prefix + u["module"]
        if key not in tensors:
            raise Failure("FSDP1's shards hold no %s" % key)
        pieces, padding[u["module"]] = unflatten(tensors[key], u)
        for fqn, (start, piece) in pieces.items():
            shards[fqn] = piece
            layout.append({"name": fqn, "row_offset": start, "local_rows": piece.shape[0]})
        for state in STATE:
            if "%s.%s" % (key, state) in tensors:
                for fqn, (_, piece) in unflatten(tensors["%s.%s" % (key, state)], u)[0].items():
                    shards["optim.%s.%s" % (fqn, state)] = piece
    return shards, layout, padding


def flattened(arrays):
    """{name: 1-D view} of a checkpoint's full tensors (compare_values reads a piece as rows of a 1-D array)."""
    return {k: v.reshape(-1) for k, v in arrays.items()}


def compare_flat_init(init, shards, layout, padding, rank):
    """FSDP1's shards right after wrapping: the initial weights' elements, bitwise, and zero where no parameter is."""
    import numpy as np
    fails = []
    flat = flattened(init)
    for p in layout:
        want = flat[p["name"]][p["row_offset"]:p["row_offset"] + p["local_rows"]]
        got = np.ascontiguousarray(shards[p["name"]])
        if not np.array_equal(got.view(np.uint32), np.ascontiguousarray(want).view(np.uint32)):
            fails.append("rank %d: FSDP1's initial piece of %s (elements %d..%d) is not the initial weights'"
                         % (rank, p["name"], p["row_offset"], p["row_offset"] + p["local_rows"] - 1))
    for module, pad in padding.items():
        if pad.size and np.any(pad != 0):
            fails.append("rank %d: FSDP1's %s shard has nonzero padding" % (rank, module))
    return fails


def c_flat_dump_failures(top, rank):
    """The C run's dtensors_rank<r>.json on a flat stage: every param Flat, its piece the initial weights', every
    unit's shard views in one allocation with zero padding."""
    fails = []
    for p in top["params"]:
        if p.get("placement") != "Flat":
            fails.append("rank %d: %s's placement is %s in the C run, not Flat" % (rank, p["name"], p.get("placement")))
        elif p.get("local_matches_init") is not True or p.get("padding_is_zero") is not True:
            fails.append("rank %d: %s: the C run's piece is not the initial weights' with zero padding"
                         % (rank, p["name"]))
    for u in top.get("flat_units") or []:
        for f in ("views_in_shard", "shard_in_allocation", "padding_is_zero"):
            if u.get(f) is not True:
                fails.append("rank %d: unit %s: %s is %s in the C run" % (rank, u.get("module"), f, u.get(f)))
    if not top.get("flat_units"):
        fails.append("rank %d: the C run's dtensors dump has no flat_units" % rank)
    return fails


def compare_units(c_top, t_units, rank):
    """Unit by unit: the module, the set of parameters, the flat size and S; the differences."""
    diffs = []
    c_units = c_top.get("flat_units") or []
    c_names = {}
    for p in c_top["params"]:
        c_names.setdefault(p.get("flat_unit"), set()).add(p["name"])
    cm, tm = [u["module"] for u in c_units], [u["module"] for u in t_units]
    if cm != tm:
        return ["rank %d: the units are %s in the C run, %s in FSDP1's" % (rank, " ".join(cm), " ".join(tm))]
    for c, t in zip(c_units, t_units):
        names = c_names.get(c["flat_unit"], set())
        if names != set(t["fqns"]):
            diffs.append("rank %d: unit %s holds %s in the C run, %s in FSDP1's"
                         % (rank, c["module"], ", ".join(sorted(names)), ", ".join(sorted(t["fqns"]))))
        for what in ("flat_numel", "shard_numel"):
            if c.get(what) != t[what]:
                diffs.append("rank %d: unit %s: %s %s in the C run, %s in FSDP1's"
                             % (rank, c["module"], {"flat_numel": "flat size", "shard_numel": "S"}[what],
                                c.get(what), t[what]))
        if t["padded_numel"] != t["world"] * t["shard_numel"] or t["shard_numel"] != -(-t["flat_numel"] // t["world"]):
            diffs.append("rank %d: unit %s: FSDP1's flat size %d padded to %d, S %d: not ceil(size / W) at W = %d"
                         % (rank, c["module"], t["flat_numel"], t["padded_numel"], t["shard_numel"], t["world"]))
    return diffs


def unit_orders(c_top, t_units):
    """{module: {"c": [names in the C layout's order], "fsdp1": [FSDP1's _fqns]}} of one rank (the record)."""
    c = {}
    for p in sorted(c_top["params"], key=lambda p: (p.get("flat_unit", -1), p.get("flat_offset", 0))):
        c.setdefault(p.get("flat_unit"), []).append(p["name"])
    by_index = {u["flat_unit"]: u["module"] for u in c_top.get("flat_units") or []}
    out = {by_index.get(k, str(k)): {"c": v} for k, v in c.items()}
    for u in t_units:
        out.setdefault(u["module"], {})["fsdp1"] = list(u["fqns"])
    return out


def compare_flat_collectives(rec, cdir, job, ranks, profiled, modules, sizes):
    """The collectives as compare_run compares stage 01-12's (sizes: with their bytes); the differences."""
    groups = runtime_groups(RunDir(cdir).run_json)
    c_counts, c_single = without_single_rank_groups(c_collectives(cdir, job["world"], modules), groups)
    t_counts, t_single = without_single_rank_groups(torch_collectives(ranks, profiled, groups), groups)
    (c_counts, c_sizes), (t_counts, t_sizes) = counts_and_sizes(c_counts), counts_and_sizes(t_counts)
    equal, diffs, summary = compare_collectives(c_counts, t_counts)
    size_diffs = compare_sizes(c_sizes, t_sizes) if sizes else []
    diffs += size_diffs
    rec["collectives"] = {"identical": equal and not size_diffs, "steps_compared": profiled,
                          "bytes_compared": sizes, "differences": diffs[:20], "step1_rank0": summary,
                          "reference_reduce_ops": ranks[0].get("reduce_ops", {}),
                          "left_out_single_rank_groups": {"c": c_single, "reference": t_single}}
    return diffs


def compare_flat_run(rec, run, cdir, init, final, job, ranks, tol):
    """A flat stage's comparisons into rec (the module doc); the failures."""
    fsdp1 = job.get("reference") == "fsdp1"
    rec["reference"] = "FSDP1" if fsdp1 else "FSDP2"
    if fsdp1:  # FSDP1's default reduction (DefaultState): pre- and post-divide around a SUM, no ReduceOp.AVG
        sch = ranks[0].get("schedule") or {}
        rec["reduction"] = "SUM, the flat gradient divided by %s before and the shard by %s after (FSDP1's default)" % (
            sch.get("gradient_predivide_factor"), sch.get("gradient_postdivide_factor"))
    fails = []
    rows, max_l, max_g, f = compare_steps(read_jsonl(os.path.join(cdir, "metrics.jsonl")), ranks[0]["steps"], tol)
    rec.update({"per_step": rows, "max_loss_rel": max_l, "max_grad_norm_rel": max_g})
    fails += f
    rec["max_dtensor_norm_rel"], f = compare_norm_definition(
        ranks[0]["steps"], tol["dtensor_norm_rel"], key="grad_norm_torch" if fsdp1 else "grad_norm_dtensor")
    fails += f
    tops = []
    for r in range(job["world"]):
        with open(os.path.join(cdir, "dtensors_rank%d.json" % r)) as fh:
            tops.append(json.load(fh))
    c_dump = [d for r, top in enumerate(tops) for d in c_flat_dump_failures(top, r)]
    fails += c_dump[:5]
    shards = [read_safetensors(os.path.join(job["out"], "shards_rank%d.safetensors" % r)) for r in range(job["world"])]
    c_final = read_safetensors(final)
    gaps = fsdp1_gaps(job) if fsdp1 else {
        "units": "FSDP2 shards each parameter on dim 0 (Shard(0)): no flat units to compare",
        "collectives": None}
    if fsdp1:
        t_units = [rk["units"] for rk in ranks]
        unit_diffs = coverage_failures(t_units)
        init_arrays = read_safetensors(init)
        pieces, layouts = [], []
        for r in range(job["world"]):
            s, lay, pad = flat_pieces(t_units[r], shards[r], "init.")
            unit_diffs += compare_flat_init(init_arrays, s, lay, pad, r)
            s, lay, _ = flat_pieces(t_units[r], shards[r], "flat.")
            pieces.append(s)
            layouts.append(lay)
            if not gaps["units"]:
                unit_diffs += compare_units(tops[r], t_units[r], r)
        values, f = compare_values(flattened(c_final), pieces, layouts, job["lr"], tol["values_lr"], exact=False)
        rec["dtensors"] = {"flat": True, "layout_identical": None if gaps["units"] else not unit_diffs,
                           "why_not": gaps["units"], "layout_differences": unit_diffs[:20], "values": values,
                           "c_dump_differences": c_dump[:20],
                           "compared": "per unit: the parameters, the flat size and S (FSDP1's FlatParameter); "
                                       "the shards by name (flat_param._fqns, _shard_param_infos)",
                           "units_rank0": [{k: u[k] for k in ("module", "flat_numel", "shard_numel", "padded_numel")}
                                           for u in t_units[0]],
                           "orders_rank0": unit_orders(tops[0], t_units[0])}
        fails += unit_diffs[:5] + f
    else:
        values, f = compare_values(c_final, shards, [rk["dtensors"] for rk in ranks], job["lr"], tol["values_lr"],
                                   exact=False)
        rec["dtensors"] = {"flat": True, "layout_identical": None, "why_not": gaps["units"],
                           "layout_differences": [], "values": values, "c_dump_differences": c_dump[:20]}
        fails += f
    with open(os.path.join(cdir, "run.json")) as fh:
        profiled = min(json.load(fh)["profile_steps"], job["steps"])
    modules = {p["module"] for p in tops[0]["params"]}
    bucketed = any(len(u) > 1 for u in job.get("flat_units") or [])
    if fsdp1 and gaps["collectives"]:
        rec["collectives"] = {"identical": None, "why_not": gaps["collectives"]}
    elif not fsdp1 and bucketed:
        rec["collectives"] = {"identical": None, "why_not": "--bucket-mb units of several modules: FSDP2 has one "
                                                            "per module"}
    else:
        fails += compare_flat_collectives(rec, cdir, job, ranks, profiled, modules, sizes=fsdp1)[:5]
        if not fsdp1:
            rec["collectives"]["why_bytes_not"] = ("FSDP2 moves each parameter's padded rows, a flat unit W x S "
                                                   "elements: the counts per module and phase are compared")
        if profiled < job["steps"]:
            fails.append("only %d of %d steps profiled in the C run: collectives of the rest not compared"
                         % (profiled, job["steps"]))
    rec["backward_issue_points"] = {"policy": None, "identical": None,
                                    "why_not": "compared under --backward-prefetch pre and none only (stage 10)"}
    rec["fsdp2_schedule"] = ranks[0].get("schedule")
    return fails
