"""The native MoE exchange (spmd.ops.moe_dispatch / moe_combine): every layout row by row
against a NumPy model built from every rank's ids, on shared memory and MPI; the weighted and
summed combine in four float dtypes; rows too large for a pipeline piece; gradients against
finite differences of the global objective (the weights' too); vmap; a bad id as the same error
on every rank.

Every rank's ids and rows are functions of its rank, so each rank computes every rank's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.ops import moe_combine, moe_dispatch
from spmd.testing import multirank

from ._cases import x64
from .test_all_to_allv import _raises, _transport, _transports
from .test_autodiff import _fd_gradient

E, K = 6, 2


def _ids(r: int, t: int, drop: bool = False) -> np.ndarray:
    """Rank r's T * K expert ids, token-major: K distinct experts per token; with ``drop``,
    every fifth assignment dropped (id E)."""
    rng = np.random.default_rng(10 + r)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).reshape(-1)
    if drop:
        ids[::5] = E
    return ids.astype(np.int32)


def _x(r: int, t: int, d: int, dtype: str = "float32") -> np.ndarray:
    return ((np.arange(t * d).reshape(t, d) * 3 + 100 * r) % 97 - 40).astype(dtype)


def _weights(r: int, t: int, dtype: str = "float32") -> np.ndarray:
    return (0.25 + (np.arange(t * K) + r) % 4 / 8).astype(dtype)


def _order(ids: np.ndarray, e: int, choice_major: bool) -> list[int]:
    """The assignments of one rank that chose expert e, in the order they travel."""
    a = [i for i in range(ids.size) if ids[i] == e]
    return sorted(a, key=lambda i: (i % K, i // K)) if choice_major else a


def _layout(n, me, idss, rows_of, slots, cap, out_rows, d, dtype):
    """NumPy dispatch for rank ``me``: (rows, sizes, where each (source, assignment) landed).
    rows_of(s, a) is the row rank s sends for assignment a."""
    per = E // n
    out = np.zeros((out_rows, d), dtype)
    where, sizes, at = {}, [], 0
    for j in range(per):
        e = me * per + j
        base = j * slots if slots else at
        pos = base
        for s in range(n):
            if cap:
                pos = base + s * cap
            for a in _order(idss[s], e, cap > 0):
                out[pos] = rows_of(s, a)
                where[(s, a)] = pos
                pos += 1
        sizes.append(sum(int((idss[s] == e).sum()) for s in range(n)))
        at = pos
    return out, np.array(sizes, np.int32), where


def _check_layouts(comm) -> None:
    n, me = comm.size, comm.rank
    t, d = 7, 3
    per = E // n
    for drop in (False, True):
        idss = [_ids(r, t, drop) for r in range(n)]
        xs = [_x(r, t, d) for r in range(n)]
        ws = [_weights(r, t) for r in range(n)]
        cap = max(int((idss[s] == e).sum()) for s in range(n) for e in range(E))
        layouts = {"grouped": (0, 0, n * t * min(K, per)), "padded": (n * t, 0, per * n * t),
                   "capacity": (n * cap, cap, per * n * cap)}  # fmt: skip
        for name, (slots, c, out_rows) in layouts.items():
            what = f"{name}, drop={drop}"
            # Leave garbage in the allocator first: the zeros must be written, not found.
            jax.block_until_ready(jnp.full((out_rows, d), 7.0) * 2)
            f = jax.jit(lambda x, ids, w=None, slots=slots, c=c, out_rows=out_rows: moe_dispatch(
                x, ids, w, k=K, experts=E, group=comm, out_rows=out_rows, slots=slots,
                capacity=c))  # fmt: skip
            rows, sizes = f(xs[me], idss[me])
            want, want_sizes, where = _layout(
                n, me, idss, lambda s, a, xs=xs: xs[s][a // K], slots, c, out_rows, d, np.float32
            )
            np.testing.assert_array_equal(rows, want, err_msg=what)
            np.testing.assert_array_equal(sizes, want_sizes, err_msg=what)
            rows_w, _ = f(xs[me], idss[me], ws[me])

            def weighted_row(s, a, xs=xs, ws=ws):
                return xs[s][a // K] * ws[s][a]

            want_w, _, _ = _layout(n, me, idss, weighted_row, slots, c, out_rows, d, np.float32)
            np.testing.assert_allclose(rows_w, want_w, rtol=1e-6, err_msg=what + " weighted")

            # Combine: y = 2 * rows + (rank + 1) in the rows that were filled, NaN elsewhere
            # (never read): each assignment's row comes back from the rank holding its expert.
            filled = np.zeros(out_rows, bool)
            filled[list(where.values())] = True
            y = np.where(filled[:, None], 2 * want + me + 1, np.nan).astype(np.float32)
            back = np.zeros((t * K, d), np.float32)
            for a, e in enumerate(idss[me]):
                if e < E:
                    back[a] = 2 * xs[me][a // K] + e // per + 1

            def g(y, ids, w=None, tokens=True, slots=slots, c=c):
                return jax.jit(lambda y, ids, w: moe_combine(
                    y, ids, w, k=K, experts=E, group=comm, tokens=tokens, slots=slots,
                    capacity=c))(y, ids, w)  # fmt: skip

            np.testing.assert_array_equal(g(y, idss[me], tokens=False), back, err_msg=what)
            summed = back.reshape(t, K, d).sum(1)
            np.testing.assert_allclose(g(y, idss[me]), summed, rtol=1e-6, err_msg=what)
            weighted = (back * ws[me][:, None]).reshape(t, K, d).sum(1)
            np.testing.assert_allclose(g(y, idss[me], ws[me]), weighted, rtol=1e-6, err_msg=what)


@multirank(nprocs=(2, 3))
def test_layouts_match_numpy(comm):
    for name in _transports(comm):
        with _transport(name):
            _check_layouts(comm)


@multirank(nprocs=(3,))
def test_dtypes_and_rows_larger_than_a_piece(comm):
    """The weighted, summed combine in every float dtype, and rows of 400 kB: more than a
    pipeline piece at 3 ranks (the output then starts as zeros and every row adds)."""
    n, me = comm.size, comm.rank
    for name in _transports(comm):
        with _transport(name), x64():
            for dtype, d, tol in (("float64", 4, 1e-12), ("float16", 4, 2e-3),
                                  ("bfloat16", 4, 2e-2), ("float32", 100_000, 1e-6)):  # fmt: skip
                t = 3
                idss = [_ids(r, t) for r in range(n)]
                xs = [_x(r, t, d, "float32") for r in range(n)]
                x = jnp.asarray(xs[me], dtype)
                rows, _ = moe_dispatch(x, idss[me], k=K, experts=E, group=comm,
                                       out_rows=n * t * K)  # fmt: skip
                w = jnp.asarray(_weights(me, t), dtype)
                ids = idss[me]
                out = jax.jit(lambda y, w, ids=ids: moe_combine(y, ids, w, k=K, experts=E,
                                                                group=comm))(rows, w)  # fmt: skip
                assert out.dtype == jnp.dtype(dtype)
                # Identity experts: each token's rows come back, weighted.
                wf = np.asarray(w.astype(jnp.float32)).reshape(t, K).sum(1)
                want = np.asarray(x.astype(jnp.float32)) * wf[:, None]
                got = np.asarray(out.astype(jnp.float32))
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 40,
                                           err_msg=f"{name} {dtype} d={d}")  # fmt: skip


@multirank(nprocs=(2, 3))
def test_gradients_match_finite_differences(comm):
    """Dispatch then combine with the same weights, and a rank-dependent cotangent: the vjp in
    x and in the weights against finite differences of the sum of every rank's objective."""
    n, me = comm.size, comm.rank
    t, d = 4, 2
    idss = [_ids(r, t, drop=True) for r in range(n)]
    cts = [np.cos(np.arange(t * d).reshape(t, d) + r).astype(np.float64) for r in range(n)]

    def step(x, w, ids):  # every rank's step: dispatch, a nonlinear expert, weighted combine
        rows, _ = moe_dispatch(x, ids, k=K, experts=E, group=comm, out_rows=n * t * K)
        return moe_combine(jnp.sin(rows), ids, w, k=K, experts=E, group=comm)

    def emulate(inputs):  # NumPy: inputs are every rank's [x, w] flattened
        outs = []
        for r in range(n):
            x, w = inputs[r][: t * d].reshape(t, d), inputs[r][t * d :]
            out = np.zeros((t, d))
            for a, e in enumerate(idss[r]):
                if e < E:
                    out[a // K] += w[a] * np.sin(x[a // K])
            outs.append(out)
        return outs

    flat = [np.concatenate([_x(r, t, d, "float64").ravel() / 40, _weights(r, t, "float64")])
            for r in range(n)]  # fmt: skip
    want = _fd_gradient(emulate, flat, cts, eps=1e-6)[me]
    with x64():
        x = jnp.asarray(flat[me][: t * d].reshape(t, d), jnp.float64)
        w = jnp.asarray(flat[me][t * d :], jnp.float64)
        gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(step(x, w, idss[me]) * cts[me]),
                                  argnums=(0, 1)))(x, w)  # fmt: skip
        np.testing.assert_allclose(gx.ravel(), want[: t * d], rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(gw, want[t * d :], rtol=1e-6, atol=1e-8)
        # Forward mode agrees with reverse mode.
        v = jnp.ones_like(x)
        _, tangent = jax.jvp(lambda x: step(x, w, idss[me]), (x,), (v,))
        _, vjp = jax.vjp(lambda x: step(x, w, idss[me]), x)
        assert np.isfinite(np.asarray(tangent)).all()
        # <J v, ct> summed over ranks equals <v, J^T ct> summed over ranks.
        lhs = comm.allgather_object(float(jnp.sum(tangent * cts[me])))
        rhs = comm.allgather_object(float(jnp.sum(vjp(jnp.asarray(cts[me]))[0] * v)))
        assert abs(sum(lhs) - sum(rhs)) < 1e-9 * max(1.0, abs(sum(lhs)))
        # The weights of a dispatch (a combine's transpose), differentiated.
        ct_rows = jnp.asarray(np.cos(np.arange(n * t * K * d)).reshape(n * t * K, d))

        def weighted_dispatch(w):
            rows, _ = moe_dispatch(x, idss[me], w, k=K, experts=E, group=comm,
                                   out_rows=n * t * K)  # fmt: skip
            return jnp.sum(rows * ct_rows)

        gwd = jax.grad(weighted_dispatch)(w)
        back = moe_combine(ct_rows, idss[me], k=K, experts=E, group=comm, tokens=False)
        want_w = np.sum(np.asarray(back) * np.repeat(np.asarray(x), K, axis=0), axis=1)
        np.testing.assert_allclose(gwd, want_w, rtol=1e-9, atol=1e-12)


@multirank(nprocs=(2,))
def test_vmap(comm):
    n, me = comm.size, comm.rank
    t, d = 5, 2
    ids = _ids(me, t)
    x = jnp.asarray(_x(me, t, d))
    f = lambda x, ids: moe_dispatch(x, ids, k=K, experts=E, group=comm, out_rows=n * t * K)  # noqa: E731
    rows, sizes = f(x, ids)
    batch = jnp.stack([x, 2 * x, 3 * x], axis=1)
    got, got_sizes = jax.vmap(f, in_axes=(1, None))(batch, ids)
    for b in range(3):
        np.testing.assert_array_equal(got[b], (b + 1) * rows)
        np.testing.assert_array_equal(got_sizes[b], sizes)
    other = _ids(me + 7, t)
    got, _ = jax.vmap(f)(jnp.stack([x, x]), jnp.stack([ids, other]))
    np.testing.assert_array_equal(got[0], rows)
    np.testing.assert_array_equal(got[1], f(x, other)[0])


@multirank(nprocs=(2, 3))
def test_a_bad_id_fails_every_rank(comm):
    n, me = comm.size, comm.rank
    t = 3
    ids = _ids(me, t)
    if me == 1:
        ids[4] = E + 3
    f = jax.jit(lambda x, ids: moe_dispatch(x, ids, k=K, experts=E, group=comm,
                                            out_rows=n * t * K))  # fmt: skip
    x = jnp.ones((t, 2))
    runtime = jax.errors.JaxRuntimeError
    frag = "rank 1 passed expert ids" if me != 1 else f"ids[4] = {E + 3} is out of range"
    _raises(lambda: f(x, ids), f"rank {me}: moe.dispatch: ", frag, exc=runtime)
    # An output too small for what arrives: every rank names the one.
    g = jax.jit(lambda x, ids: moe_dispatch(x, ids, k=K, experts=E, group=comm, out_rows=1))
    too_small = "rows, but its output holds out_rows=1; pass out_rows="
    _raises(lambda: g(x, _ids(me, t)), too_small, exc=runtime)
    # The group still works.
    rows, _ = f(x, _ids(me, t))
    assert sum(comm.allgather_object(float(jnp.sum(rows)))) == pytest.approx(n * t * K * 2)
