"""What a rank does with an uncaught exception: say who it is, then stop the whole job.

Without this, one rank's exception leaves its peers blocked in a collective forever (MPI has no
timeouts, and MPICH's launcher does not stop the job when one rank exits non-zero).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any


def format_rank_traceback(rank: int, exc: BaseException) -> str:
    """The exception's traceback with every line prefixed by ``[rank N]``."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def report_status(rank: int, status: dict[str, object]) -> None:
    """Record this rank's outcome for ``spmd-run`` (no-op outside it)."""
    directory = os.environ.get("SPMD_RUN_STATUS_DIR")
    if not directory:
        return
    path = os.path.join(directory, f"rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"rank": rank, **status}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # reporting must never mask the rank's own error


def report_waiting(rank: int) -> None:
    """Tell ``spmd-run`` that this failed rank waits to be stopped (no-op outside it)."""
    directory = os.environ.get("SPMD_RUN_STATUS_DIR")
    if directory:
        try:
            open(os.path.join(directory, f"rank{rank}.waiting"), "w").close()
        except OSError:
            pass


def report_exception(rank: int, exc: BaseException) -> None:
    """Print the rank-prefixed traceback and record the failure for ``spmd-run``. Under
    ``spmd-run``, a traceback that another rank of the job already printed (the same text, its
    rank aside: a missing script, a syntax error, a bug every rank meets) is one line naming
    that rank instead of N copies."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    first = _first_to_print(rank, text.replace(f"rank {rank}", "rank N"))
    if first is None:
        sys.stderr.write(format_rank_traceback(rank, exc))
    else:
        last = text.rstrip("\n").rsplit("\n", 1)[-1]
        sys.stderr.write(f"[rank {rank}] {last} (the traceback rank {first} printed)\n")
    report_status(
        rank,
        {"state": "failed", "exit_code": 1, "error": f"{type(exc).__name__}: {exc}"},
    )
    sys.stdout.flush()
    sys.stderr.flush()


def _first_to_print(rank: int, text: str) -> int | None:
    """The rank that already printed the traceback ``text`` in this job, or None if this rank is
    the first (it then claims it: a file named by the text's hash, made atomically with this
    rank in it, so that of ranks failing at once exactly one prints)."""
    directory = os.environ.get("SPMD_RUN_STATUS_DIR")
    if not directory:
        return None
    path = os.path.join(directory, "traceback-" + hashlib.sha1(text.encode()).hexdigest()[:16])
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(str(rank))
        try:
            os.link(tmp, path)  # fails if another rank made it first
            return None
        except FileExistsError:
            with open(path) as f:
                return int(f.read())
        finally:
            os.unlink(tmp)
    except (OSError, ValueError):
        return None  # reporting must never mask the rank's own error: print it whole


def must_abort() -> bool:
    """Whether a failing rank must stop the job itself: MPI or spmd's runtime is running, so
    its peers may be waiting on it (and a normal exit could wait on them in finalization).
    Otherwise it may exit normally, running atexit handlers and flushing open files; the
    launcher stops the rest."""
    if _mpi_running() is not None:
        return True
    state = sys.modules.get("spmd.runtime._state")
    return bool(state is not None and state.is_initialized())


def _mpi_running() -> Any:
    """mpi4py's MPI module while MPI is initialized and not finalized, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


# Longer than any --grace spmd-run is given in practice: a safety net, should it not stop the job.
_SPMD_RUN_STOPS_WITHIN_S = 600.0


def abort_job(code: int, rank: int | None = None) -> None:
    """Stop this rank, and make sure the job stops. Under ``spmd-run`` with MPI running, this rank
    is marked as leaving in its shared-memory groups (a peer waiting for it fails at once, naming
    it) and waits for ``spmd-run``, which stops every rank after ``--grace`` seconds, so that a
    peer failing on its own meanwhile prints its traceback too. Elsewhere: ``MPI_Abort`` when MPI
    is running (nothing else would stop the ranks waiting for this one), else exit this process
    (the launcher, ``spmd-run`` or a torchrun-style agent stops the rest)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = _mpi_running()
    if mpi is not None and os.environ.get("SPMD_RUN_STATUS_DIR"):
        try:
            from .._native_lib import native

            native.shm_mark_leaving()
        except Exception:  # the native layer never loaded: no group to leave
            pass
        # MPICH's launcher ends the whole job at once when a process with MPI running exits, so
        # this one waits instead: spmd-run has seen its failure and stops the job after --grace,
        # or at once when every rank has failed or ended (this one says it waits to be stopped;
        # a rank that failed without saying so is ending on its own, and is left to end).
        if rank is not None:
            report_waiting(rank)
        deadline = time.monotonic() + _SPMD_RUN_STOPS_WITHIN_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
    if mpi is not None:
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


_previous_hook: Callable[..., Any] | None = None  # set while spmd's hook is installed


def install_abort_hook(rank: int) -> None:
    """Make an uncaught exception in the main thread print, then stop the job (:func:`abort_job`).
    ``SPMD_ABORT_ON_ERROR=0`` leaves ``sys.excepthook`` alone."""
    global _previous_hook
    if os.environ.get("SPMD_ABORT_ON_ERROR", "1") == "0":
        return
    if _previous_hook is None:
        _previous_hook = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        report_exception(rank, value.with_traceback(tb))
        if must_abort():
            abort_job(1, rank)

    sys.excepthook = hook


def uninstall_abort_hook() -> None:
    global _previous_hook
    if _previous_hook is not None:
        sys.excepthook = _previous_hook
        _previous_hook = None
