"""Compile time of a JAX program without collectives: JAX alone, with spmd imported, and after
spmd installed its ordering rules (which it does at the first collective of a process).

    python benchmarks/compile_time.py [--rounds 7] [--layers 24] [--json out.json]

The program is a stack of ``--layers`` calls to one jitted layer function, a ``lax.scan`` over
layers and a ``lax.cond``: what a transformer's step holds, and what JAX's per-module lowering
cache serves (a nested jit lowered once and called again). Each measurement runs in a fresh
process (jit's caches are per process): ``import jax`` (and spmd), build the function, then time
``lower`` and ``compile`` of its first ``jax.jit``. Rounds alternate the three setups, so each
sees the same machine. Prints the median per setup and its ratio to JAX alone (above 1: slower).

- ``jax``: JAX alone;
- ``import spmd``: ``import spmd, spmd.ops`` first (what every spmd program does);
- ``rules installed``: also ``spmd.ops._ordering.install()``, the state of a process after its
  first collective (spmd's rules for calls, loops and branches hand the program to JAX's own, but
  JAX's lowering cache is off for those primitives).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

SETUPS = {
    "jax": "",
    "import spmd": "import spmd, spmd.ops",
    "rules installed": "import spmd, spmd.ops; from spmd.ops import _ordering; _ordering.install()",
}

_CHILD = """
import time
{setup}
import jax, jax.numpy as jnp
from jax import lax

LAYERS = {layers}

@jax.jit
def layer(w, x):
    return jnp.tanh(x @ w) + x

def program(ws, x):
    for i in range(LAYERS):
        x = layer(ws[i], x)
    x, _ = lax.scan(lambda c, w: (layer(w, c), None), x, ws)
    return lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, x)

ws = jnp.ones((LAYERS, 64, 64)) * 0.01
x = jnp.ones((8, 64))
f = jax.jit(program)
t0 = time.perf_counter()
lowered = f.lower(ws, x)
t1 = time.perf_counter()
lowered.compile()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def measure(setup: str, layers: int) -> tuple[float, float]:
    code = _CHILD.format(setup=setup, layers=layers)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    lower, compile_ = out.stdout.split()
    return float(lower), float(compile_)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json", help="write the medians and every measurement here")
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in SETUPS}
    for _ in range(args.rounds):
        for name, setup in SETUPS.items():
            times[name].append(measure(setup, args.layers))
    base_lower = statistics.median(t[0] for t in times["jax"])
    base_compile = statistics.median(t[1] for t in times["jax"])
    print(f"{args.layers} nested jit calls + scan + cond; medians of {args.rounds} fresh processes")
    print(f"{'setup':<17} {'lower ms':>9} {'ratio':>6} {'compile ms':>11} {'ratio':>6}")
    report = {"layers": args.layers, "rounds": args.rounds, "setups": {}}
    for name, ts in times.items():
        lower = statistics.median(t[0] for t in ts)
        comp = statistics.median(t[1] for t in ts)
        print(
            f"{name:<17} {lower * 1e3:9.1f} {lower / base_lower:6.2f} {comp * 1e3:11.1f} "
            f"{comp / base_compile:6.2f}"
        )
        report["setups"][name] = {"lower_s": lower, "compile_s": comp, "runs": ts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
