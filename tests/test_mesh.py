"""Meshes: AITER's layout ExternalDP x DP x PP x TP, groups, coordinates, the derived ep axis."""

import numpy as np
import pytest

import spmd
from spmd.mesh import layout_rank_lists
from spmd.testing import multirank, run


def test_aiter_example_dp2_tp4():
    shape = {"dp": 2, "tp": 4}
    assert layout_rank_lists(shape, ("tp",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout_rank_lists(shape, ("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout_rank_lists(shape, ("dp", "tp")) == [list(range(8))]


@pytest.mark.parametrize(
    "edp, dp, pp, tp", [(1, 2, 1, 4), (2, 2, 2, 2), (1, 3, 2, 2), (2, 1, 3, 2)]
)
def test_groups_match_aiter_formulas(edp, dp, pp, tp):
    """AITER forms its groups by reshaping and transposing a 4-D rank tensor; ours must give
    the same groups (as sets: the order of groups may differ)."""
    ranks = np.arange(edp * dp * pp * tp).reshape(edp, dp, pp, tp)
    aiter = {
        ("tp",): ranks.reshape(-1, tp),
        ("pp",): ranks.transpose(0, 1, 3, 2).reshape(-1, pp),
        ("dp",): ranks.transpose(0, 3, 2, 1).reshape(-1, dp),
        ("dp", "tp"): ranks.transpose(0, 2, 1, 3).reshape(-1, dp * tp),
    }
    shape = {"edp": edp, "dp": dp, "pp": pp, "tp": tp}
    for axes, groups in aiter.items():
        ours = layout_rank_lists(shape, axes)
        assert sorted(map(tuple, ours)) == sorted(map(tuple, groups.tolist())), axes


def mesh_dp2_tp4():
    comm = spmd.init()
    mesh = spmd.Mesh(dp=2, tp=4)
    tp, dp, ep = mesh.group("tp"), mesh.group("dp"), mesh.group("ep")
    return {
        "rank_lists": {a: mesh.rank_lists(a) for a in ("tp", "dp", "ep")},
        "coords": mesh.coords(),
        "tp": (tp.rank, tp.size, tp.ranks, tp.group_id, sum(tp.allgather_object(comm.rank))),
        "dp": (dp.rank, dp.size, dp.ranks, dp.group_id, sum(dp.allgather_object(comm.rank))),
        "ep_is_world": ep is comm,
    }


def test_mesh_dp2_tp4_on_8_ranks():
    results = run(mesh_dp2_tp4, 8, fresh=True)
    for r, got in enumerate(results):
        assert got["rank_lists"] == {
            "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "ep": [[0, 1, 2, 3, 4, 5, 6, 7]],
        }
        assert got["coords"] == {"dp": r // 4, "tp": r % 4}
        tp_ranks = tuple(range(4 * (r // 4), 4 * (r // 4) + 4))
        assert got["tp"] == (r % 4, 4, tp_ranks, r // 4, sum(tp_ranks))
        assert got["dp"] == (r // 4, 2, (r % 4, r % 4 + 4), r % 4, 2 * (r % 4) + 4)
        assert got["ep_is_world"]


def mesh_dp2_pp2_tp2():
    mesh = spmd.Mesh(dp=2, pp=2, tp=2)
    return {a: mesh.group(a).ranks for a in ("dp", "pp", "tp", "ep")}, mesh.coords()


def test_mesh_with_pipeline_axis_on_8_ranks():
    results = run(mesh_dp2_pp2_tp2, 8, fresh=True)
    # rank = 4*dp + 2*pp + tp
    for r, (groups, coords) in enumerate(results):
        d, p, t = r // 4, (r // 2) % 2, r % 2
        assert coords == {"dp": d, "pp": p, "tp": t}
        assert groups["tp"] == (4 * d + 2 * p, 4 * d + 2 * p + 1)
        assert groups["pp"] == (4 * d + t, 4 * d + 2 + t)
        assert groups["dp"] == (2 * p + t, 4 + 2 * p + t)
        # ep: dp x tp within one pp stage
        assert groups["ep"] == (2 * p, 2 * p + 1, 4 + 2 * p, 5 + 2 * p)


@multirank(nprocs=(1, 2, 3, 4))
def test_mesh_shapes_and_errors(comm):
    n = comm.size
    mesh = spmd.Mesh(dp=-1)
    assert dict(mesh.shape) == {"dp": n} and mesh.size == n
    assert mesh.rank_lists("dp") == [list(range(n))] and mesh.group("dp") is comm
    assert mesh.index("dp") == comm.rank and mesh.rank_lists("ep") == [list(range(n))]
    with pytest.raises(
        spmd.SpmdError,
        match=rf"rank {comm.rank}: Mesh\(dp=2, tp={n + 1}\) has "
        rf"{2 * n + 2} ranks but the world has {n}",
    ):
        spmd.Mesh(dp=2, tp=n + 1)
    with pytest.raises(
        spmd.SpmdError,
        match=rf"rank {comm.rank}: .* has no axis 'pp'.*not taken as size 1 .* add it as pp=1",
    ):
        mesh.rank_lists("pp")
    with pytest.raises(spmd.SpmdError, match=r"may infer \(-1\) at most one axis"):
        spmd.Mesh(dp=-1, tp=-1)
    with pytest.raises(spmd.SpmdError, match=r"tp=0 must be >= 1"):
        spmd.Mesh(dp=n, tp=0)
    with pytest.raises(spmd.SpmdTypeError, match=r"tp=2.0 is not an integer size"):
        spmd.Mesh(dp=n, tp=2.0)
    with pytest.raises(spmd.SpmdError, match=r"no 'dp' or 'tp' axis"):
        spmd.Mesh(pp=n).rank_lists("ep")
    assert dict(spmd.Mesh(dp=np.int64(n)).shape) == {"dp": n}
    with pytest.raises(spmd.SpmdError, match=r"\('dp', 'ep'\) uses a mesh axis twice \('ep' is dp"):
        mesh.rank_lists(("dp", "ep"))
    if n == 4:
        mesh = spmd.Mesh(dp=2, tp=-1)
        assert dict(mesh.shape) == {"dp": 2, "tp": 2}
        assert mesh.group("tp").ranks == ((0, 1) if comm.rank < 2 else (2, 3))
        with pytest.raises(spmd.SpmdError, match="world size 4 is not divisible by 3"):
            spmd.Mesh(dp=3, tp=-1)
        # 'ep' inside a tuple of axes means dp and tp as well
        pp = spmd.Mesh(pp=2, tp=2)
        assert pp.rank_lists(("pp", "ep")) == pp.rank_lists(("pp", "tp")) == [[0, 1, 2, 3]]
    assert spmd.current_mesh() is None
    with mesh:
        assert spmd.current_mesh() is mesh
        with spmd.Mesh(dp=n) as inner:
            assert spmd.current_mesh() is inner
        assert spmd.current_mesh() is mesh
    assert spmd.current_mesh() is None


@multirank(nprocs=(4,))
def test_jitted_axis_names_follow_the_active_mesh(comm):
    """A jitted function (and a data_parallel step) whose collectives name a mesh axis resolves
    it when traced: under a mesh of another shape it is traced again, not run with the first
    mesh's groups; back under the first shape it reuses that trace."""
    import jax
    import jax.numpy as jnp

    r = comm.rank
    traces = []

    @jax.jit
    def tp_sum(x):
        traces.append(1)
        return spmd.allreduce(x, group="tp")

    x = jnp.float32(r + 1)
    with spmd.Mesh(dp=2, tp=2):
        assert float(tp_sum(x)) == (3.0 if r < 2 else 7.0)
    with spmd.Mesh(tp=4):
        assert float(tp_sum(x)) == 10.0
    with spmd.Mesh(dp=2, tp=2):
        assert float(tp_sum(x)) == (3.0 if r < 2 else 7.0)
    assert len(traces) == 2

    step = spmd.data_parallel(group="dp", average=False)(
        lambda w, x: spmd.grad(lambda w, x: jnp.sum(w * x))(w, x)
    )
    w = jnp.ones(2)
    with spmd.Mesh(dp=2, tp=2):  # dp groups [0, 2], [1, 3]
        np.testing.assert_array_equal(step(w, jnp.full(2, r + 1.0)), [(r % 2) * 2 + 4.0] * 2)
    with spmd.Mesh(dp=4, tp=1):
        np.testing.assert_array_equal(step(w, jnp.full(2, r + 1.0)), [10.0] * 2)
