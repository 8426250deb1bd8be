"""Starting MPI for the world communicator, and the checks of the launcher against the MPI
library mpi4py loaded.

Two ways a launcher and a library fail to meet. One aborts inside ``MPI_Init``, before spmd can
say anything: the MPICH wheel has no PMIx, and under ``srun --mpi=pmix`` (or Open MPI's mpirun)
it stops the process with "Runtime environment uses unsupported PMI version PMIx". So mpi4py is
imported with MPI's initialization deferred (``mpi4py.rc.initialize``), the library is asked
what it is (``MPI_Get_library_version`` may be called before ``MPI_Init``), and spmd refuses
with the fix before ``MPI_Init`` runs. The other passes ``MPI_Init`` and leaves every process a
world of one (``srun`` without ``--mpi`` where the cluster's default is ``none``, or another
MPI's launcher): the launcher's world size, read from the environment, then differs from
MPI's, and spmd refuses after ``MPI_Init``. Both refusals name the rank the launcher gave.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .._errors import SpmdError
from ._env import SRUN, Launcher, LaunchInfo, in_srun_step


def library_name(version: str) -> str:
    """A short name of the MPI library from ``MPI_Get_library_version``: ``MPICH 5.0.2``,
    ``Open MPI v4.1.4``."""
    first = version.strip().splitlines()[0] if version.strip() else "an unknown MPI library"
    if first.startswith("MPICH Version:"):
        return "MPICH " + first.removeprefix("MPICH Version:").strip()
    return first.split(",")[0].strip()


def _mpich_without_pmix(version: str) -> bool:
    """MPICH itself (not a derivative) whose build has no PMIx (its configure line says)."""
    if not version.startswith("MPICH Version:"):
        return False
    lines = version.splitlines()
    configure = next((line for line in lines if line.startswith("MPICH configure:")), version)
    return "pmix" not in configure.lower()


def _srun_mpi_option(version: str) -> str:
    """The ``srun --mpi`` type the library speaks."""
    if version.startswith(("MPICH", "Intel", "MVAPICH")):
        return "--mpi=pmi2"
    if version.startswith("Open MPI"):
        return "--mpi=pmix"
    return "--mpi=pmi2 or --mpi=pmix, whichever it supports (srun --mpi=list shows the types)"


def refusal_before_init(env: Mapping[str, str], launcher: Launcher | None, version: str) -> str:
    """Why ``MPI_Init`` would abort in this environment with this library, and the fix; ``""``
    where nothing is known to stop it."""
    pmix_only = "PMIX_RANK" in env and "PMI_RANK" not in env and "PMI_FD" not in env
    if not (pmix_only and _mpich_without_pmix(version)):
        return ""
    library = library_name(version)
    mpi_type = env.get("SLURM_MPI_TYPE", "")
    if mpi_type.startswith("pmix") and in_srun_step(env):
        return (
            f"srun started this task with PMIx (SLURM_MPI_TYPE={mpi_type}: srun "
            f"--mpi={mpi_type}, or the cluster's MpiDefault), but mpi4py loaded {library}, which "
            "has no PMIx and would abort in MPI_Init. Add --mpi=pmi2 to srun: srun --mpi=pmi2 "
            "-n N python train.py (in a batch script too; docs/slurm.md)"
        )
    started = launcher.name if launcher is not None else "the launcher"
    return (
        f"{started} started this process with PMIx (PMIX_RANK={env['PMIX_RANK']}), but "
        f"mpi4py loaded {library}, which has no PMIx and would abort in MPI_Init. Start the job "
        "with that library's launcher (spmd-run, or MPICH's mpiexec), or point mpi4py at the "
        "launcher's MPI library with MPI4PY_LIBMPI (README, 'Using a system MPI')"
    )


def refusal_after_init(
    env: Mapping[str, str], launcher: Launcher | None, mpi_rank: int, mpi_size: int, version: str
) -> str:
    """Why the launcher's world and MPI's differ, and the fix; ``""`` where they agree (or the
    launcher does not say how many processes it started)."""
    if launcher is None or launcher.size is None or launcher.size == mpi_size:
        return ""
    library = library_name(version)
    seen = f"MPI sees a world of {mpi_size}"
    if mpi_rank != launcher.rank:
        seen += f" in which this process is rank {mpi_rank}"
    option = _srun_mpi_option(version)
    if launcher.name == SRUN:  # no PMI variables: srun gave the tasks nothing to start MPI with
        mpi_type = env.get("SLURM_MPI_TYPE")
        how = (
            f"SLURM_MPI_TYPE={mpi_type}"
            if mpi_type
            else "--mpi=none, also srun's default where the cluster's MpiDefault is none"
        )
        return (
            f"srun started {launcher.size} tasks ({launcher.describe()}) but {seen}: srun gave "
            f"the tasks no PMI to start MPI with ({how}), so each started alone. Add {option} to "
            f"srun (mpi4py loaded {library}): srun {option.split()[0]} -n {launcher.size} python "
            "train.py (docs/slurm.md)"
        )
    fix = (
        f"Under srun, give the --mpi type that library speaks: {option}"
        if in_srun_step(env)
        else "Use the mpiexec of that library, or point mpi4py at the launcher's library with "
        "MPI4PY_LIBMPI (README, 'Using a system MPI')"
    )
    return (
        f"{launcher.name} started {launcher.size} processes ({launcher.describe()}) but {seen}: "
        f"mpi4py loaded an MPI library other than the launcher's ({library}). {fix}."
    )


def start_mpi(launch: LaunchInfo, env: Mapping[str, str]) -> Any:
    """mpi4py's ``MPI`` module with MPI initialized, after the check that must come before
    ``MPI_Init``. Raises :class:`spmd.SpmdError` naming the launcher's rank where the launcher
    and the library cannot work together.

    mpi4py initializes MPI when ``mpi4py.MPI`` is first imported, unless ``mpi4py.rc.initialize``
    is false; here the import defers it, ``MPI_Init_thread`` follows with mpi4py's own settings
    (``rc.threads``, ``rc.thread_level``), and MPI is finalized at exit as when mpi4py starts it
    (unless ``rc.finalize`` says otherwise). Where ``mpi4py.MPI`` was imported already, or
    ``MPI4PY_RC_INITIALIZE`` is set (mpi4py reads it in place of ``rc``), the import is
    mpi4py's own, and MPI is started here only if that import did not start it.
    """
    import mpi4py

    rc = mpi4py.rc
    if "mpi4py.MPI" not in sys.modules and "MPI4PY_RC_INITIALIZE" not in env:
        initialize, finalize = rc.initialize, rc.finalize
        rc.initialize = False
        rc.finalize = True if finalize is None else finalize
        try:
            from mpi4py import MPI
        finally:
            rc.initialize, rc.finalize = initialize, finalize
    from mpi4py import MPI

    if not MPI.Is_initialized():
        refusal = refusal_before_init(env, launch.launcher, MPI.Get_library_version())
        if refusal:
            raise SpmdError(refusal, rank=launch.rank)
        if rc.threads:
            MPI.Init_thread(getattr(MPI, f"THREAD_{str(rc.thread_level).upper()}"))
        else:
            MPI.Init()
    return MPI
