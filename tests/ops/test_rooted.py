"""reduce, gather, scatter and scan (the calls mpi4jax users look for): values against NumPy on
2 and 3 ranks for every root, eagerly and under jit, their gradients (the global objective's:
every rank's loss summed), vmap, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import ops
from spmd.testing import multirank


def _x(rank):
    return jnp.arange(3.0) + 10.0 * (rank + 1)


@multirank(nprocs=(2, 3))
def test_values_for_every_root(comm):
    r, n = comm.rank, comm.size
    every = np.stack([np.asarray(_x(k)) for k in range(n)])
    x = _x(r)
    for root in range(n):
        for run in (lambda f: f, jax.jit):
            got = run(lambda x, root=root: ops.reduce(x, "max", root=root))(x)
            np.testing.assert_array_equal(got, every.max(0) if r == root else x)
            got = run(lambda x, root=root: ops.gather(x, root=root))(x)
            np.testing.assert_array_equal(got, every if r == root else x)
            blocks = jnp.asarray(every * (r + 1))  # only the root's values count
            got = run(lambda b, root=root: ops.scatter(b, root=root))(blocks)
            np.testing.assert_array_equal(got, every[r] * (root + 1))
    np.testing.assert_array_equal(ops.scan(x, "sum"), every[: r + 1].sum(0))
    np.testing.assert_array_equal(ops.scan(x, "min"), every[: r + 1].min(0))
    # pytrees: one call per tree for reduce, each leaf for the others
    tree = {"a": x, "b": jnp.ones((2, 2), jnp.int32) * (r + 1)}
    out = ops.reduce(tree, "sum", root=0)
    if r == 0:
        assert int(out["b"][0, 0]) == n * (n + 1) // 2
    np.testing.assert_array_equal(ops.scan(tree, "prod")["b"], np.full((2, 2), np.prod(
        np.arange(1, r + 2))))  # fmt: skip


@multirank(nprocs=(2, 3))
def test_gradients_are_the_global_objectives(comm):
    """Every rank differentiates its own loss; the gradient each rank gets is that of the sum
    of all ranks' losses with respect to its input (spmd's convention)."""
    r, n = comm.rank, comm.size
    x = _x(r)
    w = float(r + 1)  # each rank weighs its own output
    # reduce to root 0: F = w0 * sum(total) + sum_{r>0} w_r * sum(x_r) -> dF/dx_r = w0 + w_r [r>0]
    g = jax.grad(lambda x: jnp.sum(ops.reduce(x, "sum", root=0)) * w)(x)
    np.testing.assert_allclose(g, np.full(3, 1.0 + (w if r else 0.0)))
    # gather to root 0: the same derivative (the root sees every x once)
    g = jax.grad(lambda x: jnp.sum(ops.gather(x, root=0)) * w)(x)
    np.testing.assert_allclose(g, np.full(3, 1.0 + (w if r else 0.0)))
    # scatter from root 0: F = sum_j w_j * sum(b0[j]^2) -> the root's gradient 2 w_j b0[j]
    b = jnp.stack([_x(k) for k in range(n)])
    g = jax.grad(lambda b: jnp.sum(ops.scatter(b, root=0) ** 2) * w)(b)
    want = 2 * np.arange(1, n + 1)[:, None] * np.asarray(b) if r == 0 else np.zeros_like(b)
    np.testing.assert_allclose(g, want)
    # scan (sum): F = sum_k w_k * sum(prefix_k) -> dF/dx_r = sum_{k >= r} w_k
    g = jax.grad(lambda x: jnp.sum(ops.scan(x, "sum")) * w)(x)
    np.testing.assert_allclose(g, np.full(3, sum(k + 1.0 for k in range(r, n))))


@multirank(nprocs=(2,))
def test_vmap_and_errors(comm):
    r = comm.rank
    xs = jnp.stack([_x(r), 2 * _x(r)])
    got = jax.vmap(lambda x: ops.scan(x, "sum"))(xs)
    want = sum(np.stack([_x(k), 2 * _x(k)]) for k in range(r + 1))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(spmd.SpmdError, match=r"rank \d: scatter: x has shape \(3,\); scatter "
                       r"expects axis 0 of length 2"):  # fmt: skip
        ops.scatter(_x(r))
    with pytest.raises(spmd.SpmdError, match=r"root=5"):
        ops.reduce(_x(r), root=5)
    with pytest.raises(spmd.SpmdError, match=r"op='avg'; expected one of"):
        ops.scan(_x(r), "avg")
