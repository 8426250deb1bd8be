"""Communicators on 1-4 ranks under the real launchers: RAF's attribute table and grouping."""

import os

import numpy as np
import pytest

import spmd
from spmd.runtime._env import mpi_rank_size
from spmd.testing import multirank, run

ATTRS = (
    "local_rank",
    "local_size",
    "rank",
    "size",
    "world_rank",
    "world_size",
    "group_id",
    "group_size",
    "root_rank",
    "ranks",
    "backend",
)


def attributes(rank_list=None):
    comm = spmd.get_communicator(rank_list)
    return {a: getattr(comm, a) for a in ATTRS}


# RAF, Distribution Mechanism: rank_list=[[1, 2, 3], [0]] on two nodes of two ranks.
RAF_GLOBAL = {
    "local_rank": [0, 1, 0, 1],
    "local_size": [2, 2, 2, 2],
    "rank": [0, 1, 2, 3],
    "size": [4, 4, 4, 4],
    "world_rank": [0, 1, 2, 3],
    "world_size": [4, 4, 4, 4],
}
RAF_SUB = {
    "local_rank": [0, 0, 0, 1],
    "local_size": [1, 1, 2, 2],
    "rank": [0, 0, 1, 2],
    "size": [1, 3, 3, 3],
    "world_rank": [0, 1, 2, 3],
    "world_size": [4, 4, 4, 4],
    "group_id": [1, 0, 0, 0],
    "group_size": [2, 2, 2, 2],
}


def check_raf_table(results, backend):
    for table, which in ((RAF_GLOBAL, 0), (RAF_SUB, 1)):
        for attr, expected in table.items():
            assert [r[which][attr] for r in results] == expected, (attr, which)
    assert [r[1]["ranks"] for r in results] == [(0,), (1, 2, 3), (1, 2, 3), (1, 2, 3)]
    assert [r[1]["root_rank"] for r in results] == [0, 1, 1, 1]
    assert {r[k]["backend"] for r in results for k in (0, 1)} == {backend}


def raf_table():
    return attributes(), attributes([[1, 2, 3], [0]])


@pytest.mark.parametrize("launcher, backend", [("mpi", "mpi"), ("env", "void")])
def test_raf_attribute_table_two_simulated_nodes(launcher, backend):
    results = run(raf_table, 4, env={"SPMD_SIMULATE_NODES": "2"}, launcher=launcher)
    check_raf_table(results, backend)


def raf_table_with_node_ids():
    rank = mpi_rank_size(os.environ)[0]
    os.environ["SPMD_NODE_ID"] = ["machine-a", "machine-a", "machine-b", "machine-b"][rank]
    return raf_table()


def test_raf_attribute_table_node_ids_from_spmd_node_id():
    check_raf_table(run(raf_table_with_node_ids, 4, fresh=True), "mpi")


def world_attributes():
    return attributes()


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("launcher, backend", [("mpi", "mpi"), ("env", "void")])
def test_world_communicator(nprocs, launcher, backend):
    results = run(world_attributes, nprocs, launcher=launcher)
    assert [r["rank"] for r in results] == list(range(nprocs))
    assert [r["local_rank"] for r in results] == list(range(nprocs))  # one machine
    for r in results:
        assert (r["size"], r["local_size"], r["world_size"]) == (nprocs,) * 3
        assert (r["group_id"], r["group_size"], r["root_rank"]) == (0, 1, 0)
        assert r["ranks"] == tuple(range(nprocs))
        assert r["backend"] == backend


def group_sums(rank_lists):
    """RAF's AR table, through the communicators' object exchange: input rank + 1."""
    out = []
    for rank_list in rank_lists:
        comm = spmd.get_communicator(rank_list)
        out.append(sum(comm.allgather_object(comm.world_rank + 1)))
    return out


@pytest.mark.parametrize("launcher", ["mpi", "env"])
def test_raf_grouping_table(launcher):
    lists = [
        None,
        [[0, 1, 2, 3]],
        [[0, 1], [2, 3]],
        [[0, 1, 2], [3]],
        [[0, 1, 2]],
        [[1, 2, 3], [0]],
        [[3, 1], [2, 0]],
    ]
    by_rank = run(group_sums, 4, args=(lists,), launcher=launcher)
    by_list = list(zip(*by_rank, strict=True))
    assert by_list == [
        (10,) * 4,
        (10,) * 4,
        (3, 3, 7, 7),
        (6, 6, 6, 4),
        (6, 6, 6, 4),
        (1, 9, 9, 9),
        (4, 6, 4, 6),
    ]


@multirank()
def test_pool_caches_sub_communicators(comm):
    n = comm.size
    first = spmd.get_communicator([list(range(n - 1))] if n > 1 else [[0]])
    assert spmd.get_communicator([list(range(n - 1)), [n - 1]] if n > 1 else [[0]]) is first
    assert spmd.get_communicator([list(range(n))]) is comm  # the whole world is the world
    assert spmd.get_communicator() is comm is spmd.init()


@multirank(nprocs=(2, 3, 4))
def test_rank_in_group_is_position_in_list(comm):
    reverse = spmd.get_communicator([list(reversed(range(comm.size)))])
    assert reverse.rank == comm.size - 1 - comm.rank
    assert reverse.root_rank == comm.size - 1
    assert reverse.allgather_object(comm.rank) == list(reversed(range(comm.size)))


@multirank(nprocs=(1, 2, 3, 4))
def test_broadcast_and_barrier(comm):
    assert comm.broadcast_object({"from": comm.rank}, root=comm.size - 1) == {"from": comm.size - 1}
    comm.barrier()
    pairs = spmd.get_communicator([[r, r + 1] for r in range(0, comm.size - 1, 2)] or [[0]])
    got = pairs.broadcast_object(comm.rank * 10, root=pairs.size - 1)
    assert got == pairs.ranks[-1] * 10
    with pytest.raises(spmd.SpmdError, match=rf"rank {comm.rank}: root=5 is out of range"):
        comm.broadcast_object(1, root=5)


@multirank(nprocs=(1, 2, 3, 4))
def test_bad_rank_lists_raise_on_every_rank(comm):
    n = comm.size
    with pytest.raises(spmd.SpmdError, match=rf"rank {comm.rank}: .* lists rank 0 twice"):
        spmd.get_communicator([[0], [0]])
    with pytest.raises(spmd.SpmdError, match=rf"rank {comm.rank}: .* names rank {n}, out of"):
        spmd.get_communicator([[0, n]])
    with pytest.raises(
        spmd.SpmdTypeError, match=rf"rank {comm.rank}: rank_list=\[0\]: group 0 is 0, not a list"
    ):
        spmd.get_communicator([0])
    comm.barrier()  # every rank got here: nobody hung


def rank_skips_exchange(rank_list):
    comm = spmd.get_communicator(rank_list)
    if comm.world_rank == 1:
        return "skipped"
    try:
        comm.allgather_object(comm.world_rank)
    except spmd.SpmdError as e:
        return str(e)
    return "completed"


@pytest.mark.parametrize("launcher", ["mpi", "env"])
def test_missing_rank_times_out_with_a_clear_error(launcher):
    results = run(
        rank_skips_exchange,
        3,
        args=([[0, 1], [2]],),
        env={"SPMD_TIMEOUT": "1.5"},
        launcher=launcher,
        fresh=True,
    )
    assert results[1] == "skipped"
    assert results[2] == "completed"  # a group of one does not wait for anyone
    if launcher == "mpi":  # the group's MPI communicator is created on first use
        assert results[0].startswith(
            "rank 0: creating the communicator of ranks [0, 1] timed "
            "out after 1.5 s: ranks [1] never joined."
        )
    else:
        assert results[0].startswith(
            "rank 0: allgather_object on the group of ranks [0, 1] "
            "timed out after 1.5 s waiting for ranks [1]"
        )


def late_rank_exchange():
    """Rank 1 gives up on an exchange; rank 0 arrives after the deadline (say, still writing a
    checkpoint). Its exchange pairs with rank 1's abandoned one and must then time out too, not
    wait forever for a rank that has moved on; after that the group refuses at once."""
    import time

    comm = spmd.get_communicator()
    comm.barrier()
    if comm.rank == 0:
        time.sleep(2.5)
    outcome = []
    for value in ("late", "after"):
        start = time.monotonic()
        try:
            comm.allgather_object(value)
            outcome.append("completed")
        except spmd.SpmdError as e:
            outcome.append(f"{time.monotonic() - start:.1f}s {e}")
    return outcome


def test_a_late_rank_times_out_instead_of_hanging():
    first, second = run(late_rank_exchange, 2, env={"SPMD_TIMEOUT": "1.5"}, fresh=True, timeout=60)
    for rank, (late, after) in enumerate((first, second)):
        assert "allgather_object on the group of ranks [0, 1] timed out after 1.5 s" in late
        assert float(late.split("s ")[0]) < 3, late
        assert after.startswith(f"0.0s rank {rank}: allgather_object: the group of ranks [0, 1] is")
        assert "unusable after an earlier exchange timed out" in after


@multirank(nprocs=(4,), launcher="env")
def test_file_store_communicators_of_the_same_members_keep_apart(comm):
    """Two communicators holding ranks 0 and 1 (from [[0, 1], [2, 3]] and from [[0, 1]]):
    over the file store each exchanges through files of its own, so alternating calls never
    read the other's data."""
    assert comm.backend == "void"
    a = spmd.get_communicator([[0, 1], [2, 3]])
    b = spmd.get_communicator([[0, 1]])
    r = comm.rank
    assert list(a.ranks) == ([0, 1] if r < 2 else [2, 3])
    assert list(b.ranks) == ([0, 1] if r < 2 else [r])
    for i in range(20):
        got_a = a.allgather_object(("a", i, comm.rank))
        got_b = b.allgather_object(("b", i, comm.rank))
        assert got_a == [("a", i, r) for r in a.ranks], (i, got_a)
        assert got_b == [("b", i, r) for r in b.ranks], (i, got_b)
    x = np.float32(r + 1)
    assert float(spmd.allreduce(x, group=a)) == (3.0 if r < 2 else 7.0)
    assert float(spmd.allreduce(x, group=b)) == (3.0 if r < 2 else r + 1)
