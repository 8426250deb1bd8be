"""Data-parallel training throughput: spmd's @data_parallel on N ranks against one process at
the same global batch, and torch DDP (gloo) where torch is installed, in the same run.

    python benchmarks/data_parallel.py [--ranks 2] [--rounds 3] [--steps 40] [--zero]
    python benchmarks/data_parallel.py --deterministic

Model: MLP 784-1024-1024-10 (float32), batch 64 per rank, cross-entropy, SGD with momentum
(``--optimizer adam`` for Adam). Rounds alternate the implementations so that a noisy
neighbour hits them alike; each round reports the median step time of its timed steps, and the
table quotes the median over rounds. Writes
``benchmarks/results/data_parallel-cpu<cores>-n<ranks>.{json,md}`` (``cpu<cores>of<total>`` on a job
given fewer cores than the machine has: ``taskset``, a cpuset).

``--zero`` adds ``@spmd.zero_shard`` stages 1, 2 and 3 on the same step and reports each
against ``@data_parallel`` (results tagged ``-zero``). ``--deterministic`` runs one process,
``@data_parallel`` and ``@data_parallel(deterministic=True, shards=8)`` (results tagged
``-deterministic``): what bit-identical results at any world size cost.

Each implementation runs as its own job (this script with ``--worker``): spmd under
``spmd-run -n N`` (which pins each rank to its share of the cores; once more with
``compression="bf16"``, once with ``SPMD_BIND=none``), one process alone with the machine,
torch DDP under ``spmd-run -n N`` with a gloo process group (and torch alone at the global
batch, the reference of torch's own scaling), N ranks training with no communication at all
(the ceiling that any data-parallel implementation meets on this machine), and the same with
one 4-byte allreduce per step (what making the ranks wait for each other costs, before any
gradient moves).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spmd.bench import (
    cores_tag,
    host_info,
    job_cores,
    package_version,
    shm_hop,
)

SIZES = (784, 1024, 1024, 10)
HEADER = (
    "| implementation | step (ms) | samples/s | vs one process | vs data_parallel | rounds (ms) |"
)
RESULTS = Path(__file__).resolve().parent / "results"


# -- workers --------------------------------------------------------------------------------------


def _data(rows: int, seed: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, SIZES[0]), dtype=np.float32), rng.integers(0, 10, rows)


def _time(step: Any, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _jax_setup(optimizer: str) -> tuple[Any, Any, Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    def init(key: Any) -> Any:
        keys = jax.random.split(key, len(SIZES) - 1)
        return [
            {"w": jax.random.normal(k, (m, n)) * (2.0 / m) ** 0.5, "b": jnp.zeros((n,))}
            for k, m, n in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
        ]

    def loss_fn(params: Any, batch: Any) -> Any:
        x, y = batch
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = optax.adam(1e-3) if optimizer == "adam" else optax.sgd(0.01, momentum=0.9)
    params = init(jax.random.key(0))
    return params, tx.init(params), tx, loss_fn


def _time_steps(step: Any, params: Any, opt_state: Any, rows: int, seed: int,
                args: argparse.Namespace) -> float:  # fmt: skip
    """Median time of ``step(params, opt_state, batch)`` on a batch of ``rows`` rows."""
    import jax

    batch = tuple(jax.device_put(a) for a in _data(rows, seed=seed))
    state = [params, opt_state]

    def one() -> None:
        state[0], state[1], loss = step(state[0], state[1], batch)
        loss.block_until_ready()

    return statistics.median(_time(one, args.steps, args.warmup))


def _local_step(args: argparse.Namespace, sync: bool = False) -> tuple[Any, Any, Any]:
    """A plain ``jax.jit`` step, with its initial parameters and state: no collective, or with
    ``sync`` one 4-byte allreduce of the loss (the ranks wait for each other every step)."""
    import jax
    import optax

    params, opt_state, tx, loss_fn = _jax_setup(args.optimizer)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if sync:
            import spmd

            loss = spmd.allreduce(loss)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, opt_state


def worker_spmd(args: argparse.Namespace) -> dict[str, Any]:
    import optax

    import spmd

    comm = spmd.init()
    params, opt_state, tx, loss_fn = _jax_setup(args.optimizer)
    params = spmd.broadcast_params(params)

    def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if args.stage:
        step = spmd.zero_shard(train_step, stage=args.stage, bucket_mb=args.bucket_mb)
        params, opt_state = step.shard(params, opt_state)
    else:
        compression = "bf16" if args.worker == "spmd-bf16" else None
        step = spmd.data_parallel(train_step, bucket_mb=args.bucket_mb, compression=compression,
                                  deterministic=args.worker == "spmd-det", shards=8)  # fmt: skip

    hop = shm_hop()
    med = _time_steps(step, params, opt_state, args.batch, comm.rank, args)
    slowest = max(comm.allgather_object(med))  # the step ends when the slowest rank does
    return {"step_s": slowest, "ranks": comm.size, "global_batch": args.batch * comm.size,
            "hop_ns": [hop, shm_hop()]}  # fmt: skip


def worker_nocomm(args: argparse.Namespace) -> dict[str, Any]:
    """N ranks each train on their own batch with no communication at all: the ceiling of any
    data-parallel implementation on this machine (what N processes cost, before collectives).
    As the ``sync`` worker, one 4-byte allreduce per step makes them wait for each other."""
    import spmd

    comm = spmd.init()
    hop = shm_hop()
    med = _time_steps(*_local_step(args, sync=args.worker == "sync"), args.batch, comm.rank, args)
    slowest = max(comm.allgather_object(med))
    return {"step_s": slowest, "ranks": comm.size, "global_batch": args.batch * comm.size,
            "hop_ns": [hop, shm_hop()]}  # fmt: skip


def worker_single(args: argparse.Namespace) -> dict[str, Any]:
    rows = args.batch * args.ranks
    med = _time_steps(*_local_step(args), rows, 0, args)
    return {"step_s": med, "ranks": 1, "global_batch": rows}


def _torch_step(args: argparse.Namespace, rows: int, seed: int, wrap: Any = None) -> Any:
    """One torch training step on ``rows`` samples (the model wrapped by ``wrap``, e.g. DDP)."""
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for m, n in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(m, n), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    if wrap is not None:
        model = wrap(model)
    opt = (
        torch.optim.Adam(model.parameters(), 1e-3)
        if args.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    )
    x, y = (torch.from_numpy(a) for a in _data(rows, seed=seed))
    loss_fn = torch.nn.CrossEntropyLoss()

    def one() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return one


def worker_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import spmd

    comm = spmd.init()  # rank and size from the launcher; gloo bootstraps through env
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getppid() % 1000))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    torch.set_num_threads(max(1, job_cores() // comm.size))
    one = _torch_step(args, args.batch, comm.rank, DistributedDataParallel)
    times = _time(one, args.steps, args.warmup)
    slowest = max(comm.allgather_object(statistics.median(times)))
    dist.destroy_process_group()
    return {"step_s": slowest, "ranks": comm.size, "global_batch": args.batch * comm.size}


def worker_torch_single(args: argparse.Namespace) -> dict[str, Any]:
    """torch alone at the global batch, on all cores: what torch DDP is measured against."""
    import torch

    torch.set_num_threads(job_cores())
    rows = args.batch * args.ranks
    one = _torch_step(args, rows, 0)
    return {"step_s": statistics.median(_time(one, args.steps, args.warmup)), "ranks": 1,
            "global_batch": rows}  # fmt: skip


WORKERS = {"spmd": worker_spmd, "spmd-unpinned": worker_spmd, "spmd-bf16": worker_spmd,
           "spmd-det": worker_spmd,
           "single": worker_single,
           "nocomm": worker_nocomm, "sync": worker_nocomm, "torch": worker_torch,
           "torch-single": worker_torch_single,
           "zero1": worker_spmd, "zero2": worker_spmd, "zero3": worker_spmd}  # fmt: skip


# -- driver ---------------------------------------------------------------------------------------


def _run_worker(name: str, args: argparse.Namespace) -> dict[str, Any] | str:
    cmd = [sys.executable, __file__, "--worker", name, "--ranks", str(args.ranks),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--optimizer", args.optimizer, "--bucket-mb", str(args.bucket_mb),
           "--stage", name[4:] if name.startswith("zero") else "0"]  # fmt: skip
    env = dict(os.environ)
    if name not in ("single", "torch-single"):
        # spmd-run pins each rank to its share of the cores; spmd-unpinned: SPMD_BIND=none.
        env["SPMD_BIND"] = "none" if name == "spmd-unpinned" else "auto"
        cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(args.ranks), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        return f"exit {out.returncode}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    return dict(json.loads(lines[0][len("RESULT ") :]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="per rank (one process: batch x ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--zero", action="store_true", help="also zero_shard stages 1-3")
    p.add_argument("--deterministic", action="store_true",
                   help="one process, data_parallel, deterministic=True")  # fmt: skip
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        result = WORKERS[args.worker](args)
        if args.worker in ("single", "torch-single") or int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    impls = (
        ["single", "spmd", "zero1", "zero2", "zero3"]
        if args.zero
        else ["single", "spmd", "spmd-det"]
        if args.deterministic
        else ["single", "nocomm", "sync", "spmd", "spmd-bf16", "spmd-unpinned"]
    )
    skipped = {}
    if package_version("torch") is None:
        skipped["torch DDP"] = "torch is not installed"
    elif not args.zero and not args.deterministic:
        impls += ["torch", "torch-single"]
    runs: dict[str, list[float]] = {i: [] for i in impls}
    errors: dict[str, str] = {}
    load_start = round(os.getloadavg()[0], 2)
    hops: list[float] = []  # the staging probe before and after the multi-rank jobs' steps
    for r in range(args.rounds):
        for impl in impls if r % 2 == 0 else reversed(impls):
            res = _run_worker(impl, args)
            if isinstance(res, str):
                errors[impl] = res
                continue
            runs[impl].append(res["step_s"])
            hops.extend(h for h in res.get("hop_ns", []) if h is not None)
            print(f"round {r + 1} {impl:>10}: {res['step_s'] * 1e3:8.2f} ms/step", flush=True)
    global_batch = args.batch * args.ranks
    labels = {
        "single": "one process",
        "spmd": f"spmd data_parallel ({args.ranks} ranks)",
        "spmd-unpinned": f"spmd data_parallel ({args.ranks} ranks, SPMD_BIND=none)",
        "spmd-bf16": f"spmd data_parallel ({args.ranks} ranks, compression='bf16')",
        "spmd-det": f"spmd data_parallel ({args.ranks} ranks, deterministic=True, shards=8)",
        "nocomm": f"{args.ranks} ranks, no communication (ceiling)",
        "sync": f"{args.ranks} ranks, only a 4-byte allreduce per step",
        "torch": f"torch DDP gloo ({args.ranks} ranks)",
        "torch-single": "torch, one process",
        **{f"zero{k}": f"spmd zero_shard stage {k} ({args.ranks} ranks)" for k in (1, 2, 3)},
    }
    rows = []
    single = statistics.median(runs["single"]) if runs["single"] else float("nan")
    dp = statistics.median(runs["spmd"]) if runs["spmd"] else float("nan")
    for impl in impls:
        if not runs[impl]:
            continue
        t = statistics.median(runs[impl])
        rows.append({
            "implementation": labels[impl],
            "step_ms": round(t * 1e3, 3),
            "samples_per_s": round(global_batch / t, 1),
            "vs_one_process": round(single / t, 3),
            "vs_data_parallel": round(dp / t, 3),
            "rounds_ms": [round(x * 1e3, 3) for x in runs[impl]],
        })  # fmt: skip
    info = {
        **host_info("optax", "torch"),
        "model": "MLP " + "-".join(map(str, SIZES)) + ", float32",
        "optimizer": "adam" if args.optimizer == "adam" else "sgd momentum 0.9",
        "batch_per_rank": args.batch,
        "global_batch": global_batch,
        "ranks": args.ranks,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "bucket_mb": args.bucket_mb,
        "load_average_1min_at_start": load_start,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "shm_hop_ns_min_max": [min(hops), max(hops)] if hops else None,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"data_parallel-{cores_tag()}-n{args.ranks}"
    if args.optimizer != "sgd":
        tag += f"-{args.optimizer}"
    if args.zero:
        tag += "-zero"
    if args.deterministic:
        tag += "-deterministic"
    (out / f"{tag}.json").write_text(
        json.dumps({"machine": info, "results": rows, "skipped": skipped, "errors": errors},
                   indent=2) + "\n"
    )  # fmt: skip
    md = [
        f"# Data-parallel training step: {args.ranks} ranks vs one process",
        "",
        "Produced by `python benchmarks/data_parallel.py`.",
        "",
        "| machine | |",
        "|---|---|",
    ]
    md += [f"| {k} | {v} |" for k, v in info.items()]
    md += ["", "Step time: per round the median over timed steps (the slowest rank's), then the "
           "median over rounds. samples/s = global batch / step time. vs one process = one "
           "process's step time / this step time at the same global batch (above 1: faster); "
           "vs data_parallel likewise against spmd's data_parallel.", "",
           HEADER, "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    md += [
        f"| {r['implementation']} | {r['step_ms']:.2f} | {r['samples_per_s']:.0f} | "
        f"{r['vs_one_process']:.2f} | {r['vs_data_parallel']:.2f} | "
        f"{', '.join(f'{x:.2f}' for x in r['rounds_ms'])} |"
        for r in rows
    ]
    if skipped or errors:
        md += ["", *(f"- skipped {k}: {v}" for k, v in skipped.items()),
               *(f"- {k} failed: {v}" for k, v in errors.items())]  # fmt: skip
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index(HEADER) :]))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
