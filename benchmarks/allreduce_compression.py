"""allreduce(compression=...) against float32 and against casting in XLA, call by call.

    spmd-run -n 2 python benchmarks/allreduce_compression.py [--sizes 7454760,64M] [--iters 200]

Three jitted functions of the same float32 array, timed alternately on every rank (so that all
three see the same machine): ``allreduce(x, "avg")`` in float32; the previous data_parallel
compression, ``allreduce((x / n).astype(bfloat16), "sum").astype(float32)`` with the casts in
XLA; and ``allreduce(x, "avg", compression="bf16")`` with the rounding inside the native call
(forced at every size: allreduce takes the casts below 4 MiB, where they measured faster).
Prints per size the median over calls (the slowest rank's) and each one's ratio to float32.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import spmd


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _native_bf16(x: jax.Array) -> Any:
    """``allreduce(x, "avg", compression="bf16")`` compiled with the rounding in the native call
    whatever the size (allreduce is lowered to XLA casts below NATIVE_COMPRESSION_MIN_BYTES,
    read when the call is lowered)."""
    from spmd.ops import _allreduce

    before = _allreduce.NATIVE_COMPRESSION_MIN_BYTES
    _allreduce.NATIVE_COMPRESSION_MIN_BYTES = 0
    try:
        f = jax.jit(lambda v: spmd.allreduce(v, "avg", compression="bf16"))
        return f.lower(x).compile()
    finally:
        _allreduce.NATIVE_COMPRESSION_MIN_BYTES = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="7454760,64M", help="bytes of float32 per call")
    ap.add_argument("--iters", type=int, default=0, help="timed calls (default: by size)")
    args = ap.parse_args()
    comm = spmd.init()
    n = comm.size
    impls = {
        "float32": jax.jit(lambda x: spmd.allreduce(x, "avg")),
        "bf16, casts in XLA": jax.jit(
            lambda x: spmd.allreduce((x / n).astype(jnp.bfloat16), "sum").astype(jnp.float32)
        ),
    }
    if comm.rank == 0:
        print(f"{n} ranks; median per call (slowest rank), ratio = float32 time / this time")
    for nbytes in (_size(s) for s in args.sizes.split(",")):
        x = jnp.ones((nbytes // 4,), jnp.float32) * (comm.rank + 1)
        iters = args.iters or int(np.clip((1 << 30) // nbytes, 20, 300))
        sized = {**impls, "bf16, native": _native_bf16(x)}
        times: dict[str, list[float]] = {k: [] for k in sized}
        for f in sized.values():
            for _ in range(3):
                f(x).block_until_ready()
        comm.barrier()
        for _ in range(iters):
            for k, f in sized.items():
                t = time.perf_counter()
                f(x).block_until_ready()
                times[k].append(time.perf_counter() - t)
        medians = {k: float(np.median(v)) for k, v in times.items()}
        slowest = {k: max(comm.allgather_object(m)) for k, m in medians.items()}
        if comm.rank == 0:
            base = slowest["float32"]
            cells = ", ".join(f"{k} {t * 1e3:.3f} ms ({base / t:.2f}x)" for k, t in slowest.items())
            print(f"{nbytes / 2**20:.1f} MiB, {iters} calls: {cells}")


if __name__ == "__main__":
    main()
