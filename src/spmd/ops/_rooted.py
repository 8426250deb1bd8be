"""Rooted collectives and the prefix scan, the calls MPI (and mpi4jax) users look for:
``reduce``, ``gather``, ``scatter`` and ``scan``.

They are composed from spmd's primitives (allreduce, allgather, all_to_allv), so they work
eagerly, under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` with those primitives' rules, on
every transport. What the composition costs: ``reduce`` moves an allreduce's bytes (every rank
gets the result, the others then keep their input); ``gather`` and ``scan`` an allgather's
(every rank receives every block); ``scatter`` exactly its own bytes (one all_to_allv in which
only the root sends).

Conventions (as mpi4jax's, where it has the call): a rank other than the root gets its own input
back from ``reduce`` and ``gather``; ``scatter`` takes the same shape on every rank (the root's
values are used, as ``broadcast`` does); ``scan`` is inclusive (rank r gets the reduction over
ranks 0..r of the group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError
from ._all_to_allv import all_to_allv
from ._allreduce import allreduce
from ._checks import check_rank, flatten
from ._gather import allgather
from ._primitive import alone, resolve

__all__ = ["gather", "reduce", "scan", "scatter"]

_SCAN_OPS: dict[str, Callable[..., jax.Array]] = {
    "sum": jnp.sum,
    "prod": jnp.prod,
    "min": jnp.min,
    "max": jnp.max,
}


def reduce(x: Any, op: str = "sum", root: int = 0, *, rank_list: Any = None,
           group: Any = None) -> Any:  # fmt: skip
    """The reduction of ``x`` over the group on the rank at position ``root``; every other rank
    gets its ``x`` back. ``op``: as :func:`allreduce` (``sum``, ``avg``, ``prod``, ``min``,
    ``max``); ``x``: an array or a pytree (one fused call).

    Example (a world of one is its own root)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.ops.reduce(jnp.array([1.0, 2.0]), "sum", root=0)
        Array([1., 2.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="reduce")
    r = check_rank(root, "root", "reduce", ref.ranks)
    total = allreduce(x, op, rank_list=rank_list, group=group)
    # A select, not a Python branch: the result depends on the allreduce on every rank, so that
    # every rank differentiates it (its backward pass is a collective too).
    here = jnp.asarray(ref.rank == r)
    return jax.tree_util.tree_map(lambda t, a: jnp.where(here, t, a), total, x)


def gather(x: Any, root: int = 0, *, rank_list: Any = None, group: Any = None) -> Any:
    """Every rank's ``x`` stacked along a new axis 0, in group order, on the rank at position
    ``root``; every other rank gets its ``x`` back. ``x`` has the same shape on every rank.

    Example (a world of one)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.ops.gather(jnp.array([1.0, 2.0]), root=0).shape
        (1, 2)
    """
    ref = resolve(rank_list, group, op="gather")
    r = check_rank(root, "root", "gather", ref.ranks)
    leaves, treedef, _ = flatten(x, "gather")
    stacked = [allgather(jnp.expand_dims(a, 0), axis=0, rank_list=rank_list, group=group)
               for a in leaves]  # fmt: skip
    if ref.rank != r:
        # x itself, bit for bit, as the gathered block of this rank: so that the result depends
        # on the allgather on every rank, which every rank then differentiates alike.
        stacked = [s[ref.rank] for s in stacked]
    return jax.tree_util.tree_unflatten(treedef, stacked)


def scatter(x: Any, root: int = 0, *, rank_list: Any = None, group: Any = None) -> Any:
    """Block ``i`` of the root's ``x`` (``x[i]``, axis 0 of length the group's size) on the
    member at position ``i`` of the group. Every rank passes an array of the same shape (the
    other ranks' values are ignored); only the root sends, each member its block.

    Example (a world of one keeps its one block)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.ops.scatter(jnp.array([[1.0, 2.0]]), root=0)
        Array([1., 2.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="scatter")
    r = check_rank(root, "root", "scatter", ref.ranks)
    leaves, treedef, names = flatten(x, "scatter")
    n = ref.size
    out = []
    for name, a in zip(names, leaves, strict=True):
        if a.ndim == 0 or a.shape[0] != n:
            raise SpmdError(
                f"{name} has shape {tuple(a.shape)}; scatter expects axis 0 of length {n} (one "
                f"block per member of the group of ranks {list(ref.ranks)})",
                op="scatter",
            )
        if alone(ref):
            out.append(a[0])
            continue
        rows = a.reshape(n, -1)
        if ref.rank != r:  # only the root sends
            rows = rows[:0]
        send = [1] * n if ref.rank == r else [0] * n
        recv = [1 if j == r else 0 for j in range(n)]
        got = all_to_allv(rows, send, recv, rank_list=rank_list, group=group)
        out.append(got.reshape(a.shape[1:]))
    return jax.tree_util.tree_unflatten(treedef, out)


def scan(x: Any, op: str = "sum", *, rank_list: Any = None, group: Any = None) -> Any:
    """The inclusive prefix reduction: the member at position r of the group gets ``op`` over
    the ``x`` of members 0..r. ``op``: ``sum``, ``prod``, ``min`` or ``max``.

    Example (a world of one: its own ``x``)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.ops.scan(jnp.array([1.0, 2.0]), "sum")
        Array([1., 2.], dtype=float32)
    """
    if op not in _SCAN_OPS:
        raise SpmdError(f"op={op!r}; expected one of {sorted(_SCAN_OPS)}", op="scan")
    ref = resolve(rank_list, group, op="scan")
    leaves, treedef, _ = flatten(x, "scan")
    out = []
    for a in leaves:
        every = allgather(jnp.expand_dims(a, 0), axis=0, rank_list=rank_list, group=group)
        out.append(_SCAN_OPS[op](every[: ref.rank + 1], axis=0).astype(a.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
