"""Bad input to the training driver: one clear line on stderr, exit status 2,
never a crash, a hang or a silent wrong result."""
import json
import os
import struct
import subprocess

import pytest

import manifest
from helpers import BASELINE, CORPUS, ROOT, SOLVED, apply_mutant, solution_bin


def run(*args, timeout=60):
    return subprocess.run([BASELINE] + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def expect_error(p, message):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, "want exactly one line on stderr, got:\n" + p.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert message in lines[0], "%r not in %r" % (message, lines[0])


def need(*stages):
    """Skip where a stage's solution is not in the tree (a student copy)."""
    missing = [s for s in stages if not any(st.id == s for st in SOLVED)]
    if missing:
        pytest.skip("stage %s's solution is the instructors' (not in a student tree)" % missing[0])


def mpirun_env():
    """mpirun's environment (as root), or a skip where OpenMPI is absent."""
    import shutil
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian: openmpi-bin)")
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def expect_exact(p, message):
    """Exit status 2 and stderr exactly "error: <message>\n"."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stderr == "error: " + message + "\n", p.stderr


def write_st(path, tensors, header_override=None):
    """A safetensors file from {name: (dtype, shape, bytes)}."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = header_override if header_override is not None else json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


LONG = "x" * 80
# model.h's MODEL_FLAVORS
FLAVORS = "tiny, debugmodel, 1B, 8B, 70B, llama2-7B, llama2-13B, llama2-70B, llama3.1-8B, llama3.1-70B, llama3.1-405B"


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown flag '--bogus' (see --help)"),
    (["--" + LONG + "=1"], "unknown flag '--%s=1' (see --help)" % LONG),
    (["--steps"], "flag --steps needs a value (see --help)"),
    (["--steps", "ten"], "--steps expects an integer, got 'ten'"),
    (["--steps", "99999999999999999999"], "--steps expects an integer, got '99999999999999999999'"),
    (["--lr", "-1"], "--lr must be in [0, 10], got -1"),
    (["--lr", "abc"], "--lr expects a number, got 'abc'"),
    (["--lr", "nan"], "--lr must be in [0, 10], got nan"),
    (["--flavor", "huge"], "unknown flavor 'huge' (%s)" % FLAVORS),
    (["--flavor", LONG], "unknown flavor '%s' (%s)" % (LONG, FLAVORS)),
    (["--dim", "66"], "dim 66 is not divisible by n-heads 4"),
    (["--n-heads", "4", "--n-kv-heads", "3"], "n-heads 4 is not divisible by n-kv-heads 3"),
    (["--dim", "12", "--n-heads", "4"], "head dim 3 (dim / n-heads) must be even for RoPE"),
    (["--world", "0"], "--world must be in [1, 16384], got 0"),
    (["--world", "65"], "--world 65: a run that computes executes every rank, one thread each, at most 64; a dry "
                        "run (--dry-run) models up to 16384 by executing one rank per class of symmetric ranks"),
    (["--backend", "gloo"], "--backend expects local, mpi, nccl or nccl-mpi, got 'gloo'"),
    (["--device-profile", "h200"], "--device-profile: no profile 'h200' (profiles: teach, a100-80g, h100-sxm, h100-gt)"),
    (["--device-profile"], "flag --device-profile needs a value (see --help)"),
    (["--backend", "nccl"], "--backend nccl needs the CUDA build (make cuda, then build-cuda/.../train)"),
    (["--backend", "nccl-mpi"], "--backend nccl-mpi needs the CUDA build (make cuda, then build-cuda/.../train)"),
    (["--reshard-after-forward=maybe"], "--reshard-after-forward expects true or false, got 'maybe'"),
    (["--save-every", "2"], "--save-every needs --save FILE"),
    (["--grad-accum", "3"], "--grad-accum 3 must divide --batch-size 2 (each microbatch holds batch-size / K sequences)"),
    (["--grad-sync", "sometimes"], "--grad-sync expects every or last, got 'sometimes'"),
    (["--param-dtype", "fp16"], "--param-dtype expects fp32 or bf16, got 'fp16'"),
    (["--reduce-dtype=bfloat16"], "--reduce-dtype expects fp32 or bf16, got 'bfloat16'"),
    (["--mesh", "2"], "--mesh expects R,S or RxS (replicas, shards: two positive integers), got '2'"),
    (["--mesh", "0,4", "--world", "4"], "--mesh expects R,S or RxS (replicas, shards: two positive integers), got '0,4'"),
    (["--mesh", "2,2,1"], "--mesh expects R,S or RxS (replicas, shards: two positive integers), got '2,2,1'"),
    (["--mesh", "2,3", "--world", "4"], "--mesh 2,3 holds 6 ranks but --world is 4 (R*S must equal the world)"),
    (["--ranks-per-node", "3", "--world", "4"], "--ranks-per-node 3 must divide --world 4"),
    (["--backward-prefetch", "later"], "--backward-prefetch expects pre, post or none, got 'later'"),
    (["--pcie-gbps", "-1"], "--pcie-gbps must be in [0, 1e+06], got -1"),
    (["--data", "/nonexistent/tokens.npy"], "cannot open /nonexistent/tokens.npy: No such file or directory"),
    (["--load", "/nonexistent/w.safetensors"], "cannot open /nonexistent/w.safetensors: No such file or directory"),
    (["positional"], "unexpected argument 'positional' (see --help)"),
], ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else "")
def test_bad_flags(args, message):
    expect_exact(run(*args), message)


def test_directory_as_a_file(tmp_path):
    # fopen() takes a directory: it used to end in "out of host memory allocating 9223372036854775808 bytes"
    expect_exact(run("--data", tmp_path), "cannot read %s: Is a directory" % tmp_path)
    expect_exact(run("--load", tmp_path), "cannot read %s: Is a directory" % tmp_path)


def test_out_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    expect_exact(run("--steps", "1", "--out", blocker / "run"),
                 "cannot create directory %s: Not a directory" % (blocker / "run"))


def long_quoted_path(tmp_path, length):
    """A path of exactly `length` characters to a small text file, with '"' and '\\' in a directory's and the
    file's names: it goes down into that directory and back up ("D/..") as often as it takes."""
    d = 'dir "quoted" \\back\\slashed ' + "d" * 200  # within NAME_MAX (255)
    (tmp_path / d).mkdir()
    name = 'tokens "q" \\b\\.txt'
    (tmp_path / name).write_text("a few bytes of text for a short sequence, and some more\n" * 4)
    path = str(tmp_path) + ("/" + d + "/..") * ((length - len(str(tmp_path)) - len(name) - 1) // (len(d) + 4))
    path += "/" * (length - len(path) - len(name)) + name  # "//" is "/": pad to the exact length
    assert len(path) == length and os.path.isfile(path)
    return path


def test_run_json_holds_any_data_path(tmp_path):
    """run.json used to be formatted into a 4,096-byte buffer with the data path unescaped: a path of 3,432
    characters made 4,160 bytes of invalid JSON (64 bytes read past the buffer), a '"' in it broke the file.
    A path longer than PATH_MAX (4,096 with its NUL) cannot be opened, so the longest that can be, 4,095
    characters, stands for the 5,000 of the report; its escaped quotes and backslashes make the file longer."""
    path = long_quoted_path(tmp_path, 4095)
    out = tmp_path / "run"
    p = run("--data", path, "--seq-len", "8", "--steps", "0", "--quiet", "--out", out)
    assert p.returncode == 0, p.stderr
    raw = (out / "run.json").read_bytes()
    assert len(raw) > 4096 + 600 and raw.endswith(b"}\n")
    with open(out / "run.json") as fh:
        meta = json.load(fh)
    assert meta["data"] == path
    assert meta["seq_len"] == 8 and meta["host"], meta


def test_out_near_path_max(tmp_path):
    """An --out whose run.json fits in PATH_MAX but whose other files do not: the paths used to be cut to
    4,096 bytes with snprintf, so metrics.jsonl went to a file of another name. Now the run stops at the
    first file it cannot write, in one line with the reason, and leaves no file of a cut name."""
    out = str(tmp_path)
    while len(out) < 4085 - 201:
        out += "/" + "o" * 200
    out += "/" + "p" * (4085 - len(out) - 1)
    assert len(out) == 4085 and len(out + "/run.json") < 4096 < len(out + "/metrics.jsonl")
    p = run("--seq-len", "8", "--steps", "1", "--quiet", "--out", out)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and lines[0].endswith(": File name too long"), p.stderr[-500:]
    assert sorted(os.listdir(out)) == ["run.json"], os.listdir(out)


def test_help_documents_every_flag():
    """Every row of the flag table (options.c's FLAGS) is in --help, and every flag --help names is a row."""
    p = run("--help")
    assert p.returncode == 0
    src = open(os.path.join(ROOT, "common", "driver", "options.c")).read()
    import re
    flags = set(re.findall(r'\.name = "(--[a-z0-9-]+)"', src))
    assert len(flags) > 25
    missing = [f for f in flags if f not in p.stdout]
    assert not missing, missing
    listed = set(re.findall(r'(?:^  |\s)(--[a-z0-9-]+)', p.stdout, re.M))
    assert listed == flags, listed ^ flags


def test_seq_len_larger_than_data(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("only a few bytes of text")
    expect_exact(run("--data", small, "--seq-len", "64"), "seq-len 64 needs at least 66 tokens but %s has 24" % small)


def test_token_outside_vocab(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "t.npy"
    np.save(path, (np.arange(1000) % 300).astype(np.uint16))
    expect_exact(run("--data", path, "--vocab-size", "259"),
                 "%s: token 259 at index 259 is outside the vocabulary (vocab-size 259)" % path)


def test_truncated_npy(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "t.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    p = run("--data", path)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "t.npy" in p.stderr


def test_save_init_then_load_round_trip(tmp_path):
    init = tmp_path / "init.safetensors"
    assert run("--save-init", init).returncode == 0
    a = run("--load", init, "--steps", "2", "--out", tmp_path / "a", "--quiet")
    b = run("--seed", "0", "--steps", "2", "--out", tmp_path / "b", "--quiet")
    assert a.returncode == 0 and b.returncode == 0
    assert (tmp_path / "a" / "metrics.jsonl").read_text().split('"step_ms"')[0] == \
        (tmp_path / "b" / "metrics.jsonl").read_text().split('"step_ms"')[0]


def test_safetensors_wrong_shape_dtype_missing(tmp_path):
    init = tmp_path / "init.safetensors"
    assert run("--save-init", init).returncode == 0
    raw = init.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    tensors = {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
               for k, v in header.items() if k != "__metadata__"}

    missing = dict(tensors)
    del missing["layers.1.feed_forward.w2.weight"]
    write_st(tmp_path / "missing.safetensors", missing)
    expect_exact(run("--load", tmp_path / "missing.safetensors"),
                 "tensor 'layers.1.feed_forward.w2.weight' missing from %s" % (tmp_path / "missing.safetensors"))

    wrong = dict(tensors)
    d, s, b = wrong["output.weight"]
    wrong["output.weight"] = (d, [s[1], s[0]], b)
    write_st(tmp_path / "shape.safetensors", wrong)
    expect_exact(run("--load", tmp_path / "shape.safetensors"),
                 "tensor 'output.weight' in %s has shape [%d, %d], expected [%d, %d]"
                 % (tmp_path / "shape.safetensors", s[1], s[0], s[0], s[1]))

    f16 = dict(tensors)
    d, s, b = f16["norm.weight"]
    f16["norm.weight"] = ("F16", s, b[: len(b) // 2])
    write_st(tmp_path / "dtype.safetensors", f16)
    expect_exact(run("--load", tmp_path / "dtype.safetensors"),
                 "%s: tensor 'norm.weight' has dtype F16, only F32 is supported" % (tmp_path / "dtype.safetensors"))

    write_st(tmp_path / "header.safetensors", {}, header_override=b"{not json")
    expect_exact(run("--load", tmp_path / "header.safetensors"),
                 "%s: header is not valid JSON (expected a string at header byte 1)" % (tmp_path / "header.safetensors"))


@pytest.mark.parametrize("step", [None, "", "abc", "-1", "7x", "100000001"])
def test_checkpoint_with_optimizer_state_needs_a_step(tmp_path, step):
    ck = tmp_path / "ck.safetensors"
    assert run("--save", ck, "--steps", "1", "--out", tmp_path / "run", "--quiet").returncode == 0
    raw = ck.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["step"] == "1"
    if step is None:
        del header["__metadata__"]["step"]
    else:
        header["__metadata__"]["step"] = step
    h = json.dumps(header).encode()
    ck.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    expect_exact(run("--load", ck, "--steps", "2"),
                 '%s: has optimizer state but no valid "step" in its metadata' % ck)


def test_mpi_world_disagrees_with_mpirun():
    env = mpirun_env()
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", BASELINE, "--backend", "mpi",
                        "--world", "4", "--steps", "1", "--data", CORPUS], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert p.returncode != 0
    assert "--world 4 but mpirun started 2 processes" in p.stderr, p.stderr


def test_bf16_params_need_a_stage_that_casts(tmp_path):
    """A stage before 08 run with --param-dtype bf16 leaves Param.data_bf16 NULL: one line naming the hook and
    the flag, not a crash in compute. Every rank (a thread) hits it at once; the process reports the first
    and only that one, on every run (20 runs: two lines came out in about 2% of them before)."""
    need("04")
    binary = solution_bin("04")
    for _ in range(20):
        p = subprocess.run([binary, "--world", "4", "--steps", "1", "--param-dtype", "bf16", "--quiet", "--data",
                            CORPUS], capture_output=True, text=True, timeout=60, cwd=ROOT)
        expect_exact(p, "embedding: tok_embeddings.weight has no unsharded data after fsdp_pre_forward "
                        "(Param.data_bf16 is NULL) (--param-dtype bf16: compute reads Param.data_bf16; a stage "
                        "before 08 sets only Param.data)")


def test_mesh_needs_a_stage_that_splits_over_the_shard_group():
    """A stage before 09 run with --mesh splits over the world: one line after fsdp_init naming the param, the
    split it made and the one the mesh asks for, not a silent 1-D run."""
    need("04")
    p = subprocess.run([solution_bin("04"), "--world", "4", "--mesh", "2,2", "--steps", "1", "--quiet", "--data",
                        CORPUS], capture_output=True, text=True, timeout=60, cwd=ROOT)
    expect_exact(p, "--mesh 2,2: embedding's DTensor tok_embeddings.weight holds 65 padded rows of 259, not "
                    "ceil(259 / 2) = 130: on a 2-D mesh params are split over the 2 ranks of the shard group "
                    "(FsdpConfig.mesh->shard_group; HANDOUT.md, HSDP)")


def test_offload_needs_a_stage_that_offloads():
    """A stage before 10 run with --offload-params keeps its shards on the device: one line after fsdp_init."""
    need("04")
    p = subprocess.run([solution_bin("04"), "--world", "2", "--offload-params", "--steps", "1", "--quiet", "--data",
                        CORPUS], capture_output=True, text=True, timeout=60, cwd=ROOT)
    expect_exact(p, "--offload-params: embedding's DTensor tok_embeddings.weight keeps its shard in device memory: "
                    "with --offload-params the shards live in pinned host memory (dev_alloc_host; HANDOUT.md, "
                    "--offload-params)")


def train(stage, *args):
    return subprocess.run([solution_bin(stage), "--world", "4", "--steps", "1", "--quiet", "--data", CORPUS]
                          + [str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=ROOT)


PREFETCH_IGNORED = [
    # stage 04 prefetches as pre whatever the flag says
    ("04", "post", "block1's backward all-gather was issued in head's pre_backward, not head's post_backward: the "
                   "hooks follow --backward-prefetch pre's schedule, not post's"),
    ("04", "none", "block1's backward all-gather was issued in head's pre_backward, not block1's pre_backward: the "
                   "hooks follow --backward-prefetch pre's schedule, not none's"),
    # stage 03 has no backward prefetch at all
    ("03", "pre", "block1's backward all-gather was issued in block1's pre_backward, not head's pre_backward: the "
                  "hooks follow --backward-prefetch none's schedule, not pre's"),
]


@pytest.mark.parametrize("stage,policy,says", PREFETCH_IGNORED, ids=["%s-%s" % c[:2] for c in PREFETCH_IGNORED])
def test_backward_prefetch_needs_a_stage_that_follows_it(stage, policy, says):
    """A stage before 10 run with --backward-prefetch issues its backward all-gathers on its own schedule: one
    line after the first backward naming a module, the hook that issued its all-gather and the hook the policy
    asks for, not a run of another policy under the flag's name. Every rank (a thread) finds it at once: one
    line on every run."""
    need(stage)
    for _ in range(5):
        expect_exact(train(stage, "--backward-prefetch", policy),
                     "--backward-prefetch %s: %s (FsdpConfig.backward_prefetch; HANDOUT.md, --backward-prefetch)"
                     % (policy, says))


def test_single_comm_stream_needs_a_stage_that_follows_it():
    """A stage that gives its reduce-scatters their own stream, run with --single-comm-stream: one line."""
    need("04")
    expect_exact(train("04", "--single-comm-stream"),
                 "--single-comm-stream: the all-gathers and reduce-scatters ran on 2 streams (all_gather, "
                 "reduce_scatter): with --single-comm-stream every one goes on one stream "
                 "(FsdpConfig.single_comm_stream; HANDOUT.md, --single-comm-stream)")


def test_single_comm_stream_holds_for_every_step(tmp_path):
    """--single-comm-stream is one rule for the whole run, stated once (common/driver/flag_check.c; the grader
    relies on it): the stage that teaches it, changed to move its reduce-scatters to a new stream after the first
    backward, runs step 1 on one stream and stops at step 2's first reduce-scatter with the same line."""
    st = manifest.flag_stage("--single-comm-stream")
    if st is None:
        pytest.skip("no stage of this tree's rubric teaches --single-comm-stream")
    need(st.id)
    src = tmp_path / "hw_fsdp.c"
    apply_mutant({"base": os.path.relpath(st.solution_src(), ROOT), "replace": [
        ["    Stream *compute, *ag_stream, *rs_stream;", "    Stream *compute, *ag_stream, *rs_stream, *late;"],
        ["    release_all_gather_state(f); /* the backward's last one, before the optimizer */",
         "    release_all_gather_state(f); /* the backward's last one, before the optimizer */\n"
         "    if (!f->late) f->rs_stream = f->late = dev_stream_create(f->dev, \"late\");"]]}, str(src))
    binary = tmp_path / "train"
    b = subprocess.run(["make", "-s", "--no-print-directory", "impl", "SRC=%s" % src, "OUT=%s" % binary], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout + b.stderr
    one = subprocess.run([str(binary), "--world", "2", "--steps", "1", "--quiet", "--data", CORPUS,
                          "--single-comm-stream", "--out", str(tmp_path / "one")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert one.returncode == 0, one.stderr  # the first step keeps to one stream
    for _ in range(3):
        expect_exact(subprocess.run([str(binary), "--world", "2", "--steps", "2", "--quiet", "--data", CORPUS,
                                     "--single-comm-stream", "--out", str(tmp_path / "two")], capture_output=True,
                                    text=True, timeout=120, cwd=ROOT),
                     "--single-comm-stream: the all-gathers and reduce-scatters ran on 2 streams (all_gather, late): "
                     "with --single-comm-stream every one goes on one stream (FsdpConfig.single_comm_stream; "
                     "HANDOUT.md, --single-comm-stream)")


@pytest.mark.parametrize("stage,flags", [
    ("04", ["--backward-prefetch", "pre"]),            # what stage 04 does: nothing to say
    ("03", ["--backward-prefetch", "none"]),           # stage 03 never prefetches: that is none
    ("02", ["--single-comm-stream"]),                  # stage 02 queues every collective on the compute stream
    ("06", ["--backward-prefetch", "post", "--reshard-after-forward=false"]),  # no all-gather in the backward
    ("10", ["--backward-prefetch", "post", "--single-comm-stream", "--ac"]),
    ("10", ["--backward-prefetch", "none", "--grad-accum", "2"]),
], ids=["04-pre", "03-none", "02-single", "06-zero2-post", "10-post-single-ac", "10-none-accum"])
def test_flags_a_stage_follows_run_on(stage, flags):
    """The check stops only a schedule that is exactly another policy's (or collectives on two streams)."""
    need(stage)
    p = train(stage, *flags)
    assert p.returncode == 0, p.stderr


def test_backward_prefetch_ignored_under_mpirun():
    """The same check with one process per rank (the mpi backend reports collectives the same way): each
    process stops with the line."""
    need("04")
    env = mpirun_env()
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", solution_bin("04"), "--backend", "mpi", "--world",
                        "2", "--steps", "1", "--quiet", "--data", CORPUS, "--backward-prefetch", "post"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode != 0
    assert ("error: --backward-prefetch post: block1's backward all-gather was issued in head's pre_backward, not "
            "head's post_backward: the hooks follow --backward-prefetch pre's schedule") in p.stderr, p.stderr


def test_help_states_each_default_once_and_it_is_the_one_used(tmp_path):
    """--help prints a flag's default from its table row (.def) once, at the end of its text, and the help texts
    do not repeat it: the default said is the default a run without the flag records in run.json."""
    p = run("--help")
    assert p.returncode == 0, p.stderr
    entries, cur = {}, None  # flag -> its text (continuation lines joined)
    for line in p.stdout.splitlines():
        if line.startswith("  --"):
            cur = line.split()[0].split("=")[0]
            entries[cur] = line
        elif line.startswith(" " * 20) and cur:
            entries[cur] += " " + line.strip()
        else:
            cur = None
    said = {f: t for f, t in entries.items() if "(default " in t}
    for f, t in said.items():
        assert t.count("default") == 1, t  # never a second "default" in the text itself
    assert {"--seq-len", "--batch-size", "--steps", "--lr", "--warmup-steps", "--weight-decay", "--max-norm", "--seed",
            "--world", "--grad-accum", "--grad-sync", "--reduce-dtype", "--param-dtype", "--backward-prefetch",
            "--pp-schedule", "--profile-steps", "--reshard-after-forward", "--flavor"} <= set(said)
    out = tmp_path / "run"
    r = run("--steps", "1", "--out", out, "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr
    with open(out / "run.json") as fh:
        cfg = json.load(fh)
    keys = {"--seq-len": "seq_len", "--batch-size": "batch_size", "--lr": "lr", "--warmup-steps": "warmup_steps",
            "--weight-decay": "weight_decay", "--max-norm": "max_norm", "--seed": "seed", "--world": "world_size",
            "--grad-accum": "grad_accum", "--grad-sync": "grad_sync", "--reduce-dtype": "reduce_dtype",
            "--param-dtype": "param_dtype", "--backward-prefetch": "backward_prefetch",
            "--profile-steps": "profile_steps", "--flavor": "flavor", "--reshard-after-forward": "reshard_after_forward"}
    for flag, key in keys.items():
        default = said[flag].rsplit("(default ", 1)[1].rstrip(")")
        value = cfg[key]
        if isinstance(value, bool):
            assert default == ("true" if value else "false"), (flag, default, value)
        elif isinstance(value, (int, float)):
            assert float(default) == pytest.approx(value, rel=1e-6), (flag, default, value)
        else:
            assert default == value, (flag, default, value)
