"""What the launcher told this process: launcher detection and node identity.

Pure functions of the environment; nothing here talks to other processes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .._errors import SpmdError

CommunicatorName = Literal["mpi", "void"]
COMMUNICATOR_NAMES: tuple[CommunicatorName, ...] = ("mpi", "void")

# The MPI launchers, each with the variable that carries this process's rank and the one that
# carries the number of processes, both read from the same launcher. Tried in this order: the
# first whose rank variable is set wins. Open MPI also sets PMIX_RANK, without a size, so it comes
# before PMIx; Slurm's own variables come last, because MPICH's mpiexec and Open MPI's mpirun
# inside an allocation start their daemons with srun, which gives the ranks the daemons' SLURM_*.
_PMI = "a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)"
_OMPI = "Open MPI's mpirun"
_PMIX = "a PMIx launcher"
_MV2 = "MVAPICH2"
SRUN = "srun"
_MPI_LAUNCHERS: tuple[tuple[str, str, str], ...] = (
    (_PMI, "PMI_RANK", "PMI_SIZE"),
    (_OMPI, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    (_PMIX, "PMIX_RANK", ""),  # the size: Slurm's, for srun --mpi=pmix (_pmix_size)
    (_MV2, "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
    (SRUN, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
)


@dataclass(frozen=True)
class Launcher:
    """What one launcher announced: its name, this process's rank, the number of processes
    (None where the launcher does not say), and the variables they came from."""

    name: str
    rank: int
    size: int | None
    rank_var: str
    size_var: str | None

    def describe(self) -> str:
        """The variables, as a user would set them: ``SLURM_PROCID=1, SLURM_STEP_NUM_TASKS=2``."""
        size = f", {self.size_var}={self.size}" if self.size_var else " and no world size"
        return f"{self.rank_var}={self.rank}{size}"


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about this process before any communication.

    A launcher's ``LOCAL_RANK`` is not taken: local ranks derive from node identity, the same
    way under every launcher."""

    communicator: CommunicatorName | None  # None: a world of one
    rank: int
    size: int | None  # None when the launcher does not say (MPI will)
    store_path: str | None = None
    launcher: Launcher | None = None  # the MPI launcher that started this process, if one did


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise SpmdError(
            f"environment variable {name}={value!r} is not an integer", rank=None
        ) from None


def in_srun_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task that srun started (not a batch script, nor a login)."""
    return "SLURM_STEP_ID" in env and _int(env, "SLURM_PROCID") is not None


def _srun_size(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    size = _int(env, "SLURM_STEP_NUM_TASKS")
    if size is not None:
        return size, "SLURM_STEP_NUM_TASKS"
    return _int(env, "SLURM_NTASKS"), "SLURM_NTASKS"


def _pmix_size(env: Mapping[str, str], rank: int) -> tuple[int | None, str | None]:
    """The world size of a PMIx launch, where the launcher says it: a task srun started with
    --mpi=pmix (its PMIx rank is its Slurm rank). PMIx itself has no variable for it."""
    slurm_mpi = env.get("SLURM_MPI_TYPE", "")
    if slurm_mpi.startswith("pmix") and in_srun_step(env) and _int(env, "SLURM_PROCID") == rank:
        return _srun_size(env)
    return None, None


def mpi_launcher(env: Mapping[str, str]) -> Launcher | None:
    """The MPI launcher (mpiexec, mpirun, srun) that started this process, or None."""
    for name, rank_var, size_var in _MPI_LAUNCHERS:
        rank = _int(env, rank_var)
        if rank is None:
            continue
        size: int | None
        if name == SRUN:
            if not in_srun_step(env):
                continue  # a batch script, not a task started by srun
            size, found_var = _srun_size(env)
        elif name == _PMIX:
            size, found_var = _pmix_size(env, rank)
        else:
            size, found_var = _int(env, size_var), size_var
        return Launcher(name, rank, size, rank_var, found_var if size is not None else None)
    return None


def mpi_rank_size(env: Mapping[str, str]) -> tuple[int, int | None] | None:
    """(rank, size) announced by an MPI launcher (mpiexec, srun), or None outside one."""
    found = mpi_launcher(env)
    return None if found is None else (found.rank, found.size)


def detect(env: Mapping[str, str], requested: CommunicatorName | None = None) -> LaunchInfo:
    """Decide which world communicator this process belongs to.

    Order: an explicit request; ``RANK``/``WORLD_SIZE`` with ``SPMD_FILE_STORE_PATH`` (a
    torchrun-style launcher) -> "void"; an MPI launcher's variables -> "mpi"; otherwise a world
    of one. Rank and size always come from one launcher: torchrun's pair, or one MPI launcher's.
    """
    rank = _int(env, "RANK")
    size = _int(env, "WORLD_SIZE")
    store = env.get("SPMD_FILE_STORE_PATH") or None
    mpi = mpi_launcher(env)

    if requested is None:
        if store is not None and rank is not None and size is not None:
            requested = "void"
        elif mpi is not None:
            requested = "mpi"
        elif size is not None and size > 1:
            raise SpmdError(
                f"RANK={rank} WORLD_SIZE={size} say this is one of {size} processes "
                "started by a torchrun-style launcher, but SPMD_FILE_STORE_PATH is not set. spmd "
                "exchanges bootstrap data between such processes through files: set "
                "SPMD_FILE_STORE_PATH to a directory all ranks can reach, e.g. "
                "SPMD_FILE_STORE_PATH=$(mktemp -d) torchrun ...",
                rank=rank,
            )
        else:
            return LaunchInfo(None, 0, 1)

    if requested == "mpi":
        if mpi is None:
            # MPI started without a launcher (singleton init) is a legal world of one.
            return LaunchInfo("mpi", 0, None)
        return LaunchInfo("mpi", mpi.rank, mpi.size, launcher=mpi)

    if requested == "void":
        if rank is not None or size is not None:
            if rank is None or size is None:
                raise SpmdError(
                    f"RANK={_shown(env, 'RANK')} WORLD_SIZE={_shown(env, 'WORLD_SIZE')}: the "
                    "'void' communicator takes this process's rank and the number of processes "
                    "together, from both variables; set both, or neither under an MPI launcher",
                    rank=rank if rank is not None else (mpi.rank if mpi else None),
                )
        elif mpi is not None:
            if mpi.size is None:
                raise SpmdError(
                    f"the 'void' communicator needs the number of processes, but {mpi.name} "
                    f"gave only this process's rank ({mpi.describe()}). Set RANK and WORLD_SIZE "
                    "for every process, or use the 'mpi' communicator",
                    rank=mpi.rank,
                )
            rank, size = mpi.rank, mpi.size
        else:
            rank, size = 0, 1
        if not 0 <= rank < size:
            raise SpmdError(f"RANK={rank} is outside WORLD_SIZE={size}", rank=rank)
        if size > 1 and store is None:
            raise SpmdError(
                f"the 'void' communicator with WORLD_SIZE={size} needs "
                "SPMD_FILE_STORE_PATH, a directory shared by all ranks, to exchange bootstrap data",
                rank=rank,
            )
        return LaunchInfo("void", rank, size, store, launcher=mpi)

    raise SpmdError(
        f"unknown communicator {requested!r}; expected one of {', '.join(COMMUNICATOR_NAMES)}",
        rank=None,
    )


def _shown(env: Mapping[str, str], name: str) -> str:
    return env[name] if env.get(name) else "<unset>"


def node_id(env: Mapping[str, str], rank: int, size: int) -> str:
    """This process's node identity.

    ``SPMD_NODE_ID`` (any string) wins; else ``SPMD_SIMULATE_NODES=K`` splits the world into K
    simulated nodes of consecutive ranks (for testing multi-node code paths on one machine); else
    the hostname.
    """
    explicit = env.get("SPMD_NODE_ID")
    if explicit:
        return explicit
    nodes = _int(env, "SPMD_SIMULATE_NODES")
    if nodes is not None:
        if not 1 <= nodes <= size:
            raise SpmdError(
                f"SPMD_SIMULATE_NODES={nodes} must be between 1 and the world size {size}",
                rank=rank,
            )
        return f"simulated-node-{rank * nodes // size}"
    return socket.gethostname()


def _seconds(env: Mapping[str, str], name: str, default: float, zero_ok: bool) -> float:
    value = env.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise SpmdError(f"{name}={value!r} is not a number of seconds", rank=None) from None
    if seconds < 0 or (seconds == 0 and not zero_ok):
        want = "0 (off) or more" if zero_ok else "positive"
        raise SpmdError(f"{name}={value!r} must be {want}", rank=None)
    return seconds


def stall_warn_seconds(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a shared-memory collective waits for a peer before it prints a stall report
    (``SPMD_STALL_WARN``; 0: never). The native layer reads the variable; this checks it."""
    return _seconds(env, "SPMD_STALL_WARN", 30.0, zero_ok=True)


def timeout_seconds(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a bootstrap exchange waits for its peers before it fails (``SPMD_TIMEOUT``)."""
    return _seconds(env, "SPMD_TIMEOUT", 300.0, zero_ok=False)


def cuda_graphs(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the GPU handlers are registered as command-buffer compatible, so that XLA may
    capture them in CUDA graphs (``SPMD_CUDA_GRAPHS``, on unless ``0``)."""
    return env.get("SPMD_CUDA_GRAPHS", "1") != "0"


def debug_checks(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the checks too costly to run always are on (``SPMD_DEBUG``: ``0`` or ``1``)."""
    value = env.get("SPMD_DEBUG", "0").strip()
    if value not in ("", "0", "1"):
        raise SpmdError(f"SPMD_DEBUG={value!r}; expected 0 or 1", rank=None)
    return value == "1"


def check_every(env: Mapping[str, str] = os.environ) -> int:
    """How many steps apart a transformed step repeats its replica check under ``SPMD_DEBUG=1``
    (``SPMD_CHECK_EVERY``, default 100)."""
    value = env.get("SPMD_CHECK_EVERY", "100").strip()
    if not value.isdigit() or int(value) < 1:
        raise SpmdError(f"SPMD_CHECK_EVERY={value!r}; expected a whole number >= 1", rank=None)
    return int(value)


_INT_MAX = 2**31 - 1


def mpi_large_count(env: Mapping[str, str] = os.environ) -> bool:
    """Whether MPI calls may use the MPI-4 large-count functions where the library has them
    (``SPMD_MPI_LARGE_COUNT``: ``1``, the default, or ``0``: the classic int-count calls)."""
    value = env.get("SPMD_MPI_LARGE_COUNT", "1").strip()
    if value not in ("", "0", "1"):
        raise SpmdError(f"SPMD_MPI_LARGE_COUNT={value!r}; expected 0 or 1", rank=None)
    return value != "0"


def mpi_progress(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a thread of each rank moves its point-to-point sends on while the rank computes
    (``SPMD_MPI_PROGRESS``: ``1``, the default, or ``0``: sends move only inside the rank's own
    calls; where MPI runs without ``MPI_THREAD_MULTIPLE`` there is no such thread either way)."""
    value = env.get("SPMD_MPI_PROGRESS", "1").strip()
    if value not in ("", "0", "1"):
        raise SpmdError(f"SPMD_MPI_PROGRESS={value!r}; expected 0 or 1", rank=None)
    return value != "0"


def mpi_max_count(env: Mapping[str, str] = os.environ) -> int:
    """The most elements one classic MPI call carries; larger calls are split
    (``SPMD_MPI_MAX_COUNT``, for tests of the split; default and largest 2147483647)."""
    count = _int(env, "SPMD_MPI_MAX_COUNT")
    if count is None:
        return _INT_MAX
    if not 1 <= count <= _INT_MAX:
        raise SpmdError(
            f"SPMD_MPI_MAX_COUNT={count}: expected a count between 1 and {_INT_MAX}", rank=None
        )
    return count
