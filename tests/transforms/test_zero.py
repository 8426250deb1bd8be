"""@spmd.zero_shard: parity with @data_parallel after every step (stages 1-3, SGD, Adam, Adam
with global-norm clipping, 2-4 ranks), per-rank memory of 1/N, the collectives each stage
inserts, mesh-axis groups and the errors."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank
from tests import HEAVY

from ._model import (
    ROWS_PER_RANK,
    assert_close,
    assert_same_everywhere,
    global_batches,
    init_params,
    loss_fn,
    make_step,
    reference,
)

STEPS = 5
CLIP = 0.05  # below the gradient norms of the first steps, so clipping is active


def _optimizers():
    return {
        "sgd": optax.sgd(0.3),
        "adam": optax.adam(0.05),
        "adam+clip": optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(0.05)),
    }


def _step(tx, with_grads=False):
    def step(params, opt_state, batch):
        loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = (optax.apply_updates(params, updates), opt_state, loss)
        return (*out, grads) if with_grads else out

    return step


def _train_dp(tx, batches):
    step = make_step(tx)
    params = spmd.broadcast_params(init_params())
    opt_state = tx.init(params)
    history = []
    for b in batches:
        params, opt_state, _ = step(params, opt_state, spmd.data.shard_batch(b))
        history.append((params, opt_state))
    return history


def _train_zero(tx, batches, stage):
    step = spmd.zero_shard(_step(tx), stage=stage)
    params = spmd.broadcast_params(init_params())
    params, opt_state = step.shard(params, tx.init(params))
    history = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, spmd.data.shard_batch(b))
        assert np.isfinite(float(loss))
        history.append((spmd.gather(params), spmd.gather(opt_state)))
    return history


def test_clipping_is_active_in_the_parity_test():
    batch = global_batches(1, 2)[0]
    norm = optax.tree.norm(jax.grad(loss_fn)(init_params(), batch))
    assert norm > 2 * CLIP


@multirank(nprocs=(2, 3, 4), timeout=HEAVY)
def test_parity_with_data_parallel(comm):
    batches = global_batches(STEPS, comm.size)
    for name, tx in _optimizers().items():
        want = _train_dp(tx, batches)
        one = reference(tx, batches)
        for stage in (1, 2, 3):
            got = _train_zero(tx, batches, stage)
            for i, ((gp, gs), (wp, ws)) in enumerate(zip(got, want, strict=True)):
                what = f"{name} stage {stage} step {i + 1}"
                assert_same_everywhere(comm, gp)
                assert_close(gp, wp, 1e-5, what)
                assert_close(gp, one[i], 1e-5, what + " (one process)")
                for g, w in zip(jax.tree_util.tree_leaves(gs), jax.tree_util.tree_leaves(ws),
                                strict=True):  # fmt: skip
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=what)


def _big_params():
    k = jax.random.split(jax.random.key(3), 3)
    return {
        "w1": jax.random.normal(k[0], (301, 64)) * 0.05,
        "b1": jnp.zeros((64,)),
        "w2": jax.random.normal(k[1], (64, 7)) * 0.1,
    }


def _big_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def _nbytes(tree):
    return sum(
        math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
    )


def _expected_shard_bytes(full_tree, n):
    """Bytes of row shards of ceil(rows / n) rows (padding included), and of the padding."""
    total = padding = 0
    for x in jax.tree_util.tree_leaves(full_tree):
        if x.ndim == 0:
            total += x.dtype.itemsize
            continue
        row = math.prod(x.shape[1:]) * x.dtype.itemsize
        chunk = -(-x.shape[0] // n)
        total += chunk * row
        padding += (chunk * n - x.shape[0]) * row / n
    return total, padding


@multirank(nprocs=(2, 4))
def test_memory_per_rank_is_one_nth(comm):
    """Measured from the arrays each rank holds after a step: optimizer state (stage >= 1),
    gradients (stage >= 2) and parameters (stage 3) are 1/N of the replicated bytes, plus the
    padding of uneven row counts (301 rows do not split evenly)."""
    n = comm.size
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((4, 301)).astype(np.float32), rng.integers(0, 7, 4))
    full_params = _big_params()
    full_state = tx.init(full_params)

    def step(params, opt_state, batch):
        grads = spmd.grad(_big_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    for stage in (1, 2, 3):
        z = spmd.zero_shard(step, stage=stage)
        params, opt_state = z.shard(full_params, full_state)
        params, opt_state, grads = z(params, opt_state, batch)
        held = {"optimizer state": (opt_state, full_state), "gradients": (grads, full_params),
                "parameters": (params, full_params)}  # fmt: skip
        sharded = {"optimizer state": True, "gradients": stage >= 2, "parameters": stage == 3}
        for what, (mine, full) in held.items():
            arrays = jax.tree_util.tree_leaves(mine, is_leaf=spmd.sharded.is_sharded)
            if not sharded[what]:
                assert not any(isinstance(a, spmd.ShardedArray) for a in arrays), what
                assert _nbytes(mine) == _nbytes(full), what
                continue
            want, padding = _expected_shard_bytes(full, n)
            got = _nbytes(mine)  # a ShardedArray's leaf is its local shard
            assert got == want, f"stage {stage} {what}: {got} bytes, expected {want}"
            ideal = _nbytes(full) / n
            assert abs(got - padding - ideal) <= 0.01 * ideal, (what, got, padding, ideal)
            assert all(a.ndim == 0 for a in arrays if not isinstance(a, spmd.ShardedArray))


def _names(program):
    return [op.name for op in program.ops]


@multirank(nprocs=(2,))
def test_trace_shows_what_each_stage_inserts(comm):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    batch = spmd.data.shard_batch(global_batches(1, 2)[0])
    params = init_params()
    for stage in (1, 2, 3):
        z = spmd.zero_shard(_step(tx), stage=stage)
        p, s = z.shard(params, tx.init(params))
        program = spmd.trace(z)(p, s, batch)
        names = _names(program)
        text = str(program)
        dots = [i for i, n in enumerate(names) if n == "dot_general"]
        if stage == 1:
            # gradients averaged by allreduce; updated parameters gathered once at the end
            assert names.count("spmd.reduce_scatter") == 0
            assert names.count("spmd.allgather") == 1
            assert names.index("spmd.allgather") > max(dots)
        else:
            assert names.count("spmd.reduce_scatter") == 1, text
            # the global norm: partial sums of the gradient shards, then scalar allreduces
            norms = [e for e in program.jaxpr.jaxpr.eqns if e.primitive.name == "spmd_allreduce"]
            assert norms and all(v.aval.shape == () for e in norms for v in e.outvars), text
        if stage == 2:
            assert names.count("spmd.allgather") == 1
        if stage == 3:
            # each weight gathered on its own before its first use in the forward pass, and the
            # one the backward pass reads (w2, for the input gradient of the second layer) again
            gathers = [e for e in program.jaxpr.jaxpr.eqns if e.primitive.name == "spmd_allgather"]
            ops = program.jaxpr.jaxpr.eqns
            names_in = [[program.in_names[program.jaxpr.jaxpr.invars.index(v)] for v in g.invars]
                        for g in gathers]  # fmt: skip
            assert names_in == [["params.w1"], ["params.b1"], ["params.w2"], ["params.w2"]], text
            assert ops.index(gathers[0]) < dots[0] and dots[1] < ops.index(gathers[3]), text
            assert names[-1] != "spmd.allgather"
        assert "spmd.mark" not in names


@multirank(nprocs=(2,))
def test_stage3_gathers_a_weight_once_per_pass(comm):
    """A weight that two matmuls read in the forward pass (and two in the backward pass) is
    gathered once for each pass, and the step still equals data_parallel's."""
    tx = optax.sgd(0.1)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((6, 6)) * 0.3, jnp.float32)
    x = jnp.asarray(np.random.default_rng(comm.rank + 1).standard_normal((4, 6)), jnp.float32)

    def update(p, state, x):
        g = spmd.grad(lambda p: jnp.sum(jnp.tanh(jnp.tanh(x @ p["w"]) @ p["w"]) ** 2))(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    params = {"w": w}
    want, _ = spmd.data_parallel(update)(params, tx.init(params), x)
    z = spmd.zero_shard(update, stage=3)
    p, s = z.shard(params, tx.init(params))
    program = spmd.trace(z)(p, s, x)
    names = _names(program)
    dots = [i for i, n in enumerate(names) if n == "dot_general"]
    gathers = [i for i, n in enumerate(names) if n == "spmd.allgather"]
    assert len(dots) >= 4 and len(gathers) == 2, str(program)
    assert gathers[0] < dots[0] < dots[1] < gathers[1], str(program)
    got, _ = z(p, s, x)
    np.testing.assert_allclose(got["w"].gather(), want["w"], rtol=1e-5, atol=1e-6)


@multirank(nprocs=(4,))
def test_mesh_axis_group(comm):
    """zero_shard(group="dp") inside Mesh(dp=2, tp=2): each dp group averages over its 2 ranks;
    the tp pairs see the same data, so all four ranks match one process on 2 ranks' batches."""
    mesh = spmd.Mesh(dp=2, tp=2)
    tx = optax.adam(0.05)
    batches = global_batches(3, 2)
    want = reference(tx, batches)
    with mesh:
        z = spmd.zero_shard(_step(tx), stage=2, group="dp")
        params = init_params()
        params, opt_state = z.shard(params, tx.init(params))
        leaf = jax.tree_util.tree_leaves(opt_state, is_leaf=spmd.sharded.is_sharded)[1]
        assert leaf.mesh is mesh and leaf.spec == spmd.PartitionSpec("dp")
        i = mesh.index("dp")
        for k, b in enumerate(batches):
            mine = tuple(x[i * ROWS_PER_RANK : (i + 1) * ROWS_PER_RANK] for x in b)
            params, opt_state, _ = z(params, opt_state, mine)
            assert_close(params, want[k], 1e-5, f"step {k + 1}")


@multirank(nprocs=(2,))
def test_arrays_whose_shards_look_alike_get_their_own_program(comm):
    """7 and 8 rows both give 4-row shards on 2 ranks: the step must not reuse the 7-row
    program for the 8-row state (the global shape is part of the cache key)."""
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(params, x):
        return jnp.sum(params["w"] ** 2) * x.mean()

    def step(params, opt_state, x):
        grads = spmd.grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    z = spmd.zero_shard(step, stage=3)
    x = jnp.ones((4,))
    for rows in (7, 8, 7):
        full = {"w": jnp.arange(rows, dtype=jnp.float32)}
        params, opt_state = z.shard(full, tx.init(full))
        params, opt_state = z(params, opt_state, x)
        got = spmd.gather(params)["w"]
        assert got.shape == (rows,)
        np.testing.assert_allclose(got, full["w"] * (1 - 0.1 * 2), rtol=1e-6)
    assert len(z._cache) == 2


@multirank(nprocs=(1,))
def test_one_rank_is_one_process(comm):
    tx = optax.adam(0.05)
    batches = global_batches(3, 1)
    for stage in (1, 3):
        for (p, _), w in zip(_train_zero(tx, batches, stage), reference(tx, batches), strict=True):
            assert_close(p, w, 1e-6, f"stage {stage}")


def _cumulative(learning_rate):
    """A made-up optimizer whose state update is not elementwise (a cumulative sum)."""

    def init(params):
        return {"m": jax.tree_util.tree_map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        m = jax.tree_util.tree_map(lambda m, g: jnp.cumsum(m + g, axis=0), state["m"], grads)
        return jax.tree_util.tree_map(lambda x: -learning_rate * x, m), {"m": m}

    return optax.GradientTransformation(init, update)


@multirank(nprocs=(2,))
def test_errors_name_the_op_and_the_rank(comm):
    batch = spmd.data.shard_batch(global_batches(1, 2)[0])
    params = init_params()
    tx = _cumulative(0.1)
    z = spmd.zero_shard(_step(tx), stage=1)
    p, s = z.shard(params, tx.init(params))
    with pytest.raises(spmd.SpmdError, match=rf"rank {comm.rank}: .*op cumsum .*opt_state\.m\."):
        z(p, s, batch)

    adam = optax.adam(0.1)
    z = spmd.zero_shard(_step(adam), stage=2)
    p, s = z.shard(params, adam.init(params))
    wrong = spmd.shard(params["w1"], spmd.PartitionSpec(None, "dp"))
    bad = (s[0]._replace(mu={**s[0].mu, "w1": wrong}), *s[1:])
    with pytest.raises(spmd.SpmdError, match=r"opt_state.*mu.*w1.*split along axis 0"):
        z(p, bad, batch)

    def no_grad(params, opt_state, batch):
        return params, opt_state, loss_fn(params, batch)

    with pytest.raises(spmd.SpmdError, match="computes no gradient"):
        spmd.zero_shard(no_grad)(p, s, batch)
    with pytest.raises(spmd.SpmdError, match=r"stage=4; expected 1, 2 or 3"):
        spmd.zero_shard(no_grad, stage=4)
    # no_sync: refused (the step synchronized anyway and the accumulation was lost)
    with (
        spmd.no_sync(),
        pytest.raises(
            spmd.SpmdError,
            match=rf"rank {comm.rank}: zero_shard\(step\) was "
            r"called inside spmd.no_sync\(\).*accumulate_steps",
        ),  # fmt: skip
    ):
        z(p, s, batch)


@multirank(nprocs=(2, 3), timeout=HEAVY)
def test_batch_values_and_scans_at_every_stage(comm):
    """A parameter times a value of this rank's batch of the same shape (the pass must not take
    this rank's rows of the batch value as if every rank held it), and a scan over
    layer-stacked parameters (a loop, not a call: it reads them gathered), at every stage: the
    same parameters as one process on the global batch."""
    n = comm.size
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((4 * n, 4)).astype(np.float32)
    params = {
        "scale": jnp.asarray([1.0, 2.0, 3.0, 4.0]),
        "layers": jnp.asarray(rng.standard_normal((3, 4, 4)) * 0.3, jnp.float32),
    }

    def loss(p, x):  # mean over ranks of each rank's loss: the global batch's objective
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
        return jnp.sum((p["scale"] * x.mean(0)) ** 2) + jnp.mean(h**2)

    tx = optax.adam(0.1)

    def step(p, s, x):
        value, g = spmd.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    def reference(p, s):
        g = jax.tree.map(
            lambda *gs: sum(gs) / n,
            *[jax.grad(loss)(p, xs[k * 4 : (k + 1) * 4]) for k in range(n)],
        )
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for stage in (1, 2, 3):
        z = spmd.zero_shard(step, stage=stage)
        p, s = z.shard(params, tx.init(params))
        want_p, want_s = params, tx.init(params)
        mine = spmd.data.shard_batch(xs)
        for i in range(3):
            p, s, value = z(p, s, mine)
            # The loss is this rank's own, before the update.
            np.testing.assert_allclose(float(value), float(loss(want_p, mine)), rtol=2e-5)
            want_p, want_s = reference(want_p, want_s)
            got = spmd.gather(p) if stage == 3 else p
            for key in params:
                np.testing.assert_allclose(
                    got[key], want_p[key], rtol=2e-5, atol=1e-6, err_msg=f"{stage} {i} {key}"
                )


@multirank(nprocs=(2,))
def test_stage_3_checks_the_parameters_before_sharding_them(comm):
    params = {"w": jnp.ones((4, 2)) * (1 + comm.rank)}  # differs on rank 1
    tx = optax.sgd(0.1)
    z = spmd.zero_shard(_step(tx), stage=3)
    with pytest.raises(spmd.SpmdError, match=r"rank \d: zero_shard\(.*\)\.shard: .*ranks \[1\] "
                       r"hold other values than rank 0 \(first difference: params\.w"):  # fmt: skip
        z.shard(params, tx.init(params))
    p, _ = z.shard(spmd.broadcast_params(params), tx.init(params))  # repaired
    assert isinstance(p["w"], spmd.ShardedArray) and p["w"].shape == (4, 2)


@multirank(nprocs=(2,))
def test_nested_calls_with_constant_operands(comm):
    """jnp.where/jnp.clip inside optax and in the forward pass are nested jit calls that take a
    literal operand; the pass crashed on them (an unhashable Literal). Each stage now matches
    data_parallel."""
    r, n = comm.rank, comm.size
    x = np.random.default_rng(0).standard_normal((4 * n, 5)).astype(np.float32)[4 * r : 4 * r + 4]
    params = {"w": jnp.linspace(-0.5, 0.5, 15, dtype=jnp.float32).reshape(5, 3)}

    def plain(p, b):
        return jnp.mean((b @ p["w"]) ** 2)

    def clipped(p, b):
        return jnp.mean((b @ jnp.where(p["w"] > 0, p["w"], 0.0)) ** 2)

    cases = [
        (1, optax.adagrad(0.1), plain),
        (2, optax.chain(optax.clip(1.0), optax.sgd(0.1)), plain),
        (3, optax.sgd(0.1), clipped),
    ]
    for stage, tx, loss in cases:

        def step(p, s, b, tx=tx, loss=loss):
            g = spmd.grad(loss)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        want, _ = spmd.data_parallel(step)(params, tx.init(params), x)
        z = spmd.zero_shard(step, stage=stage)
        got, _ = z(*z.shard(params, tx.init(params)), x)
        np.testing.assert_allclose(spmd.gather(got)["w"], want["w"], rtol=1e-6, err_msg=str(stage))


class _TrainState(NamedTuple):
    params: Any
    opt_state: Any


@multirank(nprocs=(2,))
def test_weight_decay_keeps_the_optimizer_state_sharded(comm):
    """With weight decay the optimizer state is computed from the parameters too; it used to
    be taken for updated parameters and come back full at stages 1 and 2 (values right, the
    1/N memory silently lost). Steps that return (params, opt_state) or a whole TrainState."""
    r, n = comm.rank, comm.size
    x = np.random.default_rng(1).standard_normal((4 * n, 5)).astype(np.float32)[4 * r : 4 * r + 4]
    params = {"w": jnp.linspace(-0.5, 0.5, 15, dtype=jnp.float32).reshape(5, 3), "b": jnp.ones(3)}

    def loss(p, b):
        return jnp.mean((b @ p["w"] + p["b"]) ** 2)

    optimizers = {
        "decay+adam": optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.1)),
        "adamw": optax.adamw(0.1, weight_decay=0.1),
        "lars": optax.lars(0.1),
    }
    for name, tx in optimizers.items():

        def step(p, s, b, tx=tx):
            u, s = tx.update(spmd.grad(loss)(p, b), s, p)
            return optax.apply_updates(p, u), s

        def whole(state, b, tx=tx):
            return _TrainState(*step(state.params, state.opt_state, b, tx))

        for stage in (1, 2):
            want = (params, tx.init(params))
            dp = spmd.data_parallel(step)
            z, zw = spmd.zero_shard(step, stage=stage), spmd.zero_shard(whole, stage=stage)
            got = z.shard(params, tx.init(params))
            got_whole = _TrainState(*zw.shard(params, tx.init(params)))
            for i in range(2):
                what = f"{name} stage {stage} step {i + 1}"
                want = dp(*want, x)
                got = z(*got, x)
                got_whole = zw(got_whole, x)
                for p_, s_ in (got, got_whole):
                    assert not any(spmd.sharded.is_sharded(v) for v in jax.tree.leaves(p_)), what
                    arrays = [v for v in jax.tree.leaves(s_, is_leaf=spmd.sharded.is_sharded)
                              if np.ndim(v) >= 1]  # fmt: skip
                    assert arrays and all(spmd.sharded.is_sharded(v) for v in arrays), what
                    for g, w in zip(jax.tree.leaves(p_), jax.tree.leaves(want[0]), strict=True):
                        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=what)
                    full = spmd.gather(s_)
                    for g, w in zip(jax.tree.leaves(full), jax.tree.leaves(want[1]), strict=True):
                        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=what)

    # Momentum with the parameters' own structure, and weight decay: the new momentum has the
    # structure of both arguments, so it cannot be told from the parameters by the pytrees.
    # Ambiguous parts are gathered: the parameters must come back full (the momentum does too).
    def momentum(p, m, b):
        g = spmd.grad(loss)(p, b)
        m = jax.tree.map(lambda m, g, p: 0.9 * m + g + 0.1 * p, m, g, p)
        return jnp.float32(0), jax.tree.map(lambda p, m: p - 0.1 * m, p, m), m

    m0 = jax.tree.map(jnp.zeros_like, params)
    for stage in (1, 2):
        z = spmd.zero_shard(momentum, stage=stage)
        _, want_p, _ = spmd.data_parallel(momentum)(params, m0, x)
        _, got_p, _ = z(*z.shard(params, m0), x)
        assert not any(spmd.sharded.is_sharded(v) for v in jax.tree.leaves(got_p)), stage
        for g, w in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=str(stage))
