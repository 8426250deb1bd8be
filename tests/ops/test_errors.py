"""Bad input is a clear spmd.SpmdError on every rank, naming the rank and the values; nothing
hangs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank
from tests import HEAVY


def _raises(fn, *fragments, exc=spmd.SpmdError):
    with pytest.raises(exc) as info:
        fn()
    text = str(info.value)
    for f in fragments:
        assert f in text, (f, text)
    return text


@multirank(nprocs=(2, 3))
def test_static_bad_input_raises_on_every_rank(comm):
    r, n = comm.rank, comm.size
    x = jnp.ones((2 * n, 3))
    me = f"rank {r}"
    _raises(lambda: spmd.broadcast(x, root=n), me, f"root={n}", f"0..{n - 1}")
    _raises(lambda: spmd.broadcast(x, root=-1), me, "root=-1")
    _raises(lambda: spmd.sendrecv(x, src=n + 1, dst=0), me, f"src={n + 1}")
    _raises(lambda: spmd.send(x, dst=r), me, "dst=", "itself")
    _raises(lambda: spmd.recv(x, src=7), me, "src=7")
    _raises(lambda: spmd.allgather(x, axis=2), me, "axis=2", "2 dimension")
    _raises(lambda: spmd.all_to_all(x, split_axis=5), me, "split_axis=5")
    _raises(lambda: spmd.reduce_scatter(jnp.ones((2 * n + 1,))), me, "not divisible", str(n))
    _raises(lambda: spmd.allgatherv(x, [1] * (n + 1)), me, "entries", f"{n} ranks")
    _raises(lambda: spmd.allgatherv(x, [-1] + [1] * (n - 1)), me, "-1")
    _raises(lambda: spmd.allgatherv(x, [5] * n), me, "sizes=", "5 rows")
    _raises(lambda: spmd.reduce_scatterv(x, [1] * n), me, f"adds up to {n}")
    _raises(lambda: spmd.allreduce(x, "mean"), me, "op='mean'", "sum, prod, max, min, avg")
    _raises(lambda: spmd.allreduce(jnp.ones(3, jnp.int32), "avg"), me, "avg", "int32")
    _raises(lambda: spmd.allreduce(jnp.ones(3, jnp.complex64)), me, "complex64", "float32")
    _raises(lambda: spmd.allreduce({"a": np.ones(2, np.uint16)}), me, "x['a']", "uint16")
    # NumPy arrays of objects or text: named, not JAX's "not a valid JAX type".
    _raises(lambda: spmd.allreduce({"a": np.array([object()])}), me, "x['a']", "Python objects")
    _raises(lambda: spmd.allgather(np.array(["a", "b"])), me, "x is a NumPy array of <U1", "text")
    _raises(lambda: spmd.all_to_allv(np.array([b"a"] * n), [1] * n), me, "bytes")
    _raises(lambda: spmd.allreduce(x, rank_list=[[0, 0]]), me, "twice")
    _raises(lambda: spmd.allreduce(x, rank_list=[[0]], group=spmd.get_communicator()), "not both")
    _raises(lambda: spmd.allreduce(x, group="tp"), "no mesh is active")
    _raises(lambda: spmd.allreduce(x, group=3), "group=3")
    # The same checks inside jit.
    _raises(lambda: jax.jit(lambda v: spmd.broadcast(v, root=n))(x), me, f"root={n}")


def _mismatch(comm, what):
    """Call `what(rank)` on every rank: the shapes or dtypes differ between ranks."""
    r = comm.rank
    text = _raises(lambda: what(r), "made different collective calls")
    assert text.startswith(f"rank {r}: ")
    assert "\n  rank 0: " in text and "\n  rank 1: " in text
    return text


def _every_kind_of_mismatch(comm):
    text = _mismatch(comm, lambda r: spmd.allreduce(jnp.ones((2 + r,))))
    assert "float32[2]" in text and "float32[3]" in text
    # A sum of 4 elements meeting one of 400_000: over MPI this once returned garbage in the
    # elements only one rank had.
    text = _mismatch(comm, lambda r: spmd.allreduce(jnp.ones((4 * 100_000 ** min(r, 1),))))
    assert "float32[4]" in text and "float32[400000]" in text
    text = _mismatch(comm, lambda r: spmd.allgather(jnp.ones(2, jnp.float32 if r else jnp.int32)))
    assert "int32[2]" in text and "float32[2]" in text
    _mismatch(comm, lambda r: spmd.broadcast(jnp.ones((1 + r, 2))))
    _mismatch(comm, lambda r: spmd.reduce_scatter(jnp.ones((comm.size * (1 + r),))))
    _mismatch(comm, lambda r: spmd.all_to_all(jnp.ones((comm.size * (1 + r), 2))))
    # A fused call of two leaves against one of one.
    _mismatch(comm, lambda r: spmd.allreduce([jnp.ones(3)] * (1 + min(r, 1))))
    # Different ops at the same point in the program.
    _mismatch(comm, lambda r: spmd.allreduce(jnp.ones(4), "max" if r else "sum"))
    # What the native parameters do not show: an average runs as a sum, and the axes move to
    # axis 0 before the call (square arrays: the same shapes either way). Each returned
    # different values on different ranks without an error.
    sq = jnp.ones((comm.size, comm.size))
    text = _mismatch(comm, lambda r: spmd.allreduce(sq, "avg" if r else "sum"))
    assert "rank 0: allreduce(op=sum) of" in text and "rank 1: allreduce(op=avg) of" in text
    text = _mismatch(comm, lambda r: spmd.reduce_scatter(sq, "avg" if r else "sum"))
    assert "reduce_scatter(op=sum, axis=0)" in text and "reduce_scatter(op=avg, axis=0)" in text
    text = _mismatch(comm, lambda r: spmd.all_to_all(sq, split_axis=min(r, 1)))
    assert "all_to_all(split_axis=1, concat_axis=0)" in text, text
    text = _mismatch(comm, lambda r: spmd.allgather(sq, axis=min(r, 1)))
    assert "rank 0: allgather(axis=0)" in text and "rank 1: allgather(axis=1)" in text
    gather = jax.jit(lambda v: spmd.allgather(v, axis=min(comm.rank, 1)))
    _raises(lambda: gather(sq).block_until_ready(), "made different collective calls",
            "rank 1: allgather(axis=1)", exc=jax.errors.JaxRuntimeError)  # fmt: skip
    # The same call written two ways is the same call.
    np.testing.assert_array_equal(spmd.allgather(sq, axis=-1 if comm.rank else 1).shape,
                                  (comm.size, comm.size ** 2))  # fmt: skip
    text = _mismatch(comm, lambda r: spmd.allreduce(jnp.ones(3)) if r else spmd.barrier())
    assert "rank 0: barrier()" in text, text
    # Different ops once both have succeeded, so that JAX takes its cached fast path (which
    # raises another exception type).
    spmd.allreduce(jnp.ones(3))
    spmd.allgather(jnp.ones(3))
    _mismatch(comm, lambda r: spmd.allreduce(jnp.ones(3)) if r else spmd.allgather(jnp.ones(3)))
    # Inside jit the failure surfaces as JAX's runtime error carrying the same message.
    f = jax.jit(lambda v: spmd.allreduce(v))
    with pytest.raises(jax.errors.JaxRuntimeError, match="made different collective calls"):
        f(jnp.ones((2 + comm.rank,))).block_until_ready()
    # The group still works afterwards.
    assert float(spmd.allreduce(jnp.float32(1))) == comm.size
    np.testing.assert_array_equal(spmd.allgather(jnp.int32(comm.rank)[None]), np.arange(comm.size))


@multirank(nprocs=(2, 3))
def test_shapes_or_dtypes_that_differ_between_ranks(comm):
    assert spmd.ops.get_transport() == "shm"
    _every_kind_of_mismatch(comm)


@multirank(nprocs=(2, 3), env={"SPMD_TRANSPORT": "mpi"})
def test_shapes_or_dtypes_that_differ_between_ranks_over_mpi(comm):
    """MPI compares nothing itself: spmd checks every call, as shared memory does."""
    assert spmd.ops.get_transport() == "mpi"
    _every_kind_of_mismatch(comm)


@multirank(nprocs=(4,), env={"SPMD_SIMULATE_NODES": "2"}, timeout=HEAVY)
def test_shapes_or_dtypes_that_differ_between_nodes_over_hier(comm):
    """Nodes {0, 1} and {2, 3}: the cases above make rank 0 differ from the other rank of its
    node; here the node {2, 3} agrees within itself and differs from the node {0, 1}, which
    only the check between nodes can see."""
    assert spmd.ops.get_transport() == "hier"
    _every_kind_of_mismatch(comm)
    text = _mismatch(comm, lambda r: spmd.allreduce(jnp.ones((2 + r // 2,))))
    assert "rank 1: allreduce(op=sum) of float32[2]" in text
    assert "rank 2: allreduce(op=sum) of float32[3]" in text


@multirank(nprocs=(2, 3), env={"SPMD_TIMEOUT": "10"})
def test_a_backward_collective_never_pairs_with_a_forward_one(comm):
    """The programs docs/collectives.md warns of: JAX runs a collective's backward on some ranks
    only. The rank in the backward pass meets the others' next forward collective of the same
    signature; that is a mismatch naming the backward pass on every rank, not a wrong sum (and,
    one collective later, a timeout)."""
    r, n = comm.rank, comm.size
    hint = "did not differentiate"

    def constant_off_root(v):  # the non-roots broadcast a constant: no backward there
        x = v if r == 0 else jnp.zeros(3)
        return jnp.sum(spmd.broadcast(x, root=0) ** 2)

    def unused_off_root(v):  # the allreduce reaches the objective on rank 0 only
        y = spmd.allreduce(v)
        return jnp.sum(v**2) + (jnp.sum(y**2) if r == 0 else 0.0)

    for loss in (constant_off_root, unused_off_root):

        def step(v, loss=loss):
            return jax.grad(loss)(v), spmd.allreduce(jnp.ones(3))

        text = _mismatch(comm, lambda _: step(jnp.arange(3.0)))
        assert "rank 0: allreduce(op=sum) of float32[3] [backward pass]" in text, text
        assert "rank 1: allreduce(op=sum) of float32[3]\n" in text and hint in text, text
        with pytest.raises(jax.errors.JaxRuntimeError, match="backward pass"):
            jax.block_until_ready(jax.jit(step)(jnp.arange(3.0)))
        assert float(spmd.allreduce(jnp.float32(1))) == n
    # Differentiated alike, backward and forward collectives run side by side as before.
    g = jax.grad(lambda v: jnp.sum(spmd.allreduce(v * (r + 1)) ** 2))(jnp.ones(2))
    # dL/dv_r = (r + 1) * sum over ranks of the cotangent 2 * y, with y = 1 + 2 + ... + n.
    np.testing.assert_allclose(g, (r + 1) * n * 2 * sum(range(1, n + 1)) * np.ones(2))


@multirank(nprocs=(2,), env={"SPMD_TRANSPORT": "mpi"})
def test_a_backward_collective_is_named_over_mpi(comm):
    def loss(v):
        return jnp.sum(spmd.broadcast(v if comm.rank == 0 else jnp.zeros(3), root=0) ** 2)

    text = _mismatch(comm, lambda _: (jax.grad(loss)(jnp.ones(3)), spmd.allreduce(jnp.ones(3))))
    assert "[backward pass]" in text and "did not differentiate" in text


@multirank(nprocs=(2,), env={"SPMD_TIMEOUT": "2"}, fresh=True)
def test_a_rank_that_never_arrives_is_named_not_a_hang(comm):
    spmd.barrier()  # register the group while everyone is here
    if comm.rank == 0:
        text = _raises(lambda: spmd.allreduce(jnp.ones(3)), "timed out", "[1]")
        assert text.startswith("rank 0: ")
        assert "never made the matching call" in text


@multirank(nprocs=(3,), env={"SPMD_TIMEOUT": "2"}, fresh=True)
def test_the_timeout_bounds_the_whole_wait_not_each_peer(comm):
    """Rank 1 arrives late and rank 2 never: rank 0 gives up SPMD_TIMEOUT after it started
    waiting, not SPMD_TIMEOUT after rank 1 arrived."""
    import time

    spmd.barrier()
    if comm.rank == 2:
        return
    if comm.rank == 1:
        time.sleep(1.5)
    start = time.monotonic()
    text = _raises(lambda: spmd.allreduce(jnp.ones(3)), "timed out", "[2]")
    assert text.startswith(f"rank {comm.rank}: ")
    if comm.rank == 0:
        assert time.monotonic() - start < 3.2  # 2 s, not 1.5 + 2


@multirank(nprocs=(2,), env={"SPMD_TIMEOUT": "2", "SPMD_TRANSPORT": "mpi"}, fresh=True)
def test_an_mpi_timeout_makes_the_group_unusable(comm):
    """MPI cannot cancel a collective: after a timeout the abandoned call may still complete
    with a late rank, so the group refuses every later call instead of mismatching them."""
    import time

    spmd.barrier()
    if comm.rank == 0:
        assert _raises(lambda: spmd.allreduce(jnp.ones(3)), "timed out").startswith("rank 0: ")
        start = time.monotonic()
        text = _raises(lambda: spmd.allreduce(jnp.ones(3)), "unusable", "timed out")
        assert text.startswith("rank 0: ")
        assert time.monotonic() - start < 1  # refused at once, not after another timeout
    else:
        time.sleep(3)  # never makes the call rank 0 gives up on


@multirank(nprocs=(2,), env={"SPMD_TIMEOUT": "2", "SPMD_TRANSPORT": "mpi"}, fresh=True)
def test_over_mpi_a_late_rank_fails_at_once_naming_the_first_failure(comm):
    """Rank 0 gives up on a collective (timeout) and goes on running; rank 1 reaches that
    collective 2 s later. It fails at once with rank 0's error (read from the node's segment),
    not after its own timeout, nor with a guess that rank 0 made fewer calls; then both refuse
    every later call, saying why."""
    import time

    spmd.barrier()
    if comm.rank == 1:
        time.sleep(4)
    start = time.monotonic()
    text = _raises(lambda: spmd.allreduce(jnp.ones(3)), "timed out after 2 s")
    took = time.monotonic() - start
    if comm.rank == 1:
        assert "collective #2 over MPI of the group [0, 1] failed on rank 0 before this rank " \
               "could complete it: timed out after 2 s" in text, text  # fmt: skip
        assert took < 1.0, f"rank 1 took {took:.1f} s to fail"
    later = _raises(lambda: spmd.allreduce(jnp.ones(3)), "unusable", "timed out after 2 s")
    assert later.startswith(f"rank {comm.rank}: "), later
    if comm.rank == 0:
        time.sleep(4)  # alive, not exiting, while rank 1 arrives


@multirank(
    nprocs=(4,),
    env={"SPMD_SIMULATE_NODES": "2", "SPMD_TIMEOUT": "2", "SPMD_TRANSPORT": "mpi"},
    fresh=True,
)
def test_across_nodes_a_rank_that_fails_a_collective_fails_its_waiting_peers(comm):
    """Ranks 0, 1 (node 0) and 2 (node 1) wait for rank 3, which never calls; rank 0 started
    1 s earlier and times out first. No segment spans the nodes: the peer watch tells ranks 1
    and 2 of rank 0's failure, and they fail with its error about 1 s into their wait, not at
    their own timeout (2 s); a later call is refused naming it."""
    import time

    spmd.allreduce(jnp.ones(3))  # compiled before the timed call
    spmd.barrier()
    if comm.rank == 3:
        time.sleep(5)  # never makes the call; alive while the others fail
        return
    if comm.rank != 0:
        time.sleep(1)
    start = time.monotonic()
    text = _raises(lambda: spmd.allreduce(jnp.ones(3)), "timed out after 2 s", "rank 3")
    took = time.monotonic() - start
    if comm.rank != 0:
        assert text.startswith(
            f"rank {comm.rank}: allreduce: collective #3 over MPI of the group [0, 1, 2, 3] "
            "failed on rank 0 before this rank could complete it: timed out after 2 s"
        ), text
        assert took < 1.7, f"rank {comm.rank} took {took:.1f} s to fail"
    later = _raises(lambda: spmd.allreduce(jnp.ones(3)), "unusable", "timed out after 2 s")
    assert later.startswith(f"rank {comm.rank}: "), later
    time.sleep(3 - took if comm.rank == 0 else 1)  # alive while the others are told


@multirank(nprocs=(2,), timeout=HEAVY)
def test_more_than_2_to_the_31_elements(comm):
    n = 2**31 + 192
    x = jnp.full((n,), comm.rank + 1, jnp.int8)
    y = spmd.allreduce(x)
    del x
    assert y.shape == (n,)
    # min == max == 3: every element, those past index 2**31 included, holds the sum.
    assert int(jnp.min(y)) == 3 and int(jnp.max(y)) == 3


@multirank(nprocs=(2,))
def test_recv_checks_shape_and_dtype_not_only_bytes(comm):
    """float32[4] sent, int32[2,2] expected: the same 16 bytes, which recv once reinterpreted."""
    r = comm.rank
    if r == 0:
        spmd.send(jnp.arange(4.0), dst=1)
        spmd.send(jnp.arange(4.0), dst=1)
    else:
        text = _raises(lambda: spmd.recv(jnp.zeros((2, 2), jnp.int32), src=0))
        assert text.startswith("rank 1: recv: rank 0 sent float32[4] (16 bytes), but this rank "
                               "receives into int32[2,2] (16 bytes)"), text  # fmt: skip
        recv = jax.jit(lambda v: spmd.recv(v, src=0))
        _raises(lambda: recv(jnp.zeros((4, 1))).block_until_ready(), "rank 0 sent float32[4]",
                "receives into float32[4,1]", exc=jax.errors.JaxRuntimeError)  # fmt: skip
    # The pair still works, and a matching message arrives intact.
    if r == 0:
        spmd.send(jnp.arange(3.0), dst=1)
    else:
        np.testing.assert_array_equal(spmd.recv(jnp.zeros(3), src=0), [0.0, 1.0, 2.0])
