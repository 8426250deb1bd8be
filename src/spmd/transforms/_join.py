"""Uneven inputs (PyTorch DDP's Join), for a functional step: ``spmd.join(batches)``.

Ranks with different numbers of batches would leave the ranks with more waiting in a collective
that the others never make. Wrapped in :func:`join`, every rank's loop runs as many steps as the
rank with the most batches: each step the ranks agree (one allgather of a flag) on which of them
still have a batch; a rank that has run out takes its step again on its last batch, with its
gradients counted as zeros, and the data-parallel pass divides the sum of the gradients by the
number of ranks that had a batch instead of the group's size. Every rank thus applies the same
update at every step (its replica stays identical, its optimizer state too), and the result is
one process's on the batches of the ranks that had one, step by step.

The wrapper, and not a ``with`` block, is the design: a functional step's state lives in the
loop's variables, so a rank that has run out must go on calling the step for them to stay
current; a context manager's exit could make the collectives but not update the caller's
``params``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._errors import SpmdError
from ..mesh import resolve_group

__all__ = ["JoinState", "current_join", "join", "joined"]


@dataclass(frozen=True)
class JoinState:
    """A step under :func:`join`: whether this rank's batch is its own (``weight`` 1) or its
    last one again (0), how many ranks of the group have their own, and the group's ranks."""

    weight: float
    active: int
    ranks: tuple[int, ...]


_JOIN: contextvars.ContextVar[JoinState | None] = contextvars.ContextVar("spmd_join", default=None)


def current_join() -> JoinState | None:
    """The join state of the step called now (None outside :func:`join`)."""
    return _JOIN.get()


def joined() -> bool:
    """Whether this rank has run out of batches and the step called now only keeps its replica
    current (its outputs, a loss for instance, are of its last batch again: skip them)."""
    state = _JOIN.get()
    return state is not None and state.weight == 0


def join(batches: Iterable[Any], *, group: Any = None) -> Iterator[Any]:
    """This rank's ``batches``, then its last batch again until every rank of the group has run
    out; the ``@spmd.data_parallel`` steps called with them count a rank's gradients only while
    it has batches of its own (see the module doc).

    Every rank of the group iterates it (a collective per step). Only data-parallel steps may
    communicate inside the loop: another collective made by the ranks that still have batches
    would have no partner on those that have run out.

    Example (a world of one: the batches as they are)::

        >>> import spmd
        >>> [b for b in spmd.join([1, 2, 3])]
        [1, 2, 3]
    """
    comm = resolve_group(None, group, op="spmd.join")
    it = iter(batches)
    last: list[Any] = []
    while True:
        try:
            batch, own = next(it), 1
        except StopIteration:
            batch, own = (last[0] if last else None), 0
        # 1: a batch of its own; 0: out of batches; -1: none ever, so nothing to step with.
        flags = comm.allgather_object(own if own or last else -1)
        active = sum(f == 1 for f in flags)
        if active == 0:
            return
        never = [comm.ranks[r] for r, f in enumerate(flags) if f == -1]
        if never:
            raise SpmdError(
                f"ranks {never} have no batch at all while ranks "
                f"{[comm.ranks[r] for r, f in enumerate(flags) if f == 1]} have: a rank that has "
                "run out takes the step again on its last batch, and these have none. Give every "
                "rank at least one batch",
                op="spmd.join",
            )
        token = _JOIN.set(JoinState(float(own), active, tuple(comm.ranks)))
        try:
            yield batch
        finally:
            _JOIN.reset(token)
        if own:
            last[:] = [batch]
