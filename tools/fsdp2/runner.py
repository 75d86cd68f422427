"""The runs of make fsdp2-check (tools/fsdp2_check.py): the torch venv (found or installed), the plan of
runs (each stage's grading configuration and variants, the debugmodel), the C run (--save-init, then the
graded run from those weights) and the FSDP2 run (tools/fsdp2_torch.py under the venv's python, one
process per rank), and what a --pp run's job needs (the runtime's pipeline split).
"""
import json
import os
import shutil
import socket
import subprocess
import sys

from repo_paths import ROOT  # first: it puts grader/ on sys.path
import manifest
from gradelib.rubric import stage_flags, stage_variants
from gradelib.trace_model import stage_modules


TOOL = os.path.join(ROOT, "tools", "fsdp2_check.py")  # the command line: what a run under the venv's python runs
BUILD = os.path.join(ROOT, os.environ.get("HWFSDP_BUILD", "build"))


MIN_TORCH = (2, 6)


READY = ".fsdp2-ready"  # written into the venv once torch imports with fully_shard


PIP_PACKAGES = ["torch", "numpy", "safetensors"]


# The debugmodel (torchtitan's flavour) for 10 steps, besides the grading configurations.
DEBUGMODEL = {"name": "debugmodel", "stage": "04",
              "flags": ["--flavor", "debugmodel", "--world", "4", "--seq-len", "128", "--batch-size", "2",
                        "--steps", "10", "--warmup-steps", "2", "--lr", "8e-4", "--max-norm", "1.0",
                        "--profile-steps", "10"]}


C_TIMEOUT_S = 900


TORCH_TIMEOUT_S = 900


class Failure(Exception):
    """A run could not be compared: one line."""


def usage_error(msg):
    sys.stderr.write("fsdp2-check: error: %s\n" % msg)
    sys.exit(2)


def torch_version(python):
    """torch's version tuple in `python` if it has torch.distributed.fsdp.fully_shard, else None."""
    code = ("import torch, torch.distributed.fsdp as f; f.fully_shard; "
            "print(torch.__version__.split('+')[0])")
    try:
        p = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        return tuple(int(x) for x in p.stdout.decode().strip().split(".")[:2])
    except ValueError:
        return None


def suitable(python):
    v = torch_version(python)
    return v is not None and v >= MIN_TORCH


def shown(path):
    """A path as the user reads it: relative to the checkout when inside it."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def install_venv(venv):
    """python -m venv + pip install torch; READY marks a venv whose torch has fully_shard."""
    print("fsdp2-check: warning: installing torch from the Python package index into %s: it pulls the CUDA "
          "wheels (~5 GB, a few minutes); once" % shown(venv), flush=True)
    if not os.path.exists(venv_python(venv)):
        if subprocess.run([sys.executable, "-m", "venv", venv]).returncode != 0:
            usage_error("python -m venv %s failed (Debian: apt-get install python3-venv)" % venv)
    if subprocess.run([venv_python(venv), "-m", "pip", "install", "--quiet"] + PIP_PACKAGES).returncode != 0:
        usage_error("pip install %s into %s failed (output above)" % (" ".join(PIP_PACKAGES), venv))
    if not suitable(venv_python(venv)):
        usage_error("%s has no torch >= %d.%d with torch.distributed.fsdp.fully_shard after pip install"
                    % (venv, MIN_TORCH[0], MIN_TORCH[1]))
    open(os.path.join(venv, READY), "w").close()


def ensure_torch(args, argv):
    """Return when this interpreter can run FSDP2; else re-run the tool under the venv's python."""
    venv = os.path.abspath(args.venv)
    if args.install_only:
        if not os.path.exists(os.path.join(venv, READY)):
            install_venv(venv)
        print("fsdp2-check: %s is ready" % shown(venv))
        sys.exit(0)
    if suitable(sys.executable):
        return
    if not os.path.exists(os.path.join(venv, READY)):
        if args.no_install:
            usage_error("no torch >= %d.%d with fully_shard in %s and no venv at %s (--no-install): run make "
                        "fsdp2-check, or this tool without --no-install" % (MIN_TORCH + (sys.executable, shown(venv))))
        install_venv(venv)
    python = venv_python(venv)
    os.execv(python, [python, TOOL] + argv)


class Run:
    """One comparison: a stage's binary on one command line, and FSDP2 on the same configuration.
    The binary is the stage's solution; in a student tree (no solutions/) the student's stage."""

    def __init__(self, name, stage, variant, stage_dir, flags, flat=False):
        self.name, self.stage, self.variant, self.flags = name, stage, variant, flags
        self.flat = flat            # a flat stage (rubric "flat": 13): compared with FSDP1 (choose_references)
        self.reference = "fsdp2"    # the torch side: fsdp2 (tools/fsdp2_torch.py) or fsdp1 (tools/fsdp1_torch.py)
        tree = "solutions" if os.path.exists(os.path.join(ROOT, "solutions", stage_dir, "hw_fsdp.c")) else "stages"
        self.binary = os.path.join(BUILD, tree, stage_dir, "train")
        self.solution = "%s/%s/hw_fsdp.c" % (tree, stage_dir)


def plan(rubric, stages, main_only, debugmodel):
    runs = []
    for stage in stages:
        sdir = rubric["stages"][stage]["dir"]
        flat = bool(rubric["stages"][stage].get("flat"))
        runs.append(Run("stage" + stage, stage, None, sdir, stage_flags(rubric, stage), flat))
        for v in ([] if main_only else stage_variants(rubric, stage)):
            runs.append(Run("stage%s-%s" % (stage, v), stage, v, sdir, stage_flags(rubric, stage, v), flat))
    if debugmodel:
        s = DEBUGMODEL["stage"]
        runs.append(Run(DEBUGMODEL["name"], s, None, rubric["stages"][s]["dir"],
                        list(DEBUGMODEL["flags"]) + list(rubric["stages"][s].get("flags", []))))
    return runs


def fsdp1_available():
    """Whether this interpreter's torch ships FSDP1 (FullyShardedDataParallel): detected, not assumed."""
    try:
        import fsdp1_torch  # torch: only in the venv's python
    except ImportError:
        return False
    return fsdp1_torch.has_fsdp1()


def choose_references(runs, detect=None):
    """Set each flat run's reference: FSDP1 when the torch has it, else FSDP2 (stage 07's per-parameter
    sharding) on the same configuration; the line that says so (None when nothing falls back or no run is flat).
    detect: the FSDP1 detection (fsdp1_available; a test fakes it)."""
    flat = [r for r in runs if r.flat]
    if not flat:
        return None
    has = (detect or fsdp1_available)()
    for r in flat:
        r.reference = "fsdp1" if has else "fsdp2"
    if has:
        return None
    return ("fsdp2-check: this torch has no torch.distributed.fsdp.FullyShardedDataParallel (FSDP1): stage%s %s "
            "compared with FSDP2's per-parameter sharding (stage 07's reference) instead"
            % ("s" if len({r.stage for r in flat}) > 1 else "", " ".join(sorted({r.stage for r in flat}))))


def run_c(run, work):
    """--save-init, then the run from those weights; (run dir, init file, final checkpoint or None, the run's
    command). A pipeline run (--pp): the initial weights from the command line without the pipeline's flags at
    --world 1 (without_pipeline_flags), then the pipeline run from its own init, no checkpoint."""
    init = os.path.join(work, "init.safetensors")
    final = os.path.join(work, "c_final.safetensors")
    cdir = os.path.join(work, "c")
    if pipeline_of(run.flags):
        final = None
        steps = [[run.binary] + without_pipeline_flags(run.flags) + ["--save-init", init],
                 [run.binary] + run.flags + ["--out", cdir, "--quiet"]]
    else:
        steps = [[run.binary] + run.flags + ["--save-init", init],
                 [run.binary] + run.flags + ["--load", init, "--save", final, "--out", cdir, "--quiet"]]
    with open(os.path.join(work, "c_log.txt"), "w") as log:
        for cmd in steps:
            log.write("$ %s\n" % " ".join(cmd))
            log.flush()
            try:
                p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=C_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise Failure("%s timed out after %d s" % (run.solution, C_TIMEOUT_S))
            if p.returncode != 0:
                raise Failure("%s exited with %d (see %s)" % (run.solution, p.returncode, shown(log.name)))
    return cdir, init, final, steps[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_job(run, cdir, init, out, args):
    """What FSDP2 trains: the C run's configuration (its run.json) and the stage's flags."""
    with open(os.path.join(cdir, "run.json")) as fh:
        r = json.load(fh)
    param_dtype = manifest.flag_value(run.flags, "--param-dtype")
    reduce_dtype = manifest.flag_value(run.flags, "--reduce-dtype") or ("fp32" if param_dtype else None)
    for what, v in (("--param-dtype", param_dtype), ("--reduce-dtype", reduce_dtype)):
        if v not in (None, "fp32", "bf16"):
            raise Failure("%s %s: only fp32 and bf16 map to a MixedPrecisionPolicy" % (what, v))
    return {"model": {k: r[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                                        "hidden_dim")},
            "init": init, "data": os.path.join(ROOT, r["data"]), "world": r["world_size"],
            "batch_size": r["batch_size"], "seq_len": r["seq_len"], "steps": r["steps"], "lr": r["lr"],
            "warmup_steps": r["warmup_steps"], "weight_decay": r["weight_decay"], "max_norm": r["max_norm"],
            "forward_only": r["forward_only"], "ac": r["ac"], "recompute_blocks": r.get("recompute_blocks"),
            "reshard_after_forward": r["reshard_after_forward"],
            "grad_accum": r.get("grad_accum", 1), "grad_sync_every": r.get("grad_sync", "every") == "every",
            "reshard_after_backward": r.get("reshard_after_backward", True),
            "param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
            "mesh": r.get("mesh"), "backward_prefetch": r.get("backward_prefetch", "pre"),
            "offload": bool(r.get("offload_params", False)), "force_sum_reduction": args.force_sum_reduction, "threads": 1, "port": free_port(),
            "timeout_s": TORCH_TIMEOUT_S, "out": out, "pipeline": pipeline_job(r),
            "reference": run.reference, "flat_units": r.get("flat_units")}


def run_torch(job):
    if job.get("reference") == "fsdp1":
        import fsdp1_torch as side  # torch: only in the venv's python
    else:
        import fsdp2_torch as side
    shutil.rmtree(job["out"], ignore_errors=True)
    try:
        side.run(job)
    except Exception as e:  # a rank's traceback is in the exception's text: keep its last line
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        raise Failure("the %s run failed: %s" % ("FSDP1" if job.get("reference") == "fsdp1" else "FSDP2",
                                                 lines[-1] if lines else type(e).__name__))
    out = []
    for r in range(job["world"]):
        with open(os.path.join(job["out"], "rank%d.json" % r)) as fh:
            out.append(json.load(fh))
    return out


PIPELINE_FLAGS = ("--pp", "--microbatches", "--pp-schedule")


def pipeline_of(flags):
    """{"pp": P, "microbatches": M, "schedule": gpipe | 1f1b} of a command line with --pp P >= 1 (the runtime's
    defaults: M = P, 1f1b), else None."""
    try:
        P = int(manifest.flag_value(flags, "--pp", "0") or 0)
    except ValueError:
        return None
    if P < 1:
        return None
    return {"pp": P, "microbatches": int(manifest.flag_value(flags, "--microbatches", str(P))),
            "schedule": manifest.flag_value(flags, "--pp-schedule", "1f1b")}


def without_pipeline_flags(flags):
    """The command line without --pp, --microbatches, --pp-schedule (--name V or --name=V), at --world 1 (the
    runtime's parser: the last --world wins): the run that writes a pipeline run's initial weights."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in PIPELINE_FLAGS:
            skip = True
        elif not any(f.startswith(name + "=") for name in PIPELINE_FLAGS):
            out.append(f)
    return out + ["--world", "1"]


def pipeline_job(r):
    """The job's "pipeline" of a C run's run.json: None without --pp; the blocks of each stage from the stage map
    the runtime states (trace_model.stage_modules), not split again here."""
    P = r.get("pp") or 0
    if P < 1:
        return None
    if r["world_size"] % P or r["batch_size"] % r["microbatches"]:
        raise Failure("--pp %d at world %d with batch %d in %d microbatches: not a split the runtime makes"
                      % (P, r["world_size"], r["batch_size"], r["microbatches"]))
    stages = stage_modules(r)
    if not stages or len(stages) != P:
        raise Failure("the C run's run.json states no stage map of %d stages (\"pipeline\"): a run that stopped "
                      "before its end?" % P)
    # the blocks each stage holds, as the runtime split them (hw_pipe.h; run.json "pipeline"): block<i> is layer i
    return {"pp": P, "microbatches": r["microbatches"], "schedule": r["pp_schedule"],
            "blocks": [[int(m[len("block"):]) for m in mods if m.startswith("block")] for mods in stages]}
