"""The pre-flight schedule check: spmd.check, and the first call of a data_parallel step, compare
the collectives each rank would make, group by group, before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank


def _raises(call, *needles):
    with pytest.raises(spmd.SpmdError) as info:
        call()
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    return text


@multirank(nprocs=(2,))
def test_check_names_the_first_call_that_differs_with_each_rank_s_line(comm):
    r = comm.rank
    x = jnp.ones(3)

    def same(x):
        y = spmd.allreduce(x)
        return spmd.allgather(y * 2, axis=0)

    assert spmd.check(same, x) == 2  # and nothing ran: no collective was made
    assert spmd.check(jax.grad(lambda x: spmd.allreduce(x).sum()), x) == 2  # forward + backward

    def sum_or_avg(x):
        y = spmd.allreduce(x)
        return spmd.allreduce(y, op="sum" if r == 0 else "avg")

    text = _raises(lambda: spmd.check(sum_or_avg, x), "spmd.check: the ranks of the group [0, 1]",
                   "call #2 on this group is",
                   "rank 0: allreduce(op=sum) of float32[3] at test_check.py:",
                   "rank 1: allreduce(op=avg) of float32[3] at test_check.py:")  # fmt: skip
    assert "(sum_or_avg)" in text, text
    assert f"rank {r}:" in text  # the same error on every rank

    def one_more(x):
        y = spmd.allreduce(x)
        return spmd.allreduce(y) if r == 1 else y

    _raises(lambda: spmd.check(one_more, x), "call #2 on this group is",
            "rank 0: no call (it makes 1 on this group)", "rank 1: allreduce(op=sum)")  # fmt: skip
    # Shapes, and allgather's axis on square arrays (the shapes alone agree).
    _raises(lambda: spmd.check(spmd.allreduce, jnp.ones(3 + r)), "float32[3]", "float32[4]")
    sq = jnp.ones((2, 2))
    _raises(lambda: spmd.check(lambda a: spmd.allgather(a, axis=r), sq), "axis=0", "axis=1")
    # The comparison ran nothing: the group still works.
    np.testing.assert_array_equal(spmd.allreduce(x), np.full(3, 2.0))


@multirank(nprocs=(4,))
def test_check_compares_each_group_among_its_own_ranks(comm):
    r = comm.rank
    with spmd.Mesh(dp=2, tp=2) as mesh:
        tp = mesh.index("dp")  # which tp group: [0, 1] or [2, 3]

        def stages(x):  # each tp group its own shapes, as pipeline stages have
            return spmd.allreduce(x[: 2 + tp], group="tp")

        assert spmd.check(stages, jnp.ones(4)) == 2  # one call per group, each agreed

        def odd(x):  # rank 3 differs from rank 2 in its tp group; [0, 1] agree
            return spmd.allreduce(x, group="tp", op="max" if r == 3 else "sum")

        _raises(lambda: spmd.check(odd, jnp.ones(4)), "the group [2, 3]",
                "rank 2: allreduce(op=sum)", "rank 3: allreduce(op=max)")  # fmt: skip


@multirank(nprocs=(2,))
def test_a_data_parallel_step_checks_its_schedule_before_it_runs(comm):
    r = comm.rank
    params = {"w": jnp.ones(3)}

    @spmd.data_parallel
    def step(p, x):
        loss, g = spmd.value_and_grad(lambda p, x: jnp.sum(p["w"] * x))(p, x)
        extra = spmd.allreduce(x, op="sum" if r == 0 else "avg")  # a rank-dependent bug
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss + extra.sum()

    _raises(lambda: step(params, jnp.ones(3)), "data_parallel(step): the ranks of the group [0, 1]",
            "would make different collective calls", "rank 0: allreduce(op=sum) of float32[3]",
            "rank 1: allreduce(op=avg) of float32[3]")  # fmt: skip
