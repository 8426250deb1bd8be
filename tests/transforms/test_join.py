"""spmd.join: ranks with different numbers of batches train together, and the result is one
process's on the batches of the ranks that had one, step by step (2 and 3 ranks, SGD and Adam);
the replicas stay identical; what a rank out of batches sees; the errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

from ._model import (
    assert_close,
    assert_same_everywhere,
    global_batches,
    init_params,
    loss_fn,
    make_step,
    optimizers,
)


def _uneven(world: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Rank r's batches: 2 + r of them (the same data on every rank, cut per rank)."""
    rows = global_batches(world + 1, world, seed=3)  # world * 8 rows per batch
    per = len(rows[0][0]) // world
    return [[(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for x, y in rows[:2 + r]]
            for r in range(world)]  # fmt: skip


def _reference(tx, batches: list[list[tuple[np.ndarray, np.ndarray]]]):
    """One process: step i on the batches of the ranks that have an i-th one, concatenated."""

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree_util.tree_map(lambda p, u: p + u, params, updates), opt_state

    params = init_params()
    opt_state = tx.init(params)
    for i in range(max(map(len, batches))):
        parts = [b[i] for b in batches if i < len(b)]
        both = tuple(np.concatenate([p[k] for p in parts]) for k in range(2))
        params, opt_state = step(params, opt_state, both)
    return params


@multirank(nprocs=(2, 3, 4))
def test_uneven_batches_follow_one_process(comm):
    batches = _uneven(comm.size)
    mine = batches[comm.rank]
    for name, tx in optimizers().items():
        step = make_step(tx)
        params = spmd.broadcast_params(init_params())
        opt_state = tx.init(params)
        steps, shadows = 0, 0
        for batch in spmd.join(mine):
            params, opt_state, loss = step(params, opt_state, batch)
            steps += 1
            shadows += spmd.joined()
            assert np.isfinite(float(loss))
        assert steps == len(batches[-1])  # every rank ran as many steps as the longest
        assert shadows == steps - len(mine)  # the steps after its own batches ran out
        assert not spmd.joined()  # outside the loop
        assert_same_everywhere(comm, params)
        assert_close(params, _reference(tx, batches), 1e-5, f"{name} after join")


@multirank(nprocs=(2, 3))
def test_uneven_batches_under_zero_follow_one_process(comm):
    """zero_shard stages 1 and 3: the same, each rank updating its shard of the state."""
    batches = _uneven(comm.size)
    tx = optimizers()["adam"]
    want = _reference(tx, batches)

    def train_step(params, opt_state, batch):
        loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree_util.tree_map(lambda p, u: p + u, params, updates), opt_state, loss

    for stage in (1, 3):
        step = spmd.zero_shard(train_step, stage=stage)
        params = spmd.broadcast_params(init_params())
        params, opt_state = step.shard(params, tx.init(params))
        for batch in spmd.join(batches[comm.rank]):
            params, opt_state, _ = step(params, opt_state, batch)
        full = spmd.gather(params)
        assert_same_everywhere(comm, full)
        assert_close(full, want, 1e-5, f"stage {stage} after join")


@multirank(nprocs=(2,))
def test_errors(comm):
    tx = optimizers()["sgd"]
    step = make_step(tx)
    params = spmd.broadcast_params(init_params())
    opt_state = tx.init(params)
    b = global_batches(1, 1)[0]
    mine = [] if comm.rank == 1 else [b]
    with pytest.raises(spmd.SpmdError, match=r"ranks \[1\] have no batch at all"):
        for batch in spmd.join(mine):
            step(params, opt_state, batch)
    other = spmd.get_communicator(rank_list=[[0], [1]])
    with pytest.raises(spmd.SpmdError, match=r"spmd.join over the ranks \[\d\] around a step"):
        for batch in spmd.join([b], group=other):
            step(params, opt_state, batch)


def test_the_join_pass_weights_each_gradient_where_it_is_produced():
    """weight_joined on its own (a world of one): the program takes the weight and the factor
    last; each gradient is multiplied by the factor, or zero on a rank out of batches (a NaN
    included); the marks stay for the reducing pass after it; and the weighting sits right
    after the op that produces the gradient, not at the end of the backward pass."""
    import jax.numpy as jnp

    def f(w, x):
        return spmd.grad(lambda w: jnp.sum(w**2 * x))(w)

    w, x = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([1.0, 1.0, 1.0])
    program = spmd.trace(f)(w, x)
    weighted = spmd.transforms.weight_joined()(program)
    assert weighted.in_names == (*program.in_names, "join.weight", "join.scale")
    assert len(spmd.transforms.gradient_leaves(weighted)[0]) == 1  # still marked
    np.testing.assert_array_equal(weighted(w, x, np.float32(1), np.float32(2)), [4.0, 8.0, 12.0])
    np.testing.assert_array_equal(weighted(w, x, np.float32(0), np.float32(2)), [0.0, 0.0, 0.0])
    nan = jnp.asarray([np.nan, 1.0, 1.0])
    np.testing.assert_array_equal(weighted(w, nan, np.float32(0), np.float32(1)), [0.0, 0.0, 0.0])
    reduced = spmd.transforms.chain(
        spmd.transforms.weight_joined(), spmd.transforms.reduce_gradients()
    )(program)
    np.testing.assert_array_equal(reduced(w, x, np.float32(1), np.float32(3)), [6.0, 12.0, 18.0])

    # Two layers: the second's gradient comes first in the backward pass, and is weighted
    # before the first's is computed (where the reducing pass can overlap its reduction).
    def two(p, x):
        return spmd.grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(p)

    p = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}
    names = [op.name for op in spmd.transforms.weight_joined()(spmd.trace(two)(p, x[None])).ops]
    products = [i for i, n in enumerate(names) if n == "dot_general"]
    selects = [i for i, n in enumerate(names) if n == "select_n"]
    assert len(selects) == 2 and selects[0] < products[-1] < selects[1], names
