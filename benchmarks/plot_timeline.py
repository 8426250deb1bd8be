"""Draw a merged collective timeline (``SPMD_TIMELINE=dir spmd-run ...`` writes
``dir/timeline.json``) as a picture: one row per rank, one bar per collective, coloured by op.

    python benchmarks/plot_timeline.py dir/timeline.json out.png [--last 0.25]
    python benchmarks/plot_timeline.py dir/timeline.json out.png --from-ms 2160 --to-ms 2290

``--last F``: draw the last fraction F of the job's time span (the first calls include
compiling); ``--from-ms``/``--to-ms``: that window of the timeline's time. The same file opens in
Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline")
    ap.add_argument("out")
    ap.add_argument("--last", type=float, default=0.25)
    ap.add_argument("--from-ms", type=float, default=None)
    ap.add_argument("--to-ms", type=float, default=None)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.loads(Path(args.timeline).read_text())["traceEvents"]
    calls = [e for e in events if e.get("ph") == "X"]
    end = max(e["ts"] + e["dur"] for e in calls)
    start = end * (1 - args.last)
    if args.from_ms is not None:
        start = args.from_ms * 1e3
    if args.to_ms is not None:
        end = args.to_ms * 1e3
    shown = [e for e in calls if e["ts"] + e["dur"] >= start and e["ts"] <= end]
    ops = sorted({e["name"] for e in shown})
    colours = dict(zip(ops, plt.get_cmap("tab10").colors, strict=False))
    ranks = sorted({e["pid"] for e in calls})
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.4))
    for e in shown:
        left, right = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        ax.broken_barh([((left - start) / 1e3, max(right - left, 50.0) / 1e3)],
                       (e["pid"] - 0.35, 0.7), color=colours[e["name"]])  # fmt: skip
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from {start / 1e3:.0f} ms into the timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[o]) for o in ops]
    ax.legend(handles, ops, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(args.title or f"collectives, last {args.last:.0%} of the job")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
