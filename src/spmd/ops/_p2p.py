"""Point to point: send, recv, sendrecv; and barrier.

``sendrecv`` is differentiable under the global-objective convention (see _allreduce.py): what
rank r received from ``src`` came from src's input, so its cotangent travels back the other way,
``sendrecv(ct, src=dst, dst=src)``. ``send`` and ``recv`` are one-sided: the receiving rank's
program has no input the value depends on, so JAX treats the received value as a constant there
and no tangent or cotangent crosses ranks (send's JVP sends only the primal, keeping both sides'
messages matched). Differentiate through point-to-point transfers with ``sendrecv``.

Under ``jax.vmap`` a batched ``send`` sends the whole batch at once, and a ``recv`` whose
``like`` is batched receives a whole batch (batch axis first), so a vmapped function that sends
on one rank and receives on another pairs up. The primitive sees the batch through an "anchor":
a zero-size slice of ``like`` passed as its operand (never to the native call), which vmap
batches like any other value.

Point-to-point operations run over MPI (the file-store communicator has none).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError
from .._jax_compat import ad, batching, core
from ._autodiff import arg_aval, batch_first, instantiate, linear_jvp, zero_tangent
from ._checks import check_dtype, check_rank, flatten
from ._primitive import GroupRef, alone, bind, collective_primitive, register_lowering, resolve

sendrecv_p = collective_primitive("spmd_sendrecv")
send_p = collective_primitive("spmd_send")
recv_p = collective_primitive("spmd_recv")
barrier_p = collective_primitive("spmd_barrier")

# send and barrier return this placeholder (so that an eager call can wait for completion).
_DONE = core.ShapedArray((0,), np.dtype(np.uint8))


# -- API ----------------------------------------------------------------------------------------


def _check_peer(value: Any, what: str, name: str, ref: GroupRef) -> int:
    peer = check_rank(value, what, name, ref.ranks)
    if peer == ref.rank:
        raise SpmdError(
            f"{what}={peer} is this rank itself; a {name} to oneself never completes (use "
            "sendrecv, which may name oneself)",
            op=name,
        )
    return peer


def send(
    x: Any, dst: int, *, rank_list: Any = None, group: Any = None, note: str | None = None
) -> None:
    """Send ``x`` (array or pytree) to the rank at position ``dst`` of the group, which must
    call :func:`recv` with ``src`` = this rank. Returns once ``x`` is copied out, without
    waiting for the receiver (up to 64 sends per group wait for their receivers at once; one
    more waits for the oldest), so two ranks may each send to the other before they receive.
    ``note``: a label that ``spmd.trace`` prints with the op (a pipeline's microbatch, say); it
    changes nothing else.

    Example (does something on two ranks or more, ``spmd-run -n 2``)::

        >>> import jax.numpy as jnp, spmd
        >>> comm = spmd.init()
        >>> if comm.size > 1 and comm.rank == 0:
        ...     spmd.send(jnp.arange(3.0), dst=1)
        >>> if comm.size > 1 and comm.rank == 1:
        ...     print(spmd.recv(jnp.zeros(3), src=0))
    """
    ref = resolve(rank_list, group, op="send", p2p=True)
    leaves, _, _ = flatten(x, "send")
    d = _check_peer(dst, "dst", "send", ref)
    for leaf in leaves:
        bind(send_p, leaf, group=ref, dst=d, **_noted(note))


def recv(
    like: Any, src: int, *, rank_list: Any = None, group: Any = None, note: str | None = None
) -> Any:
    """Receive from the rank at position ``src`` an array (or pytree) shaped like ``like``
    (arrays or ``jax.ShapeDtypeStruct``s; their values are not used). ``note``: as
    :func:`send`'s.

    Example: see :func:`send`; ``like`` may also be a shape description::

        >>> import jax, jax.numpy as jnp, spmd
        >>> like = jax.ShapeDtypeStruct((3,), jnp.float32)
        >>> comm = spmd.init()
        >>> if comm.size > 1 and comm.rank == 1:
        ...     print(spmd.recv(like, src=0))
    """
    ref = resolve(rank_list, group, op="recv", p2p=True)
    s = _check_peer(src, "src", "recv", ref)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
    specs = []
    for path, v in with_path:
        name = "like" + jax.tree_util.keystr(path)
        # As send sees it: numpy's float64 is float32 without jax_enable_x64.
        dtype = jax.dtypes.canonicalize_dtype(getattr(v, "dtype", None) or np.asarray(v).dtype)
        check_dtype(dtype, "recv", name)
        specs.append((_anchor(v), tuple(np.shape(v)), np.dtype(dtype)))
    outs = [
        bind(recv_p, *anchor, group=ref, src=s, shape=shape, dtype=dtype, **_noted(note))[0]
        for anchor, shape, dtype in specs
    ]
    return jax.tree_util.tree_unflatten(treedef, outs)


def _anchor(like: Any) -> list[Any]:
    """A traced ``like`` as a zero-size array that carries its batch axes (none for concrete
    arrays and shape descriptions, which no transform batches)."""
    if isinstance(like, core.Tracer):
        return [jnp.reshape(like, (-1,))[:0]]
    return []


def sendrecv(
    x: Any,
    src: int,
    dst: int,
    *,
    rank_list: Any = None,
    group: Any = None,
    note: str | None = None,
) -> Any:
    """Send ``x`` to position ``dst`` of the group and return what position ``src`` sent this
    rank (shaped like ``x``), at once; e.g. a ring shift: ``sendrecv(x, src=(r - 1) % n,
    dst=(r + 1) % n)``. Differentiable (the cotangent travels back from dst). ``note``: as
    :func:`send`'s.

    Example (a ring shift: on 2 ranks each gets the other's value; a world of one its own)::

        >>> import jax.numpy as jnp, spmd
        >>> comm = spmd.init()
        >>> r, n = comm.rank, comm.size
        >>> spmd.sendrecv(jnp.float32(r + 1), src=(r - 1) % n, dst=(r + 1) % n)
        Array(1., dtype=float32)
    """
    ref = resolve(rank_list, group, op="sendrecv", p2p=True)
    leaves, treedef, _ = flatten(x, "sendrecv")
    s = check_rank(src, "src", "sendrecv", ref.ranks)
    d = check_rank(dst, "dst", "sendrecv", ref.ranks)
    if alone(ref):
        return jax.tree_util.tree_unflatten(treedef, leaves)
    outs = [bind(sendrecv_p, leaf, group=ref, src=s, dst=d, **_noted(note))[0] for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, outs)


def _noted(note: str | None) -> dict[str, str]:
    """The primitive's ``note`` parameter: present only when given (the lowering ignores it)."""
    if note is None:
        return {}
    if not isinstance(note, str):
        raise SpmdError(f"note={note!r} is not a string; pass a short label, or None")
    return {"note": note}


def barrier(*, rank_list: Any = None, group: Any = None) -> None:
    """Return once every rank of the group has called ``barrier`` (in jit: once every rank's
    program reaches it).

    Example::

        >>> import spmd
        >>> spmd.barrier()
    """
    ref = resolve(rank_list, group, op="barrier")
    if ref.size > 1:
        bind(barrier_p, group=ref)


# -- primitives ---------------------------------------------------------------------------------

sendrecv_p.def_abstract_eval(
    lambda x, **_: [core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)]
)
send_p.def_abstract_eval(lambda x, **_: [_DONE])
recv_p.def_abstract_eval(lambda *anchor, shape, dtype, **_: [core.ShapedArray(shape, dtype)])
barrier_p.def_abstract_eval(lambda *, group: [_DONE])

register_lowering(sendrecv_p, "spmd_sendrecv", src=lambda src, **_: src, dst=lambda dst, **_: dst)
register_lowering(send_p, "spmd_sendrecv", src=lambda **_: -1, dst=lambda dst, **_: dst)
register_lowering(
    recv_p, "spmd_sendrecv", pass_operands=False, src=lambda src, **_: src, dst=lambda **_: -1
)
register_lowering(barrier_p, "spmd_barrier")


def _sendrecv_transpose(
    cts: list[Any], x: Any, *, group: GroupRef, src: int, dst: int, **noted: Any
) -> list[Any]:
    # y_r = x_src(r): the cotangent of y_r belongs to x on rank src, so send it back to src.
    (ct,) = cts
    ct = instantiate(ct, arg_aval(x))
    return list(sendrecv_p.bind(ct, group=group.backward(), src=dst, dst=src, **noted))


def _constant_jvp(prim: core.Primitive) -> Any:
    """JVP of a one-sided transfer: the primal call alone; its results have zero tangents."""

    def jvp(primals: list[Any], tangents: list[Any], **params: Any) -> Any:
        outs = prim.bind(*primals, **params)
        return outs, [zero_tangent(o) for o in outs]

    return jvp


ad.primitive_jvps[sendrecv_p] = linear_jvp(sendrecv_p)
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose
ad.primitive_jvps[send_p] = _constant_jvp(send_p)
ad.primitive_jvps[recv_p] = _constant_jvp(recv_p)


def _sendrecv_batch(args: list[Any], dims: list[Any], **params: Any) -> Any:
    moved, out_dims = batch_first(args, dims)
    return sendrecv_p.bind(*moved, **params), out_dims


def _send_batch(args: list[Any], dims: list[Any], **params: Any) -> Any:
    return send_p.bind(*batch_first(args, dims)[0], **params), [None]


def _recv_batch(args: list[Any], dims: list[Any], *, shape: tuple[int, ...], **params: Any) -> Any:
    # Receive the whole batch: as many values as the anchor's batch axis holds, batch axis
    # first. The anchor stays an operand (batch axis first too), so that an enclosing vmap
    # batches this call in turn.
    (anchor,), _ = batch_first(args, dims)
    return recv_p.bind(anchor, shape=(anchor.shape[0], *shape), **params), [0]


batching.primitive_batchers[sendrecv_p] = _sendrecv_batch
batching.primitive_batchers[send_p] = _send_batch
batching.primitive_batchers[recv_p] = _recv_batch
