"""allreduce_rmsnorm: the tensor-parallel epilogue (all-reduce the partial sums of a row-parallel
layer, add the residual, RMS-normalize) as one collective.

On GPU it is one kernel over the custom all-reduce's IPC buffers where eligible (hidden size up
to 16384 and the rows within the registered buffer; _gpu_chain.select_rmsnorm), and NCCL's
all-reduce followed by a norm kernel otherwise; on CPU it is the all-reduce followed by the
norm in XLA. Every path computes the same thing, to float rounding:

    residual_out = allreduce(x) + residual            (in x's dtype, as the two ops would round)
    r = float32(residual_out)
    normed = r * rsqrt(mean(r**2, axis=-1) + eps) * float32(weight)     (rounded to x's dtype)

Its derivative is that of this composition (the gradient convention of allreduce).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from .._jax_compat import ad, batching, core, mlir
from . import _gpu_chain
from ._allreduce import allreduce_p
from ._primitive import (
    GroupRef,
    alone,
    bind,
    check_attrs,
    collective_primitive,
    gpu_side,
    lower_collective,
    resolve,
)

allreduce_rmsnorm_p = collective_primitive("spmd_allreduce_rmsnorm")

_FLOATS = ("float32", "float16", "bfloat16", "float64")  # float64: CPU only


def allreduce_rmsnorm(
    x: Any,
    residual: Any,
    weight: Any,
    eps: float = 1e-6,
    *,
    rank_list: Any = None,
    group: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """All-reduce ``x``, add ``residual``, and RMS-normalize the rows; returns
    ``(normed, residual_out)``.

    Args:
        x: this rank's partial sums, ``[..., hidden]``, float32, float16 or bfloat16.
        residual: the same shape and dtype as ``x``.
        weight: ``[hidden]``, the norm's scale, the same dtype.
        eps: added to the mean square before the reciprocal square root.
        rank_list, group: as for :func:`spmd.allreduce`.

    Returns:
        ``normed`` and ``residual_out = allreduce(x) + residual``, both shaped like ``x``.

    Example (a world of one: the norm of ``x + residual``)::

        >>> import jax.numpy as jnp, spmd
        >>> x = jnp.array([[1.0, -1.0, 1.0, -1.0]])
        >>> normed, out = spmd.ops.allreduce_rmsnorm(x, x, jnp.full(4, 0.5), eps=0.0)
        >>> normed
        Array([[ 0.5, -0.5,  0.5, -0.5]], dtype=float32)
        >>> out
        Array([[ 2., -2.,  2., -2.]], dtype=float32)
    """
    op = "allreduce_rmsnorm"
    ref = resolve(rank_list, group, op=op)
    x, residual, weight = jnp.asarray(x), jnp.asarray(residual), jnp.asarray(weight)
    if x.dtype.name not in _FLOATS:
        raise SpmdTypeError(f"x has dtype {x.dtype}; expected one of {', '.join(_FLOATS)}", op=op)
    if x.ndim < 1:
        raise SpmdError("x is a scalar; expected [..., hidden]", op=op)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise SpmdError(
            f"residual is {residual.dtype}{list(residual.shape)}, expected x's "
            f"{x.dtype}{list(x.shape)}",
            op=op,
        )
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise SpmdError(
            f"weight is {weight.dtype}{list(weight.shape)}, expected {x.dtype}[{x.shape[-1]}] "
            "(hidden = x.shape[-1])",
            op=op,
        )
    eps = float(eps)
    if alone(ref):
        return _norm(x + residual, weight, eps)
    normed, out = bind(allreduce_rmsnorm_p, x, residual, weight, group=ref, eps=eps)
    return normed, out


def _norm(residual_out: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    r = residual_out.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + jnp.float32(eps))
    normed = (r * inv * weight.astype(jnp.float32)).astype(residual_out.dtype)
    return normed, residual_out


def _composed(x: Any, residual: Any, weight: Any, *, group: GroupRef, eps: float) -> list[Any]:
    (summed,) = allreduce_p.bind(x, group=group, op="sum", quantize=None, compression=None)
    return list(_norm(summed + residual, weight, eps))


def _abstract_eval(
    x: core.ShapedArray, residual: core.ShapedArray, weight: core.ShapedArray, **_: Any
) -> list[core.ShapedArray]:
    return [core.ShapedArray(x.shape, x.dtype), core.ShapedArray(x.shape, x.dtype)]


def _cuda_rule(
    ctx: mlir.LoweringRuleContext, x: Any, residual: Any, weight: Any, *, group: GroupRef,
    eps: float
) -> list[Any]:  # fmt: skip
    aval: Any = ctx.avals_in[0]
    if aval.dtype == np.float64:
        raise SpmdTypeError(
            "float64 runs on CPU only; on GPU pass float32, float16 or bfloat16",
            op="allreduce_rmsnorm",
        )
    hidden = aval.shape[-1]
    rows = int(np.prod(aval.shape[:-1]))
    gpu = gpu_side(group, "allreduce_rmsnorm")
    path = _gpu_chain.select_rmsnorm(rows, hidden, aval.dtype, gpu, _gpu_chain.chain_config())
    return lower_collective(
        ctx,
        "spmd_cuda_allreduce_rmsnorm",
        [x, residual, weight],
        group=group.attr,
        eps=np.float32(eps),
        algo=np.int32(_gpu_chain.ALGOS[path]),
        **check_attrs("allreduce_rmsnorm", ctx.avals_in, {"group": group, "eps": eps}),
    )


def _jvp(primals: list[Any], tangents: list[Any], *, group: GroupRef, eps: float) -> Any:
    fn = functools.partial(_composed, group=group, eps=eps)
    return jax.jvp(fn, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))


def _batch(args: list[Any], dims: list[Any], *, group: GroupRef, eps: float) -> Any:
    fn = functools.partial(_composed, group=group, eps=eps)
    return jax.vmap(fn, in_axes=list(dims))(*args), [0, 0]  # unbatched dims are None


allreduce_rmsnorm_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(
    allreduce_rmsnorm_p,
    mlir.lower_fun(_composed, multiple_results=True),
    platform="cpu",
    cacheable=False,
)
mlir.register_lowering(allreduce_rmsnorm_p, _cuda_rule, platform="cuda", cacheable=False)
ad.primitive_jvps[allreduce_rmsnorm_p] = _jvp
batching.primitive_batchers[allreduce_rmsnorm_p] = _batch
