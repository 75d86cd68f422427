"""Checkpoints: a run stopped at step k and resumed from its --save checkpoint
continues bitwise identically to an uninterrupted run (stages 02 and 06 at
world 4, and the baseline), and a run killed while writing checkpoints always
leaves a valid one behind."""
import filecmp
import json
import os
import signal
import struct
import subprocess
import time

import pytest

from helpers import BASELINE, CORPUS, ROOT, metrics, run_train, solution_bin

FLAGS = ["--flavor", "tiny", "--seq-len", "32", "--batch-size", "2", "--world", "4", "--lr", "3e-3"]


def st_header(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("impl,extra", [("02", []), ("06", ["--reshard-after-forward=false"]), ("baseline", [])])
def test_resume_is_bitwise(tmp_path, impl, extra):
    binary = BASELINE if impl == "baseline" else solution_bin(impl)
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


def test_resume_without_optimizer_state_differs(tmp_path):
    """Test of the test: loading only the weights (as --save-init files hold) is NOT a resume."""
    full, first = tmp_path / "full", tmp_path / "first"
    run_train(solution_bin("02"), full, *(FLAGS + ["--steps", "6"]))
    run_train(solution_bin("02"), first, *(FLAGS + ["--steps", "3", "--save", first / "ck.safetensors"]))
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
    run_train(solution_bin("02"), second, *(FLAGS + ["--steps", "3", "--load", tmp_path / "w.safetensors"]))
    assert metrics(second)[0]["step"] == 1  # starts over: no step in a weights-only file
    assert [m["loss"] for m in metrics(second)] != [m["loss"] for m in metrics(full)][3:]


def test_killed_while_saving_leaves_a_valid_checkpoint(tmp_path):
    ck = tmp_path / "ck.safetensors"
    cmd = [BASELINE, "--flavor", "debugmodel", "--seq-len", "32", "--batch-size", "1", "--steps", "100000",
           "--save", str(ck), "--save-every", "1", "--quiet", "--profile-steps", "0", "--data", CORPUS]
    for delay in (1.5, 2.3, 3.1):
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert ck.exists(), "no checkpoint written in %.1f s" % delay
        out = tmp_path / ("resumed%.1f" % delay)
        step = int(st_header(ck)["__metadata__"]["step"])
        r = run_train(BASELINE, out, "--flavor", "debugmodel", "--seq-len", "32", "--batch-size", "1",
                      "--steps", str(step + 1), "--load", ck, "--profile-steps", "0")
        assert metrics(out)[0]["step"] == step + 1, r.stdout
