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
    assert "launcher detected: mpi; rank 0 of 2" in out.stdout
    assert "launcher detected: mpi; rank 1 of 2" in out.stdout


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
