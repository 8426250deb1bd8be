"""Splitting a model's layers into pipeline stages (``spmd.pipeline.split`` and
``stage_layers``): consecutive runs whose largest total cost is as small as it can be."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._errors import SpmdError
from ..mesh import resolve_group
from ..ops import allreduce

__all__ = ["split", "stage_layers"]


def split(layers: Sequence[Any], stages: int, *, costs: Sequence[float] | None = None) -> list[Any]:
    """``layers`` cut into ``stages`` consecutive, non-empty runs whose largest total cost is as
    small as it can be (by default each layer costs 1; pass e.g. each layer's parameter count
    or measured time).

    Example::

        >>> import spmd
        >>> spmd.pipeline.split(["embed", "b0", "b1", "b2", "b3", "head"], 3)
        [['embed', 'b0'], ['b1', 'b2'], ['b3', 'head']]
        >>> spmd.pipeline.split(["a", "b", "c"], 2, costs=[3, 1, 1])
        [['a'], ['b', 'c']]
    """
    layers = list(layers)
    n = len(layers)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise SpmdError(f"stages={stages!r}; expected an int, 1 or more", op="pipeline.split")
    if n < stages:
        raise SpmdError(
            f"{n} layers do not fill {stages} stages; every stage needs a layer at least",
            op="pipeline.split",
        )
    cost = [1.0] * n if costs is None else [float(c) for c in costs]
    if len(cost) != n or any(not c >= 0 for c in cost):
        raise SpmdError(
            f"costs has {len(cost)} entries for {n} layers (or a negative one); give one cost "
            "of 0 or more per layer",
            op="pipeline.split",
        )
    before = np.concatenate([[0.0], np.cumsum(cost)])
    # best[k][j]: the smallest largest cost of the first j layers in k stages; cut[k][j]: where
    # the last of those stages starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], before[j] - before[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [layers[a:b] for a, b in reversed(bounds)]


def stage_layers(
    layers: Sequence[Any],
    *,
    costs: Sequence[float] | None = None,
    group: Any = "pp",
    virtual_stages: int = 1,
) -> list[Any]:
    """This rank's stage of ``layers``: the run :func:`split` gives its position in the group
    (one stage per rank). With ``virtual_stages=v``, ``layers`` is split into ``v * p`` chunks
    and rank r gets the list of its v chunks, ``j * p + r`` for j < v (the interleaved
    schedule's ``stage_params``).

    Example (a world of one is one stage holding every layer)::

        >>> import spmd
        >>> with spmd.Mesh(pp=-1):
        ...     spmd.pipeline.stage_layers(["a", "b", "c"])
        ['a', 'b', 'c']
        >>> with spmd.Mesh(pp=-1):
        ...     spmd.pipeline.stage_layers(["a", "b", "c"], virtual_stages=2)
        [['a'], ['b', 'c']]
    """
    comm = resolve_group(None, group, op="pipeline.stage_layers")
    p, v = comm.size, virtual_stages
    stages: list[Any] = split(layers, p * v, costs=costs)
    if v == 1:
        return list(stages[comm.rank])
    return [list(stages[j * p + comm.rank]) for j in range(v)]


def agree_settings(comm: Any, settings: dict[str, Any]) -> None:
    """The same error on every rank of the pipeline's group unless every rank passed the same
    ``settings`` (microbatches, schedule, ...)."""

    def said(values: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in values.items())

    for r, theirs in enumerate(comm.agree(lambda: settings)):
        if theirs != settings:
            raise SpmdError(
                f"rank {comm.ranks[r]} passed {said(theirs)}, but rank {comm.world_rank} "
                f"{said(settings)}; every stage of a pipeline passes the same",
                op="pipeline_value_and_grad",
            )


def sum_shared(grads: Any, shared: Any, comm: Any) -> Any:
    """``grads`` with the leaves ``shared`` marks summed over the pipeline's group (one call)."""
    try:
        mask = jax.tree_util.tree_map(
            lambda flag, g: jax.tree_util.tree_map(lambda _: bool(flag), g), shared, grads
        )
    except ValueError as e:
        raise SpmdError(
            f"shared={shared!r} is not a tree of bools with the structure of stage_params "
            f"(or a prefix of it): {e}",
            op="pipeline_value_and_grad",
        ) from None
    flags = jax.tree_util.tree_leaves(mask)
    leaves, tree = jax.tree_util.tree_flatten(grads)
    picked = [g for g, f in zip(leaves, flags, strict=True) if f]
    if not picked:
        return grads
    summed = iter(allreduce(picked, "sum", group=comm))
    out = [next(summed) if f else g for g, f in zip(leaves, flags, strict=True)]
    return jax.tree_util.tree_unflatten(tree, out)


def at(tree: Any, i: Any) -> Any:
    """Element i of every leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda a: a[i], tree)


def describe(tree: Any) -> str:
    """A pytree of arrays or shapes as ``float32[4, 8]`` (or a dict/list of those)."""

    def one(x: Any) -> str:
        dtype = getattr(x, "dtype", None)
        name = getattr(dtype, "name", str(dtype))
        return f"{name}{list(np.shape(x))}"

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if jax.tree_util.treedef_is_leaf(treedef):
        return one(leaves[0]) if leaves else repr(tree)
    return str(jax.tree_util.tree_unflatten(treedef, [_Text(one(x)) for x in leaves]))


class _Text(str):
    """A string that prints without quotes."""

    def __repr__(self) -> str:
        return str(self)
