"""The runtime's bfloat16 conversions (common/runtime/bf16.h, through the cast ops the kernels call)
against PyTorch's tensor.to(torch.bfloat16) and back, bit for bit: ties (to even), values one bit
either side of a tie, subnormals, the overflow to infinity past bfloat16's largest finite value,
signed zeros and infinities, and 400,000 random bit patterns; NaN inputs give NaN (PyTorch's CPU
kernels return 0x7fc0 or 0xffff depending on the code path, so only NaN-ness is compared there; the
runtime keeps the sign and sets the quiet bit, checked on its own). Widening is checked on all
65,536 bfloat16 values.

The numbers come from build/tests/test_ops --bf16 (one float32 bit pattern in, the bfloat16 and the
widened float32 out). Without torch this test is skipped with the reason on a developer machine and
FAILS under CI (CI=true), where ./hwfsdp installs python3-torch."""
import os
import subprocess

from helpers import BUILD, require_torch

require_torch("bfloat16 tests")
import numpy as np  # noqa: E402
import torch  # noqa: E402

TOOL = os.path.join(BUILD, "tests", "test_ops")

EDGES = {
    "zero": 0x00000000, "negative zero": 0x80000000, "one": 0x3F800000,
    "tie, even kept part: down": 0x3F808000, "tie, odd kept part: up": 0x3F818000,
    "negative tie, even": 0xBF808000, "negative tie, odd": 0xBF818000,
    "just above a tie": 0x3F808001, "just below a tie": 0x3F807FFF,
    "carry into the exponent": 0x3FFFFFFF, "largest finite float: to inf": 0x7F7FFFFF,
    "largest finite bfloat16's tie: odd, to inf": 0x7F7F8000, "just below that tie": 0x7F7F7FFF,
    "inf": 0x7F800000, "-inf": 0xFF800000, "smallest normal": 0x00800000,
    "largest subnormal: rounds up to the smallest normal": 0x007FFFFF,
    "smallest subnormal": 0x00000001, "subnormal tie, even: to zero": 0x00008000,
    "subnormal tie, odd: up": 0x00018000, "negative subnormal tie": 0x80008000,
    "negative subnormal just above a tie": 0x80008001,
}
NANS = {"quiet NaN": 0x7FC00000, "signalling NaN": 0x7F800001, "negative quiet NaN": 0xFFC00000,
        "all-ones NaN": 0xFFFFFFFF, "NaN whose low half would carry": 0x7F80FFFF, "negative signalling NaN": 0xFF800001}


def ours(bits):
    """(bfloat16, widened float32 bits) per float32 bit pattern, from the runtime's cast ops."""
    assert os.access(TOOL, os.X_OK), "%s is not built: run make" % TOOL
    text = "".join("%08x\n" % int(b) for b in bits)
    p = subprocess.run([TOOL, "--bf16"], input=text, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.split("\n") if line]
    assert len(rows) == len(bits)
    return (np.array([int(r[0], 16) for r in rows], dtype=np.uint16),
            np.array([int(r[1], 16) for r in rows], dtype=np.uint32))


def torch_bf16(bits):
    x = torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def torch_widen(b16):
    t = torch.from_numpy(np.asarray(b16, dtype=np.uint16).view(np.int16).copy()).view(torch.bfloat16)
    return t.to(torch.float32).numpy().view(np.uint32)


def is_nan32(bits):
    bits = np.asarray(bits, dtype=np.uint32)
    return (bits & 0x7FFFFFFF) > 0x7F800000


def test_edge_cases_match_torch():
    names, bits = zip(*EDGES.items())
    got, _ = ours(bits)
    want = torch_bf16(bits)
    bad = ["%s (0x%08x): ours 0x%04x, torch 0x%04x" % (n, b, g, w)
           for n, b, g, w in zip(names, bits, got, want) if g != w]
    assert not bad, bad
    # and the cases mean what their names say (the test tests itself)
    assert got[names.index("tie, even kept part: down")] == 0x3F80
    assert got[names.index("tie, odd kept part: up")] == 0x3F82
    assert got[names.index("largest finite float: to inf")] == 0x7F80
    assert got[names.index("subnormal tie, even: to zero")] == 0x0000


def test_nan_stays_nan_with_its_sign():
    names, bits = zip(*NANS.items())
    got, widened = ours(bits)
    want = torch_bf16(bits)
    for n, b, g, w, back in zip(names, bits, got, want, widened):
        g32 = np.uint32(int(g) << 16)
        assert is_nan32(g32) and is_nan32(np.uint32(int(w) << 16)), "%s (0x%08x): ours 0x%04x, torch 0x%04x" % (n, b, g, w)
        assert (int(g) >> 15) == (b >> 31), "%s: the sign is lost (0x%04x)" % (n, g)
        assert int(g) & 0x0040, "%s: not a quiet NaN (0x%04x)" % (n, g)
        assert is_nan32(back), n


def test_random_patterns_match_torch():
    rng = np.random.default_rng(20261123)
    bits = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # exact ties (low half 0x8000) are 1 in 65536 of random patterns: add 200,000 of them
    ties = (rng.integers(0, 2 ** 16, size=200_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    bits = np.concatenate([bits, ties])
    got, widened = ours(bits)
    want = torch_bf16(bits)
    nan = is_nan32(bits)
    diff = np.nonzero((got != want) & ~nan)[0]
    assert diff.size == 0, ["0x%08x: ours 0x%04x, torch 0x%04x" % (bits[i], got[i], want[i]) for i in diff[:5]]
    assert np.all(is_nan32(got.astype(np.uint32) << 16)[nan])
    # widening gives back exactly the bfloat16's value: its bits followed by 16 zero bits
    assert np.array_equal(widened, got.astype(np.uint32) << 16)
    assert ties.size and np.any(got[-ties.size:] & 1) and np.any(~got[-ties.size:] & 1)


def test_widening_every_bfloat16_matches_torch():
    every = np.arange(2 ** 16, dtype=np.uint32)
    widened = torch_widen(every.astype(np.uint16))
    mine = every << 16  # the runtime's widening of b, as the filter prints it for b's own float32
    _, back = ours(mine)
    finite = ~is_nan32(mine)
    assert np.array_equal(back[finite], mine[finite])
    assert np.array_equal(widened[finite], mine[finite])
    assert np.all(is_nan32(widened[~finite])) and np.all(is_nan32(back[~finite]))
