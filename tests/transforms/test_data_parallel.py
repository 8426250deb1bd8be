"""@spmd.data_parallel: parity with one process on the global batch (after every step, SGD and
Adam, 2-4 ranks), bitwise agreement between ranks, buckets, compression, accumulation, no_sync,
the parameter check and the errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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


def _every_dtype(r):
    return {
        "key": jax.random.key(r),
        "rbg": jax.random.key(r, impl="rbg"),
        "raw": jax.random.PRNGKey(r + 100),
        "i16": jnp.arange(3, dtype=jnp.int16) - 7 * r,
        "u32": jnp.array([2**32 - 1 - r, 2**24 + 1 + r], jnp.uint32),
        "u16": jnp.array([[60000 + r]], jnp.uint16),
        "c64": jnp.array([1.5 - 0.25j * (r + 1), r]),
        "f8": jnp.array([0.5 * (r + 1)], jnp.float8_e4m3fn),
        "i4": jnp.array([-8, 7 - r], jnp.int4),
        "u4": jnp.array([15 - r], jnp.uint4),
        "f4": jnp.array([0.5 * (r + 1), -6.0], jnp.float4_e2m1fn),
        "f32": jnp.float32(r),
    }


def _bits(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), _bits(jax.random.key_data(x))
    return str(x.dtype), x.shape, np.asarray(x).tobytes()


@multirank(nprocs=(2, 3))
def test_broadcast_params_moves_every_dtype_bit_for_bit(comm):
    """PRNG keys (typed, of two implementations, and raw uint32), and dtypes the collectives do
    not take (int16, uint16, uint32 beyond float32's range, complex, float8, 4-bit types)
    arrive as the root holds them; they were refused, with the lossy advice to cast them to
    float32."""
    root = comm.size - 1
    out = spmd.broadcast_params(_every_dtype(comm.rank), root=root)
    want = _every_dtype(root)
    assert sorted(out) == sorted(want)
    for name in want:
        assert _bits(out[name]) == _bits(want[name]), name
    # The collectives themselves refuse them with advice that loses nothing.
    with pytest.raises(spmd.SpmdError, match=r"dtype uint32; .*bitcast_convert_type"):
        spmd.broadcast(want["u32"])
    with pytest.raises(spmd.SpmdError, match=r"dtype key<fry>, .*key_data"):
        spmd.allgather(want["key"])
    # A leaf that is not an array (an activation function in a model object) is named.
    with pytest.raises(spmd.SpmdTypeError, match=r"\['act'\] is a custom_jvp, not an array"):
        spmd.broadcast_params({"w": jnp.ones(2), "act": jax.nn.relu})


@multirank(nprocs=(2,))
def test_broadcast_params_takes_the_roots_state(comm):
    tree = {"a": np.full((3,), comm.rank, np.float32), "b": [np.arange(4) + 10 * comm.rank]}
    out = spmd.broadcast_params(tree, root=1)
    np.testing.assert_array_equal(out["a"], np.ones(3, np.float32))
    np.testing.assert_array_equal(out["b"][0], np.arange(4) + 10)
    # A ShardedArray holds a different shard on each rank: broadcasting rank 1's over rank 0's
    # would corrupt it silently.
    sharded = {"w": spmd.shard(jnp.arange(8.0), spmd.PartitionSpec("dp"), mesh=spmd.Mesh(dp=2))}
    with pytest.raises(spmd.SpmdError, match=r"broadcast_params: \['w'\] is a ShardedArray"):
        spmd.broadcast_params(sharded)


@multirank(nprocs=(2,))
def test_misuse_is_a_clear_error_not_a_silent_divergence(comm):
    params = init_params()
    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])

    def grads(p, b):
        return spmd.grad(loss_fn)(p, b)

    # Under jax.jit the step's Python state (no_sync accumulator, replica check) would freeze.
    step = spmd.data_parallel(grads)
    with pytest.raises(spmd.SpmdError, match=r"data_parallel\(grads\): called inside a JAX"):
        jax.jit(step)(params, batch)
    with pytest.raises(spmd.SpmdError, match=r"zero_shard\(grads\): called inside a JAX"):
        jax.jit(spmd.zero_shard(grads, stage=1))(params, batch)
    assert step(params, batch)["w1"].shape == params["w1"].shape  # called directly: fine
    # Complex gradients are not compressed: refused like any complex collective, never cast.
    cstep = spmd.data_parallel(
        lambda p: spmd.grad(lambda q: jnp.abs(jnp.sum(q * q)))(p), compression="bf16"
    )
    with pytest.raises(spmd.SpmdError, match="complex64"):
        cstep(jnp.asarray([1 + 2j, 3 - 1j], jnp.complex64))

    # Parameters JAX cannot differentiate or take: the leaf is named (it was JAX's TypeError).
    def count_step(p, b):
        return spmd.grad(lambda q: loss_fn(q["net"], b) * q["n"])(p)

    with pytest.raises(spmd.SpmdTypeError, match=r"argument 0\['n'\] .* is a scalar of int32; "
                       r"gradients are taken with respect to floating-point"):  # fmt: skip
        spmd.data_parallel(count_step)({"net": params, "n": jnp.int32(2)}, batch)
    # A string is static (compiled for its value), so it reaches the gradient call, which
    # names it.
    with pytest.raises(spmd.SpmdTypeError, match=r"argument 0\['n'\] .* is a str; gradients"):
        spmd.data_parallel(count_step)({"net": params, "n": "two"}, batch)
    # The same parameter as a float works.
    g = spmd.data_parallel(count_step)({"net": params, "n": jnp.float32(2)}, batch)
    assert g["n"].shape == () and np.isfinite(float(g["n"]))
    # A partial as the loss: a bad argnums names it (it raised AttributeError).
    with pytest.raises(spmd.SpmdError, match=r"argnums=3 but functools\.partial"):
        spmd.data_parallel(lambda p: spmd.grad(functools.partial(loss_fn), argnums=3)(p, batch))(
            params
        )


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


@multirank(nprocs=(2, 3))
def test_unusual_gradients_and_arguments(comm):
    """Gradients that are constants (an unused scalar: 0; a scalar added to the loss: 1),
    integer parameters under allow_int (float0 gradients) with accumulate_steps and no_sync,
    a non-array keyword argument passed through to the loss, and argnums counted from the
    end: each gives jax's gradient on the global batch, on every rank."""
    import jax.numpy as jnp

    n, r = comm.size, comm.rank
    xs = np.random.default_rng(0).standard_normal((4 * n, 3)).astype(np.float32)
    mine = spmd.data.shard_batch(xs)

    def loss(p, x, mode="train"):
        scale = 1.0 if mode == "train" else 0.0
        return scale * jnp.mean(x @ p["w"]) ** 2 + p["bias"] + 0.0 * p["ids"].sum()

    p = {"w": jnp.arange(3.0), "bias": jnp.float32(0.5), "unused": jnp.float32(2.0),
         "ids": jnp.arange(3)}  # fmt: skip

    def want_w(k):  # the mean of the gradients of the n * k micro-batches (the loss is not linear)
        rows = len(xs) // (n * k)
        parts = [jax.grad(loss, allow_int=True)(p, xs[j * rows : (j + 1) * rows])["w"]
                 for j in range(n * k)]  # fmt: skip
        return np.mean(parts, axis=0)

    for k, nosync in ((1, False), (2, False), (1, True)):

        @spmd.data_parallel(accumulate_steps=k)
        def step(p, x):
            return spmd.grad(loss, allow_int=True)(p, x, mode="train")

        if nosync:
            with spmd.no_sync():
                step(p, mine)
        g = step(p, mine)
        assert_same_everywhere(comm, {"w": g["w"], "bias": g["bias"], "unused": g["unused"]})
        assert g["ids"].dtype == jax.dtypes.float0
        times = 2 if nosync else 1  # no_sync: the sum of the micro-steps' gradients
        np.testing.assert_allclose(g["w"], times * want_w(k), rtol=1e-5)
        assert float(g["bias"]) == times and float(g["unused"]) == 0.0

    def last():
        return spmd.data_parallel(accumulate_steps=2)(
            lambda x, w: spmd.grad(lambda x, w: jnp.mean((x @ w) ** 2), argnums=-1)(x, w)
        )

    want = jax.grad(lambda w: jnp.mean((xs @ w) ** 2))(jnp.arange(3.0))
    np.testing.assert_allclose(last()(mine, jnp.arange(3.0)), want, rtol=1e-5)
    # The parameter (the last argument) is checked across ranks, not split into micro-batches.
    with pytest.raises(spmd.SpmdError, match="hold other values"):
        last()(mine, jnp.arange(3.0) + r)


@multirank(nprocs=(2,))
def test_parameter_check_edge_cases(comm):
    """-0.0 and 0.0 are equal parameters; ranks holding different numbers of parameter arrays
    get an SpmdError naming the counts, not a crash."""
    import jax.numpy as jnp

    r = comm.rank

    def step():  # the check runs on a step's first call: a fresh step for each case
        return spmd.data_parallel(
            lambda p, x: spmd.grad(lambda p, x: sum(jnp.sum(v * x) for v in jax.tree.leaves(p)))(
                p, x
            )
        )

    zeros = {"w": jnp.array([-0.0 if r == 1 else 0.0, 1.0, 2.0])}
    np.testing.assert_array_equal(step()(zeros, jnp.ones(3))["w"], np.ones(3))
    p = {"w": jnp.ones(3)}
    if r == 1:
        p["extra"] = jnp.ones(3)
    with pytest.raises(spmd.SpmdError, match=r"different numbers of parameter arrays \(rank: "
                       r"count \{0: 1, 1: 2\}\)"):  # fmt: skip
        step()(p, jnp.ones(3))


@multirank(nprocs=(2,))
def test_accumulated_aux_is_the_whole_batch_s(comm):
    """With accumulate_steps=k, has_aux outputs come back as the loss gives them on the whole
    local batch: per-example values (a leading dimension k times larger on the whole batch) end
    to end, not averaged over micro-batches; other floating values averaged (also one whose
    length happens to equal a micro-batch's rows); integers the last micro-batch's."""
    import jax.numpy as jnp

    x = np.random.default_rng(comm.rank).standard_normal((8, 3)).astype(np.float32)
    w = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)

    def loss(w, x):
        pred = x @ w
        # "pair" has as many entries as a micro-batch of 8 // 4 rows: not per-example.
        pair = jnp.stack([jnp.mean(pred), jnp.mean(pred**2)])
        aux = {"pred": pred, "mean": jnp.mean(pred), "rows": x.shape[0], "pair": pair}
        return jnp.mean(pred**2), aux

    for k in (1, 2, 4):
        step = spmd.data_parallel(accumulate_steps=k)(
            lambda w, x: spmd.value_and_grad(loss, has_aux=True)(w, x)
        )
        (_, aux), _ = step(w, x)
        np.testing.assert_allclose(aux["pred"], x @ np.asarray(w), rtol=1e-6, err_msg=str(k))
        np.testing.assert_allclose(aux["mean"], np.mean(x @ np.asarray(w)), rtol=1e-5)
        assert int(aux["rows"]) == 8 // k
        full = x @ np.asarray(w)
        np.testing.assert_allclose(aux["pair"], [full.mean(), (full**2).mean()], rtol=1e-5)


@multirank(nprocs=(2,))
def test_vmapped_grad_ensembles_and_per_example_gradients(comm):
    """A vmapped spmd.grad is averaged across ranks index by index: right for an ensemble
    (batched parameters: no warning), and a warning for per-example gradients (unbatched
    parameters). The documented DP-SGD recipe (clipping weights from jax.vmap(jax.grad), then
    spmd.grad of the weighted loss) gives the clipped mean of the global batch."""
    import warnings

    import jax.numpy as jnp

    n, r = comm.size, comm.rank
    xs = np.random.default_rng(3).standard_normal((4 * n, 3)).astype(np.float32)
    mine = jnp.asarray(spmd.data.shard_batch(xs))
    p = {"w": jnp.asarray([0.5, -1.0, 2.0]), "b": jnp.float32(0.25)}

    def one(p, x):  # the loss of one example
        return (x @ p["w"] + p["b"]) ** 2

    def mean_loss(p, x):
        return jnp.mean(jax.vmap(one, in_axes=(None, 0))(p, x))

    # An ensemble of 3 members: each member's gradient is its global-batch gradient.
    members = {"w": p["w"] * jnp.arange(1.0, 4.0)[:, None], "b": jnp.arange(3.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = spmd.data_parallel(lambda m, x: jax.vmap(spmd.grad(mean_loss), (0, None))(m, x))(
            members, mine
        )
    want = jax.vmap(jax.grad(mean_loss), (0, None))(members, jnp.asarray(xs))
    for k in ("w", "b"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)

    # Per-example gradients through spmd.grad: warned about.
    with pytest.warns(spmd.PerExampleGradientWarning, match=f"rank {r}: spmd.grad is called under"):
        spmd.data_parallel(lambda p, x: jax.vmap(spmd.grad(one), (None, 0))(p, x))(p, mine)
    # Each vmap level is judged on its own: per-example gradients inside an ensemble's vmap...
    per_member = jax.vmap(lambda q, x: jax.vmap(spmd.grad(one), (None, 0))(q, x), (0, None))
    with pytest.warns(spmd.PerExampleGradientWarning):
        spmd.data_parallel(per_member)(members, mine)
    # ...and with respect to the (batched) examples as well as the (unbatched) parameters (the
    # examples then count as parameters, which differ between ranks).
    both = jax.vmap(spmd.grad(one, (0, 1)), (None, 0))
    with pytest.warns(spmd.PerExampleGradientWarning):
        spmd.data_parallel(check_params=False)(both)(p, mine)

    # The recipe: clipped per-example gradients, their mean over the global batch.
    clip = 1.0

    def clipped(p, x):
        per = jax.vmap(jax.grad(one), (None, 0))(p, x)
        norms = jnp.sqrt(jnp.sum(per["w"] ** 2, 1) + per["b"] ** 2)
        weights = jax.lax.stop_gradient(jnp.minimum(1.0, clip / norms))
        return spmd.grad(lambda q: jnp.mean(weights * jax.vmap(one, (None, 0))(q, x)))(p)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = spmd.data_parallel(clipped)(p, mine)
    per = jax.vmap(jax.grad(one), (None, 0))(p, jnp.asarray(xs))
    norms = np.sqrt(np.sum(np.asarray(per["w"]) ** 2, 1) + np.asarray(per["b"]) ** 2)
    assert (norms > clip).sum() >= 2  # clipping is active on some examples
    scale = np.minimum(1.0, clip / norms)
    np.testing.assert_allclose(got["w"], np.mean(scale[:, None] * per["w"], 0), rtol=1e-5)
    np.testing.assert_allclose(got["b"], np.mean(scale * per["b"]), rtol=1e-5)


@multirank(nprocs=(2,))
def test_a_step_whose_results_ignore_its_gradients_is_refused(comm):
    """A step that updates plain Python objects in place (returning nothing or only the loss)
    trained nothing without a word: the updates made inside the trace are lost. Every rank
    refuses the step, saying how to write it; a step that returns the update runs. (NNX objects
    updated in place are supported: test_frameworks.py.)"""
    import optax

    tx = optax.sgd(0.1)
    p = {"w": jnp.ones(3)}
    state = tx.init(p)
    kept = {}

    def loss(p, x):
        return jnp.sum((p["w"] * x) ** 2)

    def in_place(p, s, x):
        value, g = spmd.value_and_grad(loss)(p, x)
        kept["p"] = optax.apply_updates(p, tx.update(g, s, p)[0])  # lost with the trace
        return value

    def nothing(p, s, x):
        spmd.value_and_grad(loss)(p, x)

    x = jnp.full(3, comm.rank + 1.0)
    for transform in (spmd.data_parallel, functools.partial(spmd.zero_shard, stage=1)):
        for step in (in_place, nothing):
            with pytest.raises(spmd.SpmdError) as info:
                transform(step)(p, state, x)
            text = str(info.value)
            assert text.startswith(f"rank {comm.rank}: "), text
            assert f"({step.__name__}): none of the step's results depends on the gradients" in text
            assert "Flax NNX objects" in text and "optax.apply_updates" in text

    def pure(p, s, x):
        value, g = spmd.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    new, _, value = spmd.data_parallel(pure)(p, state, x)
    assert float(value) == 3 * (comm.rank + 1) ** 2  # this rank's loss
    # The mean gradient over the two ranks' x = 1 and 2: 2 * w * x^2 averaged = 5.
    np.testing.assert_allclose(new["w"], 1 - 0.1 * 5.0, rtol=1e-6)


@multirank(nprocs=(2,))
def test_a_pmean_left_from_pmap_is_an_error_that_says_what_to_do(comm):
    """A step ported from pmap with its jax.lax.pmean(grads, "batch") left in: an SpmdError on
    every rank naming the axis and saying to remove it (JAX's NameError pointed to shard_map);
    a psum over a made-up axis in spmd.check too."""

    @spmd.data_parallel
    def step(w, x):
        loss, g = spmd.value_and_grad(lambda w: jnp.sum(w * x))(w)
        return loss, w - jax.lax.pmean(g, "batch")

    with pytest.raises(spmd.SpmdError) as info:
        step(jnp.ones(2), jnp.ones(2))
    text = str(info.value)
    assert text.startswith(f"rank {comm.rank}: a collective over the named axis 'batch'"), text
    assert "already averaged over the group: remove the jax.lax.pmean of them" in text
    assert "spmd.allreduce(x, 'avg')" in text and "docs/pmap.md" in text
    with pytest.raises(spmd.SpmdError, match="named axis 'i'"):
        spmd.check(lambda v: jax.lax.psum(v, "i"), jnp.ones(2))
