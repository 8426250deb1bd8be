"""The hierarchical transport's algorithms (native/cpu/transport.h) on simulated nodes: shared
memory inside each node and MPI across the nodes over rails, for every op, against NumPy, at
sizes that take each path (pieces shorter than the ranks of a node, sizes that do not split
evenly, the shared-memory chunk crossed, all_to_all on either side of its two-dimensional
limit), on groups whose nodes are consecutive (every op but broadcast on the rails) and on a
reordered group (allreduce on the rails, the others over the whole group's MPI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from spmd.testing import multirank
from tests import HEAVY

# Element counts: fewer than a node's ranks, odd, and past the 1 MiB shared-memory chunk.
SIZES = (1, 5, 100_003, 300_007)


def _x(seed: int, n: int, dtype=np.float32) -> np.ndarray:
    """Integer values, so that sums are exact in any order and any misplaced element shows."""
    return ((np.arange(n) * 7 + seed * 13) % 101 - 50).astype(dtype)


def _every_op(comm, group, members, tag: str) -> None:
    g, p = len(members), members.index(comm.rank)
    for n in SIZES:
        xs = [_x(m, n) for m in range(g)]
        got = jax.jit(lambda x: spmd.allreduce(x, group=group))(jnp.asarray(xs[p]))
        np.testing.assert_array_equal(got, sum(xs), f"{tag} allreduce sum n={n}")
        got = spmd.allreduce(jnp.asarray(xs[p]), "max", group=group)
        np.testing.assert_array_equal(got, np.max(xs, 0), f"{tag} allreduce max n={n}")
        ints = [x.astype(np.int32) for x in xs]
        got = spmd.allreduce(jnp.asarray(ints[p]), "min", group=group)
        np.testing.assert_array_equal(got, np.min(ints, 0), f"{tag} allreduce min int32 n={n}")
        for root in range(g):
            got = spmd.broadcast(jnp.asarray(xs[p]), root=root, group=group)
            np.testing.assert_array_equal(got, xs[root], f"{tag} broadcast root={root} n={n}")
        blocks = [_x(m, n * g).reshape(g, n) for m in range(g)]
        got = spmd.allgather(jnp.asarray(blocks[p][p])[None], group=group)
        np.testing.assert_array_equal(got, [blocks[m][m] for m in range(g)], f"{tag} allgather")
        got = jax.jit(lambda b: spmd.reduce_scatter(b, group=group))(jnp.asarray(blocks[p]))
        np.testing.assert_array_equal(got, sum(blocks)[p : p + 1], f"{tag} reduce_scatter n={n}")
        got = spmd.all_to_all(jnp.asarray(blocks[p]), group=group)
        want = np.stack([blocks[m][p] for m in range(g)])
        np.testing.assert_array_equal(got, want, f"{tag} all_to_all n={n}")
    # Uneven blocks, one rank's empty: rows of 3, rank m contributing (m * 5) % (g + 1) rows.
    sizes = [(m * 5) % (g + 1) for m in range(g)]
    rows = [_x(m, 3 * sizes[m]).reshape(sizes[m], 3) for m in range(g)]
    got = spmd.allgatherv(jnp.asarray(rows[p]), sizes, group=group)
    np.testing.assert_array_equal(got, np.concatenate(rows), f"{tag} allgatherv {sizes}")
    full = [_x(m, 3 * sum(sizes)).reshape(sum(sizes), 3) for m in range(g)]
    got = spmd.reduce_scatterv(jnp.asarray(full[p]), sizes, group=group)
    start = sum(sizes[:p])
    want = sum(full)[start : start + sizes[p]]
    np.testing.assert_array_equal(got, want, f"{tag} reduce_scatterv {sizes}")


def _nodes_of(comm) -> list[str]:
    return [comm.node_ids[w] for w in comm.ranks]


@multirank(nprocs=(4,), env={"SPMD_SIMULATE_NODES": "2"}, timeout=HEAVY)
def test_two_nodes_of_two(comm):
    assert spmd.ops.get_transport() == "hier"
    _every_op(comm, None, list(range(comm.size)), "world")
    # Group ranks 0, 1, 2, 3 are world ranks 0, 2, 1, 3: each node's ranks are not consecutive
    # in the group, so only allreduce takes the rails.
    reordered = spmd.get_communicator([[0, 2, 1, 3]])
    assert _nodes_of(reordered) == [f"simulated-node-{i}" for i in (0, 1, 0, 1)]
    assert spmd.ops.get_transport(group=reordered) == "hier"
    _every_op(comm, reordered, [0, 2, 1, 3], "reordered")


@multirank(nprocs=(6,), env={"SPMD_SIMULATE_NODES": "3"}, timeout=HEAVY)
def test_three_nodes_of_two(comm):
    assert spmd.ops.get_transport() == "hier"
    assert _nodes_of(comm) == [f"simulated-node-{i}" for i in (0, 0, 1, 1, 2, 2)]
    _every_op(comm, None, list(range(comm.size)), "world")


@multirank(nprocs=(3,), env={"SPMD_SIMULATE_NODES": "2"}, timeout=HEAVY)
def test_unequal_nodes_go_through_the_leaders(comm):
    # Nodes {0, 1} and {2}: no rails; allreduce through the node leaders, the rest over MPI.
    assert spmd.ops.get_transport() == "hier"
    _every_op(comm, None, list(range(comm.size)), "unequal")
