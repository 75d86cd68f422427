"""--param-dtype bf16 stores the activations in bfloat16: every tensor the model saves for backward, the tensors
that pass between modules and the gradients of activations take 2 bytes an element; what stays float32 is the short
list that common/model/kernels.h names (per-row rstd and lse, the attention scratch, the logits the loss reads and
their gradient, the loss, the RoPE tables). Checked on the memory snapshot, by pairing each allocation of a float32
run with the same allocation of a bf16 run of the same configuration: a real run of the tiny flavour, and a dry run
of Llama 3 8B on 8 modelled H100s."""
import collections

import pytest

from helpers import run_train, snapshot, solution_bin, stage_or_skip

# the model's float32 tensors under bf16 (model.c: act_f32, temp_f32); every other tensor of a module is bf16
FLOAT32 = {"rstd", "rstd1", "rstd2", "lse", "att_scratch", "logits", "dlogits", "loss", "cos", "sin"}
# the bf16 run's own: the output matmul's bf16 logits (widened for the loss) and their gradient, rounded
BF16_ONLY = {"logits_bf16", "dlogits_bf16"}
MODEL_PREFIXES = ("embedding.", "block", "head.", "rope.")


def model_allocs(out):
    """{name: [size, ...]} of the model's activation and temp allocations, in host call order"""
    sizes = collections.defaultdict(list)
    for e in snapshot(out)["events"]:
        if e.get("action") == "alloc" and e["tag"] in ("activation", "temp") and e["name"].startswith(MODEL_PREFIXES):
            sizes[e["name"]].append(e["size"])
    return sizes




def check_paired(f32, bf16):
    assert set(bf16) - set(f32) == {n for n in bf16 if n.split(".")[-1] in BF16_ONLY} != set(), sorted(bf16)
    assert set(f32) <= set(bf16), sorted(set(f32) - set(bf16))
    halved = 0
    for name, sizes in f32.items():
        want = sizes if name.split(".")[-1] in FLOAT32 else [s // 2 for s in sizes]
        assert all(s % 4 == 0 for s in sizes) and bf16[name] == want, (name, sizes, bf16[name])
        halved += name.split(".")[-1] not in FLOAT32
    assert halved > 20  # the saved activations and the backward's gradients of every block


RUNS = {
    "tiny": ["--flavor", "tiny", "--world", "2", "--batch-size", "2", "--seq-len", "32", "--steps", "1"],
    "8B-dry-run": ["--flavor", "8B", "--world", "8", "--batch-size", "1", "--seq-len", "2048", "--steps", "1",
                   "--dry-run", "--device-profile", "h100-sxm", "--ac", "--trace-ranks", "1"],
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_bf16_activations_take_2_bytes(run, tmp_path):
    st = stage_or_skip("08")
    outs = {}
    for dt in ("fp32", "bf16"):
        outs[dt] = tmp_path / dt
        run_train(solution_bin(st), outs[dt], *RUNS[run], "--profile-steps", "0", "--param-dtype", dt, timeout=600)
    f32, bf16 = model_allocs(outs["fp32"]), model_allocs(outs["bf16"])
    for name in ("block0.q", "block0.swiglu", "block0.dq", "embedding.out", "head.xn", "head.dx", "block0.lse"):
        assert name in f32, name
    check_paired(f32, bf16)


def test_the_pairing_catches_a_float32_activation():
    """the check above fails when one bf16-run activation keeps its float32 size, or a new tensor appears"""
    f32 = {"block0.q": [64], "block0.lse": [16], "head.logits": [32]}
    good = {"block0.q": [32], "block0.lse": [16], "head.logits": [32], "head.logits_bf16": [16]}
    check_paired(dict(f32, **{"block%d.x%d" % (i, j): [8] for i in range(3) for j in range(8)}),
                 dict(good, **{"block%d.x%d" % (i, j): [4] for i in range(3) for j in range(8)}))
    for bad in (dict(good, **{"block0.q": [64]}), dict(good, **{"block0.new": [8]}), dict(good, **{"block0.lse": [8]})):
        with pytest.raises(AssertionError):
            check_paired(f32, bad)
