"""``@spmd.data_parallel``: RAF's AutoDataParallel for JAX, with PyTorch DDP's engineering.

A :class:`~spmd.transforms.Step` whose chain ends in :func:`reduce_gradients`, which inserts
fused allreduces that average the gradients ``spmd.grad`` marked over the data-parallel group
(before it: :func:`~spmd.transforms.add_accumulated` after ``no_sync`` steps,
:func:`~spmd.transforms.weight_joined` under ``spmd.join``):

- buckets: gradient leaves in reverse parameter order (the order backward produces them), packed
  up to ``bucket_mb`` MiB per bucket; ``bucket_mb=0`` gives one allreduce per leaf;
- placement: each bucket's allreduce goes right after the op that produces its last gradient
  (``overlap=True``), so that on CPU XLA may run it while the rest of the backward pass
  computes; with ``overlap=False`` all buckets go after the backward pass;
- compression: ``"bf16"``/``"fp16"`` send float32 gradients in half precision (pre-divided by the
  group size, so the sum cannot overflow where the average would not), summed in float32 and
  rounded once (``spmd.allreduce(compression=...)``); gradients of other dtypes travel exactly;
- ``spmd.no_sync()``: inside it, the step does not communicate; it adds this rank's gradients
  to a local accumulator that the next synchronised call adds before its allreduce (DDP's
  semantics: the accumulated sum of micro-batch gradients, averaged over ranks). The step runs
  one of three programs made from one trace (its *variants*): synchronising, accumulating, or
  synchronising what was accumulated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError, SpmdTypeError
from ..mesh import resolve_group
from ._boundary import broadcast_nodes
from ._grad import mark_p
from ._join import join_inputs, join_state, weight_joined
from ._local import add_accumulated, return_local
from ._passes import (
    NO_GRAD,
    Bucket,
    GradientLeaf,
    Pass,
    block_groups,
    chain,
    gradient_leaves,
    place_buckets,
    reduce_blocks,
)
from ._program import Env, Program, eval_eqn, retrace
from ._step import Step, Traced, syncing

__all__ = ["DataParallel", "broadcast_params", "data_parallel", "reduce_gradients"]

_COMPRESSION = ("bf16", "fp16")
PENDING_SHAPES = (
    "the gradients accumulated under spmd.no_sync() belong to a call with other argument shapes "
    "or structure; accumulate micro-batches of one shape"
)


# -- API ------------------------------------------------------------------------------------------


def broadcast_params(tree: Any, root: int = 0, *, group: Any = None) -> Any:
    """``tree`` as rank ``root`` holds it, on every rank of the group (one fused broadcast).

    Start data-parallel replicas from one state: ``params = spmd.broadcast_params(params)``.
    Leaves of any dtype travel bit for bit, PRNG keys included (dtypes the collectives do not
    take go as their bytes).

    Example (a world of one: the tree comes back as it is)::

        >>> import jax, jax.numpy as jnp, spmd
        >>> params = {"w": jnp.ones((2, 2)), "key": jax.random.key(0)}
        >>> out = spmd.broadcast_params(params)
        >>> out["w"].shape, jnp.array_equal(jax.random.key_data(out["key"]),
        ...                                 jax.random.key_data(params["key"]))
        ((2, 2), Array(True, dtype=bool))

    Flax NNX objects in the tree (a model, an optimizer) are updated in place, as NNX's own
    methods do, and come back as the same objects: ``spmd.broadcast_params(model)``.
    """
    comm = resolve_group(None, group, op="broadcast_params")
    # Flax NNX objects: their state is broadcast and written back into them.
    return broadcast_nodes(tree, lambda t: _broadcast_tree(t, root, comm))


def _broadcast_tree(tree: Any, root: int, comm: Any) -> Any:
    from ..ops import ARRAY_LIKE, broadcast
    from ..sharded import is_sharded

    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
    for path, leaf in with_path:
        name = jax.tree_util.keystr(path) or "the tree"
        if is_sharded(leaf):
            # Each rank's shard is its own data: rank root's would overwrite the others'.
            raise SpmdError(
                f"{name} is a ShardedArray, whose shards differ between ranks by design; "
                "broadcast the full array before sharding it, or leave sharded state out of the "
                "tree",
                op="broadcast_params",
            )
        if not isinstance(leaf, ARRAY_LIKE):
            raise SpmdTypeError(
                f"{name} is a {type(leaf).__name__}, not an array; pass arrays or pytrees "
                "(lists, tuples, dicts) of arrays (for a model object holding functions, e.g. "
                "equinox's, broadcast eqx.filter(model, eqx.is_array))",
                op="broadcast_params",
            )
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    wired = [_to_wire(x) for x in leaves]
    sent = broadcast([w for w, _ in wired], root=root, group=comm) if leaves else []
    return jax.tree_util.tree_unflatten(
        treedef, [back(w) for w, (_, back) in zip(sent, wired, strict=True)]
    )


def _to_wire(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``x`` as an array the collectives take, and how to make it ``x`` again, bit for bit:
    PRNG keys as their key data, dtypes the collectives do not take (uint32, int16, complex,
    ...) as their bytes (uint8, one more dimension)."""
    from ..ops import SUPPORTED_DTYPES

    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data, back = _to_wire(jax.random.key_data(x))
        return data, lambda w: jax.random.wrap_key_data(back(w), impl=impl)
    x = jnp.asarray(x)
    dtype = x.dtype
    if dtype in SUPPORTED_DTYPES:
        return x, lambda w: w
    if jnp.issubdtype(dtype, jnp.complexfloating):  # lax cannot bit-cast complex numbers
        parts, back = _to_wire(jnp.stack([x.real, x.imag], axis=-1))
        return parts, lambda w: jax.lax.complex(back(w)[..., 0], back(w)[..., 1]).astype(dtype)
    integer = jnp.issubdtype(dtype, jnp.integer)
    info = jnp.iinfo(dtype) if integer else jnp.finfo(dtype)
    if info.bits < 8:  # int4, float4...: widened, which holds every value exactly
        wide = (jnp.int8 if info.min < 0 else jnp.uint8) if integer else jnp.float32
        return x.astype(wide), lambda w: w.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint8), lambda w: jax.lax.bitcast_convert_type(
        w, dtype
    )


def data_parallel(
    fn: Callable[..., Any] | None = None,
    *,
    group: Any = None,
    bucket_mb: float = 25.0,
    average: bool = True,
    compression: str | None = None,
    overlap: bool = True,
    accumulate_steps: int = 1,
    check_params: bool = True,
    deterministic: bool = False,
    shards: int = 8,
) -> Any:
    """Data parallelism for a training step; bare (``@data_parallel``) or with options.

    Each rank calls the step with its own local batch. Every gradient produced by
    ``spmd.grad``/``spmd.value_and_grad`` inside is averaged over the group by allreduces the
    transform inserts right after the ops that produce them, in buckets. ``spmd.trace(step)``
    shows them. On its first call the step checks that the parameters (the arguments
    ``spmd.grad`` differentiates) are the same on every rank, and raises naming the ranks that
    differ.

    Args:
        fn: the step. It must compute its gradients with ``spmd.(value_and_)grad``.
        group: the data-parallel group: None (the default communicator, usually the world), a
            Communicator, or an axis name of the mesh active at call time.
        bucket_mb: bucket capacity in MiB (reverse parameter order); 0: one allreduce per leaf.
        average: average the gradients (True) or sum them (False).
        compression: None, ``"bf16"`` or ``"fp16"``: send the float32 gradients in half
            precision (others exactly).
        overlap: place each bucket's allreduce right after its last gradient is produced (True)
            or after the whole backward pass (False).
        accumulate_steps: k > 1 splits the other arguments of each gradient call into k
            micro-batches along axis 0 and accumulates their gradients locally (mean over
            micro-batches) before the one allreduce.
        check_params: on the first call, check that the parameters are identical on every rank.
        deterministic: the same bits whatever the group's size and transport: the global batch
            is cut into ``shards`` equal parts (each rank's batch into shards / size of them,
            in rank order), each part's value and gradient computed alone, gathered over the
            group and summed in a fixed pairwise order. Every gradient call then returns the
            global batch's mean value and gradient. Costs an allgather of shards / size
            gradients per rank instead of an allreduce; no compression, ``no_sync``,
            ``accumulate_steps`` or ``has_aux`` with it.
        shards: with ``deterministic=True``, the global batch's part count; group sizes that
            divide it give the same results.

    Example (a world of one; under ``spmd-run -n N`` the same step averages over N ranks)::

        >>> import jax.numpy as jnp, spmd
        >>> @spmd.data_parallel
        ... def step(w, x):
        ...     loss, g = spmd.value_and_grad(lambda w: jnp.sum(w * x))(w)
        ...     return w - 0.5 * g, loss
        >>> w, loss = step(jnp.ones(3), jnp.arange(3.0))
        >>> w, loss
        (Array([1. , 0.5, 0. ], dtype=float32), Array(3., dtype=float32))
    """
    options: dict[str, Any] = dict(
        group=group,
        bucket_mb=bucket_mb,
        average=average,
        compression=compression,
        overlap=overlap,
        accumulate_steps=accumulate_steps,
        check_params=check_params,
        deterministic=deterministic,
        shards=shards,
    )
    if fn is None:
        return functools.partial(DataParallel, **options)
    return DataParallel(fn, **options)


class DataParallel(Step):
    """A data-parallel training step (what ``@spmd.data_parallel`` returns): a
    :class:`~spmd.transforms.Step` whose chain of passes ends in :func:`reduce_gradients`, or in
    :func:`~spmd.transforms.return_local` inside ``no_sync()`` (:meth:`passes`)."""

    transform = "data_parallel"

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        group: Any,
        bucket_mb: float,
        average: bool,
        compression: str | None,
        overlap: bool,
        accumulate_steps: int,
        check_params: bool,
        deterministic: bool = False,
        shards: int = 8,
    ) -> None:
        if bucket_mb < 0:
            raise SpmdError(f"bucket_mb={bucket_mb!r}; expected a number >= 0", op=self.transform)
        _check_compression(compression)
        if deterministic:
            if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
                raise SpmdError(f"shards={shards!r}; expected an int >= 1", op=self.transform)
            if compression is not None or accumulate_steps != 1:
                raise SpmdError(
                    "deterministic=True sums exact per-shard gradients itself: pass neither "
                    f"compression (got {compression!r}) nor accumulate_steps (got "
                    f"{accumulate_steps})",
                    op=self.transform,
                )
        super().__init__(
            fn, group=group, accumulate_steps=accumulate_steps, check_params=check_params
        )
        self.shards = shards if deterministic else 0
        self.options: dict[str, Any] = dict(
            bucket_mb=bucket_mb,
            average=average,
            compression=compression,
            overlap=overlap,
            deterministic=deterministic,
        )
        # no_sync's local gradient sums, and the traced signature they belong to.
        self._pending: list[Any] | None = None
        self._pending_for: Traced | None = None

    def passes(self, traced: Traced, variant: Any) -> Pass:
        """The chain of a call's variant: under ``spmd.join``, its weighting first; where
        ``no_sync`` accumulated gradients, their addition; then the reduction, or inside
        ``no_sync()`` the local gradients returned."""
        sync, pending, joined = variant or (True, False, False)
        return chain(
            *([weight_joined(group=self.group)] if joined else []),
            *([add_accumulated()] if pending else []),
            reduce_gradients(group=self.group, **self.options) if sync else return_local(),
        )

    def variant(self, traced: Traced) -> Any:
        """None (synchronise), or (sync, pending): whether the call synchronises, and whether it
        adds the gradients accumulated under ``no_sync``."""
        pending = self._pending is not None
        if pending and self._pending_for is not traced:
            raise SpmdError(PENDING_SHAPES, op=f"{self.transform}({traced.program.name})")
        sync = syncing()
        if not sync and self.shards:
            raise SpmdError(
                "spmd.no_sync() around a data_parallel(deterministic=True) step: its gradients "
                "are reduced inside each gradient call; accumulate with a larger batch and more "
                "shards instead",
                op=self.name,
            )
        state = join_state(self.comm, self.name)
        if state is not None and (not sync or pending or self.shards):
            what = "spmd.no_sync()" if not sync or pending else "deterministic=True"
            raise SpmdError(f"spmd.join does not take {what} steps yet", op=self.name)
        return None if sync and not pending and state is None else (sync, pending, bool(state))

    def extra_inputs(self, traced: Traced, variant: Any) -> Sequence[Any]:
        if variant is not None and variant[2]:
            return join_inputs(self.comm())  # (no_sync's are refused under join)
        return self._pending or ()

    def results(self, traced: Traced, variant: Any, outs: Sequence[Any]) -> Any:
        n = traced.program.out_tree.num_leaves
        sync = variant is None or variant[0]
        self._pending = None if sync else list(outs[n:])
        self._pending_for = None if sync else traced
        return super().results(traced, variant, outs[:n])


def _check_compression(compression: Any) -> None:
    if compression is not None and compression not in _COMPRESSION:
        raise SpmdError(
            f"compression={compression!r}; expected None, 'bf16' or 'fp16'", op="data_parallel"
        )


# -- the pass -------------------------------------------------------------------------------------


def _reducible(leaf: GradientLeaf) -> bool:
    return bool(jnp.issubdtype(leaf.src.aval.dtype, jnp.inexact))


def reduce_gradients(
    *,
    group: Any = None,
    bucket_mb: float = 25.0,
    average: bool = True,
    compression: str | None = None,
    overlap: bool = True,
    deterministic: bool = False,
) -> Pass:
    """The data-parallel pass: insert bucketed allreduces of the gradients ``spmd.grad`` marked.

    Options as :func:`data_parallel`'s. What ``no_sync`` accumulated is added by
    :func:`add_accumulated` before it, and a step inside ``no_sync()`` runs
    :func:`return_local` instead; under ``spmd.join`` the step runs :func:`weight_joined`
    before it. Gradient marks and parameter marks are removed.

    Example: the pass on its own, on a traced gradient function (a world of one)::

        >>> import jax.numpy as jnp, spmd
        >>> program = spmd.trace(spmd.grad(lambda w: jnp.sum(w**2)))(jnp.ones(2))
        >>> averaged = spmd.transforms.reduce_gradients(bucket_mb=0)(program)
        >>> averaged(jnp.ones(2))
        Array([2., 2.], dtype=float32)
    """
    _check_compression(compression)

    def apply(program: Program) -> Program:
        return _reduce(
            program,
            group,
            bucket_mb,
            average,
            compression,
            overlap,
            deterministic,
        )

    return apply


def _reduce(
    program: Program,
    group: Any,
    bucket_mb: float,
    average: bool,
    compression: str | None,
    overlap: bool,
    deterministic: bool = False,
) -> Program:
    comm = resolve_group(None, group, op="data_parallel")
    leaves, marks = gradient_leaves(program)
    if not leaves:
        raise SpmdError(NO_GRAD.format(name=program.name), op="data_parallel")
    at = place_buckets(leaves, marks, bucket_mb, overlap)
    eqns = program.jaxpr.jaxpr.eqns
    invars = program.jaxpr.jaxpr.invars

    def reduce(values: list[Any]) -> list[Any]:
        from ..ops import allreduce

        if comm.size == 1 or deterministic:  # deterministic: reduced by the gradient call
            return values
        op = "avg" if average else "sum"
        return list(allreduce(values, op, group=comm, compression=compression))

    # Blocks split over ranks of the group itself (experts) are reduced over the ranks holding
    # the same block only (reduce_blocks).
    subgroups = [block_groups(comm.groups, leaf.shards) for leaf in leaves]
    if deterministic and any(sub is not None for sub in subgroups):
        raise SpmdError(
            "deterministic=True with parameters split over the group (experts): not supported",
            op="data_parallel",
        )

    def flush(env: Env, bucket: Bucket) -> None:
        values = [env.read(x.src) for x in bucket.leaves]
        live = [i for i, x in enumerate(bucket.leaves) if _reducible(x)]
        by_group: dict[Any, list[int]] = {}
        for i in live:
            by_group.setdefault(subgroups[bucket.leaves[i].k], []).append(i)
        for sub, members in by_group.items():
            parts = [values[i] for i in members]
            reduced = (
                reduce(parts) if sub is None else reduce_blocks(parts, sub, comm.size, average)
            )
            for i, r in zip(members, reduced, strict=True):
                values[i] = r
        for v, x in zip(values, bucket.leaves, strict=True):
            env.write(x.dst, v)

    def body(env: Env, xs: Sequence[Any]) -> list[Any]:
        for v, x in zip(invars, xs, strict=True):
            env.write(v, x)
        for b in at.get(-1, []):
            flush(env, b)
        for i, eqn in enumerate(eqns):
            if eqn.primitive is mark_p:
                if eqn.params["kind"] == "param":
                    for a, o in zip(eqn.invars, eqn.outvars, strict=True):
                        env.write(o, env.read(a))
            else:
                for o, val in zip(eqn.outvars, eval_eqn(eqn, [env.read(a) for a in eqn.invars]),
                                  strict=True):  # fmt: skip
                    env.write(o, val)
            for b in at.get(i, []):
                flush(env, b)
        return [env.read(v) for v in program.jaxpr.jaxpr.outvars]

    return program.replace(retrace(program, body))
