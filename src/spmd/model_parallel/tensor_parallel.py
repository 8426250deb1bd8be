"""Tensor parallelism: Megatron-LM's layers as functions of plain arrays (``spmd.tensor_parallel``).

The layers split a weight over the ranks of a group (by default the ``"tp"`` axis of the active
mesh) and move activations with *conjugate* collectives: pairs whose forward and backward are
each other's duals, so that a loss computed the same on every rank of the group gets the
gradients a one-process model would get, without counting it once per rank:

- ``copy_to``: identity forward; the gradient summed over the group (allreduce);
- ``reduce_from``: a sum over the group forward; the gradient passes unchanged;
- ``gather_from``: an allgather along ``axis`` forward; the gradient's slice of this rank;
- ``scatter_to``: this rank's slice forward; the gradient allgathered;
- ``gather_sequence`` / ``reduce_scatter_sequence``: allgather / reduce_scatter along the
  sequence axis (-2) forward, and the other one backward (sequence parallelism).

Their gradient convention is not the one of the plain collectives (whose transposes sum the
contributions of every rank's objective, see docs/collectives.md): here the ranks of the group
compute *one* objective together (the activations after ``reduce_from`` are replicated), so a
replicated value's cotangent is the same on every rank and counts once.

A column-parallel linear followed by a row-parallel one is Megatron's MLP: one allreduce in the
forward pass (``reduce_from``) and one in the backward pass (``copy_to``). With
``sequence_parallel=True`` the activations outside the pair are split on the sequence axis
(axis -2) and the pair uses allgather / reduce_scatter instead (the same bytes, and the
elementwise work between pairs runs on 1/tp of the tokens).

Weights are this rank's blocks (plain arrays, or ShardedArrays whose ``local`` is used):
:func:`shard_params` splits a full parameter tree by PartitionSpecs (``spmd.gather`` joins it
again; ``spmd.save``/``spmd.load`` reshard it). See docs/model_parallel.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._errors import SpmdError, SpmdTypeError
from ..mesh import Mesh, current_mesh, resolve_group
from ..runtime import Communicator
from ..sharded import PartitionSpec, ShardedArray, is_sharded, normalize_spec, shard
from ..transforms.marks import mark_column
from ._tp_common import join_qkv, sharded, split_qkv, unsharded

__all__ = [
    "column_linear",
    "copy_to",
    "gather_from",
    "gather_sequence",
    "join_qkv",
    "local",
    "reduce_from",
    "reduce_scatter_sequence",
    "row_linear",
    "scatter_to",
    "shard_params",
    "sharded",
    "split_qkv",
    "unsharded",
    "vocab_cross_entropy",
    "vocab_embed",
]


# -- conjugate collectives ----------------------------------------------------------------------


def _comm(group: Any, op: str) -> Communicator:
    return resolve_group(None, group, op=op)


def _axis(x: Any, axis: int, op: str) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise SpmdError(f"axis={axis} is out of range for an array of shape {x.shape}", op=op)
    return int(axis % x.ndim)


def _slice(x: Any, axis: int, comm: Communicator) -> Any:
    chunk = x.shape[axis] // comm.size
    return lax.dynamic_slice_in_dim(x, comm.rank * chunk, chunk, axis)


def _divisible(x: Any, axis: int, comm: Communicator, op: str, what: str = "x") -> None:
    if x.shape[axis] % comm.size:
        raise SpmdError(
            f"{what} has {x.shape[axis]} elements along axis {axis} (shape {x.shape}), which do "
            f"not divide by the group size {comm.size}",
            op=op,
        )


def _allreduce(x: Any, comm: Communicator) -> Any:
    from ..ops import allreduce

    return allreduce(x, "sum", group=comm)


def _allgather(x: Any, axis: int, comm: Communicator) -> Any:
    from ..ops import allgather

    return allgather(x, axis=axis, group=comm)


def _reduce_scatter(x: Any, axis: int, comm: Communicator) -> Any:
    from ..ops import reduce_scatter

    return reduce_scatter(x, "sum", axis=axis, group=comm)


def _conjugate(
    forward: Callable[[Any, int, Communicator], Any],
    backward: Callable[[Any, int, Communicator], Any],
) -> Callable[[Any, int, Communicator], Any]:
    """An op that runs ``forward`` and whose gradient runs ``backward`` (both linear)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x: Any, axis: int, comm: Communicator) -> Any:
        return forward(x, axis, comm)

    def fwd(x: Any, axis: int, comm: Communicator) -> tuple[Any, None]:
        return forward(x, axis, comm), None

    def bwd(axis: int, comm: Communicator, _: None, ct: Any) -> tuple[Any]:
        return (backward(ct, axis, comm),)

    op.defvjp(fwd, bwd)
    return op


_copy = _conjugate(lambda x, a, c: x, lambda g, a, c: _allreduce(g, c))
_reduce = _conjugate(lambda x, a, c: _allreduce(x, c), lambda g, a, c: g)
_gather = _conjugate(_allgather, _slice)
_scatter = _conjugate(_slice, _allgather)
_gather_seq = _conjugate(_allgather, _reduce_scatter)
_scatter_seq = _conjugate(_reduce_scatter, _allgather)


def _tree(op: Callable[..., Any], x: Any, axis: int, comm: Communicator) -> Any:
    return jax.tree_util.tree_map(lambda v: op(jnp.asarray(v), axis, comm), x)


def copy_to(x: Any, *, group: Any = "tp") -> Any:
    """Enter a tensor-parallel region: ``x`` unchanged; its gradient summed over the group.

    Put it on a replicated value that each rank then uses with its own block of a weight (what
    :func:`column_linear` does with its input), and on a replicated *parameter* used on values
    that differ between the ranks (a norm's scale under sequence parallelism): the gradients of
    each rank's part add up. ``x``: an array or a pytree of arrays.

    Example (a world of one: the identity)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.copy_to(jnp.ones(2))
        Array([1., 1.], dtype=float32)
    """
    return _tree(_copy, x, 0, _comm(group, "copy_to"))


def reduce_from(x: Any, *, group: Any = "tp") -> Any:
    """Leave a tensor-parallel region: ``x`` summed over the group; the gradient passes as is.

    The partial results of a row-split weight (each rank's inputs times its rows) add up to the
    full result, which every rank then holds. ``x``: an array or a pytree of arrays.
    """
    return _tree(_reduce, x, 0, _comm(group, "reduce_from"))


def gather_from(x: Any, axis: int = -1, *, group: Any = "tp") -> Any:
    """Concatenate the ranks' ``x`` along ``axis`` (in group order); the gradient keeps this
    rank's slice of the incoming one."""
    comm = _comm(group, "gather_from")
    return jax.tree_util.tree_map(
        lambda v: _gather(jnp.asarray(v), _axis(jnp.asarray(v), axis, "gather_from"), comm), x
    )


def scatter_to(x: Any, axis: int = -1, *, group: Any = "tp") -> Any:
    """This rank's slice of a replicated ``x`` along ``axis`` (``x.shape[axis]`` divides by the
    group size); the gradient is gathered from every rank's slice."""
    comm = _comm(group, "scatter_to")

    def one(v: Any) -> Any:
        v = jnp.asarray(v)
        a = _axis(v, axis, "scatter_to")
        _divisible(v, a, comm, "scatter_to")
        return _scatter(v, a, comm)

    return jax.tree_util.tree_map(one, x)


def gather_sequence(x: Any, *, group: Any = "tp") -> Any:
    """Sequence parallelism's entry: gather the sequence shards (axis -2) of every rank; the
    gradient is reduce-scattered back to this rank's shard (Megatron's pair for
    ``sequence_parallel=True``)."""
    comm = _comm(group, "gather_sequence")

    def one(v: Any) -> Any:
        v = _seq(v, "gather_sequence")
        return _gather_seq(v, v.ndim - 2, comm)

    return jax.tree_util.tree_map(one, x)


def reduce_scatter_sequence(x: Any, *, group: Any = "tp") -> Any:
    """Sequence parallelism's exit: sum the partial results over the group and keep this rank's
    shard of the sequence axis (axis -2); the gradient is gathered again."""
    comm = _comm(group, "reduce_scatter_sequence")

    def one(v: Any) -> Any:
        v = _seq(v, "reduce_scatter_sequence")
        _divisible(v, v.ndim - 2, comm, "reduce_scatter_sequence")
        return _scatter_seq(v, v.ndim - 2, comm)

    return jax.tree_util.tree_map(one, x)


def _seq(v: Any, op: str) -> Any:
    v = jnp.asarray(v)
    if v.ndim < 2:
        raise SpmdError(
            f"sequence parallelism splits axis -2 (the sequence) of (..., seq, features) "
            f"activations, but x has shape {v.shape}",
            op=op,
        )
    return v


# -- linear layers ------------------------------------------------------------------------------


def local(tree: Any) -> Any:
    """``tree`` with every ShardedArray replaced by this rank's block (its ``local``)."""
    return jax.tree_util.tree_map(
        lambda x: x.local if is_sharded(x) else x, tree, is_leaf=is_sharded
    )


def _weight(
    w: Any, op: str, what: str = "w", split: int | None = None, comm: Communicator | None = None
) -> Any:
    """``w``'s block as an array. A ShardedArray must be split as the layer takes it: along
    dimension ``split`` over the ranks of ``comm`` (or not at all where ``split`` is None)."""
    if is_sharded(w):
        _check_layout(w, op, what, split, comm)
        w = w.local
    if not hasattr(w, "shape"):
        raise SpmdTypeError(f"{what} is a {type(w).__name__}, not an array", op=op)
    return jnp.asarray(w)


def column_linear(
    x: Any,
    w: Any,
    b: Any = None,
    *,
    group: Any = "tp",
    gather_output: bool = False,
    sequence_parallel: bool = False,
    fused: int = 1,
) -> Any:
    """``x @ W + b`` with ``W`` split by output columns: this rank computes its ``out / tp``.

    Args:
        x: ``(..., in)``, the same on every rank of the group; with ``sequence_parallel`` this
            rank's shard of the sequence, ``(..., seq / tp, in)``, gathered here.
        w: this rank's columns of ``W``, ``(in, out / tp)``; b: its part of the bias,
            ``(out / tp,)``, or None.
        gather_output: return the full ``(..., out)`` on every rank (default: this rank's
            ``(..., out / tp)``, what :func:`row_linear` takes).
        fused: ``W`` is a fused kernel of this many parts (3 for ``[q|k|v]``) and ``w`` this
            rank's block of each part side by side, as :func:`split_qkv` gives it; the output
            may then be split into its parts on each rank. Splitting the output of a layer
            not told so is an error when the step is traced (the parts would be mixed up).

    The backward pass sums the input's gradient over the group (:func:`copy_to`; with sequence
    parallelism, a reduce_scatter).

    Example (a world of one holds all of ``W``)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.column_linear(jnp.ones((1, 2)), jnp.ones((2, 3)))
        Array([[2., 2., 2.]], dtype=float32)
    """
    return _column_linear(x, w, b, group, gather_output, sequence_parallel, fused, "")


def _column_linear(
    x: Any, w: Any, b: Any, group: Any, gather_output: bool, sequence_parallel: bool,
    fused: int, layer: str,
) -> Any:  # fmt: skip
    op = "column_linear"
    comm = _comm(group, op)
    x, w = jnp.asarray(x), _weight(w, op, split=1, comm=comm)
    _linear_shapes(x, w, op)
    x = gather_sequence(x, group=comm) if sequence_parallel else copy_to(x, group=comm)
    y = x @ w
    if b is not None:
        b = _bias(b, w.shape[1], op, "this rank's out / tp columns", split=0, comm=comm)
        y = y + b
    if gather_output:
        return gather_from(y, -1, group=comm)
    return _column_output(y, comm, fused=fused, layer=layer)


def _column_output(y: Any, comm: Communicator, *, fused: int = 1, layer: str = "") -> Any:
    """Mark ``y`` as a column-parallel layer's output, so that a traced step that splits it into
    parts is an error (the fused-kernel trap, ``parallel/_column.py``); size-1 groups unmarked."""
    if fused < 1 or y.shape[-1] % fused:
        raise SpmdError(
            f"fused={fused}, but this rank's block has {y.shape[-1]} columns: expected a "
            "positive part count that divides them",
            op="column_linear",
        )
    if comm.size == 1:
        return y
    return mark_column(y, fused=fused, layer=layer, ranks=tuple(comm.ranks))


def row_linear(
    x: Any, w: Any, b: Any = None, *, group: Any = "tp", sequence_parallel: bool = False
) -> Any:
    """``x @ W + b`` with ``W`` split by input rows: each rank multiplies its ``in / tp``
    features, and the partial products are summed over the group.

    Args:
        x: this rank's features, ``(..., in / tp)`` (what :func:`column_linear` returns).
        w: this rank's rows of ``W``, ``(in / tp, out)``; b: the whole bias ``(out,)``, added
            once after the sum, or None.
        sequence_parallel: reduce-scatter the sum over the sequence axis (axis -2) instead of
            allreducing it: the result is this rank's ``(..., seq / tp, out)``; the bias's
            gradient is then summed over the group (each rank saw its part of the sequence).

    Example (a world of one holds all of ``W``)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.row_linear(jnp.ones((1, 2)), jnp.ones((2, 3)), jnp.ones(3))
        Array([[3., 3., 3.]], dtype=float32)
    """
    op = "row_linear"
    comm = _comm(group, op)
    x, w = jnp.asarray(x), _weight(w, op, split=0, comm=comm)
    if comm.size > 1 and x.shape[-1:] == (w.shape[0] * comm.size,) and w.ndim == 2:
        raise SpmdError(
            f"x has {x.shape[-1]} features, tp={comm.size} times w's {w.shape[0]} rows: "
            "row_linear takes this rank's block of features, (..., in / tp), as column_linear "
            "returns it (gather_output=False)",
            op=op,
        )
    _linear_shapes(x, w, op)
    y = x @ w
    y = reduce_scatter_sequence(y, group=comm) if sequence_parallel else reduce_from(y, group=comm)
    if b is not None:
        b = _bias(b, w.shape[1], op, "the whole out")
        y = y + (copy_to(b, group=comm) if sequence_parallel else b)
    return y


def _check_layout(
    w: ShardedArray, op: str, what: str, split: int | None, comm: Communicator | None
) -> None:
    entries = (*w.spec, *([None] * (len(w.shape) - len(w.spec))))
    splits = {i: e for i, e in enumerate(entries) if e}
    if split is None or comm is None:
        ok = not splits
    else:
        entry = splits.get(split % len(w.shape)) if len(splits) == 1 else None
        where = w.mesh
        ranks: Any = where.ranks if isinstance(where, Communicator) else None
        if entry is not None and isinstance(where, Mesh):
            ranks = next((g for g in where.rank_lists(entry) if comm.world_rank in g), None)
        ok = entry is not None and list(ranks or ()) == list(comm.ranks)
    if not ok:
        want = ["None"] * len(w.shape)
        if split is not None:
            want[split % len(w.shape)] = "'tp'"
        raise SpmdError(
            f"{what} is a ShardedArray split as {w.spec}, but {op} takes "
            + (
                f"it split along dimension {split % len(w.shape)} over the group's ranks "
                f"{list(comm.ranks)} (for group='tp': P({', '.join(want)}))"
                if split is not None and comm is not None
                else "it whole on every rank (replicated)"
            ),
            op=op,
        )


def _linear_shapes(x: Any, w: Any, op: str) -> None:
    if w.ndim != 2:
        raise SpmdError(f"w has shape {w.shape}; expected a matrix (in, out)", op=op)
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise SpmdError(
            f"x has shape {x.shape} but w has shape {w.shape}: x's last axis must have "
            f"{w.shape[0]} features (w's rows)",
            op=op,
        )


def _bias(b: Any, out: int, op: str, what: str, split: int | None = None, comm: Any = None) -> Any:
    b = _weight(b, op, "b", split, comm)
    if b.shape != (out,):
        raise SpmdError(f"b has shape {b.shape}; expected ({out},), {what}", op=op)
    return b


# -- vocabulary-parallel embedding and cross-entropy --------------------------------------------


def vocab_embed(ids: Any, table: Any, *, group: Any = "tp") -> Any:
    """Embedding lookup with the table split by vocabulary rows over the group.

    ``table`` is this rank's ``(vocab / tp, dim)`` rows (rank r holds ids ``r * vocab / tp`` to
    ``(r + 1) * vocab / tp - 1``); ``ids`` (integers, any shape) are the same on every rank.
    Each rank looks up the ids it holds (zeros for the others) and the results are summed
    over the group (:func:`reduce_from`): every rank gets ``(*ids.shape, dim)``, and each
    rank's table gets the gradient of its own rows.

    Example (a world of one holds the whole table)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.vocab_embed(jnp.array([2, 0]), jnp.eye(3))
        Array([[0., 0., 1.],
               [1., 0., 0.]], dtype=float32)
    """
    op = "vocab_embed"
    comm = _comm(group, op)
    table = _weight(table, op, "table", split=0, comm=comm)
    ids = jnp.asarray(ids)
    if table.ndim != 2:
        raise SpmdError(f"table has shape {table.shape}; expected (vocab / tp, dim)", op=op)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise SpmdTypeError(f"ids have dtype {ids.dtype}; expected integers", op=op)
    rows = table.shape[0]
    start = comm.rank * rows
    mine = (ids >= start) & (ids < start + rows)
    found = jnp.take(table, jnp.where(mine, ids - start, 0), axis=0)
    return reduce_from(jnp.where(mine[..., None], found, 0), group=comm)


def vocab_cross_entropy(logits: Any, labels: Any, *, group: Any = "tp") -> Any:
    """Per-example softmax cross-entropy of logits split by vocabulary over the group.

    ``logits``: this rank's ``(..., vocab / tp)`` columns (rank r holds classes ``r * vocab /
    tp`` onwards, as :func:`column_linear` produces them); ``labels``: integer class ids
    ``(...)``, the same on every rank. Returns ``(...)`` losses, the same on every rank, as
    ``optax.softmax_cross_entropy_with_integer_labels`` on the full logits would. The full
    logits are never gathered: the maximum, the sum of exponentials and the label's logit are
    reduced over the group (two small allreduces), and the backward pass is local.

    Example (a world of one holds every class)::

        >>> import jax.numpy as jnp, spmd
        >>> with spmd.Mesh(tp=-1):
        ...     spmd.tensor_parallel.vocab_cross_entropy(jnp.zeros((1, 4)), jnp.array([1]))
        Array([1.3862944], dtype=float32)
    """
    op = "vocab_cross_entropy"
    comm = _comm(group, op)
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise SpmdError(
            f"logits have shape {logits.shape} and labels {labels.shape}; expected labels of "
            f"shape {logits.shape[:-1]} (logits without the vocabulary axis)",
            op=op,
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise SpmdTypeError(f"labels have dtype {labels.dtype}; expected integers", op=op)
    return _vocab_xent(logits, labels, comm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _vocab_xent(logits: Any, labels: Any, comm: Communicator) -> Any:
    return _xent_fwd(logits, labels, comm)[0]


def _xent_fwd(logits: Any, labels: Any, comm: Communicator) -> tuple[Any, Any]:
    from ..ops import allreduce

    v = logits.shape[-1]
    start = comm.rank * v
    mine = (labels >= start) & (labels < start + v)
    local_label = jnp.where(mine, labels - start, 0)
    f32 = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    top = jnp.max(f32, axis=-1)
    if comm.size > 1:
        top = allreduce(top, "max", group=comm)
    z = f32 - lax.stop_gradient(top)[..., None]
    e = jnp.exp(z)
    picked = jnp.where(mine, jnp.take_along_axis(z, local_label[..., None], -1)[..., 0], 0)
    total = e.sum(-1)
    if comm.size > 1:
        total, picked = allreduce([total, picked], "sum", group=comm)
    loss = jnp.log(total) - picked
    return loss.astype(logits.dtype), (e / total[..., None], mine, local_label, labels)


def _xent_bwd(comm: Communicator, res: Any, g: Any) -> tuple[Any, Any]:
    softmax, mine, local_label, labels = res
    hot = jax.nn.one_hot(local_label, softmax.shape[-1], dtype=softmax.dtype) * mine[..., None]
    grad = (softmax - hot) * g[..., None].astype(softmax.dtype)
    zero = jnp.zeros(labels.shape, jax.dtypes.float0)
    return grad.astype(g.dtype), zero


_vocab_xent.defvjp(_xent_fwd, _xent_bwd)


# -- splitting a parameter tree -----------------------------------------------------------------


def shard_params(params: Any, specs: Any, *, mesh: Mesh | None = None) -> Any:
    """This rank's blocks of a full parameter tree, as ShardedArrays (no communication).

    ``specs`` is a tree of ``spmd.PartitionSpec`` (or None: replicated) with the structure of
    ``params`` or a prefix of it. The layers' layouts: column_linear's ``w`` is
    ``P(None, "tp")`` and its bias ``P("tp")``; row_linear's ``w`` ``P("tp", None)`` and its bias
    None; vocab_embed's table ``P("tp", None)``. Split dimensions must divide by their groups
    (the layers take equal blocks). ``spmd.gather(tree)`` returns the full tree;
    ``spmd.save``/``spmd.load`` store and reshard it; :func:`local` gives the plain blocks.
    A parallel transform (``data_parallel``) that receives ShardedArrays reduces each gradient
    over the ranks that hold the same block (docs/model_parallel.md).

    Example (a world of one: one block holds everything)::

        >>> import jax.numpy as jnp, spmd
        >>> P = spmd.PartitionSpec
        >>> with spmd.Mesh(dp=-1, tp=1):
        ...     tree = spmd.tensor_parallel.shard_params(
        ...         {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}, {"w": P(None, "tp"), "b": None})
        >>> tree["w"].local.shape, tree["b"].spec
        ((4, 6), P(None,))
    """
    where = mesh if mesh is not None else current_mesh()
    if where is None:
        raise SpmdError(
            "shard_params needs a mesh: call it inside `with spmd.Mesh(...):` or pass mesh=",
            op="shard_params",
        )

    def one(outer: Any, spec: Any, sub: Any) -> Any:
        spec = PartitionSpec() if spec is None else spec

        def leaf(path: Any, x: Any) -> ShardedArray:
            x = jnp.asarray(x)
            s = normalize_spec(spec, x.ndim, where)
            for axis, entry in enumerate(s):
                n = where.group(entry).size if entry else 1
                if x.shape[axis] % n:
                    name = "params" + jax.tree_util.keystr((*outer, *path))
                    raise SpmdError(
                        f"{name} has {x.shape[axis]} elements along axis {axis} (shape "
                        f"{x.shape}), which do not divide by the {n} ranks of {entry!r} that {s} "
                        "splits it over",
                        op="shard_params",
                    )
            out: ShardedArray = shard(x, s, where)
            return out

        return jax.tree_util.tree_map_with_path(leaf, sub)

    return jax.tree_util.tree_map_with_path(
        one, specs, params, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec)
    )


# -- framework layers ---------------------------------------------------------------------------

_FRAMEWORKS = {"linen": "_tp_linen", "nnx": "_tp_nnx", "equinox": "_tp_equinox"}


def __getattr__(name: str) -> Any:
    """``spmd.tensor_parallel.linen`` / ``.nnx`` / ``.equinox``: the layers as modules of the
    framework, imported when first named (the framework must be installed)."""
    if name in _FRAMEWORKS:
        import importlib

        return importlib.import_module(f".{_FRAMEWORKS[name]}", __package__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
