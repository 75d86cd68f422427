"""Helpers shared by the grader's modules: the two errors, JSON numbers, one-line messages, paths.

Everything a student's run wrote is untrusted: the helpers here turn any value into a short
printable line and any unreadable file into a CheckFailed that names it.
"""
import json
import math
import os

import manifest

ROOT = manifest.ROOT
# a check's reason when the run it would read failed (results.json; the console says the run's reason once)
NOT_GRADED = "not graded: the run failed"


class UsageError(Exception):
    """A mistake in how the grader was called (exit status 2)."""


class CheckFailed(Exception):
    """Raised inside a check: the check fails with this one-line reason. step: the first step (1-based) the failure
    shows in, for a check that reads a series (of two failures that say as much, the earlier one leads: a cause
    comes before what it moves; cli.lead_order)."""

    def __init__(self, reason, step=None):
        super().__init__(reason)
        self.step = step


def mp_policy(flags):
    """(param dtype, reduce dtype) a run's flags ask for, as the driver's --param-dtype / --reduce-dtype
    ("fp32" or "bf16")."""
    flags = set(flags)
    return ("bf16" if "--param-dtype=bf16" in flags else "fp32", "bf16" if "--reduce-dtype=bf16" in flags else "fp32")


def mesh_shape(flags, world):
    """(R, S) of the --mesh R,S (or RxS) a run's flags ask for; with --pp P, (1, world / P): a pipeline stage's
    ranks shard its modules; (1, world) without either (the 1-D mesh: the world)."""
    for f in flags:
        if f.startswith("--mesh="):
            r, s = f[len("--mesh="):].replace("x", ",").split(",")
            return int(r), int(s)
    for f in flags:
        if f.startswith("--pp="):
            return 1, world // int(f[len("--pp="):])
    return 1, world


def padded_rows(rows, n):
    """Rows of every rank's shard when `rows` are split over n ranks: ceil(rows / n), as torch.chunk
    splits and FSDP2 pads every shard to the first chunk's size."""
    return -(-rows // n)


def chunk(rows, n, k):
    """torch.chunk's split of `rows` over n ranks: (padded rows, first row, rows) of chunk k (trailing
    chunks may hold fewer rows or none)."""
    padded = padded_rows(rows, n)
    start = k * padded
    return padded, start, max(0, min(rows, start + padded) - start)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def is_int(x):
    return type(x) is int  # not bool


def is_num(x):
    """A JSON number the checks can do float arithmetic and %g with (NaN and infinities included)."""
    return type(x) is float or (type(x) is int and abs(x) < 2 ** 63)


def is_finite(x):
    return is_num(x) and math.isfinite(x)


def short(value, limit=60):
    """A JSON value for a message: compact, cut."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return one_line(text, limit)


def one_line(text, limit=2000):
    """A reason as one printable line: newlines, other control characters and unpaired surrogates escaped
    (they come from files a student's run wrote), very long text cut."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fmt_bytes(n):
    if abs(n) < 100 * 1024:
        return "%d bytes" % n
    return "%.2f MiB" % (n / 1048576.0)


def fmt_points(p):
    return ("%.2f" % p).rstrip("0").rstrip(".")


def relpath(path):
    """path relative to the repository when it lies inside it (shorter messages), else as given."""
    try:
        r = os.path.relpath(path, ROOT)
    except ValueError:
        return path
    return path if r.startswith("..") else r


def read_json(path, top=dict):
    """The file's JSON value, which must be a `top` (dict: an object); CheckFailed naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except FileNotFoundError:
        raise CheckFailed("%s is missing: the run did not write it" % relpath(path))
    except OSError as e:
        raise CheckFailed("%s cannot be read (%s)" % (relpath(path), e.strerror or e))
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CheckFailed("%s is not valid JSON (%s)" % (relpath(path), e))
    if top is not None and not isinstance(value, top):
        raise CheckFailed("%s is not a JSON %s" % (relpath(path), "object" if top is dict else top.__name__))
    return value
