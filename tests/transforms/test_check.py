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


@multirank(nprocs=(2, 4))
def test_check_pairs_each_send_with_its_receive(comm):
    """Point-to-point: what a rank sends to another against what that one receives from it,
    in order, with dtype and shape, a scan's body once per iteration; the pipeline's schedules
    agree; a send without its receive, or a receive of another shape, is named before it runs
    (where, running, the sender's peer would wait for ever, or fail at the receive)."""
    r, n = comm.rank, comm.size
    x = jnp.ones(3)

    def ring(x):  # every rank sends to the next and receives from the previous, twice
        y = spmd.sendrecv(x, src=(r - 1) % n, dst=(r + 1) % n)
        return spmd.sendrecv(y, src=(r - 1) % n, dst=(r + 1) % n)

    assert spmd.check(ring, x) == 2 * n

    def scanned(x):  # rank 0 sends 4 in a loop, rank 1 receives them one by one
        if r == 0:

            def body(c, _):
                spmd.send(c, 1)
                return c, None

            return jax.lax.scan(body, x, None, length=4)[0]
        if r == 1:
            for _ in range(4):
                x = spmd.recv(x, 0)
        return x

    assert spmd.check(scanned, x) == 4

    def one_short(x):  # rank 0 sends twice, rank 1 receives once
        if r == 0:
            spmd.send(x, 1)
            spmd.send(x, 1)
        if r == 1:
            x = spmd.recv(x, 0)
        return x

    text = _raises(lambda: spmd.check(one_short, x),
                   "spmd.check: the ranks would exchange different messages: message #2 from "
                   "rank 0 to rank 1 on the group", "rank 0 sends float32[3] at test_check.py:",
                   "rank 1 receives nothing more (it receives 1 from rank 0)")  # fmt: skip
    assert "(one_short)" in text and len(set(comm.allgather_object(text))) == 1, text

    def other_shape(x):
        if r == 0:
            spmd.send(x, 1)
        if r == 1:
            x = spmd.recv(jnp.ones((3, 1)), 0)
        return x

    _raises(lambda: spmd.check(other_shape, x), "message #1 from rank 0 to rank 1",
            "rank 0 sends float32[3]", "rank 1 receives float32[3,1]")  # fmt: skip
    # Every pipeline schedule's messages pair up, on every stage.
    layers = [{"w": jnp.eye(4) * (k + 1)} for k in range(2 * n)]

    def apply(ls, h):
        for layer in ls:
            h = jnp.tanh(h @ layer["w"])
        return h

    def mse(y, t):
        return jnp.mean((y - t) ** 2)

    with spmd.Mesh(pp=n):
        mine = spmd.pipeline.stage_layers(layers)
        chunks = spmd.pipeline.stage_layers(layers, virtual_stages=2)
        for schedule in spmd.pipeline.SCHEDULES:
            v = 2 if schedule == "interleaved" else 1
            step = spmd.pipeline_value_and_grad(apply, mse, microbatches=4, schedule=schedule,
                                                virtual_stages=v)  # fmt: skip
            xt = jnp.ones((8, 4))
            assert spmd.check(step, chunks if v == 2 else mine, xt, xt) > 0, schedule
    # Nothing ran: the ring still works.
    np.testing.assert_array_equal(ring(x), np.ones(3))
