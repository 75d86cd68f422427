"""Statistics over steps and the number formats of the bench's log and report."""
import math
import statistics

MIB = 1048576.0


def stats(xs):
    """median, min, max and count of the figures that are not None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def tps_stats(metrics, tokens_per_step, first_step):
    """tokens/s over steps first_step..N (1-based): median, min, max."""
    return stats([tokens_per_step / (m["step_ms"] / 1e3) for m in metrics if m["step"] >= first_step])


def fmt(x, nd=0):
    """x with thousands separators and nd decimals; an en dash when there is no figure."""
    if x is None:
        return "–"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "–"
    return "{:,.{}f}".format(x, nd)


def fmt_mib(b):
    """bytes as MiB with 2 decimals; an en dash when there is no figure."""
    return "–" if b is None else "%.2f" % (b / MIB)


def fmt_s(s, nd=0, scale=1.0):
    """'median [min–max]' of a stats dict."""
    if not s or s.get("median") is None:
        return "–"
    return "%s [%s–%s]" % (fmt(s["median"] * scale, nd), fmt(s["min"] * scale, nd), fmt(s["max"] * scale, nd))
