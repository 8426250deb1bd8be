"""all_to_allv: every rank sends each peer a number of rows of its own choosing.

Rank r sends its first ``send_counts[0]`` rows to group member 0, the next ``send_counts[1]`` to
member 1, and so on; it receives ``recv_counts[j]`` rows from member j, packed from row 0 in
member order, and zeros after them up to the output's static row count. The primitive always
carries both counts, as int32 operands of shape (size,), and that row count (``out_rows``): the
transpose needs them. Its ``exact`` flag says whether the send counts must add up to the rows of
x (the public function) or to at most that (the transpose, which sends from a padded cotangent).

Every rank publishes its counts before any row moves and checks every rank's (the native layer,
``spmd/alltoallv.h``), so a count that is negative, does not add up, disagrees with what the
peer sends, or overflows the output is the same error on every rank, also when the counts are
traced.

Gradient convention (see _allreduce.py: spmd differentiates the sum of every rank's objective):
each row of rank j's x lands in exactly one row of one rank's y, so its cotangent is the
cotangent of that row. The transpose is the reverse exchange, ``all_to_allv(ct_y,
send=recv_counts, recv=send_counts, out_rows=x.shape[0])``: nothing is summed, and rows of x
that were not sent (past ``sum(send_counts)``) get zeros, as do the padding rows of y.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from .._jax_compat import Zero, ad, batching, core
from ._all_to_all import all_to_all
from ._autodiff import arg_aval, instantiate, zero_tangent
from ._checks import ARRAY_LIKE, as_array
from ._primitive import GroupRef, alone, bind, collective_primitive, register_lowering, resolve

all_to_allv_p = collective_primitive("spmd_all_to_allv")

_OP = "all_to_allv"
_INT32_MAX = 2**31 - 1

# Counts as the primitive takes them, and their values where they are known at trace time.
Counts = tuple[jax.Array, tuple[int, ...] | None]


# -- API ----------------------------------------------------------------------------------------


def all_to_allv(
    x: Any,
    send_counts: Any,
    recv_counts: Any = None,
    *,
    rank_list: Any = None,
    group: Any = None,
    out_rows: int | None = None,
) -> jax.Array:
    """Send rows of ``x`` to each member of the group, as many as ``send_counts`` says, and
    return the rows received, in member order.

    ``x`` is one array whose axis 0 holds rows (any trailing shape, any dtype the collectives
    take; the rows may differ between ranks, the rest of the shape may not). Rank r sends its
    first ``send_counts[0]`` rows to member 0, the next ``send_counts[1]`` to member 1, and so
    on: the counts are non-negative and add up to ``x.shape[0]``. The result holds the rows from
    member 0 first, then member 1's, ..., from row 0, and zeros after them.

    ``send_counts``, ``recv_counts``: a list of ints, one per member of the group, or an integer
    array of shape (size,), which may be traced. ``recv_counts[j]`` on rank r must equal
    ``send_counts[r]`` on member j. ``None`` (default): the receive counts are exchanged first
    (one :func:`all_to_all` of the counts).

    Rows of the result: ``out_rows`` if given; else ``sum(recv_counts)`` when the receive counts
    are known when the call is traced (Python ints, a NumPy array, a JAX array outside ``jit``);
    else ``size * x.shape[0]``, enough for every member sending all its rows when all have
    ``x.shape[0]``. More rows arriving than the result holds is an error.

    Example (a world of one keeps its rows; on 2 ranks where rank 0 passes rows ``[0., 1., 2.]``
    with ``send_counts=[1, 2]`` and rank 1 rows ``[10., 11.]`` with ``[0, 2]``, rank 0 gets
    ``[0.]`` and rank 1 ``[1., 2., 10., 11.]``)::

        >>> import jax.numpy as jnp, spmd
        >>> n = spmd.init().size
        >>> spmd.all_to_allv(jnp.arange(3.0), [3] + [0] * (n - 1))
        Array([0., 1., 2.], dtype=float32)
    """
    ref = resolve(rank_list, group, op=_OP)
    arr = _array(x)
    rows, n = arr.shape[0], ref.size
    send, send_known = _counts(send_counts, "send_counts", n)
    if send_known is not None and sum(send_known) != rows:
        raise SpmdError(
            f"send_counts={list(send_known)} add up to {sum(send_known)} rows, but x has "
            f"{rows} rows (shape {arr.shape}); the send counts must add up to x.shape[0]",
            op=_OP,
        )
    if recv_counts is None:
        recv = all_to_all(send, rank_list=rank_list, group=group)
        recv_known = _known(recv)
    else:
        recv, recv_known = _counts(recv_counts, "recv_counts", n)
    size = _out_rows(out_rows, recv_known, n * rows)
    if alone(ref):
        if recv_known is not None and send_known is not None and recv_known != send_known:
            raise SpmdError(
                f"recv_counts={list(recv_known)} expects {recv_known[0]} rows from this rank "
                f"itself, but it sends {send_known[0]} (send_counts={list(send_known)})",
                op=_OP,
            )
        if size < rows:
            raise SpmdError(_TOO_SMALL.format(rows=rows, out_rows=size), op=_OP)
        if size == rows:
            return arr
        return jnp.concatenate([arr, jnp.zeros((size - rows, *arr.shape[1:]), arr.dtype)])
    y: jax.Array = bind(all_to_allv_p, arr, send, recv, group=ref, out_rows=size, exact=True)[0]
    return y


# -- errors -------------------------------------------------------------------------------------

_TOO_SMALL = (
    "this rank receives {rows} rows, but out_rows={out_rows}; pass out_rows={rows} or more, or "
    "leave it out"
)


def _array(x: Any) -> jax.Array:
    if not isinstance(x, ARRAY_LIKE):
        raise SpmdTypeError(
            f"x is a {type(x).__name__}; all_to_allv takes one array (its rows along axis 0), "
            "not a pytree: call it once per array",
            op=_OP,
        )
    arr = as_array(x, _OP, "x")
    if arr.ndim == 0:
        raise SpmdError("x is a scalar; all_to_allv sends rows along axis 0", op=_OP)
    return arr


def _counts(value: Any, what: str, n: int) -> Counts:
    """Counts as an int32 array of shape (n,), and their values when known at trace time."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if all(_is_int(c) for c in value):
            return _static(tuple(int(c) for c in value), what, n)
        for c in value:
            if not (isinstance(c, jax.Array) and c.ndim == 0 and _int_dtype(c.dtype)):
                raise SpmdTypeError(
                    f"{what} holds {c!r}; counts are integers (Python ints, or an integer array)",
                    op=_OP,
                )
        value = jnp.stack(list(value))
    if not isinstance(value, jax.Array | np.ndarray):
        raise SpmdTypeError(
            f"{what}={value!r} is not a list of {n} row counts (one per member of the group) or "
            "an integer array",
            op=_OP,
        )
    if not _int_dtype(value.dtype):
        raise SpmdTypeError(
            f"{what} has dtype {value.dtype}; counts are integers (cast them to int32)", op=_OP
        )
    if value.shape != (n,):
        raise SpmdError(
            f"{what} has shape {value.shape} for a group of {n} ranks; give one count per "
            f"member of the group, shape ({n},)",
            op=_OP,
        )
    known = _known(value)
    if known is not None:
        return _static(known, what, n)
    return jnp.asarray(value).astype(jnp.int32), None


def _static(values: tuple[int, ...], what: str, n: int) -> Counts:
    if len(values) != n:
        raise SpmdError(
            f"{what}={list(values)} has {len(values)} entries for a group of {n} ranks; give "
            "one count per member of the group",
            op=_OP,
        )
    for c in values:
        if not 0 <= c <= _INT32_MAX:
            raise SpmdError(
                f"{what}={list(values)} holds {c}; counts are rows, 0 or more (below 2**31)",
                op=_OP,
            )
    return jnp.asarray(np.array(values, np.int32)), values


def _known(value: Any) -> tuple[int, ...] | None:
    """The values of an array that is not traced; None for a tracer."""
    if isinstance(value, core.Tracer):
        return None
    return tuple(int(c) for c in np.asarray(value).tolist())


def _is_int(c: Any) -> bool:
    return isinstance(c, int | np.integer) and not isinstance(c, bool | np.bool_)


def _int_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.integer))


def _out_rows(out_rows: Any, recv_known: tuple[int, ...] | None, most: int) -> int:
    if out_rows is None:
        return sum(recv_known) if recv_known is not None else most
    if not _is_int(out_rows) or out_rows < 0:
        raise SpmdTypeError(f"out_rows={out_rows!r} is not a row count (an int, 0 or more)", op=_OP)
    if recv_known is not None and sum(recv_known) > out_rows:
        raise SpmdError(_TOO_SMALL.format(rows=sum(recv_known), out_rows=out_rows), op=_OP)
    return int(out_rows)


# -- primitive ----------------------------------------------------------------------------------


def _abstract_eval(
    x: core.ShapedArray, send: Any, recv: Any, *, group: GroupRef, out_rows: int, exact: bool
) -> list[Any]:
    return [core.ShapedArray((out_rows, *x.shape[1:]), x.dtype)]


all_to_allv_p.def_abstract_eval(_abstract_eval)
register_lowering(all_to_allv_p, "spmd_all_to_allv", exact=lambda exact, **_: bool(exact))


# -- batching -----------------------------------------------------------------------------------


def _batch(args: list[Any], dims: list[Any], **params: Any) -> Any:
    x, send, recv = args
    dx, ds, dr = dims
    if ds is None and dr is None:
        # Axis 0 holds the rows: the batch goes to axis 1, so one call moves every element's rows
        # (the counts count rows of the batch, as of each element).
        return all_to_allv_p.bind(jnp.moveaxis(x, dx, 1), send, recv, **params), [1]
    # Counts that differ per element: one call per element, in order (every rank of the group
    # batches alike, so the calls pair up).
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

    def at(a: Any, d: Any, b: int) -> Any:
        return a if d is None else jnp.take(a, b, axis=d)

    ys = [
        all_to_allv_p.bind(at(x, dx, b), at(send, ds, b), at(recv, dr, b), **params)[0]
        for b in range(size)
    ]
    return [jnp.stack(ys)], [0]


batching.primitive_batchers[all_to_allv_p] = _batch


# -- autodiff -----------------------------------------------------------------------------------


def _jvp(primals: list[Any], tangents: list[Any], *, group: GroupRef, **params: Any) -> Any:
    # Linear in x; the counts are integers and take no tangent.
    outs = all_to_allv_p.bind(*primals, group=group, **params)
    if isinstance(tangents[0], Zero):
        return outs, [zero_tangent(outs[0])]
    t_outs = all_to_allv_p.bind(tangents[0], *primals[1:], group=group.jvp(), **params)
    return outs, t_outs


def _transpose(
    cts: list[Any], x: Any, send: Any, recv: Any, *, group: GroupRef, out_rows: int, exact: bool
) -> list[Any]:
    # The reverse exchange (module doc): the cotangent's first sum(recv) rows go back where they
    # came from, into x's rows. It sends from a padded cotangent, so not exact.
    aval = arg_aval(x)
    ct = instantiate(cts[0], core.ShapedArray((out_rows, *aval.shape[1:]), aval.dtype))
    (ct_x,) = all_to_allv_p.bind(
        ct, recv, send, group=group.backward(), out_rows=aval.shape[0], exact=False
    )
    return [ct_x, None, None]


ad.primitive_jvps[all_to_allv_p] = _jvp
ad.primitive_transposes[all_to_allv_p] = _transpose
