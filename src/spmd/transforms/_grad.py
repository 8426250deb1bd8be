"""``spmd.grad`` and ``spmd.value_and_grad``: jax's, plus marks that passes can find.

Outside a parallel transform (and outside ``spmd.trace``) they call ``jax.grad`` /
``jax.value_and_grad`` and nothing else: results are exactly jax's. While a transform traces a
step they add two identity ops to the op list, ``spmd.mark[kind=param]`` on the differentiated
arguments and ``spmd.mark[kind=grad]`` on the gradients they return, both tagged with the
call's number, so that a pass knows which values are gradients of which parameters.

Under ``data_parallel(accumulate_steps=k)`` a gradient call also splits its other arguments
into k micro-batches along axis 0 and accumulates their gradients in a ``lax.scan``, locally:
the pass then reduces the accumulated gradient once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PerExampleGradientWarning, SpmdError, SpmdTypeError
from .._jax_compat import ad, batching, core, mlir
from ..runtime import Communicator, this_rank
from ..sharded import is_sharded, spec_axes
from ._boundary import split_for_grad
from ._boxes import box_groups, is_block_box

__all__ = ["grad", "mark_p", "marking", "value_and_grad"]


# -- marking context ------------------------------------------------------------------------------


@dataclass
class _Marking:
    calls: int = 0
    accumulate_steps: int = 1
    transform: str = "data_parallel"  # how errors name the transform tracing the step
    # data_parallel(deterministic=True): the global batch's shard count and the group; each
    # gradient call then reduces its per-shard gradients itself (_deterministic).
    shards: int = 0
    group: Any = None
    # (spmd.grad call, vmap level) where that vmap left some parameter leaf unbatched: its
    # batched gradients are per-example (or a sweep's), not an ensemble's.
    unbatched_params: set[tuple[int, int]] = field(default_factory=set)


_MARKING: contextvars.ContextVar[_Marking | None] = contextvars.ContextVar(
    "spmd_marking", default=None
)


@contextlib.contextmanager
def marking(
    accumulate_steps: int = 1, transform: str = "data_parallel", shards: int = 0, group: Any = None
) -> Iterator[None]:
    """While tracing a step: spmd.grad calls mark their parameters and gradients."""
    token = _MARKING.set(
        _Marking(accumulate_steps=accumulate_steps, transform=transform, shards=shards, group=group)
    )
    try:
        yield
    finally:
        _MARKING.reset(token)


def active() -> _Marking | None:
    """The marking context of the step being traced, or None outside one."""
    return _MARKING.get()


# -- primitive ------------------------------------------------------------------------------------

mark_p = core.Primitive("spmd_mark")
mark_p.multiple_results = True
mark_p.def_impl(lambda *xs, **_: list(xs))
mark_p.def_abstract_eval(lambda *avals, **_: list(avals))
mlir.register_lowering(mark_p, lambda ctx, *xs, **_: list(xs))


def _mark_jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> Any:
    return mark_p.bind(*primals, **params), list(tangents)


def _mark_transpose(cts: Sequence[Any], *args: Any, **params: Any) -> list[Any]:
    return list(cts)


PER_EXAMPLE = (
    "{where}: spmd.grad is called under jax.vmap with parameters that are not batched: the "
    "step averages each vmapped index's gradient across ranks, right for a sweep of "
    "hyperparameters, but per-example gradients (DP-SGD) would be averaged with other ranks' "
    "unrelated examples. For those, differentiate the aggregate: compute per-example weights "
    "with jax.vmap(jax.grad(...)) and pass spmd.grad the weighted loss (docs/data_parallel.md, "
    "'Per-example gradients')."
)


def _mark_batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], **params: Any) -> Any:
    """Called at every vmap level around a mark, batched or not (a fancy batching rule), so that
    each level is judged on its own: an ensemble vmap around a per-example one still warns, and
    differentiating with respect to a batched input as well as unbatched parameters warns."""
    ctx = _MARKING.get()
    if ctx is not None:
        level = (params["call"], id(axis_data))
        batched = [d is not None for d in dims]
        if params["kind"] == "param" and not all(batched):
            ctx.unbatched_params.add(level)
        elif params["kind"] == "grad" and any(batched) and level in ctx.unbatched_params:
            warnings.warn(
                PER_EXAMPLE.format(where=this_rank()),
                PerExampleGradientWarning,
                stacklevel=_user_stacklevel(),
            )
    return mark_p.bind(*args, **params), list(dims)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost caller outside jax and spmd (the user's line) for a
    warning issued by the function that calls this one."""
    inside = (os.path.dirname(jax.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


ad.primitive_jvps[mark_p] = _mark_jvp
ad.primitive_transposes[mark_p] = _mark_transpose
batching.fancy_primitive_batchers[mark_p] = _mark_batch


def mark_tree(tree: Any, kind: str, call: int) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    shards = leaf_shard_groups(tree)
    out = mark_p.bind(*leaves, kind=kind, call=call, paths=paths, shards=shards)
    return jax.tree_util.tree_unflatten(treedef, out)


def leaf_shard_groups(tree: Any) -> tuple[tuple[tuple[int, ...], ...] | None, ...]:
    """Per array leaf of ``tree``, :func:`shard_groups`. A ShardedArray flattens to one leaf
    (its block), as does a framework layer's box (linen's ``Partitioned``: a tensor-parallel
    block, an expert block): the groups that hold its blocks go with it."""
    return tuple(
        box_groups(x) if is_block_box(x) else shard_groups(x)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: is_sharded(x) or is_block_box(x))
    )


def shard_groups(x: Any) -> tuple[tuple[int, ...], ...] | None:
    """For a ShardedArray, the groups of world ranks over which its blocks differ (a rank's
    position in its group says which block it holds); None for anything else or a replicated
    ShardedArray."""
    if not is_sharded(x):
        return None
    axes = spec_axes(x.spec)
    if not axes:
        return None
    where = x.mesh
    groups = where.groups if isinstance(where, Communicator) else where.rank_lists(axes)
    return tuple(tuple(int(r) for r in g) for g in groups)


# -- API ------------------------------------------------------------------------------------------


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` whose gradients a parallel transform can find.

    Same signature and results as ``jax.value_and_grad``. Inside ``@spmd.data_parallel`` the
    gradients it returns are averaged over the data-parallel group (the transform inserts the
    allreduces; see ``spmd.trace``).

    Example (outside a transform, exactly ``jax.value_and_grad``)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.value_and_grad(lambda w: jnp.sum(w**2))(jnp.array([1.0, 2.0]))
        (Array(5., dtype=float32), Array([2., 4.], dtype=float32))
    """
    vg = jax.value_and_grad(fun, argnums, has_aux, holomorphic, allow_int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        split = split_for_grad(fun, args, nums, has_aux)
        if split is not None:  # NNX objects or Equinox models: a pure function of their arrays
            pure, flat, aux, finish = split
            inner = value_and_grad(pure, argnums, aux, holomorphic, allow_int)
            return finish(inner(*flat, **kwargs))
        ctx = _MARKING.get()
        if ctx is None:
            return vg(*args, **kwargs)
        call = ctx.calls
        ctx.calls += 1
        for i in nums:
            if not -len(args) <= i < len(args):
                name = getattr(fun, "__name__", repr(fun))  # a functools.partial has none
                raise SpmdError(
                    f"argnums={argnums} but {name} "
                    f"was called with {len(args)} positional arguments",
                    op="spmd.value_and_grad",
                )
        marked = tuple(i % len(args) for i in nums)  # jax's argnums may count from the end
        for i in marked:
            _check_differentiable(args[i], i, allow_int, holomorphic, ctx.transform)
        args = tuple(mark_tree(a, "param", call) if i in marked else a for i, a in enumerate(args))
        if ctx.shards:
            value, grads = _deterministic(vg, args, kwargs, marked, has_aux, ctx)
        elif ctx.accumulate_steps > 1:
            value, grads = _accumulate(vg, args, kwargs, marked, has_aux, ctx.accumulate_steps)
        else:
            value, grads = vg(*args, **kwargs)
        return value, mark_tree(grads, "grad", call)

    return wrapped


NOT_DIFFERENTIABLE = (
    "{path} (a leaf of argument {i}, differentiated in a step of {transform}) is {what}; "
    "gradients are taken with respect to floating-point arrays only. {fix}"
)


def _check_differentiable(
    tree: Any, i: int, allow_int: bool, holomorphic: bool, transform: str
) -> None:
    """An error naming the leaf (jax's would not) for a differentiated argument's leaf that is
    not an array of floats: a string, an object, or (without ``allow_int``) integers."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"argument {i}" + jax.tree_util.keystr(path)
        dtype = getattr(leaf, "dtype", None)
        if dtype is None and isinstance(leaf, int | float | complex | bool):
            dtype = jnp.asarray(leaf).dtype
        if dtype is None or getattr(dtype, "kind", "f") in "OUS":
            what = f"a {type(leaf).__name__}" if dtype is None else f"an array of {dtype}"
            fix = ("Keep it out of the differentiated argument: pass it as another argument, "
                   "or close over it in the loss function.")  # fmt: skip
        elif holomorphic or allow_int or jnp.issubdtype(dtype, jnp.inexact):
            continue
        else:
            shape = np.shape(leaf)
            what = f"a scalar of {dtype}" if not shape else f"an array of {dtype} {list(shape)}"
            fix = ("Make it a float (e.g. jnp.float32), keep it out of the differentiated "
                   "argument (another argument, or closed over), or pass allow_int=True for a "
                   "float0 gradient.")  # fmt: skip
        raise SpmdTypeError(
            NOT_DIFFERENTIABLE.format(transform=transform, i=i, path=where, what=what, fix=fix),
            op="spmd.value_and_grad",
        )


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """``jax.grad`` whose gradients a parallel transform can find (see :func:`value_and_grad`).

    Example (inside ``spmd.trace`` the marks show; see :func:`spmd.trace`)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.grad(lambda w: jnp.sum(w**2))(jnp.array([1.0, 2.0]))
        Array([2., 4.], dtype=float32)
    """
    vg = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int)
    plain = jax.grad(fun, argnums, has_aux, holomorphic, allow_int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _MARKING.get() is None and split_for_grad(fun, args, nums, has_aux) is None:
            return plain(*args, **kwargs)
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


# -- gradient accumulation ------------------------------------------------------------------------


def _is_float0(x: Any) -> bool:
    """The gradient of an integer input under ``allow_int=True``: it holds no values."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _add(a: Any, b: Any) -> Any:
    return a if _is_float0(a) else a + b


def _split(x: Any, k: int, where: str, transform: str, option: str = "") -> Any:
    """``x`` as k micro-batches along axis 0; None for what is not split: scalars and leaves
    that are not arrays (a string or a flag passed through to the loss)."""
    if not getattr(x, "shape", ()):
        return None
    x = jnp.asarray(x)
    if x.shape[0] % k:
        raise SpmdError(
            f"{transform}({option or f'accumulate_steps={k}'}): {where} has {x.shape[0]} "
            f"rows, which do not split into {k} micro-batches; pass a batch whose leading "
            f"dimension is a multiple of {k}"
        )
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


def _micro_batches(
    vg: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: tuple[int, ...],
    k: int,
    transform: str,
    option: str = "",
) -> tuple[Callable[[Any], Any], bool]:
    """``one(i)``: ``vg`` on micro-batch i of k of the non-differentiated arguments (split along
    axis 0; the differentiated ones whole); and whether any argument was split at all."""
    data = ([a for i, a in enumerate(args) if i not in nums], kwargs)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(data)
    leaves = [x for _, x in with_path]
    split = [_split(x, k, "argument" + jax.tree_util.keystr(p), transform, option)
             for p, x in with_path]  # fmt: skip

    def one(i: Any) -> Any:
        micro = [x if s is None else s[i] for x, s in zip(leaves, split, strict=True)]
        rest, kw = jax.tree_util.tree_unflatten(treedef, micro)
        it = iter(rest)
        full = [a if j in nums else next(it) for j, a in enumerate(args)]
        return vg(*full, **kw)

    return one, any(s is not None for s in split)


def _accumulate(
    vg: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: tuple[int, ...],
    has_aux: bool,
    k: int,
) -> tuple[Any, Any]:
    """Mean value and gradient over k micro-batches of the non-differentiated arguments."""
    transform = ctx.transform if (ctx := _MARKING.get()) is not None else "data_parallel"
    one, _ = _micro_batches(vg, args, kwargs, nums, k, transform)

    def parts(i: Any) -> tuple[Any, Any, Any]:
        value, grads = one(i)
        return (value[0], value[1], grads) if has_aux else (value, None, grads)

    v0, aux0, g0 = parts(0)

    def body(carry: Any, i: Any) -> Any:
        v, aux, g = parts(i)
        return jax.tree_util.tree_map(_add, carry, (v, g)), aux

    (v, g), auxs = jax.lax.scan(body, (v0, g0), jnp.arange(1, k))
    value, grads = jax.tree_util.tree_map(lambda t: t if _is_float0(t) else t / k, (v, g))
    if not has_aux:
        return value, grads
    # aux, as the loss would give it on the whole batch: a leaf whose leading dimension the
    # whole batch makes k times a micro-batch's (per-example values; found by evaluating the
    # loss's shapes on the whole batch) is the micro-batches' rows end to end; any other the
    # mean over micro-batches where it is floating point, else the last micro-batch's.
    whole = jax.tree_util.tree_leaves(jax.eval_shape(lambda: vg(*args, **kwargs))[0][1])
    firsts, treedef = jax.tree_util.tree_flatten(aux0)

    def combine(a0: Any, rest: Any, whole_shape: tuple[int, ...]) -> Any:
        m = jnp.shape(a0)
        if m and whole_shape == (k * m[0], *m[1:]):
            return jnp.concatenate([a0[None], rest]).reshape(whole_shape)
        if jnp.issubdtype(rest.dtype, jnp.inexact):
            return (a0 + rest.sum(0)) / k
        return rest[-1]

    combined = [
        combine(a0, rest, tuple(w.shape))
        for a0, rest, w in zip(firsts, jax.tree_util.tree_leaves(auxs), whole, strict=True)
    ]  # (the scan stacks aux0's structure: the same leaves in the same order)
    return (value, jax.tree_util.tree_unflatten(treedef, combined)), grads


# -- deterministic reduction ----------------------------------------------------------------------


def _deterministic(
    vg: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: tuple[int, ...],
    has_aux: bool,
    ctx: _Marking,
) -> tuple[Any, Any]:
    """The value and gradient over the global batch, the same bits whatever the group's size:
    this rank's batch is its k = shards / size consecutive shards of the global batch; each
    shard's value and gradient are computed alone (a lax.scan, the same program for any k), the
    group's shards gathered in global order, and summed in ``spmd.ops.tree_reduce``'s order."""
    from ..ops import allgather, tree_reduce

    transform = ctx.transform
    comm = ctx.group
    if has_aux:
        raise SpmdError(
            f"{transform}(deterministic=True) does not take has_aux=True gradients yet; return "
            "the auxiliary values from the step instead",
            op="spmd.value_and_grad",
        )
    if ctx.shards % comm.size:
        raise SpmdError(
            f"{transform}(deterministic=True, shards={ctx.shards}) on a group of {comm.size} "
            f"ranks: the shard count must be a multiple of the group size (pass shards=, e.g. "
            f"{comm.size * max(1, round(ctx.shards / comm.size))})",
            op="spmd.value_and_grad",
        )
    k = ctx.shards // comm.size
    option = f"deterministic=True, shards={ctx.shards}: {k} per rank of {comm.size}"
    shard, any_split = _micro_batches(vg, args, kwargs, nums, k, transform, option)
    if not any_split:
        raise SpmdError(
            f"{transform}(deterministic=True): the gradient call has no batch to split into "
            "shards (no argument but the differentiated ones has a leading dimension)",
            op="spmd.value_and_grad",
        )

    _, (values, grads) = jax.lax.scan(lambda _, i: (None, shard(i)), None, jnp.arange(k))
    summed = []
    for leaf in jax.tree_util.tree_leaves((values, grads)):
        if _is_float0(leaf):
            summed.append(leaf[0])
            continue
        every = leaf if comm.size == 1 else allgather(leaf, axis=0, group=comm)
        summed.append(tree_reduce(every) / ctx.shards)
    value, grads = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure((values, grads)),
                                                summed)  # fmt: skip
    return value, grads
