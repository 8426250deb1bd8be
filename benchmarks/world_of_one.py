"""A training step in a world of one: ``@spmd.data_parallel`` against plain ``jax.jit`` of the
same function, side by side in one process.

    python benchmarks/world_of_one.py [--rounds 7] [--steps 200] [--json out.json]

The step is an MLP's Adam update (two dense layers, ReLU, softmax cross-entropy on a batch of
128) at three widths: 64 (a step of about 0.1 ms, where a call's fixed cost shows), 512 and
1024. Each round times ``--steps`` calls of each variant in turn (after a warm-up call that
compiles it), so both see the same machine; the table gives the median time per step over the
rounds, its range, and the ratio spmd / plain (above 1: slower). spmd's share is what its
step's call does in Python around the compiled program: flattening the arguments, the
signature's lookup, the results' tree; in a world of one it inserts no collective.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import spmd

WIDTHS = (64, 512, 1024)
BATCH, CLASSES = 128, 10


def _setup(d: int) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (d, d)) * 0.05,
        "w2": jax.random.normal(k[1], (d, CLASSES)) * 0.05,
    }
    x = jax.random.normal(k[2], (BATCH, d))
    return params, x, jnp.zeros((BATCH,), jnp.int32)


def _loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _steps(tx: optax.GradientTransformation) -> dict[str, object]:
    def update(p, s, x, y, value_and_grad):  # type: ignore[no-untyped-def]
        loss, g = value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return {
        "plain jax.jit": jax.jit(lambda p, s, x, y: update(p, s, x, y, jax.value_and_grad)),
        "spmd.data_parallel": spmd.data_parallel(
            lambda p, s, x, y: update(p, s, x, y, spmd.value_and_grad)
        ),
    }


def _time(step, params, state, x, y, steps: int) -> float:  # type: ignore[no-untyped-def]
    params, state, loss = step(params, state, x, y)
    jax.block_until_ready(loss)
    t = time.perf_counter()
    for _ in range(steps):
        params, state, loss = step(params, state, x, y)
    jax.block_until_ready(loss)
    return (time.perf_counter() - t) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tx = optax.adam(1e-3)
    rows = []
    for d in WIDTHS:
        params, x, y = _setup(d)
        steps = _steps(tx)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                times[name].append(_time(step, params, tx.init(params), x, y, args.steps))
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"width": d, "us": times, "median_us": med,
                     "ratio": med["spmd.data_parallel"] / med["plain jax.jit"]})  # fmt: skip
    print(f"# A step in a world of one ({args.rounds} rounds of {args.steps} steps, jax "
          f"{jax.__version__}, {jax.devices()[0].platform})\n")  # fmt: skip
    print("| width | plain jax.jit, us (range) | spmd.data_parallel, us (range) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [f"{r['median_us'][n]:.0f} ({min(r['us'][n]):.0f}-{max(r['us'][n]):.0f})"
                 for n in ("plain jax.jit", "spmd.data_parallel")]  # fmt: skip
        print(f"| {r['width']} | {cells[0]} | {cells[1]} | {r['ratio']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
