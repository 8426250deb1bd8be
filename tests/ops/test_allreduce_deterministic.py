"""allreduce(deterministic=True): the same bits over shared memory, MPI and the hierarchical
path, equal to NumPy summing the ranks' values in the documented pairwise order; every op;
pytrees and jit; gradients; what it does not combine with.

The values are chosen so that float32 sums depend on their order: a plain allreduce may differ in
the last bits from one transport to another, this one may not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

from .test_all_to_allv import _transport


def _values(r: int) -> np.ndarray:
    """Rank r's float32 values: large and small magnitudes, so that the order of the sum shows."""
    rng = np.random.default_rng(r)
    scale = np.float32(10.0) ** rng.integers(-3, 8, 64)
    return (rng.standard_normal(64) * scale).astype(np.float32)


def _pairwise(parts: list[np.ndarray], combine) -> np.ndarray:
    while len(parts) > 1:
        pairs = [combine(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        parts = pairs + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def _check(comm, transports) -> None:
    n, r = comm.size, comm.rank
    xs = [_values(k) for k in range(n)]
    want = {
        "sum": _pairwise(xs, np.add),
        # The division is XLA's (which may round differently from NumPy's), of the same sum.
        "avg": np.asarray(jnp.asarray(_pairwise(xs, np.add)) / n),
        "prod": _pairwise([x / np.abs(x).max() + 1 for x in xs], np.multiply),
        "max": np.max(xs, axis=0),
        "min": np.min(xs, axis=0),
    }
    flags = [_values(k) > 0 for k in range(n)]
    seen = {}
    for name in transports:
        with _transport(name):
            for op, expected in want.items():
                x = xs[r] / np.abs(xs[r]).max() + 1 if op == "prod" else xs[r]
                got = spmd.allreduce(jnp.asarray(x), op, deterministic=True)
                np.testing.assert_array_equal(got, expected, err_msg=f"{name} {op}")
                seen.setdefault(op, np.asarray(got))
            tree = jax.jit(lambda t: spmd.allreduce(t, "sum", deterministic=True))(
                {"f": jnp.asarray(xs[r]), "b": jnp.asarray(flags[r]), "i": jnp.arange(3) + r}
            )
            np.testing.assert_array_equal(tree["f"], want["sum"], err_msg=f"{name} jit")
            np.testing.assert_array_equal(tree["b"], np.any(flags, axis=0), err_msg=name)
            np.testing.assert_array_equal(tree["i"], n * np.arange(3) + n * (n - 1) // 2)
    # Every rank holds the same bits.
    assert all(np.array_equal(a, seen["sum"]) for a in comm.allgather_object(seen["sum"]))


@multirank(nprocs=(2, 3, 4))
def test_same_bits_on_every_transport(comm):
    _check(comm, ("shm", "mpi"))


@multirank(nprocs=(4,), env={"SPMD_SIMULATE_NODES": "2"})
def test_same_bits_on_the_hierarchical_path(comm):
    assert spmd.ops.get_transport() == "hier"
    _check(comm, (None,))


@multirank(nprocs=(2,))
def test_gradient_and_bad_combinations(comm):
    n, r = comm.size, comm.rank
    x = jnp.arange(3.0) + r
    g = jax.grad(lambda x: jnp.sum(spmd.allreduce(x, "sum", deterministic=True) * (r + 1)))(x)
    # The gradient of the sum of every rank's objective: sum over ranks of (rank + 1).
    np.testing.assert_allclose(g, np.full(3, n * (n + 1) / 2))
    with pytest.raises(spmd.SpmdError, match=f"rank {r}: allreduce: deterministic=True"):
        spmd.allreduce(x, deterministic=True, compression="bf16")
    with pytest.raises(spmd.SpmdTypeError, match="deterministic='yes'"):
        spmd.allreduce(x, deterministic="yes")
