"""Autodiff and batching of every collective.

Gradient convention: the global objective is the sum of every rank's objective. Each rank
differentiates its own output with its own cotangent w_r (different on every rank); the result
must equal the finite-difference gradient of G(x_0, .., x_{n-1}) = sum_r <w_r, y_r(x)>, computed in
one process from a NumPy emulation of the collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from spmd.testing import multirank

SHAPE = (4, 6)  # divisible by 1..4 ranks along axis 0 when padded below


def _x(rank: int, shape=SHAPE) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(shape)


def _w(rank: int, shape) -> np.ndarray:
    return np.random.default_rng(200 + rank).standard_normal(shape)


def _cases(n: int):
    """(name, spmd function of this rank's x, NumPy emulation: all xs -> all ys, input shape)."""
    rows = 2 * n
    me = spmd.get_communicator().rank
    sizes = [r + 1 for r in range(n)]
    off = np.cumsum([0, *sizes])

    def red(xs, fn):
        return [fn(np.stack(xs), axis=0)] * n

    return [
        ("allreduce sum", lambda x: spmd.allreduce(x), lambda xs: red(xs, np.sum), SHAPE),
        ("allreduce avg", lambda x: spmd.allreduce(x, "avg"), lambda xs: red(xs, np.mean), SHAPE),
        ("allreduce max", lambda x: spmd.allreduce(x, "max"), lambda xs: red(xs, np.max), SHAPE),
        ("allreduce min", lambda x: spmd.allreduce(x, "min"), lambda xs: red(xs, np.min), SHAPE),
        ("allreduce prod", lambda x: spmd.allreduce(x, "prod"), lambda xs: red(xs, np.prod), SHAPE),
        ("allgather axis 1", lambda x: spmd.allgather(x, axis=1),
         lambda xs: [np.concatenate(xs, 1)] * n, SHAPE),
        ("reduce_scatter", lambda x: spmd.reduce_scatter(x),
         lambda xs: [np.sum(xs, 0)[2 * r : 2 * r + 2] for r in range(n)], (rows, 3)),
        ("reduce_scatter max", lambda x: spmd.reduce_scatter(x, "max"),
         lambda xs: [np.max(xs, 0)[2 * r : 2 * r + 2] for r in range(n)], (rows, 3)),
        ("broadcast", lambda x: spmd.broadcast(x, root=n - 1), lambda xs: [xs[-1]] * n, SHAPE),
        ("all_to_all", lambda x: spmd.all_to_all(x, 0, 1),
         lambda xs: [np.concatenate([x[2 * r : 2 * r + 2] for x in xs], 1) for r in range(n)],
         (rows, 3)),
        ("reduce_scatterv", lambda x: spmd.reduce_scatterv(x, sizes),
         lambda xs: [np.sum(xs, 0)[off[r] : off[r + 1]] for r in range(n)], (sum(sizes), 3)),
        ("sendrecv ring", lambda x: spmd.sendrecv(x, src=(me - 1) % n, dst=(me + 1) % n),
         lambda xs: [xs[(r - 1) % n] for r in range(n)], SHAPE),
    ]  # fmt: skip


def _fd_gradient(emulate, xs, ws, eps=1e-4):
    def G(xs):
        return sum(float(np.sum(w * y)) for w, y in zip(ws, emulate(xs), strict=True))

    grads = []
    for r in range(len(xs)):
        g = np.zeros_like(xs[r])
        for i in np.ndindex(xs[r].shape):
            plus = [x.copy() for x in xs]
            minus = [x.copy() for x in xs]
            plus[r][i] += eps
            minus[r][i] -= eps
            g[i] = (G(plus) - G(minus)) / (2 * eps)
        grads.append(g)
    return grads


@multirank(nprocs=(1, 2, 3, 4))
def test_vjp_matches_finite_differences_of_the_global_objective(comm):
    n, r = comm.size, comm.rank
    for name, fn, emulate, shape in _cases(n):
        xs = [_x(k, shape) for k in range(n)]
        ys = emulate(xs)
        ws = [_w(k, y.shape) for k, y in enumerate(ys)]
        x = jnp.asarray(xs[r], jnp.float32)
        y, vjp = jax.vjp(fn, x)
        np.testing.assert_allclose(y, ys[r], rtol=1e-5, atol=1e-5, err_msg=name)
        (g,) = vjp(jnp.asarray(ws[r], jnp.float32))
        expected = _fd_gradient(emulate, xs, ws)[r]
        np.testing.assert_allclose(g, expected, rtol=1e-3, atol=1e-3, err_msg=name)
        # The same through jax.grad of a scalar objective, inside jit.
        w = jnp.asarray(ws[r], jnp.float32)
        g2 = jax.jit(jax.grad(lambda x, w=w, fn=fn: jnp.sum(w * fn(x))))(x)
        np.testing.assert_allclose(g2, expected, rtol=1e-3, atol=1e-3, err_msg=name)


@multirank(nprocs=(2, 3))
def test_jvp_matches_finite_differences(comm):
    n, r = comm.size, comm.rank
    for name, fn, emulate, shape in _cases(n):
        xs = [_x(k, shape) for k in range(n)]
        ts = [_w(10 + k, shape) for k in range(n)]
        eps = 1e-4
        plus = emulate([x + eps * t for x, t in zip(xs, ts, strict=True)])
        minus = emulate([x - eps * t for x, t in zip(xs, ts, strict=True)])
        expected = (plus[r] - minus[r]) / (2 * eps)
        _, t_out = jax.jvp(
            fn, (jnp.asarray(xs[r], jnp.float32),), (jnp.asarray(ts[r], jnp.float32),)
        )
        np.testing.assert_allclose(t_out, expected, rtol=1e-3, atol=1e-3, err_msg=name)


@multirank(nprocs=(2, 3))
def test_linear_transpose_equals_vjp(comm):
    n = comm.size
    linear = {"allreduce sum", "allgather axis 1", "reduce_scatter", "broadcast", "all_to_all",
              "reduce_scatterv", "sendrecv ring"}  # fmt: skip
    for name, fn, _emulate, shape in _cases(n):
        if name not in linear:
            continue
        x = jnp.asarray(_x(comm.rank, shape), jnp.float32)
        y, vjp = jax.vjp(fn, x)
        w = jnp.asarray(_w(comm.rank, y.shape), jnp.float32)
        (expected,) = vjp(w)
        (got,) = jax.linear_transpose(fn, x)(w)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=name)


@multirank(nprocs=(2, 4))
def test_vmap_equals_a_loop(comm):
    n = comm.size
    for name, fn, _, shape in _cases(n):
        batch = jnp.asarray(
            np.stack([_x(comm.rank + 10 * b, shape) for b in range(3)]), jnp.float32
        )
        for axis in (0, 1):
            moved = jnp.moveaxis(batch, 0, axis)
            got = jax.vmap(fn, in_axes=axis)(moved)
            expected = jnp.stack([fn(batch[b]) for b in range(3)])
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{name} axis {axis}")


@multirank(nprocs=(2,))
def test_pytree_gradients_and_grouped_allreduce(comm):
    r = comm.rank
    params = {"w": jnp.full((2, 2), r + 1.0), "b": jnp.array([r + 1.0])}

    def loss(p):
        s = spmd.allreduce(p, rank_list=[[0, 1]])
        return (r + 1.0) * (jnp.sum(s["w"] ** 2) + jnp.sum(s["b"]))

    g = jax.grad(loss)(params)
    # G = sum_k (k+1) * (sum (w0+w1)^2 + sum(b0+b1)) -> dG/dw_r = sum_k (k+1) * 2 (w0+w1) = 3*2*3
    np.testing.assert_allclose(g["w"], np.full((2, 2), 18.0))
    np.testing.assert_allclose(g["b"], [3.0])


@multirank(nprocs=(2,))
def test_checkpointed_collectives_run_once(comm):
    """jax.checkpoint recomputed every collective in the backward pass: a send went twice (the
    peer's next recv got stale data), and a rank that checkpoints while its peer does not (a
    local memory choice) made a call the peer never matched."""
    r = comm.rank

    def sends(x):
        spmd.send(x, dst=1)
        return jnp.sum(x**2)

    if r == 0:
        np.testing.assert_array_equal(jax.grad(jax.checkpoint(sends))(jnp.arange(3.0)), [0, 2, 4])
        spmd.send(jnp.full(3, 7.0), dst=1)
    else:
        np.testing.assert_array_equal(spmd.recv(jnp.zeros(3), src=0), [0, 1, 2])
        np.testing.assert_array_equal(spmd.recv(jnp.zeros(3), src=0), [7, 7, 7])

    def ring(x):  # the shifted value is not needed by the backward pass
        y = spmd.sendrecv(x, src=1 - r, dst=1 - r)
        return jnp.sum(x * (r + 1.0)) + 0.0 * jnp.sum(y)

    f = jax.checkpoint(ring) if r == 0 else ring
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(jnp.ones(3)), np.full(3, r + 1.0))
    # the collective of the primal runs once; its result is saved, not recomputed
    jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(lambda x: spmd.allreduce(x).sum() ** 2)))
    text = str(jaxpr(jnp.ones(3)))
    assert text.count("spmd_allreduce") == 2, text  # forward, and the transpose of its JVP


@multirank(nprocs=(2,))
def test_the_jvp_of_a_product_reduce_scatter_sends_no_allgather(comm):
    """Only max/min need the gathered result; the product's JVP gathered it anyway (a
    collective never removed, so traffic for nothing)."""
    x = jnp.arange(1.0, 5.0) + comm.rank
    jaxpr = str(jax.make_jaxpr(lambda v, t: jax.jvp(
        lambda u: spmd.reduce_scatter(u, op="prod"), (v,), (t,)))(x, jnp.ones(4)))  # fmt: skip
    assert "spmd_allgather" not in jaxpr and jaxpr.count("spmd_reduce_scatter") == 2, jaxpr
    y, t = jax.jvp(lambda u: spmd.reduce_scatter(u, op="prod"), (x,), (jnp.ones(4),))
    a, b = np.arange(1.0, 5.0), np.arange(2.0, 6.0)
    block = slice(2 * comm.rank, 2 * comm.rank + 2)
    np.testing.assert_allclose(y, (a * b)[block])
    np.testing.assert_allclose(t, (a + b)[block])  # d(ab) = b da + a db with da = db = 1


@multirank(nprocs=(2,))
def test_checkpoint_and_custom_derivatives_keep_program_order(comm):
    """A checkpointed (or custom-derivative) helper holding a send was lowered as a function of
    its own, so XLA ran the caller's later allreduce first: rank 1, waiting in recv, timed out.
    A while_loop holding a collective inside jax.checkpoint under grad failed to trace."""
    r = comm.rank

    def region(x):
        m = x.reshape(64, 64)
        for _ in range(4):
            m = jnp.tanh(m @ m)  # work before the send
        spmd.send(m, dst=1)
        return x * 2

    @jax.custom_jvp
    def sends(x):
        spmd.send(x, dst=1)
        return x

    sends.defjvp(lambda p, t: (sends(p[0]), t[0]))

    def first(x, g):
        return jax.checkpoint(region)(x), sends(x[:4]), spmd.allreduce(g)

    def second(x, g):
        return spmd.recv(x.reshape(64, 64), src=0), spmd.recv(x[:4], src=0), spmd.allreduce(g)

    x, g = jnp.ones(64 * 64) * 0.01, jnp.full(4, r + 1.0)
    out = jax.jit(first if r == 0 else second)(x, g)
    np.testing.assert_array_equal(out[2], np.full(4, 3.0))
    if r == 1:
        np.testing.assert_array_equal(out[1], np.full(4, 0.01, np.float32))

    def loop(v, y):
        body = lambda c: (c[0] + 1, spmd.allreduce(c[1]) * 0.5)  # noqa: E731
        _, s = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, y))
        return jnp.sum(jnp.sin(v) * s)

    want = jax.grad(loop)(jnp.ones(3), jnp.ones(3))
    np.testing.assert_allclose(jax.grad(jax.checkpoint(loop))(jnp.ones(3), jnp.ones(3)), want)


@multirank(nprocs=(2,))
def test_forward_and_reverse_mode_through_transfers_answer_different_questions(comm):
    """docs/collectives.md, "Forward mode": through sendrecv and broadcast, jax.grad of rank r's
    scalar gives d(sum_s L_s)/dx_r, the global objective's gradient for rank r's input, while
    jax.jacfwd moves a tangent on every rank at once and gives dL_r/dt, the derivative of rank
    r's own output along a direction every rank's input takes."""
    r, other = comm.rank, 1 - comm.rank
    c = jnp.float32(r + 2)  # rank 0's objective weighs by 2, rank 1's by 3
    x = jnp.float32(1.0)

    def shifted(v):
        return c * spmd.sendrecv(v, src=other, dst=other)

    def broadcast(v):
        return c * spmd.broadcast(v, root=0)

    # Reverse: rank r's input reaches the other rank's objective (sendrecv), or every rank's
    # objective from the root (broadcast).
    assert float(jax.grad(shifted)(x)) == [3.0, 2.0][r]
    assert float(jax.grad(broadcast)(x)) == [5.0, 0.0][r]
    # Forward: the tangent that arrives is the other rank's (the root's), 1 on every rank.
    assert float(jax.jacfwd(shifted)(x)) == [2.0, 3.0][r]
    assert float(jax.jacfwd(broadcast)(x)) == [2.0, 3.0][r]
