"""The dry run (train --dry-run; common/runtime/dry.h): every op priced on the modelled clock and every
allocation counted, nothing executed and no memory behind the buffers.

- A dry run does not change the schedule or the memory count: its trace (every track's slices on the
  modelled clock), its memory snapshots and its peaks equal those of the real run of the same
  configuration (every stage that trains, at the debugmodel, world 4; stage 07's grad-state note, a
  value probe, says "dry_run" in place of its figures); its metrics carry no loss or grad norm.
- Host code that touches a buffer stops with one line naming it and the code (tests/test_guard.c --dry;
  no protection keys needed).
- A mid-size model at world 8 (1B) runs in seconds, and its peak per tag is the analytic memory model's
  (tools/benchlib/memory_model.py), computed from the sizes alone.
- Bad input is one line; tools/simulate.py's report holds figures recomputed here from their definitions.
- Device memory: on a profile with a capacity (80 GiB H100s), 8B without AC at local batch 4 x 8192 goes past it:
  one out-of-memory line checked against the snapshot, "fits": false, exit status 5, the report's marks; 8B with
  --ac-op at 1 x 8192 fits; the teach profile holds no capacity and records none.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import BASELINE, BUILD, ROOT, SOLVED, metrics, params_or_skip, run_train, solution_bin, stage_or_skip

sys.path.insert(0, os.path.join(ROOT, "tools"))
from compare_reference import memory_snapshot, trace_tracks  # noqa: E402
from benchlib.memory_model import memory_model, model_dims  # noqa: E402
import simulate  # noqa: E402  (the compare's configuration, the report's marks and train's exit statuses)

EXIT_OVER_CAPACITY = simulate.EXIT_OVER_CAPACITY

DEBUG = ["--flavor", "debugmodel", "--world", 4, "--seq-len", 128, "--batch-size", 2, "--steps", 2,
         "--profile-steps", 2, "--device-profile", "h100-sxm"]


def read(path, reader=json.loads):
    with open(path) as fh:
        return reader(fh.read())


# every stage that trains (02's blocking schedule, 04's overlap, 06's ZeRO-2, 09's 2-D mesh and the rest)
TRAINING = [s for s in SOLVED if not s.forward_only]


@pytest.mark.parametrize("st", params_or_skip(TRAINING, ids=[s.id for s in TRAINING]))
def test_dry_run_has_the_real_runs_schedule_and_memory(st, tmp_path):
    real, dry = tmp_path / "real", tmp_path / "dry"
    run_train(solution_bin(st), real, *DEBUG, *st.flags_at(4))
    run_train(solution_bin(st), dry, *DEBUG, *st.flags_at(4), "--dry-run")
    assert read(dry / "trace.json", trace_tracks) == read(real / "trace.json", trace_tracks)
    for r in range(4):
        name = "memory_rank%d.json" % r
        want, got = read(real / name, memory_snapshot), read(dry / name, memory_snapshot)
        # stage 07's grad-state note holds values: a dry run's says so instead, in the same place (probes.h)
        for d in (want, got):
            d["events"] = [{k: e.get(k) for k in ("seq", "kind", "step", "module", "hook", "microbatch")}
                           if e.get("kind") == "grad_state" else e for e in d["events"]]
        assert got == want, name
        # the DTensors' geometry is the same; whether a shard holds its rows of the init is a value: null
        want, got = read(real / ("dtensors_rank%d.json" % r)), read(dry / ("dtensors_rank%d.json" % r))
        for p in got["params"]:
            assert p["local_matches_init"] is None and p["padding_is_zero"] is None, p
        strip = lambda d: [{k: v for k, v in p.items() if k not in ("local_matches_init", "padding_is_zero")}
                           for p in d["params"]]
        assert strip(got) == strip(want)
        # a flat stage's units (manifest Stage.flat): the same geometry; whether the padding is zero is a value
        assert ("flat_units" in got) == ("flat_units" in want) == st.flat
        for u in got.get("flat_units", []):
            assert u["padding_is_zero"] is None, u
        units = lambda d: [{k: v for k, v in u.items() if k != "padding_is_zero"} for u in d.get("flat_units", [])]
        assert units(got) == units(want)
    mr, md = metrics(real), metrics(dry)
    for a, b in zip(mr, md):
        assert b["dry_run"] is True and b["loss"] is None and b["grad_norm"] is None and b["tokens_per_s"] is None
        assert (b["model_step_ms"], b["peak_mem_bytes_per_rank"]) == (a["model_step_ms"], a["peak_mem_bytes_per_rank"])
        assert a["loss"] is not None and "dry_run" not in a


GUARD = os.path.join(BUILD, "tests", "test_guard")
TAIL = (" on rank 1's host thread: a dry run executes no op and puts no memory behind its buffers, so no code may "
        "read or write them (")
DEVICE_HINT = "host code reads device memory only through a copy, as on a GPU, and a dry run has no values to copy)"
CASES = {
    "host_read": re.escape("error: dry run: host code read device memory 'layers.0.attention.wq.weight' (param, "
                           "rank 1) at byte offset 128, touched by peek_weights (tests/test_guard.c)" + TAIL +
                           DEVICE_HINT),
    "host_write": re.escape("error: dry run: host code wrote device memory 'layers.0.attention.wq.weight' (param, "
                            "rank 1) at byte offset 12, touched by poke_weights (tests/test_guard.c)" + TAIL +
                            DEVICE_HINT),
    "host_memcmp": re.escape("error: dry run: host code read device memory 'layers.0.attention.wq.weight' (param, "
                             "rank 1) at byte offset ") + r"\d+" +
                   re.escape(", touched by compare_weights (tests/test_guard.c) through libc.so.6" + TAIL +
                             DEVICE_HINT),
    "pinned_read": re.escape("error: dry run: host code read pinned host memory 'exp_avg.pinned' (optim_state, "
                             "rank 1) at byte offset 128, touched by peek_weights (tests/test_guard.c)" + TAIL +
                             "a value it needs does not exist in a dry run)"),
    "probe_read": re.escape("error: rank 1: dev_probe_read of 1024 bytes in a dry run, which has no values to read"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_touching_a_dry_runs_buffer_stops_with_one_line(kind):
    assert os.access(GUARD, os.X_OK), "%s missing: run make first" % GUARD
    p = subprocess.run([GUARD, "--mode", kind, "--dry"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, "exit %d, stdout:\n%s\nstderr:\n%s" % (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert re.fullmatch(CASES[kind], lines[0]), lines[0]


def test_1B_at_world_8_is_counted_as_the_memory_model_predicts(tmp_path):
    """A mid-size model on 8 modelled GPUs: seconds on 2 cores, and rank 0's peak equals, to the byte and by tag,
    the analytic model's prediction from the sizes and the stage's schedule alone."""
    st = stage_or_skip("04")
    B, T, W = 1, 2048, 8
    run_train(solution_bin(st), tmp_path, "--flavor", "1B", "--world", W, "--batch-size", B, "--seq-len", T,
              "--steps", 2, "--profile-steps", 2, "--trace-ranks", 1, "--dry-run", "--device-profile", "h100-sxm",
              timeout=120)
    dims = model_dims(read(tmp_path / "run.json"))
    model_bytes, model_at, model_tags = memory_model(dims, B, T, W, st)
    measured = max(m["peak_mem_bytes_per_rank"][0] for m in metrics(tmp_path))
    assert measured == model_bytes, "measured %d bytes, the model predicts %d at %s" % (measured, model_bytes, model_at)
    # --trace-ranks 1: rank 0 alone wrote a trace and a snapshot
    assert os.path.exists(tmp_path / "memory_rank0.json") and not os.path.exists(tmp_path / "memory_rank1.json")


# model.h's MODEL_FLAVORS
FLAVORS = "tiny, debugmodel, 1B, 8B, 70B, llama2-7B, llama2-13B, llama2-70B, llama3.1-8B, llama3.1-70B, llama3.1-405B"
BAD = [
    (["--flavor", "13B"], "error: unknown flavor '13B' (%s)" % FLAVORS),
    (["--flavor", "8B", "--seq-len", "16384"],
     "error: --seq-len 16384 exceeds the 8B flavour's context of 8192 tokens (Llama 3's; the llama3.1-* flavours, "
     "with Llama 3.1's RoPE scaling, take 131072)"),
    (["--load", "x.safetensors"], "error: --dry-run computes no values: it cannot go with --load"),
    (["--save", "x.safetensors"], "error: --dry-run computes no values: it cannot go with --save"),
    (["--world", "8", "--mesh", "3,3"], "error: --mesh 3,3 holds 9 ranks but --world is 8 (R*S must equal the world)"),
]


@pytest.mark.parametrize("flags,line", BAD, ids=[b[1][7:40] for b in BAD])
def test_bad_input_is_one_line(flags, line, tmp_path):
    p = run_train(BASELINE, tmp_path, "--dry-run", *flags, check=False)
    assert p.returncode == 2 and p.stderr.strip() == line, p.stderr


def test_simulate_report_holds_its_definitions(tmp_path):
    st = stage_or_skip("04")
    out = tmp_path / "sim"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--solutions", "--stage", "04",
                        "--flavor", "debugmodel", "--world", "4", "--batch", "2", "--seq", "128", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, HWFSDP_BUILD=BUILD))
    assert p.returncode == 0, p.stdout + p.stderr
    r = read(out / "report.json")
    rj, last = read(out / "run.json"), metrics(out)[-1]
    assert r["model_step_ms"] == last["model_step_ms"]
    assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 128 / (last["model_step_ms"] / 1e3))
    # torchtitan's FLOPs per token, from the config: 6 x (params - embedding) + 12 x L x H x head_dim x T
    D, L, H, V, F, KV = rj["dim"], rj["n_layers"], rj["n_heads"], rj["vocab_size"], rj["hidden_dim"], rj["n_kv_heads"]
    hd = D // H
    block = 2 * D + D * H * hd * 2 + 2 * D * KV * hd + 3 * D * F
    non_embedding = L * block + D + V * D
    assert r["flops_per_token"] == 6 * non_embedding + 12 * L * H * hd * 128
    assert r["n_params"] == rj["n_params"]
    peak = read(out / "trace_rank0.json")["otherData"]["peak_flops"]["bf16"]
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s_per_gpu"] / peak)
    assert r["steady_peak_bytes"] == last["peak_mem_bytes_per_rank"][0]
    assert sum(r["steady_peak_by_tag"].values()) == r["steady_peak_bytes"]
    # the compute stream's kernels by op class (their args.class) add up to its kernel time, and every class a run
    # of stage 04 holds is there; its copies and memsets beside them
    by_class = r["compute_ms_by_class"]
    assert set(by_class) == {"matmul", "attention", "elementwise", "copies and memsets"}, by_class
    kernels = sum(ms for what, ms in by_class.items() if what != "copies and memsets")
    assert kernels == pytest.approx(r["compute_ms"], rel=1e-9), (by_class, r["compute_ms"])
    assert r["attention_ms"] == by_class["attention"]
    assert "modelled step (step 2)" in (out / "report.md").read_text()
    assert (out / "plots" / "timeline.png").exists() and (out / "plots" / "memory.png").exists()


def test_8B_at_sequence_8192_runs_flash_attention(tmp_path):
    """Llama 3 8B at its full context (a dry run, 8 modelled H100s, float32): attention is flash attention. No
    allocation of a block is anywhere near one head's T x T scores, let alone the B x H x T x T probabilities (8 GiB a layer);
    each block saves its logsumexp, B x H x T floats, instead; and attention is a minority of the modelled compute
    (its FLOPs are the causal half)."""
    st = stage_or_skip("04")
    B, T, W = 1, 8192, 8
    p = run_train(solution_bin(st), tmp_path, "--flavor", "8B", "--world", W, "--batch-size", B, "--seq-len", T,
                  "--steps", 2, "--profile-steps", 2, "--trace-ranks", 1, "--dry-run", "--device-profile", "h100-sxm",
                  timeout=300, check=False)
    # float32 activations without AC come close to an H100's 80 GiB (past it today, in the head's backward): the
    # dry run then says so, goes on and exits 5 (the device-memory tests below); this test reads attention only
    assert p.returncode in (0, EXIT_OVER_CAPACITY), p.stderr
    rj = read(tmp_path / "run.json")
    H = rj["n_heads"]
    events = read(tmp_path / "memory_rank0.json")["events"]
    allocs = [e for e in events if e.get("action") == "alloc"]
    lse = [e for e in allocs if e["name"].endswith(".lse")]
    assert lse and all(e["size"] == B * H * T * 4 and e["tag"] == "activation" for e in lse), lse[:3]
    assert {e["module"] for e in lse} >= {"block0", "block%d" % (rj["n_layers"] - 1)}
    # the blocks' own (the head's logits, N x V, are the biggest tensor of a step, and not attention's): the
    # largest is an FFN activation (N x F), a sixteenth of the probabilities; attention's own (its output, lse and
    # the backward's scratch) are each below one head's T x T
    blocks = [e for e in allocs if e["tag"] in ("activation", "temp") and e["module"].startswith("block")]
    biggest = max(blocks, key=lambda e: e["size"])
    assert biggest["size"] <= B * H * T * T * 4 // 16, "%s holds %d bytes" % (biggest["name"], biggest["size"])
    for e in blocks:
        if e["name"].split(".")[-1] in ("att", "lse", "att_scratch"):
            assert e["size"] < T * T * 4, "%s holds %d bytes: one head's T x T scores are %d" % (
                e["name"], e["size"], T * T * 4)
    assert not [e for e in allocs if "probs" in e["name"]]
    trace = read(tmp_path / "trace_rank0.json")
    compute = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"]
    total = sum(e["dur"] for e in compute)
    attention = sum(e["dur"] for e in compute if e["name"].split(".")[-1].startswith("attention"))
    assert total > 0 and attention < 0.5 * total, "attention %.0f of %.0f us of compute" % (attention, total)


# ------------------------------------------------------------------ device memory

CAPACITY = 80 << 30  # the h100-sxm profile's HBM (common/runtime/profile.c: 5 stacks x 16 GiB)


def dry_8B(st, out, batch, *flags, profile="h100-sxm"):
    """Llama 3 8B on 8 modelled GPUs of `profile` at sequence 8192, as tools/simulate.py --compare runs it (stage
    08's solution, --param-dtype bf16, a node of 8): the CompletedProcess, whatever its exit status."""
    return run_train(solution_bin(st), out, "--dry-run", "--flavor", "8B", "--world", 8, "--device-profile", profile,
                     "--ranks-per-node", simulate.GPUS_PER_NODE, "--batch-size", batch, "--seq-len", 8192,
                     "--steps", 2, "--warmup-steps", 0, "--profile-steps", 2, "--trace-ranks", 1,
                     *st.flags_at(8), *simulate.COMPARE_FLAGS, *flags, timeout=300, check=False)


def size_of(number, unit):
    return float(number) * (1 << (30 if unit == "GiB" else 20))


OOM = re.compile(r"error: dry run: out of device memory on rank (\d+) in step (\d+) \((\S+) (\S+)\): tried to allocate "
                 r"([\d.]+) (GiB|MiB) for '([^']+)' \((\w+)\); the h100-sxm profile's device has 80\.00 GiB, of which "
                 r"([\d.]+) (GiB|MiB) is allocated \(([^)]*)\) and ([\d.]+) (GiB|MiB) is free; a GPU would stop here, "
                 r"the dry run goes on and records that the configuration does not fit \(\"fits\": false in run\.json "
                 r"and metrics\.jsonl; exit status 5\)")


def test_8B_without_activation_checkpointing_does_not_fit_an_h100(tmp_path):
    """8B, no AC, local batch 4 x 8192 on 8 modelled H100s (80 GiB each): one line, as CUDA's out-of-memory error
    would say it, naming the allocation that crossed, where, and what held the memory then (each figure checked
    against rank 0's memory snapshot); the dry run goes on, records "fits": false, and exits 5."""
    st = stage_or_skip(simulate.COMPARE_STAGE)
    p = dry_8B(st, tmp_path, 4)
    assert p.returncode == EXIT_OVER_CAPACITY, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr  # once for the run, though every rank and both steps go past it
    m = OOM.fullmatch(lines[0])
    assert m, lines[0]
    rank, step, module, phase, ask, ask_u, name, tag, had, had_u, tags, free, free_u = m.groups()
    assert rank == "0"  # the lowest rank that went over (FSDP's ranks are symmetric: all did)
    # the snapshot's first allocation of a step that took rank 0 past 80 GiB (init is not held to it)
    snap = read(tmp_path / "memory_rank0.json")
    events = snap["events"]
    first = next(e for e in events if e.get("action") == "alloc" and e["step"] >= 0 and e["current_bytes"] > CAPACITY)
    assert (int(step), module, phase, name, tag) == (first["step"] + 1, first["module"], first["phase"], first["name"],
                                                     first["tag"])
    before = first["current_bytes"] - first["size"]
    assert size_of(ask, ask_u) == pytest.approx(first["size"], abs=0.01 * (1 << 20))
    assert size_of(had, had_u) == pytest.approx(before, rel=1e-3)
    assert size_of(free, free_u) == pytest.approx(CAPACITY - before, rel=1e-2)
    # the three tags holding the most just before it, largest first (ties: in the tags' order), replayed from the
    # event log
    held = {}
    for e in events:
        if e is first:
            break
        if e.get("action") == "alloc":
            held[e["tag"]] = held.get(e["tag"], 0) + e["size"]
        elif e.get("action") in ("free", "free_completed"):
            held[e["tag"]] -= e["size"]
    top = sorted(((b, t) for t, b in held.items() if b), key=lambda bt: (-bt[0], snap["tags"].index(bt[1])))[:3]
    said = [re.fullmatch(r"(\w+) ([\d.]+) (GiB|MiB)", x).groups() for x in tags.split(", ")]
    assert [t for t, _, _ in said] == [t for _, t in top], (tags, top)
    for (t, n, u), (b, _) in zip(said, top):
        assert size_of(n, u) == pytest.approx(b, rel=1e-3), t
    # recorded: run.json for the run, every metrics line for its step
    rj = read(tmp_path / "run.json")
    assert (rj["hbm_capacity_bytes"], rj["fits"]) == (CAPACITY, False)
    for line in metrics(tmp_path):
        assert line["hbm_capacity_bytes"] == CAPACITY and line["fits"] is False and line["peak_mem_bytes"] > CAPACITY
    # and the report says so in its title and its table, as the --compare table does
    r = simulate.report(str(tmp_path), st)
    text = simulate.render(r)
    assert text[0].endswith("(h100-sxm, 80 GiB each): does not fit"), text[0]
    assert "| device memory per GPU (h100-sxm's HBM), every rank and step | 80.00 GiB: **does not fit** |" in text
    t = dict(simulate.TORCHTITAN[0], batch=4, ac="none")
    assert ", **does not fit in 80 GiB** |" in simulate.compare_row(t, r)[0]


def test_8B_with_per_op_activation_checkpointing_fits_an_h100(tmp_path):
    """8B with --ac-op (torchtitan's selective AC), local batch 1 x 8192, on the same 8 H100s: no line, exit 0,
    "fits": true, and no mark in the report."""
    st = stage_or_skip(simulate.COMPARE_STAGE)
    p = dry_8B(st, tmp_path, 1, "--ac-op")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    rj = read(tmp_path / "run.json")
    assert (rj["hbm_capacity_bytes"], rj["fits"]) == (CAPACITY, True)
    for line in metrics(tmp_path):
        assert line["fits"] is True and line["peak_mem_bytes"] <= CAPACITY
    r = simulate.report(str(tmp_path), st)
    text = simulate.render(r)
    assert text[0].endswith("(h100-sxm, 80 GiB each)") and "does not fit" not in "\n".join(text)
    assert "does not fit" not in simulate.compare_row(simulate.TORCHTITAN[0], r)[0]


def test_the_teach_profile_holds_no_memory_capacity(tmp_path):
    """The grader's teach profile is no real device: the configuration that does not fit an H100 runs on it with
    no line, exit 0, and nothing recorded about a capacity (run.json and metrics.jsonl as before)."""
    st = stage_or_skip(simulate.COMPARE_STAGE)
    p = dry_8B(st, tmp_path, 4, profile="teach")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert max(m["peak_mem_bytes"] for m in metrics(tmp_path)) > CAPACITY  # no limit held it
    rj = read(tmp_path / "run.json")
    assert "hbm_capacity_bytes" not in rj and "fits" not in rj
    for line in metrics(tmp_path):
        assert "hbm_capacity_bytes" not in line and "fits" not in line
    r = simulate.report(str(tmp_path), st)
    assert r["hbm_capacity_bytes"] is None and r["fits"] is None
    assert simulate.render(r)[0].endswith("(teach)")


def test_the_handout_lists_the_profiles_as_the_program_does():
    """HANDOUT.md's profile table is a copy of `train --device-profile list` (the constants are stated once, in
    common/runtime/profile.c): the copy between its markers is the program's output, byte for byte."""
    st = stage_or_skip(simulate.COMPARE_STAGE)
    p = subprocess.run([solution_bin(st), "--device-profile", "list"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    with open(os.path.join(ROOT, "HANDOUT.md")) as fh:
        handout = fh.read()
    copy = re.search(r"<!-- train --device-profile list -->\n(.*?)<!-- end of the list -->", handout, re.S)
    assert copy, "HANDOUT.md has no copy of the profile list between its markers"
    assert copy.group(1) == p.stdout, "HANDOUT.md's profile table differs from train --device-profile list: copy it"
    for name in ("teach", "a100-80g", "h100-sxm", "h100-gt"):
        assert "| `%s` |" % name in p.stdout


def test_price_ops_eager_prices_eager_kernels_and_holds_eager_memory(tmp_path):
    """--price-ops eager (the torchtitan rows of --compare): the same program, its element-wise math priced as
    eager PyTorch's kernels and two more buffers held (model.c: eager_hold). Against --price-ops fused on the
    debugmodel (--ac-op, bf16, h100-sxm; one rank, so that no collective's overlap slowdown moves between kernels):
    every matmul slice lasts the same; each RMSNorm lasts 8 kernels' latency
    plus 36 bytes an element at 80 % of 3.35 TB/s (kernels.h: kcost_eager_rmsnorm); the snapshot adds, per block
    and step, one 'eager_w2_saved' of N x D bf16 from its forward to its backward, and per step one
    'eager_nll_grad' of N x V float32 in the head's backward; nothing else."""
    st = stage_or_skip(simulate.COMPARE_STAGE)
    B, T, W = 2, 256, 1
    runs = {}
    for po in ("fused", "eager"):
        out = tmp_path / po
        run_train(solution_bin(st), out, "--dry-run", "--flavor", "debugmodel", "--world", W, "--batch-size", B,
                  "--seq-len", T, "--steps", 2, "--profile-steps", 2, "--device-profile", "h100-sxm", "--ac-op",
                  "--param-dtype", "bf16", "--price-ops", po, timeout=120)
        runs[po] = out
    rj = read(runs["eager"] / "run.json")
    assert rj["price_ops"] == "eager" and "price_ops" not in read(runs["fused"] / "run.json")
    dims = model_dims(rj)
    N, D, V = B * T, dims["D"], dims["V"]

    def slices(d, name):
        tr = read(d / "trace_rank0.json")
        evs = tr["traceEvents"] if isinstance(tr, dict) else tr
        return [e for e in evs if e.get("ph") == "X" and e.get("name", "").split(".")[-1] == name]

    for name in ("wq", "w1", "output"):
        f, e = slices(runs["fused"], name), slices(runs["eager"], name)
        assert f and [x["dur"] for x in f] == [x["dur"] for x in e], name
    norms = slices(runs["eager"], "rmsnorm")
    want = 8 * 3 + 36.0 * N * D / (3350e9 * 0.8) * 1e6
    assert norms and all(abs(x["dur"] - want) < 1e-3 for x in norms), (norms[0]["dur"], want)
    snaps = {po: read(runs[po] / "memory_rank0.json") for po in runs}
    extra = [e for e in snaps["eager"]["events"] if e.get("action") == "alloc" and "eager" in e["name"]]
    assert not [e for e in snaps["fused"]["events"] if "eager" in e.get("name", "")]
    w2 = [e for e in extra if e["name"].endswith("eager_w2_saved")]
    nll = [e for e in extra if e["name"].endswith("eager_nll_grad")]
    assert len(w2) == 2 * dims["L"] and all(e["size"] == N * D * 2 and e["phase"] == "forward" for e in w2), w2[:1]
    assert len(nll) == 2 and all(e["size"] == N * V * 4 and e["phase"] == "backward" for e in nll), nll
    assert len(extra) == len(w2) + len(nll)
    # the rest of the snapshot is the same allocations, in the same order
    same = lambda s: [(e.get("action"), e.get("name"), e.get("size")) for e in s["events"]
                      if "eager" not in e.get("name", "")]
    assert same(snaps["fused"]) == same(snaps["eager"])
