"""Shared start of the perf/plot_*.py scripts: the --results / --out options and matplotlib."""

from __future__ import annotations

import argparse
import sys


def args_and_pyplot(doc: str, results: str, out: str, tool: str):
    """Parse --results / --out (defaults given) and import matplotlib's pyplot on the Agg backend;
    (args, pyplot), or (args, None) after printing how to install matplotlib (not a dependency)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=results)
    p.add_argument("--out", default=out)
    args = p.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{tool}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return args, None
    return args, plt


def save(fig, out: str) -> int:
    """Lay out, write and announce the figure; the scripts' exit status (0)."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0
