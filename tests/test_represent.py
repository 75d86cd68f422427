"""Representative ranks (train --dry-run --dry-run-ranks representative; runtime.h: WorldConfig.rep_stride): a dry
run executes one rank per class of symmetric ranks and prices every collective on its full group, so a world of
any size (up to 16,384 ranks) runs in the time and memory of a few.

- The executed ranks see exactly what they see in the full run (every rank a thread, --dry-run-ranks all) at
  worlds 8 and 16: each one's trace (every slice's name, track, modelled start and length, args but the wall
  clock's), its memory snapshot (every event in order, sizes, tags, modelled times) and the modelled step time,
  for plain FSDP (stages 04 and 08, on the teaching profile and on H100s four to a node, where the world's
  collectives cross nodes), HSDP (stage 09, --mesh) and the pipeline (stages 11 and 12, --pp: one executed
  rank per stage, each stage's first); and at world 64, Llama 3 8B on 8 nodes of H100s (stage 08).
- Llama 3 70B at 512 ranks and Llama 3 8B at 16,384 run and report (tools/simulate.py's report reads them);
  their wall time and memory: tools/bench_dry_worlds.py.
- Bad input is one line: all above 64 ranks, a world past 16,384, the flag without --dry-run, a computing run
  above 64 ranks; in the runtime, a send to a rank that does not execute and a group made from colors alone
  (tests/test_runtime_misuse.py's cases).
"""
import json
import os

import pytest

from helpers import BASELINE, metrics, run_train, solution_bin, stage_or_skip

from compare_reference import memory_snapshot, trace_tracks
import simulate

# (case id, stage, world, flags beyond the stage's own): small flavours so that 16 threads take seconds
CASES = [
    ("fsdp04-tiny-w8", "04", 8, ["--flavor", "tiny"]),
    ("fsdp04-tiny-w16", "04", 16, ["--flavor", "tiny"]),
    ("fsdp08-debug-w8", "08", 8, ["--flavor", "debugmodel", "--seq-len", 128]),
    ("fsdp08-debug-h100-4pernode-w16", "08", 16, ["--flavor", "debugmodel", "--seq-len", 256,
                                                  "--device-profile", "h100-sxm", "--ranks-per-node", 4]),
    ("hsdp09-tiny-w8", "09", 8, ["--flavor", "tiny"]),
    ("hsdp09-debug-h100-w16", "09", 16, ["--flavor", "debugmodel", "--seq-len", 128, "--device-profile", "h100-sxm"]),
    ("pp11-tiny-w8", "11", 8, ["--flavor", "tiny"]),
    ("pp11-tiny-w16", "11", 16, ["--flavor", "tiny"]),
    ("pp12-tiny-w8", "12", 8, ["--flavor", "tiny"]),
    ("pp12-debug-h100-4pernode-w16", "12", 16, ["--flavor", "debugmodel", "--seq-len", 128,
                                                "--device-profile", "h100-sxm", "--ranks-per-node", 4]),
    # the largest world that executes every rank, at Llama 3 8B's size on 8 nodes (2 s on 2 cores)
    ("fsdp08-8B-h100-w64", "08", 64, ["--flavor", "8B", "--seq-len", 8192, "--batch-size", 1, "--ac",
                                      "--device-profile", "h100-sxm", "--ranks-per-node", 8, "--trace-ranks", 1]),
]
COMMON = ["--dry-run", "--steps", 2, "--profile-steps", 2, "--warmup-steps", 0]


def read(path, reader=json.loads):
    with open(path) as fh:
        return reader(fh.read())


def tracks(path):
    """A rank's trace by track, its slices without their wall-clock args (the run's facts, otherData, aside:
    the groups of the ranks that never executed are not made)."""
    t = read(path, trace_tracks)
    t.pop("otherData")
    return t


@pytest.mark.parametrize("case,sid,world,flags", CASES, ids=[c[0] for c in CASES])
def test_representatives_see_what_the_full_run_shows_them(case, sid, world, flags, tmp_path):
    st = stage_or_skip(sid)
    full, rep = tmp_path / "all", tmp_path / "representative"
    args = COMMON + ["--world", world] + st.flags_at(world) + flags
    run_train(solution_bin(st), full, *args, "--dry-run-ranks", "all", timeout=300)
    run_train(solution_bin(st), rep, *args, "--dry-run-ranks", "representative", timeout=300)
    rj_full, rj = read(full / "run.json"), read(rep / "run.json")
    pp = rj.get("pp") or 1
    executed = list(range(0, world, world // pp))  # rank 0, or each stage's first rank
    assert (rj["dry_run_ranks"], rj["executed_ranks"]) == ("representative", executed)
    assert (rj_full["dry_run_ranks"], rj_full["executed_ranks"]) == ("all", list(range(world)))
    # per-rank files of the executed ranks alone
    assert sorted(p.name for p in rep.glob("memory_rank*.json")) == sorted("memory_rank%d.json" % r for r in executed)
    for r in executed:
        name = "trace_rank%d.json" % r
        assert tracks(rep / name) == tracks(full / name), "rank %d's trace differs" % r
        name = "memory_rank%d.json" % r
        assert read(rep / name, memory_snapshot) == read(full / name, memory_snapshot), "rank %d's memory" % r
    mf, mr = metrics(full), metrics(rep)
    assert [m["model_step_ms"] for m in mr] == [m["model_step_ms"] for m in mf]
    # the figures per rank are the executed ranks'
    for a, b in zip(mf, mr):
        assert b["peak_mem_bytes_per_rank"] == [a["peak_mem_bytes_per_rank"][r] for r in executed]
        assert b["peak_mem_bytes"] == a["peak_mem_bytes"]
    # the full groups, priced and listed whole: the world's, and with --pp each stage's
    groups = {g["name"]: g["ranks"] for g in rj["groups"]}
    assert groups["world"] == list(range(world))
    full_groups = {g["name"]: g["ranks"] for g in rj_full["groups"]}
    assert all(full_groups[n] == ranks for n, ranks in groups.items()), groups
    if pp > 1:
        assert rj["pipeline"] == rj_full["pipeline"]


def test_llama3_70B_at_512_ranks_runs_and_reports(tmp_path):
    """The issue's budget (2 minutes, 4 GiB on 2 cores; measured by tools/bench_dry_worlds.py): here, that it runs
    through simulate.py and its report reads it."""
    st = stage_or_skip("08")
    r = simulate.dry_run(solution_bin(st), st, "70B", 512, "h100-sxm", 1, 8192, 2, ["--ac", "--param-dtype", "bf16"],
                         str(tmp_path))
    rj = read(tmp_path / "run.json")
    assert (rj["world_size"], rj["dry_run_ranks"], rj["executed_ranks"]) == (512, "representative", [0])
    assert r["world"] == 512 and r["model_step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0
    # 70B's 70.6e9 parameters over 512 ranks: rank 0's float32 shards and their AdamW state, at least
    shards = sum(b for tag, b in r["steady_peak_by_tag"].items() if tag in ("param_shard", "optim_state"))
    assert shards >= 3 * 4 * 70.55e9 / 512, r["steady_peak_by_tag"]
    assert not os.path.exists(tmp_path / "memory_rank1.json") and not os.path.exists(tmp_path / "dtensors_rank1.json")


def test_llama3_8B_at_16384_ranks_runs(tmp_path):
    st = stage_or_skip("08")
    run_train(solution_bin(st), tmp_path, "--dry-run", "--flavor", "8B", "--world", 16384, "--ranks-per-node", 8,
              "--device-profile", "h100-sxm", "--batch-size", 1, "--seq-len", 8192, "--steps", 1, "--ac",
              "--param-dtype", "bf16", "--trace-ranks", 1, timeout=300)
    rj = read(tmp_path / "run.json")
    assert (rj["world_size"], rj["executed_ranks"], rj["fits"]) == (16384, [0], True)
    (m,) = metrics(tmp_path)
    assert len(m["peak_mem_bytes_per_rank"]) == 1 and m["model_step_ms"] > 0


BAD = [
    (["--dry-run", "--dry-run-ranks", "all", "--world", "128"],
     "error: --dry-run-ranks all executes every rank, one thread each: at most 64, and --world is 128 "
     "(representative, the default above 64, executes one rank per class of symmetric ranks)"),
    (["--dry-run", "--world", "20000"], "error: --world must be in [1, 16384], got 20000"),
    (["--dry-run-ranks", "representative", "--world", "8"],
     "error: --dry-run-ranks picks the ranks a dry run executes: it needs --dry-run (a run that computes executes "
     "every rank)"),
    (["--world", "128"],
     "error: --world 128: a run that computes executes every rank, one thread each, at most 64; a dry run "
     "(--dry-run) models up to 16384 by executing one rank per class of symmetric ranks"),
    (["--dry-run", "--world", "128", "--backend", "mpi"],
     "error: --dry-run-ranks representative runs its ranks as threads of one process: it needs --backend local "
     "(--world 128)"),
    (["--dry-run", "--dry-run-ranks", "fast"], "error: --dry-run-ranks expects all or representative, got 'fast'"),
]


@pytest.mark.parametrize("flags,line", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line(flags, line, tmp_path):
    p = run_train(BASELINE, tmp_path, *flags, check=False)
    assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
