"""spmd.moe: the expert-parallel layer at ep = 2 and 4 equals a one-process dense reference that
runs every token through its top-k experts with the same gates (outputs, aux loss, gradients),
dropless and with a capacity factor (which drops exactly the assignments the routing says); it
trains inside data_parallel as one process does on the global batch; bad input is a named error
on every rank."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank

T, D, F, E = 6, 4, 8, 4  # tokens per rank, features, expert hidden size, experts


def expert_fn(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


def grouped_fn(p, rows, sizes):
    """expert_fn on the grouped layout: each local expert's rows through its own weights."""
    return jax.lax.ragged_dot(jax.nn.relu(jax.lax.ragged_dot(rows, p["w1"], sizes)), p["w2"], sizes)


def _experts(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (E, D, F)) * 0.5,
        "w2": jax.random.normal(k2, (E, F, D)) * 0.5,
    }


def _router(seed=1):
    return jax.random.normal(jax.random.key(seed), (D, E))


def _tokens(world, seed=2):
    """Every rank's tokens (T, D), different per rank; the same arrays on every process."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((T, D)), jnp.float32) for _ in range(world)]


def dense(experts, router, x, k, capacity_factor=None):
    """One process: every token through its top-k experts, weighted by softmax(top-k logits),
    minus the assignments a capacity drops (first choices first, then by token); and the
    Switch load-balancing loss."""
    logits = x @ router
    top, chosen = jax.lax.top_k(logits, k)
    gates = jax.nn.softmax(top, axis=-1)
    keep = np.ones((x.shape[0], k), bool)
    if capacity_factor is not None:
        cap = max(1, math.ceil(capacity_factor * x.shape[0] * k / E))
        seen = dict.fromkeys(range(E), 0)
        for j in range(k):
            for t in range(x.shape[0]):
                e = int(chosen[t, j])
                keep[t, j] = seen[e] < cap
                seen[e] += 1
    outs = jax.vmap(expert_fn, in_axes=(0, None))(experts, x)  # (E, T, D): every expert
    picked = jnp.take_along_axis(outs.transpose(1, 0, 2), chosen[..., None], axis=1)
    y = jnp.einsum("tk,tkd->td", gates * keep, picked)
    share = jax.nn.one_hot(chosen, E).sum((0, 1)) / (x.shape[0] * k)
    aux = E * jnp.sum(share * jax.nn.softmax(logits, -1).mean(0))
    return y, aux, keep


@multirank(nprocs=(2, 4))
def test_layer_matches_dense_reference(comm):
    _layer_matches_dense_reference(comm)


@multirank(nprocs=(2,), env={"SPMD_MOE_EXCHANGE": "composed"})
def test_composed_exchange_matches_dense_reference(comm):
    """The way a GPU moves the tokens (all_to_allv and XLA gathers), run on CPU."""
    assert not spmd.ops.moe_native(comm)
    _layer_matches_dense_reference(comm)


def _layer_matches_dense_reference(comm):
    n, me = comm.size, comm.rank
    full, router = _experts(), _router()
    xs = _tokens(n)
    cts = _tokens(n, seed=3)  # cotangents that differ between ranks
    with spmd.Mesh(ep=n):
        mine = spmd.moe.shard_experts(full)
        cases = [("padded", k, cf) for k, cf in ((2, None), (1, None), (2, 0.5), (1, 1.0))]
        for layout, k, cf in [*cases, ("grouped", 2, None), ("grouped", 3, None)]:
            what = f"ep={n} k={k} capacity_factor={cf} layout={layout}"
            fn = grouped_fn if layout == "grouped" else expert_fn

            def objective(experts, router, k=k, cf=cf, fn=fn, layout=layout):
                y, aux = spmd.moe.moe(
                    xs[me], router, fn, experts, k=k, capacity_factor=cf, layout=layout
                )
                return jnp.sum(y * cts[me]) + 0.1 * aux, (y, aux)

            (_, (y, aux)), (g_exp, g_router) = jax.jit(
                jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
            )(spmd.tensor_parallel.local(mine), router)

            want_y, want_aux, keep = dense(full, router, xs[me], k, cf)
            np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6, err_msg=what)
            np.testing.assert_allclose(aux, want_aux, rtol=1e-5, err_msg=what)
            routing = spmd.moe.route(xs[me] @ router, k, capacity_factor=cf)
            assert np.array_equal(np.asarray(routing.keep), keep), what
            if cf is not None and k == 2:
                assert not keep.all(), f"{what}: the capacity drops nothing; the test is weak"

            # Experts: the gradient of every rank's objective; the router: this rank's.
            def total(experts, router, k=k, cf=cf):
                return sum(
                    jnp.sum(dense(experts, router, xs[r], k, cf)[0] * cts[r])
                    + 0.1 * dense(experts, router, xs[r], k, cf)[1]
                    for r in range(n)
                )

            want_exp = jax.grad(total)(full, router)
            per = E // n
            for key in full:
                np.testing.assert_allclose(
                    g_exp[key], want_exp[key][me * per : (me + 1) * per], rtol=1e-4, atol=1e-5,
                    err_msg=f"{what} expert grad {key}",
                )  # fmt: skip

            def own(router, k=k, cf=cf):
                y, aux, _ = dense(full, router, xs[me], k, cf)
                return jnp.sum(y * cts[me]) + 0.1 * aux

            np.testing.assert_allclose(
                g_router, jax.grad(own)(router), rtol=1e-4, atol=1e-5, err_msg=what + " router"
            )


@multirank(nprocs=(4,))
def test_trains_with_data_parallel(comm):
    """Mesh(dp=2, ep=2), data parallel (and ZeRO) over both axes (every rank has its own
    tokens), and Mesh(ep=4) over the world: the expert blocks are reduced only where they are
    the same, and ZeRO leaves them whole."""
    batches = [_tokens(4, seed=10 + s) for s in range(3)]
    targets = [_tokens(4, seed=20 + s) for s in range(3)]
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(params, x, t):
        y, aux = spmd.moe.moe(x, params["router"], expert_fn, params["experts"], k=2)
        return jnp.mean((y - t) ** 2) + 0.01 * aux

    def dense_loss(params, xs, ts):
        per_rank = []
        for x, t in zip(xs, ts, strict=True):
            y, aux, _ = dense(params["experts"], params["router"], x, 2)
            per_rank.append(jnp.mean((y - t) ** 2) + 0.01 * aux)
        return sum(per_rank) / len(per_rank)

    params, want = {"router": _router(), "experts": _experts()}, []
    state = tx.init(params)
    for xs, ts in zip(batches, targets, strict=True):
        u, state = tx.update(jax.grad(dense_loss)(params, xs, ts), state, params)
        params = optax.apply_updates(params, u)
        want.append(params)

    def update(params, state, x, t):
        value, g = spmd.value_and_grad(loss)(params, x, t)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, value

    runs = [
        (spmd.Mesh(dp=2, ep=2), lambda: spmd.data_parallel(update, group=("dp", "ep"))),
        (spmd.Mesh(ep=4), lambda: spmd.data_parallel(update)),
        # ZeRO shards the router's state over all four ranks; the expert blocks stay whole.
        (spmd.Mesh(dp=2, ep=2), lambda: spmd.zero_shard(update, stage=2, group=("dp", "ep"))),
        (spmd.Mesh(ep=4), lambda: spmd.zero_shard(update, stage=3)),
    ]
    for mesh, make in runs:
        with mesh:
            step = make()
            params = {"router": _router(), "experts": spmd.moe.shard_experts(_experts())}
            state = tx.init(params)
            if isinstance(step, spmd.transforms.ZeroShard):
                params, state = step.shard(params, state)
            for i, (xs, ts) in enumerate(zip(batches, targets, strict=True)):
                params, state, _ = step(params, state, xs[comm.rank], ts[comm.rank])
                got = spmd.gather(params)
                what = f"{mesh} {step.name} step {i + 1}"
                for key in ("w1", "w2"):
                    np.testing.assert_allclose(
                        got["experts"][key], want[i]["experts"][key], rtol=1e-4, atol=1e-6,
                        err_msg=f"{what} experts {key}",
                    )  # fmt: skip
                np.testing.assert_allclose(
                    got["router"], want[i]["router"], rtol=1e-4, atol=1e-6,
                    err_msg=f"{what} router",
                )  # fmt: skip


@multirank(nprocs=(2,))
def test_grouped_layout_with_out_rows(comm):
    """dispatch(..., layout="grouped", out_rows=R): the same rows and counts in a buffer of R
    rows, zeros past them; combine and the layer (values and gradients) as with the default
    buffer, natively and composed; a routing that brings a rank more rows is a named error on
    every rank, on both paths."""
    me = comm.rank
    x, cts, router = _tokens(2)[me], _tokens(2, seed=3)[me], _router()
    with spmd.Mesh(ep=2):
        experts = spmd.tensor_parallel.local(spmd.moe.shard_experts(_experts()))
        routing = spmd.moe.route(x @ router, 2)
        full, sizes = spmd.moe.dispatch(x, routing, layout="grouped")
        assert full.shape[0] == 2 * T * 2  # ep * T * min(k, E / ep): any routing fits
        got = int(np.sum(sizes))
        most = max(comm.allgather_object(got))
        assert most < full.shape[0], "every row arrives somewhere: the bound saves nothing"

        def layer(experts, router, out_rows):
            y, aux = spmd.moe.moe(x, router, grouped_fn, experts, layout="grouped",
                                  out_rows=out_rows)  # fmt: skip
            return jnp.sum(y * cts) + 0.1 * aux, y

        for path in ("native", "composed"):
            env = {"SPMD_MOE_EXCHANGE": "composed"} if path == "composed" else {}
            with pytest.MonkeyPatch.context() as mp:
                for key, value in env.items():
                    mp.setenv(key, value)
                disp = jax.jit(lambda x, r, n=None: spmd.moe.dispatch(
                    x, r, layout="grouped", out_rows=n), static_argnums=2)  # fmt: skip
                rows, sizes2 = disp(x, routing, np.int64(most))  # any integer
                assert rows.shape == (most, D), path
                np.testing.assert_array_equal(sizes2, sizes, err_msg=path)
                np.testing.assert_array_equal(rows[:got], full[:got], err_msg=path)
                np.testing.assert_array_equal(rows[got:], 0, err_msg=path)
                back = jax.jit(lambda y, r: spmd.moe.combine(y, r, layout="grouped"))
                np.testing.assert_allclose(back(2 * rows, routing), back(2 * full, routing),
                                           rtol=1e-6, err_msg=path)  # fmt: skip
                grad = jax.jit(jax.value_and_grad(layer, argnums=(0, 1), has_aux=True),
                               static_argnums=2)  # fmt: skip
                (want_obj, want_y), want_g = grad(experts, router, None)
                (obj, y), g = grad(experts, router, most)
                # (out_rows changes the buffers' row count, and XLA may sum in another order:
                # a difference of a few float32 ulps was seen, 5e-6 relative)
                np.testing.assert_allclose(y, want_y, rtol=2e-5, atol=1e-7, err_msg=path)
                np.testing.assert_allclose(obj, want_obj, rtol=2e-5, err_msg=path)
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=path)
                with pytest.raises(jax.errors.JaxRuntimeError) as info:  # jit: XLA's error
                    jax.block_until_ready(disp(x, routing, most - 1))
                message = str(info.value)
                assert f"rank {me}: " in message, message
                assert f"holds out_rows={most - 1}; pass out_rows={most} or more" in message, (
                    message
                )
                # A y with fewer rows than go back: an error on every rank too (natively it
                # names the rank; composed, the exchange's index check fails).
                with pytest.raises(jax.errors.JaxRuntimeError) as info:
                    jax.block_until_ready(back(rows[: most - 1], routing))
                message = str(info.value)
                assert f"rank {me}: " in message, message
                if path == "native":
                    assert f"rows, but its y has {most - 1}" in message, message


def _sum_of_squares_grad(w):
    return spmd.grad(lambda w: jnp.sum(w**2))(w)


@multirank(nprocs=(2,))
def test_errors(comm):
    x, router = _tokens(1)[0], _router()
    with spmd.Mesh(ep=2):
        experts = spmd.tensor_parallel.local(spmd.moe.shard_experts(_experts()))
        routing = spmd.moe.route(x @ router, 2)
        cases = [
            (lambda: spmd.moe.route(x @ router, 5), "k=5, but there are 4 experts"),
            (lambda: spmd.moe.moe(x, jnp.ones((D, 3)), expert_fn, experts),
             "3 experts do not split evenly over the 2 ranks"),
            (lambda: spmd.moe.moe(x, router, expert_fn, _experts()),
             "expected E / ep = 4 / 2 = 2 experts"),
            (lambda: spmd.moe.shard_experts({"w": jnp.ones((3, 2))}), "do not split evenly"),
            (lambda: spmd.moe.dispatch(x[:3], routing), "expected (6, features)"),
            (lambda: spmd.moe.combine(jnp.ones((4, 12, D)), routing),
             "expected (2, 12, features)"),
            (lambda: spmd.moe.route(x @ router, 2, capacity_factor=0), "capacity_factor=0"),
            (lambda: spmd.moe.dispatch(x, routing, out_rows=8),
             "out_rows=8 sizes the grouped layout; the padded layout's buffers are"),
            (lambda: spmd.moe.dispatch(x, routing, layout="grouped", out_rows=0),
             "out_rows=0; expected a number of rows, 1 or more (at most 24"),
            (lambda: spmd.moe.moe(x, router, grouped_fn, experts, layout="grouped",
                                  out_rows=2.5), "out_rows=2.5; expected a number of rows"),
            (lambda: spmd.moe.combine(jnp.ones((4, 12, D)), routing, layout="grouped"),
             "expected (rows, features) in the grouped layout"),
        ]  # fmt: skip
        for make, text in cases:
            with pytest.raises(spmd.SpmdError) as info:
                make()
            assert f"rank {comm.rank}: " in str(info.value), str(info.value)
            assert text in str(info.value), str(info.value)
    # zero_shard takes blocks over other mesh axes (experts), but not its own axis split
    # otherwise than along axis 0.
    with spmd.Mesh(dp=2):
        step = spmd.zero_shard(_sum_of_squares_grad, stage=1, group="dp")
        odd = spmd.shard(jnp.ones((2, 4)), spmd.PartitionSpec(None, "dp"))
        with pytest.raises(spmd.SpmdError, match="zero_shard expects its sharded state split"):
            step(odd)
    # A routing record made for one group, used with another: the layout does not fit.
    with spmd.Mesh(ep=1, dp=2), pytest.raises(spmd.SpmdError, match=r"expected \(4, 6, features\)"):
        spmd.moe.combine(jnp.ones((2, 12, D)), routing)
    # In a group of one, all T * k = 12 assignments stay: a grouped buffer must hold them (the
    # exchange of a group of one checks no counts, so this is checked when tracing).
    with spmd.Mesh(ep=1, dp=2):
        one = "but in a group of one all 12 assignments (T * k) stay on this rank"
        with pytest.raises(spmd.SpmdError, match=re.escape("out_rows=11, " + one)):
            spmd.moe.dispatch(x, routing, layout="grouped", out_rows=11)
        with pytest.raises(spmd.SpmdError, match=re.escape("y has 11 rows, " + one)):
            spmd.moe.combine(jnp.ones((11, D)), routing, layout="grouped")
        rows, sizes = spmd.moe.dispatch(x, routing, layout="grouped", out_rows=12)
        assert rows.shape == (12, D) and int(np.sum(sizes)) == 12
