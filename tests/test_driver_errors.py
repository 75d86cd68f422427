"""Bad input to the training driver: one clear line on stderr, exit status 2,
never a crash, a hang or a silent wrong result."""
import json
import os
import struct
import subprocess

import pytest

from helpers import BASELINE, CORPUS, ROOT, solution_bin


def run(*args, timeout=60):
    return subprocess.run([BASELINE] + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def expect_error(p, message):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, "want exactly one line on stderr, got:\n" + p.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert message in lines[0], "%r not in %r" % (message, lines[0])


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


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown flag '--bogus'"),
    (["--steps"], "flag --steps needs a value"),
    (["--steps", "ten"], "--steps expects an integer, got 'ten'"),
    (["--lr", "-1"], "--lr must be in"),
    (["--flavor", "huge"], "unknown flavor 'huge'"),
    (["--dim", "66"], "dim 66 is not divisible by n-heads 4"),
    (["--n-heads", "4", "--n-kv-heads", "3"], "n-heads 4 is not divisible by n-kv-heads 3"),
    (["--dim", "12", "--n-heads", "4"], "head dim 3 (dim / n-heads) must be even"),
    (["--world", "0"], "--world must be in [1, 64], got 0"),
    (["--world", "65"], "--world must be in [1, 64], got 65"),
    (["--backend", "gloo"], "--backend expects local, mpi, nccl or nccl-mpi, got 'gloo'"),
    (["--backend", "nccl"], "--backend nccl needs the CUDA build (make cuda, then build-cuda/.../train)"),
    (["--backend", "nccl-mpi"], "--backend nccl-mpi needs the CUDA build (make cuda, then build-cuda/.../train)"),
    (["--reshard-after-forward=maybe"], "--reshard-after-forward expects true or false"),
    (["--data", "/nonexistent/tokens.npy"], "/nonexistent/tokens.npy"),
    (["--load", "/nonexistent/w.safetensors"], "/nonexistent/w.safetensors"),
    (["positional"], "unexpected argument 'positional'"),
])
def test_bad_flags(args, message):
    expect_error(run(*args), message)


def test_help_documents_every_flag():
    p = run("--help")
    assert p.returncode == 0
    src = open(os.path.join(ROOT, "common", "train_main.c")).read()
    import re
    flags = set(re.findall(r'!strcmp\(flag, "(--[a-z-]+)"\)', src))
    assert len(flags) > 25
    missing = [f for f in flags if f not in p.stdout]
    assert not missing, missing


def test_seq_len_larger_than_data(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("only a few bytes of text")
    expect_error(run("--data", small, "--seq-len", "64"), "seq-len 64 needs at least 66 tokens")


def test_token_outside_vocab(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "t.npy"
    np.save(path, (np.arange(1000) % 300).astype(np.uint16))
    expect_error(run("--data", path, "--vocab-size", "259"), "outside the vocabulary")


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
    expect_error(run("--load", tmp_path / "missing.safetensors"), "layers.1.feed_forward.w2.weight")

    wrong = dict(tensors)
    d, s, b = wrong["output.weight"]
    wrong["output.weight"] = (d, [s[1], s[0]], b)
    write_st(tmp_path / "shape.safetensors", wrong)
    expect_error(run("--load", tmp_path / "shape.safetensors"), "output.weight")

    f16 = dict(tensors)
    d, s, b = f16["norm.weight"]
    f16["norm.weight"] = ("F16", s, b[: len(b) // 2])
    write_st(tmp_path / "dtype.safetensors", f16)
    expect_error(run("--load", tmp_path / "dtype.safetensors"), "F16")

    write_st(tmp_path / "header.safetensors", {}, header_override=b"{not json")
    expect_error(run("--load", tmp_path / "header.safetensors"), "header.safetensors")


def test_mpi_world_disagrees_with_mpirun():
    import shutil
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian: openmpi-bin)")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", solution_bin("02"), "--backend", "mpi",
                        "--world", "4", "--steps", "1", "--data", CORPUS], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert p.returncode != 0
    assert "--world 4 but mpirun started 2 processes" in p.stderr, p.stderr
