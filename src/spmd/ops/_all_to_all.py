"""all_to_all: rank r sends block j of its array to rank j and concatenates what it receives.

The primitive exchanges blocks along a leading axis of length ``size``: result block j on rank r
is input block r of rank j. That exchange is its own transpose (the cotangent of block j on rank
r goes back to block r of rank j), so the transpose of ``all_to_all(split_axis=a,
concat_axis=b)`` is ``all_to_all(split_axis=b, concat_axis=a)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError
from .._jax_compat import ad, batching, core
from ._autodiff import arg_aval, batch_second, instantiate, linear_jvp
from ._checks import axes_meaning, check_axis, flatten
from ._primitive import GroupRef, alone, bind, collective_primitive, register_lowering, resolve

all_to_all_p = collective_primitive("spmd_all_to_all")


def all_to_all(
    x: Any, split_axis: int = 0, concat_axis: int = 0, *, rank_list: Any = None, group: Any = None
) -> Any:
    """Split ``x`` along ``split_axis`` into ``size`` blocks, send block j to rank j, and
    concatenate the blocks received along ``concat_axis`` in rank order.

    ``x.shape[split_axis]`` must divide by the group size. Same shapes on every rank. The result
    has ``split_axis`` ``size`` times shorter and ``concat_axis`` ``size`` times longer (as
    ``jax.lax.all_to_all(..., tiled=True)``).

    Example (a world of one keeps its one block; on 2 ranks holding ``[10r, 10r + 1]``, rank 0
    gets ``[0., 10.]`` and rank 1 ``[1., 11.]``)::

        >>> import jax.numpy as jnp, spmd
        >>> r = spmd.init().rank
        >>> spmd.all_to_all(jnp.array([10.0 * r, 10.0 * r + 1]))
        Array([0., 1.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="all_to_all")
    leaves, treedef, paths = flatten(x, "all_to_all")
    n = ref.size
    plans = []
    for v, p in zip(leaves, paths, strict=True):
        s = check_axis(split_axis, v.ndim, "split_axis", "all_to_all", p)
        c = check_axis(concat_axis, v.ndim, "concat_axis", "all_to_all", p)
        if v.shape[s] % n:
            raise SpmdError(
                f"{p} has {v.shape[s]} elements along split_axis={s}, not divisible by the "
                f"group size {n}",
                op="all_to_all",
            )
        plans.append((s, c))
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    blocks = _to_blocks(leaves, tuple(plans), n)
    meaning = (
        axes_meaning("split_axis", [s for s, _ in plans])
        + ", "
        + axes_meaning("concat_axis", [c for _, c in plans])
    )
    outs = bind(all_to_all_p, *blocks, group=ref.meant(meaning))
    return jax.tree_util.tree_unflatten(treedef, _from_blocks(outs, tuple(plans)))


# The reshapes and moves around the exchange, one program per call for all leaves (called
# eagerly, each jnp operation on each leaf would compile a program of its own).


@partial(jax.jit, static_argnums=(1, 2))
def _to_blocks(leaves: list[Any], plans: tuple[tuple[int, int], ...], n: int) -> list[Any]:
    """Each leaf as (n, rows / n, ...): block j, for rank j, along axis 0."""
    blocks = []
    for v, (s, _) in zip(leaves, plans, strict=True):
        m = jnp.moveaxis(v, s, 0)
        blocks.append(m.reshape(n, m.shape[0] // n, *m.shape[1:]))
    return blocks


@partial(jax.jit, static_argnums=1)
def _from_blocks(outs: list[Any], plans: tuple[tuple[int, int], ...]) -> list[Any]:
    """The blocks received (n, rows / n, ...) concatenated along each leaf's concat axis."""
    results = []
    for y, (s, c) in zip(outs, plans, strict=True):
        y = jnp.moveaxis(y, 1, s + 1)  # (n, *x.shape with split_axis / n)
        y = jnp.moveaxis(y, 0, c)  # rank axis right before concat_axis
        shape = list(y.shape)
        results.append(y.reshape(*shape[:c], shape[c] * shape[c + 1], *shape[c + 2 :]))
    return results


def _abstract_eval(*avals: core.ShapedArray, group: GroupRef) -> list[Any]:
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


all_to_all_p.def_abstract_eval(_abstract_eval)
register_lowering(all_to_all_p, "spmd_all_to_all")


def _transpose(cts: list[Any], *args: Any, group: GroupRef) -> list[Any]:
    cts = [instantiate(ct, arg_aval(a)) for ct, a in zip(cts, args, strict=True)]
    return list(all_to_all_p.bind(*cts, group=group.backward()))


def _batch(args: list[Any], dims: list[Any], *, group: GroupRef) -> Any:
    # Axis 0 holds the blocks: batch dimensions go to axis 1.
    moved, out_dims = batch_second(args, dims)
    return all_to_all_p.bind(*moved, group=group), out_dims


ad.primitive_jvps[all_to_all_p] = linear_jvp(all_to_all_p)
ad.primitive_transposes[all_to_all_p] = _transpose
batching.primitive_batchers[all_to_all_p] = _batch
