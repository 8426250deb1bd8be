"""Argument checks every op shares: pytrees of arrays, dtypes, reductions, ranks and axes.

They run on every rank before anything is sent, and depend only on the arguments, so every rank
of a group raises the same :class:`spmd.SpmdError` for the same bad call (naming its own rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from .._native_lib import tables

# The dtypes the native handlers take, in the order messages list them.
SUPPORTED_DTYPES = tuple(
    np.dtype(jnp.bfloat16 if name == "bfloat16" else name) for name in tables()["dtypes"]
)
REDUCE_OPS: dict[str, int] = tables()["reduce_ops"]
REDUCE_NAMES = (*REDUCE_OPS, "avg")
# What a collective takes as a leaf: arrays and scalars (then checked for their dtype).
ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, int, float, complex)

PRNG_KEY = (
    "{path} has dtype {dtype}, which collectives do not take; pass its bits, "
    "jax.random.key_data(x), bit-cast to uint8 (spmd.broadcast_params does this for you)"
)
UNSUPPORTED_DTYPE = (
    "{path} has dtype {dtype}; spmd's collectives take {supported}. Cast it to one that holds "
    "its values (e.g. int16 -> int32), or, to move it unchanged (broadcast, gather, send), pass "
    "its bytes: jax.lax.bitcast_convert_type(x, jnp.uint8) (complex: of x.real and x.imag)"
)


def flatten(x: Any, op: str) -> tuple[list[jax.Array], Any, list[str]]:
    """Leaves of ``x`` as arrays, their treedef and pytree paths; checks the dtypes."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves, paths = [], []
    for path, leaf in with_path:
        name = "x" + jax.tree_util.keystr(path)
        if not isinstance(leaf, ARRAY_LIKE):
            raise SpmdTypeError(
                f"{name} is a {type(leaf).__name__}, not an array; pass arrays or pytrees "
                "(lists, tuples, dicts) of arrays",
                op=op,
            )
        arr = as_array(leaf, op, name)
        leaves.append(arr)
        paths.append(name)
    return leaves, treedef, paths


NOT_NUMBERS = (
    "{path} is a NumPy array of {dtype} ({what}), not of numbers; collectives move numeric "
    "arrays. Convert it (np.asarray(x, dtype=np.float32)), or move Python objects with "
    "comm.broadcast_object / comm.allgather_object"
)
# NumPy kinds that hold no numbers (ml_dtypes' bfloat16 and float8 are kind "V": numbers).
_NOT_NUMBERS = {"O": "Python objects", "U": "text", "S": "bytes"}


def as_array(x: Any, op: str, path: str) -> jax.Array:
    """``x`` as a JAX array of a dtype the collectives take, or an error naming ``path``."""
    if isinstance(x, np.ndarray) and x.dtype.kind in _NOT_NUMBERS:
        what = _NOT_NUMBERS[x.dtype.kind]
        raise SpmdTypeError(NOT_NUMBERS.format(path=path, dtype=x.dtype, what=what), op=op)
    # A NumPy array goes to the device as it is: jnp.asarray would compile a program per shape
    # and dtype to do the same when called eagerly.
    arr = jax.device_put(x) if isinstance(x, np.ndarray) else jnp.asarray(x)
    check_dtype(arr.dtype, op, path)
    return arr


def move_axes(
    leaves: Sequence[Any], sources: Sequence[int], destinations: Sequence[int]
) -> list[Any]:
    """``jnp.moveaxis`` of each leaf, as one program for them all (called eagerly, moveaxis
    compiles one per leaf, shape and dtype); leaves whose axis stays are passed through. Axes
    are non-negative."""
    move = [s != d for s, d in zip(sources, destinations, strict=True)]
    if not any(move):
        return list(leaves)
    picked = [v for v, m in zip(leaves, move, strict=True) if m]
    axes = tuple((s, d) for s, d, m in zip(sources, destinations, move, strict=True) if m)
    moved = iter(_moved(picked, axes))
    return [next(moved) if m else v for v, m in zip(leaves, move, strict=True)]


@partial(jax.jit, static_argnums=1)
def _moved(leaves: list[Any], axes: tuple[tuple[int, int], ...]) -> list[Any]:
    return [jnp.moveaxis(v, s, d) for v, (s, d) in zip(leaves, axes, strict=True)]


def check_dtype(dtype: Any, op: str, path: str) -> None:
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys
        raise SpmdTypeError(PRNG_KEY.format(path=path, dtype=dtype), op=op)
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise SpmdTypeError(
            UNSUPPORTED_DTYPE.format(path=path, dtype=np.dtype(dtype), supported=supported), op=op
        )


def check_reduce_op(op: Any, name: str, leaves: Sequence[jax.Array]) -> None:
    if op not in REDUCE_NAMES:
        raise SpmdError(
            f"op={op!r} is not a reduction; expected one of {', '.join(REDUCE_NAMES)}", op=name
        )
    if op == "avg":
        for leaf in leaves:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise SpmdTypeError(
                    f"op='avg' needs floating-point arrays, got {leaf.dtype}; use op='sum' and "
                    "divide, or cast to a float dtype",
                    op=name,
                )


def check_rank(value: Any, what: str, op: str, ranks: Sequence[int]) -> int:
    """``value`` as a rank of the group of world ranks ``ranks`` (its position in the group)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise SpmdTypeError(
            f"{what}={value!r} is not an integer rank of the group of ranks {list(ranks)}", op=op
        )
    if not 0 <= int(value) < len(ranks):
        raise SpmdError(
            f"{what}={value} is out of range for the group of ranks {list(ranks)} (valid: "
            f"0..{len(ranks) - 1}, positions in that group)",
            op=op,
        )
    return int(value)


def check_axis(axis: Any, ndim: int, what: str, op: str, path: str) -> int:
    """``axis`` of an array of ``ndim`` dimensions, made non-negative."""
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise SpmdTypeError(f"{what}={axis!r} is not an int", op=op)
    if not -ndim <= int(axis) < max(ndim, 1) or ndim == 0:
        raise SpmdError(
            f"{what}={axis} is out of range for {path} with {ndim} dimension(s) (valid: "
            f"{-ndim}..{ndim - 1})"
            + ("; a scalar has no axis to split or join, reshape it to (1,)" if ndim == 0 else ""),
            op=op,
        )
    return int(axis) % ndim


_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def to_sum(op: str, leaves: Sequence[Any]) -> tuple[str, list[Any]]:
    """What the native layer reduces for ``op``: an average is a sum, float16/bfloat16 leaves
    of it widened to float32 so that the sum cannot overflow (or round) before the division."""
    if op != "avg":
        return op, list(leaves)
    return "sum", [v.astype(jnp.float32) if v.dtype in _HALF else v for v in leaves]


def from_sum(op: str, outs: Sequence[Any], like: Sequence[Any], size: int) -> list[Any]:
    """The results of :func:`to_sum`'s reduction as ``op``'s: averages divided by the group
    size and rounded once to the dtypes of ``like``."""
    if op != "avg":
        return list(outs)
    return [(y / size).astype(x.dtype) for y, x in zip(outs, like, strict=True)]


def axes_meaning(name: str, axes: list[int]) -> str:
    """How a call's axes (normalized, one per leaf) read in its signature (GroupRef.meant):
    ``"axis=1"``, or ``"axis=[1, 0]"`` when the leaves differ."""
    if len(set(axes)) <= 1:
        return f"{name}={axes[0] if axes else 0}"
    return f"{name}={list(axes)}"
