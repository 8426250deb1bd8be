"""The planner against measurements: every layout ``spmd.perf.plan`` considers for
examples/train_lm.py on this machine, measured, with the planner's prediction beside it.

    python benchmarks/plan.py [--world 2] [--rounds 2] [--steps 30] [--microbatches 1 2 4]
    python benchmarks/plan.py --refit results/plan-cpu2.json   # fit again, without running

Each round runs every candidate layout (``spmd.perf.candidates`` of the example's default model:
dp, tp, pp with each schedule, cp, ZeRO 0-3, the microbatch counts given) as a job of its own,
``spmd-run -n WORLD python examples/train_lm.py --mesh ... --steps STEPS``, in the opposite order
from the round before, and reads the median step time the example prints (the steps after the
first, which compiles). A layout's time is the median over the rounds.

Then it fits the cost model (``spmd.perf.Machine.fit``: eight coefficients, non-negative,
relative least squares) to all the measured layouts, and reports for each its prediction by that
fit and by a fit that left it out (leave-one-out: how well the model predicts a layout it was
not fitted on). Finally it plans with the fit and compares the planner's first choice with the
fastest measured layout. The collectives' link parameters come from ``--links`` (a
``benchmarks/cost_model.py`` result: ``spmd-bench`` runs on this machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spmd.perf import Links, Machine, Model, candidates, plan, predict
from spmd.perf._simulate import Layout

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCRIPT = HERE.parent / "examples" / "train_lm.py"
# examples/train_lm.py's defaults
MODEL = Model(layers=4, hidden=64, heads=4, seq=64, batch=32, vocab=256)


def flags(lay: Layout) -> list[str]:
    """The example's command line for a layout."""
    mesh = ",".join(f"{k}={v}" for k, v in lay.axes.items())
    return ["--mesh", mesh, "--zero", str(lay.zero), "--microbatches", str(lay.microbatches),
            "--schedule", lay.schedule]  # fmt: skip


def measure(lay: Layout, world: int, steps: int) -> float:
    cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(world), sys.executable, str(SCRIPT),
           *flags(lay), "--steps", str(steps), "--sample", "0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.findall(r"median step ([\d.]+) ms", out.stdout)
    if out.returncode != 0 or not found:
        raise SystemExit(
            f"{lay.describe()}: {(out.stderr or out.stdout).strip().splitlines()[-3:]}"
        )
    return float(found[-1]) / 1e3


def as_layout(d: dict[str, Any]) -> Layout:
    return Layout(**d)


def report(data: dict[str, Any], out: Path, command: str) -> None:
    world = data["world"]
    rows = data["rows"]
    links = Links.of(data["links"])
    runs = [(MODEL, as_layout(r["layout"]), r["seconds"]) for r in rows]
    machine = Machine.fit(runs, links, fitted_on=f"{out.name}.json")
    data["machine"] = machine.to_json()
    for i, r in enumerate(rows):
        lay = as_layout(r["layout"])
        r["predicted"] = predict(MODEL, lay, machine).time
        others = Machine.fit(runs[:i] + runs[i + 1 :], links)
        r["predicted_left_out"] = predict(MODEL, lay, others).time
    ranked = plan(MODEL, world=world, cost=machine, microbatches=data["microbatches"])
    measured = {json.dumps(r["layout"], sort_keys=True): r["seconds"] for r in rows}
    order = [json.dumps(asdict(p.layout), sort_keys=True) for p in ranked]
    missing = [o for o in order if o not in measured]
    if missing:
        raise SystemExit(f"the planner ranks {len(missing)} layouts that were not measured")
    pick = measured[order[0]]
    fastest = min(measured.values())
    data["pick"] = {"layout": asdict(ranked[0].layout), "measured": pick, "fastest": fastest}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")

    errs = [r["predicted"] / r["seconds"] - 1 for r in rows]
    loo = [r["predicted_left_out"] / r["seconds"] - 1 for r in rows]
    md = [
        f"# The planner against measured steps: examples/train_lm.py on {world} ranks",
        "",
        f"Produced by `{command}` on {data['date_utc']} ({data['host']['cpu']}, "
        f"{data['host']['cores']} cores).",
        "",
        f"Model: the example's defaults ({MODEL.layers} layers, d={MODEL.hidden}, {MODEL.heads} "
        f"heads, sequence {MODEL.seq}, batch {MODEL.batch}, float32, Adam). Each layout ran as "
        f"its own job, {data['steps']} steps, {data['rounds']} rounds in alternating order; "
        "measured: the median over the rounds of each run's median step (range: the rounds'). "
        "predicted: the cost model fitted to every row; left out: fitted to every other row.",
        "",
        "## Fitted coefficients",
        "",
        "| term | seconds per unit |",
        "|---|---:|",
    ]
    md += [f"| {t} | {v:.4g} |" for t, v in machine.coefficients.items()]
    md += [
        "",
        "## Measured against predicted, in the planner's order",
        "",
        "| rank | layout | measured (ms) | range (ms) | predicted (ms) | error | left out (ms) "
        "| error |",
        "|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    by_key = {json.dumps(r["layout"], sort_keys=True): r for r in rows}
    for i, key in enumerate(order, 1):
        r = by_key[key]
        lo, hi = min(r["runs"]) * 1e3, max(r["runs"]) * 1e3
        md.append(
            f"| {i} | {as_layout(r['layout']).describe()} | {r['seconds'] * 1e3:.1f} | "
            f"{lo:.1f}-{hi:.1f} | {r['predicted'] * 1e3:.1f} | "
            f"{r['predicted'] / r['seconds'] - 1:+.0%} | {r['predicted_left_out'] * 1e3:.1f} | "
            f"{r['predicted_left_out'] / r['seconds'] - 1:+.0%} |"
        )
    md += [
        "",
        "## Summary",
        "",
        f"- Layouts: {len(rows)}. Largest error, fitted to all: {max(map(abs, errs)):.0%}; "
        f"left out: {max(map(abs, loo)):.0%} (median {statistics.median(map(abs, loo)):.0%}).",
        f"- The planner picks {ranked[0].layout.describe()}: measured {pick * 1e3:.1f} ms, "
        f"{pick / fastest:.3f}x the fastest measured ({fastest * 1e3:.1f} ms).",
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index("## Measured against predicted, in the planner's order") :]))


def main(argv: list[str] | None = None) -> int:
    from spmd.bench import cores_tag, host_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--links", default=str(RESULTS / "cost_model-cpu2.json"))
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--refit", help="a result of this script: fit and report again, not run")
    args = ap.parse_args(argv)
    command = "python benchmarks/plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.refit:
        path = Path(args.refit)
        report(json.loads(path.read_text()), path.with_suffix(""), command.strip())
        return 0
    layouts = candidates(MODEL, args.world, microbatches=args.microbatches)
    times: dict[int, list[float]] = {i: [] for i in range(len(layouts))}
    for rnd in range(args.rounds):
        order = range(len(layouts)) if rnd % 2 == 0 else reversed(range(len(layouts)))
        for i in order:
            times[i].append(measure(layouts[i], args.world, args.steps))
            print(f"round {rnd + 1}: {layouts[i].describe():>28}  {times[i][-1] * 1e3:7.1f} ms",
                  flush=True)  # fmt: skip
    data = {
        "world": args.world,
        "steps": args.steps,
        "rounds": args.rounds,
        "microbatches": args.microbatches,
        "host": host_info(),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "links": json.loads(Path(args.links).read_text())["params"],
        "rows": [
            {"layout": asdict(lay), "seconds": statistics.median(times[i]), "runs": times[i]}
            for i, lay in enumerate(layouts)
        ],
    }
    out = Path(args.out_dir) / f"plan-{cores_tag()}-n{args.world}"
    report(data, out, command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
