"""spmd.ops.allreduce_rmsnorm on CPU (the all-reduce, then the norm): values against NumPy, the
same results eager, under jit and vmap, groups, gradients against finite differences of the global
objective, and bad input. The GPU's fused kernel is checked against the same formula in
tests/gpu/test_device.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

ROWS, HIDDEN, EPS = 3, 8, 1e-5


def _inputs(rank: int, dtype=np.float32):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((ROWS, HIDDEN)).astype(dtype)
    residual = np.random.default_rng(50).standard_normal((ROWS, HIDDEN)).astype(dtype)
    weight = np.random.default_rng(60).uniform(0.5, 1.5, HIDDEN).astype(dtype)
    return x, residual, weight


def _reference(members, dtype=np.float32):
    """The documented formula, in NumPy, for the ranks in ``members``."""
    summed = np.zeros((ROWS, HIDDEN), np.float32)
    for m in members:
        summed = summed + _inputs(m, dtype)[0].astype(np.float32)
    _, residual, weight = _inputs(members[0], dtype)
    out = (summed.astype(dtype).astype(np.float32) + residual.astype(np.float32)).astype(dtype)
    r = out.astype(np.float32)
    inv = 1 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + np.float32(EPS))
    normed = (r * inv * weight.astype(np.float32)).astype(dtype)
    return normed, out


@multirank(nprocs=(1, 2, 3, 4))
def test_values_eager_jit_and_groups(comm):
    members = list(range(comm.size))
    for dtype, tol in ((np.float32, 1e-6), (ml_dtypes.bfloat16, 1e-2)):
        args = [jnp.asarray(a) for a in _inputs(comm.rank, dtype)]
        want = _reference(members, dtype)
        eager = spmd.ops.allreduce_rmsnorm(*args, EPS)
        jitted = jax.jit(lambda x, r, w: spmd.ops.allreduce_rmsnorm(x, r, w, EPS))(*args)
        for got in (eager, jitted):
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_allclose(
                    np.asarray(g, np.float32), w.astype(np.float32), rtol=tol, atol=tol
                )
        # identical on every rank
        seen = comm.allgather_object(np.asarray(jitted[0], np.float32).tobytes())
        assert len(set(seen)) == 1
    if comm.size == 4:  # a rank_list: pairs reduce separately
        pairs = [[0, 1], [2, 3]]
        mine = next(p for p in pairs if comm.rank in p)
        got = spmd.ops.allreduce_rmsnorm(*_inputs(comm.rank), EPS, rank_list=pairs)
        np.testing.assert_allclose(got[0], _reference(mine)[0], rtol=1e-6, atol=1e-6)


@multirank(nprocs=(2,))
def test_vmap_over_a_leading_axis(comm):
    x, r, w = _inputs(comm.rank)
    xs = np.stack([x, 2 * x])
    got = jax.vmap(lambda a: spmd.ops.allreduce_rmsnorm(a, r, w, EPS))(xs)
    for k in range(2):
        one = spmd.ops.allreduce_rmsnorm(xs[k], r, w, EPS)
        np.testing.assert_allclose(got[0][k], one[0], rtol=1e-6)
        np.testing.assert_allclose(got[1][k], one[1], rtol=1e-6)


@multirank(nprocs=(2, 3))
def test_gradient_of_the_global_objective(comm):
    """Each rank weighs its outputs with its own cotangents; dL/dx_r must match finite
    differences of G = sum_r <c_r, normed_r> + <d_r, residual_out_r> computed in one process."""
    n = comm.size
    xs = [np.random.default_rng(10 + r).standard_normal((2, 4)) for r in range(n)]
    res = np.random.default_rng(30).standard_normal((2, 4))
    w = np.random.default_rng(31).uniform(0.5, 1.5, 4)
    cs = [np.random.default_rng(40 + r).standard_normal((2, 4)) for r in range(n)]
    ds = [np.random.default_rng(50 + r).standard_normal((2, 4)) for r in range(n)]

    def mine(x):
        normed, out = spmd.ops.allreduce_rmsnorm(x, res, w, EPS)
        return jnp.sum(normed * cs[comm.rank]) + jnp.sum(out * ds[comm.rank])

    with jax.enable_x64(True):
        got = np.asarray(jax.grad(mine)(jnp.asarray(xs[comm.rank])))

    def global_objective(all_x):
        out = sum(all_x) + res
        inv = 1 / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + EPS)
        normed = out * inv * w
        return sum(np.sum(normed * cs[r]) + np.sum(out * ds[r]) for r in range(n))

    h = 1e-6
    want = np.zeros_like(xs[comm.rank])
    for idx in np.ndindex(want.shape):
        plus = [x.copy() for x in xs]
        minus = [x.copy() for x in xs]
        plus[comm.rank][idx] += h
        minus[comm.rank][idx] -= h
        want[idx] = (global_objective(plus) - global_objective(minus)) / (2 * h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@multirank(nprocs=(2,))
def test_bad_input_names_the_rank(comm):
    x, r, w = _inputs(comm.rank)
    me = f"rank {comm.rank}: allreduce_rmsnorm: "
    with pytest.raises(spmd.SpmdError, match=me + r"residual is float32\[3, 7\], expected"):
        spmd.ops.allreduce_rmsnorm(x, r[:, :7], w)
    with pytest.raises(spmd.SpmdError, match=me + r"weight is float32\[4\], expected float32\[8\]"):
        spmd.ops.allreduce_rmsnorm(x, r, w[:4])
    with pytest.raises(spmd.SpmdError, match=me + "x has dtype int32"):
        spmd.ops.allreduce_rmsnorm(x.astype(np.int32), r, w)


@multirank(nprocs=(2,))
def test_quantize_on_cpu_is_exact(comm):
    """The CPU transports always reduce exactly: quantize= only applies on GPU."""
    x = np.random.default_rng(comm.rank).standard_normal(4096).astype(np.float32)
    exact = spmd.allreduce(x)
    for codec in ("fp8", "int8", "int4"):
        np.testing.assert_array_equal(spmd.allreduce(x, quantize=codec), exact)
