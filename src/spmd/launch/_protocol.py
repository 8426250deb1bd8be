"""What the job runner and its per-rank wrapper agree on: a rank's number as its launcher
announced it (before any MPI call), and where ``spmd-run --output`` keeps each stream."""

from __future__ import annotations

import os

from ..runtime import mpi_rank_size


def launch_rank() -> int:
    """This process's rank as the launcher announced it (before any MPI call), in the order
    :func:`spmd.init` decides: a torchrun-style ``RANK``/``WORLD_SIZE`` with a file store
    first (such ranks may be started from inside an MPI job), then an MPI launcher's."""
    env = os.environ
    if env.get("SPMD_FILE_STORE_PATH") and env.get("RANK") and env.get("WORLD_SIZE"):
        return int(env["RANK"])
    found = mpi_rank_size(env)
    if found is not None:
        return found[0]
    return int(env.get("RANK", "0"))


def output_file(directory: str | os.PathLike[str], who: str, stream: str) -> str:
    """Where ``spmd-run --output DIR`` keeps ``stream`` ("stdout" or "stderr") of ``who``
    ("rank<N>" or "launcher")."""
    return os.path.join(directory, f"{who}.{stream}")
