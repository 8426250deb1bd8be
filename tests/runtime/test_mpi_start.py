"""Starting MPI: the launcher checked against the MPI library before MPI_Init (where MPICH
would abort) and after it (where every process would be a world of one).

The refusals are pure functions of the environment and of the library's own version string,
read here from the library mpi4py loads; tests/cli/test_slurm.py runs them under a real srun.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spmd.runtime._env import detect
from spmd.runtime._mpi import library_name, refusal_after_init, refusal_before_init

SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
SRUN_PMIX = {**SRUN_TASK, "SLURM_MPI_TYPE": "pmix", "PMIX_RANK": "1", "PMIX_NAMESPACE": "s.1"}
SRUN_PMI2 = {**SRUN_TASK, "SLURM_MPI_TYPE": "pmi2", "PMI_RANK": "1", "PMI_SIZE": "2",
             "PMI_FD": "11"}  # fmt: skip
MPIRUN = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1"}
OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4"


def _clean_env() -> dict[str, str]:
    launcher = ("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_", "SPMD_", "RANK", "WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)}


@pytest.fixture(scope="module")
def mpich() -> str:
    """The version string of the MPI library mpi4py loads (the MPICH wheel's), read without
    starting MPI."""
    code = (
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI; print(MPI.Get_library_version(), end='')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    if not out.stdout.startswith("MPICH Version:"):
        pytest.skip(f"mpi4py loads {library_name(out.stdout)}, not MPICH")
    return out.stdout


def _before(env: dict[str, str], version: str) -> str:
    return refusal_before_init(env, detect(env).launcher, version)


def test_mpich_without_pmix_is_refused_before_mpi_init_under_srun_pmix(mpich):
    message = _before(SRUN_PMIX, mpich)
    assert message.startswith(
        "srun started this task with PMIx (SLURM_MPI_TYPE=pmix: srun --mpi=pmix, or the "
        f"cluster's MpiDefault), but mpi4py loaded {library_name(mpich)}, which has no PMIx"
    )
    assert "Add --mpi=pmi2 to srun" in message
    under_mpirun = _before(MPIRUN, mpich)
    assert under_mpirun.startswith("Open MPI's mpirun started this process with PMIx (PMIX_RANK=1)")
    assert "MPI4PY_LIBMPI" in under_mpirun


def test_pmi_launchers_and_pmix_builds_pass_the_check_before_mpi_init(mpich):
    assert _before(SRUN_PMI2, mpich) == ""
    assert _before({"PMI_RANK": "0", "PMI_SIZE": "2"}, mpich) == ""  # MPICH's mpiexec
    assert _before(SRUN_TASK, mpich) == ""  # srun --mpi=none: found after MPI_Init
    assert _before({}, mpich) == ""  # no launcher: a singleton
    with_pmix = mpich.replace("MPICH configure:", "MPICH configure: --with-pmix=/usr", 1)
    assert _before(SRUN_PMIX, with_pmix) == ""  # an MPICH built with PMIx runs under it
    assert _before(SRUN_PMIX, OPEN_MPI) == ""


def test_srun_without_mpi_type_gets_the_option_to_add(mpich):
    launcher = detect(SRUN_TASK).launcher
    message = refusal_after_init(SRUN_TASK, launcher, 0, 1, mpich)
    assert message == (
        "srun started 2 tasks (SLURM_PROCID=1, SLURM_STEP_NUM_TASKS=2) but MPI sees a world of 1 "
        "in which this process is rank 0: srun gave the tasks no PMI to start MPI with "
        "(--mpi=none, also srun's default where the cluster's MpiDefault is none), so each "
        f"started alone. Add --mpi=pmi2 to srun (mpi4py loaded {library_name(mpich)}): srun "
        "--mpi=pmi2 -n 2 python train.py (docs/slurm.md)"
    )
    assert "Add --mpi=pmix to srun" in refusal_after_init(SRUN_TASK, launcher, 1, 1, OPEN_MPI)
    assert refusal_after_init(SRUN_TASK, launcher, 1, 2, mpich) == ""


def test_another_librarys_launcher_is_named_with_its_variables(mpich):
    launcher = detect(MPIRUN).launcher
    message = refusal_after_init(MPIRUN, launcher, 0, 1, mpich)
    assert message.startswith(
        "Open MPI's mpirun started 2 processes (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2) "
        "but MPI sees a world of 1 in which this process is rank 0: mpi4py loaded an MPI "
        f"library other than the launcher's ({library_name(mpich)}). Use the mpiexec of that "
        "library, or point mpi4py at the launcher's library with MPI4PY_LIBMPI"
    )
    pmix_without_size = {"PMIX_RANK": "1"}
    assert (
        refusal_after_init(pmix_without_size, detect(pmix_without_size).launcher, 0, 1, mpich) == ""
    )


def test_spmd_refuses_before_mpich_aborts_in_mpi_init():
    # MPICH alone aborts in MPI_Init here (PMI_Init fails); spmd.init says why first.
    env = {**_clean_env(), "PMIX_RANK": "1", "PMIX_NAMESPACE": "test.1"}
    out = subprocess.run([sys.executable, "-c", "import spmd; spmd.init()"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "spmd._errors.SpmdError: rank 1: a PMIx launcher started this process with PMIx "
        "(PMIX_RANK=1), but mpi4py loaded MPICH"
    ), out.stderr
    assert "MPI_Init_thread" not in out.stderr, out.stderr  # MPI was never started


def test_deferred_initialization_keeps_mpi4pys_settings(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(
        "import mpi4py, spmd\n"
        "comm = spmd.init()\n"
        "from mpi4py import MPI\n"
        "print(comm.rank, comm.size, MPI.Query_thread() == MPI.THREAD_MULTIPLE,\n"
        "      MPI.COMM_WORLD.Get_errhandler() == MPI.ERRORS_RETURN,\n"
        "      mpi4py.rc.initialize, mpi4py.rc.finalize, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-m", "spmd.cli.run", "-n", "2", sys.executable,
                          str(script)], env=_clean_env(), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line[:1].isdigit())
    assert lines == ["0 2 True True True None", "1 2 True True True None"], out.stdout


def test_open_mpis_mpirun_with_the_mpich_wheel_is_refused_on_every_rank_before_mpi_init():
    """The real route: a system Open MPI's mpiexec (SPMD_TEST_OPENMPI_SYSTEM, which .ci/run sets
    to Debian's) starting processes whose mpi4py loads the MPICH wheel. MPICH would abort in
    MPI_Init ("unsupported PMI version PMIx"); spmd refuses first, on every rank, by its rank."""
    mpiexec = os.environ.get("SPMD_TEST_OPENMPI_SYSTEM")
    if not mpiexec:
        pytest.skip("SPMD_TEST_OPENMPI_SYSTEM is not set: no system Open MPI to start ranks")
    out = subprocess.run(
        [mpiexec, "--oversubscribe", "--allow-run-as-root", "-n", "2", sys.executable, "-c",
         "import spmd; spmd.init(); print('started')"],
        capture_output=True, text=True, timeout=120, env=_clean_env(),
    )  # fmt: skip
    assert out.returncode != 0 and "started" not in out.stdout, out.stdout + out.stderr
    for rank in (0, 1):
        assert (
            f"SpmdError: rank {rank}: Open MPI's mpirun started this process with PMIx "
            f"(PMIX_RANK={rank}), but mpi4py loaded MPICH"
        ) in out.stderr, out.stderr
    assert "unsupported PMI version" not in out.stderr
