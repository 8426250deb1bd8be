"""broadcast: every rank gets the root's array.

Transpose under the global-objective convention (see _allreduce.py): every rank's output is the
root's input, so dL/dx_root = sum_r ct_r and the other ranks' inputs get zero: a sum-reduction
to the root (run as an allreduce whose result only the root keeps).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._jax_compat import ad, batching, core
from ._allreduce import allreduce_p
from ._autodiff import arg_aval, batch_first, instantiate, linear_jvp
from ._checks import check_rank, flatten
from ._primitive import GroupRef, alone, bind, collective_primitive, register_lowering, resolve

broadcast_p = collective_primitive("spmd_broadcast")


def broadcast(x: Any, root: int = 0, *, rank_list: Any = None, group: Any = None) -> Any:
    """Every rank of the group gets ``x`` of the rank at position ``root`` in the group.

    ``x`` (array or pytree, one fused call) has the same shapes and dtypes on every rank; the
    other ranks' values are ignored. Grouping: ``rank_list=`` or ``group=``.

    Example (on several ranks every rank gets rank 0's ``[0., 0.]``)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.broadcast(jnp.full((2,), spmd.init().rank, jnp.float32), root=0)
        Array([0., 0.], dtype=float32)
    """
    ref = resolve(rank_list, group, op="broadcast")
    leaves, treedef, _ = flatten(x, "broadcast")
    r = check_rank(root, "root", "broadcast", ref.ranks)
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    return jax.tree_util.tree_unflatten(treedef, bind(broadcast_p, *leaves, group=ref, root=r))


def _abstract_eval(*avals: core.ShapedArray, group: GroupRef, root: int) -> list[Any]:
    return [core.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]


broadcast_p.def_abstract_eval(_abstract_eval)
register_lowering(broadcast_p, "spmd_broadcast", root=lambda root, **_: int(root))


def _transpose(cts: list[Any], *args: Any, group: GroupRef, root: int) -> list[Any]:
    cts = [instantiate(ct, arg_aval(a)) for ct, a in zip(cts, args, strict=True)]
    summed = allreduce_p.bind(
        *cts, group=group.backward(), op="sum", quantize=None, compression=None
    )
    if group.rank == root:
        return list(summed)
    return [jnp.zeros_like(s) for s in summed]


def _batch(args: list[Any], dims: list[Any], *, group: GroupRef, root: int) -> Any:
    moved, out_dims = batch_first(args, dims)
    return broadcast_p.bind(*moved, group=group, root=root), out_dims


ad.primitive_jvps[broadcast_p] = linear_jvp(broadcast_p)
ad.primitive_transposes[broadcast_p] = _transpose
batching.primitive_batchers[broadcast_p] = _batch
