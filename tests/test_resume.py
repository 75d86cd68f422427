"""Checkpoints: a run stopped at step k and resumed from its --save checkpoint
continues bitwise identically to an uninterrupted run (stages 02 and 06 at
world 4, each flat stage, and the baseline), a flat stage's checkpoint is its
base stage's (each loads the other's and resumes bitwise), and a run killed
while writing checkpoints always leaves a valid one behind."""
import filecmp
import json
import os
import signal
import struct
import subprocess
import time

import pytest

from helpers import BASELINE, CORPUS, ROOT, STAGES, metrics, run_train, solution_bin

def built_solution(stage):
    """The stage's solution binary, or None in a student tree (no solutions/, or a release without the stage)."""
    try:
        binary = solution_bin(stage)
    except KeyError:
        return None
    return binary if os.path.exists(binary) else None


# a sharded training binary when the solutions are here, else the baseline (the same driver and checkpoints)
SHARDED = built_solution("02") or BASELINE

FLAGS = ["--flavor", "tiny", "--seq-len", "32", "--batch-size", "2", "--world", "4", "--lr", "3e-3"]


def st_header(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


# the stages that lay their params out flat (manifest Stage.flat: FSDP1's FlatParameter), with their own flags
FLAT_PARAMS = [s for s in STAGES if s.flat]
RESUMED = [("02", []), ("06", ["--reshard-after-forward=false"]), ("baseline", [])] + \
    [(s.id, s.flags) for s in FLAT_PARAMS]


@pytest.mark.parametrize("impl,extra", RESUMED)
def test_resume_is_bitwise(tmp_path, impl, extra):
    binary = BASELINE if impl == "baseline" else built_solution(impl)
    if binary is None:  # the student tree has no solutions/: the baseline case still runs
        pytest.skip("stage %s's solution is the instructors' (not in a student tree)" % impl)
    full, first, second = tmp_path / "full", tmp_path / "first", tmp_path / "second"
    run_train(binary, full, *(FLAGS + extra + ["--steps", "8", "--save", full / "ck.safetensors"]))
    run_train(binary, first, *(FLAGS + extra + ["--steps", "5", "--save", first / "ck.safetensors"]))
    header = st_header(first / "ck.safetensors")
    assert header["__metadata__"]["step"] == "5"
    assert "optim.layers.0.attention.wq.weight.exp_avg_sq" in header
    run_train(binary, second, *(FLAGS + extra + ["--steps", "8", "--load", first / "ck.safetensors",
                                                 "--save", second / "ck.safetensors"]))
    want = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(full)][5:]
    got = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(second)]
    assert got == want
    assert filecmp.cmp(full / "ck.safetensors", second / "ck.safetensors", shallow=False)


@pytest.mark.parametrize("stage", FLAT_PARAMS, ids=[s.id for s in FLAT_PARAMS])
def test_flat_checkpoint_is_the_base_stages(tmp_path, stage):
    """--save turns a flat stage's shards (a rank's piece of each param, cut out of its unit's flat shard, and
    the AdamW state beside it) back into the base stage's per-param checkpoint: the same names, shapes, layout
    and bytes, and each stage loads the other's and continues bitwise as the loader's own uninterrupted run.
    --max-norm 100 keeps clipping off: the two stages sum the grad norm in different orders (a few ulps apart,
    tests/test_solutions.py test_flat_params_agree_with_their_base), which a clip coefficient below 1 would
    carry into the weights; without it the weights are the same bits."""
    base = stage.builds_on
    flat_bin, base_bin = built_solution(stage.id), built_solution(base)
    if flat_bin is None or base_bin is None:
        pytest.skip("stages %s and %s's solutions are the instructors' (not in a student tree)" % (stage.id, base))
    flags = FLAGS + stage.flags + ["--max-norm", "100"]
    runs = {}
    for name, binary in (("flat", flat_bin), ("base", base_bin)):
        for steps in (5, 8):
            out = tmp_path / ("%s%d" % (name, steps))
            run_train(binary, out, *(flags + ["--steps", str(steps), "--save", out / "ck.safetensors"]))
            runs[name, steps] = out
    for steps in (5, 8):
        assert filecmp.cmp(runs["flat", steps] / "ck.safetensors", runs["base", steps] / "ck.safetensors",
                           shallow=False), "step %d: stage %s's checkpoint differs from stage %s's" % (steps, stage.id, base)
    for loader, binary, writer in (("base", base_bin, "flat"), ("flat", flat_bin, "base")):
        out = tmp_path / ("%s_from_%s" % (loader, writer))
        run_train(binary, out, *(flags + ["--steps", "8", "--load", runs[writer, 5] / "ck.safetensors",
                                          "--save", out / "ck.safetensors"]))
        want = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(runs[loader, 8])][5:]
        assert [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(out)] == want, (loader, writer)
        assert filecmp.cmp(out / "ck.safetensors", runs[loader, 8] / "ck.safetensors", shallow=False), (loader, writer)


def test_resume_without_optimizer_state_differs(tmp_path):
    """Test of the test: loading only the weights (as --save-init files hold) is NOT a resume."""
    full, first = tmp_path / "full", tmp_path / "first"
    run_train(SHARDED, full, *(FLAGS + ["--steps", "6"]))
    run_train(SHARDED, first, *(FLAGS + ["--steps", "3", "--save", first / "ck.safetensors"]))
    raw = open(first / "ck.safetensors", "rb").read()
    header = st_header(first / "ck.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    weights = {k: v for k, v in header.items() if not k.startswith("optim.") and k != "__metadata__"}
    blobs, off, new = [], 0, {}
    for k, v in weights.items():
        b = raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
        new[k] = {"dtype": "F32", "shape": v["shape"], "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(new).encode()
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    second = tmp_path / "second"
    run_train(SHARDED, second, *(FLAGS + ["--steps", "3", "--load", tmp_path / "w.safetensors"]))
    assert metrics(second)[0]["step"] == 1  # starts over: no step in a weights-only file
    assert [m["loss"] for m in metrics(second)] != [m["loss"] for m in metrics(full)][3:]


def wait_for(what, cond, proc, deadline_s=300):
    """Poll cond() until it holds; the deadline only turns a run that never gets there into a failure."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert proc.poll() is None, "the run exited (%s) before %s" % (proc.returncode, what)
        assert time.monotonic() < end, "no %s within %d s" % (what, deadline_s)
        time.sleep(0.0005)


def test_killed_while_saving_leaves_a_valid_checkpoint(tmp_path):
    """SIGKILL at three points of the save cycle, each waited for on the file system (no delays):
    during the first save (its temporary file exists, the checkpoint not yet), right after a save
    landed, and during a later save (a checkpoint and a newer temporary file both exist). Whatever
    is at the checkpoint's path afterwards loads and resumes at the step after the one it holds."""
    ck = tmp_path / "ck.safetensors"
    cmd = [BASELINE, "--flavor", "debugmodel", "--seq-len", "32", "--batch-size", "1", "--steps", "100000",
           "--save", str(ck), "--save-every", "1", "--quiet", "--profile-steps", "0", "--data", CORPUS]

    def saving():
        return any(f.name.startswith(ck.name + ".tmp.") for f in tmp_path.iterdir())

    def after_a_save():
        return ck.exists()

    def saving_again():
        return ck.exists() and saving()

    for when, cond in (("first save", saving), ("a landed save", after_a_save), ("a later save", saving_again)):
        for f in tmp_path.iterdir():
            if f.name.startswith(ck.name):
                f.unlink()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(when, cond, p)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        if not ck.exists():
            assert when == "first save", "killed during %s: the previous checkpoint is gone" % when
            continue  # killed before the first rename: nothing at the path, which is valid too
        step = int(st_header(ck)["__metadata__"]["step"])
        out = tmp_path / ("resumed_" + when.replace(" ", "_"))
        r = run_train(BASELINE, out, "--flavor", "debugmodel", "--seq-len", "32", "--batch-size", "1",
                      "--steps", str(step + 1), "--load", ck, "--profile-steps", "0")
        assert metrics(out)[0]["step"] == step + 1, r.stdout
