"""Helpers of the ops' JVP, transpose and batching rules.

The gradient convention they serve is stated once, in ``_allreduce.py``'s module doc: every rank
holds its own objective and spmd differentiates their sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from .._jax_compat import Zero, ad, core


def instantiate(ct: Any, aval: core.ShapedArray) -> Any:
    """A cotangent as an array (symbolic zeros become real zeros: every rank must send)."""
    if isinstance(ct, Zero) or ct is None:
        return jnp.zeros(aval.shape, aval.dtype)
    return ct


def arg_aval(arg: Any) -> core.ShapedArray:
    """The aval of a transpose rule's argument, linear (undefined) or not."""
    aval: core.ShapedArray = arg.aval if ad.is_undefined_primal(arg) else core.typeof(arg)
    return aval


def zero_tangent(primal: Any) -> Any:
    """The symbolic zero tangent of ``primal`` (no communication: the same on every rank)."""
    return Zero(core.typeof(primal).to_tangent_aval())


def live(tangents: Sequence[Any]) -> list[int]:
    """Positions of the tangents that are not symbolic zeros. Which are zero is decided by the
    program, so it is the same on every rank."""
    return [i for i, t in enumerate(tangents) if not isinstance(t, Zero)]


def linear_jvp(prim: core.Primitive) -> Any:
    """The JVP rule of a primitive linear in every operand: the same collective on the live
    tangents (symbolic zeros stay zeros)."""

    def rule(primals: list[Any], tangents: list[Any], **params: Any) -> Any:
        outs = prim.bind(*primals, **params)
        t_outs: list[Any] = [zero_tangent(y) for y in outs]
        at = live(tangents)
        if at:
            t_params = {**params, "group": params["group"].jvp()}
            for i, r in zip(at, prim.bind(*[tangents[i] for i in at], **t_params), strict=True):
                t_outs[i] = r
        return outs, t_outs

    return rule


def batch_first(args: Sequence[Any], dims: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Batched operands with the batch axis first, and the batch dims of results shaped like
    them: ranks may batch along different axes, and an elementwise collective combines memory,
    so every rank must lay the batch out alike. Unbatched operands stay as they are."""
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    return moved, [None if d is None else 0 for d in dims]


def batch_second(args: Sequence[Any], dims: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """As :func:`batch_first`, with the batch axis second: for primitives whose axis 0 is the
    one they gather, scatter or exchange along."""
    moved = [x if d is None else jnp.moveaxis(x, d, 1) for x, d in zip(args, dims, strict=True)]
    return moved, [None if d is None else 1 for d in dims]


def rows_batcher(prim: core.Primitive) -> Any:
    """The batching rule of a collective whose operand 0 holds rows on axis 0 and whose other
    operands (counts, indices, ids, weights) say how they move (all_to_allv, the MoE exchange).
    Only the rows batched: the batch goes to axis 1, and one call moves every element's rows
    (its results after the first are the same for every element). Anything else batched: one
    call per element, in order (every rank of the group batches alike, so the calls pair up)."""

    def rule(args: list[Any], dims: list[Any], **params: Any) -> Any:
        if all(d is None for d in dims[1:]):
            outs = prim.bind(jnp.moveaxis(args[0], dims[0], 1), *args[1:], **params)
            return outs, [1] + [None] * (len(outs) - 1)
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

        def at(a: Any, d: Any, b: int) -> Any:
            return a if d is None else jnp.take(a, b, axis=d)

        each = [prim.bind(*(at(a, d, b) for a, d in zip(args, dims, strict=True)), **params)
                for b in range(size)]  # fmt: skip
        return [jnp.stack(outs) for outs in zip(*each, strict=True)], [0] * len(each[0])

    return rule
