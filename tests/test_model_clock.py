"""The modelled clock: time is a property of the program, as memory is. The same program gives the same
modelled trace (the name, track, start and length of every op) and the same overlap figures on every run,
while this test keeps both cores busy itself, with ranks as threads and under mpirun. The wall clock stays
in each event's args, and differs from run to run."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import SOLVED, overlap_of, run_train, solution_bin

STAGE = "04"
FLAGS = ["--seq-len", "64", "--batch-size", "2", "--steps", "3", "--profile-steps", "3", "--max-norm", "0.5"]

pytestmark = pytest.mark.skipif(not any(s.id == STAGE for s in SOLVED),
                                reason="stage 04's solution is the instructors' (not in a student tree)")


def modelled(out):
    """Every op of every rank: (rank, track, name, ts, dur), in file order, and the trace's clock."""
    ops, clocks = [], set()
    for path in sorted(glob.glob(os.path.join(str(out), "trace_rank*.json"))):
        with open(path) as fh:
            t = json.load(fh)
        clocks.add(t.get("otherData", {}).get("clock"))
        ops += [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in t["traceEvents"] if e.get("ph") == "X"]
    return ops, clocks


def wall_times(out):
    with open(os.path.join(str(out), "trace_rank0.json")) as fh:
        return [e["args"]["wall_ts_us"] for e in json.load(fh)["traceEvents"] if "wall_ts_us" in e.get("args", {})]


def overlaps(out, world):
    """The grader's overlap figures of the run, at full precision: (compute share, collective share) of its
    all-gathers, then of its reduce-scatters."""
    figures = [overlap_of(STAGE, out, key, world=world) for key in ("ag_overlap", "rs_overlap")]
    return [(f.compute_share, f.collective_share) for f in figures]


class Load:
    """Both cores kept busy by two spinning processes for as long as the block runs (killed at its end)."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def test_same_modelled_trace_on_every_run_under_load(tmp_path):
    runs = []
    with Load():
        for i in range(3):
            out = tmp_path / ("run%d" % i)
            run_train(solution_bin(STAGE), out, "--world", "4", *FLAGS)
            runs.append(out)
    traces = [modelled(out) for out in runs]
    ops, clocks = traces[0]
    assert clocks == {"model"}, clocks
    assert len(ops) > 1000 and any(dur > 0 for *_, dur in ops)
    for i, (other, _) in enumerate(traces[1:], 1):
        assert other == ops, "run %d's modelled trace differs from run 0's: first at %s" % (
            i, next((a, b) for a, b in zip(ops, other) if a != b) if len(other) == len(ops) else "its length")
    figures = [overlaps(out, 4) for out in runs]
    assert all(f == figures[0] for f in figures), figures
    assert all(compute > 0 for compute, _ in figures[0]), figures[0]  # the solution overlaps both
    assert wall_times(runs[0]) != wall_times(runs[1])  # the wall clock is still there, and it is not the model


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (Debian: openmpi-bin)")
@pytest.mark.parametrize("world", [2, 4])
def test_threads_and_mpirun_give_the_same_modelled_trace(tmp_path, world):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    local, mpi = tmp_path / "local", tmp_path / "mpi"
    run_train(solution_bin(STAGE), local, "--world", str(world), *FLAGS)
    run_train(solution_bin(STAGE), mpi, "--world", str(world), "--backend", "mpi", *FLAGS, env=env,
              launcher=("mpirun", "--oversubscribe", "-np", str(world)))
    a, b = modelled(local)[0], modelled(mpi)[0]
    assert len(a) == len(b) and a == b, next((x, y) for x, y in zip(a, b) if x != y)
    assert overlaps(local, world) == overlaps(mpi, world)
