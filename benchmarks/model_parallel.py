"""Model parallelism: a tensor-parallel MLP block against one process, and MoE dispatch + combine
against bare all_to_all calls moving the same bytes, in the same run.

    spmd-run -n 2 python benchmarks/model_parallel.py [--rounds 5] [--tokens 256]
    spmd-run -n 1 python benchmarks/model_parallel.py     # tp=1 against the dense block only
    python benchmarks/model_parallel.py -n 2               # outside a job it starts one itself

**Tensor parallel.** Megatron's MLP block, ``row_linear(gelu(column_linear(x, w1, b1)), w2, b2)``
with model dim D and hidden H, forward + backward (the gradients of every parameter and of x)
under ``jax.jit``: at tp = N on the job's N ranks (each holds H / N of the hidden units; one
allreduce forward, one backward), against one process running the dense block (plain ``@``, no
spmd) and the same process running the block through the tp layers at tp = 1. The one-process
jobs run in a child of rank 0 with every core of the job (``spmd-run`` pins each rank to its
share) while the other ranks sleep; rounds alternate the two. Reported: median step time (the
slowest rank's), the ratio to the dense process (above 1: faster), parameter bytes per rank,
and the compiled program's temp memory (``memory_analysis()``).

**Expert parallel** (2 ranks or more). ``spmd.moe.dispatch`` then ``spmd.moe.combine``
(dropless, identity experts in between, the routing computed once outside), jitted, in the
grouped layout (``layout="grouped"``: the rows routed, one expert after another, in a buffer of
``ep * T * min(k, E / ep)`` rows, zeros past them) and the padded one (a buffer of ``ep * T``
rows per local expert), against bare ``spmd.all_to_all`` of a ``(T * k, D)`` float32 buffer: the
same bytes as the token payload, ``T * k * D * 4`` per rank. dispatch + combine make two
exchanges (there and back), so the baseline is two chained all_to_alls of that buffer; the ratio
to one is printed too. On CPU both layouts use the native MoE exchange; "composed" is the grouped
layout the way a GPU runs it (``SPMD_MOE_EXCHANGE=composed``: a counts all_to_all, sorting and
placement in XLA, ``all_to_allv``), which CPU used before. "out_rows=1.25Tk" is the grouped
layout in a buffer of ``ceil(1.25 * T * k)`` rows (``dispatch(..., out_rows=)``), 1.25x the rows
an even routing brings each rank, instead of the worst case: fewer zeros to write (a routing
that brought more would be an error). Also timed: the capacity-factor path
(``capacity_factor=1.25``: fixed slots of ``ep * C`` rows per expert) and ``spmd.all_to_allv``
alone (dispatch's exchange of the sorted rows, counts given, into a buffer as large as the
grouped layout's).
The implementations are called in turn, call by call, each call timed on its own; per rank the
median, then the maximum over ranks.

Writes ``benchmarks/results/model_parallel-cpu<cores>-n<ranks>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20


# -- tensor parallel ------------------------------------------------------------------------------


def _mlp_params(d: int, h: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((d, h)) * d**-0.5).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.standard_normal((h, d)) * h**-0.5).astype(np.float32),
        "b2": np.zeros(d, np.float32),
    }


def _tokens(t: int, d: int, seed: int = 1) -> Any:
    import numpy as np

    return np.random.default_rng(seed).standard_normal((t, d)).astype(np.float32)


def _dense_step() -> Any:
    import jax

    def loss(p: Any, x: Any) -> Any:
        y = jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return (y * y).mean()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _tp_step(comm: Any) -> Any:
    import jax

    from spmd import tensor_parallel as tp

    def loss(p: Any, x: Any) -> Any:
        h = jax.nn.gelu(tp.column_linear(x, p["w1"], p["b1"], group=comm))
        y = tp.row_linear(h, p["w2"], p["b2"], group=comm)
        return (y * y).mean()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _tp_block(params: dict[str, Any], rank: int, n: int) -> dict[str, Any]:
    """This rank's blocks: w1's columns, b1's part, w2's rows, the whole b2."""
    h = params["w1"].shape[1] // n
    part = slice(rank * h, (rank + 1) * h)
    return {"w1": params["w1"][:, part], "b1": params["b1"][part], "w2": params["w2"][part],
            "b2": params["b2"]}  # fmt: skip


def _program(step: Any, params: Any, x: Any) -> dict[str, Any]:
    """Parameter bytes and the compiled program's memory (bytes), as XLA reports it."""
    info: dict[str, Any] = {"param_bytes": int(sum(v.nbytes for v in params.values()))}
    try:
        mem = step.lower(params, x).compile().memory_analysis()
        info["temp_bytes"] = int(mem.temp_size_in_bytes)
        info["argument_bytes"] = int(mem.argument_size_in_bytes)
        info["output_bytes"] = int(mem.output_size_in_bytes)
    except Exception as e:  # reported, not fatal
        info["memory_analysis"] = f"unavailable: {type(e).__name__}"
    return info


def _runner(step: Any, params: Any, x: Any) -> Callable[[], None]:
    import jax

    params, x = jax.device_put((params, x))

    def one() -> None:
        jax.block_until_ready(step(params, x))

    return one


def _interleaved(calls: dict[str, Callable[[], None]], iters: int, warmup: int,
                 sync: Callable[[], None] | None = None) -> dict[str, list[float]]:  # fmt: skip
    """Each call ``iters`` times, in turn call by call (the order rotating), each timed."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    if sync is not None:
        sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for i in range(iters):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            t0 = clock()
            calls[name]()
            times[name].append(clock() - t0)
    return times


def worker_single(args: argparse.Namespace) -> dict[str, Any]:
    """One process (no launcher): the dense block and the block at tp = 1, alternately."""
    import spmd

    comm = spmd.init()
    params, x = _mlp_params(args.dim, args.hidden), _tokens(args.tokens, args.dim)
    dense, tp1 = _dense_step(), _tp_step(comm)
    progs = {"dense": _program(dense, params, x), "tp1": _program(tp1, params, x)}
    calls = {"dense": _runner(dense, params, x), "tp1": _runner(tp1, params, x)}
    times = _interleaved(calls, args.steps, args.warmup)
    return {name: {"step_s": statistics.median(ts), **progs[name]} for name, ts in times.items()}


def _single_in_child(args: argparse.Namespace, comm: Any) -> dict[str, Any] | None:
    """Run :func:`worker_single` in a child of rank 0 with every core of the job, while the
    other ranks sleep (polling a file, so that they leave the cores to it)."""
    done = comm.broadcast_object(
        os.path.join(tempfile.gettempdir(), f"spmd-mpbench-{os.getpid()}.done")
    )
    result = None
    if comm.rank == 0:
        launcher = ("PMI_", "MPIR_", "HYDRA_", "MPI_LOCAL", "OMPI_", "SPMD_RUN_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
        cmd = [sys.executable, __file__, "--worker", "single", *_pass_on(args)]
        cpus = _job_cpus()
        old = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)  # the child inherits it; restored below
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        finally:
            os.sched_setaffinity(0, old)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode == 0 and lines:
            result = json.loads(lines[0][len("RESULT ") :])
        else:
            print(f"one-process worker failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        Path(done).write_text("1")
    else:
        while not os.path.exists(done):
            time.sleep(0.02)
    comm.barrier()
    if comm.rank == 0:
        os.unlink(done)
    return result


def _job_cpus() -> set[int]:
    from spmd.runtime._affinity import recorded_cpus

    recorded = recorded_cpus(os.environ)
    return set(recorded) if recorded is not None else os.sched_getaffinity(0)


def _pass_on(args: argparse.Namespace) -> list[str]:
    return ["--dim", str(args.dim), "--hidden", str(args.hidden), "--tokens", str(args.tokens),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip


def tp_round(args: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """The block at tp = N on the job's ranks: the slowest rank's median step."""
    full = _mlp_params(args.dim, args.hidden)
    params, x = _tp_block(full, comm.rank, comm.size), _tokens(args.tokens, args.dim)
    step = _tp_step(comm)
    prog = _program(step, params, x)
    times = _interleaved({"tp": _runner(step, params, x)}, args.steps, args.warmup, comm.barrier)
    return {"step_s": max(comm.allgather_object(statistics.median(times["tp"]))), **prog}


# -- expert parallel ------------------------------------------------------------------------------


def _moe_calls(comm: Any, t: int, d: int, k: int, e: int) -> dict[str, Callable[[], None]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import spmd
    from spmd import moe

    rng = np.random.default_rng(100 + comm.rank)
    x = jax.device_put(rng.standard_normal((t, d)).astype(np.float32))
    logits = jax.device_put(rng.standard_normal((t, e)).astype(np.float32))
    dropless = jax.jit(lambda lg: moe.route(lg, k))(logits)
    capped = jax.jit(lambda lg: moe.route(lg, k, capacity_factor=1.25))(logits)

    @jax.jit
    def dispatch_combine(x: Any, routing: Any) -> Any:
        return moe.combine(moe.dispatch(x, routing, group=comm), routing, group=comm)

    def grouped_step(x: Any, routing: Any) -> Any:
        rows, _ = moe.dispatch(x, routing, group=comm, layout="grouped")
        return moe.combine(rows, routing, group=comm, layout="grouped")

    grouped = jax.jit(grouped_step)
    grouped.lower(x, dropless)  # traced natively first

    # The grouped layout in a buffer of 1.25x the rows an even routing brings (T * k) instead
    # of the worst case (ep * T * min(k, E / ep)): fewer zeros to write.
    bound = math.ceil(1.25 * t * k)

    @jax.jit
    def bounded(x: Any, routing: Any) -> Any:
        rows, _ = moe.dispatch(x, routing, group=comm, layout="grouped", out_rows=bound)
        return moe.combine(rows, routing, group=comm, layout="grouped")

    # The way a GPU runs it: another jit of the same step, traced under the variable.
    os.environ["SPMD_MOE_EXCHANGE"] = "composed"
    try:
        composed = jax.jit(lambda x, r: grouped_step(x, r)).lower(x, dropless).compile()
    finally:
        del os.environ["SPMD_MOE_EXCHANGE"]

    buf = jax.device_put(rng.standard_normal((t * k, d)).astype(np.float32))
    a2a_once = jax.jit(lambda b: spmd.all_to_all(b, group=comm))
    a2a_twice = jax.jit(lambda b: spmd.all_to_all(spmd.all_to_all(b, group=comm), group=comm))

    # dispatch's exchange alone: the rows sorted by expert, the per-rank counts given.
    flat = np.asarray(dropless.experts).reshape(-1)
    order = np.argsort(flat, kind="stable")
    per_rank = np.bincount(flat // (e // comm.size), minlength=comm.size).astype(np.int32)
    recv = np.array(comm.allgather_object(per_rank.tolist()), np.int32)[:, comm.rank]
    send = jax.device_put(np.asarray(x)[order // k])
    sc, rc = jax.device_put(per_rank), jax.device_put(recv)
    rows = comm.size * t * k
    a2av = jax.jit(lambda s, a, b: spmd.all_to_allv(s, a, b, group=comm, out_rows=rows))

    # Results are checked once: identity experts give back sum(gates) * x = x (dropless).
    for f in (dispatch_combine, grouped, composed, bounded):
        if not np.allclose(np.asarray(f(x, dropless)), np.asarray(x), atol=1e-5):
            raise AssertionError("dispatch + combine with identity experts did not return x")
    keep_w = jnp.where(capped.keep, capped.gates, 0).sum(1, keepdims=True)
    if not np.allclose(np.asarray(dispatch_combine(x, capped)), np.asarray(keep_w * x), atol=1e-5):
        raise AssertionError("the capacity path with identity experts did not return gates * x")

    def run(f: Any, *a: Any) -> Callable[[], None]:
        return lambda: jax.block_until_ready(f(*a))

    return {
        "dispatch+combine grouped": run(grouped, x, dropless),
        "grouped, out_rows=1.25Tk": run(bounded, x, dropless),
        "grouped, composed": run(composed, x, dropless),
        "dispatch+combine": run(dispatch_combine, x, dropless),
        "dispatch+combine cf=1.25": run(dispatch_combine, x, capped),
        "2x all_to_all": run(a2a_twice, buf),
        "1x all_to_all": run(a2a_once, buf),
        "all_to_allv (dispatch's exchange)": run(a2av, send, sc, rc),
    }


def moe_round(args: argparse.Namespace, comm: Any) -> list[dict[str, Any]]:
    out = []
    for mib in args.moe_mib:
        t = int(mib * MIB) // (args.k * args.moe_dim * 4)
        calls = _moe_calls(comm, t, args.moe_dim, args.k, args.experts)
        iters = max(20, min(400, int(400 / mib)))
        times = _interleaved(calls, iters, max(3, iters // 10), comm.barrier)
        meds = comm.allgather_object({name: statistics.median(ts) for name, ts in times.items()})
        out.append({"payload_MiB": mib, "tokens": t, "iters": iters,
                    "time_s": {name: max(m[name] for m in meds) for name in calls}})  # fmt: skip
    return out


# -- driver ---------------------------------------------------------------------------------------


def _machine(args: argparse.Namespace, comm: Any, load_start: float, hops: list[Any]) -> Any:
    from spmd.bench import host_info

    hops = [h for h in hops if h is not None]
    return {
        **host_info(),
        "ranks": comm.size,
        "mlp": f"D={args.dim}, H={args.hidden}, tokens={args.tokens}, float32, gelu",
        "moe": f"D={args.moe_dim}, k={args.k}, E={args.experts}, random router logits, float32",
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "load_average_1min_at_start": load_start,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "shm_hop_ns_min_max": [min(hops), max(hops)] if hops else None,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_job(args: argparse.Namespace) -> int:
    import spmd
    from spmd.bench import cores_tag, shm_hop

    comm = spmd.init()
    n = comm.size
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    load_start = round(os.getloadavg()[0], 2)
    hops: list[Any] = []
    tp: list[dict[str, Any]] = []
    single: list[dict[str, Any]] = []
    moe_runs: list[list[dict[str, Any]]] = []
    for r in range(args.rounds):
        parts = ["tp", "single", "moe"] if r % 2 == 0 else ["moe", "single", "tp"]
        for part in parts:
            if part == "tp" and n > 1 and not args.no_tp:
                hops.append(shm_hop())
                tp.append(tp_round(args, comm))
                say(f"round {r + 1} tp={n}: {tp[-1]['step_s'] * 1e3:8.2f} ms", flush=True)
            elif part == "single" and not args.no_tp:
                res = _single_in_child(args, comm) if n > 1 else worker_single(args)
                if res is not None:
                    single.append(res)
                    say(f"round {r + 1} one process: dense {res['dense']['step_s'] * 1e3:8.2f} "
                        f"ms, tp=1 {res['tp1']['step_s'] * 1e3:8.2f} ms", flush=True)  # fmt: skip
            elif part == "moe" and n > 1 and not args.no_moe:
                moe_runs.append(moe_round(args, comm))
                hops.append(shm_hop())
                say(f"round {r + 1} moe: " + ", ".join(
                    f"{m['payload_MiB']} MiB {m['time_s']['dispatch+combine'] * 1e3:.2f}/"
                    f"{m['time_s']['2x all_to_all'] * 1e3:.2f} ms" for m in moe_runs[-1]),
                    flush=True)  # fmt: skip
    if comm.rank != 0:
        return 0

    tp_rows = []
    if single:
        dense = _med([s["dense"]["step_s"] for s in single])
        impls = [
            ("one process, dense block (no spmd)", [s["dense"] for s in single]),
            ("one process, tp=1 (tp layers, world of one)", [s["tp1"] for s in single]),
        ]
        if tp:
            impls.append((f"spmd tp={n}, {n} ranks", tp))
        for label, runs in impls:
            t = _med([x["step_s"] for x in runs])
            tp_rows.append({
                "implementation": label,
                "step_ms": round(t * 1e3, 3),
                "vs_one_process": round(dense / t, 3),
                "param_MiB_per_rank": round(runs[0]["param_bytes"] / MIB, 2),
                "temp_MiB": round(runs[0]["temp_bytes"] / MIB, 2) if "temp_bytes" in runs[0]
                else None,
                "rounds_ms": [round(x["step_s"] * 1e3, 3) for x in runs],
            })  # fmt: skip
    moe_rows = []
    if moe_runs:
        for i, first in enumerate(moe_runs[0]):
            names = list(first["time_s"])
            med = {nm: _med([run[i]["time_s"][nm] for run in moe_runs]) for nm in names}
            two, one = med["2x all_to_all"], med["1x all_to_all"]
            moe_rows.append({
                "payload_MiB": first["payload_MiB"],
                "tokens": first["tokens"],
                "iters_per_round": first["iters"],
                "median_ms": {nm: round(v * 1e3, 4) for nm, v in med.items()},
                "vs_2x_all_to_all": {nm: round(v / two, 3) for nm, v in med.items()},
                "vs_1x_all_to_all": {nm: round(v / one, 3) for nm, v in med.items()},
                "rounds_ms": {nm: [round(run[i]["time_s"][nm] * 1e3, 4) for run in moe_runs]
                              for nm in names},
            })  # fmt: skip

    info = _machine(args, comm, load_start, hops)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"model_parallel-{cores_tag()}-n{n}"
    (out / f"{tag}.json").write_text(
        json.dumps({"machine": info, "tensor_parallel": tp_rows, "moe": moe_rows}, indent=2) + "\n"
    )
    md = [f"# Model parallelism: tensor-parallel MLP block and MoE dispatch + combine, {n} ranks",
          "", f"Produced by `spmd-run -n {n} python benchmarks/model_parallel.py"
          + (f" --rounds {args.rounds}" if args.rounds != 5 else "") + "`.", "",
          "| machine | |", "|---|---|"]  # fmt: skip
    md += [f"| {k} | {v} |" for k, v in info.items()]
    if tp_rows:
        md += ["", "## Tensor-parallel MLP block (forward + backward, jit)", "",
               "Per round the median step (the slowest rank's), then the median over rounds. "
               "vs one process = the dense process's step time / this one (above 1: faster). "
               "temp: the compiled program's temporary buffers (XLA's memory_analysis).", "",
               "| implementation | step (ms) | vs one process | params per rank (MiB) | "
               "temp (MiB) | rounds (ms) |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in tp_rows:
            temp = "n/a" if r["temp_MiB"] is None else f"{r['temp_MiB']:.1f}"
            md.append(f"| {r['implementation']} | {r['step_ms']:.2f} | {r['vs_one_process']:.2f} "
                      f"| {r['param_MiB_per_rank']:.1f} | {temp} | "
                      f"{', '.join(f'{x:.2f}' for x in r['rounds_ms'])} |")  # fmt: skip
    if moe_rows:
        names = list(moe_rows[0]["median_ms"])
        md += ["", "## MoE dispatch + combine against bare all_to_all (jit)", "",
               f"Payload per rank = T * k * D * 4 bytes (k={args.k}, D={args.moe_dim}, "
               f"E={args.experts}). Per call: each rank's median, the maximum over ranks; the "
               "median over rounds. Baseline: two chained all_to_alls of a (T * k, D) buffer "
               "(dispatch + combine exchange there and back). Ratio = time / baseline "
               "(below 1: faster); the ratio to one all_to_all in parentheses.", "",
               "| payload | T | " + " | ".join(names) + " |",
               "|---:|---:|" + "---:|" * len(names)]  # fmt: skip
        for r in moe_rows:
            cells = [f"{r['median_ms'][nm]:.3f} ms ({r['vs_2x_all_to_all'][nm]:.2f}x; "
                     f"{r['vs_1x_all_to_all'][nm]:.2f}x)" for nm in names]  # fmt: skip
            md.append(f"| {r['payload_MiB']} MiB | {r['tokens']} | " + " | ".join(cells) + " |")
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index("| machine | |") + len(info) + 2 :]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks when relaunching")
    p.add_argument("--dim", type=int, default=1024, help="MLP model dim D")
    p.add_argument("--hidden", type=int, default=4096, help="MLP hidden H")
    p.add_argument("--tokens", type=int, default=256, help="MLP tokens")
    p.add_argument("--steps", type=int, default=30, help="timed MLP steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--moe-mib", type=float, nargs="+", default=[1, 4, 16])
    p.add_argument("--moe-dim", type=int, default=1024)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--no-tp", action="store_true")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--worker", choices=("single",), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.moe_mib = [int(m) if float(m).is_integer() else m for m in args.moe_mib]

    if args.worker:
        print("RESULT " + json.dumps(worker_single(args)), flush=True)
        return 0
    from spmd.bench import in_job, relaunch

    if not in_job():
        return relaunch(args.nprocs, __file__, argv if argv is not None else sys.argv[1:])
    return run_job(args)


if __name__ == "__main__":
    sys.exit(main())
