"""Statistics over steps, the number formats of the bench's log and report, and the report's markdown blocks."""
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


def table(L, header, rows):
    """Append a markdown table (header: column titles; rows: cells, formatted or plain) to the lines L."""
    L.append("| " + " | ".join(header) + " |")
    L.append("|" + " --- |" * len(header))
    for row in rows:
        L.append("| " + " | ".join(str(c) for c in row) + " |")


def section(L, title, intro, header, rows, outro=None):
    """Append a report section to the lines L: '## title', the paragraph intro (None: none), the table and the
    closing paragraph outro (None: none), each followed by a blank line."""
    L += ["## " + title, ""]
    if intro is not None:
        L += [intro, ""]
    table(L, header, rows)
    L.append("")
    if outro is not None:
        L += [outro, ""]


def runs_section(L, x, name, intro, header, cells, outro, steps="%d steps"):
    """Append the section on one solution run under several flags (4b, 4c, 4e, 4f) to the lines L, if it ran.
    x: its figures (solution, flavor, world, batch, seq or seq_len, steps, link, rows); intro may name them as
    %(link)s, and %(losses)s says whether the runs' losses agree; cells(row) gives a row's table cells."""
    if not x.get("rows"):
        return
    title = "%s (%s, %s, world %d, batch %d × seq %d per rank, rank 0, %s)" % (
        name, x["solution"], x["flavor"], x["world"], x["batch"], x.get("seq", x.get("seq_len")), steps % x["steps"])
    fields = dict(x, losses="agree" if x.get("losses_agree") else "DIFFER (a bug)")
    section(L, title, intro % fields, header, [cells(r) for r in x["rows"]], outro)
