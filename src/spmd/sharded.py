"""Sharded arrays: a global shape, a partition spec over a mesh (or a group), and this rank's shard.

A :class:`ShardedArray` is what one process holds of a larger array. Its ``spec`` (jax's
``PartitionSpec``, re-exported as ``spmd.PartitionSpec``) says, for each dimension, which mesh
axes split it: ``P("dp", None)`` splits dimension 0 over the ``dp`` axis and keeps dimension 1
whole; ``P(("dp", "tp"))`` splits dimension 0 over both axes combined (``dp`` outer). Ranks that
agree on the axes a spec names hold the same shard (it is replicated over the other axes).

Uneven sizes are padded: a dimension of size ``G`` split ``n`` ways has shards of
``ceil(G / n)`` elements, the last ones padded with zeros. Every shard has the same shape (so
collectives can move them) and the padding never reaches a result: :meth:`ShardedArray.gather`
strips it.

Instead of a :class:`~spmd.Mesh`, an array may be sharded over a Communicator (a group): it acts
as a mesh with a single axis, whatever name the spec gives it (``zero_shard`` shards over its
data-parallel group this way).

A ShardedArray is a pytree whose only leaf is ``.local``; its global shape, spec and mesh are
static, so it passes through ``jax.jit`` (and ``gather``/``reshard`` work inside it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ._errors import SpmdError, SpmdTypeError
from .mesh import Mesh, current_mesh
from .runtime import Communicator, get_communicator

__all__ = ["PartitionSpec", "ShardedArray", "gather", "is_sharded", "shard"]

Where = Mesh | Communicator


# -- placement ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dim:
    """How one dimension is split: over which axes, in how many shards, which one is ours."""

    axes: tuple[str, ...]
    n: int
    index: int
    chunk: int  # elements per shard (the last ones padded)

    @property
    def split(self) -> bool:
        return bool(self.axes)


def normalize_spec(spec: Any, ndim: int, where: Where) -> PartitionSpec:
    if not isinstance(spec, PartitionSpec):
        if isinstance(spec, tuple | list):
            spec = make_spec(*spec)
        else:
            raise SpmdTypeError(
                f"spec={spec!r} is not a PartitionSpec; pass e.g. spmd.PartitionSpec('dp', None)"
            )
    if len(spec) > ndim:
        raise SpmdError(
            f"{spec} has {len(spec)} entries for an array of {ndim} dimensions; "
            "give at most one entry per dimension"
        )
    entries: list[tuple[Any, ...] | None] = []
    for e in spec:
        if e is None or isinstance(e, str):
            entries.append(None if e is None else (e,))
        elif isinstance(e, tuple | list) and all(isinstance(a, str) for a in e):
            entries.append(tuple(e) or None)
        else:
            names = e if isinstance(e, tuple | list) else (e,)
            bad = next(a for a in names if not isinstance(a, str))
            raise SpmdTypeError(
                f"{spec}: {bad!r} is not an axis name; each entry is None, an "
                "axis name, or a tuple of axis names"
            )
    entries += [None] * (ndim - len(entries))
    # On a mesh, 'ep' stands for its dp and tp axes: each name is counted as the axes it means.
    used = [a for e in entries if e for a in (where.axes(e) if isinstance(where, Mesh) else e)]
    if len(set(used)) != len(used):
        raise SpmdError(
            f"{spec} uses a mesh axis twice (as {', '.join(used)}); each axis splits one dimension"
        )
    if isinstance(where, Communicator) and any(e and len(e) > 1 for e in entries):
        raise SpmdError(
            f"{spec} combines several axes but the array is sharded over a "
            "group, which has one axis; shard over a Mesh to combine axes"
        )
    if isinstance(where, Communicator) and sum(1 for e in entries if e) > 1:
        raise SpmdError(f"{spec} splits several dimensions over one group; a group has one axis")
    return make_spec(*(e[0] if e and len(e) == 1 else e for e in entries))


def make_spec(*entries: Any) -> PartitionSpec:
    return PartitionSpec(*entries)  # type: ignore[no-untyped-call]


def spec_axes(spec: Any) -> tuple[str, ...]:
    """Every axis name a PartitionSpec splits over, in order (its entries flattened)."""
    return tuple(a for e in spec for a in _entry_axes(e))


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _group(where: Where, axes: tuple[str, ...]) -> Communicator:
    return where if isinstance(where, Communicator) else where.group(axes)


def _dims(shape: tuple[int, ...], spec: PartitionSpec, where: Where) -> tuple[_Dim, ...]:
    dims = []
    entries = (*spec, *([None] * (len(shape) - len(spec))))
    for g, entry in zip(shape, entries, strict=True):
        axes = _entry_axes(entry)
        if not axes:
            dims.append(_Dim((), 1, 0, g))
            continue
        comm = _group(where, axes)
        dims.append(_Dim(axes, comm.size, comm.rank, -(-g // comm.size)))
    return tuple(dims)


def _resolve_where(mesh: Any, group: Any) -> Where:
    if mesh is not None and group is not None:
        raise SpmdError("pass mesh= or group=, not both")
    if group is not None:
        if not isinstance(group, Communicator):
            raise SpmdTypeError(f"group={group!r} is not a Communicator")
        return group
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise SpmdTypeError(f"mesh={mesh!r} is not a spmd.Mesh")
        return mesh
    active = current_mesh()
    return active if active is not None else get_communicator()


# -- the array ------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_with_keys_class
class ShardedArray:
    """This rank's shard of a global array split over a mesh (or a group).

    Attributes:
        local: this rank's shard, a jax.Array of :attr:`local_shape` (padded where uneven).
        shape: the global shape; dtype: the element type.
        spec: the PartitionSpec (one entry per dimension).
        mesh: the Mesh (or Communicator) whose axes the spec names.
    """

    def __init__(self, local: Any, shape: Sequence[int], spec: PartitionSpec, mesh: Where) -> None:
        self.local = local
        self.shape = tuple(int(s) for s in shape)
        # One entry per dimension (trailing ones may be left out, as in JAX), checked once here.
        self.spec = normalize_spec(spec, len(self.shape), mesh)
        self.mesh = mesh

    # pytree: the shard is the leaf (at .local); the placement is static.
    def tree_flatten(self) -> tuple[tuple[Any], tuple[Any, ...]]:
        return (self.local,), (self.shape, self.spec, self.mesh)

    def tree_flatten_with_keys(self) -> tuple[tuple[Any], tuple[Any, ...]]:
        key = jax.tree_util.GetAttrKey("local")
        return ((key, self.local),), (self.shape, self.spec, self.mesh)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Sequence[Any]) -> ShardedArray:
        return cls.placed(children[0], *aux)  # checked when the array was made

    @classmethod
    def placed(
        cls, local: Any, shape: tuple[int, ...], spec: PartitionSpec, mesh: Where
    ) -> ShardedArray:
        """An array whose placement spmd already checked (a normalized spec): no checks."""
        out = cls.__new__(cls)
        out.local, out.shape, out.spec, out.mesh = local, shape, spec, mesh
        return out

    # -- description --

    @property
    def dtype(self) -> Any:
        return self.local.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dims(self) -> tuple[_Dim, ...]:
        return _dims(self.shape, self.spec, self.mesh)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(d.chunk for d in self.dims)

    def valid(self) -> tuple[slice, ...]:
        """The part of :attr:`local` that holds data (not padding), as slices."""
        return tuple(
            slice(0, max(0, min(d.chunk, g - d.index * d.chunk)))
            for d, g in zip(self.dims, self.shape, strict=True)
        )

    def index(self) -> tuple[slice, ...]:
        """Where this rank's (unpadded) shard sits in the global array, as slices."""
        return tuple(
            slice(min(g, d.index * d.chunk), min(g, (d.index + 1) * d.chunk))
            for d, g in zip(self.dims, self.shape, strict=True)
        )

    def __repr__(self) -> str:
        # The shape of the shard held, not the layout's (which asks the runtime for the groups:
        # a repr must work after spmd.finalize too).
        if not (hasattr(self.local, "dtype") and hasattr(self.local, "shape")):
            # A pytree function put something else at the leaf (jax.tree.map(lambda a: a.shape,
            # ...) gives a tuple): show it as it is.
            return (
                f"ShardedArray(shape={self.shape}, spec={self.spec}, mesh={self.mesh!r}, "
                f"local={self.local!r})"
            )
        return (
            f"ShardedArray(shape={self.shape}, dtype={jnp.dtype(self.dtype).name}, "
            f"spec={self.spec}, mesh={self.mesh!r}, local_shape={tuple(self.local.shape)})"
        )

    # -- moving data --

    def gather(self) -> jax.Array:
        """The full global array on every rank (allgathers over the split dimensions)."""
        from .ops import allgather

        x = self.local
        for axis, (d, g) in enumerate(zip(self.dims, self.shape, strict=True)):
            if d.split:
                x = allgather(x, axis=axis, group=_group(self.mesh, d.axes))
                x = lax.slice_in_dim(x, 0, g, axis=axis)
        return cast(jax.Array, x)

    def reshard(self, spec: Any) -> ShardedArray:
        """The same global array under another spec (on the same mesh).

        Moving one split from a dimension to another over the same axes is one all_to_all;
        other changes gather the dimensions whose split changes, then slice locally.
        """
        spec = normalize_spec(spec, self.ndim, self.mesh)
        if spec == self.spec:
            return self
        old = [_entry_axes(e) for e in self.spec]
        new = [_entry_axes(e) for e in spec]
        changed = [i for i in range(self.ndim) if old[i] != new[i]]
        if len(changed) == 2:
            i, j = changed if old[changed[0]] else changed[::-1]
            if old[i] and not new[i] and not old[j] and new[j] == old[i]:
                return self._all_to_all(i, j, spec)
        x = self.local
        for axis in changed:
            d = self.dims[axis]
            if d.split:
                from .ops import allgather

                x = allgather(x, axis=axis, group=_group(self.mesh, d.axes))
                x = lax.slice_in_dim(x, 0, self.shape[axis], axis=axis)
        target = _dims(self.shape, spec, self.mesh)
        for axis in changed:
            if target[axis].split:
                x = slice_dim(x, axis, target[axis].index, target[axis].chunk)
        return ShardedArray(x, self.shape, spec, self.mesh)

    def _all_to_all(self, i: int, j: int, spec: PartitionSpec) -> ShardedArray:
        """Split dim i -> split dim j over the same group: one all_to_all."""
        from .ops import all_to_all

        d = self.dims[i]
        target = _dims(self.shape, spec, self.mesh)[j]
        x = pad_dim(self.local, j, target.n * target.chunk)
        x = all_to_all(x, split_axis=j, concat_axis=i, group=_group(self.mesh, d.axes))
        x = lax.slice_in_dim(x, 0, self.shape[i], axis=i)
        return ShardedArray(x, self.shape, spec, self.mesh)


# -- helpers --------------------------------------------------------------------------------------


def pad_dim(x: Any, axis: int, size: int) -> Any:
    """``x`` zero-padded at the end of ``axis`` to ``size`` elements."""
    have = x.shape[axis]
    if have == size:
        return x
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (0, size - have, 0)
    return lax.pad(x, jnp.zeros((), x.dtype), config)


def slice_dim(x: Any, axis: int, index: int, chunk: int) -> Any:
    """Chunk ``index`` (of ``chunk`` elements) of a full ``axis``, zero-padded where it runs past
    the end: this rank's part of a replicated array."""
    size = x.shape[axis]
    start = min(size, index * chunk)
    stop = min(size, start + chunk)
    return pad_dim(lax.slice_in_dim(x, start, stop, axis=axis), axis, chunk)


# -- API ------------------------------------------------------------------------------------------


def shard(x: Any, spec: Any, mesh: Mesh | None = None, *, group: Communicator | None = None) -> Any:
    """This rank's part of a replicated array ``x`` under ``spec`` (no communication).

    Args:
        x: an array every rank holds in full (or a pytree of them, each sharded by ``spec``).
        spec: a ``spmd.PartitionSpec`` naming mesh axes per dimension (missing trailing entries
            mean "not split").
        mesh: the mesh whose axes ``spec`` names; default: the active mesh, else the default
            communicator as a one-axis mesh. ``group=`` shards over a Communicator instead.
    """
    where = _resolve_where(mesh, group)

    def one(path: Any, leaf: Any) -> ShardedArray:
        if isinstance(leaf, ShardedArray):
            raise SpmdTypeError(
                f"{jax.tree_util.keystr(path) or 'x'} is already a "
                f"ShardedArray (spec {leaf.spec}); use its .reshard(spec) for another layout, or "
                "spmd.gather it first",
                op="shard",
            )
        leaf = jnp.asarray(leaf)
        s = normalize_spec(spec, leaf.ndim, where)
        local = leaf
        for axis, d in enumerate(_dims(leaf.shape, s, where)):
            if d.split:
                local = slice_dim(local, axis, d.index, d.chunk)
        return ShardedArray(local, leaf.shape, s, where)

    return jax.tree_util.tree_map_with_path(one, x, is_leaf=is_sharded)


def is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedArray)


def gather(tree: Any) -> Any:
    """``tree`` with every ShardedArray leaf replaced by its full array (others left as is)."""
    return jax.tree_util.tree_map(
        lambda x: x.gather() if isinstance(x, ShardedArray) else x, tree, is_leaf=is_sharded
    )
