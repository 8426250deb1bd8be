"""Data-parallel training on a real dataset: scikit-learn's handwritten digits (8x8 images,
shipped inside the scikit-learn package, nothing downloaded).

    spmd-run -n 2 python examples/train_digits.py

Every rank runs this same program. spmd.broadcast_params starts all replicas from rank 0's
parameters; the DistributedSampler gives each rank its own part of every epoch; the step is an
ordinary JAX training step under @spmd.data_parallel, which averages the gradients over the
ranks (run with --trace to print the op list with the allreduces it inserted). With --zero 1|2|3
the same step runs under @spmd.zero_shard instead: each rank keeps 1/N of the optimizer state
(and of the gradients, and of the parameters). Rank 0 shows the progress, the loss per epoch and
the test accuracy; all ranks write a checkpoint with spmd.save (loadable on any world size).

With --elastic DIR it checkpoints every epoch and resumes from the newest checkpoint there, so
that ``spmd-run --max-restarts 2 -n 2 python examples/train_digits.py --elastic ck/elastic``
survives a rank that dies: the job is started again and goes on from the last epoch it saved.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import spmd


def init_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m),
            "b": jnp.zeros((n,)),
        }
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def predict(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--checkpoint", default="checkpoints/digits")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage (0: plain data parallel)")  # fmt: skip
    parser.add_argument("--trace", action="store_true", help="print the step's op list")
    parser.add_argument("--elastic", metavar="DIR",
                        help="checkpoint every epoch to DIR and resume from the newest there (for "
                        "spmd-run --max-restarts)")  # fmt: skip
    args = parser.parse_args()

    comm = spmd.init()
    main_rank = comm.rank == 0

    # The same split on every rank: 80% train, 20% test.
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]

    params = spmd.broadcast_params(init_params(jax.random.key(comm.rank), [64, args.hidden, 10]))
    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if args.zero:
        train_step = spmd.zero_shard(step, stage=args.zero)
        params, opt_state = train_step.shard(params, opt_state)
    else:
        train_step = spmd.data_parallel(step)

    sampler = spmd.data.DistributedSampler(len(train), shuffle=True, seed=0, drop_last=True)
    if args.trace and main_rank:
        first = train[next(sampler.batches(args.batch_size))]
        print(spmd.trace(train_step)(params, opt_state, (x[first], y[first])))

    first = 0
    if args.elastic:  # a restarted job goes on from its newest checkpoint, at any world size
        like = {"params": params, "opt_state": opt_state}
        state, first, _ = spmd.elastic.resume(args.elastic, like=like)
        params, opt_state = state["params"], state["opt_state"]

    start = time.perf_counter()
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        batches = sampler.batches(args.batch_size, drop_last=True)
        steps = len(sampler) // args.batch_size
        bar = tqdm(batches, total=steps, desc=f"epoch {epoch + 1}", disable=not main_rank,
                   leave=False)  # fmt: skip
        for idx in bar:
            rows = train[idx]
            params, opt_state, loss = train_step(params, opt_state, (x[rows], y[rows]))
            losses.append(loss)
        # Each rank saw its own batches: average the epoch's loss over the ranks.
        epoch_loss = float(spmd.allreduce(jnp.mean(jnp.stack(losses)), "avg"))
        if main_rank:
            tqdm.write(f"epoch {epoch + 1:2d}  loss {epoch_loss:.4f}")
        if args.elastic:
            state = {"params": params, "opt_state": opt_state}
            spmd.elastic.save(args.elastic, epoch + 1, state)

    # The replicas are identical, so every rank computes the same test accuracy (at ZeRO stage 3
    # each rank holds a shard of the parameters: gather them first).
    correct = jnp.argmax(predict(spmd.gather(params), x[test]), axis=-1) == y[test]
    accuracy = float(jnp.mean(correct))
    if main_rank:
        elapsed = time.perf_counter() - start
        print(f"test accuracy {accuracy:.4f} on {n_test} images after {args.epochs} epochs "
              f"({comm.size} ranks, {elapsed:.1f} s)")  # fmt: skip
    # Every rank writes its shards (replicated arrays are written once); spmd.load reads the
    # checkpoint back on any number of ranks, in any layout.
    path = pathlib.Path(args.checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    spmd.save(path, {"params": params, "opt_state": opt_state},
              metadata={"epochs": args.epochs, "sampler": sampler.state_dict()})  # fmt: skip
    if main_rank:
        print(f"checkpoint written to {path}")
    spmd.finalize()


if __name__ == "__main__":
    main()
