#!/usr/bin/env python3
"""Loss curves of several run directories on one figure.

    plot_compare.py OUT.png RUN [RUN ...]
"""
import json
import os
import sys


def main():
    if len(sys.argv) < 3:
        print("usage: plot_compare.py OUT.png RUN [RUN ...]", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in sys.argv[2:]:
        with open(os.path.join(run, "metrics.jsonl")) as fh:
            rows = [json.loads(l) for l in fh if l.strip()]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=os.path.basename(run.rstrip("/")),
                lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("debugmodel, 4 ranks: every solution")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    print("wrote %s" % sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
