"""Pin each rank ``spmd-run`` starts to its own share of the cores.

Unpinned, N ranks on N cores each run a thread pool as wide as the machine (XLA's, the BLAS's),
and the scheduler moves them across cores, which slows a data-parallel step (measured in
docs/performance.md, "Pinning"). Open MPI's launcher pins by default for the same reason;
MPICH's does not, so the per-rank wrapper does it, before the user's program starts its threads:

- ``spmd-run`` records the cores it may use (``SPMD_BIND_CPUS``); a rank whose own set is still
  that set (the launcher did not pin it) and whose node holds at most that many ranks takes the
  ``k = cores // local ranks`` cores of its local rank;
- more ranks than cores (oversubscribed) or a launcher that pinned: nothing is changed;
- ``SPMD_BIND=none`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from .._errors import SpmdError

BIND_MODES = ("auto", "none")
# Local rank and local size as launchers announce them (MPICH's Hydra, Open MPI, Slurm).
_LOCAL_VARS = (
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _cpus_text(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def record_cpus(child_env: MutableMapping[str, str]) -> None:
    """In ``spmd-run``: tell the ranks which cores the job may use."""
    if hasattr(os, "sched_getaffinity"):
        child_env["SPMD_BIND_CPUS"] = _cpus_text(os.sched_getaffinity(0))


def recorded_cpus(env: Mapping[str, str]) -> list[int] | None:
    """In a rank: the cores ``spmd-run`` may use, as it recorded them (None outside it)."""
    recorded = env.get("SPMD_BIND_CPUS", "")
    return [int(c) for c in recorded.split(",")] if recorded else None


def bind_mode(env: Mapping[str, str]) -> str:
    mode = env.get("SPMD_BIND", "auto") or "auto"
    if mode not in BIND_MODES:
        raise SpmdError(f"SPMD_BIND={mode!r}; expected one of {', '.join(BIND_MODES)}", rank=None)
    return mode


def local_rank_size(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(local rank, ranks on this node) as the launcher announced them, or None."""
    for rank_var, size_var in _LOCAL_VARS:
        rank, size = env.get(rank_var, ""), env.get(size_var, "")
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return None


def share(cpus: list[int], local_rank: int, local_size: int) -> set[int] | None:
    """The cores of ``local_rank`` out of ``cpus`` shared by ``local_size`` ranks; None when the
    ranks outnumber the cores."""
    if local_size < 2 or local_size > len(cpus) or not 0 <= local_rank < local_size:
        return None
    k = len(cpus) // local_size
    return set(sorted(cpus)[local_rank * k : (local_rank + 1) * k])


def bind_rank(env: Mapping[str, str] | None = None) -> set[int] | None:
    """In the per-rank wrapper: pin every thread of this process to its share of the cores.
    Returns the cores, or None where nothing was changed (see the module doc)."""
    env = os.environ if env is None else env
    if bind_mode(env) == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus, local = recorded_cpus(env), local_rank_size(env)
    if cpus is None or local is None:
        return None
    if os.sched_getaffinity(0) != set(cpus):
        return None  # the launcher pinned this rank: its choice stands
    mine = share(cpus, *local)
    if mine is None:
        return None
    for tid in os.listdir("/proc/self/task"):  # threads already started (BLAS pools) too
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:
            pass  # the thread ended meanwhile
    os.sched_setaffinity(0, mine)
    return mine
