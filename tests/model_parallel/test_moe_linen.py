"""spmd.moe.linen.MoE: a Flax model whose experts are a linen module, on Mesh(ep=2), starts as
the dense model one process builds with the same key (every expert on one rank, ep = 1) and
follows it over 3 steps of data parallel and of ZeRO-3 over the two ranks, whose tokens differ:
the reference is flax alone (each rank's tokens through their top-2 experts, written out), on
the mean of the two ranks' losses. Without the boxes' axis, data parallel would average the two
ranks' different experts (and the replica check would refuse them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

T, D, F, E, K = 6, 4, 8, 4, 2  # tokens per rank, features, expert hidden size, experts, top-k


class Expert(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(jax.nn.relu(nn.Dense(F)(x)))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return spmd.moe.linen.MoE(Expert(), num_experts=E, k=K)(nn.Dense(D)(x))


def dense(p, x):
    """Flax alone, one process: every token through its top-k experts (softmax of their
    logits as gates) and the Switch load-balancing loss."""
    h = nn.Dense(D).apply({"params": p["Dense_0"]}, x)
    logits = h @ p["MoE_0"]["router"]
    top, chosen = jax.lax.top_k(logits, K)
    outs = jax.vmap(lambda e: Expert().apply({"params": e}, h))(p["MoE_0"]["experts"])
    picked = jnp.take_along_axis(outs.transpose(1, 0, 2), chosen[..., None], axis=1)
    y = jnp.einsum("tk,tkd->td", jax.nn.softmax(top, -1), picked)
    share = jax.nn.one_hot(chosen, E).sum((0, 1)) / (x.shape[0] * K)
    return y, E * jnp.sum(share * jax.nn.softmax(logits, -1).mean(0))


def _loss(y, aux, t):
    return jnp.mean((y - t) ** 2) + 0.01 * aux


@multirank(nprocs=(2,))
def test_linen_moe_starts_and_trains_as_one_process(comm):
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((3, 2, T, D)), jnp.float32)  # step, rank, tokens
    ts = jnp.asarray(rng.standard_normal((3, 2, T, D)), jnp.float32)
    model, tx = Model(), optax.sgd(0.1, momentum=0.9)
    with spmd.Mesh(dp=2, ep=1):  # every rank holds every expert: the dense model
        want = nn.meta.unbox(model.init(jax.random.key(0), xs[0, 0])["params"])
    assert want["MoE_0"]["experts"]["Dense_0"]["kernel"].shape == (E, F, D)

    def dense_loss(p, x, t):
        return sum(_loss(*dense(p, x[r]), t[r]) for r in range(2)) / 2

    trajectory, p, s = [], want, tx.init(want)
    for i in range(3):
        u, s = tx.update(jax.grad(dense_loss)(p, xs[i], ts[i]), s, p)
        p = optax.apply_updates(p, u)
        trajectory.append(p)

    def update(params, state, x, t):
        value, g = spmd.value_and_grad(lambda q: _loss(*model.apply({"params": q}, x), t))(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, value

    with spmd.Mesh(ep=2):
        for make in (spmd.data_parallel, lambda f: spmd.zero_shard(f, stage=3)):
            params = model.init(jax.random.key(0), xs[0, 0])["params"]
            mine = params["MoE_0"]["experts"]["Dense_0"]["kernel"]
            assert mine.value.shape == (E // 2, F, D) and mine.names == ("ep", None, None)
            full = spmd.gather(spmd.tensor_parallel.sharded(params))
            jax.tree_util.tree_map(np.testing.assert_array_equal, full, want)
            step, state = make(update), tx.init(params)
            if isinstance(step, spmd.transforms.ZeroShard):
                params, state = step.shard(params, state)
            for i in range(3):
                params, state, _ = step(params, state, xs[i, comm.rank], ts[i, comm.rank])
                got = spmd.gather(spmd.tensor_parallel.sharded(params))
                what = f"{step.name} step {i + 1}"
                jax.tree_util.tree_map(
                    lambda a, b, what=what: np.testing.assert_allclose(
                        a, b, rtol=1e-4, atol=1e-6, err_msg=what
                    ),
                    got,
                    trajectory[i],
                )


class Stage(nn.Module):
    """A pipeline stage as a linen module: the first embeds the token ids, the last projects
    to the vocabulary; each has its own blocks."""

    first: bool
    last: bool

    @nn.compact
    def __call__(self, x):
        if self.first:
            x = nn.Embed(16, D)(x)
        for _ in range(2):
            x = x + nn.Dense(D)(jax.nn.gelu(nn.LayerNorm()(x)))
        return nn.Dense(16)(x) if self.last else x


def _xent(logits, t):
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()


@multirank(nprocs=(2,))
def test_linen_stages_in_a_pipeline_give_one_process_s_loss_and_gradients(comm):
    """Mesh(pp=2): each rank builds its stage as a linen module with its own key; the pipeline
    (1F1B, 4 microbatches) gives the loss and the gradients of the two stages composed in one
    process with flax alone."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 16, (8, 5)))
    targets = jnp.roll(ids, -1, axis=1)
    stages = [Stage(first=True, last=False), Stage(first=False, last=True)]
    like = [ids, jnp.zeros((1, 5, D))]
    params = [s.init(jax.random.key(i), like[i])["params"] for i, s in enumerate(stages)]

    def whole(ps):
        return _xent(stages[1].apply({"params": ps[1]}, stages[0].apply({"params": ps[0]}, ids)),
                     targets)  # fmt: skip

    want_loss, want_grads = jax.value_and_grad(whole)(params)
    mine = stages[comm.rank]
    step = spmd.pipeline_value_and_grad(
        lambda p, x: mine.apply({"params": p}, x), _xent, microbatches=4
    )
    with spmd.Mesh(pp=2):
        loss, grads = step(params[comm.rank], ids, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        grads,
        want_grads[comm.rank],
    )
