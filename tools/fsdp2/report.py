"""The report of make fsdp2-check: the table every run gets a row of, and logs/fsdp2/ (table.txt, one
<run>.json per run; a partial check keeps the other runs' rows).
"""
import json
import os


def fmt(x):
    return "-" if x is None else "%.1e" % x


def table(records):
    head = ["run", "world", "steps", "loss rel", "gnorm rel", "DTensors", "values |d|/lr", "pp order", "p2p",
            "collectives", "bwd issue", "result"]
    lines = []
    for r in records:
        if "error" in r:
            lines.append([r["run"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "FAIL: " + r["error"]])
            continue
        dt = r.get("dtensors")
        if dt:
            v = dt["values"]
            vals = ("bitwise" if v["bitwise_identical"] == v["shards"] else "NOT bitwise" if v.get("exact")
                    else fmt(v["max_abs_over_lr"]))
            layout = "identical" if dt["layout_identical"] else "DIFFER"
            if dt.get("flat"):  # a flat stage: the units (S per unit) against FSDP1, or nothing against FSDP2
                layout = {True: "S same", False: "S DIFFER", None: "-"}[dt["layout_identical"]] + " (%s)" % (
                    r.get("reference") or "?")
        else:
            vals = layout = "-"
        pl = r.get("pipeline")
        order = p2p = "-"
        if pl:
            order = "same" if pl["pass_order"]["identical"] else "DIFFER"
            q = pl["p2p"]
            p2p = ("DIFFER" if not q["identical"] or (q["groups_judged"] and not q["groups_identical"])
                   else "same" if q["groups_identical"] else "same (regrouped)")
        same = {True: "same", False: "DIFFER"}
        lines.append([r["run"], str(r["world"]), str(r["steps"]), fmt(r["max_loss_rel"]), fmt(r["max_grad_norm_rel"]),
                      layout, vals, order, p2p,
                      {True: "equal", False: "DIFFER"}.get((r.get("collectives") or {}).get("identical"), "-"),
                      same.get((r.get("backward_issue_points") or {}).get("identical"), "-"),
                      "PASS" if r["pass"] else "FAIL"])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def earlier_records(out, records, order):
    """The records in out/<run>.json of runs not in `records` (an earlier invocation's), and all of them
    ordered as `order` names the runs (others after, by name)."""
    now = {r["run"] for r in records}
    earlier = []
    if os.path.isdir(out):
        for name in sorted(os.listdir(out)):
            if name.endswith(".json") and name[:-len(".json")] not in now:
                try:
                    with open(os.path.join(out, name)) as fh:
                        rec = json.load(fh)
                except (OSError, ValueError):
                    continue
                if isinstance(rec, dict) and rec.get("run") == name[:-len(".json")] and "pass" in rec:
                    earlier.append(rec)
    rank = {name: i for i, name in enumerate(order)}

    def key(r):
        return rank.get(r["run"], len(order)), r["run"]
    return sorted(earlier, key=key), sorted(records + earlier, key=key)


def write_logs(out, records, text, meta, every_run, order=()):
    """table.txt and <run>.json; a run of everything first removes the json of runs that no longer exist. A run of
    some stages keeps the other runs' json, and their rows in table.txt (from that json)."""
    os.makedirs(out, exist_ok=True)
    if every_run:
        for name in os.listdir(out):
            if name.endswith(".json"):
                os.remove(os.path.join(out, name))
    else:
        earlier, merged = earlier_records(out, records, order)
        if earlier:
            text = table(merged)
            meta += ("\nrows of %d runs not run now (%s) come from their <run>.json, written by an earlier "
                     "make fsdp2-check" % (len(earlier), ", ".join(r["run"] for r in earlier[:3])
                                           + (", ..." if len(earlier) > 3 else "")))
    for r in records:
        with open(os.path.join(out, r["run"] + ".json"), "w") as fh:
            json.dump(r, fh, indent=1)
            fh.write("\n")
    with open(os.path.join(out, "table.txt"), "w") as fh:
        fh.write(meta + "\n\n" + text + "\n")
