"""ShardedArray: shard / gather / reshard round trips with uneven sizes and several dtypes,
eagerly and under jit, over a group and over a mesh; padding never leaks; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import PartitionSpec as P
from spmd.testing import multirank, run
from tests import HEAVY

DTYPES = (np.float32, np.float16, jnp.bfloat16, np.int32, np.int8, np.float64, np.bool_)


def _full(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(-50, 50, size=shape)
    return jnp.asarray(x > 0 if dtype is np.bool_ else x.astype(dtype))


def test_one_rank_shard_is_the_array():
    spmd.init()
    x = jnp.arange(10.0)
    s = spmd.shard(x, P("dp"))
    assert s.local_shape == (10,) and s.shape == (10,)
    np.testing.assert_array_equal(s.gather(), x)


def test_errors_name_the_rank_and_the_spec():
    spmd.init()
    with pytest.raises(spmd.SpmdError, match=r"rank 0: .*3 entries for an array of 2"):
        spmd.shard(jnp.ones((2, 2)), P("a", None, None))
    with pytest.raises(spmd.SpmdError, match="uses a mesh axis twice"):
        spmd.shard(jnp.ones((2, 2)), P("dp", "dp"), mesh=spmd.Mesh(dp=1))
    with pytest.raises(spmd.SpmdTypeError, match="not a PartitionSpec"):
        spmd.shard(jnp.ones(2), "dp")
    with pytest.raises(spmd.SpmdError, match="has no axis 'tp'"):
        spmd.shard(jnp.ones(2), P("tp"), mesh=spmd.Mesh(dp=1))
    # an array already sharded: an error at shard(), not a broken ShardedArray inside one
    sharded = {"w": spmd.shard(jnp.ones((2, 2)), P("dp"), mesh=spmd.Mesh(dp=1))}
    with pytest.raises(spmd.SpmdTypeError, match=r"rank 0: shard: \['w'\] is already a Sharded"):
        spmd.shard(sharded, P("dp"), mesh=spmd.Mesh(dp=1))
    # an integer is not an axis name (it raised a bare TypeError)
    for entry in (1, ("dp", 2)):
        with pytest.raises(spmd.SpmdTypeError, match=r"rank 0: .* is not an axis name"):
            spmd.shard(jnp.ones((2, 2)), P(entry))


@multirank(nprocs=(2, 3, 4), timeout=HEAVY)
def test_shard_gather_round_trip_uneven_dtypes(comm):
    n = comm.size
    for dtype in DTYPES:
        for shape in ((7,), (n * 3 + 1, 5), (2, n + 2), (1, 3)):
            x = _full(shape, dtype, seed=len(shape))
            for spec in (P("dp"), P(None, "dp")) if len(shape) == 2 else (P("dp"),):
                s = spmd.shard(x, spec)
                axis = 0 if spec[0] else 1
                chunk = -(-shape[axis] // n)
                assert s.local.shape[axis] == chunk
                # this rank's part is the global array's slice; the padding is zeros
                want = np.asarray(x)[(slice(None),) * axis + (s.index()[axis],)]
                got = np.asarray(s.local)[(slice(None),) * axis + (s.valid()[axis],)]
                np.testing.assert_array_equal(got, want)
                rest = (slice(None),) * axis + (slice(s.valid()[axis].stop, None),)
                padding = np.asarray(s.local)[rest]
                assert not padding.astype(bool).any()
                np.testing.assert_array_equal(s.gather(), x)
                if dtype in (np.float32, jnp.bfloat16):  # under jit too (compiles are slow)
                    np.testing.assert_array_equal(jax.jit(lambda a: a.gather())(s), x)
                assert s.gather().dtype == x.dtype


@multirank(nprocs=(2, 3, 4))
def test_reshard_moves_the_split_and_padding_never_leaks(comm):
    n = comm.size
    x = jnp.arange((n + 1) * (2 * n - 1), dtype=jnp.float32).reshape(n + 1, 2 * n - 1) + 1
    a = spmd.shard(x, P("dp", None))
    # fill the padding with garbage: it must not reach any result
    pad = np.asarray(a.local).copy()
    pad[a.valid()[0].stop :] = np.nan
    a = spmd.ShardedArray(jnp.asarray(pad), a.shape, a.spec, a.mesh)
    b = a.reshard(P(None, "dp"))  # one all_to_all
    want = spmd.shard(x, P(None, "dp"))
    np.testing.assert_array_equal(np.asarray(b.local)[:, b.valid()[1]],
                                  np.asarray(want.local)[:, want.valid()[1]])  # fmt: skip
    np.testing.assert_array_equal(b.gather(), x)
    c = jax.jit(lambda s: s.reshard(P("dp", None)))(b)
    np.testing.assert_array_equal(c.gather(), x)
    r = a.reshard(P())  # replicated: every rank holds everything
    np.testing.assert_array_equal(r.local, x)
    np.testing.assert_array_equal(r.reshard(P(None, "dp")).gather(), x)


@multirank(nprocs=(4,))
def test_mesh_specs_combined_axes_and_replication(comm):
    mesh = spmd.Mesh(dp=2, tp=2)
    x = _full((5, 7), np.float32)
    for spec in (P("dp", "tp"), P("tp", "dp"), P(("dp", "tp")), P(("tp", "dp")), P(None, "tp")):
        s = spmd.shard(x, spec, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(s.local)[s.valid()], np.asarray(x)[s.index()])
        np.testing.assert_array_equal(s.gather(), x)
        for to in (P("dp", "tp"), P(None, ("tp", "dp")), P()):
            np.testing.assert_array_equal(s.reshard(to).gather(), x)
    # 'ep' is dp and tp combined: naming it beside either uses an axis twice (gather() of
    # such an array returned wrong values)
    for spec in (P("dp", "ep"), P("ep", "tp"), P(("ep", "dp"))):
        with pytest.raises(spmd.SpmdError, match=rf"rank {comm.rank}: .* uses a mesh axis twice"):
            spmd.shard(x, spec, mesh=mesh)
    np.testing.assert_array_equal(spmd.shard(x, P("ep"), mesh=mesh).gather(), x)
    # made by hand with trailing entries left out, as JAX allows: the spec is completed
    s = spmd.shard(x, P("dp", None), mesh=mesh)
    short = spmd.ShardedArray(s.local, s.shape, P("dp"), mesh)
    assert short.spec == P("dp", None)
    for to in (P("dp"), P("dp", None), P(None, "dp"), P(None, ("dp", "tp"))):
        np.testing.assert_array_equal(short.reshard(to).gather(), x)
    # meshes of one shape are equal: one pytree type, one trace
    traces = []

    @jax.jit
    def total(a):
        traces.append(1)
        return a.gather().sum()

    for _ in range(3):
        again = spmd.Mesh(dp=2, tp=2)
        assert again == mesh and hash(again) == hash(mesh) and again != spmd.Mesh(tp=2, dp=2)
        b = spmd.shard(x, P("dp", "tp"), mesh=again)
        np.testing.assert_allclose(total(b), np.asarray(x).sum())
    assert len(traces) == 1
    both = jax.tree_util.tree_map(jnp.add, b, spmd.shard(x, P("dp", "tp"), mesh=mesh))
    np.testing.assert_array_equal(both.gather(), 2 * np.asarray(x))
    # ranks that agree on the named axes hold the same shard
    s = spmd.shard(x, P("tp"), mesh=mesh)
    shards = comm.allgather_object(np.asarray(s.local))
    for r in range(4):
        if r % 2 == comm.rank % 2:  # same tp coordinate (tp is the inner axis)
            np.testing.assert_array_equal(shards[r], shards[comm.rank])
        else:
            assert not np.array_equal(shards[r], shards[comm.rank])


@multirank(nprocs=(2, 3))
def test_gather_tree_and_pytree_through_jit(comm):
    tree = {"w": jnp.ones((5, 3)) * 2, "b": jnp.arange(4.0), "step": jnp.int32(7)}
    sharded = {"w": spmd.shard(tree["w"], P("dp")), "b": spmd.shard(tree["b"], P("dp")),
               "step": tree["step"]}  # fmt: skip
    leaves = jax.tree_util.tree_leaves(sharded)
    assert len(leaves) == 3  # one leaf per ShardedArray: its shard

    @jax.jit
    def double(t):
        return jax.tree_util.tree_map(lambda a: a * 2, t)

    out = double(sharded)
    assert isinstance(out["w"], spmd.ShardedArray) and out["w"].shape == (5, 3)
    full = spmd.gather(out)
    np.testing.assert_array_equal(full["w"], tree["w"] * 2)
    np.testing.assert_array_equal(full["b"], tree["b"] * 2)
    assert int(full["step"]) == 14


def _repr_after_finalize():
    comm = spmd.init()
    s = spmd.shard(jnp.arange(5.0), spmd.PartitionSpec("dp"), mesh=spmd.Mesh(dp=comm.size))
    shapes = repr(jax.tree.map(lambda a: a.shape, s))  # a leaf that is not an array
    spmd.finalize()
    return repr(s), s.local.tolist(), shapes


def test_repr_works_after_finalize():
    """The repr used to ask the finalized runtime for the mesh's groups and raise ("MPI was
    finalized ... cannot be initialized again")."""
    results = run(_repr_after_finalize, 2, fresh=True)
    for rank, (text, local, shapes) in enumerate(results):
        assert text == (
            "ShardedArray(shape=(5,), dtype=float32, spec=P('dp',), mesh=Mesh(dp=2), "
            "local_shape=(3,))"
        )
        assert shapes == "ShardedArray(shape=(5,), spec=P('dp',), mesh=Mesh(dp=2), local=(3,))"
        assert local == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]][rank]
