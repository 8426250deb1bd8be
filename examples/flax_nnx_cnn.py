"""Flax NNX's MNIST tutorial, as its users write it, data parallel: scikit-learn's 8x8 digits.

    spmd-run -n 2 python examples/flax_nnx_cnn.py

The model, the ``nnx.Optimizer`` and the ``nnx.MultiMetric`` are NNX objects, and the training
step updates them in place and returns nothing, exactly as in Flax's tutorial. Two lines differ:
``@spmd.data_parallel`` in place of ``@nnx.jit``, and ``spmd.value_and_grad`` in place of
``nnx.value_and_grad`` (so that the transform finds the gradients and averages them over the
ranks). spmd splits the NNX objects into their state at the step's boundary and writes the new
state back after each call, as ``nnx.jit`` does.

Every rank takes its share of the same global batches, so the run follows one process's step
for step (the metrics each rank keeps are of its own examples: they are averaged over the ranks
for printing). Rank 0 prints the loss per epoch and the test accuracy.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import spmd


class CNN(nnx.Module):
    """The tutorial's CNN, for 8x8 images."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model: CNN, batch: dict[str, jax.Array]) -> Any:
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


@spmd.data_parallel  # the tutorial: @nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: Any) -> None:
    grad_fn = spmd.value_and_grad(loss_fn, has_aux=True)  # the tutorial: nnx.value_and_grad
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global, over all ranks")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()

    comm = spmd.init()
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (n, 8, 8, 1)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    n_test = len(images) // 5
    test, train = order[:n_test], order[n_test:]

    model = CNN(rngs=nnx.Rngs(0))
    spmd.broadcast_params(model)  # every replica starts from rank 0's model (in place)
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    rng = np.random.default_rng(1)
    steps = len(train) // args.batch_size
    for epoch in range(args.epochs):
        shuffled = rng.permutation(train)  # the same global batches on every rank
        for i in range(steps):
            rows = shuffled[i * args.batch_size : (i + 1) * args.batch_size]
            batch = {"image": images[rows], "label": labels[rows]}
            train_step(model, optimizer, metrics, spmd.data.shard_batch(batch))
        # Each rank's metrics are of its own examples: average them over the ranks.
        local = metrics.compute()
        loss = float(spmd.allreduce(local["loss"], "avg"))
        accuracy = float(spmd.allreduce(local["accuracy"], "avg"))
        metrics.reset()
        if comm.rank == 0:
            print(f"epoch {epoch + 1}  loss {loss:.5f}  train accuracy {accuracy:.4f}")

    logits = model(jnp.asarray(images[test]))  # the same model on every rank
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == labels[test]))
    if comm.rank == 0:
        print(f"test accuracy {accuracy:.4f} on {n_test} images ({comm.size} ranks)")
    spmd.finalize()


if __name__ == "__main__":
    main()
