"""The published models' flavours (common/model/model.c): Llama 2 7B / 13B / 70B and Llama 3.1 8B / 70B / 405B
as their configs define them, beside torchtitan's Llama 3 (8B, 70B).

- Every published flavour's parameter count, as the binary states it (run.json's n_params), equals the count
  computed here from the configs in CONFIGS (written from the published configs: llama-models' sku_list.py for
  Llama 3 and 3.1, Llama 2's params.json; untied embedding and output, RMSNorm weights, no biases), and that
  equals the published count. The FFN width F is derived here, by the runtime (run.json's hidden_dim) and by
  tools/benchlib/memory_model.py's hidden_dim: all three equal the published widths.
- A flavour's RoPE (its theta; Llama 3.1's scaling) reaches a real run: tiny-size runs of the flavours (every
  dimension overridden alike) agree bit for bit within a family and differ across families. The scaled tables
  themselves are checked against a float64 implementation in tests/test_ops.c
  (rope_tables_llama31_scaling_match_float64).
- Dry runs of llama3.1-8B and llama2-7B on 8 modelled H100s (stage 04's solution, sequence 4096) finish.
- An unknown flavour is one line listing every flavour; a --seq-len beyond a flavour's context is one line.
- tools/simulate.py's titles name the model ("Llama 3 8B", "Llama 2 7B", "Llama 3.1 405B").
"""
import json
import os
import re

import pytest

from helpers import BASELINE, metrics, run_train, solution_bin, stage_or_skip

from benchlib.memory_model import hidden_dim, model_dims, n_params
from simulate import model_name

# name: (dim, layers, heads, kv heads, vocab, multiple_of, ffn_dim_multiplier, rope theta, context,
#        published F, published parameters)
CONFIGS = {
    "8B": (4096, 32, 32, 8, 128256, 1024, 1.3, 500000, 8192, 14336, 8_030_261_248),
    "70B": (8192, 80, 64, 8, 128256, 4096, 1.3, 500000, 8192, 28672, 70_553_706_496),
    "llama2-7B": (4096, 32, 32, 32, 32000, 256, None, 10000, 4096, 11008, 6_738_415_616),
    "llama2-13B": (5120, 40, 40, 40, 32000, 256, None, 10000, 4096, 13824, 13_015_864_320),
    "llama2-70B": (8192, 80, 64, 8, 32000, 4096, 1.3, 10000, 4096, 28672, 68_976_648_192),
    "llama3.1-8B": (4096, 32, 32, 8, 128256, 1024, 1.3, 500000, 131072, 14336, 8_030_261_248),
    "llama3.1-70B": (8192, 80, 64, 8, 128256, 4096, 1.3, 500000, 131072, 28672, 70_553_706_496),
    "llama3.1-405B": (16384, 126, 128, 8, 128256, 4096, 1.2, 500000, 131072, 53248, 405_853_388_800),
}
OWN = ["tiny", "debugmodel", "1B"]  # this project's own flavours
FAMILY = {"8B": "Llama 3", "70B": "Llama 3", "llama2-7B": "Llama 2", "llama2-13B": "Llama 2",
          "llama2-70B": "Llama 2", "llama3.1-8B": "Llama 3.1", "llama3.1-70B": "Llama 3.1",
          "llama3.1-405B": "Llama 3.1"}


def ffn_width(dim, multiple_of, multiplier):
    """Llama's FeedForward: int(2 x 4 dim / 3), times the multiplier (int), rounded up to multiple_of."""
    h = int(2 * 4 * dim / 3)
    if multiplier is not None:
        h = int(multiplier * h)
    return -(-h // multiple_of) * multiple_of


def param_count(dim, layers, heads, kv, vocab, F):
    """Embedding and output V x D each; per block: two RMSNorm weights (D), wq and wo (D x H hd), wk and wv
    (D x KV hd), w1, w2, w3 (D x F); the final norm (D)."""
    hd = dim // heads
    block = 2 * dim + 2 * dim * heads * hd + 2 * dim * kv * hd + 3 * dim * F
    return 2 * vocab * dim + layers * block + dim


def run_json(out):
    with open(os.path.join(str(out), "run.json")) as fh:
        return json.load(fh)


def solution_or_skip(sid):
    return solution_bin(stage_or_skip(sid))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_and_parameter_count(name, tmp_path):
    D, L, H, KV, V, mult_of, mult, theta, ctx, F_pub, N_pub = CONFIGS[name]
    F = ffn_width(D, mult_of, mult)
    assert F == F_pub, "F derived here %d, published %d" % (F, F_pub)
    assert hidden_dim(D, mult_of, mult or 0.0) == F_pub, "benchlib's hidden_dim"
    assert param_count(D, L, H, KV, V, F) == N_pub, "the count from the config is not the published one"
    # the binary's own statement (a dry run of no step: the model is built, nothing priced)
    run_train(BASELINE, tmp_path, "--dry-run", "--flavor", name, "--world", 1, "--batch-size", 1, "--seq-len", 16,
              "--steps", 0)
    rj = run_json(tmp_path)
    got = {k: rj[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "hidden_dim")}
    assert got == {"dim": D, "n_layers": L, "n_heads": H, "n_kv_heads": KV, "vocab_size": V, "multiple_of": mult_of,
                   "hidden_dim": F_pub}
    assert rj["n_params"] == N_pub, "run.json n_params %d, published %d" % (rj["n_params"], N_pub)
    assert n_params(model_dims(rj)) == N_pub, "benchlib's count from run.json"


# Every dimension overridden alike, so that two flavours' runs differ in their RoPE alone: 2 layers, head dim 64,
# 1024 positions (the long waves turn by a measurable angle), the same FFN multiplier.
TINY = ["--dim", 128, "--n-layers", 2, "--n-heads", 2, "--n-kv-heads", 1, "--vocab-size", 259, "--multiple-of", 32,
        "--ffn-dim-multiplier", 1.3, "--seq-len", 1024, "--batch-size", 1, "--steps", 2, "--world", 1]


def test_the_flavours_rope_reaches_a_real_run(tmp_path):
    """Within a family the runs agree bit for bit (the same theta and scaling); Llama 3 (theta 500000), Llama 3.1
    (the same theta, scaled) and Llama 2 (theta 10000) give three different runs."""
    runs = {}
    for name in CONFIGS:
        out = tmp_path / name
        run_train(BASELINE, out, "--flavor", name, *TINY)
        runs[name] = [(m["loss"], m["grad_norm"]) for m in metrics(out)]
    by_family = {}
    for name, r in runs.items():
        by_family.setdefault(FAMILY[name], set()).add(tuple(r))
    for family, seen in by_family.items():
        assert len(seen) == 1, "%s's flavours differ at the same sizes: %s" % (family, seen)
    firsts = [next(iter(seen)) for seen in by_family.values()]
    assert len(set(firsts)) == 3, "two families' RoPE gave the same run: %s" % by_family


@pytest.mark.parametrize("name", ["llama3.1-8B", "llama2-7B"])
def test_dry_run_at_world_8(name, tmp_path):
    binary = solution_or_skip("04")
    run_train(binary, tmp_path, "--dry-run", "--flavor", name, "--world", 8, "--device-profile", "h100-sxm",
              "--seq-len", 4096, "--batch-size", 1, "--steps", 1, "--trace-ranks", 1, timeout=120)
    m = metrics(tmp_path)
    assert len(m) == 1 and m[0]["model_step_ms"] > 0, m
    rj = run_json(tmp_path)
    assert rj["flavor"] == name and rj["world_size"] == 8 and rj["n_params"] == CONFIGS[name][-1]


def one_line_error(*flags, tmp_path):
    p = run_train(BASELINE, tmp_path, *flags, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_unknown_flavour_lists_every_flavour(tmp_path):
    line = one_line_error("--flavor", "llama3-8B", tmp_path=tmp_path)
    m = re.fullmatch(r"error: unknown flavor 'llama3-8B' \((.*)\)", line)
    assert m, line
    assert m.group(1).split(", ") == OWN + list(CONFIGS), line


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_seq_len_beyond_the_context_is_one_line(name, tmp_path):
    ctx = CONFIGS[name][8]
    line = one_line_error("--dry-run", "--flavor", name, "--seq-len", ctx + 1, tmp_path=tmp_path)
    hint = "; the llama3.1-* flavours, with Llama 3.1's RoPE scaling, take 131072" if FAMILY[name] == "Llama 3" else ""
    assert line == "error: --seq-len %d exceeds the %s flavour's context of %d tokens (%s's%s)" % (
        ctx + 1, name, ctx, FAMILY[name], hint)


def test_simulate_titles_name_the_model():
    assert [model_name(n) for n in CONFIGS] == ["Llama 3 8B", "Llama 3 70B", "Llama 2 7B", "Llama 2 13B",
                                                "Llama 2 70B", "Llama 3.1 8B", "Llama 3.1 70B", "Llama 3.1 405B"]
    assert [model_name(n) for n in OWN] == ["the tiny flavour", "the debugmodel flavour", "the 1B flavour"]
