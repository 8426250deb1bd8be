"""Flax NNX and Equinox steps as their users write them: NNX's in-place style (model, optimizer
and metrics updated inside the step) and Equinox's filtering (a model with non-array leaves,
passed whole) under data_parallel and zero_shard, against one process on the global batch; NNX
state written back (batch statistics, RNG counts, metrics); the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank

from ._model import IN, OUT, global_batches

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

STEPS = 4


class MLP(nnx.Module):
    def __init__(self, rngs, *, norm: bool = False) -> None:
        self.l1 = nnx.Linear(IN, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(0.25, rngs=rngs) if norm else None
        self.l2 = nnx.Linear(16, OUT, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.drop(self.bn(h))
        return self.l2(nnx.relu(h))


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def nnx_step(model, optimizer, metrics, batch):
    """Flax's MNIST tutorial step, spmd.value_and_grad for nnx.value_and_grad: returns nothing."""
    (loss, logits), grads = spmd.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch[1])
    optimizer.update(model, grads)


def new_nnx(norm: bool = False):
    model = MLP(nnx.Rngs(0), norm=norm)
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def nnx_reference(batches, norm: bool = False):
    """Flax alone, one process on the global batches: the model's state after every step."""

    @nnx.jit
    def step(model, optimizer, batch):
        (_, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)

    model, optimizer, _ = new_nnx(norm)
    history = []
    for b in batches:
        step(model, optimizer, b)
        history.append(jax.tree_util.tree_map(lambda a: a.copy(), nnx.state(model)))  # a copy
    return history


def assert_states_close(got, want, rtol, what):
    sharded = lambda x: isinstance(x, spmd.ShardedArray)  # noqa: E731
    flat_got = jax.tree_util.tree_flatten_with_path(got, is_leaf=sharded)[0]
    flat_want = jax.tree_util.tree_leaves(want)
    assert len(flat_got) == len(flat_want), what
    for (path, g), w in zip(flat_got, flat_want, strict=True):
        g = g.gather() if isinstance(g, spmd.ShardedArray) else g
        if jnp.issubdtype(jnp.asarray(g).dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * 1e-1,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")  # fmt: skip


@multirank(nprocs=(2,))
def test_nnx_in_place_step_matches_one_process(comm):
    """The tutorial's step as written (it returns nothing) trains under data_parallel and
    zero_shard: after every step the model equals one process's on the global batch, and the
    metrics counted this rank's examples."""
    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in
               global_batches(STEPS, comm.size)]  # fmt: skip
    want = nnx_reference(batches)
    for name, make in (
        ("data_parallel", lambda: spmd.data_parallel(nnx_step)),
        ("zero_shard stage 1", lambda: spmd.zero_shard(nnx_step, stage=1)),
        ("zero_shard stage 3", lambda: spmd.zero_shard(nnx_step, stage=3)),
    ):
        model, optimizer, metrics = new_nnx()
        step = make()
        if name.startswith("zero"):
            assert step.shard(model, optimizer) == (model, optimizer)  # sharded in place
            mu = optimizer.opt_state[0].mu["l1"]["kernel"].get_value()
            assert isinstance(mu, spmd.ShardedArray) and mu.local.shape == (IN // comm.size, 16)
        rows = 0
        for i, b in enumerate(batches):
            local = spmd.data.shard_batch(b)
            rows += local[1].shape[0]
            assert step(model, optimizer, metrics, local) is None
            assert_states_close(nnx.state(model), want[i], 1e-5, f"{name} step {i + 1}")
        assert int(optimizer.step.get_value()) == STEPS
        assert int(metrics.accuracy.count.get_value()) == rows  # this rank's examples
        assert int(metrics.loss.count.get_value()) == STEPS
        assert np.isfinite(float(metrics.compute()["loss"]))


def test_nnx_state_other_than_parameters_is_written_back():
    """Batch statistics, dropout's RNG counts and the optimizer's step come back from the step
    as nnx.jit's would leave them (a world of one: the same computation)."""
    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in global_batches(3, 1)]
    want = nnx_reference(batches, norm=True)
    model, optimizer, metrics = new_nnx(norm=True)
    step = spmd.data_parallel(nnx_step)
    for i, b in enumerate(batches):
        step(model, optimizer, metrics, b)
        assert_states_close(nnx.state(model), want[i], 1e-5, f"step {i + 1}")
    assert int(model.drop.rngs.count.get_value()) == 3  # one dropout mask per step
    assert float(jnp.abs(model.bn.mean.get_value()).sum()) > 0  # running mean moved
    assert len(step._cache) == 1  # traced once


def test_gradients_outside_a_transform_are_the_frameworks_own():
    """spmd.value_and_grad and spmd.grad on an NNX model are nnx.value_and_grad's (an
    nnx.State of the Params); on an Equinox model eqx.filter_value_and_grad's."""
    x, y = (jnp.asarray(a) for a in global_batches(1, 1)[0])
    model = MLP(nnx.Rngs(0))
    v, g = spmd.value_and_grad(lambda m: loss_fn(m, (x, y))[0])(model)
    v2, g2 = nnx.value_and_grad(lambda m: loss_fn(m, (x, y))[0])(model)
    assert float(v) == float(v2)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(g2)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_array_equal(a, b)
    g3 = spmd.grad(lambda m: loss_fn(m, (x, y))[0])(model)
    assert jax.tree_util.tree_structure(g3) == jax.tree_util.tree_structure(g2)

    mlp = eqx.nn.MLP(IN, 4, 16, 2, key=jax.random.key(0))  # holds its activation functions
    v, g = spmd.value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(mlp)
    v2, g2 = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(mlp)
    assert float(v) == float(v2)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(g2)


def _eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@multirank(nprocs=(2,))
def test_equinox_model_passed_whole_matches_one_process(comm):
    """Equinox's own style: the model (arrays and activation functions) in and out of the
    step, gradients filtered by spmd.value_and_grad; equal to one process's filter_jit step."""
    tx = optax.adam(0.01)

    def step(model, opt_state, x, y, grad=spmd.value_and_grad):
        loss, grads = grad(_eqx_loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    init = eqx.nn.MLP(IN, 1, 16, 2, key=jax.random.key(0))
    batches = [(jnp.asarray(x), jnp.asarray(x[:, :1] ** 2)) for x, _ in
               global_batches(STEPS, comm.size)]  # fmt: skip
    ref = eqx.filter_jit(lambda m, s, x, y: step(m, s, x, y, grad=eqx.filter_value_and_grad))
    want, opt_ref = init, tx.init(eqx.filter(init, eqx.is_array))
    model, opt_state = init, tx.init(eqx.filter(init, eqx.is_array))
    dp = spmd.data_parallel(step)
    for i, (x, y) in enumerate(batches):
        want, opt_ref, _ = ref(want, opt_ref, x, y)
        model, opt_state, _ = dp(model, opt_state, *spmd.data.shard_batch((x, y)))
        assert model.activation is init.activation  # the static leaves come back as they were
        assert_states_close(eqx.filter(model, eqx.is_array), eqx.filter(want, eqx.is_array),
                            1e-5, f"step {i + 1}")  # fmt: skip
    assert len(dp._cache) == 1


@multirank(nprocs=(2,))
def test_nnx_broadcast_params_updates_the_model_in_place(comm):
    model = MLP(nnx.Rngs(comm.rank))  # every rank its own initialisation
    assert spmd.broadcast_params(model) is model
    want = MLP(nnx.Rngs(0))
    assert_states_close(nnx.state(model), nnx.state(want), 0, "broadcast")


def test_refusals_say_how_to_write_the_step():
    b = tuple(jnp.asarray(a) for a in global_batches(1, 1)[0])
    model, optimizer, _ = new_nnx()

    def with_nnx_grad(model, optimizer, batch):  # nnx's gradients are not seen
        (_, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)

    with pytest.raises(
        spmd.SpmdError, match=r"(?s)no gradient with spmd\.grad.*nnx\.value_and_grad"
    ):
        spmd.data_parallel(with_nnx_grad)(model, optimizer, b)

    def grows(model, optimizer, batch):  # adds a submodule inside the step
        (_, _), grads = spmd.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        model.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

    with pytest.raises(spmd.SpmdError, match="changed the structure of its NNX objects"):
        spmd.data_parallel(grows)(model, optimizer, b)

    params = {"w": jnp.ones((IN, OUT))}
    state = {"w": params["w"]}

    def in_place(params, batch):  # a plain dict updated in place: nothing trains
        g = spmd.grad(lambda p: jnp.mean(batch[0] @ p["w"]))(params)
        state["w"] = params["w"] - 0.1 * g["w"]

    with pytest.raises(spmd.SpmdError, match="would train nothing"):
        spmd.data_parallel(in_place)(params, b)
