"""Haiku, as its users write it, data parallel: an MLP with batch normalisation on
scikit-learn's 8x8 digits.

    spmd-run -n 2 python examples/haiku_mlp.py

Haiku's ``transform_with_state`` turns the model into two pure functions, ``init`` and
``apply``, over a parameter tree and a state tree (here the batch-norm statistics): nothing to
split or merge. The step is Haiku's usual one with ``spmd.value_and_grad`` in place of
``jax.value_and_grad``; ``@spmd.data_parallel`` averages the parameters' gradients over the
ranks. The batch-norm statistics are each rank's own (of its examples, as in PyTorch DDP without
SyncBatchNorm): the step averages them over the ranks with ``spmd.allreduce`` so that the
replicas stay identical.

Every rank takes its share of the same global batches; rank 0 prints the loss per epoch and
the test accuracy.
"""

from __future__ import annotations

import argparse
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import spmd


def forward(x: jax.Array, is_training: bool) -> jax.Array:
    x = hk.Linear(128)(x)
    x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
    return hk.Linear(10)(jax.nn.relu(x))


model = hk.without_apply_rng(hk.transform_with_state(forward))


def loss_fn(params: Any, state: Any, batch: Any) -> Any:
    logits, state = model.apply(params, state, batch["image"], is_training=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global, over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    comm = spmd.init()
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    n_test = len(images) // 5
    test, train = order[:n_test], order[n_test:]

    params, state = model.init(jax.random.key(comm.rank), images[:1], is_training=True)
    params, state = spmd.broadcast_params((params, state))  # rank 0's initialisation
    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @spmd.data_parallel
    def train_step(params: Any, state: Any, opt_state: Any, batch: Any) -> Any:
        (loss, state), grads = spmd.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
        # The replicas' batch statistics, averaged (the step counter is the same everywhere).
        state = jax.tree_util.tree_map(
            lambda s: spmd.allreduce(s, "avg") if jnp.issubdtype(s.dtype, jnp.floating) else s,
            state,
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    rng = np.random.default_rng(1)
    steps = len(train) // args.batch_size
    for epoch in range(args.epochs):
        shuffled = rng.permutation(train)  # the same global batches on every rank
        losses = []
        for i in range(steps):
            rows = shuffled[i * args.batch_size : (i + 1) * args.batch_size]
            batch = spmd.data.shard_batch({"image": images[rows], "label": labels[rows]})
            params, state, opt_state, loss = train_step(params, state, opt_state, batch)
            losses.append(loss)
        loss = float(spmd.allreduce(jnp.mean(jnp.stack(losses)), "avg"))
        if comm.rank == 0:
            print(f"epoch {epoch + 1}  loss {loss:.5f}")

    logits, _ = model.apply(params, state, jnp.asarray(images[test]), is_training=False)
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == labels[test]))
    if comm.rank == 0:
        print(f"test accuracy {accuracy:.4f} on {n_test} images ({comm.size} ranks)")
    spmd.finalize()


if __name__ == "__main__":
    main()
