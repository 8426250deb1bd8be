"""The cost model (spmd.perf) against measurements on test hosts: fitted on some layouts,
checked on others.

    python benchmarks/cost_model.py [--link "rate 1gbit"] [--sizes 4,64K,1M,16M] [--rounds 3]

Needs root for the test hosts (docs/hosts.md). Five jobs, each `spmd-bench` or this script's
worker under `spmd-run`:

1. one node, 2 ranks: spmd's shared memory and MPI (`--transport shm,mpi`);
2. 2 test hosts x 1 rank, each host's link shaped by `--link`: MPI between hosts;
3. 2 test hosts x 2 ranks, the same links: the hierarchical transport and one MPI call over the
   group (`--transport hier,mpi`);
4. the same 4 ranks training an MLP with `@spmd.data_parallel` and `@spmd.zero_shard(stage=1|3)`:
   each step's time, and its compute alone (the same step without collectives, on every rank at
   once).

The link parameters are fitted to jobs 1 and 2 (`spmd.perf.fit`) and then predict job 3's calls
and job 4's steps (the compute measured, plus the predicted time of every collective
`spmd.trace` shows in the step). Writes `results/cost_model-cpu<cores>.{json,md}`: the fitted
parameters and predicted against measured, row by row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
OPS = "allreduce,allgather,reduce_scatter,broadcast,all_to_all"
SIZES = (784, 1024, 1024, 10)  # the MLP of benchmarks/data_parallel.py
BATCH = 64  # per rank


# -- the step worker (job 4) -----------------------------------------------------------------------


def _collectives(program: Any) -> list[tuple[str, int]]:
    """(op, bytes as nccl-tests counts them) of every collective in a traced step."""
    out = []
    for e in program.jaxpr.jaxpr.eqns:
        name = e.primitive.name
        if not name.startswith("spmd_"):
            continue
        op = name[len("spmd_") :]
        size = sum(v.aval.size * v.aval.dtype.itemsize for v in e.invars if hasattr(v, "aval"))
        if op == "allgather":
            size *= e.params["group"].size if "group" in e.params else 1
        out.append((op, int(size)))
    return out


def worker_steps(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    import spmd

    comm = spmd.init()
    keys = jax.random.split(jax.random.key(0), len(SIZES))
    params = [
        {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=False)
    ]
    tx = optax.sgd(0.01, momentum=0.9)
    x = jax.random.normal(jax.random.key(comm.rank + 1), (BATCH, SIZES[0]))
    y = jax.random.randint(jax.random.key(comm.rank + 7), (BATCH,), 0, SIZES[-1])

    def loss(p: Any, x: Any, y: Any) -> Any:
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ p[-1]["w"] + p[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def body(p: Any, s: Any, x: Any, y: Any) -> Any:
        value, g = spmd.value_and_grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    def plain(p: Any, s: Any, x: Any, y: Any) -> Any:
        value, g = jax.value_and_grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    steps: dict[str, Any] = {"compute": (jax.jit(plain), (params, tx.init(params)))}
    calls: dict[str, list[tuple[str, int]]] = {"compute": []}
    for name, dec in (("data_parallel", spmd.data_parallel),
                      ("zero_shard(stage=1)", spmd.zero_shard(stage=1)),
                      ("zero_shard(stage=3)", spmd.zero_shard(stage=3))):  # fmt: skip
        step = dec(body)
        state = (
            step.shard(params, tx.init(params))
            if hasattr(step, "shard")
            else (params, tx.init(params))
        )
        steps[name] = (step, state)
        calls[name] = _collectives(spmd.trace(step)(*state, x, y))
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, (fn, state) in steps.items():
            for i in range(args.steps + 3):
                spmd.barrier()
                t0 = time.perf_counter()
                p, s, value = fn(*state, x, y)
                jax.block_until_ready(value)
                if i >= 3:
                    times[name].append(time.perf_counter() - t0)
                state = (p, s)
            steps[name] = (fn, state)
    medians = {k: max(comm.allgather_object(statistics.median(v))) for k, v in times.items()}
    if comm.rank == 0:
        print(json.dumps({"step_s": medians, "collectives": calls}), flush=True)


# -- the driver -----------------------------------------------------------------------------------


def _spmd_run(ranks: int, hosts: int, link: str, argv: list[str]) -> str:
    cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(ranks)]
    if hosts:
        cmd += ["--hosts", str(hosts)] + (["--link", link] if link else [])
    out = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd + argv)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out.stdout


def _bench(ranks: int, hosts: int, link: str, transport: str, args: argparse.Namespace,
           path: Path) -> None:  # fmt: skip
    _spmd_run(ranks, hosts, link, [sys.executable, "-m", "spmd.cli.bench", "--ops", OPS,
                                   "--sizes", args.sizes, "--transport", transport,
                                   "--peers", "none", "--rounds", str(args.rounds),
                                   "--iters", str(args.iters), "--no-small",
                                   "--json", str(path)])  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| op | bytes | layout | algorithm | measured (us) | predicted (us) | error |",
           "|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['op']} | {r['bytes']} | {r['nodes']} x {r['per_node']} | "
                   f"{r['algorithm']} | {r['measured_us']:.1f} | {r['predicted_us']:.1f} | "
                   f"{r['error']:+.0%} |")  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="rate 1gbit", help="tc parameters of each host's link")
    p.add_argument("--sizes", default="4,64K,1M,16M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (job 4)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_steps(args)
        return 0

    from spmd.bench import cores_tag, host_info
    from spmd.perf import compare, fit, read_bench

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _bench(2, 0, "", "shm,mpi", args, d / "one_node.json")
        _bench(2, 2, args.link, "mpi", args, d / "two_hosts_x1.json")
        _bench(4, 2, args.link, "hier,mpi", args, d / "two_hosts_x2.json")
        out = _spmd_run(
            4,
            2,
            args.link,
            [
                sys.executable,
                __file__,
                "--worker",
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
            ],
        )
        steps = json.loads(out.strip().splitlines()[-1])
        fitted_on = read_bench(d / "one_node.json", 1, 2) + read_bench(
            d / "two_hosts_x1.json", 2, 1
        )
        checked = read_bench(d / "two_hosts_x2.json", 2, 2)
    links = fit(fitted_on)
    params = links.as_dict()
    step_rows = []
    compute = steps["step_s"]["compute"]
    for name, measured in steps["step_s"].items():
        if name == "compute":
            continue
        comm_s = sum(links.time(op, size, 2, 2, "hier") for op, size in steps["collectives"][name])
        predicted = compute + comm_s
        step_rows.append({"step": name, "measured_ms": measured * 1e3,
                          "compute_ms": compute * 1e3, "collectives": steps["collectives"][name],
                          "predicted_ms": predicted * 1e3,
                          "error": predicted / measured - 1})  # fmt: skip
    fit_rows, check_rows = compare(fitted_on, links), compare(checked, links)
    report = {
        "command": " ".join(["python benchmarks/cost_model.py", *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": host_info(),
        "link": args.link,
        "params": params,
        "fitted_on": fit_rows,
        "checked": check_rows,
        "steps": step_rows,
        "minutes": round((time.monotonic() - start) / 60, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    tag = f"cost_model-{cores_tag()}"
    (RESULTS / f"{tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    md = [f"# Cost model against measurements ({args.link} links between 2 test hosts)", "",
          f"Produced by `{report['command']}` on {report['date_utc']} "
          f"({report['machine'].get('cpu', '?')}, {os.cpu_count()} cores).", "",
          "## Fitted parameters", "", "| parameter | value |", "|---|---:|"]  # fmt: skip
    for k, v in params.items():
        unit = (
            f"{v * 1e6:.2f} us" if k.endswith("alpha") else f"{1 / v / 1e9:.3f} GB/s" if v else "0"
        )
        md.append(f"| {k} | {unit} |")
    md += ["", "## Fitted on (one node x 2 ranks; 2 hosts x 1 rank)", "", *_table(fit_rows)]
    md += ["", "## Predicted (2 hosts x 2 ranks)", "", *_table(check_rows)]
    md += ["", "## Training steps on 2 hosts x 2 ranks (MLP 784-1024-1024-10, batch 64 per rank)",
           "", "| step | measured (ms) | compute (ms) | predicted (ms) | error |",
           "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in step_rows:
        md.append(f"| {r['step']} | {r['measured_ms']:.1f} | {r['compute_ms']:.1f} | "
                  f"{r['predicted_ms']:.1f} | {r['error']:+.0%} |")  # fmt: skip
    (RESULTS / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
