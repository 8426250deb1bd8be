"""Pipeline parallelism: the measured bubble of GPipe, 1F1B and ZB-H1 against their theoretical
values (``theory``), and the memory each stage's compiled step needs, per schedule and number
of microbatches m, in the same run.

    spmd-run -n 2 python benchmarks/pipeline.py [--rounds 3] [--micro 1 2 4 8 16]
    python benchmarks/pipeline.py -n 4        # outside a job it starts one itself

The model: ``--layers`` tanh layers of ``--dim`` x ``--dim`` (float32) on a batch of ``--batch``
rows, split evenly over the job's p ranks (``Mesh(pp=p)``), loss = mean squared error.

**Bubble.** Per (schedule, m): the step ``spmd.pipeline_value_and_grad(...)`` under ``jax.jit``
(T: per timed step the slowest rank's time, the median over steps, then over rounds); and on
every rank at once, the same stage's forward and backward passes over the m microbatches with no
messages (a ``lax.scan`` of ``jax.vjp``; C: the slowest stage's median). Measured bubble =
1 - C / T: the share of the step the slowest stage does not compute, which includes the time
spent moving activations, not only the idle time of the schedule. Theoretical (``theory``):
(p - 1) / (m + p - 1) for GPipe and 1F1B, less for ZB-H1; each assumes stages of equal time
and free messages.

**The schedule alone.** Also per (schedule, m), on every rank at once: the same pipelined step
on a group of one holding this stage's layers (S: the slowest stage's median). It runs the
schedule's own work (the stash of residuals, the loss, the gradient sums) with no messages and
nothing to wait for, so S / C - 1 is what the schedule costs beyond the compute; with it the
expected step is S (m + p - 1) / m, and what the step takes beyond that is the messages and the
waits for them.

**Memory.** Per stage, XLA's ``memory_analysis()`` of the compiled step: temporary buffers (the
stash of residuals and the work space); 1F1B keeps p - s microbatches, GPipe m, ZB-H1 p.

The ranks share the machine's cores (``spmd-run`` pins each to its share): with fewer cores than
ranks the stages take turns on a core and the bubble is not the schedule's. The results record
the cores.

Writes ``benchmarks/results/pipeline-cpu<cores>-n<ranks>.{json,md}``.

**The language model** (``--lm``, run outside a job): ``examples/train_lm.py`` on each layout of
``--layouts`` (default: one process, and every 2-rank mesh; ``pp=2:zero_bubble`` names the
pipeline's schedule), ``--lm-steps`` steps each; the tokens/s the example reports at the end
(global tokens over the steps after the first, which compiles), the median over ``--rounds``
runs. Writes ``benchmarks/results/<--lm-tag, default pipeline-lm>-cpu<cores>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
VIRTUAL = 2  # the interleaved schedule's chunks per stage
LAYOUTS = ["", "pp=2", "dp=2", "tp=2"]


def theory(sch: str, p: int, m: int) -> float:
    """The schedule's bubble, stages of equal time and free messages: GPipe's and 1F1B's
    (p - 1) / (m + p - 1); ZB-H1's (p - 1)(F + B - W) / (m(F + B + W) + (p - 1)(F + B - W)) with
    forward, input-gradient and weight-gradient passes of equal time (a tanh layer's three
    products): (p - 1) / (3m + p - 1); interleaved 1F1B's with v chunks per stage
    (p - 1) / (v m + p - 1)."""
    if sch == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / ((VIRTUAL if sch == "interleaved" else 1) * m + p - 1)


def _model(args: argparse.Namespace) -> tuple[list[Any], Any, Any]:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), args.layers)
    layers = [
        {"w": jax.random.normal(k, (args.dim, args.dim)) / args.dim**0.5,
         "b": jnp.zeros(args.dim)}
        for k in keys
    ]  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (args.batch, args.dim))
    t = jax.random.normal(jax.random.key(2), (args.batch, args.dim))
    return layers, x, t


def _apply(layers: list[Any], h: Any) -> Any:
    import jax.numpy as jnp

    for layer in layers:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return h


def _mse(y: Any, t: Any) -> Any:
    import jax.numpy as jnp

    return jnp.mean((y - t) ** 2)


def _compute_alone(m: int) -> Any:
    """This stage's forward and backward passes over m microbatches, no messages."""
    import jax
    import jax.numpy as jnp

    def run(params: Any, xs: Any) -> Any:
        def body(acc: Any, x: Any) -> tuple[Any, None]:
            y, vjp = jax.vjp(_apply, params, x)
            g, _ = vjp(jnp.ones_like(y))
            return jax.tree_util.tree_map(jnp.add, acc, g), None

        acc, _ = jax.lax.scan(body, jax.tree_util.tree_map(jnp.zeros_like, params), xs)
        return acc

    return jax.jit(run)


def _time(comm: Any, call: Any, steps: int, warmup: int) -> float:
    """Median over ``steps`` of the slowest rank's time for one call (ranks start together)."""
    import jax
    import numpy as np

    import spmd

    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(steps):
        spmd.barrier(group=comm)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    slowest = np.max(np.asarray(comm.allgather_object(times)), axis=0)
    return float(statistics.median(slowest))


def run_job(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import spmd
    from spmd.bench import cores_tag, host_info

    comm = spmd.init()
    p = comm.size
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    load_start = round(os.getloadavg()[0], 2)
    layers, x, t = _model(args)
    rows: list[dict[str, Any]] = []
    solo = spmd.Mesh(dp=p, pp=1).group("pp")  # this rank alone: a pipeline of one stage
    with spmd.Mesh(pp=p) as mesh:
        pp = mesh.group("pp")
        s = pp.rank
        mine = spmd.pipeline.stage_layers(layers)
        chunked = spmd.pipeline.stage_layers(layers, virtual_stages=VIRTUAL)
        held = {sch: chunked if sch == "interleaved" else mine for sch in SCHEDULES}
        kw = {sch: {"virtual_stages": VIRTUAL} if sch == "interleaved" else {} for sch in SCHEDULES}
        for m in args.micro:
            if args.batch % m:
                continue
            # What this stage receives, per microbatch: its input activations (the first: x).
            xs = jnp.reshape(x, (m, args.batch // m, args.dim))
            if s > 0:
                xs = jnp.tanh(xs)  # any activations of the right shape
            alone = _compute_alone(m)
            pipe = spmd.pipeline_value_and_grad
            steps = {
                sch: jax.jit(pipe(_apply, _mse, microbatches=m, schedule=sch, **kw[sch]))
                for sch in SCHEDULES
            }
            alone_steps = {
                sch: jax.jit(
                    pipe(_apply, _mse, microbatches=m, schedule=sch, group=solo, **kw[sch])
                )
                for sch in SCHEDULES
            }
            temp = {
                sch: int(f.lower(held[sch], x, t).compile().memory_analysis().temp_size_in_bytes)
                for sch, f in steps.items()
            }
            temps = pp.allgather_object(temp)
            order = ["compute alone", *(f"{sch} alone" for sch in SCHEDULES), *SCHEDULES]
            rounds: dict[str, list[float]] = {name: [] for name in order}
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    if name == "compute alone":
                        call = functools.partial(alone, mine, xs)
                    elif name.endswith(" alone"):
                        # Any input of the right shape: the stage is first and last here.
                        sch = name.split()[0]
                        call = functools.partial(alone_steps[sch], held[sch], x, t)
                    else:
                        call = functools.partial(steps[name], held[name], x, t)
                    rounds[name].append(_time(pp, call, args.steps, args.warmup))
            med = {k: statistics.median(v) for k, v in rounds.items()}
            row = {
                "m": m,
                "microbatch_rows": args.batch // m,
                "theoretical_bubble": {sch: round(theory(sch, p, m), 4) for sch in SCHEDULES},
                "step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                "measured_bubble": {
                    sch: round(1 - med["compute alone"] / med[sch], 4) for sch in SCHEDULES
                },
                "schedule_overhead": {
                    sch: round(med[f"{sch} alone"] / med["compute alone"] - 1, 4)
                    for sch in SCHEDULES
                },
                "expected_step_ms": {
                    sch: round(med[f"{sch} alone"] / (1 - theory(sch, p, m)) * 1e3, 3)
                    for sch in SCHEDULES
                },
                "temp_MiB_per_stage": {
                    sch: [round(tt[sch] / MIB, 3) for tt in temps] for sch in SCHEDULES
                },
                "activation_MiB_per_microbatch": round(args.batch // m * args.dim * 4 / MIB, 4),
                "rounds_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in rounds.items()},
            }
            rows.append(row)
            st, b = row["step_ms"], row["measured_bubble"]
            say(f"m={m:2d}: compute {st['compute alone']:8.2f} ms, "
                + ", ".join(f"{sch} {st[sch]:8.2f} ms (bubble {b[sch]:.3f}, theory "
                            f"{row['theoretical_bubble'][sch]:.3f})" for sch in SCHEDULES),
                flush=True)  # fmt: skip
    if comm.rank != 0:
        return 0
    info = {
        **host_info(),
        "ranks (stages)": p,
        "model": f"{args.layers} tanh layers of {args.dim} x {args.dim}, "
        f"batch {args.batch}, float32, MSE",
        "timed_steps_per_round": args.steps,
        "rounds": args.rounds,
        "load_average_1min_at_start": load_start,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"pipeline-{cores_tag()}-n{p}"
    (out / f"{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    md = [f"# Pipeline parallelism: bubble and memory per schedule, {p} stages", "",
          f"Produced by `spmd-run -n {p} python benchmarks/pipeline.py"
          + (f" --rounds {args.rounds}" if args.rounds != 3 else "") + "`.", "",
          "| machine | |", "|---|---|"]  # fmt: skip
    md += [f"| {k} | {v} |" for k, v in info.items()]
    if p > int(info.get("job_cores") or info.get("cores") or p):
        md += ["", f"**{p} ranks on {info.get('job_cores') or info.get('cores')} cores: the "
               "stages take turns on the cores, so the bubble column does not measure the "
               "schedule; the memory column does not depend on it.**"]  # fmt: skip
    cols = " | ".join
    md += ["", "## Bubble", "",
           "Step: per timed step the slowest rank's time; the median over steps, then over "
           "rounds. compute alone: every stage's forward and backward passes over the m "
           "microbatches without messages, the slowest stage. Measured bubble = 1 - compute "
           "alone / step (it includes moving the activations); theoretical: GPipe's and 1F1B's "
           "(p - 1) / (m + p - 1), interleaved 1F1B's (p - 1) / (vm + p - 1) with v = "
           f"{VIRTUAL} chunks per stage, ZB-H1's (p - 1) / (3m + p - 1) (forward, input-gradient "
           "and weight-gradient passes of equal time). measured / theory: 1F1B's; interleaved "
           "/ 1F1B and ZB-H1 / 1F1B: the measured bubbles' ratios.", "",
           f"| m | compute alone (ms) | {cols(f'{k} (ms)' for k in SCHEDULES)} | "
           f"{cols(f'bubble {k} (theory)' for k in SCHEDULES)} | 1f1b measured / theory | "
           "interleaved / 1f1b | zero_bubble / 1f1b |",
           "|---:|" + "---:|" * (2 * len(SCHEDULES) + 4)]  # fmt: skip
    for r in rows:
        st, b, th = r["step_ms"], r["measured_bubble"], r["theoretical_bubble"]
        steps = cols(f"{st[k]:.2f}" for k in SCHEDULES)
        md.append(f"| {r['m']} | {st['compute alone']:.2f} | {steps} | "
                  f"{cols(f'{b[k]:.3f} ({th[k]:.3f})' for k in SCHEDULES)} | "
                  f"{b['1f1b'] / th['1f1b']:.2f} | {b['interleaved'] / b['1f1b']:.2f} | "
                  f"{b['zero_bubble'] / b['1f1b']:.2f} |"
                  )  # fmt: skip
    md += ["", "## The schedule alone", "",
           "alone: the same pipelined step on a group of one holding the stage's layers, every "
           "rank at once (the slowest stage): the schedule's own work without messages. "
           "overhead = alone / compute alone - 1; expected step = alone / (1 - theoretical "
           "bubble); the rest of the step is the messages and the waits for them.", "",
           f"| m | {cols(f'{k} alone (ms)' for k in SCHEDULES)} | "
           f"{cols(f'overhead {k}' for k in SCHEDULES)} | "
           f"{cols(f'expected / measured {k}' for k in SCHEDULES)} |",
           "|---:|" + "---:|" * (3 * len(SCHEDULES))]  # fmt: skip
    for r in rows:
        st, o, e = r["step_ms"], r["schedule_overhead"], r["expected_step_ms"]
        alone = cols(f"{st[k + ' alone']:.2f}" for k in SCHEDULES)
        md.append(f"| {r['m']} | {alone} | "
                  f"{cols(f'{o[k]:+.3f}' for k in SCHEDULES)} | "
                  f"{cols(f'{e[k]:.2f} / {st[k]:.2f}' for k in SCHEDULES)} |")  # fmt: skip
    md += ["", "## Memory per stage", "",
           "Temporary buffers of the compiled step (XLA's memory_analysis), MiB, stage 0 first. "
           "1F1B keeps p - s microbatches of residuals on stage s, GPipe m, ZB-H1 p (and the "
           "gradients at the parameters' uses that its weight-gradient pass reads); interleaved "
           "1F1B's program is written out, and XLA decides how long each residual lives.", "",
           f"| m | activation per microbatch (MiB) | {cols(SCHEDULES)} |",
           "|---:|---:|" + "---|" * len(SCHEDULES)]  # fmt: skip
    for r in rows:
        tm = r["temp_MiB_per_stage"]
        md.append(f"| {r['m']} | {r['activation_MiB_per_microbatch']:.3f} | "
                  + cols(", ".join(f"{v:.2f}" for v in tm[k]) for k in SCHEDULES)
                  + " |")  # fmt: skip
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index("## Bubble") :]))
    return 0


def run_lm(args: argparse.Namespace) -> int:
    """tokens/s of examples/train_lm.py per layout, each run a job of its own."""
    from spmd.bench import cores_tag, host_info

    script = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    rows = []
    for entry in args.layouts:
        layout, _, schedule = entry.partition(":")  # "pp=2:zero_bubble": the pipeline's schedule
        sizes = [int(part.split("=")[1]) for part in filter(None, layout.split(","))]
        n = math.prod(sizes)
        rates = []
        for _ in range(args.rounds):
            cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(n), sys.executable,
                   str(script), "--mesh", layout, "--steps", str(args.lm_steps),
                   "--sample", "0", *(["--schedule", schedule] if schedule else [])]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if out.returncode != 0:
                raise SystemExit(f"{layout}: {out.stderr.strip().splitlines()[-1:]}")
            last = re.findall(r"([\d,]+) tokens/s", out.stdout)[-1]
            rates.append(float(last.replace(",", "")))
        rows.append({"mesh": entry or "one process", "ranks": n,
                     "tokens_per_s": statistics.median(rates), "runs": rates})  # fmt: skip
        print(f"{entry or 'one process':>16}: {rows[-1]['tokens_per_s']:,.0f} tokens/s",
              flush=True)  # fmt: skip
    info = {**host_info(), "steps": args.lm_steps, "rounds": args.rounds,
            "model": "examples/train_lm.py defaults (4 layers, d=64, 4 heads, seq 64, batch 32)",
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{args.lm_tag}-{cores_tag()}"
    (out_dir / f"{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    one = rows[0]["tokens_per_s"]
    md = [
        "# examples/train_lm.py: tokens/s per mesh",
        "",
        "Produced by `python benchmarks/pipeline.py --lm"
        + (f" --layouts {' '.join(args.layouts)}" if args.layouts != LAYOUTS else "")
        + (f" --lm-tag {args.lm_tag}" if args.lm_tag != "pipeline-lm" else "")
        + "`.",
        "",
        "| machine | |",
        "|---|---|",
    ]
    md += [f"| {k} | {v} |" for k, v in info.items()]
    md += ["", "Global tokens per second over the steps after the first; the median over runs. "
           "vs first: against the first row.", "",
           "| mesh | ranks | tokens/s | vs first | runs |", "|---|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        md.append(f"| {r['mesh']} | {r['ranks']} | {r['tokens_per_s']:,.0f} | "
                  f"{r['tokens_per_s'] / one:.2f} | "
                  f"{', '.join(f'{x:,.0f}' for x in r['runs'])} |")  # fmt: skip
    (out_dir / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index("| mesh | ranks | tokens/s | vs first | runs |") :]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks when relaunching")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--lm", action="store_true", help="tokens/s of examples/train_lm.py")
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=LAYOUTS,
        help="meshes of examples/train_lm.py; mesh:schedule picks the pipeline's",
    )
    ap.add_argument("--lm-tag", default="pipeline-lm", help="the results' file name")
    ap.add_argument("--lm-steps", type=int, default=60)
    args = ap.parse_args(argv)
    if args.lm:
        return run_lm(args)
    from spmd.bench import in_job, relaunch

    if not in_job():
        return relaunch(args.nprocs, __file__, argv if argv is not None else sys.argv[1:])
    return run_job(args)


if __name__ == "__main__":
    sys.exit(main())
