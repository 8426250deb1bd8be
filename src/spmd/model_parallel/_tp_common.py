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
from ..transforms.marks import handler_of, is_box_or_sharded


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
    if layout.fused > 1:  # (the parts along the split axis, moved last and back)
        x = jnp.moveaxis(x, axis, -1)
        lead, width = x.shape[:-1], x.shape[-1] // layout.fused
        n = width // comm.size
        parts = x.reshape(*lead, layout.fused, width)[..., comm.rank * n : (comm.rank + 1) * n]
        return jnp.moveaxis(parts.reshape(*lead, layout.fused * n), -1, axis)
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


def _mesh() -> Mesh:
    mesh = current_mesh()
    if mesh is None:
        raise SpmdError(
            "spmd.tensor_parallel.sharded/unsharded need the mesh the layers were built on: call "
            "them inside `with spmd.Mesh(...):`"
        )
    return mesh


def _to_sharded(value: Any, layout: Layout | None, mesh: Mesh) -> Any:
    if layout is None:
        return value
    comm = mesh.group(layout.group)
    value = jnp.asarray(value)
    axis = layout.axis % value.ndim
    if layout.fused > 1:
        full = jnp.moveaxis(
            join_qkv(jnp.moveaxis(value, axis, -1), group=comm, parts=layout.fused), -1, axis
        )
        value = block_of(full, Layout(axis, layout.group), comm)
    shape = list(value.shape)
    shape[axis] *= comm.size
    spec: list[Any] = [None] * value.ndim
    spec[axis] = layout.group
    return ShardedArray(value, tuple(shape), PartitionSpec(*spec), mesh)


def to_sharded(tree: Any) -> Any:
    mesh = _mesh()

    def one(x: Any) -> Any:
        h = handler_of(x)
        if h is None:
            return x
        fields = h[1](x)
        values = [_to_sharded(v, layout, mesh) for v, layout in fields]
        return h[2](x, values) if h[3] else values[0]

    return jax.tree_util.tree_map(one, tree, is_leaf=is_box_or_sharded)


def _from_sharded(x: Any, layout: Layout | None, mesh: Mesh) -> Any:
    if layout is None:
        return x.gather() if is_sharded(x) else x
    comm = mesh.group(layout.group)
    if layout.fused > 1 or not is_sharded(x):  # from the full array
        return block_of(jnp.asarray(x.gather() if is_sharded(x) else x), layout, comm)
    spec: list[Any] = [None] * x.ndim
    spec[layout.axis % x.ndim] = layout.group
    return x.reshard(PartitionSpec(*spec)).local


def from_sharded(tree: Any, like: Any) -> Any:
    mesh = _mesh()
    mine = jax.tree_util.tree_leaves(tree, is_leaf=is_sharded)
    boxes, structure = jax.tree_util.tree_flatten(like, is_leaf=is_box_or_sharded)
    # Per box: its handler and the layout of each array it holds (None: a plain leaf).
    fields = [(b, h, [lay for _, lay in h[1](b)] if h else [None]) for b in boxes
              for h in [handler_of(b)]]  # fmt: skip
    need = sum(len(layouts) for _, _, layouts in fields)
    if len(mine) != need:
        raise SpmdError(
            f"tree has {len(mine)} leaves but like has {need} arrays: expected the tree "
            "spmd.tensor_parallel.sharded(like) returns (or spmd.load of it)"
        )
    out, k = [], 0
    for box, h, layouts in fields:
        values = [_from_sharded(mine[k + i], lay, mesh) for i, lay in enumerate(layouts)]
        k += len(layouts)
        out.append(h[2](box, values) if h else values[0])
    return jax.tree_util.tree_unflatten(structure, out)


# -- fused kernels ------------------------------------------------------------------------------


def split_qkv(w: Any, heads: int, *, group: Any = "tp", parts: int = 3) -> Any:
    """This rank's block of a fused ``[q|k|v]`` kernel ``(in, parts * out)`` (or bias
    ``(parts * out,)``): the same heads of each part, side by side, ``(in, parts * out / tp)``.

    The columns of each part are head-major (head h is ``h * out / heads`` onwards), so rank r
    gets heads ``r * heads / tp`` to ``(r + 1) * heads / tp - 1`` of q, of k and of v; after
    ``column_linear(x, w, fused=parts)`` it splits its output into its q, k and v as one process
    splits the full one. :func:`join_qkv` is the inverse (collective over the group).

    Example (a world of one: the kernel unchanged)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.split_qkv(jnp.arange(6.0)[None], heads=1)
        Array([[0., 1., 2., 3., 4., 5.]], dtype=float32)
    """
    op = "split_qkv"
    comm = group_of(group, op)
    w = jnp.asarray(w)
    out = _part_width(w, parts, op)
    if heads < 1 or heads % comm.size or out % heads:
        raise SpmdError(
            f"heads={heads}: each of the {parts} parts has {out} columns and the group "
            f"{comm.size} ranks; expected a head count that divides the columns and that the "
            "group size divides (each rank holds whole heads)",
            op=op,
        )
    n = out // comm.size
    blocks = w.reshape(*w.shape[:-1], parts, out)[..., comm.rank * n : (comm.rank + 1) * n]
    return blocks.reshape(*w.shape[:-1], parts * n)


def join_qkv(w: Any, *, group: Any = "tp", parts: int = 3) -> Any:
    """The full fused kernel ``(in, parts * out)`` from every rank's :func:`split_qkv` block
    (an allgather over the group; every rank gets it)."""
    op = "join_qkv"
    comm = group_of(group, op)
    w = jnp.asarray(w)
    n = _part_width(w, parts, op)
    if comm.size == 1:
        return w
    from ..ops import allgather

    everyone = allgather(w, axis=w.ndim - 1, group=comm)  # [q0 k0 v0 q1 k1 v1 ...]
    lead = w.shape[:-1]
    split = everyone.reshape(*lead, comm.size, parts, n)
    return jnp.swapaxes(split, -3, -2).reshape(*lead, parts * comm.size * n)


def _part_width(w: Any, parts: int, op: str) -> int:
    if w.ndim < 1 or parts < 1 or w.shape[-1] % parts:
        raise SpmdError(
            f"w has shape {w.shape}; expected a last axis of {parts} equal parts "
            "([q|k|v] for parts=3)",
            op=op,
        )
    return int(w.shape[-1] // parts)


# -- the public conversions ---------------------------------------------------------------------


def sharded(tree: Any) -> Any:
    """The parameters of the framework layers (``linen``, ``nnx``, ``equinox``) as ShardedArrays
    of the dense model's layout, for ``spmd.gather``, ``spmd.save`` and the checkpoint exports.

    ``tree``: a tree that holds the layers' blocks (linen's boxed ``params``, an NNX state or
    model, an Equinox model); every block becomes a ShardedArray over the active mesh, a fused
    kernel reordered from its per-rank ``[q|k|v]`` blocks to the dense kernel's columns (one
    allgather of that kernel); other leaves are returned as they are (replicated). Collective
    over the tensor-parallel group: every rank of it calls it. :func:`unsharded` is the inverse.
    """
    return to_sharded(tree)


def unsharded(tree: Any, like: Any) -> Any:
    """``like`` (the layers' parameters, as :func:`sharded` takes them) with its values taken from
    ``tree`` (what :func:`sharded` returns, or ``spmd.load(path, like=sharded(like))``)."""
    return from_sharded(tree, like)
