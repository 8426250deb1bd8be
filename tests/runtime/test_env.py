"""Launcher detection and node identity: pure functions of the environment."""

import pytest

from spmd import SpmdError
from spmd.runtime._env import detect, node_id, stall_warn_seconds, timeout_seconds


def test_no_launcher_is_a_world_of_one():
    info = detect({})
    assert (info.communicator, info.rank, info.size) == (None, 0, 1)


# Each launcher's variables as it sets them (Open MPI's mpirun and srun --mpi=pmix set PMIX_RANK
# too; srun --mpi=pmi2 sets PMI_* beside SLURM_*): rank and size come from one launcher.
_SRUN_STEP = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
              "SLURM_STEP_ID": "0"}  # fmt: skip


@pytest.mark.parametrize(
    "env, rank, size, launcher",
    [
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 3, 4, "a PMI "),  # MPICH / Intel MPI (Hydra)
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1"},
            1,
            2,
            "Open MPI",
        ),
        ({"PMIX_RANK": "2"}, 2, None, "a PMIx"),  # PMIx alone says no size
        ({**_SRUN_STEP, "PMIX_RANK": "5", "SLURM_MPI_TYPE": "pmix"}, 5, 8, "a PMIx"),
        ({**_SRUN_STEP, "PMIX_RANK": "5", "SLURM_MPI_TYPE": "pmix_v4"}, 5, 8, "a PMIx"),
        (
            {**_SRUN_STEP, "PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_MPI_TYPE": "pmi2"},
            5,
            8,
            "a PMI ",
        ),
        ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "3"}, 0, 3, "MVAPICH2"),
        (_SRUN_STEP, 5, 8, "srun"),  # srun --mpi=none
        ({**_SRUN_STEP, "SLURM_STEP_NUM_TASKS": ""}, 5, 8, "srun"),  # SLURM_NTASKS then
    ],
)
def test_mpi_launchers(env, rank, size, launcher):
    info = detect(env)
    assert (info.communicator, info.rank, info.size) == ("mpi", rank, size)
    assert info.launcher is not None and info.launcher.name.startswith(launcher)


def test_pmix_takes_slurms_size_only_from_the_task_srun_started():
    # MPICH's mpiexec or Open MPI's mpirun inside an allocation starts its daemons with srun:
    # a daemon's SLURM_PROCID is its node's number, not the rank.
    env = {**_SRUN_STEP, "PMIX_RANK": "3", "SLURM_MPI_TYPE": "pmix"}
    assert detect(env).size is None
    env = {**_SRUN_STEP, "PMIX_RANK": "5", "SLURM_MPI_TYPE": "pmi2"}
    assert detect(env).size is None
    mpiexec_in_allocation = {**_SRUN_STEP, "PMI_RANK": "1", "PMI_SIZE": "4"}
    assert (detect(mpiexec_in_allocation).rank, detect(mpiexec_in_allocation).size) == (1, 4)


def test_slurm_batch_script_is_not_a_launched_task():
    assert detect({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"}).communicator is None


def test_torchrun_style_env_with_store_is_void():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "SPMD_FILE_STORE_PATH": "/tmp/x"}
    info = detect(env)
    assert (info.communicator, info.rank, info.size) == ("void", 2, 4)
    assert info.store_path == "/tmp/x"


def test_store_wins_over_mpi_env():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SPMD_FILE_STORE_PATH": "/s", "PMI_RANK": "1"}
    assert detect(env).communicator == "void"


def test_torchrun_style_env_without_store_is_an_error():
    with pytest.raises(SpmdError, match=r"rank 2: RANK=2 WORLD_SIZE=4 .*SPMD_FILE_STORE_PATH"):
        detect({"RANK": "2", "WORLD_SIZE": "4"})


def test_requested_void_under_mpiexec_takes_the_mpi_rank():
    info = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "SPMD_FILE_STORE_PATH": "/s"}, "void")
    assert (info.communicator, info.rank, info.size) == ("void", 1, 2)


def test_requested_void_without_store_for_many_ranks_is_an_error():
    with pytest.raises(SpmdError, match="needs SPMD_FILE_STORE_PATH"):
        detect({"RANK": "0", "WORLD_SIZE": "2"}, "void")


@pytest.mark.parametrize(
    "env, rank, size",
    [
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1"}, 1, 2),
        ({**_SRUN_STEP, "PMIX_RANK": "5", "SLURM_MPI_TYPE": "pmix"}, 5, 8),
        (_SRUN_STEP, 5, 8),
    ],
)
def test_requested_void_takes_rank_and_size_from_one_launcher(env, rank, size):
    info = detect({**env, "SPMD_FILE_STORE_PATH": "/s"}, "void")
    assert (info.communicator, info.rank, info.size) == ("void", rank, size)


def test_requested_void_under_a_launcher_that_gives_no_size_is_an_error_on_every_rank():
    for rank in range(3):
        with pytest.raises(SpmdError) as e:
            detect({"PMIX_RANK": str(rank), "SPMD_FILE_STORE_PATH": "/s"}, "void")
        assert str(e.value) == (
            f"rank {rank}: the 'void' communicator needs the number of processes, but a PMIx "
            f"launcher gave only this process's rank (PMIX_RANK={rank} and no world size). Set "
            "RANK and WORLD_SIZE for every process, or use the 'mpi' communicator"
        )


def test_requested_void_with_half_of_torchruns_pair_is_an_error():
    with pytest.raises(SpmdError, match=r"rank 1: RANK=1 WORLD_SIZE=<unset>: .* set both"):
        detect({"RANK": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}, "void")


def test_requested_mpi_without_launcher_is_a_singleton():
    assert detect({}, "mpi").communicator == "mpi"


def test_unknown_communicator():
    with pytest.raises(SpmdError, match="unknown communicator 'nccl'; expected one of mpi, void"):
        detect({}, "nccl")  # type: ignore[arg-type]


def test_bad_integer_names_the_variable():
    with pytest.raises(SpmdError, match="RANK='one' is not an integer"):
        detect({"RANK": "one", "WORLD_SIZE": "2"})


def test_rank_outside_world():
    with pytest.raises(SpmdError, match="RANK=4 is outside WORLD_SIZE=4"):
        detect({"RANK": "4", "WORLD_SIZE": "4", "SPMD_FILE_STORE_PATH": "/s"})


def test_node_id_order():
    assert node_id({"SPMD_NODE_ID": "n7", "SPMD_SIMULATE_NODES": "2"}, 0, 4) == "n7"
    ids = [node_id({"SPMD_SIMULATE_NODES": "2"}, r, 4) for r in range(4)]
    assert ids[0] == ids[1] != ids[2] == ids[3]
    ids = [node_id({"SPMD_SIMULATE_NODES": "3"}, r, 6) for r in range(6)]
    assert [ids.index(i) for i in ids] == [0, 0, 2, 2, 4, 4]
    import socket

    assert node_id({}, 0, 1) == socket.gethostname()


def test_simulated_nodes_out_of_range():
    with pytest.raises(SpmdError, match="SPMD_SIMULATE_NODES=5 must be between 1 and"):
        node_id({"SPMD_SIMULATE_NODES": "5"}, 0, 4)


def test_timeout_seconds():
    assert timeout_seconds({}) == 300.0
    assert timeout_seconds({"SPMD_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(SpmdError, match="SPMD_TIMEOUT='-1' must be positive"):
        timeout_seconds({"SPMD_TIMEOUT": "-1"})
    with pytest.raises(SpmdError, match="SPMD_TIMEOUT='0' must be positive"):
        timeout_seconds({"SPMD_TIMEOUT": "0"})


def test_stall_warn_seconds():
    assert stall_warn_seconds({}) == 30.0
    assert stall_warn_seconds({"SPMD_STALL_WARN": "0"}) == 0.0  # off
    with pytest.raises(SpmdError, match="SPMD_STALL_WARN='-2' must be 0 \\(off\\) or more"):
        stall_warn_seconds({"SPMD_STALL_WARN": "-2"})
    with pytest.raises(SpmdError, match="SPMD_STALL_WARN='soon' is not a number of seconds"):
        stall_warn_seconds({"SPMD_STALL_WARN": "soon"})


def test_a_node_with_fewer_gpus_than_processes_is_an_error_that_says_so():
    from spmd.runtime._device import too_few_devices

    assert too_few_devices(2, 2, 0) == ""
    assert too_few_devices(1, 8, 0) == ""
    assert too_few_devices(4, None, 0) == ""  # no driver: nothing is known
    assert too_few_devices(4, 0, 0) == ""  # a driver without GPUs: JAX runs on CPU
    message = too_few_devices(2, 1, 3)
    assert message.startswith("2 processes run on the node of rank 3, which has 1 GPU(s)")
    assert "start at most 1 per node" in message and "SPMD_BIND_DEVICE=0" in message


def test_jax_platforms_can_keep_the_binding_off_the_gpu():
    from spmd.runtime._device import _platforms_allow

    assert _platforms_allow("", "cuda")
    assert not _platforms_allow("cpu", "cuda")
    assert _platforms_allow("cuda,cpu", "cuda") and not _platforms_allow("cuda,cpu", "rocm")
