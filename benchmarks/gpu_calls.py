"""The per-call time of a small all-reduce inside ``jax.jit`` between processes on one GPU, to show
what the GPU handlers' call comparison costs: each call site's first run is compared across the
ranks on the group's CPU transport (a host barrier), later runs only look the site up, and under
``SPMD_DEBUG=1`` every call is compared.

    spmd-run -n 2 python benchmarks/gpu_calls.py [--calls 2000] [--label default]

Run it once per setting (``SPMD_DEBUG=1``; another build on ``PYTHONPATH``) with
``SPMD_CUSTOM_AR=force SPMD_BIND_DEVICE=0``, the processes sharing the machine's GPU. Prints one
line: the label, the median over ``--rounds`` of the mean time per call of ``--calls`` calls
(4096 float32: the custom one-shot kernel), and the first call's time (compiling included).
Needs a GPU and spmd's GPU module.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="default")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import spmd

    comm = spmd.init()
    x = jnp.ones(4096, jnp.float32)
    f = jax.jit(lambda x: spmd.allreduce(x) * 0.5)
    t0 = time.perf_counter()
    y = jax.block_until_ready(f(x))
    first = time.perf_counter() - t0
    per_call = []
    for _ in range(args.rounds):
        comm.allgather_object(None)  # start together (a GPU barrier needs NCCL)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            y = f(y)
        jax.block_until_ready(y)
        per_call.append((time.perf_counter() - t0) / args.calls)
    everyone = comm.allgather_object(statistics.median(per_call))
    if comm.rank == 0:
        slowest = max(everyone) * 1e6
        rounds = f"{args.rounds} x {args.calls}"
        print(f"{args.label}: {slowest:.1f} us per call (slowest rank's median of {rounds}), "
              f"first call {first * 1e3:.0f} ms", flush=True)  # fmt: skip
    spmd.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
