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
from ..runtime import gpu_active
from ._all_to_all import all_to_all
from ._autodiff import arg_aval, instantiate, rows_batcher, zero_tangent
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
    y: jax.Array = bind(all_to_allv_p, arr, send, recv, **_plain(ref, size, exact=True))[0]
    return y


def all_to_allv_indexed(
    x: Any,
    send_counts: Any,
    recv_counts: Any,
    *,
    send_index: Any = None,
    repeat: int = 1,
    recv_index: Any = None,
    group: Any = None,
    out_rows: int | None = None,
) -> jax.Array:
    """:func:`all_to_allv` that gathers the rows it sends and places the rows it receives, in
    the same pass as the copies (spmd.moe's dispatch and combine; not in ``__all__``).

    With S rows sent (the send counts' sum) and R received (the receive counts'): the rows sent,
    in order, are ``x[send_index[i] // repeat]`` for i < S, where ``send_index[:S]`` is a
    permutation of ``0 .. S - 1`` and S is at most ``x.shape[0] * repeat`` (None: x's first S
    rows; rows of x past them are not sent). Received row i (in member order) lands in output
    row ``recv_index[i]``, where
    ``recv_index[:R]`` is a permutation of ``0 .. R - 1`` (None: in order); rows past R are
    zeros. Entries past S and R are not read, so the indices may have a static length while the
    counts vary. The native layer checks the indices on every call (out of range or repeated:
    an error on every rank, naming the rank). The transpose swaps the two indices and sums the
    ``repeat`` rows of each row of x.
    """
    ref = resolve(None, group, op=_OP)
    arr = _array(x)
    n = ref.size
    send, send_known = _counts(send_counts, "send_counts", n)
    recv, recv_known = _counts(recv_counts, "recv_counts", n)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise SpmdTypeError(f"repeat={repeat!r}; expected an int, 1 or more", op=_OP)
    limit = arr.shape[0] if send_index is None else arr.shape[0] * repeat
    most = limit if send_index is None else min(limit, _index(send_index, "send_index"))
    if send_known is not None and sum(send_known) > most:
        raise SpmdError(
            f"send_counts={list(send_known)} add up to {sum(send_known)} rows, but only {most} "
            "can be sent (x's rows, times repeat, and send_index's length)",
            op=_OP,
        )
    if recv_index is not None:
        placed = _index(recv_index, "recv_index")
        if recv_known is not None and sum(recv_known) > placed:
            raise SpmdError(
                f"recv_index has {placed} entries, but recv_counts={list(recv_known)} add up to "
                f"{sum(recv_known)}; expected one entry per row received",
                op=_OP,
            )
    size = _out_rows(out_rows, recv_known, n * most)
    indices = [jnp.asarray(i).astype(jnp.int32) for i in (send_index, recv_index) if i is not None]
    y: jax.Array = _bind(
        arr, send, recv, *indices, group=ref, out_rows=size, exact=False,
        repeat=0 if send_index is None else repeat, placed=recv_index is not None,
    )  # fmt: skip
    return y


def _index(value: Any, what: str) -> int:
    if not isinstance(value, jax.Array | np.ndarray) or value.ndim != 1:
        raise SpmdTypeError(f"{what} is not a vector of row indices", op=_OP)
    if not _int_dtype(value.dtype):
        raise SpmdTypeError(f"{what} has dtype {value.dtype}; expected integers", op=_OP)
    return int(value.shape[0])


def _plain(group: GroupRef, out_rows: int, exact: bool) -> dict[str, Any]:
    return dict(group=group, out_rows=out_rows, exact=exact, repeat=0, placed=False)


def _bind(x: Any, send: Any, recv: Any, *indices: Any, **params: Any) -> Any:
    """One indexed call: native where the CPU handler places the rows; on a GPU, or alone, the
    same rows gathered and placed by XLA around a plain call."""
    group, repeat, placed, size = (params[k] for k in ("group", "repeat", "placed", "out_rows"))
    if not (repeat or placed) or not (gpu_active() or alone(group)):
        return bind(all_to_allv_p, x, send, recv, *indices, **params)[0]
    rest = list(indices)
    if repeat:
        x = x[rest.pop(0) // repeat]
    if alone(group):  # the rows sent are the rows received
        pad = max(size - x.shape[0], 0)
        x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])[:size]
        y = jnp.where(_below(size, jnp.sum(send), x.ndim), x, 0)
    else:
        y = bind(all_to_allv_p, x, send, recv, **_plain(group, size, exact=False))[0]
    if placed:
        (where,) = rest
        m = where.shape[0]
        rows = jnp.concatenate([y, jnp.zeros((max(m - size, 0), *y.shape[1:]), y.dtype)])[:m]
        target = jnp.where(jnp.arange(m) < jnp.sum(recv), where, size)
        y = y.at[target].set(rows, mode="drop")
    return y


def _below(rows: int, count: Any, ndim: int) -> Any:
    """A mask of the first ``count`` of ``rows`` rows, broadcastable over ``ndim`` axes."""
    return (jnp.arange(rows) < count).reshape(rows, *([1] * (ndim - 1)))


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


def _abstract_eval(x: core.ShapedArray, *counts_and_indices: Any, out_rows: int, **_: Any) -> Any:
    return [core.ShapedArray((out_rows, *x.shape[1:]), x.dtype)]


all_to_allv_p.def_abstract_eval(_abstract_eval)
# Only the CPU handler takes indices (_bind composes them on a GPU).
register_lowering(
    all_to_allv_p, "spmd_all_to_allv", exact=lambda exact, **_: bool(exact),
    cpu_attrs=lambda repeat, placed, **_: {"repeat": int(repeat), "placed": bool(placed)},
)  # fmt: skip


# -- batching -----------------------------------------------------------------------------------


batching.primitive_batchers[all_to_allv_p] = rows_batcher(all_to_allv_p)


# -- autodiff -----------------------------------------------------------------------------------


def _jvp(primals: list[Any], tangents: list[Any], *, group: GroupRef, **params: Any) -> Any:
    # Linear in x; the counts are integers and take no tangent.
    outs = all_to_allv_p.bind(*primals, group=group, **params)
    if isinstance(tangents[0], Zero):
        return outs, [zero_tangent(outs[0])]
    t_outs = all_to_allv_p.bind(tangents[0], *primals[1:], group=group.jvp(), **params)
    return outs, t_outs


def _transpose(
    cts: list[Any], x: Any, send: Any, recv: Any, *indices: Any, group: GroupRef, out_rows: int,
    exact: bool, repeat: int, placed: bool,
) -> list[Any]:  # fmt: skip
    # The reverse exchange (module doc): the cotangent's first sum(recv) rows go back where they
    # came from, into x's rows. Without a recv_index it sends from a padded cotangent, so not
    # exact. With indices, each becomes the other: the rows that recv_index placed are gathered
    # from there, and land where send_index took them, in rows of x repeated `repeat` times.
    aval = arg_aval(x)
    ct = instantiate(cts[0], core.ShapedArray((out_rows, *aval.shape[1:]), aval.dtype))
    rest = list(indices)
    send_index = rest.pop(0) if repeat else None
    recv_index = rest.pop(0) if placed else None
    rows = aval.shape[0] * (repeat or 1)
    back = [i for i in (recv_index, send_index) if i is not None]
    ct_x = _bind(
        ct, recv, send, *back, group=group.backward(), out_rows=rows, exact=False,
        repeat=1 if placed else 0, placed=repeat > 0,
    )  # fmt: skip
    if repeat > 1:
        ct_x = ct_x.reshape(aval.shape[0], repeat, *aval.shape[1:]).sum(1)
    return [ct_x, None, None, *(None for _ in indices)]


ad.primitive_jvps[all_to_allv_p] = _jvp
ad.primitive_transposes[all_to_allv_p] = _transpose
