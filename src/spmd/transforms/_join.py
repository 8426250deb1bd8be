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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError
from .._jax_compat import core
from ..mesh import resolve_group
from ..runtime import Communicator
from ._passes import Pass, block_groups, gradient_leaves, map_gradients
from ._program import Program

__all__ = [
    "JoinState",
    "current_join",
    "join",
    "join_inputs",
    "join_state",
    "joined",
    "weight_joined",
]


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


# -- what a transform does under join -------------------------------------------------------------


def join_state(comm: Callable[[], Communicator], op: str) -> JoinState | None:
    """The join state of a step called now (None outside :func:`join`); an error naming both
    groups when the loop's group is not the step's (``comm()``, resolved only inside a join:
    a step's every call asks)."""
    state = current_join()
    if state is None:
        return None
    ranks = tuple(comm().ranks)
    if ranks != state.ranks:
        raise SpmdError(
            f"spmd.join over the ranks {list(state.ranks)} around a step over "
            f"{list(ranks)}: pass the step's group to spmd.join(..., group=)",
            op=op,
        )
    return state


def join_inputs(comm: Communicator) -> list[Any]:
    """The two inputs a program made by :func:`weight_joined` takes last, for a step over
    ``comm`` called now inside :func:`join`: this rank's weight, and the group's size over the
    number of ranks that have a batch."""
    state = current_join()
    assert state is not None
    return [np.float32(state.weight), np.float32(comm.size / state.active)]


def weight_joined(*, group: Any = None) -> Pass:
    """The :func:`join` pass: the program takes two scalars more, last (:func:`join_inputs`): a
    weight (0: this rank has run out of batches) and a factor (the group's size over the ranks
    that have a batch). Every floating gradient that ``spmd.grad`` marked becomes
    ``where(weight > 0, g, 0) * factor`` (a NaN of a rank out of batches counts as zero too)
    right after the op that produces it, so that the average a reducing pass after it takes over
    the group is the average over the ranks that had a batch. The marks stay, for that pass.

    Gradients of blocks split over ranks of the group (experts) are refused: their reduction
    over the ranks holding each block is not weighted yet.
    """

    def apply(program: Program) -> Program:
        comm = resolve_group(None, group, op="spmd.join")
        leaves, _ = gradient_leaves(program)
        if any(block_groups(comm.groups, leaf.shards) is not None for leaf in leaves):
            raise SpmdError(
                "spmd.join around a step with parameters split over the group (experts): not "
                "supported yet",
                op="spmd.join",
            )

        def weighted(g: Any, leaf: Any, extra: Sequence[Any]) -> Any:
            weight, factor = extra
            keep = jnp.broadcast_to(weight > 0, jnp.shape(g))
            return (jax.lax.select(keep, g, jnp.zeros_like(g)) * factor).astype(g.dtype)

        scalar = core.ShapedArray((), jnp.float32)
        return map_gradients(program, weighted, [("join.weight", scalar), ("join.scale", scalar)])

    return apply
