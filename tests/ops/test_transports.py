"""Transports: automatic choice, forcing (API and SPMD_TRANSPORT), the hierarchical path on
simulated nodes, and the file-store communicator (shared memory only)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank, run
from tests import HEAVY

from ._cases import forms, x64
from .test_values import _check, _run_ops


def _all_ops_everywhere(comm, mode):
    with x64():
        for form in forms(comm):
            with form.active():
                out = (
                    _run_ops(form, comm)
                    if mode == "eager"
                    else jax.jit(lambda form=form: _run_ops(form, comm))()
                )
                _check(out, form, comm, mode)


@multirank(nprocs=(2, 3))
def test_auto_is_shm_on_one_node_and_mpi_can_be_forced(comm):
    assert spmd.ops.get_transport() == "shm"
    assert spmd.ops.get_transport(rank_list=[[0]]) in ("self", "shm")
    try:
        spmd.ops.set_transport("mpi")
        assert spmd.ops.get_transport() == "mpi"
        _all_ops_everywhere(comm, "jit")
        with pytest.raises(spmd.SpmdError, match="'hier' is not available"):
            spmd.ops.set_transport("hier")
        assert spmd.ops.get_transport() == "mpi"  # a refused switch changes nothing
        with pytest.raises(spmd.SpmdError, match="unknown"):
            spmd.ops.set_transport("gloo")
    finally:
        spmd.ops.set_transport("auto")
    assert spmd.ops.get_transport() == "shm"


@multirank(nprocs=(3, 4), env={"SPMD_SIMULATE_NODES": "2"}, timeout=HEAVY)
def test_hierarchical_across_simulated_nodes(comm):
    # Nodes of consecutive ranks: 4 ranks -> {0, 1} {2, 3}; 3 ranks -> {0, 1} {2}.
    assert spmd.ops.get_transport() == "hier"
    _all_ops_everywhere(comm, "eager")
    _all_ops_everywhere(comm, "jit")
    # Bit-identical sums on every rank, through shared memory and MPI between the nodes.
    x = jnp.asarray(np.random.default_rng(comm.rank).standard_normal(100_003), jnp.float32)
    y = np.asarray(spmd.allreduce(x))
    assert len({b for b in comm.allgather_object(y.tobytes())}) == 1
    np.testing.assert_allclose(
        y,
        sum(np.random.default_rng(k).standard_normal(100_003) for k in range(comm.size)),
        rtol=1e-4,
        atol=1e-4,
    )
    # From 1 MiB the node-local steps choose their staging (a probe inside each node, and the
    # broadcast back streams): exact integer sums, so any misplaced element shows.
    big = (jnp.arange(300_007) % 1000).astype(jnp.float32) + comm.rank
    want = comm.size * (np.arange(300_007) % 1000) + comm.size * (comm.size - 1) // 2
    np.testing.assert_array_equal(np.asarray(jax.jit(spmd.allreduce)(big)), want)


@multirank(nprocs=(2,), env={"SPMD_SIMULATE_NODES": "2"})
def test_one_rank_per_node_uses_mpi(comm):
    assert spmd.ops.get_transport() == "mpi"
    assert float(spmd.allreduce(jnp.float32(comm.rank + 1))) == 3


@multirank(nprocs=(2, 3), env={"SPMD_TRANSPORT": "mpi"})
def test_transport_from_the_environment(comm):
    assert spmd.ops.get_transport() == "mpi"
    np.testing.assert_array_equal(spmd.allgather(jnp.int32(comm.rank)[None]), np.arange(comm.size))


@multirank(nprocs=(2,), env={"SPMD_TRANSPORT": "hier"})
def test_an_unavailable_transport_fails_every_collective_but_not_point_to_point(comm):
    """hier needs several nodes: every collective raises, the second as the first (never a
    silent fall back to shared memory); send/recv need only MPI and still work; forcing a
    transport the group has makes the collectives work."""
    for _ in range(2):
        with pytest.raises(spmd.SpmdError, match="transport 'hier' is not available"):
            spmd.allreduce(jnp.float32(1))
    if comm.rank == 0:
        spmd.send(jnp.arange(3), dst=1)
    else:
        np.testing.assert_array_equal(spmd.recv(jnp.zeros(3, jnp.int32), src=0), [0, 1, 2])
    try:
        spmd.ops.set_transport("shm")
        assert float(spmd.allreduce(jnp.float32(comm.rank + 1))) == 3
        assert spmd.ops.get_transport() == "shm"
    finally:
        spmd.ops.set_transport("auto")


@multirank(nprocs=(2, 3), launcher="env")
def test_file_store_communicator_runs_on_shared_memory(comm):
    assert comm.backend == "void"
    assert spmd.ops.get_transport() == "shm"
    r, n = comm.rank, comm.size
    assert float(jax.jit(spmd.allreduce)(jnp.float32(r + 1))) == n * (n + 1) / 2
    np.testing.assert_array_equal(spmd.all_to_all(jnp.arange(n) + 10 * r), 10 * np.arange(n) + r)
    with pytest.raises(spmd.SpmdError, match="need MPI"):
        spmd.sendrecv(jnp.ones(2), src=(r - 1) % n, dst=(r + 1) % n)


def _one_rank_inspects_the_world_alone():
    """Rank 0 alone asks for the transport and traces collectives before any rank made one; the
    others go straight to the communicator's own exchanges and then to a collective."""
    comm = spmd.init()
    seen = None
    if comm.rank == 0:
        program = jax.make_jaxpr(lambda v: spmd.allreduce(v))(jnp.ones(2))
        seen = (spmd.ops.get_transport(), "spmd_allreduce" in str(program))
        str(spmd.trace(lambda v: spmd.allgather(v))(jnp.ones(2)))
    comm.barrier()
    ranks = comm.allgather_object(comm.rank)
    total = jax.jit(spmd.allreduce)(jnp.full(2, comm.rank + 1.0))
    return seen, ranks, total.tolist(), spmd.ops.get_transport()


@pytest.mark.parametrize("launcher", ["mpi", "env"])
def test_one_rank_may_trace_collectives_or_ask_the_transport_alone(launcher):
    """The world's transports are prepared in spmd.init; nothing done on one rank alone may
    pair with the others' barrier (it did, and both ranks failed with a bare TypeError)."""
    results = run(_one_rank_inspects_the_world_alone, 2, launcher=launcher, fresh=True)
    assert results[0][0] == ("shm", True)
    assert results[1][0] is None
    for _, ranks, total, transport in results:
        assert (ranks, total, transport) == ([0, 1], [3.0, 3.0], "shm")


def _one_rank_traces_a_new_group_alone():
    comm = spmd.init()
    try:
        if comm.rank == 0:
            jax.make_jaxpr(lambda v: spmd.allreduce(v, rank_list=[[1, 0]]))(jnp.ones(2))
        else:
            comm.barrier()
    except spmd.SpmdError as e:
        return str(e)
    return "no error"


def test_tracing_a_new_group_on_one_rank_alone_is_an_error_not_a_hang():
    """A sub-group is prepared at its first collective (tracing included), which every rank of
    the group must make: one that does it alone while the other waits in its barrier is a
    deadlock, found on both ranks before the timeout, naming both waits."""
    messages = run(_one_rank_traces_a_new_group_alone, 2, env={"SPMD_TIMEOUT": "2"}, fresh=True)
    waits = (
        "rank 0 waits in creating the communicator of ranks [1, 0]; rank 1 waits in "
        "allgather_object on the group of ranks [0, 1]"
    )
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: deadlock: every rank of the job waits"), message
        assert waits in message, message


def _segment_of_a_timed_out_preparation():
    comm = spmd.init()
    sub = spmd.get_communicator([[1, 0]])  # its first rank, world rank 1, makes its segment
    sub.barrier()  # both ranks make the group's channels
    error = None
    if comm.rank == 1:  # prepares the group for collectives alone: times out
        try:
            jax.make_jaxpr(lambda v: spmd.allreduce(v, group=sub))(jnp.ones(2))
        except spmd.SpmdError as e:
            error = str(e)
    prefix = f"spmd-{os.getpid()}-"
    return error, [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def test_a_timed_out_preparation_leaves_no_shared_memory():
    """The rank that made a segment removes its name even when the exchange that follows
    fails (it stayed in /dev/shm until reboot)."""
    (error0, left0), (error1, left1) = run(
        _segment_of_a_timed_out_preparation, 2, env={"SPMD_TIMEOUT": "2"}, fresh=True
    )
    assert error0 is None and error1 is not None
    assert "rank 1: preparing the group for collectives" in error1 and "timed out" in error1
    assert left0 == [] and left1 == []


@multirank(nprocs=(2,), launcher="env", env={"SPMD_SIMULATE_NODES": "2"})
def test_the_file_store_across_nodes_has_no_transport(comm):
    """Shared memory cannot span nodes and the file store has no MPI: every collective raises
    saying so (it said "'mpi' is not available (available: )")."""
    for _ in range(2):
        with pytest.raises(spmd.SpmdError, match=f"rank {comm.rank}: no transport can carry"):
            spmd.allreduce(jnp.float32(1))


def _bad_staging_mode_on_one_rank():
    comm = spmd.init()
    if comm.rank == 1:
        os.environ["SPMD_SHM_STAGING"] = "fast"  # read when a group is prepared
    try:
        jax.jit(lambda v: spmd.allreduce(v, rank_list=[[1, 0]]))(jnp.ones(2))
    except spmd.SpmdError as e:
        return str(e)
    return "no error"


def test_a_bad_staging_mode_on_one_rank_fails_every_rank():
    """SPMD_SHM_STAGING is read as each group's shared memory is prepared: a value that is not
    a mode, on any rank, fails that preparation on every rank, naming the rank and the value."""
    messages = run(_bad_staging_mode_on_one_rank, 2, fresh=True)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: "), message
        assert "rank 1: SPMD_SHM_STAGING='fast' is not a staging mode" in message, message
        assert "expected one of auto, cached, streamed" in message, message


@multirank(nprocs=(1, 2, 3))
def test_shm_hop_probe(comm):
    """The staging probe on its own: a timing on the group's rank 0, NaN elsewhere, None for a
    group of one; a sub-group probes among its own ranks."""
    from spmd.runtime import shm_hop_ns

    hop = shm_hop_ns(comm)
    if comm.size == 1:
        assert hop is None
        return
    if comm.rank == 0:
        assert hop is not None and 0 < hop < 1e7, hop  # ns; 3 ranks on 2 cores yield
    else:
        assert hop is not None and math.isnan(hop)
    sub = spmd.get_communicator([[1, 0]] + [[r] for r in range(2, comm.size)])
    hop = shm_hop_ns(sub)
    if comm.rank == 1:  # rank 0 of the group [1, 0]
        assert hop is not None and 0 < hop < 1e7, hop
    elif comm.rank == 0:
        assert hop is not None and math.isnan(hop)
    else:
        assert hop is None


@multirank(nprocs=(2,), env={"SPMD_SIMULATE_NODES": "2"})
def test_shm_hop_probe_needs_shared_memory(comm):
    from spmd.runtime import shm_hop_ns

    assert shm_hop_ns(comm) is None  # one rank per node: MPI only


def test_former_names_still_work_with_a_deprecation_warning():
    """'backend' names the communicator kind; the transport's former names still work."""
    import subprocess
    import sys

    from spmd.ops._gpu_chain import ChainConfig

    with pytest.warns(DeprecationWarning, match="spmd.ops.set_transport"):
        assert spmd.ops.set_backend is spmd.ops.set_transport
    with pytest.warns(DeprecationWarning, match="spmd.ops.get_transport"):
        assert spmd.ops.get_backend is spmd.ops.get_transport
    with pytest.warns(DeprecationWarning, match="SPMD_GPU_TRANSPORT"):
        assert ChainConfig.from_env({"SPMD_GPU_BACKEND": "nccl"}).transport == "nccl"
    code = "from spmd.runtime import requested_transport; print(requested_transport())"
    env = {k: v for k, v in os.environ.items() if k != "SPMD_TRANSPORT"}
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        env={**env, "SPMD_BACKEND": "mpi"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "mpi"
    assert "DeprecationWarning: SPMD_BACKEND is now SPMD_TRANSPORT" in out.stderr
