"""spmd.tensor_parallel.nnx and .equinox: a small GPT block (a fused [q|k|v] kernel, a tied
embedding, LayerNorm, sequence parallelism) built from the layers on Mesh(dp=2, tp=2) starts as
the dense model one process builds with the same key, and 10 Adam steps follow that dense model
(flax.nnx / equinox alone, no spmd) step for step; the gathered weights match too."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.checkpoint._external import tensor_name
from spmd.testing import run

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

V, T, C, HEADS, B, STEPS, LR = 32, 8, 16, 4, 8, 10, 1e-2


def _data():
    return np.random.default_rng(0).integers(0, V, (STEPS, B, T + 1))


def _attention(qkv):
    q, k, v = jnp.split(qkv, 3, axis=-1)
    b, t, hd = q.shape[0], q.shape[1], C // HEADS
    q, k, v = (a.reshape(b, t, -1, hd) for a in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, -1)


def _flat(tree):
    """{name: array}, the names without the frameworks' own nodes (value, local)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tensor_name(p).replace(".value", ""): np.asarray(x) for p, x in leaves}


# -- Flax NNX --------------------------------------------------------------------------------------


class NNXModel(nnx.Module):
    def __init__(self, layers, rngs):
        self.layers = layers
        self.wte = layers.Embed(V, C, rngs=rngs)
        self.ln_1 = layers.Norm(C, rngs=rngs)
        self.c_attn = layers.Fused(C, 3 * C, rngs=rngs)
        self.c_proj = layers.Row(C, C, rngs=rngs)
        self.ln_f = layers.Norm(C, rngs=rngs)

    def __call__(self, ids):
        x = self.layers.enter(self.wte(ids))
        x = x + self.c_proj(_attention(self.c_attn(self.ln_1(x))))
        return self.wte.attend(self.ln_f(x))


def _nnx_layers(tp):
    if not tp:
        return _Namespace(
            Embed=nnx.Embed,
            Norm=nnx.LayerNorm,
            Fused=nnx.Linear,
            Row=nnx.Linear,
            enter=lambda x: x,
            loss=optax.softmax_cross_entropy_with_integer_labels,
        )
    L = spmd.tensor_parallel.nnx
    sp = functools.partial
    return _Namespace(
        Embed=sp(L.VocabEmbed, sequence_parallel=True),
        Norm=sp(L.LayerNorm, sequence_parallel=True),
        Fused=sp(L.ColumnLinear, fused=3, sequence_parallel=True),
        Row=sp(L.RowLinear, sequence_parallel=True),
        enter=lambda x: spmd.tensor_parallel.scatter_to(x, axis=1),
        loss=spmd.tensor_parallel.vocab_cross_entropy,
    )  # fmt: skip


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _nnx_train(tp, rows=slice(None)):
    layers = _nnx_layers(tp)
    model = NNXModel(layers, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    def loss_fn(model, ids, targets):
        return layers.loss(model(ids), targets).mean()

    def step(model, optimizer, ids, targets):
        loss, grads = (spmd.value_and_grad if tp else nnx.value_and_grad)(loss_fn)(
            model, ids, targets
        )
        optimizer.update(model, grads)
        return loss

    step = spmd.data_parallel(group="dp")(step) if tp else nnx.jit(step)
    initial = nnx.state(model, nnx.Param)
    initial = _flat(spmd.gather(spmd.tensor_parallel.sharded(initial)) if tp else initial)
    losses = []
    for batch in _data():
        mine = jnp.asarray(batch[rows])
        loss = step(model, optimizer, mine[:, :-1], mine[:, 1:])
        losses.append(float(spmd.allreduce(loss, "avg", group="dp") if tp else loss))
    final = nnx.state(model, nnx.Param)
    final = spmd.gather(spmd.tensor_parallel.sharded(final)) if tp else final
    return losses, initial, _flat(final)  # (initial copied: NNX trains its variables in place)


# -- Equinox ---------------------------------------------------------------------------------------


class EqxModel(eqx.Module):
    wte: object
    ln_1: object
    c_attn: object
    c_proj: object
    ln_f: object
    tp: bool = eqx.field(static=True)

    def __init__(self, tp, key):
        k = jax.random.split(key, 3)
        self.tp = tp
        if tp:
            L = spmd.tensor_parallel.equinox
            self.wte = L.VocabEmbedding(V, C, key=k[0], sequence_parallel=True)
            self.ln_1, self.ln_f = (L.LayerNorm(C, sequence_parallel=True) for _ in range(2))
            self.c_attn = L.ColumnLinear(C, 3 * C, key=k[1], fused=3, sequence_parallel=True)
            self.c_proj = L.RowLinear(C, C, key=k[2], sequence_parallel=True)
        else:
            self.wte = eqx.nn.Embedding(V, C, key=k[0])
            self.ln_1, self.ln_f = eqx.nn.LayerNorm(C), eqx.nn.LayerNorm(C)
            self.c_attn = eqx.nn.Linear(C, 3 * C, key=k[1])
            self.c_proj = eqx.nn.Linear(C, C, key=k[2])

    def __call__(self, ids):
        if self.tp:
            x = spmd.tensor_parallel.scatter_to(self.wte(ids), axis=1)
            x = x + self.c_proj(_attention(self.c_attn(self.ln_1(x))))
            return self.wte.attend(self.ln_f(x))
        each = lambda f: jax.vmap(jax.vmap(f))  # noqa: E731 (Equinox's layers take one token)
        x = each(self.wte)(ids)
        x = x + each(self.c_proj)(_attention(each(self.c_attn)(each(self.ln_1)(x))))
        return each(self.ln_f)(x) @ self.wte.weight.T


def _eqx_train(tp, rows=slice(None)):
    model = EqxModel(tp, jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.adam(LR)
    opt_state = tx.init(params)
    xent = (spmd.tensor_parallel.vocab_cross_entropy if tp
            else optax.softmax_cross_entropy_with_integer_labels)  # fmt: skip

    def loss_fn(params, ids, targets):
        return xent(eqx.combine(params, static)(ids), targets).mean()

    def step(params, opt_state, ids, targets):
        loss, grads = (spmd.value_and_grad if tp else jax.value_and_grad)(loss_fn)(
            params, ids, targets
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    step = spmd.data_parallel(group="dp")(step) if tp else jax.jit(step)
    initial = spmd.gather(spmd.tensor_parallel.sharded(params)) if tp else params
    losses = []
    for batch in _data():
        mine = jnp.asarray(batch[rows])
        params, opt_state, loss = step(params, opt_state, mine[:, :-1], mine[:, 1:])
        losses.append(float(spmd.allreduce(loss, "avg", group="dp") if tp else loss))
    final = spmd.gather(spmd.tensor_parallel.sharded(params)) if tp else params
    return losses, _flat(initial), _flat(final)


def both_on_dp2_tp2():
    with spmd.Mesh(dp=2, tp=2) as mesh:
        dp = mesh.group("dp")
        rows = slice(dp.rank * B // 2, (dp.rank + 1) * B // 2)
        return _nnx_train(True, rows), _eqx_train(True, rows)


def _compare(got, want, what):
    losses, initial, final = got
    d_losses, d_initial, d_final = want
    assert sorted(initial) == sorted(d_initial), (sorted(initial), sorted(d_initial))
    for name in d_initial:  # the same model from the same key
        np.testing.assert_allclose(initial[name], d_initial[name], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{what} {name}")  # fmt: skip
    np.testing.assert_allclose(losses, d_losses, rtol=1e-4, err_msg=what)
    assert d_losses[-1] < d_losses[0]
    for name, want_w in d_final.items():
        got_w = final[name]
        if name.endswith("c_attn.bias"):  # k's bias: a zero gradient, Adam's noise (see below)
            got_w, want_w = np.delete(got_w, np.s_[C : 2 * C]), np.delete(want_w, np.s_[C : 2 * C])
        np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=2e-6, err_msg=f"{what} {name}")


@pytest.mark.slow(reason="two 4-rank trainings")
def test_nnx_and_equinox_models_on_dp2_tp2_follow_the_dense_model_in_one_process():
    """(The bias of k has a gradient of exactly 0, softmax over keys ignoring q . b_k: Adam
    turns each run's rounding noise there into full-size steps, so it is left out.)"""
    results = run(both_on_dp2_tp2, 4)
    nnx_got, eqx_got = results[0]
    _compare(nnx_got, _nnx_train(False), "nnx")
    _compare(eqx_got, _eqx_train(False), "equinox")
    for r in results[1:]:
        np.testing.assert_allclose(r[0][0], nnx_got[0], rtol=0)  # every rank saw the same losses


# -- dropout keys and the way back from ShardedArrays ---------------------------------------------


def keys_and_round_trip(path):
    """fold_in_axes over Mesh(dp=2, tp=2); linen parameters (a fused kernel among them) saved
    as ShardedArrays of the dense layout, loaded, and put back into the layers' blocks."""
    nn = pytest.importorskip("flax.linen")
    L = spmd.tensor_parallel.linen

    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x):
            q, k, v = jnp.split(L.ColumnDense(12, fused=3, name="c_attn")(x), 3, axis=-1)
            return L.RowDense(4, name="c_proj")(q * k + v) + L.LayerNorm(name="ln")(x)

    with spmd.Mesh(dp=2, tp=2) as mesh:
        key = jax.random.key(3)
        keys = {axes: np.asarray(jax.random.key_data(spmd.random.fold_in_axes(key, axes)))
                for axes in ("dp", "tp", ("dp", "tp"))}  # fmt: skip
        with pytest.raises(spmd.SpmdError, match=r"has no axis 'pp'"):
            spmd.random.fold_in_axes(key, "pp")
        params = Tiny().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
        # The blocks as they are would be saved as replicated leaves (rank 0's alone): refused.
        with pytest.raises(
            spmd.SpmdError,
            match=r"leaf \['c_attn'\]\['bias'\] is this rank's "
            r"block of a tensor-parallel parameter \(a flax Partitioned box",
        ):
            spmd.save(path + "-raw", params)
        layer = spmd.tensor_parallel.equinox.ColumnLinear(4, 4, key=key)
        with pytest.raises(spmd.SpmdError, match=r"tensor-parallel ColumnLinear layer"):
            spmd.checkpoint.save_safetensors(path + ".safetensors", {"layer": layer})
        spmd.save(path, spmd.tensor_parallel.sharded(params))
        loaded = spmd.load(path, like=spmd.tensor_parallel.sharded(params))
        back = spmd.tensor_parallel.unsharded(loaded, params)
        same = jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), back, params)
        )
        kernel = spmd.gather(spmd.tensor_parallel.sharded(params))["c_attn"]["kernel"]
        return mesh.index("dp"), mesh.index("tp"), keys, same, np.asarray(kernel)


def test_dropout_keys_vary_over_the_named_axes_and_parameters_come_back_from_a_checkpoint(
    tmp_path,
):
    out = run(keys_and_round_trip, 4, args=(str(tmp_path / "ckpt"),))
    by = {(dp, tp): keys for dp, tp, keys, _, _ in out}
    for axes, varies in (("dp", "dp"), ("tp", "tp"), (("dp", "tp"), "both")):
        k = {c: by[c][axes].tobytes() for c in by}
        assert (k[0, 0] == k[0, 1]) == (varies == "dp"), axes  # differ only over tp?
        assert (k[0, 0] == k[1, 0]) == (varies == "tp"), axes  # differ only over dp?
        assert len(set(k.values())) == (4 if varies == "both" else 2), axes
    assert all(same for _, _, _, same, _ in out)  # the blocks (fused ones included) came back
    for _, _, _, _, kernel in out:  # the fused kernel gathered in the dense layout
        np.testing.assert_array_equal(kernel, out[0][4])
