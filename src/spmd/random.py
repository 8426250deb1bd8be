"""Random keys over a mesh: ``spmd.random.fold_in_axes``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ._errors import SpmdError
from .mesh import current_mesh

__all__ = ["fold_in_axes"]


def fold_in_axes(key: Any, axes: str | Sequence[str]) -> Any:
    """``key`` made different over the named mesh axes and left alike over the others.

    Each rank folds its position along each axis of ``axes`` into ``key`` (in the order given):
    ranks that differ along one of them get different keys, ranks that differ only along other
    axes get the same key. Dropout under tensor parallelism wants exactly that: masks that
    differ between data-parallel replicas (different examples) and agree over the ranks of a
    tensor-parallel group, whose activations are the same tensor (``fold_in_axes(key, "dp")``
    on ``Mesh(dp=.., tp=..)``). An axis the active mesh lacks is an error (the key would not
    vary where the caller expects it to). Needs an active mesh; no communication.

    Example (a world of one: the position is 0 along every axis)::

        >>> import jax, spmd
        >>> with spmd.Mesh(dp=-1, tp=1):
        ...     k = spmd.random.fold_in_axes(jax.random.key(0), "dp")
        >>> bool((jax.random.key_data(k) == jax.random.key_data(
        ...     jax.random.fold_in(jax.random.key(0), 0))).all())
        True
    """
    mesh = current_mesh()
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if mesh is None:
        raise SpmdError(
            f"fold_in_axes(key, {names!r}) needs an active mesh: call it inside "
            "`with spmd.Mesh(...):`",
            op="fold_in_axes",
        )
    for axis in names:
        if axis not in mesh.axis_names:
            raise SpmdError(
                f"the active mesh {mesh!r} has no axis {axis!r} (its axes: "
                f"{list(mesh.axis_names)})",
                op="fold_in_axes",
            )
        key = jax.random.fold_in(key, mesh.group(axis).rank)
    return key
