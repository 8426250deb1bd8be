"""A Flax linen GPT-2 as its users write it, and its port to spmd.tensor_parallel.linen
(examples/gpt_flax.py): on Mesh(dp=2, tp=2) with sequence parallelism, 10 Adam steps follow the
plain Flax model trained in one process (no spmd) step for step, and the weights it exports as
safetensors are the dense model's. The fused-kernel trap (a [q|k|v] kernel split as if it were
one layer) is an error naming the layer, its weight and the group."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import run

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt_flax.py"


def _example():
    if "gpt_flax" not in sys.modules:  # (Flax's dataclasses look their module up there)
        spec = importlib.util.spec_from_file_location("gpt_flax", EXAMPLE)
        sys.modules["gpt_flax"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["gpt_flax"]


# -- GPT-2 as Flax users write it (the model examples/gpt_flax.py ports) -------------------------


class Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C = x.shape[-1]
        qkv = nn.Dense(3 * C, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        B, T, hd = q.shape[0], q.shape[1], C // self.heads
        q, k, v = (t.reshape(B, T, self.heads, hd) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, jnp.finfo(att.dtype).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(B, T, C)
        return nn.Dense(C, name="c_proj")(y)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * C, name="c_fc")(x))
        return nn.Dense(C, name="c_proj")(h)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.heads, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    vocab: int
    context: int
    width: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        wte = nn.Embed(self.vocab, self.width, name="wte")
        x = wte(ids) + nn.Embed(self.context, self.width, name="wpe")(jnp.arange(ids.shape[1]))
        for i in range(self.layers):
            x = Block(self.heads, name=f"h_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return wte.attend(x)


def _dense_run(steps=10, batch=8, lr=3e-3):
    """The one-process reference: plain Flax and optax, no spmd."""
    ex = _example()
    model = GPT(**ex.CONFIG)
    data = ex.batches(steps, batch)
    params = model.init(jax.random.key(0), jnp.asarray(data[0, :1, :-1]))["params"]
    opt = optax.adam(lr)
    state = opt.init(params)

    def loss_fn(p, ids, targets):
        logits = model.apply({"params": p}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(p, s, ids, targets):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, targets)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, data[i, :, :-1], data[i, :, 1:])
        losses.append(float(loss))
    return losses, params


@pytest.mark.slow(reason="a 4-rank training run of the example")
def test_the_port_on_dp2_tp2_with_sequence_parallel_follows_plain_flax(tmp_path):
    from safetensors.numpy import load_file

    out = subprocess.run(
        [sys.executable, "-m", "spmd.cli.run", "-n", "4", sys.executable, str(EXAMPLE),
         "--mesh", "dp=2,tp=2", "--sequence-parallel", "--save", str(tmp_path / "w.safetensors")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    four = [float(m) for m in re.findall(r"step +\d+ loss ([\d.]+)", out.stdout)]
    losses, params = _dense_run()
    assert len(four) == 10
    np.testing.assert_allclose(four, losses, rtol=1e-4)
    assert losses[-1] < losses[0]

    saved = load_file(str(tmp_path / "w.safetensors"))
    dense = {
        ".".join(str(k.key) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert sorted(saved) == sorted(dense)
    C = _example().CONFIG["width"]
    for name, want in dense.items():
        got = saved[name]
        assert got.shape == want.shape, name
        if name.endswith("c_attn.bias"):
            # k's bias has a gradient of exactly 0 (softmax over keys ignores q . b_k, the same
            # for every key): Adam turns each run's rounding noise there into full-size steps.
            got, want = np.delete(got, np.s_[C : 2 * C]), np.delete(want, np.s_[C : 2 * C])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=name)


# -- the fused-kernel trap ------------------------------------------------------------------------


class _Unfused(nn.Module):
    @nn.compact
    def __call__(self, x):
        qkv = spmd.tensor_parallel.linen.ColumnDense(12, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        return spmd.tensor_parallel.linen.RowDense(4, name="c_proj")(q * k + v)


def fused_trap(fused):
    comm = spmd.get_communicator()
    with spmd.Mesh(dp=1, tp=comm.size):
        model = _Unfused() if not fused else _Fused()
        x = jnp.ones((2, 4))
        params = model.init(jax.random.key(0), x)["params"]

        @spmd.data_parallel(group="dp")
        def step(p, x):
            return spmd.value_and_grad(lambda p: model.apply({"params": p}, x).sum())(p)

        try:
            return float(step(params, x)[0])
        except spmd.SpmdError as e:
            return str(e)


class _Fused(nn.Module):
    @nn.compact
    def __call__(self, x):
        qkv = spmd.tensor_parallel.linen.ColumnDense(12, fused=3, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        return spmd.tensor_parallel.linen.RowDense(4, name="c_proj")(q * k + v)


def function_trap():
    """The function API: the weight is a step input, named by its path."""
    comm = spmd.get_communicator()
    P = spmd.PartitionSpec
    with spmd.Mesh(dp=1, tp=comm.size):
        params = spmd.tensor_parallel.shard_params(
            {"c_attn": jnp.ones((4, 12))}, {"c_attn": P(None, "tp")}
        )

        @spmd.data_parallel(group="dp")
        def step(p, x):
            def loss(p):
                qkv = spmd.tensor_parallel.column_linear(x, p["c_attn"])
                return (qkv[..., :2] ** 2).sum()

            return spmd.value_and_grad(loss)(p)

        try:
            return float(step(params, jnp.ones((2, 4)))[0])
        except spmd.SpmdError as e:
            return str(e)


def test_a_fused_kernel_split_as_one_layer_is_an_error_naming_the_layer_and_group():
    unfused = run(fused_trap, 2, args=(False,))
    for rank, text in enumerate(unfused):
        assert isinstance(text, str), unfused
        assert text.startswith(f"rank {rank}: "), text
        assert (
            "the output of the column-parallel layer 'c_attn' (weight p.c_attn.kernel) is split "
            "into 3 parts along its features, but each rank of the group [0, 1] holds a "
            "contiguous block"
        ) in text, text
        assert "ColumnDense(..., fused=3)" in text
    fused = run(fused_trap, 2, args=(True,))
    assert all(isinstance(v, float) for v in fused), fused
    sliced = run(function_trap, 2)
    assert all("(weight p.c_attn) is sliced to its features 0:2 of 6, but" in t for t in sliced), (
        sliced
    )


def test_split_qkv_gives_each_rank_its_heads_of_q_k_and_v_and_join_qkv_inverts_it():
    got = run(_split_join, 2)
    w = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)  # q: 0-3, k: 4-7, v: 8-11
    assert np.array_equal(got[0][0], w[:, [0, 1, 4, 5, 8, 9]])
    assert np.array_equal(got[1][0], w[:, [2, 3, 6, 7, 10, 11]])
    for _, joined in got:
        assert np.array_equal(joined, w)


def _split_join():
    comm = spmd.get_communicator()
    with spmd.Mesh(tp=comm.size):
        w = jnp.arange(2 * 12, dtype=jnp.float32).reshape(2, 12)
        mine = spmd.tensor_parallel.split_qkv(w, heads=2)
        return np.asarray(mine), np.asarray(spmd.tensor_parallel.join_qkv(mine))
