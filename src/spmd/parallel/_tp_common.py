"""What the framework layers (``_tp_linen``, ``_tp_nnx``, ``_tp_equinox``) share: a parameter
block's layout, its initialisation from the dense layer's initializer, and the conversion of the
layers' parameters to ShardedArrays of the dense layout and back.

Initialisation: a block is the slice of the full parameter that the dense layer's initializer
makes from the same key (the full array is made and sliced, once, at init), so that N
tensor-parallel ranks hold exactly the dense model one process builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError
from ..mesh import Mesh, current_mesh, resolve_group
from ..runtime import Communicator
from ..sharded import PartitionSpec, ShardedArray, is_sharded


@dataclass(frozen=True)
class Layout:
    """A block of a parameter split along ``axis`` over the mesh axis ``group``; ``fused`` > 1:
    a fused kernel whose last axis holds this rank's block of each of its parts side by side."""

    axis: int
    group: str
    fused: int = 1


def group_of(group: Any, op: str) -> Communicator:
    return resolve_group(None, group, op=op)


def group_name(group: Any) -> str:
    if not isinstance(group, str):
        raise SpmdError(
            f"group={group!r}: the framework layers take a mesh axis name (their parameters "
            "record it, to be gathered and saved over that axis)"
        )
    return group


def block_init(
    init: Callable[..., Any], full: tuple[int, ...], layout: Layout, comm: Communicator
) -> Callable[..., Any]:
    """An initializer of this rank's block: ``init`` on the full shape, sliced."""

    def make(key: Any, shape: Any = None, dtype: Any = jnp.float32) -> Any:
        return block_of(init(key, full, dtype), layout, comm)

    return make


def block_of(x: Any, layout: Layout, comm: Communicator) -> Any:
    """This rank's block of the full (dense) parameter ``x``."""
    axis = layout.axis % x.ndim
    if layout.fused > 1:
        lead, width = x.shape[:-1], x.shape[-1] // layout.fused
        n = width // comm.size
        parts = x.reshape(*lead, layout.fused, width)[..., comm.rank * n : (comm.rank + 1) * n]
        return parts.reshape(*lead, layout.fused * n)
    n = x.shape[axis] // comm.size
    return jax.lax.slice_in_dim(x, comm.rank * n, (comm.rank + 1) * n, axis=axis)


def local_size(full: int, comm: Communicator, what: str, op: str) -> int:
    if full % comm.size:
        raise SpmdError(
            f"{what} is {full}, which does not divide by the {comm.size} ranks of the group "
            f"{list(comm.ranks)}; each rank holds an equal block",
            op=op,
        )
    return full // comm.size


# -- to and from ShardedArrays -------------------------------------------------------------------

# (is_box, read: box -> (value, Layout | None), write: (box, value) -> box), one per framework
# module imported.
_HANDLERS: list[tuple[Callable[[Any], bool], Callable[[Any], Any], Callable[[Any, Any], Any]]] = []


def register(
    is_box: Callable[[Any], bool], read: Callable[[Any], Any], write: Callable[[Any, Any], Any]
) -> None:
    _HANDLERS.append((is_box, read, write))


def _handler(x: Any) -> Any:
    return next((h for h in _HANDLERS if h[0](x)), None)


def _is_leaf(x: Any) -> bool:
    return is_sharded(x) or _handler(x) is not None


def _mesh() -> Mesh:
    mesh = current_mesh()
    if mesh is None:
        raise SpmdError(
            "spmd.tensor_parallel.sharded/unsharded need the mesh the layers were built on: call "
            "them inside `with spmd.Mesh(...):`"
        )
    return mesh


def to_sharded(tree: Any) -> Any:
    mesh = _mesh()

    def one(x: Any) -> Any:
        h = _handler(x)
        if h is None:
            return x
        value, layout = h[1](x)
        if layout is None:
            return value
        comm = mesh.group(layout.group)
        value = jnp.asarray(value)
        if layout.fused > 1:
            from .tensor_parallel import join_qkv

            full = join_qkv(value, group=comm, parts=layout.fused)
            value = block_of(full, Layout(value.ndim - 1, layout.group), comm)
        axis = layout.axis % value.ndim
        shape = list(value.shape)
        shape[axis] *= comm.size
        spec = [None] * value.ndim
        spec[axis] = layout.group
        return ShardedArray(value, tuple(shape), PartitionSpec(*spec), mesh)

    return jax.tree_util.tree_map(one, tree, is_leaf=_is_leaf)


def from_sharded(tree: Any, like: Any) -> Any:
    mesh = _mesh()
    mine = jax.tree_util.tree_leaves(tree, is_leaf=is_sharded)
    boxes, structure = jax.tree_util.tree_flatten(like, is_leaf=_is_leaf)
    if len(mine) != len(boxes):
        raise SpmdError(
            f"tree has {len(mine)} leaves but like has {len(boxes)} parameters: expected the "
            "tree spmd.tensor_parallel.sharded(like) returns (or spmd.load of it)"
        )
    out = []
    for x, box in zip(mine, boxes, strict=True):
        h = _handler(box)
        if h is None:
            out.append(x.gather() if is_sharded(x) else x)
            continue
        _, layout = h[1](box)
        if layout is None:
            out.append(h[2](box, x.gather() if is_sharded(x) else x))
            continue
        comm = mesh.group(layout.group)
        if layout.fused > 1 or not is_sharded(x):  # from the full array
            value = block_of(jnp.asarray(x.gather() if is_sharded(x) else x), layout, comm)
        else:
            value = x.reshard(PartitionSpec(*_spec(x.ndim, layout))).local
        out.append(h[2](box, value))
    return jax.tree_util.tree_unflatten(structure, out)


def _spec(ndim: int, layout: Layout) -> list[Any]:
    spec: list[Any] = [None] * ndim
    spec[layout.axis % ndim] = layout.group
    return spec
