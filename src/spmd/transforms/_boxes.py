"""Framework boxes: how a framework's parameter box (linen's ``Partitioned``, an NNX variable,
an Equinox layer) holds tensor-parallel blocks, registered by the layers that make them and read
by the transforms (a block's gradient is reduced over the ranks that hold the same block)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..mesh import current_mesh
from ..sharded import is_sharded

# (is_box, read, write, container), one per framework module imported. read(box) -> [(value,
# layout or None)], one entry per array the box holds (an Equinox layer holds two), a layout
# naming its mesh axis as ``.group``; write(box, values) -> box. A box (linen's, NNX's) becomes
# its ShardedArray; a container (an Equinox layer) keeps its place, with ShardedArrays in its
# fields.
_HANDLERS: list[
    tuple[Callable[[Any], bool], Callable[[Any], Any], Callable[[Any, Any], Any], bool]
] = []


def register(
    is_box: Callable[[Any], bool],
    read: Callable[[Any], Any],
    write: Callable[[Any, Any], Any],
    container: bool = False,
) -> None:
    _HANDLERS.append((is_box, read, write, container))


def handler_of(x: Any) -> Any:
    """The registered (is_box, read, write, container) of ``x``, or None."""
    return next((h for h in _HANDLERS if h[0](x)), None)


def is_box_or_sharded(x: Any) -> bool:
    return is_sharded(x) or handler_of(x) is not None


def is_block_box(x: Any) -> bool:
    """A framework box (linen's ``Partitioned``) that holds one array and its layout."""
    h = handler_of(x)
    return h is not None and not h[3]


def box_groups(x: Any) -> tuple[tuple[int, ...], ...] | None:
    """For a box of :func:`is_block_box`, the groups of world ranks over which its blocks
    differ (those of its mesh axis in the active mesh), as ``_grad.shard_groups`` gives for a
    ShardedArray; None for a replicated parameter or outside a mesh."""
    h = handler_of(x)
    layout = h[1](x)[0][1] if h is not None else None
    mesh = current_mesh()
    if layout is None or mesh is None or layout.group not in mesh.shape:
        return None
    return tuple(tuple(int(r) for r in g) for g in mesh.rank_lists(layout.group))
