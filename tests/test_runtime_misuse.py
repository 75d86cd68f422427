"""Misuse of the runtime is one clear line on stderr and exit status 2.
Runs `build/tests/test_runtime --misuse KIND` (see tests/test_runtime.c)."""
import os
import re
import subprocess

import pytest

from helpers import BUILD, ROOT

BINARY = os.path.join(BUILD, "tests", "test_runtime")

CASES = {
    # the rank and who waits (a stream, or the host) are named; the hook too when the wait is in one
    "event": re.escape("error: event 'ag_done' waited on but never recorded (rank 0: compute stream waits on it; a "
                       "wait refers to the latest dev_event_record of the event, so record it after the work it "
                       "marks, before anything waits on it)"),
    "event_sync": re.escape("error: event 'rs_done' waited on but never recorded (rank 0: the host waits on it; a "
                            "wait refers to the latest dev_event_record of the event, so record it after the work it "
                            "marks, before anything waits on it)"),
    "double_free": r"error: dev_free: 0x[0-9a-f]+ is not a live allocation of rank 0 \(double free\?\)",
    "foreign_free": r"error: dev_free: 0x[0-9a-f]+ is not a live allocation of rank 0 \(double free\?\)",
    "mismatch": re.escape("error: collective mismatch on stream 'ag' #14: rank 0 all_gather 8192 f32 (block2); "
                          "rank 1 all_gather 8192 f32 (block2); rank 2 reduce_scatter 16384 f32 sum (block3)"),
    # inside a group: the ranks are named by their world rank, the group by its name
    "group_mismatch": re.escape("error: collective mismatch on stream 'ag' #1: rank 2 all_gather 16 f32 in shard1 "
                                "(block2); rank 3 reduce_scatter 8 f32 avg in shard1 (block3)"),
    # buffers that overlap other than in NCCL's in-place forms (a race between the ranks' copies)
    "inplace_offset": re.escape("error: all_gather (block0) on rank 1: send is at recv+0 elements, overlapping recv but "
                                "not in place: in place means send = recv + group rank * send_count, i.e. send at "
                                "recv+32 (rank 1 of 2 in world); any other overlap races with the peers' copies"),
    "overlap_all_reduce": re.escape("error: all_reduce (grad_norm) on rank 0: send is at recv-4 elements, overlapping "
                                    "recv: pass the same buffer for both (in place) or two disjoint ones; any other "
                                    "overlap races with the peers' reads"),
    # dev_memcpy_batch_async: its copies run in no set order, in one direction, under a name of their own
    "batch_overlap": re.escape("error: dev_memcpy_batch_async('copy_out'): copy 0's destination overlaps copy 2's "
                               "destination (the copies of a batch run in no set order: no destination may overlap "
                               "another copy's source or destination)"),
    "batch_null": re.escape("error: dev_memcpy_batch_async('chunk_cat'): copy 1 has a NULL source with 64 bytes"),
    "batch_mixed": re.escape("error: dev_memcpy_batch_async('copy_in'): copy 0 goes device to device but copy 1 goes "
                             "host to device (one batch, one direction: split it)"),
    "batch_name": re.escape("error: dev_memcpy_batch_async: name it what it is, without a dot (e.g. \"copy_in\"), "
                            "not 'block0.copy_in' (the trace shows \"<module>.<name>\")"),
    # launch_cast_batch_to_bf16 (a casting chunk-cat / copy-in): the same rules, one line each
    "batch_cast_overlap": re.escape("error: launch_cast_batch_to_bf16('copy_in'): cast 0's source overlaps cast 1's "
                                    "destination (the casts of a batch run in no set order: no destination may "
                                    "overlap another cast's source or destination)"),
    "batch_cast_null": re.escape("error: launch_cast_batch_to_bf16('chunk_cat'): cast 1 has a NULL destination "
                                 "with 16 elements"),
    "batch_cast_name": re.escape("error: launch_cast_batch_to_bf16: name it what it is, without a dot (e.g. "
                                 "\"copy_in\"), not 'block0.copy_in' (the trace shows \"<module>.<name>\")"),
    # representative ranks (a dry run's WorldConfig.rep_stride): a send to a rank that does not execute, a group
    # whose non-executed members pass no color, a run that computes, a world past the dry run's largest
    "rep_p2p": re.escape("error: dev_send('act') on rank 0: peer rank 1 does not execute: this dry run executes one "
                         "representative rank per class of symmetric ranks (every 4-th rank), and a representative's "
                         "peers must be representatives too (--dry-run-ranks all runs every rank, up to 64)"),
    "rep_group": re.escape("error: rank 0: dev_group_new('mine'): with representative ranks (a dry run of 8 ranks "
                           "executing 2) the ranks that do not execute pass no color: make the group from its "
                           "structure (dev_group_new_of)"),
    "rep_computing": re.escape("error: representative ranks stand for ranks that never execute: a dry run's "
                               "(--dry-run) of the local backend only, not a run that computes or one with a process "
                               "per rank"),
    "rep_world_big": re.escape("error: world size 16385 is out of range (1..16384 ranks with representative ranks)"),
    "world0": re.escape("error: world size 0 is out of range (1..64 ranks)"),
    "world_big": re.escape("error: world size 65 is out of range (1..64 ranks)"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_misuse(kind):
    assert os.access(BINARY, os.X_OK), "%s missing: run make first" % BINARY
    p = subprocess.run([BINARY, "--misuse", kind], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n%s" % p.stderr
    assert re.fullmatch(CASES[kind], lines[0]), lines[0]


NO_MPI_LINE = "error: this build has no MPI support (rebuild with OpenMPI installed)"


def build_has_mpi():
    """Whether the build under test was compiled with MPI, from the flags make recorded (build/.flags: the Makefile
    adds -DHAVE_MPI where it finds mpicc), not from what the binary says of itself."""
    flags = os.path.join(BUILD, ".flags")
    assert os.path.isfile(flags), "%s missing: run make first" % flags
    with open(flags) as fh:
        return "-DHAVE_MPI" in fh.read().split()


def test_binary_has_the_builds_mpi():
    """test_runtime answers --misuse mpi_no_support as its build's flags say: "mpi supported" where make compiled
    with -DHAVE_MPI, the refusal otherwise (a binary left from a build with other flags fails here)."""
    assert os.access(BINARY, os.X_OK), "%s missing: run make first" % BINARY
    p = subprocess.run([BINARY, "--misuse", "mpi_no_support"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    if build_has_mpi():
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, "mpi supported", ""), (
            p.returncode, p.stdout, p.stderr)
    else:
        assert p.returncode == 2 and p.stderr.strip() == NO_MPI_LINE, (p.returncode, p.stdout, p.stderr)


def test_mpi_backend_without_mpi_is_clear(tmp_path):
    """A world asked for the mpi backend in a build without MPI stops with one line and exit status 2 (the
    runtime's stubs without HAVE_MPI: cpu/backend_mpi.c, runtime/mpi_world.c). In a build without MPI that is the
    build under test; in one with MPI the same sources are built again without it (make NO_MPI=1 into tmp_path, -O0: a
    few seconds) and that binary is run, so the property is checked in both."""
    binary = BINARY
    if build_has_mpi():
        build = tmp_path / "build-no-mpi"
        binary = str(build / "tests" / "test_runtime")
        env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # under make test
        p = subprocess.run(["make", "-s", "--no-print-directory", "-j2", "BUILD=%s" % build, "NO_MPI=1", "NO_CUDA=1",
                            "OPT=-O0", binary], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, "make NO_MPI=1 %s failed:\n%s%s" % (binary, p.stdout[-3000:], p.stderr[-3000:])
        with open(build / ".flags") as fh:
            assert "-DHAVE_MPI" not in fh.read().split()
    assert os.access(binary, os.X_OK), "%s missing: run make first" % binary
    p = subprocess.run([binary, "--misuse", "mpi_no_support"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, "exit %d, stdout:\n%s\nstderr:\n%s" % (p.returncode, p.stdout, p.stderr)
    assert p.stderr.strip() == NO_MPI_LINE, p.stderr
    assert "mpi supported" not in p.stdout, p.stdout


# ---------------------------------------------------------------------------------------------
# Race detector and collective watchdog: `build/tests/test_race --mode KIND` (see tests/test_race.c).
RACE_BINARY = os.path.join(BUILD, "tests", "test_race")

RACE_CASES = {
    "race_missing_wait": re.escape(
        "error: race on rank 0: compute stream's 'block1.matmul' reads 'block1.buffer' (comm_buffer, allocated in "
        "block1.pre_forward) at byte offset 1024 as block1 weights written by producer stream's 'block1.copy' with no "
        "event wait ordering it (record an event on producer after the write and make compute wait for it)"),
    "race_record_before_write": r"error: race on rank 0: compute stream's 'block1.matmul' reads 'block1.buffer' .*"
                                r"written by producer stream's 'block1.copy' with no event wait ordering it .*",
    "race_write_after_read": re.escape(
        "error: race on rank 0: writer stream's 'optimizer.memset' writes 'layers.0.wq.weight' (param_shard, "
        "allocated in optimizer.step) while compute stream's 'optimizer.copy' may still read it: no event wait "
        "orders the read before the write (record an event on compute after the read and make writer wait for it)"),
    "race_use_after_free": re.escape(
        "error: use after free on rank 0: compute stream's 'block2.copy' reads 'block2.all_gather_buffer' "
        "(comm_buffer, allocated in block2.pre_forward, freed in block2.pre_forward) after its dev_free (free "
        "a buffer only after enqueuing the last op that uses it)"),
    # pinned host memory is ordered like device memory: a d2h copy, then a read on another stream
    "race_host": re.escape(
        "error: race on rank 0: compute stream's 'optimizer.h2d' reads 'block1.host_grads' (grad_shard, allocated in "
        "block1.post_backward) written by copy stream's 'block1.d2h' with no event wait ordering it (record an event "
        "on copy after the write and make compute wait for it)"),
    "race_collective": re.escape(
        "error: race on rank 0: compute stream's 'block2.copy' reads 'block2.all_gather_buffer' (comm_buffer, "
        "allocated in block1.pre_forward) written by all_gather stream's 'block2.all_gather' with no event wait "
        "ordering it (record an event on all_gather after the write and make compute wait for it)"),
    # a receive writes its buffer on its stream: another stream reads it only after waiting
    "race_p2p": re.escape(
        "error: race on rank 1: other stream's 'stage1.copy' reads 'act_in' (activation, allocated in stage1.forward) "
        "written by compute stream's 'act.recv' with no event wait ordering it (record an event on compute after the "
        "write and make other wait for it)"),
    # a send and its receive that disagree on the microbatch: both ranks and both microbatches named
    "p2p_mismatch": re.escape(
        "error: point-to-point mismatch on stream 'compute': rank 0's send #0 to rank 1 is 'act' of microbatch 1 "
        "(64 floats), but rank 1's receive #0 from rank 0 is 'act' of microbatch 2 (64 floats) (sends and receives "
        "between two ranks pair up in the order each side issues them, whatever the stream; a send and a receive on "
        "one stream that wait on each other go in one dev_group_start / dev_group_end)"),
}
RACE_CLEAN = ["race_with_wait", "race_stream_sync", "race_event_sync", "race_off", "race_write_after_read_ordered",
              "race_collective_ordered", "p2p_grouped", "race_p2p_ordered"]


def _race_run(kind):
    assert os.access(RACE_BINARY, os.X_OK), "%s missing: run make first" % RACE_BINARY
    return subprocess.run([RACE_BINARY, "--mode", kind], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("kind", sorted(RACE_CASES))
def test_race_reported(kind):
    p = _race_run(kind)
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line, got:\n%s" % p.stderr
    assert re.fullmatch(RACE_CASES[kind], lines[0]), lines[0]


@pytest.mark.parametrize("kind", RACE_CLEAN)
def test_race_clean(kind):
    p = _race_run(kind)
    assert p.returncode == 0 and not p.stderr, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)


def test_race_verdict_is_deterministic():
    """4 thread-ranks hit the same race at slightly different times: always the same line."""
    seen = {_race_run("race_collective").stderr for _ in range(20)}
    assert len(seen) == 1, seen


WATCHDOG_CASES = {
    # rank 3 skips one all-gather: ranks 0-2 would wait forever
    "timeout_skip": r"error: collective timeout on rank 0: stream 'all_gather' #13 all_gather 64 f32 \(block2\) "
                    r"waited 1\.0 s; rank 3 never joined it .*",
    # a collective on a stream index the other ranks never created
    "timeout_stream": r"error: collective timeout on rank 0: stream 'extra' #0 all_reduce 16 f32 sum \(grad_norm\) "
                      r"waited 1\.0 s; ranks 1, 2 never joined it .*",
    # in a 2x2 mesh rank 1 skips its shard group's all-gather: rank 0 (its row) waits; row 1 is not involved
    "timeout_group": r"error: collective timeout on rank 0: stream 'all_gather' #1 all_gather 64 f32 in shard0 "
                     r"\(block2\) waited 1\.0 s; rank 1 never joined it \(every rank of a group must issue its "
                     r"collectives in the same order, on the same stream\)",
    # compute waits on an event recorded behind a collective that never completes
    "timeout_event": r"error: collective timeout on rank 0: stream 'all_gather' #0 all_gather 32 f32 \(block0\) "
                     r"waited 1\.0 s; rank 1 never joined it .*",
}


def test_p2p_deadlock_names_both_ranks_and_the_microbatch():
    """Two ranks that each send before they receive, outside a group, wait for each other (NCCL would hang the
    same way): whichever rank's watchdog fires names itself, its peer, the buffer and the microbatch, and the flight
    recorder shows each rank's send started and its receive still queued behind it."""
    p = _race_run("timeout_p2p")
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    one = (r"error: point-to-point timeout on rank (\d): stream 'compute' waited 1\.0 s for rank (\d) to receive "
           r"'(act|grad)' \(microbatch 0, 64 floats\), rank \1's send #0 to it; rank \2 never posted the matching "
           r"receive \(.*dev_group_start / dev_group_end\)")
    m = re.fullmatch(one, lines[0])
    assert m and {m.group(1), m.group(2)} == {"0", "1"}, lines[0]
    assert lines[1].startswith("flight recorder"), p.stderr
    assert lines[2].strip() == "rank 0: compute: #0 p2p (send 1 0 act) started, #1 p2p (recv 1 0 grad) issued; " \
                               "other: (no collectives)", p.stderr
    assert lines[3].strip() == "rank 1: compute: #0 p2p (send 0 0 grad) started, #1 p2p (recv 0 0 act) issued; " \
                               "other: (no collectives)", p.stderr


@pytest.mark.parametrize("kind", sorted(WATCHDOG_CASES))
def test_collective_watchdog(kind):
    p = _race_run(kind)  # a hang would hit _race_run's subprocess timeout: the watchdog's message says it stopped
    assert p.returncode == 2, "exit %d, stderr:\n%s" % (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert re.fullmatch(WATCHDOG_CASES[kind], lines[0]), lines[0]
    assert lines[1].startswith("flight recorder"), p.stderr
    ranks = {"timeout_skip": 4, "timeout_stream": 3, "timeout_event": 2, "timeout_group": 4}[kind]
    assert [l.split(":")[0].strip() for l in lines[2:]] == ["rank %d" % r for r in range(ranks)], p.stderr
