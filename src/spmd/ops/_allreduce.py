"""allreduce: every rank gets the reduction of every rank's array.

Gradient convention (all of spmd.ops): each rank holds its own objective L_r and spmd
differentiates the global objective L = sum_r L_r. A cotangent on rank r is dL/dy_r, so the
transpose of a sum-allreduce is a sum-allreduce of the cotangents (dL/dx_r = sum_s dL/dy_s).
Values that are the same on every rank (replicated parameters) count as one independent copy per
rank: the gradient for rank r's copy is what reaches rank r; allreduce it for the gradient of
the shared value (what spmd.data_parallel does).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from .._jax_compat import ad, batching, core, mlir
from .._native_lib import tables
from . import _gpu_chain
from ._autodiff import arg_aval, batch_first, instantiate, live, zero_tangent
from ._checks import REDUCE_OPS, check_reduce_op, flatten, from_sum, to_sum
from ._primitive import (
    GroupRef,
    alone,
    bind,
    collective_primitive,
    collective_rules,
    gpu_side,
    register_rules,
    resolve,
)

allreduce_p = collective_primitive("spmd_allreduce")


def allreduce(
    x: Any,
    op: str = "sum",
    *,
    rank_list: Any = None,
    group: Any = None,
    quantize: str | None = None,
    compression: str | None = None,
    deterministic: bool = False,
) -> Any:
    """Reduce ``x`` over the ranks of the group; every rank gets the result.

    Args:
        x: an array or a pytree of arrays (sent in one fused call). Same shapes and dtypes on
            every rank of the group.
        op: ``"sum"``, ``"avg"`` (floating dtypes), ``"max"``, ``"min"`` or ``"prod"``. On bool
            arrays sum/max are logical or, prod/min logical and.
        rank_list: RAF's grouping, e.g. ``[[0, 1], [2, 3]]``: each rank reduces within its
            list; unlisted ranks form groups of their own. Default: all ranks.
        group: a Communicator, or an axis name of the active mesh (instead of rank_list).
        quantize: ``"fp8"``, ``"int8"`` or ``"int4"``: on GPU, send block-scaled codes of
            float leaves large enough to gain (the quantized all-reduce of the GPU all-reduce
            chain, error bound in docs/gpu.md); ``SPMD_QUANTIZE`` sets a default. Exact paths
            are used where it does not apply, and always on CPU.
        compression: ``"bf16"`` or ``"fp16"`` (op sum or avg): float32 leaves travel rounded to
            bfloat16/float16, PyTorch DDP's compression hooks. Each rank's values are rounded
            once (for avg, after scaling by the float32 reciprocal of the group size, so that a
            float16 sum does not overflow where the average would not), summed in float32 in
            rank order, and the sum rounded once before it is widened back to float32. On CPU
            the rounding happens inside the native call, as it copies the data (no extra passes
            over memory), for calls of 4 MiB of float32 or more; XLA casts around the exact
            all-reduce for smaller calls (faster in cache) and on GPU: the same bits either way.
            Leaves of other dtypes are reduced exactly.
        deterministic: the same bits on every transport (shared memory, MPI, hierarchical) and
            on CPU and GPU: the group's values are gathered in rank order and combined in a
            fixed pairwise order, ``(x0 + x1) + (x2 + x3)``, ... (an odd one out carried to the
            next level), by elementwise operations that XLA does not reorder. It moves
            ``size`` times the bytes of the allreduce (an allgather). Gradients flow through
            the allgather's transpose. Not with ``quantize`` or ``compression``.

    Returns:
        ``x``'s structure, shapes and dtypes, identical on every rank: reduced in rank order
        on shared memory, in MPI's order or node by node otherwise (docs/collectives.md).

    Example (a world of one returns ``x``; on 4 ranks, ``spmd-run -n 4``, where rank r holds
    ``r + 1``, every rank gets 10, and with ``rank_list=[[0, 1], [2, 3]]`` ranks 0, 1 get 3 and
    ranks 2, 3 get 7)::

        >>> import jax, jax.numpy as jnp, spmd
        >>> x = jnp.full((2,), spmd.init().rank + 1, jnp.float32)
        >>> spmd.allreduce(x)
        Array([1., 1.], dtype=float32)
        >>> jax.jit(lambda t: spmd.allreduce(t, "max"))({"a": x, "b": x * 3})
        {'a': Array([1., 1.], dtype=float32), 'b': Array([3., 3.], dtype=float32)}
    """
    ref = resolve(rank_list, group, op="allreduce")
    leaves, treedef, _ = flatten(x, "allreduce")
    check_reduce_op(op, "allreduce", leaves)
    quantize = _gpu_chain.check_quantize(quantize, "allreduce")
    _check_compression(compression, op)
    if deterministic not in (True, False):
        raise SpmdTypeError(f"deterministic={deterministic!r}; expected True or False",
                            op="allreduce")  # fmt: skip
    if deterministic and (quantize is not None or compression is not None):
        raise SpmdError(
            "deterministic=True reduces exactly, in a fixed order; leave out quantize and "
            "compression",
            op="allreduce",
        )
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    if deterministic:
        return jax.tree_util.tree_unflatten(treedef, _fixed_order(leaves, op, rank_list, group))
    if compression is not None:
        return jax.tree_util.tree_unflatten(treedef, _compressed(leaves, op, ref, compression))
    return jax.tree_util.tree_unflatten(treedef, _exact(leaves, op, ref, quantize))


_COMBINE = {"sum": jnp.add, "avg": jnp.add, "prod": jnp.multiply, "max": jnp.maximum,
            "min": jnp.minimum}  # fmt: skip


def tree_reduce(stacked: Any, combine: Any = jnp.add) -> Any:
    """``combine`` over axis 0 of ``stacked`` in a fixed pairwise order that depends only on its
    length: (x0 + x1) + (x2 + x3), ..., an odd one out carried to the next level. Elementwise
    operations only, which XLA neither reorders nor reassociates."""
    parts = [stacked[i] for i in range(stacked.shape[0])]
    while len(parts) > 1:
        pairs = [combine(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        parts = pairs + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def _fixed_order(leaves: list[Any], op: str, rank_list: Any, group: Any) -> list[Any]:
    """allreduce(deterministic=True): one allgather of every leaf, then tree_reduce."""
    from ._gather import allgather

    stacked = allgather([v[None] for v in leaves], rank_list=rank_list, group=group)
    outs = []
    for v, s in zip(leaves, stacked, strict=True):
        if v.dtype == jnp.bool_:  # logical or (sum, max) and and (prod, min)
            r = tree_reduce(s, jnp.logical_or if op in ("sum", "max") else jnp.logical_and)
        else:
            r = tree_reduce(s, _COMBINE[op])
        outs.append((r / s.shape[0]).astype(v.dtype) if op == "avg" else r)
    return outs


def _exact(leaves: list[Any], op: str, ref: GroupRef, quantize: str | None) -> list[Any]:
    native, sent = to_sum(op, leaves)
    # An average runs as a sum: the signature says which the caller meant.
    meant = ref.meant("op=avg") if op == "avg" else ref
    outs = bind(allreduce_p, *sent, group=meant, op=native, quantize=quantize, compression=None)
    return from_sum(op, outs, leaves, ref.size)


# Wire codes of compressed allreduces, shared with the native layer.
WIRES: dict[str, int] = tables()["wires"]
_HALVES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
# On CPU, a compressed call with fewer float32 bytes than this is lowered to XLA casts around an
# exact half-precision allreduce (_cast_around: the same bits, as that allreduce also sums in
# float32 in rank order and rounds once); larger ones round inside the native call, which is
# faster from there on (docs/performance.md, "Compressed allreduce").
NATIVE_COMPRESSION_MIN_BYTES = 4 << 20


def _check_compression(compression: Any, op: str) -> None:
    if compression is None:
        return
    if compression not in WIRES:
        raise SpmdError(
            f"compression={compression!r}; expected None, 'bf16' or 'fp16'", op="allreduce"
        )
    if op not in ("sum", "avg"):
        raise SpmdError(
            f"compression={compression!r} needs op='sum' or op='avg', got op={op!r}",
            op="allreduce",
        )


def _compressed(leaves: list[Any], op: str, ref: GroupRef, compression: str) -> list[Any]:
    """float32 leaves in one compressed call, the others in one exact call."""
    wide = [i for i, v in enumerate(leaves) if v.dtype == jnp.float32]
    rest = [i for i, v in enumerate(leaves) if v.dtype != jnp.float32]
    outs: list[Any] = list(leaves)
    if wide:
        xs = [leaves[i] for i in wide]
        ys = bind(allreduce_p, *xs, group=ref, op=op, quantize=None, compression=compression)
        for i, y in zip(wide, ys, strict=True):
            outs[i] = y
    if rest:
        for i, y in zip(rest, _exact([leaves[i] for i in rest], op, ref, None), strict=True):
            outs[i] = y
    return outs


def _cast_around(
    ctx: Any, operands: Any, *, group: GroupRef, op: str, compression: str, **_: Any
) -> list[Any]:
    """A compressed call lowered as XLA casts around an exact half-precision allreduce: each
    rank's values scaled by 1/n (avg) and rounded, summed in float32 and rounded once by that
    allreduce, widened. The same bits as the native rounding (which scales by the same float32
    reciprocal), and the same primitive, so grad and vmap see one set of rules."""
    half = _HALVES[compression]
    scale = np.float32(1.0 / group.size)

    def casts(*xs: Any) -> list[Any]:
        sent = [(x * scale if op == "avg" else x).astype(half) for x in xs]
        summed = allreduce_p.bind(*sent, group=group, op="sum", quantize=None, compression=None)
        return [y.astype(jnp.float32) for y in summed]

    return list(mlir.lower_fun(casts, multiple_results=True)(ctx, *operands))


def _abstract_eval(
    *avals: core.ShapedArray,
    group: GroupRef,
    op: str,
    quantize: str | None,
    compression: str | None,
) -> list[core.ShapedArray]:
    return [core.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]


def _cuda_attrs(
    ctx: Any, *, group: GroupRef, op: str, quantize: str | None, compression: str | None
) -> dict[str, Any]:
    """The GPU chain's choice for each leaf (_gpu_chain.py), fixed at compile time."""
    gpu = gpu_side(group, "allreduce")
    cfg = _gpu_chain.chain_config()
    algos = tuple(
        _gpu_chain.ALGOS[
            _gpu_chain.select_allreduce(
                int(np.prod(a.shape)) * a.dtype.itemsize, a.dtype, op, gpu, cfg, quantize
            )
        ]
        for a in ctx.avals_in
    )
    codec = _gpu_chain.CODECS.get(quantize or cfg.quantize or "", 0)
    return {"algos": algos, "codec": np.int32(codec)}


def _cpu_attrs(*, group: GroupRef, op: str, compression: str | None, **_: Any) -> dict[str, Any]:
    """Compression: the wire code, and what each rank's values are divided by before rounding
    (the group size for op='avg', which only compressed calls bind; exact averages are sums)."""
    return {
        "wire": np.int32(WIRES[compression] if compression else 0),
        "div": group.size if op == "avg" else 1,
    }


allreduce_p.def_abstract_eval(_abstract_eval)
_cpu_rule, _cuda_rule = collective_rules(
    "spmd_allreduce",
    cuda_attrs=_cuda_attrs,
    cpu_attrs=_cpu_attrs,
    op=lambda op, **_: np.int32(REDUCE_OPS["sum" if op == "avg" else op]),
)


def _lower_cpu(ctx: Any, *operands: Any, **params: Any) -> list[Any]:
    if params["compression"] is not None and (
        sum(int(np.prod(a.shape)) * 4 for a in ctx.avals_in) < NATIVE_COMPRESSION_MIN_BYTES
    ):
        return _cast_around(ctx, operands, **params)
    return _cpu_rule(ctx, *operands, **params)


def _lower_cuda(ctx: Any, *operands: Any, **params: Any) -> list[Any]:
    if params["compression"] is not None:  # no native codec on GPU
        return _cast_around(ctx, operands, **params)
    packs = _gpu_chain.pack_allreduce(
        [(int(np.prod(a.shape)), a.dtype) for a in ctx.avals_in],
        params["op"],
        gpu_side(params["group"], "allreduce"),
        _gpu_chain.chain_config(),
        params["quantize"],
    )
    if not packs:
        return _cuda_rule(ctx, *operands, **params)
    return _packed(ctx, operands, packs, params)


def _packed(ctx: Any, operands: Any, packs: list[list[int]], params: Any) -> list[Any]:
    """One fused call with the leaves of each pack (``_gpu_chain.pack_allreduce``) flattened
    into one buffer, each padded to 16 bytes: XLA copies them in and slices the results out;
    the handler sends each pack with one launch instead of one per leaf."""
    avals = ctx.avals_in
    packed = {i for pack in packs for i in pack}
    rest = [i for i in range(len(avals)) if i not in packed]
    sizes = [_gpu_chain.padded_count(int(np.prod(a.shape)), a.dtype) for a in avals]
    wire = [
        core.ShapedArray((sum(sizes[i] for i in pack),), avals[pack[0]].dtype) for pack in packs
    ] + [avals[i] for i in rest]

    def pack_in(*xs: Any) -> list[Any]:
        flats = [
            jnp.concatenate([jnp.pad(xs[i].ravel(), (0, sizes[i] - xs[i].size)) for i in pack])
            for pack in packs
        ]
        return [*flats, *(xs[i] for i in rest)]

    def unpack(*ys: Any) -> list[Any]:
        outs: list[Any] = [None] * len(avals)
        for pack, flat in zip(packs, ys, strict=False):
            start = 0
            for i in pack:
                outs[i] = flat[start : start + avals[i].size].reshape(avals[i].shape)
                start += sizes[i]
        for i, y in zip(rest, ys[len(packs) :], strict=True):
            outs[i] = y
        return outs

    sent = mlir.lower_fun(pack_in, multiple_results=True)(ctx.replace(avals_out=wire), *operands)
    summed = _cuda_rule(ctx.replace(avals_in=wire, avals_out=wire), *sent, **params)
    return list(mlir.lower_fun(unpack, multiple_results=True)(ctx.replace(avals_in=wire), *summed))


register_rules(allreduce_p, _lower_cpu, _lower_cuda)


def _sum(
    values: list[Any],
    group: GroupRef,
    quantize: str | None = None,
    compression: str | None = None,
    op: str = "sum",
) -> list[Any]:
    return list(
        allreduce_p.bind(*values, group=group, op=op, quantize=quantize, compression=compression)
    )


def _jvp(
    primals: list[Any],
    tangents: list[Any],
    *,
    group: GroupRef,
    op: str,
    quantize: str | None,
    compression: str | None,
) -> Any:
    outs = allreduce_p.bind(
        *primals, group=group, op=op, quantize=quantize, compression=compression
    )
    group = group.jvp()  # the collectives below work on tangents
    at = live(tangents)
    t_outs: list[Any] = [zero_tangent(y) for y in outs]
    if not at:
        return outs, t_outs
    xs = [primals[i] for i in at]
    ts = [tangents[i] for i in at]
    ys = [outs[i] for i in at]
    if op in ("sum", "avg"):  # linear (compressed: up to the rounding, which is not followed)
        res = _sum(ts, group, quantize, compression, op)
    elif op == "prod":
        # d(prod_r x_r) = prod * sum_r t_r / x_r (undefined where some x_r == 0).
        res = [
            y * s
            for y, s in zip(
                ys, _sum([t / x for t, x in zip(ts, xs, strict=True)], group), strict=True
            )
        ]
    else:
        # max/min: the tangent of the rank(s) holding the extreme value, averaged over ties.
        masks = [(x == y) for x, y in zip(xs, ys, strict=True)]
        num = _sum(
            [jnp.where(m, t, jnp.zeros_like(t)) for m, t in zip(masks, ts, strict=True)], group
        )
        cnt = _sum([m.astype(t.dtype) for m, t in zip(masks, ts, strict=True)], group)
        res = [n / c for n, c in zip(num, cnt, strict=True)]
    for i, r in zip(at, res, strict=True):
        t_outs[i] = r
    return outs, t_outs


def _transpose(
    cts: list[Any],
    *args: Any,
    group: GroupRef,
    op: str,
    quantize: str | None,
    compression: str | None,
) -> list[Any]:
    # Only op="sum" is linear. Transpose of sum-allreduce is sum-allreduce: dL/dx_r = sum_s ct_s.
    # A compressed op="avg" (y = sum_s x_s / n) transposes to itself.
    if op not in ("sum", "avg"):
        raise SpmdError(
            f"allreduce(op={op!r}) is not linear, so it has no transpose (jax.linear_transpose, "
            "or a VJP that treats it as linear); only op='sum' and op='avg' do"
        )
    avals = [arg_aval(a) for a in args]
    cts = [instantiate(ct, aval) for ct, aval in zip(cts, avals, strict=True)]
    return _sum(cts, group.backward(), quantize, compression, op)


def _batch(
    args: list[Any],
    dims: list[Any],
    *,
    group: GroupRef,
    op: str,
    quantize: str | None,
    compression: str | None,
) -> Any:
    # Element-wise across ranks, with the batch axis first on every rank (one rank's in_axes
    # may differ from another's).
    moved, out_dims = batch_first(args, dims)
    outs = allreduce_p.bind(*moved, group=group, op=op, quantize=quantize, compression=compression)
    return outs, out_dims


ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
batching.primitive_batchers[allreduce_p] = _batch
