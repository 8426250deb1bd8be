"""Predicted scaling (spmd.perf) of 1.3B, 6.7B and 70B language models from 8 to 10,240 ranks:
the best layout of each family at each size, its step time and scaling efficiency.

    python benchmarks/plot_scaling.py [docs/scaling.png]

Writes the figure (matplotlib) and `results/scaling-predicted.{json,md}`. The assumptions are the
constants below, and docs/scaling.md states them: they describe a cluster, they were not
measured here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from spmd.perf import Cluster, Links, Transformer, best, gbit

RESULTS = Path(__file__).resolve().parent / "results"

# A GPU cluster: nodes of 8, 400 TFLOP/s achieved per rank (bf16), 80 GiB each; inside a node
# 3 us and 150 GB/s per rank (NVLink-class); between nodes 10 us per message and 8 x 400 Gbit/s
# per node (one 400 Gbit/s NIC per rank) or, the second cluster, 100 Gbit/s per node.
PER_NODE = 8
FLOPS = 400e12
MEMORY = 80 * 2**30
INSIDE = dict(shm_alpha=3e-6, shm_beta=1 / 150e9, node_alpha=3e-6, node_beta=1 / 150e9)
NETWORKS = {"8 x 400 Gbit/s per node": gbit(3200), "100 Gbit/s per node": gbit(100)}
NET_ALPHA = 10e-6
MODELS = {
    "1.3B (24 x 2048)": Transformer(24, 2048),
    "6.7B (32 x 4096)": Transformer(32, 4096),
    "70B (80 x 8192)": Transformer(80, 8192),
}
BATCH = 1024  # sequences of 2048 tokens: 2M tokens per step
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 10240)
FAMILIES = ("dp", "zero1", "zero3", "tp", "pp")
COLORS = dict(
    zip(FAMILIES, ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True)
)


def predict() -> list[dict[str, Any]]:
    rows = []
    for net_name, net_beta in NETWORKS.items():
        links = Links.of({**INSIDE, "net_alpha": NET_ALPHA, "net_beta": net_beta})
        for model_name, model in MODELS.items():
            for ranks in RANKS:
                cluster = Cluster(ranks // PER_NODE, PER_NODE, links, FLOPS, MEMORY)
                for family in FAMILIES:
                    found = best(model, cluster, BATCH, family)
                    row = {"network": net_name, "model": model_name, "ranks": ranks,
                           "family": family, "layout": None}  # fmt: skip
                    if found is not None:
                        lay, s = found
                        row |= {"layout": lay.name(), "step_s": s.total,
                                "efficiency": s.efficiency, "memory_GiB": s.memory / 2**30,
                                "compute_s": s.compute, "tp_s": s.tp, "bubble_s": s.bubble,
                                "p2p_s": s.p2p, "dp_exposed_s": s.dp_exposed}  # fmt: skip
                    rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(NETWORKS), len(MODELS), figsize=(14, 7.5), sharex=True,
                             sharey=True, squeeze=False)  # fmt: skip
    for i, net in enumerate(NETWORKS):
        for j, model in enumerate(MODELS):
            ax = axes[i][j]
            for family in FAMILIES:
                key = (net, model, family)
                mine = (r for r in rows if (r["network"], r["model"], r["family"]) == key)
                pts = [(r["ranks"], r["efficiency"]) for r in mine if r["layout"]]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, marker="o", markersize=3, label=family, color=COLORS[family])
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.set_title(f"{model}, {net}", fontsize=10)
            if i == len(NETWORKS) - 1:
                ax.set_xlabel("ranks (nodes of 8)")
            if j == 0:
                ax.set_ylabel("scaling efficiency")
    handles = [plt.Line2D([], [], color=COLORS[f], marker="o", markersize=3) for f in FAMILIES]
    axes[0][0].legend(handles, FAMILIES, fontsize=8, loc="lower left")
    title = f"Predicted efficiency of the best layout per family (batch {BATCH} x 2048 tokens; "
    fig.suptitle(title + "a missing point: no layout of the family fits 80 GiB)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/scaling.png")
    rows = predict()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scaling-predicted.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = ["# Predicted scaling (spmd.perf)", "",
          "Produced by `python benchmarks/plot_scaling.py`; assumptions in docs/scaling.md. "
          "Efficiency = the step's FLOPs at every rank's rate / the predicted step.", "",
          "| network | model | ranks | family | layout | step (s) | efficiency | GiB per rank |",
          "|---|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if r["layout"] is None:
            md.append(f"| {r['network']} | {r['model']} | {r['ranks']} | {r['family']} | "
                      "none fits | | | |")  # fmt: skip
            continue
        md.append(f"| {r['network']} | {r['model']} | {r['ranks']} | {r['family']} | "
                  f"{r['layout']} | {r['step_s']:.3f} | {r['efficiency']:.2f} | "
                  f"{r['memory_GiB']:.0f} |")  # fmt: skip
    (RESULTS / "scaling-predicted.md").write_text("\n".join(md) + "\n")
    plot(rows, out)
    print(f"wrote {out} and {RESULTS / 'scaling-predicted.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
