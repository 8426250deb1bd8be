"""spmd's exceptions and warnings.

Every error spmd raises on purpose is a :class:`SpmdError`. Its message starts with the rank that
raised it and, where there is one, the operation: ``rank 3: allreduce: op='mean' is not a
reduction; expected one of sum, prod, max, min, avg``. The exception builds that prefix itself
from ``op=`` and the runtime's rank; the text after it says what was received, what was
expected, and how to fix it.
"""

from __future__ import annotations

from typing import Any

# The world rank of this process while spmd's runtime runs (set by spmd.init, cleared by
# spmd.finalize); errors raised before init say "rank ?".
_rank: int | None = None
_CURRENT: Any = object()


def set_rank(rank: int | None) -> None:
    """The rank errors name from now on (the runtime calls this at init and finalize)."""
    global _rank
    _rank = rank


def this_rank() -> str:
    """How an error names this process: ``"rank N"`` (world rank), ``"rank ?"`` before init."""
    return f"rank {_rank}" if _rank is not None else "rank ?"


def prefix(op: str | None = None, rank: Any = _CURRENT) -> str:
    """The start of an error message: ``"rank N: op: "``; without ``op``, ``"rank N: "``."""
    who = this_rank() if rank is _CURRENT else (None if rank is None else f"rank {rank}")
    return "".join(f"{part}: " for part in (who, op) if part)


def _rebuild(cls: type[SpmdError], text: str, rank: Any, op: str | None) -> SpmdError:
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.rank, error.op = rank, op
    return error


class SpmdError(ValueError):
    """Base class of spmd's errors (a ``ValueError``): bad input, or ranks that disagree.

    ``SpmdError(message, op="allreduce")`` reads ``rank N: allreduce: message``; ``rank=``
    names another rank than this process's, and ``rank=None`` leaves the rank out (errors of a
    launcher, which is no rank, and messages that already carry their prefix).
    """

    def __init__(self, message: str = "", *, op: str | None = None, rank: Any = _CURRENT) -> None:
        self.rank: int | None = _rank if rank is _CURRENT else rank
        self.op = op
        super().__init__(prefix(op, rank) + message)

    def __reduce__(self) -> Any:
        # The message already holds the prefix: unpickling must not add it again.
        return _rebuild, (type(self), str(self), self.rank, self.op)


class SpmdTypeError(SpmdError, TypeError):
    """An argument of the wrong type (both a :class:`SpmdError` and a ``TypeError``)."""


class PerExampleGradientWarning(UserWarning):
    """``spmd.grad`` under ``jax.vmap`` with unbatched parameters inside a parallel step: its
    gradients are averaged across ranks index by index, wrong for per-example gradients
    (docs/data_parallel.md). Silence it where the vmapped index means the same thing on every
    rank: ``warnings.filterwarnings("ignore", category=spmd.PerExampleGradientWarning)``."""
