"""Bad token and weight files end in one clear line, and files written by numpy
/ Python load in C and vice versa.

Runs the probe modes of tests/test_io.c (compiled here with gcc from the
sources, so the test never depends on a stale build):
    /usr/bin/python3 -m pytest tests/test_io_errors.py
"""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["tests/test_io.c", "common/model/optim.c", "common/model/data.c", "common/model/safetensors.c",
           "common/runtime/json.c", "common/runtime/util.c"]


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("bin") / "test_io")
    cmd = [os.environ.get("CC", "gcc"), "-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror",
           "-Wno-unused-parameter", "-D_GNU_SOURCE", "-pthread", "-Icommon", "-Itests"] + SOURCES + [
           "-lm", "-o", exe]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return exe


def run(probe, *args):
    return subprocess.run([probe] + [str(a) for a in args], capture_output=True, text=True)


def fails_with(probe, message, *args):
    r = run(probe, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == "error: " + message + "\n", r.stderr
    assert r.stdout == ""


# ------------------------------------------------------------------ tokens

def loaded(probe, path):
    r = run(probe, "--load-npy", path)
    assert r.returncode == 0, r.stderr
    head, toks = r.stdout.split("\n", 1)
    n, mx = int(head.split()[1]), int(head.split()[3])
    return n, mx, [int(t) for t in toks.split()]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_numpy_npy_loads(probe, tmp_path, dtype):
    tokens = (np.arange(1000, dtype=np.int64) * 7919 % 60000).astype(dtype)
    p = tmp_path / "t.npy"
    np.save(p, tokens)
    n, mx, got = loaded(probe, p)
    assert n == 1000 and mx == int(tokens.max()) and got == tokens.astype(np.int64).tolist()


def test_npy_version_2(probe, tmp_path):
    tokens = np.array([5, 4, 3, 2, 1, 0, 65535], dtype=np.uint16)
    p = tmp_path / "v2.npy"
    with open(p, "wb") as f:
        np.lib.format.write_array(f, tokens, version=(2, 0))
    assert loaded(probe, p)[2] == tokens.tolist()


def test_c_npy_is_numpy_bytes(probe, tmp_path):
    for n in (1, 300, 123456):
        p = tmp_path / "c.npy"
        r = run(probe, "--save-npy", p, n)
        assert r.returncode == 0, r.stderr
        want = (np.arange(n, dtype=np.int64) * 7919 % 100003).astype(np.int32)
        np.testing.assert_array_equal(np.load(p), want)
        q = tmp_path / "np.npy"
        np.save(q, want)
        assert p.read_bytes() == q.read_bytes()


def test_text_is_bytes(probe, tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"Ab\n\x00\xff")
    assert loaded(probe, p) == (5, 255, [65, 98, 10, 0, 255])


# arrays numpy saves that the loader refuses; keep: the bytes of the saved file left (a slice), or None for all
SAVED_BAD_NPY = [
    ("trunc", np.arange(1000, dtype=np.uint16), slice(None, -1000),
     "truncated .npy data: shape (1000,) of '<u2' needs 2000 bytes, the file has 1000"),
    ("trunchead", np.arange(10, dtype=np.int32), slice(None, 40),
     "truncated .npy header (header says 118 bytes, file has 30 after the preamble)"),
    ("f", np.zeros(10, dtype=np.float32), None, "unsupported dtype '<f4' (want uint16 or int32 .npy)"),
    ("l", np.zeros(10, dtype=np.int64), None, "unsupported dtype '<i8' (want uint16 or int32 .npy)"),
    ("m", np.zeros((3, 4), dtype=np.int32), None, ".npy array has shape (3, 4); only 1-D token arrays are supported"),
    ("neg", np.array([1, 2, 3, -5, 4], dtype=np.int32), None, "negative token -5 at index 3"),
    ("empty", np.zeros(0, dtype=np.uint16), None, ".npy array has no tokens"),
]


@pytest.mark.parametrize("name,array,keep,message", SAVED_BAD_NPY, ids=[c[0] for c in SAVED_BAD_NPY])
def test_saved_bad_npy(probe, tmp_path, name, array, keep, message):
    p = tmp_path / f"{name}.npy"
    np.save(p, array)
    if keep is not None:
        p.write_bytes(p.read_bytes()[keep])
    fails_with(probe, f"{p}: {message}", "--load-npy", p)


def test_empty_file(probe, tmp_path):
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    fails_with(probe, f"{p}: file is empty (no tokens)", "--load-npy", p)


def test_missing_file(probe, tmp_path):
    p = tmp_path / "nope.npy"
    fails_with(probe, f"cannot open {p}: No such file or directory", "--load-npy", p)


def npy_bytes(header, data=b"", version=1, pad=True):
    """An .npy file with this header text (numpy's layout: padded with spaces and a newline)."""
    h = header.encode("latin1")
    pre = 10 if version == 1 else 12
    if pad:
        h += b" " * (-(pre + len(h) + 1) % 64) + b"\n"
    size = struct.pack("<H", len(h)) if version == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([version, 0]) + size + h + data


U2_4 = "{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }"
BAD_NPY = [
    ("magiconly", b"\x93NUMPY\x01", "truncated .npy header (7 bytes)"),
    ("v2short", b"\x93NUMPY\x02\x00\x10\x00", "truncated .npy header (10 bytes)"),
    ("version", npy_bytes(U2_4, b"\0" * 8, version=9), "unsupported .npy format version 9.0"),
    ("fortran2d", npy_bytes("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 2), }", b"\0" * 16),
     ".npy array is in Fortran order; only C order is supported"),
    ("toolarge", npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (18446744073709551615,), }"),
     ".npy shape (18446744073709551615,) is too large"),
    ("extrabytes", npy_bytes(U2_4, b"\0" * 10), ".npy file has 2 unexpected bytes after the 8 data bytes"),
    ("notdict", npy_bytes("['descr', '<u2']"), "malformed .npy header (expected '{' at header byte 0)"),
    ("unquotedkey", npy_bytes("{descr: '<u2', 'fortran_order': False, 'shape': (4,), }", b"\0" * 8),
     "malformed .npy header (expected a quoted string at header byte 1)"),
    ("longkey", npy_bytes("{'" + "k" * 40 + "': 1}"), "malformed .npy header (unexpected string at header byte 33)"),
    ("unterminated", npy_bytes("{'descr", pad=False), "malformed .npy header (unterminated string at header byte 7)"),
    ("notbool", npy_bytes("{'descr': '<u2', 'fortran_order': 0, 'shape': (4,), }", b"\0" * 8),
     "malformed .npy header (expected True or False at header byte 34)"),
    ("notdim", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (x,), }", b"\0" * 8),
     "malformed .npy header (expected a dimension at header byte 51)"),
    ("dimtoolarge", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (99999999999999999999999,), }"),
     "malformed .npy header (dimension too large at header byte 70)"),
    ("ninedims", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", b"\0" * 2),
     "malformed .npy header (too many dimensions at header byte 68)"),
    ("shapesep", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (4 4), }", b"\0" * 8),
     "malformed .npy header (expected ',' or ')' at header byte 53)"),
    ("dictsep", npy_bytes("{'descr': '<u2' 'fortran_order': False, 'shape': (4,), }", b"\0" * 8),
     "malformed .npy header (expected ',' or '}' at header byte 16)"),
    ("trailing", npy_bytes(U2_4 + " x", b"\0" * 8), "malformed .npy header (trailing characters at header byte 58)"),
    ("unknownkey", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (4,), 'x': 1}", b"\0" * 8),
     "malformed .npy header (unexpected key 'x')"),
    ("duplicatekey", npy_bytes("{'descr': '<u2', 'descr': '<u2', 'fortran_order': False, 'shape': (4,), }", b"\0" * 8),
     "malformed .npy header (duplicate key 'descr')"),
    ("noshape", npy_bytes("{'descr': '<u2', 'fortran_order': False}", b"\0" * 8),
     "malformed .npy header (missing 'shape')"),
    ("nodescr", npy_bytes("{'fortran_order': False, 'shape': (4,)}", b"\0" * 8),
     "malformed .npy header (missing 'descr')"),
    ("nofortran", npy_bytes("{'descr': '<u2', 'shape': (3,), }", b"\0" * 6),
     "malformed .npy header (missing 'fortran_order')"),
]


@pytest.mark.parametrize("name,content,message", BAD_NPY, ids=[c[0] for c in BAD_NPY])
def test_bad_npy(probe, tmp_path, name, content, message):
    p = tmp_path / f"{name}.npy"
    p.write_bytes(content)
    fails_with(probe, f"{p}: {message}", "--load-npy", p)


def test_directory_is_not_a_token_or_weight_file(probe, tmp_path):
    # fopen() takes a directory; it used to end in "out of host memory allocating 9223372036854775808 bytes"
    fails_with(probe, f"cannot read {tmp_path}: Is a directory", "--load-npy", tmp_path)
    fails_with(probe, f"cannot read {tmp_path}: Is a directory", "--load-st", tmp_path)


def test_check_arguments(probe, tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"x" * 100)
    fails_with(probe, "seq-len must be at least 1", "--check", p, 0, 259)
    fails_with(probe, "vocab-size must be positive (got 0)", "--check", p, 8, 0)


def test_seq_len_too_long(probe, tmp_path):
    p = tmp_path / "short.txt"
    p.write_bytes(b"x" * 300)
    fails_with(probe, f"seq-len 512 needs at least 514 tokens but {p} has 300", "--check", p, 512, 259)
    assert run(probe, "--check", p, 298, 259).returncode == 0


def test_token_outside_vocab(probe, tmp_path):
    p = tmp_path / "big.npy"
    t = np.arange(100, dtype=np.uint16) % 250
    t[12] = 300
    np.save(p, t)
    fails_with(probe, f"{p}: token 300 at index 12 is outside the vocabulary (vocab-size 259)",
               "--check", p, 16, 259)
    assert run(probe, "--check", p, 16, 301).returncode == 0


@pytest.mark.parametrize("step,rank,world,B,T", [(0, 0, 1, 2, 8), (5, 1, 4, 3, 50), (1000, 3, 8, 2, 90)])
def test_batch_contract(probe, tmp_path, step, rank, world, B, T):
    n = 997
    tokens = (np.arange(n) * 31 % 1000).astype(np.int32)
    p = tmp_path / "b.npy"
    np.save(p, tokens)
    r = run(probe, "--batch", p, step, rank, world, B, T)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    inputs, targets = [int(x) for x in lines[0].split()], [int(x) for x in lines[1].split()]
    want_in, want_tg = [], []
    for i in range(B):
        start = ((step * world + rank) * B + i) * T % (n - T - 1)
        want_in += tokens[start:start + T].tolist()
        want_tg += tokens[start + 1:start + T + 1].tolist()
    assert inputs == want_in and targets == want_tg


# ------------------------------------------------------------- safetensors

def st_bytes(header, data=b"", header_len=None, pad=True):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + data


def write_st_py(path, tensors, metadata=None):
    """A minimal safetensors writer (what the safetensors package writes)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    path.write_bytes(st_bytes(header, b"".join(blobs)))


def read_st_py(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32"
        b, en = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + b:8 + n + en], dtype="<f4").reshape(e["shape"])
    return out, meta, n


def c_loaded(probe, path):
    r = run(probe, "--load-st", path)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        name, ndim, shape, vals = line.split("|")
        shape = [int(s) for s in shape.split(",")] if shape else []
        assert len(shape) == int(ndim)
        out[name] = np.array([float(v) for v in vals.split()], dtype=np.float32).reshape(shape)
    return out


def test_c_written_loads_in_python(probe, tmp_path):
    p = tmp_path / "c.safetensors"
    assert run(probe, "--write-st", p).returncode == 0
    tensors, meta, n = read_st_py(p)
    assert n % 8 == 0
    assert meta == {"format": "pt", "step": "7"}
    assert list(tensors) == ["tok_embeddings.weight", "norm.weight", "cube"]
    b = np.array([0.5, -0.25, 1e-20, 123456.789], dtype=np.float32)
    np.testing.assert_array_equal(tensors["tok_embeddings.weight"],
                                  (np.arange(12, dtype=np.float32) / np.float32(3)).reshape(4, 3))
    np.testing.assert_array_equal(tensors["norm.weight"], b)
    np.testing.assert_array_equal(tensors["cube"], b.reshape(1, 2, 2))
    assert os.path.getsize(p) == 8 + n + 4 * (12 + 4 + 4)


def test_python_written_loads_in_c(probe, tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "layers.0.attention.wq.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "norm.weight": np.ones(8, dtype=np.float32),
        "output.weight": rng.standard_normal((5, 8)).astype(np.float32),
        "x.y": rng.standard_normal((2, 1, 3)).astype(np.float32),
    }
    p = tmp_path / "py.safetensors"
    write_st_py(p, tensors, metadata={"format": "pt"})
    got = c_loaded(probe, p)
    assert list(got) == list(tensors)
    for k in tensors:
        np.testing.assert_array_equal(got[k], tensors[k])


def test_unpadded_header_loads(probe, tmp_path):
    # the format does not require the header to be padded; the data is then unaligned
    p = tmp_path / "u.safetensors"
    header = {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}
    h = json.dumps(header).encode()
    if len(h) % 4 == 0:
        h += b" "
    p.write_bytes(st_bytes(h, np.array([1, 2, 3], dtype="<f4").tobytes(), pad=False))
    np.testing.assert_array_equal(c_loaded(probe, p)["a"], [1, 2, 3])


T1 = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
DATA24 = np.arange(6, dtype="<f4").tobytes()


BAD_ST = [
    ("short", b"\x10\x00\x00\x00",
     "file is 4 bytes, too short for a safetensors file (needs an 8-byte header length)"),
    ("hlen", st_bytes({"a": T1}, DATA24, header_len=1000),
     "header length 1000 is larger than the file (96 bytes after the 8-byte length)"),
    ("badjson", st_bytes(b'{"a": {"dtype": "F32",, }}'),
     "header is not valid JSON (expected a string at header byte 22)"),
    ("notobject", st_bytes(b'[1, 2, 3]'), "header is not a JSON object"),
    ("f16", st_bytes({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a' has dtype F16, only F32 is supported"),
    ("nodtype", st_bytes({"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "tensor 'a' has no dtype"),
    ("noshape", st_bytes({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8), "tensor 'a' has no shape"),
    ("nooffsets", st_bytes({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "tensor 'a' has no data_offsets"),
    ("wrongsize", st_bytes({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}}, DATA24),
     "tensor 'a' has shape [2, 3] (24 bytes of F32) but data_offsets [0, 12] span 12 bytes"),
    ("outside", st_bytes({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}}, DATA24),
     "tensor 'a' has data_offsets [8, 32] outside the data section (24 bytes)"),
    ("reversed", st_bytes({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, DATA24),
     "tensor 'a' has data_offsets [8, 0] with begin after end"),
    ("overlap", st_bytes({"a": T1, "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 28]}},
                         DATA24 + b"\0" * 4),
     "tensors 'a' and 'b' overlap (data_offsets [0, 24] and [16, 28])"),
    ("negshape", st_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "tensor 'a' has a shape entry that is not a non-negative integer"),
    ("meta", st_bytes({"__metadata__": {"step": 3}}), "__metadata__ value 'step' is not a string"),
    ("trailing", st_bytes(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}} x', b"\0" * 4),
     "header is not valid JSON (trailing characters after the header object at header byte 62)"),
    # the header's entries
    ("metanotobject", st_bytes({"__metadata__": ["pt"]}), "__metadata__ is not a JSON object"),
    ("tensornotobject", st_bytes({"a": 5}), "tensor 'a' is not a JSON object"),
    ("dtypenotstring", st_bytes({"a": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a' has a dtype that is not a string"),
    ("shapenotlist", st_bytes({"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a' has a shape that is not a list"),
    ("fivedims", st_bytes({"a": {"dtype": "F32", "shape": [1, 1, 1, 1, 1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a' has 5 dimensions, at most 4 are supported"),
    ("hugeshape", st_bytes({"a": {"dtype": "F32", "shape": [2 ** 32, 2 ** 32], "data_offsets": [0, 8]}}, b"\0" * 8),
     "tensor 'a' shape [4294967296, 4294967296] is too large"),
    ("oneoffset", st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4),
     "tensor 'a' has data_offsets that are not a pair of non-negative integers"),
    ("floatoffset", st_bytes(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}', b"\0" * 4),
     "tensor 'a' has data_offsets that are not a pair of non-negative integers"),
    ("hugeoffset", st_bytes(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551616]}}',
                            b"\0" * 4),
     "tensor 'a' has data_offsets that are not a pair of non-negative integers"),
    ("misaligned", st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8),
     "tensor 'a' data offset 2 is not a multiple of 4"),
    # the JSON itself
    ("emptyheader", st_bytes(b"", pad=False), "header is not valid JSON (unexpected end at header byte 0)"),
    ("truncatedu", st_bytes(b'{"\\u12', pad=False), "header is not valid JSON (truncated \\u escape at header byte 4)"),
    ("badu", st_bytes(b'{"\\u12G4": 1}'), "header is not valid JSON (bad \\u escape at header byte 7)"),
    ("unterminated", st_bytes(b'{"abc', pad=False), "header is not valid JSON (unterminated string at header byte 5)"),
    ("tabinstring", st_bytes(b'{"a\tb": 1}'), "header is not valid JSON (control character in string at header byte 3)"),
    ("badutf8", st_bytes(b'{"\xc3\x28": 1}'), "header is not valid JSON (invalid UTF-8 in string at header byte 2)"),
    # F5..FF never start a UTF-8 sequence (the reader took them as 3-byte leads; found by fuzz_safetensors)
    ("utf8f5", st_bytes(b'{"\xf5\x80\x80": 1}'), "header is not valid JSON (invalid UTF-8 in string at header byte 2)"),
    ("utf8ff", st_bytes(b'{"\xff\x80\x80": 1}'), "header is not valid JSON (invalid UTF-8 in string at header byte 2)"),
    ("surrogate", st_bytes(b'{"\\ud800": 1}'),
     "header is not valid JSON (unpaired surrogate in \\u escape at header byte 8)"),
    ("nulescape", st_bytes(b'{"\\u0000": 1}'), "header is not valid JSON (\\u0000 in string at header byte 8)"),
    ("badescape", st_bytes(b'{"\\x": 1}'), "header is not valid JSON (bad escape in string at header byte 3)"),
    ("badnumber", st_bytes(b'{"a": -}'), "header is not valid JSON (bad number at header byte 7)"),
    ("deep", st_bytes(b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}"),
     "header is not valid JSON (nesting too deep at header byte 69)"),
    ("controlkey", st_bytes(b'{"a\\u0001": 1}'), "header is not valid JSON (control character in a key at header byte 1)"),
    ("duplicatekey", st_bytes(b'{"a": 1, "a": 2}'), "header is not valid JSON (duplicate key 'a' at header byte 9)"),
    ("nocolon", st_bytes(b'{"a" 1}'), "header is not valid JSON (expected ':' at header byte 5)"),
    ("nocommaobj", st_bytes(b'{"a": 1 "b": 2}'), "header is not valid JSON (expected ',' or '}' at header byte 8)"),
    ("nocommaarr", st_bytes(b'{"a": [1 2]}'), "header is not valid JSON (expected ',' or ']' at header byte 9)"),
    ("unexpectedend", st_bytes(b'{"a": ', pad=False), "header is not valid JSON (unexpected end at header byte 6)"),
    ("unexpectedchar", st_bytes(b'{"a": x}'), "header is not valid JSON (unexpected character at header byte 6)"),
]


@pytest.mark.parametrize("name,content,message", BAD_ST, ids=[c[0] for c in BAD_ST])
def test_bad_safetensors(probe, tmp_path, name, content, message):
    p = tmp_path / f"{name}.safetensors"
    p.write_bytes(content)
    fails_with(probe, f"{p}: {message}", "--load-st", p)
