"""Every collective over MPI on two ranks, on inputs whose sizes cross the classic path's split
(run with ``SPMD_MPI_MAX_COUNT=1000``) and on small ones: the bytes of each result, for tests that
compare the MPI paths (large-count and classic, MPICH and Open MPI) bit for bit.

Also a script: ``spmd-run -n 2 python tests/ops/_mpi_results.py DIR`` writes each rank's results
to ``DIR/rank<N>.pkl`` (tests/ops/test_mpi_calls.py runs it under Open MPI's launcher).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import spmd

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
N = 2503  # elements of the large inputs: three pieces of at most 1000


def values(rank: int, dtype: str, n: int, salt: int = 0) -> np.ndarray:
    """Random values that differ by rank (normals x 100: float sums round; ints wrap), made by
    NumPy (whose integer casts wrap, where XLA's of out-of-range floats may differ by version)."""
    x = np.random.default_rng(1000 * salt + rank).standard_normal(n) * 100
    if dtype == "bool":
        return x > 0
    if dtype in ("int8", "uint8", "int32", "int64"):
        return np.round(x).astype(np.int64).astype(dtype)
    return x.astype(jnp.bfloat16 if dtype == "bfloat16" else dtype)


def _input(rank: int, dtype: str, n: int, salt: int = 0) -> Any:
    return jnp.asarray(values(rank, dtype, n, salt))


def results() -> dict[str, Any]:
    """The bytes of every collective's result on this rank (two ranks), and the MPI calls used."""
    comm = spmd.init()
    if comm.size != 2:
        raise ValueError(f"these checks run on 2 ranks; got {comm.size}")
    r = comm.rank
    spmd.ops.set_transport("mpi")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # float64 and int64 stay 64-bit
    try:
        out: dict[str, Any] = {}
        big = {d: _input(r, d, N) for d in DTYPES}
        small = {d: _input(r, d, 10, salt=1) for d in DTYPES}
        for op in ("sum", "max", "min", "prod"):
            out[f"allreduce_{op}"] = spmd.allreduce(big, op=op)
            out[f"allreduce_{op}_small"] = spmd.allreduce(small, op=op)
        floats = {d: big[d] for d in ("float16", "bfloat16", "float32", "float64")}
        out["allreduce_avg"] = spmd.allreduce(floats, op="avg")
        out["allgather"] = spmd.allgather(big)
        out["allgather_small"] = spmd.allgather(small)
        sizes = [1200, 1303]
        out["allgatherv"] = spmd.allgatherv({d: big[d][: sizes[r]] for d in DTYPES}, sizes)
        even = {d: big[d][: 2 * 1251] for d in DTYPES if d != "bool"}
        out["reduce_scatter"] = spmd.reduce_scatter(even)
        out["reduce_scatter_max"] = spmd.reduce_scatter(even, op="max")
        out["reduce_scatter_small"] = spmd.reduce_scatter({d: small[d] for d in even})
        out["reduce_scatterv"] = spmd.reduce_scatterv(even, [1500, 1002])
        out["all_to_all"] = spmd.all_to_all({d: big[d][: 2 * 1251] for d in DTYPES})
        out["all_to_all_small"] = spmd.all_to_all(small)
        counts = [[700, 1803], [2100, 403]][r]
        out["all_to_allv"] = spmd.all_to_allv(big["float32"], counts)
        out["broadcast"] = spmd.broadcast(big, root=1)
        out["sendrecv"] = spmd.sendrecv(big, src=1 - r, dst=1 - r)
        flat = {
            f"{name}/{k}": np.asarray(v).tobytes()
            for name, tree in out.items()
            for k, v in (tree.items() if isinstance(tree, dict) else [("", tree)])
        }
        flat["calls"] = spmd.runtime.mpi_calls()
        return flat
    finally:
        jax.config.update("jax_enable_x64", previous)
        spmd.ops.set_transport("auto")


if __name__ == "__main__":
    got = results()
    rank = spmd.init().rank
    Path(sys.argv[1], f"rank{rank}.pkl").write_bytes(pickle.dumps(got))
