"""mpi4py as its users run it, against mpi4py inside a process where spmd tuned malloc, and spmd.

    python benchmarks/mpi4py_malloc.py [--ranks 2] [--mb 64] [--rounds 3]

``spmd.init`` raises glibc's mmap threshold so that large buffers are reused instead of mapped
afresh on every call (see spmd/runtime/_malloc.py). The tuning is process-wide, so in
``spmd-bench`` (one job for every implementation) the mpi4py peers profit from it too: MPICH's
large reductions allocate a temporary buffer on every call. This script measures the large
collectives three ways, each in its own job, rounds alternating:

- ``mpi4py (plain)``: a process that never imports spmd and whose malloc nobody tuned (what an
  mpi4py user runs);
- ``mpi4py (spmd's malloc)``: the same calls after spmd's tuning;
- ``spmd``: spmd's collectives inside ``jax.jit``;
- ``floor``: no communication at all, only the memory work that the out-of-place call leaves to
  each rank whatever the algorithm, done by numpy on all ranks at once: allreduce copies the
  input to the output, allgather copies the rank's own block into the output, reduce_scatter
  adds the input's blocks into the output. No collective that returns a new array can beat it.

Time: per call the maximum over ranks, the median over calls, then the median over rounds.
The spmd job also records the shared-memory staging probe's hop time before and after its calls
(``spmd.bench.shm_hop``; benchmarks/README.md: where the two cores share no cache).
Writes ``benchmarks/results/mpi4py-malloc-cpu<cores>-n<ranks>.{json,md}`` (``cpu<cores>of<total>``
on a job given fewer cores than the machine has).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
OPS = ("allreduce in place", "allreduce", "allgather in place", "allgather", "reduce_scatter")
IMPLS = {
    "plain": "mpi4py (plain)",
    "tuned": "mpi4py (spmd's malloc)",
    "spmd": "spmd (jit)",
    "floor": "local memory work only",
}


def _timed(comm: Any, call: Any, calls: int) -> float:
    import numpy as np

    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        comm.Barrier()
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    slowest = np.empty(calls)
    from mpi4py import MPI

    comm.Allreduce(np.asarray(times), slowest, op=MPI.MAX)
    return float(statistics.median(slowest))


def worker(impl: str, nbytes: int, calls: int) -> dict[str, Any]:
    """Times the calls of one implementation: ``{"s": {op: seconds}}``, and for spmd also
    ``"hop_ns"``: the staging probe's hop before and after them."""
    import numpy as np

    if impl in ("tuned", "spmd"):
        import spmd

        spmd.init()  # tunes malloc (SPMD_MALLOC_TUNING=1, the default)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n, count = comm.size, nbytes // 4
    x = np.ones(count, np.float32)
    block = np.ones(count // n, np.float32)
    out = np.empty(count, np.float32)
    part = np.empty(count // n, np.float32)
    buf = np.zeros(count, np.float32)  # in place: zeros stay zeros
    if impl == "spmd":
        import jax
        import jax.numpy as jnp

        import spmd

        xs, bs = jnp.asarray(x), jnp.asarray(block)
        ar = jax.jit(lambda a: spmd.allreduce(a))
        ag = jax.jit(lambda a: spmd.allgather(a))
        rs = jax.jit(lambda a: spmd.reduce_scatter(a))
        calls_by_op = {
            "allreduce": lambda: ar(xs).block_until_ready(),
            "allgather": lambda: ag(bs).block_until_ready(),
            "reduce_scatter": lambda: rs(xs).block_until_ready(),
        }
        from spmd.bench import shm_hop

        hops = [shm_hop()]
        times = {op: _timed(comm, call, calls) for op, call in calls_by_op.items()}
        return {"s": times, "hop_ns": [*hops, shm_hop()]}
    elif impl == "floor":
        me, rows = comm.rank, count // n

        def add_blocks() -> None:
            np.add(x[:rows], x[rows : 2 * rows], out=part)
            for r in range(2, n):
                np.add(part, x[r * rows : (r + 1) * rows], out=part)

        calls_by_op = {
            "allreduce": lambda: np.copyto(out, x),
            "allgather": lambda: np.copyto(out[me * rows : (me + 1) * rows], block),
            "reduce_scatter": add_blocks if n > 1 else lambda: np.copyto(part, x),
        }
    else:
        ip = MPI.IN_PLACE
        calls_by_op = {
            "allreduce in place": lambda: comm.Allreduce(ip, buf),
            "allreduce": lambda: comm.Allreduce(x, out),
            "allgather in place": lambda: comm.Allgather(ip, buf),
            "allgather": lambda: comm.Allgather(block, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(x, part),
        }
    return {"s": {op: _timed(comm, call, calls) for op, call in calls_by_op.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mb", type=int, default=64, help="size of the full array (MiB)")
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--worker", choices=tuple(IMPLS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    nbytes = args.mb << 20
    if args.worker:
        res = worker(args.worker, nbytes, args.calls)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    # The driver only: a plain worker never imports spmd.
    from spmd.bench import cores_tag, job_cores

    runs: dict[str, dict[str, list[float]]] = {i: {} for i in IMPLS}
    hops: list[float] = []  # the spmd jobs' probe readings, before and after their calls
    for r in range(args.rounds):
        for impl in IMPLS if r % 2 == 0 else reversed(list(IMPLS)):
            cmd = [
                sys.executable, "-m", "spmd.cli.run", "-n", str(args.ranks), sys.executable,
                __file__, "--worker", impl, "--mb", str(args.mb), "--calls", str(args.calls),
            ]  # fmt: skip
            # spmd-run tunes malloc in every rank unless told not to: plain is a process that
            # never tunes it, as under a bare mpiexec.
            env = {**os.environ, "SPMD_MALLOC_TUNING": "0" if impl == "plain" else "1"}
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                print(out.stderr, file=sys.stderr)
                return 1
            res = json.loads(line[0][len("RESULT ") :])
            for op, t in res["s"].items():
                runs[impl].setdefault(op, []).append(t)
            hops.extend(h for h in res.get("hop_ns", []) if h is not None)
            print(f"round {r + 1} {IMPLS[impl]} done", flush=True)
    med = {
        i: {op: statistics.median(ts) * 1e3 for op, ts in ops.items()} for i, ops in runs.items()
    }
    hop = f"{min(hops):.0f}-{max(hops):.0f} ns" if hops else "not measured (one rank)"
    header = "| op | " + " | ".join(f"{IMPLS[i]} (ms)" for i in IMPLS)
    header += " | spmd / plain | spmd / spmd's malloc | spmd / floor |"
    md = [
        f"# mpi4py plain and with spmd's malloc tuning, and spmd: {args.ranks} ranks, "
        f"{args.mb} MiB float32",
        "",
        "Produced by `python benchmarks/mpi4py_malloc.py`; each implementation in its own job, "
        f"{args.rounds} rounds, {job_cores()} of {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} at the end. The ratios divide spmd's time (inside jit, where "
        "every result is a new array) by each MPI call's, in-place rows included, and by the "
        "floor: the memory work that any out-of-place call leaves to each rank (numpy, no "
        "communication, all ranks at once).",
        "",
        f"Shared-memory hop (the staging probe, before and after each spmd job's calls): {hop}.",
        "",
        header,
        "|---|" + "---:|" * (len(IMPLS) + 3),
    ]
    for op in OPS:
        cells = [med[i].get(op) for i in IMPLS]
        base = op.replace(" in place", "")
        s = med["spmd"].get(base)
        floor = None if op != base else med["floor"].get(base)
        ratio = [f"{s / c:.2f}" if s and c else "" for c in [*cells[:2], floor]]
        md.append(f"| {op} | " + " | ".join(f"{c:.2f}" if c else "" for c in cells)
                  + f" | {' | '.join(ratio)} |")  # fmt: skip
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"mpi4py-malloc-{cores_tag()}-n{args.ranks}"
    record = {"ms": med, "rounds": runs, "shm_hop_ns": hops}
    (out_dir / f"{tag}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[md.index(header) :]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
