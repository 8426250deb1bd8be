"""@spmd.data_parallel: parity with one process on the global batch (after every step, SGD and
Adam, 2-4 ranks), bitwise agreement between ranks, buckets, compression, accumulation, no_sync,
the parameter check and the errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

from ._model import (
    assert_close,
    assert_same_everywhere,
    global_batches,
    init_params,
    loss_fn,
    make_step,
    optimizers,
    reference,
)

STEPS = 5


def _train(comm, tx, batches, **options):
    step = make_step(tx, **options)
    params = spmd.broadcast_params(init_params())
    opt_state = tx.init(params)
    history = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, spmd.data.shard_batch(b))
        assert np.isfinite(float(loss))
        history.append(params)
    return history


@multirank(nprocs=(2, 3, 4))
def test_parity_with_one_process(comm):
    batches = global_batches(STEPS, comm.size)
    for name, tx in optimizers().items():
        want = reference(tx, batches)
        for options, rtol in (
            ({}, 1e-5),
            ({"bucket_mb": 0}, 1e-5),
            ({"bucket_mb": 1e-4, "overlap": False}, 1e-5),  # several buckets, after backward
            ({"compression": "bf16"}, 2e-2),
        ):
            got = _train(comm, tx, batches, **options)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_same_everywhere(comm, g)
                assert_close(g, w, rtol, f"{name} {options} step {i + 1}")


@multirank(nprocs=(2, 3))
def test_accumulate_steps_matches_the_global_batch(comm):
    """accumulate_steps=2 splits each local batch in two micro-batches; with a mean loss the
    accumulated gradient is the global batch's."""
    batches = global_batches(STEPS, comm.size)
    tx = optimizers()["adam"]
    want = reference(tx, batches)
    got = _train(comm, tx, batches, accumulate_steps=2)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_everywhere(comm, g)
        assert_close(g, w, 1e-5, f"accumulate_steps=2 step {i + 1}")


@multirank(nprocs=(2, 3))
def test_no_sync_accumulates_locally_then_averages(comm):
    """DDP's no_sync: micro-steps inside it add local gradients; the next call averages the sum.
    With each micro-batch's loss divided by the number of micro-batches, the result is the
    global batch's step."""
    k = 2
    batches = global_batches(STEPS, comm.size)
    tx = optimizers()["sgd"]
    want = reference(tx, batches)

    @spmd.data_parallel
    def step(params, opt_state, batch):
        loss, grads = spmd.value_and_grad(lambda p, b: loss_fn(p, b) / k)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree_util.tree_map(lambda p, u: p + u, params, updates), opt_state, loss

    params = init_params()
    opt_state = tx.init(params)
    for i, b in enumerate(batches):
        x, y = spmd.data.shard_batch(b)
        half = len(x) // k
        with spmd.no_sync():
            step(params, opt_state, (x[:half], y[:half]))  # outputs unused, as with DDP
        params, opt_state, _ = step(params, opt_state, (x[half:], y[half:]))
        assert_same_everywhere(comm, params)
        assert_close(params, want[i], 1e-5, f"no_sync step {i + 1}")


@multirank(nprocs=(1,))
def test_one_rank_is_one_process(comm):
    batches = global_batches(3, 1)
    tx = optimizers()["adam"]
    for g, w in zip(_train(comm, tx, batches), reference(tx, batches), strict=True):
        assert_close(g, w, 1e-6, "one rank")


@multirank(nprocs=(2, 3))
def test_parameters_that_differ_are_named_on_every_rank(comm):
    tx = optimizers()["sgd"]
    step = make_step(tx)
    params = init_params()
    if comm.rank == 1:
        params = dict(params, b1=params["b1"] + 1.0)
    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])
    with pytest.raises(spmd.SpmdError) as e:
        step(params, tx.init(params), batch)
    msg = str(e.value)
    assert f"rank {comm.rank}:" in msg
    assert "ranks [1] hold other values than rank 0" in msg
    assert "params.b1" in msg and "1 of 3 parameter arrays" in msg
    assert "spmd.broadcast_params" in msg
    # broadcast_params repairs it.
    params = spmd.broadcast_params(params)
    step(params, tx.init(params), batch)


@multirank(nprocs=(2,))
def test_broadcast_params_takes_the_roots_state(comm):
    tree = {"a": np.full((3,), comm.rank, np.float32), "b": [np.arange(4) + 10 * comm.rank]}
    out = spmd.broadcast_params(tree, root=1)
    np.testing.assert_array_equal(out["a"], np.ones(3, np.float32))
    np.testing.assert_array_equal(out["b"][0], np.arange(4) + 10)


@multirank(nprocs=(2,))
def test_step_without_spmd_grad_is_an_error(comm):
    @spmd.data_parallel
    def step(params, batch):
        return jax.grad(loss_fn)(params, batch)  # jax.grad: nothing marked

    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])
    with pytest.raises(spmd.SpmdError, match=f"rank {comm.rank}: data_parallel: step computes no"):
        step(init_params(), batch)


def test_bad_options_are_errors():
    with pytest.raises(spmd.SpmdError, match="compression='int3'"):
        spmd.data_parallel(lambda p: p, compression="int3")
    with pytest.raises(spmd.SpmdError, match="accumulate_steps=0"):
        spmd.data_parallel(lambda p: p, accumulate_steps=0)
    with pytest.raises(spmd.SpmdError, match="bucket_mb=-1"):
        spmd.data_parallel(lambda p: p, bucket_mb=-1)


@multirank(nprocs=(2,))
def test_accumulation_errors_name_the_rank(comm):
    tx = optimizers()["sgd"]
    params = init_params()
    x, y = spmd.data.shard_batch(global_batches(1, comm.size)[0])  # 8 rows per rank
    step = make_step(tx, accumulate_steps=3)
    with pytest.raises(spmd.SpmdError, match=f"rank {comm.rank}: .*has 8 rows, which do not split"):
        step(params, tx.init(params), (x, y))
    # no_sync sums belong to one signature: a synced call with other shapes is refused.
    step = make_step(tx)
    with spmd.no_sync():
        step(params, tx.init(params), (x, y))
    with pytest.raises(spmd.SpmdError, match=f"rank {comm.rank}: .*spmd.no_sync\\(\\) belong"):
        step(params, tx.init(params), (x[:4], y[:4]))
