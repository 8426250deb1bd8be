"""Tensor, expert and data parallelism on one mesh: a small transformer with a mixture of experts.

    spmd-run -n 4 python examples/train_moe.py --mesh dp=2,tp=2
    spmd-run -n 4 python examples/train_moe.py --mesh dp=2,ep=2
    python examples/train_moe.py                 # one process: the same model, the same batches

The data ship with scikit-learn: each 8x8 handwritten digit is read as a sequence of 8 tokens
(its rows). The model embeds them, runs one transformer block whose attention and MLP are
tensor-parallel over the ``tp`` axis (Megatron's column- and row-parallel layers), then a
mixture-of-experts layer whose E experts are split over the ranks that hold different data (the
``dp`` and ``ep`` axes), and classifies the mean token.

Every rank builds the full parameters from one seed and keeps its blocks (ShardedArrays);
``@spmd.data_parallel`` averages the gradients over the data axes, each expert block only with
the ranks that hold the same experts. Every rank draws the same global batch and takes its
rows: a run on any mesh follows the one-process run step for step (up to rounding). Rank 0
prints the loss per step, the experts' load, and the test accuracy.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import spmd

P = spmd.PartitionSpec
tp = spmd.tensor_parallel
DATA = ("dp", "ep")  # the axes whose ranks hold different examples (and different experts)
SEQ, PIXELS, CLASSES = 8, 8, 10


def init_params(key: jax.Array, d: int, heads: int, hidden: int, experts: int) -> Any:
    k = iter(jax.random.split(key, 12))

    def dense(m: int, n: int) -> jax.Array:
        return jax.random.normal(next(k), (m, n)) * (1.0 / np.sqrt(m))

    return {
        "embed": dense(PIXELS, d), "pos": jax.random.normal(next(k), (SEQ, d)) * 0.1,
        "wq": dense(d, d), "wk": dense(d, d), "wv": dense(d, d), "wo": dense(d, d),
        "w1": dense(d, hidden), "b1": jnp.zeros(hidden), "w2": dense(hidden, d),
        "b2": jnp.zeros(d), "router": dense(d, experts) * 0.1,
        "experts": {
            "w1": jax.random.normal(next(k), (experts, d, hidden)) / np.sqrt(d),
            "w2": jax.random.normal(next(k), (experts, hidden, d)) / np.sqrt(hidden),
        },
        "head": dense(d, CLASSES),
    }  # fmt: skip


# How each parameter is split: attention heads and MLP columns over tp, experts over the data
# axes; the rest is replicated.
SPECS = {
    "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
    "w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None),
}  # fmt: skip


def place(params: Any) -> Any:
    """This rank's blocks, as ShardedArrays (the rest stays replicated)."""
    out = dict(params)
    out.update(tp.shard_params({k: params[k] for k in SPECS}, SPECS))
    out["experts"] = spmd.moe.shard_experts(params["experts"], group=DATA)
    return out


def expert_fn(p: Any, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def attention(p: Any, x: jax.Array, heads: int) -> jax.Array:
    local_heads = heads // spmd.current_mesh().shape["tp"]
    q, k, v = (tp.column_linear(x, p[w]) for w in ("wq", "wk", "wv"))

    def split(t: jax.Array) -> jax.Array:  # (B, S, h * hd) -> (B, h, S, hd)
        return t.reshape(*t.shape[:2], local_heads, -1).transpose(0, 2, 1, 3)

    q, k, v = split(q), split(k), split(v)
    w = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), axis=-1)
    o = (w @ v).transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1)
    return tp.row_linear(o, p["wo"])


def forward(p: Any, x: jax.Array, heads: int, k: int) -> tuple[jax.Array, jax.Array, Any]:
    h = x @ p["embed"] + p["pos"]
    h = h + attention(p, norm(h), heads)
    h = h + tp.row_linear(jax.nn.gelu(tp.column_linear(norm(h), p["w1"], p["b1"])), p["w2"],
                          p["b2"])  # fmt: skip
    routed = norm(h)
    moe_out, aux = spmd.moe.moe(routed, p["router"], expert_fn, p["experts"], k=k, group=DATA)
    h = h + moe_out
    return h.mean(1) @ p["head"], aux, routed


def load_expert_counts(p: Any, x: jax.Array, k: int) -> jax.Array:
    """How many of this rank's token assignments each expert received (for the printout)."""
    logits = (x @ p["router"]).reshape(-1, p["router"].shape[1])
    return jnp.bincount(spmd.moe.route(logits, k).experts.reshape(-1), length=logits.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="", help="axis sizes, e.g. dp=2,tp=2 (default: one rank)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--k", type=int, default=2, help="experts per token")
    ap.add_argument("--aux-weight", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--print-every", type=int, default=10)
    args = ap.parse_args()

    axes = {"dp": 1, "ep": 1, "tp": 1}
    for part in filter(None, args.mesh.split(",")):
        name, _, size = part.partition("=")
        if name not in axes:
            ap.error(f"--mesh: unknown axis {name!r}; use dp, ep and tp")
        axes[name] = int(size)
    mesh = spmd.Mesh(**axes)
    comm = spmd.get_communicator()
    d, heads, hidden = 32, 4, 64
    x_all, y_all = load_digits(return_X_y=True)
    x_all = (x_all / 16.0).astype(np.float32).reshape(-1, SEQ, PIXELS)
    n_train = 1500
    tx = optax.adam(args.lr)

    with mesh:
        data_ranks, me = mesh.group(DATA).size, mesh.index(DATA)
        if args.batch % data_ranks:
            ap.error(f"--batch {args.batch} does not split over {data_ranks} data-parallel ranks")
        rows = args.batch // data_ranks

        def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
            logits, aux, _ = forward(p, x, heads, args.k)
            task = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return task + args.aux_weight * aux, task

        @spmd.data_parallel(group=DATA)
        def step(p: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
            (_, task), g = spmd.value_and_grad(loss_fn, has_aux=True)(p, x, y)
            updates, state = tx.update(g, state, p)
            return optax.apply_updates(p, updates), state, spmd.allreduce(task, "avg",
                                                                          group=DATA)  # fmt: skip

        params = place(init_params(jax.random.key(0), d, heads, hidden, args.experts))
        state = tx.init(params)
        rng = np.random.default_rng(0)
        for i in range(1, args.steps + 1):
            pick = rng.choice(n_train, args.batch, replace=False)[me * rows : (me + 1) * rows]
            params, state, loss = step(params, state, x_all[pick], y_all[pick])
            if comm.rank == 0 and (i % args.print_every == 0 or i <= 5):
                print(f"step {i:4d}  loss {float(loss):.6f}", flush=True)

        # Test accuracy over the held-out digits, each data rank scoring an equal share (an MoE
        # layer routes the same number of tokens on every rank of its group): the last share is
        # padded with copies of the first digit, which are not scored.
        test_x, test_y = x_all[n_train:], y_all[n_train:]
        share = -(-len(test_x) // data_ranks)
        pad = share * data_ranks - len(test_x)
        test_x = np.concatenate([test_x, np.repeat(test_x[:1], pad, axis=0)])
        test_y = np.concatenate([test_y, np.full(pad, -1, test_y.dtype)])  # never predicted
        mine = slice(me * share, (me + 1) * share)
        logits, _, routed = jax.jit(lambda p, x: forward(p, x, heads, args.k))(params, test_x[mine])
        right = spmd.allreduce(jnp.sum(logits.argmax(-1) == test_y[mine]), group=DATA)
        load = spmd.allreduce(load_expert_counts(params, routed, args.k), group=DATA)
        if comm.rank == 0:
            print(f"expert load (test tokens per expert): {np.asarray(load).tolist()}")
            print(f"test accuracy {int(right) / (len(test_x) - pad):.3f}")


if __name__ == "__main__":
    main()
