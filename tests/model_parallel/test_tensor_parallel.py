"""spmd.tensor_parallel: forward values and gradients of the Megatron layers at tp = 2 and 4
equal a one-process dense model (also with sequence parallelism); the layers inside
data_parallel and zero_shard over the dp axis of Mesh(dp=2, tp=2) train as one process does on
the global batch; bad input is a named error on every rank."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank

P = spmd.PartitionSpec
tp = spmd.tensor_parallel
B, S, D, F, H, V = 2, 8, 8, 16, 4, 12  # batch, sequence, model, hidden, heads, vocabulary


def _close(got, want, what, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6,
                               err_msg=what)  # fmt: skip


def _params(seed=0):
    k = jax.random.split(jax.random.key(seed), 10)
    n = jax.random.normal
    return {
        "w1": n(k[0], (D, F)) * 0.3, "b1": n(k[1], (F,)) * 0.1,
        "w2": n(k[2], (F, D)) * 0.3, "b2": n(k[3], (D,)) * 0.1,
        "wq": n(k[4], (D, D)) * 0.3, "wk": n(k[5], (D, D)) * 0.3,
        "wv": n(k[6], (D, D)) * 0.3, "wo": n(k[7], (D, D)) * 0.3,
        "table": n(k[8], (V, D)), "out": n(k[9], (D, V)) * 0.3,
    }  # fmt: skip


SPECS = {
    "w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": None,
    "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
    "table": P("tp", None), "out": P(None, "tp"),
}  # fmt: skip


def _data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, S, D)).astype(np.float32)
    ids = rng.integers(0, V, (B, S))
    return jnp.asarray(x), jnp.asarray(ids)


# -- the dense model (one process) and its tensor-parallel form --------------------------------


def _attend(q, k, v, heads):
    def split(t):
        return t.reshape(*t.shape[:-1], heads, -1).swapaxes(-2, -3)  # (B, h, S, hd)

    q, k, v = split(q), split(k), split(v)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((s.shape[-1], s.shape[-1]), bool))
    o = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1) @ v
    return o.swapaxes(-2, -3).reshape(*o.shape[:-3], o.shape[-2], -1)


def dense_mlp(p, x):
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def dense_attention(p, x):
    return _attend(x @ p["wq"], x @ p["wk"], x @ p["wv"], H) @ p["wo"]


def dense_lm(p, ids):
    logits = p["table"][ids] @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, ::-1]).mean()


def tp_mlp(p, x, sp=False):
    h = jax.nn.gelu(tp.column_linear(x, p["w1"], p["b1"], sequence_parallel=sp))
    return tp.row_linear(h, p["w2"], p["b2"], sequence_parallel=sp)


def tp_attention(p, x, sp=False):
    heads = H // spmd.current_mesh().shape["tp"]
    q, k, v = (tp.column_linear(x, p[w], sequence_parallel=sp) for w in ("wq", "wk", "wv"))
    return tp.row_linear(_attend(q, k, v, heads), p["wo"], sequence_parallel=sp)


def tp_lm(p, ids):
    logits = tp.column_linear(tp.vocab_embed(ids, p["table"]), p["out"])
    return tp.vocab_cross_entropy(logits, ids[:, ::-1]).mean()


def _seq_shard(x, comm):
    n = S // comm.size
    return x[..., comm.rank * n : (comm.rank + 1) * n, :]


def _mse(y, t):
    return jnp.sum((y - t) ** 2)


@multirank(nprocs=(2, 4))
def test_layers_match_dense_model(comm):
    full = _params()
    x, ids = _data()
    target = jnp.asarray(np.random.default_rng(2).standard_normal((B, S, D)), jnp.float32)
    with spmd.Mesh(tp=comm.size):
        sharded = tp.shard_params(full, SPECS)
        mine = tp.local(sharded)
        for name, dense, layer, keys in (
            ("mlp", dense_mlp, tp_mlp, ("w1", "b1", "w2", "b2")),
            ("attention", dense_attention, tp_attention, ("wq", "wk", "wv", "wo")),
        ):
            want_y = dense(full, x)
            want_g = jax.grad(lambda p, dense=dense: _mse(dense(p, x), target))(full)
            for sp in (False, True):
                what = f"{name} sequence_parallel={sp} tp={comm.size}"
                xin = _seq_shard(x, comm) if sp else x
                t = _seq_shard(target, comm) if sp else target

                def loss(p, xin=xin, t=t, sp=sp, layer=layer):
                    part = _mse(layer(p, xin, sp), t)
                    # With sequence parallelism each rank holds its tokens' part of the loss.
                    return tp.reduce_from(part) if sp else part

                y = jax.jit(lambda p, xin=xin, sp=sp, layer=layer: layer(p, xin, sp))(mine)
                _close(y, _seq_shard(want_y, comm) if sp else want_y, what + " output")
                g = jax.jit(jax.grad(loss))(mine)
                for key in keys:
                    block = tp.shard_params(want_g[key], SPECS[key])
                    _close(g[key], block.local, f"{what} grad {key}", rtol=1e-4)
        # Vocabulary-parallel embedding and cross-entropy (and column_linear to the logits).
        loss, g = jax.jit(jax.value_and_grad(tp_lm))(mine, ids)
        want_loss, want_g = jax.value_and_grad(dense_lm)(full, ids)
        _close(loss, want_loss, f"vocab loss tp={comm.size}")
        for key in ("table", "out"):
            block = tp.shard_params(want_g[key], SPECS[key])
            _close(g[key], block.local, f"vocab grad {key} tp={comm.size}", rtol=1e-4)
        # gather_from / scatter_to are each other's transposes.
        z = jnp.arange(4.0 * comm.size).reshape(2, -1)
        part = tp.scatter_to(z)
        assert part.shape == (2, 2) and jnp.array_equal(tp.gather_from(part), z)
        ct = jax.grad(lambda v: jnp.sum(tp.gather_from(v) * z))(part)
        _close(ct, part, "gather_from's gradient is this rank's slice")


# -- composition with data_parallel and zero_shard on Mesh(dp=2, tp=2) -------------------------


def _mlp_loss(p, batch):
    x, t = batch
    return jnp.mean((tp_mlp(p, x) - t) ** 2)


def _dense_loss(p, batch):
    x, t = batch
    return jnp.mean((dense_mlp(p, x) - t) ** 2)


def _batches(steps, rows):
    rng = np.random.default_rng(3)
    return [
        (rng.standard_normal((rows, S, D)).astype(np.float32),
         rng.standard_normal((rows, S, D)).astype(np.float32))
        for _ in range(steps)
    ]  # fmt: skip


@multirank(nprocs=(4,))
def test_composes_with_data_parallel_and_zero(comm):
    tx = optax.adam(0.02)
    keys = ("w1", "b1", "w2", "b2")
    full = {k: v for k, v in _params().items() if k in keys}
    batches = _batches(4, 4)
    ref, ref_state, want = full, tx.init(full), []
    for b in batches:
        g = jax.grad(_dense_loss)(ref, b)
        u, ref_state = tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
        want.append(ref)

    mesh = spmd.Mesh(dp=2, tp=2)
    with mesh:
        dp = mesh.index("dp")

        def local_batch(b):
            return tuple(v[dp * 2 : dp * 2 + 2] for v in b)

        def train(step, params):
            state = tx.init(params)
            got = []
            for b in batches:
                params, state, _ = step(params, state, local_batch(b))
                got.append(params)
            return got

        def update(p, state, batch):
            loss, g = spmd.value_and_grad(_mlp_loss)(p, batch)
            u, state = tx.update(g, state, p)
            return optax.apply_updates(p, u), state, loss

        sharded = tp.shard_params(full, {k: SPECS[k] for k in keys})
        runs = {
            "data_parallel, ShardedArray params": train(
                spmd.data_parallel(update, group="dp"), sharded
            ),
            "data_parallel, plain blocks": train(
                spmd.data_parallel(update, group="dp"), tp.local(sharded)
            ),
        }
        zero = spmd.zero_shard(update, stage=3, group="dp")
        p3, s3 = zero.shard(tp.local(sharded), tx.init(tp.local(sharded)))
        got3 = []
        for b in batches:
            p3, s3, _ = zero(p3, s3, local_batch(b))
            got3.append(spmd.gather(p3))
        runs["zero_shard(stage=3)"] = got3
        for name, got in runs.items():
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                blocks = tp.local(tp.shard_params(w, {k: SPECS[k] for k in keys}))
                for k in keys:
                    _close(tp.local(g)[k], blocks[k], f"{name} step {i + 1} {k}", rtol=1e-4)
        text = str(spmd.trace(spmd.data_parallel(update, group="dp"))(
            sharded, tx.init(sharded), local_batch(batches[0])))  # fmt: skip
        tp_ranks = mesh.rank_lists("tp")[mesh.coords()["dp"]]
        dp_ranks = next(g for g in mesh.rank_lists("dp") if comm.rank in g)
        assert f"group={tp_ranks}" in text, text  # the layers' allreduces over tp
        assert f"group={dp_ranks}" in text, text  # the gradient average over dp


# -- bad input --------------------------------------------------------------------------------


@multirank(nprocs=(2,))
def test_errors(comm):
    with spmd.Mesh(tp=2):
        cases = [
            (lambda: tp.scatter_to(jnp.ones((2, 3))), "do not divide by the group size 2"),
            (lambda: tp.row_linear(jnp.ones((1, 4)), jnp.ones((2, 3))), "tp=2 times w's"),
            (lambda: tp.column_linear(jnp.ones((1, 3)), jnp.ones((4, 2))), "4 features"),
            (lambda: tp.column_linear(jnp.ones((1, 4)), jnp.ones((4, 2)), jnp.ones(3)),
             "b has shape (3,); expected (2,)"),
            (lambda: tp.shard_params({"w": jnp.ones((3, 4))}, {"w": P("tp", None)}),
             "params['w'] has 3 elements along axis 0"),
            (lambda: tp.vocab_cross_entropy(jnp.ones((2, 3)), jnp.zeros(3, int)),
             "expected labels of shape (2,)"),
            (lambda: tp.vocab_embed(jnp.ones(2), jnp.ones((3, 2))), "expected integers"),
            (lambda: tp.reduce_scatter_sequence(jnp.ones((3, 2))), "along axis 0"),
            (lambda: tp.column_linear(jnp.ones((1, 2)), tp.shard_params(jnp.ones((4, 4)),
                                                                         P("tp", None))),
             "w is a ShardedArray split as P('tp', None), but column_linear takes it split along "
             "dimension 1 over the group's ranks [0, 1] (for group='tp': P(None, 'tp'))"),
        ]  # fmt: skip
        for make, text in cases:
            with pytest.raises(spmd.SpmdError, match=f"rank {comm.rank}: .*") as info:
                make()
            assert text in str(info.value), str(info.value)
    with pytest.raises(spmd.SpmdError, match="no mesh is active"):
        tp.copy_to(jnp.ones(2))


def _drift_steps(use_copy_to, steps):
    """A data-parallel step on Mesh(dp=1, tp=2) whose replicated ``scale`` meets this rank's
    part of the sequence (sequence parallelism): without copy_to its gradient is this rank's
    alone and the two tp ranks' copies drift apart; with it, summed over tp, they stay equal."""
    import os

    mesh = spmd.Mesh(dp=1, tp=2)
    rank = mesh.index("tp")
    params = {"w": jax.random.normal(jax.random.key(rank), (3, 2)), "scale": jnp.ones(2)}
    x = jax.random.normal(jax.random.key(10 + rank), (4, 3))  # this rank's part of the sequence

    def loss_fn(p):
        scale = spmd.tensor_parallel.copy_to(p["scale"]) if use_copy_to else p["scale"]
        return jnp.sum((x @ p["w"] * scale) ** 2)

    with mesh:

        @spmd.data_parallel(group="dp")
        def step(p):
            loss, g = spmd.value_and_grad(loss_fn)(p)
            return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), loss

        old = {k: os.environ.get(k) for k in ("SPMD_DEBUG", "SPMD_CHECK_EVERY")}
        os.environ.update(SPMD_DEBUG="1", SPMD_CHECK_EVERY="2")
        try:
            for _ in range(steps):
                params, _ = step(params)
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return params


@multirank(nprocs=(2,))
def test_a_replicated_parameter_that_drifts_apart_over_tp_is_named(comm):
    """The silent trap of sequence parallelism without copy_to on a norm's parameters: under
    SPMD_DEBUG=1 the replica check repeats every SPMD_CHECK_EVERY steps over every mesh axis
    and names the parameter and the group; with copy_to, four steps pass and the copies agree
    (the tp-split ``w``, different from the start, is never compared over tp)."""
    with pytest.raises(spmd.SpmdError) as info:
        _drift_steps(use_copy_to=False, steps=4)
    text = str(info.value)
    assert (
        "at step 2, the parameter p.scale differs between the ranks [0, 1] of the mesh axis 'tp' "
        "(1 of the 1 parameters they held alike at the first step have drifted apart)"
    ) in text, text
    assert "spmd.tensor_parallel.copy_to" in text
    params = _drift_steps(use_copy_to=True, steps=4)
    scales = comm.allgather_object(np.asarray(params["scale"]))
    np.testing.assert_array_equal(scales[0], scales[1])
    assert not np.array_equal(scales[0], np.ones(2))  # it trained
