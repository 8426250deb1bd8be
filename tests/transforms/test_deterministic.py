"""data_parallel(deterministic=True): the same bits at any group size that divides the shard
count, and over any transport; close to one process's plain gradient; its errors."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.testing import multirank, run

BATCH = 64


def _problem():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (13, 33)) * 0.3, "b1": jnp.zeros(33),
              "w2": jax.random.normal(k[1], (33, 5)) * 0.3, "b2": jnp.zeros(5)}  # fmt: skip
    x = jax.random.normal(k[2], (BATCH, 13))
    y = jax.random.randint(k[3], (BATCH,), 0, 5)
    return params, x, y


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()


def train(deterministic: bool = True) -> tuple[str, list[np.ndarray], float]:
    """Five Adam steps on rank r's consecutive part of the global batch: a digest of the
    parameters' and the last loss's bits, the parameters, and the loss."""
    comm = spmd.init()
    n, r = comm.size, comm.rank
    params, x, y = _problem()
    tx = optax.adam(1e-2)

    @spmd.data_parallel(deterministic=deterministic, shards=8)
    def step(p, s, x, y):
        value, g = spmd.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    mine = slice(BATCH // n * r, BATCH // n * (r + 1))
    p, s = params, tx.init(params)
    for _ in range(5):
        p, s, value = step(p, s, x[mine], y[mine])
    leaves = [np.asarray(a) for a in jax.tree.leaves(p)]
    blob = b"".join(a.tobytes() for a in leaves) + np.asarray(value).tobytes()
    return hashlib.sha256(blob).hexdigest(), leaves, float(value)


def test_the_same_bits_at_1_2_and_4_ranks_and_over_every_transport():
    runs = {
        "1 rank": run(train, 1),
        "2 ranks, shm": run(train, 2),
        "2 ranks, mpi": run(train, 2, env={"SPMD_TRANSPORT": "mpi"}),
        "4 ranks, shm": run(train, 4),
        "4 ranks, hier over 2 nodes": run(train, 4, env={"SPMD_SIMULATE_NODES": "2"}),
    }
    digests = {name: {d for d, _, _ in results} for name, results in runs.items()}
    assert all(len(d) == 1 for d in digests.values()), digests  # every rank alike
    assert len(set.union(*digests.values())) == 1, digests  # and every layout

    # What it computes: five Adam steps on the global batch's mean gradient, as one process
    # computes it (to rounding: the shards are summed in another order).
    params, x, y = _problem()
    tx = optax.adam(1e-2)
    p, s = params, tx.init(params)
    for _ in range(5):
        value, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    _, leaves, last = runs["1 rank"][0]
    for a, b in zip(leaves, jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
    assert last == pytest.approx(float(value), rel=1e-5)


@multirank(nprocs=(2,))
def test_deterministic_errors(comm):
    with pytest.raises(spmd.SpmdError, match=r"shards=3\) on a group of 2 ranks: the shard count"):

        @spmd.data_parallel(deterministic=True, shards=3)
        def odd(w, x):
            return spmd.grad(lambda w, x: jnp.sum(w * x))(w, x)

        odd(jnp.ones(2), jnp.ones((6, 2)))
    with pytest.raises(spmd.SpmdError, match="pass neither compression"):
        spmd.data_parallel(lambda w: w, deterministic=True, compression="bf16")
    with pytest.raises(spmd.SpmdError, match=r"4 per rank of 2\).*has 6 rows"):

        @spmd.data_parallel(deterministic=True, shards=8)
        def short(w, x):
            return spmd.grad(lambda w, x: jnp.sum(w * x))(w, x)

        short(jnp.ones(2), jnp.ones((6, 2)))
