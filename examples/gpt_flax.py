"""A GPT-2 written in Flax linen, trained with tensor and data parallelism on one mesh.

    spmd-run -n 4 python examples/gpt_flax.py --mesh dp=2,tp=2 --sequence-parallel
    spmd-run -n 2 python examples/gpt_flax.py --mesh tp=2
    python examples/gpt_flax.py                  # one process: the same model, the same batches

The model is GPT-2's as Flax users write it (a fused ``c_attn`` kernel laid out ``[q|k|v]``,
a tied embedding used again as the output head, LayerNorm before each sublayer), with the
layers that hold weights taken from ``spmd.tensor_parallel.linen`` instead of ``flax.linen``:

    nn.Dense(3 * C, name="c_attn")        ->  tp.ColumnDense(3 * C, fused=3, name="c_attn")
    nn.Dense(C, name="c_proj")            ->  tp.RowDense(C, name="c_proj")
    nn.Embed(V, C, name="wte") / .attend  ->  tp.VocabEmbed(V, C, name="wte") / .attend
    nn.LayerNorm(name="ln_1")             ->  tp.LayerNorm(name="ln_1")

On ``Mesh(dp=.., tp=..)`` each rank holds its heads and MLP columns and its rows of the
vocabulary, and with ``--sequence-parallel`` its part of the sequence between the sublayers.
The model built on N tp ranks holds the blocks of the model one process builds from the same
key, and each step follows the one-process step (tests/test_gpt_flax.py checks 10 Adam steps
against a plain ``flax.linen`` GPT-2). ``--save`` writes the trained weights as one
safetensors file with the dense model's names and shapes (``spmd.checkpoint.save_safetensors``).
"""

from __future__ import annotations

import argparse
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import spmd

tp = spmd.tensor_parallel.linen
CONFIG = {"vocab": 64, "context": 16, "width": 32, "heads": 4, "layers": 2}


class Attention(nn.Module):
    heads: int
    sp: bool  # sequence parallel

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C = x.shape[-1]
        qkv = tp.ColumnDense(3 * C, fused=3, sequence_parallel=self.sp, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        B, T, hd = q.shape[0], q.shape[1], C // self.heads
        q, k, v = (t.reshape(B, T, -1, hd) for t in (q, k, v))  # -1: this rank's heads
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, jnp.finfo(att.dtype).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(B, T, -1)
        return tp.RowDense(C, sequence_parallel=self.sp, name="c_proj")(y)


class MLP(nn.Module):
    sp: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C = x.shape[-1]
        h = nn.gelu(tp.ColumnDense(4 * C, sequence_parallel=self.sp, name="c_fc")(x))
        return tp.RowDense(C, sequence_parallel=self.sp, name="c_proj")(h)


class Block(nn.Module):
    heads: int
    sp: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.heads, self.sp, name="attn")(
            tp.LayerNorm(sequence_parallel=self.sp, name="ln_1")(x)
        )
        return x + MLP(self.sp, name="mlp")(tp.LayerNorm(sequence_parallel=self.sp, name="ln_2")(x))


class GPT(nn.Module):
    vocab: int
    context: int
    width: int
    heads: int
    layers: int
    sp: bool = False

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        wte = tp.VocabEmbed(self.vocab, self.width, sequence_parallel=self.sp, name="wte")
        x = wte(ids) + nn.Embed(self.context, self.width, name="wpe")(jnp.arange(ids.shape[1]))
        if self.sp:  # from here on, this rank's part of the sequence
            x = spmd.tensor_parallel.scatter_to(x, axis=1)
        for i in range(self.layers):
            x = Block(self.heads, self.sp, name=f"h_{i}")(x)
        x = tp.LayerNorm(sequence_parallel=self.sp, name="ln_f")(x)
        return wte.attend(x)  # this rank's columns of the logits (its rows of the vocabulary)


def batches(steps: int, batch: int, seed: int = 0) -> np.ndarray:
    """The global batches, (steps, batch, context + 1) token ids, the same on every rank."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, CONFIG["vocab"], (steps, batch, CONFIG["context"] + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="", help="e.g. dp=2,tp=2 (default: one rank)")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="the global batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save", default="", help="write the weights to this .safetensors file")
    args = ap.parse_args()

    comm = spmd.get_communicator()
    axes = dict((k, int(v)) for k, v in (a.split("=") for a in args.mesh.split(",") if a))
    with spmd.Mesh(dp=axes.get("dp", 1), tp=axes.get("tp", 1)) as mesh:
        model = GPT(**CONFIG, sp=args.sequence_parallel)
        data = batches(args.steps, args.batch)
        params = model.init(jax.random.key(0), jnp.asarray(data[0, :1, :-1]))["params"]
        opt = optax.adam(args.lr)
        opt_state = opt.init(params)

        def loss_fn(p: Any, ids: jax.Array, targets: jax.Array) -> jax.Array:
            logits = model.apply({"params": p}, ids)
            return spmd.tensor_parallel.vocab_cross_entropy(logits, targets).mean()

        @spmd.data_parallel(group="dp")
        def step(p: Any, s: Any, ids: jax.Array, targets: jax.Array) -> Any:
            loss, grads = spmd.value_and_grad(loss_fn)(p, ids, targets)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, spmd.allreduce(loss, "avg", group="dp")

        dp = mesh.group("dp")
        rows = args.batch // dp.size
        for i in range(args.steps):
            mine = jnp.asarray(data[i, dp.rank * rows : (dp.rank + 1) * rows])
            params, opt_state, loss = step(params, opt_state, mine[:, :-1], mine[:, 1:])
            if comm.rank == 0:
                print(f"step {i:3d} loss {float(loss):.9f}", flush=True)
        if args.save:
            spmd.checkpoint.save_safetensors(args.save, spmd.tensor_parallel.sharded(params))
            if comm.rank == 0:
                print(f"saved {args.save}")


if __name__ == "__main__":
    main()
