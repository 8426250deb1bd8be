"""Finding and calling the MPI launcher that matches the MPI library mpi4py uses."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .._errors import SpmdError


def find_mpiexec(explicit: str | None = None) -> str:
    """``explicit``, else ``SPMD_MPIEXEC``, else the ``mpiexec`` next to this Python (the MPICH
    wheel puts it there), else the first ``mpiexec`` on ``PATH``."""
    for candidate in (explicit, os.environ.get("SPMD_MPIEXEC")):
        if candidate:
            found = shutil.which(candidate)
            if found is None:
                raise SpmdError(
                    f"mpiexec {candidate!r} was not found or is not executable", rank=None
                )
            return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SpmdError(
            "no mpiexec found: install the MPICH wheel (pip install mpich) or a system MPI, "
            "or set SPMD_MPIEXEC to the launcher's path",
            rank=None,
        )
    return found


@functools.cache
def flavor(mpiexec: str) -> str:
    """ "openmpi", "mpich" (Hydra) or "unknown", from ``mpiexec --version``."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "Open MPI" in out or "OpenRTE" in out or "PRRTE" in out:
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out or "Intel" in out:
        return "mpich"
    return "unknown"


def mpiexec_argv(
    nprocs: int, command: list[str], mpiexec: str | None = None, extra: list[str] | None = None
) -> list[str]:
    """The argv that starts ``command`` on ``nprocs`` ranks of this machine."""
    exe = find_mpiexec(mpiexec)
    argv = [exe, "-n", str(nprocs)]
    if flavor(exe) == "openmpi":
        # More ranks than cores is normal for tests; Open MPI refuses it and root unless told.
        argv += ["--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv += ["--allow-run-as-root"]
    return argv + list(extra or []) + command
