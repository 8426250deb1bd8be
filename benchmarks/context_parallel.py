"""Memory of ring attention per rank against the sequence split: XLA's own accounting of the
compiled forward-and-backward program (``memory_analysis()``), and the step's time.

    spmd-run -n 1 python benchmarks/context_parallel.py [--seq 4096] [--json out.json]
    spmd-run -n 2 python benchmarks/context_parallel.py ...
    spmd-run -n 4 python benchmarks/context_parallel.py ...

The program is the gradient of ``sum(attention(q, k, v) * c)`` with respect to q, k and v for
one example of ``--seq`` tokens, 4 heads of 64, causal, the sequence split over the world as a
``cp`` axis (``split_sequence(causal=True)``). Rank 0 prints, for the compiled program: its
arguments (this rank's q, k, v, c), its temporaries (what XLA allocates while it runs: score
blocks, the ring's buffers, gradients) and the median time of ``--rounds`` calls. With a world
of one, the dense attention of the same sequence in plain JAX is measured beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import spmd

HEADS, DIM = 4, 64


def _dense(q, k, v):  # type: ignore[no-untyped-def]
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)


def _measure(fn, args, rounds: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return {
        "argument_mib": mem.argument_size_in_bytes / 2**20,
        "temp_mib": mem.temp_size_in_bytes / 2**20,
        "ms": statistics.median(times) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    comm = spmd.init()
    rng = np.random.default_rng(0)
    whole = [jnp.asarray(rng.standard_normal((1, args.seq, HEADS, DIM)), jnp.float32)
             for _ in range(4)]  # fmt: skip
    rows = {}
    with spmd.Mesh(cp=-1):
        q, k, v, c = spmd.context_parallel.split_sequence(tuple(whole), causal=True)

        def ring(q, k, v, c):  # type: ignore[no-untyped-def]
            def objective(q, k, v):  # type: ignore[no-untyped-def]
                return jnp.sum(spmd.context_parallel.attention(q, k, v, causal=True) * c)

            return jax.grad(objective, argnums=(0, 1, 2))(q, k, v)

        rows[f"ring attention, cp={comm.size}"] = _measure(ring, (q, k, v, c), args.rounds)
    if comm.size == 1:

        def dense(q, k, v, c):  # type: ignore[no-untyped-def]
            return jax.grad(lambda q, k, v: jnp.sum(_dense(q, k, v) * c), argnums=(0, 1, 2))(
                q, k, v
            )

        rows["dense attention, plain JAX"] = _measure(dense, tuple(whole), args.rounds)
    if comm.rank == 0:
        print(f"# Causal attention's gradient, sequence {args.seq}, {HEADS} heads of {DIM}: "
              f"memory per rank (XLA's memory_analysis) and time\n")  # fmt: skip
        print("| program | arguments, MiB | temporaries, MiB | ms (median) |")
        print("|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['argument_mib']:.1f} | {r['temp_mib']:.1f} | {r['ms']:.1f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
