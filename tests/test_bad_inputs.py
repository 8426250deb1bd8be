"""A catalogue of bad inputs, in one place: each is a clear spmd.SpmdError on every rank of a
2-rank job, whose message starts with the rank and names what was received or expected, and the
group still works afterwards (nothing hangs, nothing is left half done)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from spmd.testing import multirank


def _cases(r: int) -> dict[str, tuple[object, str]]:
    """name: (a call that must fail, a fragment its message must hold)."""
    x = jnp.ones((4, 6), jnp.float32)

    def step_without_grad(w, b):
        return w * b

    def grad_step(w, b):
        return spmd.grad(lambda w, b: jnp.sum(w * b))(w, b)

    return {
        "unknown reduction": (lambda: spmd.allreduce(x, op="mean"), "op='mean'"),
        "object array": (lambda: spmd.allreduce(np.array([object()])), "object"),
        "a string": (lambda: spmd.allreduce("abc"), "str"),
        "complex dtype": (lambda: spmd.allreduce(jnp.ones(2, jnp.complex64)), "complex64"),
        "unknown codec": (lambda: spmd.allreduce(x, quantize="fp16"), "quantize='fp16'"),
        "unknown compression": (lambda: spmd.allreduce(x, compression="int3"), "int3"),
        "rank listed twice": (lambda: spmd.allreduce(x, rank_list=[[0, 0]]), "twice"),
        "rank out of range": (lambda: spmd.allreduce(x, rank_list=[[0, 5]]), "5"),
        "rank_list not a list": (lambda: spmd.allreduce(x, rank_list="all"), "rank_list"),
        "axis name without a mesh": (lambda: spmd.allreduce(x, group="tp"), "'tp'"),
        "allgather axis out of range": (lambda: spmd.allgather(x, axis=5), "axis"),
        "reduce_scatter rows not divisible": (
            lambda: spmd.reduce_scatter(jnp.ones((3, 2))),
            "3",
        ),
        "reduce_scatter axis out of range": (lambda: spmd.reduce_scatter(x, axis=2), "axis"),
        "allgatherv sizes of another length": (
            lambda: spmd.allgatherv(x, sizes=[4]),
            "sizes",
        ),
        "allgatherv size not this rank's rows": (
            lambda: spmd.allgatherv(x, sizes=[3, 3]),
            "sizes",
        ),
        "reduce_scatterv sizes that do not add up": (
            lambda: spmd.reduce_scatterv(x, sizes=[1, 1]),
            "sizes",
        ),
        "broadcast root out of range": (lambda: spmd.broadcast(x, root=2), "root=2"),
        "broadcast root not an int": (lambda: spmd.broadcast(x, root="0"), "root"),
        "all_to_all split not divisible": (
            lambda: spmd.all_to_all(jnp.ones((3, 2)), split_axis=0, concat_axis=0),
            "3",
        ),
        "all_to_all axis out of range": (
            lambda: spmd.all_to_all(x, split_axis=3, concat_axis=0),
            "axis",
        ),
        "all_to_allv counts of another length": (lambda: spmd.all_to_allv(x, [4]), "count"),
        "all_to_allv counts past the rows": (lambda: spmd.all_to_allv(x, [3, 3]), "count"),
        "sendrecv peer out of range": (lambda: spmd.sendrecv(x, src=0, dst=7), "7"),
        "send to a rank out of range": (lambda: spmd.send(x, dst=-3), "-3"),
        "Mesh that does not fit the world": (lambda: spmd.Mesh(dp=3), "world"),
        "Mesh with two inferred axes": (lambda: spmd.Mesh(dp=-1, tp=-1), "-1"),
        "Mesh axis of size 0": (lambda: spmd.Mesh(dp=0), "dp=0"),
        "Mesh axis not an int": (lambda: spmd.Mesh(dp="2"), "dp"),
        "sub-communicator with a rank twice": (
            lambda: spmd.get_communicator([[0], [0]]),
            "twice",
        ),
        "broadcast_object root out of range": (
            lambda: spmd.get_communicator().broadcast_object(1, root=5),
            "root=5",
        ),
        "data_parallel bucket_mb below 0": (
            lambda: spmd.data_parallel(grad_step, bucket_mb=-1),
            "bucket_mb",
        ),
        "data_parallel unknown compression": (
            lambda: spmd.data_parallel(grad_step, compression="int8"),
            "compression",
        ),
        "data_parallel accumulate_steps 0": (
            lambda: spmd.data_parallel(grad_step, accumulate_steps=0),
            "accumulate_steps",
        ),
        "data_parallel step with no gradient": (
            lambda: spmd.data_parallel(step_without_grad)(jnp.ones(2), jnp.ones(2)),
            "grad",
        ),
        "data_parallel argument that is neither an array nor hashable": (
            lambda: spmd.data_parallel(grad_step)(jnp.ones(2), {1, 2}),
            "b is a set",
        ),
        "gradient of an integer parameter": (
            lambda: spmd.data_parallel(grad_step)(jnp.arange(2), jnp.ones(2)),
            "int32",
        ),
        "data_parallel deterministic shards 0": (
            lambda: spmd.data_parallel(grad_step, deterministic=True, shards=0),
            "shards=0",
        ),
        "zero_shard stage 4": (lambda: spmd.zero_shard(grad_step, stage=4), "stage"),
        "pipeline microbatches 0": (
            lambda: spmd.pipeline_value_and_grad(lambda p, x: x, lambda y, t: y, microbatches=0),
            "microbatches=0",
        ),
        "pipeline unknown schedule": (
            lambda: spmd.pipeline_value_and_grad(
                lambda p, x: x, lambda y, t: y, microbatches=2, schedule="zigzag"
            ),
            "zigzag",
        ),
        "shard with a spec longer than the array": (
            lambda: spmd.shard(jnp.ones(4), spmd.PartitionSpec("dp", None)),
            "2 entries for an array of 1 dimensions",
        ),
        "a pytree with a string leaf": (
            lambda: spmd.allreduce({"a": jnp.ones(2), "b": "x"}),
            "str",
        ),
    }


@multirank(nprocs=(2,))
def test_every_bad_input_is_a_clear_error_on_every_rank(comm):
    r = comm.rank
    cases = _cases(r)
    assert len(cases) >= 40
    wrong = []
    for name, (call, fragment) in cases.items():
        try:
            call()  # type: ignore[operator]
        except spmd.SpmdError as e:
            text = str(e)
            if not text.startswith(f"rank {r}: ") or fragment not in text:
                wrong.append(f"{name}: {text[:200]!r}")
        except Exception as e:  # the catalogue reports any other error
            wrong.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        else:
            wrong.append(f"{name}: no error")
    assert not wrong, "\n".join(wrong)
    np.testing.assert_array_equal(spmd.allreduce(jnp.ones(3)), np.full(3, 2.0))
    jax.block_until_ready(spmd.allgather(jnp.ones(2)))
