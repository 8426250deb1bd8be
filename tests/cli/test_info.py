"""python -m spmd.info: the environment report."""

import importlib.metadata
import os
import subprocess
import sys

from spmd._native_lib import NATIVE_ABI_VERSION


def test_info_reports_versions_mpi_native_and_devices():
    out = subprocess.run(
        [sys.executable, "-m", "spmd.info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for dist in ("spmd", "jax", "jaxlib", "numpy", "mpi4py"):
        assert f"  {dist}: {importlib.metadata.version(dist)}\n" in text
    assert "collective handlers (cpu): spmd_all_to_all, spmd_all_to_allv, spmd_allgather, " in text
    assert "collective transport: auto" in text
    assert "shared-memory staging: auto (" in text
    assert "MPI library (mpi4py): MPICH Version:" in text
    assert f"native layer: built (ABI {NATIVE_ABI_VERSION}, XLA FFI API " in text
    assert "launcher detected: none (a world of one); rank 0 of 1" in text
    assert "devices:\n  cpu:0" in text


def test_info_under_mpiexec_sees_the_launcher():
    from spmd.launch import mpiexec_argv

    argv = mpiexec_argv(2, [sys.executable, "-m", "spmd.info"])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert (
            f"launcher detected: mpi; rank {rank} of 2 (a PMI launcher (MPICH's mpiexec, srun "
            f"--mpi=pmi2): PMI_RANK={rank}, PMI_SIZE=2)\n" in out.stdout
        ), out.stdout
    assert "MPI start: refused" not in out.stdout


def test_info_says_what_spmd_init_would_refuse_before_mpi_starts():
    # A PMIx launcher's variables with the MPICH wheel, which has no PMIx (docs/slurm.md).
    env = {**os.environ, "PMIX_RANK": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "spmd.info"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    detected = (
        "launcher detected: mpi; rank 1 of ? (a PMIx launcher: PMIX_RANK=1 and no world size)"
    )
    assert detected in out.stdout, out.stdout
    assert (
        "MPI start: refused: a PMIx launcher started this process with PMIx (PMIX_RANK=1), but "
        "mpi4py loaded MPICH" in out.stdout
    ), out.stdout


def test_info_follows_the_settings_spmd_init_follows():
    env = {
        **os.environ,
        "SPMD_COMMUNICATOR": "void",
        "SPMD_TRANSPORT": "shmm",
        "SPMD_SHM_STAGING": "stream",
    }
    out = subprocess.run(
        [sys.executable, "-m", "spmd.info"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "launcher detected: void; rank 0 of 1" in out.stdout
    assert "collective transport: error: SPMD_TRANSPORT='shmm' is not a transport" in out.stdout
    assert "shared-memory staging: error: " in out.stdout
    assert "SPMD_SHM_STAGING='stream' is not a staging mode" in out.stdout
