"""allgather(v) and reduce_scatter(v): the dual pair.

``allgather`` concatenates every rank's array along an axis in rank order (MPI's Allgather,
torch's all_gather_into_tensor); ``reduce_scatter`` reduces over ranks and leaves rank r the r-th
block along an axis. The primitives work on axis 0; the public functions move the axis there and
back. ``sizes`` (the v-variants) gives each rank's rows along axis 0; an empty tuple means equal
blocks. Under the global-objective convention (see _allreduce.py) each is the other's
transpose: d(allgather)^T = sum-reduce_scatter, d(sum-reduce_scatter)^T = allgather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from .._jax_compat import ad, batching, core
from ._autodiff import arg_aval, batch_second, instantiate, linear_jvp, live, zero_tangent
from ._checks import (
    REDUCE_OPS,
    axes_meaning,
    check_axis,
    check_reduce_op,
    flatten,
    from_sum,
    move_axes,
    to_sum,
)
from ._primitive import (
    GroupRef,
    alone,
    bind,
    collective_primitive,
    register_lowering,
    resolve,
)

allgather_p = collective_primitive("spmd_allgather")
reduce_scatter_p = collective_primitive("spmd_reduce_scatter")

Sizes = tuple[int, ...]


# -- API ----------------------------------------------------------------------------------------


def allgather(x: Any, axis: int = 0, *, rank_list: Any = None, group: Any = None) -> Any:
    """Concatenate every rank's ``x`` along ``axis``, in rank order, on every rank.

    ``x`` (an array or pytree of arrays, one fused call) has the same shape on every rank; the
    result's ``axis`` is ``size`` times longer. For a new leading axis instead, gather
    ``x[None]``. Grouping: ``rank_list=`` or ``group=``, as :func:`spmd.allreduce`.

    Example (on 2 ranks each rank would get ``[0., 1., 1., 2.]``)::

        >>> import jax.numpy as jnp, spmd
        >>> r = spmd.init().rank
        >>> spmd.allgather(jnp.array([r, r + 1.0]))
        Array([0., 1.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="allgather")
    leaves, treedef, paths = flatten(x, "allgather")
    axes = [
        check_axis(axis, v.ndim, "axis", "allgather", p) for v, p in zip(leaves, paths, strict=True)
    ]
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    zeros = [0] * len(axes)
    moved = move_axes(leaves, axes, zeros)
    outs = bind(allgather_p, *moved, group=ref.meant(axes_meaning("axis", axes)), sizes=())
    return jax.tree_util.tree_unflatten(treedef, move_axes(outs, zeros, axes))


def allgatherv(x: Any, sizes: Sequence[int], *, rank_list: Any = None, group: Any = None) -> Any:
    """Concatenate along axis 0 arrays whose length differs between ranks: rank r passes
    ``sizes[r]`` rows; every rank gets ``sum(sizes)`` rows. ``sizes`` is the same on every rank;
    the other dimensions and the dtype match across ranks. Pytrees: every leaf has
    ``sizes[rank]`` rows.

    Example (a world of one passes ``sizes[0]`` rows; on 2 ranks with ``sizes=[1, 2]``, rank 0
    passes one row, rank 1 two, and both get three)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.allgatherv(jnp.ones((2, 3)), sizes=[2]).shape
        (2, 3)
    """
    ref = resolve(rank_list, group, op="allgatherv")
    leaves, treedef, paths = flatten(x, "allgatherv")
    sz = _check_sizes(sizes, ref, "allgatherv")
    for v, p in zip(leaves, paths, strict=True):
        if v.ndim == 0 or v.shape[0] != sz[ref.rank]:
            raise SpmdError(
                f"{p} has shape {v.shape}, but sizes={list(sz)} says this rank (position "
                f"{ref.rank} in the group) passes {sz[ref.rank]} rows along axis 0",
                op="allgatherv",
            )
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    return jax.tree_util.tree_unflatten(treedef, bind(allgather_p, *leaves, group=ref, sizes=sz))


def reduce_scatter(
    x: Any, op: str = "sum", axis: int = 0, *, rank_list: Any = None, group: Any = None
) -> Any:
    """Reduce ``x`` over ranks (op as :func:`spmd.allreduce`) and keep block ``rank`` of ``axis``.

    ``x.shape[axis]`` must divide by the group size; the result's ``axis`` is ``size`` times
    shorter. The dual of :func:`allgather`.

    Example (on 2 ranks both holding ``[1., 2., 3., 4.]``, rank 0 gets ``[2., 4.]`` and rank 1
    ``[6., 8.]``)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.reduce_scatter(jnp.array([1.0, 2.0, 3.0, 4.0]))
        Array([1., 2., 3., 4.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="reduce_scatter")
    leaves, treedef, paths = flatten(x, "reduce_scatter")
    check_reduce_op(op, "reduce_scatter", leaves)
    axes = []
    for v, p in zip(leaves, paths, strict=True):
        a = check_axis(axis, v.ndim, "axis", "reduce_scatter", p)
        if v.shape[a] % ref.size:
            raise SpmdError(
                f"{p} has {v.shape[a]} elements along axis {a}, not divisible by the group "
                f"size {ref.size}; pad it, or use reduce_scatterv with explicit sizes",
                op="reduce_scatter",
            )
        axes.append(a)
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    zeros = [0] * len(axes)
    native, sent = to_sum(op, move_axes(leaves, axes, zeros))
    meant = ref.meant(f"op={op}, " + axes_meaning("axis", axes))
    outs = from_sum(
        op, bind(reduce_scatter_p, *sent, group=meant, op=native, sizes=()), leaves, ref.size
    )
    return jax.tree_util.tree_unflatten(treedef, move_axes(outs, zeros, axes))


def reduce_scatterv(
    x: Any, sizes: Sequence[int], op: str = "sum", *, rank_list: Any = None, group: Any = None
) -> Any:
    """Reduce ``x`` (``sum(sizes)`` rows along axis 0, same on every rank) over ranks and keep
    rows ``sum(sizes[:rank]) .. + sizes[rank]``: rank r gets ``sizes[r]`` rows.

    Example (a world of one keeps every row)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.reduce_scatterv(jnp.arange(3.0), sizes=[3])
        Array([0., 1., 2.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="reduce_scatterv")
    leaves, treedef, paths = flatten(x, "reduce_scatterv")
    check_reduce_op(op, "reduce_scatterv", leaves)
    sz = _check_sizes(sizes, ref, "reduce_scatterv")
    for v, p in zip(leaves, paths, strict=True):
        if v.ndim == 0 or v.shape[0] != sum(sz):
            raise SpmdError(
                f"{p} has shape {v.shape}, but sizes={list(sz)} adds up to {sum(sz)} rows "
                "along axis 0",
                op="reduce_scatterv",
            )
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    native, sent = to_sum(op, leaves)
    outs = bind(reduce_scatter_p, *sent, group=ref.meant(f"op={op}"), op=native, sizes=sz)
    return jax.tree_util.tree_unflatten(treedef, from_sum(op, outs, leaves, ref.size))


# -- errors -------------------------------------------------------------------------------------


def _check_sizes(sizes: Any, ref: GroupRef, name: str) -> Sizes:
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence | np.ndarray):
        raise SpmdTypeError(
            f"sizes={sizes!r} is not a list of {ref.size} row counts, one per rank of the group",
            op=name,
        )
    if len(sizes) != ref.size:
        raise SpmdError(
            f"sizes={list(sizes)} has {len(sizes)} entries for a group of {ref.size} ranks "
            f"{list(ref.ranks)}; give one row count per rank",
            op=name,
        )
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 0:
            raise SpmdError(
                f"sizes={list(sizes)} holds {s!r}; row counts are non-negative integers",
                op=name,
            )
    return tuple(int(s) for s in sizes)


# -- primitives ---------------------------------------------------------------------------------


def _gather_eval(*avals: core.ShapedArray, group: GroupRef, sizes: Sizes) -> list[Any]:
    rows = (lambda a: sum(sizes)) if sizes else (lambda a: a.shape[0] * group.size)
    return [core.ShapedArray((rows(a), *a.shape[1:]), a.dtype) for a in avals]


def _scatter_eval(*avals: core.ShapedArray, group: GroupRef, op: str, sizes: Sizes) -> list[Any]:
    rows = (lambda a: sizes[group.rank]) if sizes else (lambda a: a.shape[0] // group.size)
    return [core.ShapedArray((rows(a), *a.shape[1:]), a.dtype) for a in avals]


allgather_p.def_abstract_eval(_gather_eval)
reduce_scatter_p.def_abstract_eval(_scatter_eval)
register_lowering(allgather_p, "spmd_allgather", sizes=lambda sizes, **_: tuple(sizes))
register_lowering(
    reduce_scatter_p,
    "spmd_reduce_scatter",
    op=lambda op, **_: np.int32(REDUCE_OPS[op]),
    sizes=lambda sizes, **_: tuple(sizes),
)


# -- batching -----------------------------------------------------------------------------------


def _batcher(prim: core.Primitive) -> Any:
    # Axis 0 is the gathered/scattered one: batch dimensions go to axis 1 and stay there.
    def rule(args: list[Any], dims: list[Any], **params: Any) -> Any:
        moved, out_dims = batch_second(args, dims)
        return prim.bind(*moved, **params), out_dims

    return rule


batching.primitive_batchers[allgather_p] = _batcher(allgather_p)
batching.primitive_batchers[reduce_scatter_p] = _batcher(reduce_scatter_p)


# -- autodiff -----------------------------------------------------------------------------------


def _gather_transpose(cts: list[Any], *args: Any, group: GroupRef, sizes: Sizes) -> list[Any]:
    # Rank r's rows reach every rank; dL/dx_r sums those rows' cotangents over ranks.
    out_avals = _gather_eval(*[arg_aval(a) for a in args], group=group, sizes=sizes)
    cts = [instantiate(ct, aval) for ct, aval in zip(cts, out_avals, strict=True)]
    return list(reduce_scatter_p.bind(*cts, group=group.backward(), op="sum", sizes=sizes))


def _scatter_jvp(
    primals: list[Any], tangents: list[Any], *, group: GroupRef, op: str, sizes: Sizes
) -> Any:
    outs = reduce_scatter_p.bind(*primals, group=group, op=op, sizes=sizes)
    group = group.jvp()  # the collectives below work on tangents
    t_outs: list[Any] = [zero_tangent(y) for y in outs]
    at = live(tangents)
    if not at:
        return outs, t_outs
    xs = [primals[i] for i in at]
    ts = [tangents[i] for i in at]
    ys = [outs[i] for i in at]

    def rs(values: list[Any]) -> list[Any]:
        return list(reduce_scatter_p.bind(*values, group=group, op="sum", sizes=sizes))

    if op == "sum":
        res = rs(ts)
    elif op == "prod":
        res = [
            y * s for y, s in zip(ys, rs([t / x for t, x in zip(ts, xs, strict=True)]), strict=True)
        ]
    else:
        # max/min: every rank's contribution to a block needs the block's result: gather it.
        full = allgather_p.bind(*ys, group=group, sizes=sizes)
        masks = [x == f for x, f in zip(xs, full, strict=True)]
        num = rs([jnp.where(m, t, jnp.zeros_like(t)) for m, t in zip(masks, ts, strict=True)])
        cnt = rs([m.astype(t.dtype) for m, t in zip(masks, ts, strict=True)])
        res = [n / c for n, c in zip(num, cnt, strict=True)]
    for i, r in zip(at, res, strict=True):
        t_outs[i] = r
    return outs, t_outs


def _scatter_transpose(
    cts: list[Any], *args: Any, group: GroupRef, op: str, sizes: Sizes
) -> list[Any]:
    # Linear only for op="sum": block r of every rank's x feeds rank r's result, so
    # dL/dx_s[block r] = ct_r: gathering the cotangents gives each rank its full dL/dx.
    if op != "sum":
        raise SpmdError(
            f"reduce_scatter(op={op!r}) is not linear, so it has no transpose; only op='sum' "
            "and op='avg' do"
        )
    out_avals = _scatter_eval(*[arg_aval(a) for a in args], group=group, op=op, sizes=sizes)
    cts = [instantiate(ct, aval) for ct, aval in zip(cts, out_avals, strict=True)]
    return list(allgather_p.bind(*cts, group=group.backward(), sizes=sizes))


ad.primitive_jvps[allgather_p] = linear_jvp(allgather_p)
ad.primitive_transposes[allgather_p] = _gather_transpose
ad.primitive_jvps[reduce_scatter_p] = _scatter_jvp
ad.primitive_transposes[reduce_scatter_p] = _scatter_transpose
