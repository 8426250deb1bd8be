"""``@spmd.data_parallel``: RAF's AutoDataParallel for JAX, with PyTorch DDP's engineering.

The step is traced once per input signature into an op list (:mod:`._program`) in which
``spmd.grad`` marked every gradient. The pass :func:`allreduce_gradients` then inserts fused
allreduces that average the gradients over the data-parallel group:

- buckets: gradient leaves in reverse parameter order (the order backward produces them), packed
  up to ``bucket_mb`` MiB per bucket; ``bucket_mb=0`` gives one allreduce per leaf;
- placement: each bucket's allreduce goes right after the op that produces its last gradient
  (``overlap=True``), so communication can run while the rest of the backward pass computes;
  with ``overlap=False`` all buckets go after the backward pass;
- compression: ``"bf16"``/``"fp16"`` send float32 gradients in half precision (pre-divided by the
  group size, so the sum cannot overflow where the average would not), summed in float32 and
  rounded once (``spmd.allreduce(compression=...)``; on CPU the rounding happens inside the
  shared-memory copies); gradients of other dtypes travel exactly;
- ``spmd.no_sync()``: inside it, the step does not communicate; it adds this rank's gradients
  to a local accumulator that the next synchronised call adds before its allreduce (DDP's
  semantics: the accumulated sum of micro-batch gradients, averaged over ranks).

The compiled program is cached per input signature and variant; calls take jit's fast path.
On its first call the step compares a checksum of the parameters (the arguments that
``spmd.grad`` differentiates) across the group and raises, naming the ranks that differ.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from .._errors import SpmdError, SpmdTypeError
from ..mesh import mesh_key
from ..runtime import Communicator, this_rank
from ._grad import mark_p, marking
from ._program import Env, Program, eval_eqn, retrace, trace_program

__all__ = [
    "DataParallel",
    "allreduce_gradients",
    "broadcast_params",
    "check_replicas",
    "check_same",
    "data_parallel",
    "no_sync",
]

_COMPRESSION = ("bf16", "fp16")
_NO_SYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_no_sync", default=False)


# -- API ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Inside this context, ``@data_parallel`` steps accumulate gradients locally, without
    communication; the next call outside it averages the accumulated sum over the group.

    As with PyTorch DDP, the outputs of the steps run inside ``no_sync`` are computed from this
    rank's local gradients; use them only for what does not need synchronised gradients.
    """
    token = _NO_SYNC.set(True)
    try:
        yield
    finally:
        _NO_SYNC.reset(token)


def broadcast_params(tree: Any, root: int = 0, *, group: Any = None) -> Any:
    """``tree`` as rank ``root`` holds it, on every rank of the group (one fused broadcast).

    Start data-parallel replicas from one state: ``params = spmd.broadcast_params(params)``.
    Leaves of any dtype travel bit for bit, PRNG keys included (dtypes the collectives do not
    take go as their bytes).
    """
    from ..ops import broadcast
    from ..ops._core import ARRAY_LIKE
    from ..sharded import is_sharded

    comm = _communicator(group, "broadcast_params")
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
    for path, leaf in with_path:
        name = jax.tree_util.keystr(path) or "the tree"
        if is_sharded(leaf):
            # Each rank's shard is its own data: rank root's would overwrite the others'.
            raise SpmdError(
                f"{this_rank()}: broadcast_params: {name} is a ShardedArray, whose shards "
                "differ between ranks by design; broadcast the full array before sharding it, "
                "or leave sharded state out of the tree"
            )
        if not isinstance(leaf, ARRAY_LIKE):
            raise SpmdTypeError(
                f"{this_rank()}: broadcast_params: {name} is a {type(leaf).__name__}, not an "
                "array; pass arrays or pytrees (lists, tuples, dicts) of arrays (for a model "
                "object holding functions, e.g. equinox's, broadcast "
                "eqx.filter(model, eqx.is_array))"
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
    from ..ops._core import SUPPORTED_DTYPES

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
) -> Any:
    """Data parallelism for a training step; bare (``@data_parallel``) or with options.

    Each rank calls the step with its own local batch. Every gradient produced by
    ``spmd.grad``/``spmd.value_and_grad`` inside is averaged over the group by allreduces the
    transform inserts right after the ops that produce them, in buckets. ``spmd.trace(step)``
    shows them.

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
    """
    options: dict[str, Any] = dict(
        group=group,
        bucket_mb=bucket_mb,
        average=average,
        compression=compression,
        overlap=overlap,
        accumulate_steps=accumulate_steps,
        check_params=check_params,
    )
    if fn is None:
        return functools.partial(DataParallel, **options)
    return DataParallel(fn, **options)


# -- errors ---------------------------------------------------------------------------------------

NO_GRAD = (
    "{where}: {name} computes no gradient with spmd.grad or spmd.value_and_grad, so there is "
    "nothing to average. Compute the gradients in the step with them, e.g.\n"
    "    loss, grads = spmd.value_and_grad(loss_fn)(params, batch)\n"
    "(jax.grad's gradients are not seen, nor are spmd.grad calls inside a nested jax.jit)."
)

PARAMS_DIFFER = (
    "{where}: the parameters differ between ranks at the first step: {detail}. Data-parallel "
    "replicas must start from one state: params = spmd.broadcast_params(params) before "
    "training (or pass check_params=False if they differ on purpose)."
)


def _check_compression(compression: Any) -> None:
    if compression is not None and compression not in _COMPRESSION:
        raise SpmdError(
            f"{this_rank()}: data_parallel: compression={compression!r}; expected None, "
            "'bf16' or 'fp16'"
        )


def _communicator(group: Any, where: str) -> Communicator:
    from ..mesh import resolve_group

    return resolve_group(None, group, op=where)


# -- pass -----------------------------------------------------------------------------------------


@dataclass
class _Leaf:
    """One marked gradient leaf: where it comes from and where the step reads it."""

    k: int  # position among all marked gradients of the step
    call: int
    path: str
    src: Any  # the value the backward pass produced (mark input)
    dst: Any  # the value the rest of the step reads (mark output)
    nbytes: int
    producer: int  # index of the producing op, -1 for an input or constant


@dataclass
class _Bucket:
    leaves: list[_Leaf] = field(default_factory=list)
    nbytes: int = 0


def gradient_leaves(program: Program) -> tuple[list[_Leaf], dict[int, int]]:
    """The marked gradients of a program, and {gradient call: index of its mark op}."""
    eqns = program.jaxpr.jaxpr.eqns
    producer: dict[Any, int] = {}
    leaves: list[_Leaf] = []
    marks: dict[int, int] = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive is mark_p and eqn.params["kind"] == "grad":
            marks[eqn.params["call"]] = i
            for src, dst, path in zip(eqn.invars, eqn.outvars, eqn.params["paths"], strict=True):
                aval = src.aval
                nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
                # A constant gradient (of an unused or linear scalar) is a literal: no producer.
                made = -1 if isinstance(src, core.Literal) else producer.get(src, -1)
                leaves.append(
                    _Leaf(len(leaves), eqn.params["call"], path, src, dst, nbytes, made)
                )  # fmt: skip
        for v in eqn.outvars:
            producer[v] = i
    return leaves, marks


def _buckets(leaves: list[_Leaf], bucket_mb: float) -> list[_Bucket]:
    """Reverse parameter order within each gradient call, packed up to bucket_mb MiB."""
    cap = bucket_mb * 2**20
    buckets: list[_Bucket] = []
    calls = sorted({leaf.call for leaf in leaves})
    for call in calls:
        current = _Bucket()
        for leaf in reversed([x for x in leaves if x.call == call]):
            if current.leaves and (cap <= 0 or current.nbytes + leaf.nbytes > cap):
                buckets.append(current)
                current = _Bucket()
            current.leaves.append(leaf)
            current.nbytes += leaf.nbytes
        if current.leaves:
            buckets.append(current)
    return buckets


def schedule(
    leaves: list[_Leaf], marks: dict[int, int], bucket_mb: float, overlap: bool
) -> dict[int, list[_Bucket]]:
    """{op index: the buckets to reduce right after it} (-1: before the first op). With overlap,
    a bucket goes after the op that produces its last gradient; without, after the backward pass
    (just before its gradient call's mark)."""
    at: dict[int, list[_Bucket]] = {}
    for b in _buckets(leaves, bucket_mb):
        i = max(x.producer for x in b.leaves) if overlap else marks[b.leaves[0].call] - 1
        at.setdefault(i, []).append(b)
    return at


def _reducible(leaf: _Leaf) -> bool:
    return bool(jnp.issubdtype(leaf.src.aval.dtype, jnp.inexact))


def allreduce_gradients(
    program: Program,
    *,
    group: Any = None,
    bucket_mb: float = 25.0,
    average: bool = True,
    compression: str | None = None,
    overlap: bool = True,
    sync: bool = True,
    pending: bool = False,
) -> Program:
    """The data-parallel pass: insert bucketed allreduces of the marked gradients.

    With ``pending=True`` the program takes one more input per gradient leaf, added to the
    gradient before it is reduced; with ``sync=False`` nothing is communicated and the program
    returns the (accumulated) local gradients as a second output. Gradient marks and parameter
    marks are removed.
    """
    _check_compression(compression)
    comm = _communicator(group, "data_parallel")
    leaves, marks = gradient_leaves(program)
    if not leaves:
        raise SpmdError(NO_GRAD.format(where=f"{this_rank()}: data_parallel", name=program.name))
    at = schedule(leaves, marks, bucket_mb, overlap)
    eqns = program.jaxpr.jaxpr.eqns
    invars = program.jaxpr.jaxpr.invars
    n_in = len(invars)
    local: list[Any] = [None] * len(leaves)

    def reduce(values: list[Any]) -> list[Any]:
        from ..ops import allreduce

        if comm.size == 1:
            return values
        op = "avg" if average else "sum"
        return list(allreduce(values, op, group=comm, compression=compression))

    def flush(env: Env, bucket: _Bucket, extra: Sequence[Any]) -> None:
        values = [env.read(x.src) for x in bucket.leaves]
        if pending:
            values = [
                v + extra[x.k] if _reducible(x) else v  # float0 gradients hold nothing
                for v, x in zip(values, bucket.leaves, strict=True)
            ]
        if sync:
            live = [i for i, x in enumerate(bucket.leaves) if _reducible(x)]
            reduced = reduce([values[i] for i in live])
            for i, r in zip(live, reduced, strict=True):
                values[i] = r
        else:
            for v, x in zip(values, bucket.leaves, strict=True):
                local[x.k] = v
        for v, x in zip(values, bucket.leaves, strict=True):
            env.write(x.dst, v)

    def body(env: Env, xs: Sequence[Any]) -> list[Any]:
        for v, x in zip(invars, xs[:n_in], strict=True):
            env.write(v, x)
        extra = xs[n_in:]
        for b in at.get(-1, []):
            flush(env, b, extra)
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
                flush(env, b, extra)
        outs = [env.read(v) for v in program.jaxpr.jaxpr.outvars]
        return outs if sync else outs + local

    extra_in = [x.src.aval for x in leaves] if pending else []
    jaxpr = retrace(program, body, extra_in)
    if not pending and sync:
        return program.replace(jaxpr)
    proto = jax.tree_util.tree_unflatten(program.in_tree, [0] * program.in_tree.num_leaves)
    out_proto = jax.tree_util.tree_unflatten(program.out_tree, [0] * program.out_tree.num_leaves)
    return Program(
        jaxpr,
        jax.tree_util.tree_structure((proto, [0] * len(extra_in))),
        jax.tree_util.tree_structure((out_proto, [0] * (0 if sync else len(leaves)))),
        name=program.name,
        in_names=[*program.in_names, *(f"pending{x.path}" for x in leaves if pending)],
    )


# -- the step -------------------------------------------------------------------------------------


@dataclass
class _Traced:
    program: Program  # with marks
    param_inputs: list[int]  # flat input indices of the parameters spmd.grad differentiates
    variants: dict[tuple[bool, bool], Callable[..., Any]] = field(default_factory=dict)


class DataParallel:
    """A data-parallel training step (what ``@spmd.data_parallel`` returns)."""

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
    ) -> None:
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise SpmdError(
                f"{this_rank()}: data_parallel: accumulate_steps={accumulate_steps!r}; expected "
                "an int >= 1"
            )
        if bucket_mb < 0:
            raise SpmdError(
                f"{this_rank()}: data_parallel: bucket_mb={bucket_mb!r}; expected a number >= 0"
            )
        _check_compression(compression)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.group = group
        self.options: dict[str, Any] = dict(
            bucket_mb=bucket_mb, average=average, compression=compression, overlap=overlap
        )
        self.accumulate_steps = accumulate_steps
        self.check_params = check_params
        self._cache: dict[Any, _Traced] = {}
        self._checked = False
        # no_sync's local gradient sums, and the traced signature they belong to.
        self._pending: list[Any] | None = None
        self._pending_for: _Traced | None = None

    # Tracing -----------------------------------------------------------------------------------

    def _traced(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
                tree: Any) -> _Traced:  # fmt: skip
        key = (tree, tuple(core.typeof(x) for x in leaves), mesh_key())
        hit = self._cache.get(key)
        if hit is None:
            with marking(self.accumulate_steps):
                program = trace_program(self.fn, args, kwargs)
            index = {v: i for i, v in enumerate(program.jaxpr.jaxpr.invars)}
            params = [
                index[v]
                for e in program.jaxpr.jaxpr.eqns
                if e.primitive is mark_p and e.params["kind"] == "param"
                for v in e.invars
                if v in index
            ]
            hit = self._cache[key] = _Traced(program, sorted(set(params)))
        return hit

    def _transformed(self, traced: _Traced, sync: bool, pending: bool) -> Program:
        return allreduce_gradients(
            traced.program, group=self.group, sync=sync, pending=pending, **self.options
        )

    def __spmd_trace__(self, *args: Any, **kwargs: Any) -> Program:
        """The step's op list with the inserted collectives (what ``spmd.trace`` shows)."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        return self._transformed(self._traced(args, kwargs, leaves, tree), True, False)

    # Calling -----------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        refuse_tracers(leaves, f"data_parallel({getattr(self.fn, '__name__', 'step')})")
        traced = self._traced(args, kwargs, leaves, tree)
        if self.check_params and not self._checked:
            comm = _communicator(self.group, "data_parallel")
            check_replicas(comm, traced.program, traced.param_inputs, leaves, "data_parallel")
            self._checked = True
        sync = not _NO_SYNC.get()
        pending = self._pending is not None
        if pending and self._pending_for is not traced:
            raise SpmdError(
                f"{this_rank()}: data_parallel({traced.program.name}): the gradients accumulated "
                "under spmd.no_sync() belong to a call with other argument shapes or "
                "structure; accumulate micro-batches of one shape"
            )
        run = traced.variants.get((sync, pending))
        if run is None:
            program = self._transformed(traced, sync, pending)
            run = traced.variants[(sync, pending)] = program._compiled
        outs = run(*leaves, *(self._pending or []))
        n = traced.program.out_tree.num_leaves
        self._pending = None if sync else list(outs[n:])
        self._pending_for = None if sync else traced
        return jax.tree_util.tree_unflatten(traced.program.out_tree, outs[:n])


def refuse_tracers(leaves: Sequence[Any], what: str) -> None:
    """A step called under jax.jit/vmap would have its Python state (the replica check, the
    no_sync accumulator) frozen into the trace: refuse instead of desynchronising replicas."""
    if any(isinstance(x, core.Tracer) for x in leaves):
        raise SpmdError(
            f"{this_rank()}: {what}: called inside a JAX transformation (jax.jit, jax.vmap, ...); "
            "the step compiles itself, so call it directly"
        )


def _canonical(x: Any) -> np.ndarray:
    """The bytes the replica check compares: -0.0 counts as 0.0 (equal values, other bits)."""
    a = np.ascontiguousarray(x)
    if np.issubdtype(a.dtype, np.inexact) or a.dtype.name == "bfloat16":
        a = np.where(a == 0, np.zeros((), a.dtype), a)
    return a


def check_replicas(
    comm: Communicator, program: Program, param_inputs: list[int], leaves: list[Any], where: str
) -> None:
    """Raise on every rank if the parameters (flat inputs ``param_inputs``) differ between the
    ranks of ``comm``, naming the ranks and the first parameter that differs (CRC32 checksums)."""
    names = program.in_names
    check_same(comm, [(names[i], leaves[i]) for i in param_inputs], f"{where}({program.name})")


def check_same(comm: Communicator, named: list[tuple[str, Any]], where: str) -> None:
    """Raise on every rank if the arrays of ``named`` ((name, array) pairs) differ between the
    ranks of ``comm``, naming the ranks and the first array that differs."""
    if comm.size == 1 or not named:
        return
    sums = [zlib.crc32(_canonical(a).tobytes()) for _, a in named]
    everyone = comm.allgather_object(sums)
    differ = [r for r, s in enumerate(everyone) if s != everyone[0]]
    if not differ:
        return
    first = differ[0]
    if len(everyone[first]) != len(sums) or len(everyone[0]) != len(sums):
        counts = {comm.ranks[r]: len(s) for r, s in enumerate(everyone)}
        detail = (
            f"the ranks hold different numbers of parameter arrays (rank: count {counts}); "
            "every rank must pass the same parameter structure"
        )
    else:
        bad = [name for (name, _), a, b in zip(named, everyone[0], everyone[first], strict=True)
               if a != b]  # fmt: skip
        ranks = [comm.ranks[r] for r in differ]
        detail = (
            f"ranks {ranks} hold other values than rank {comm.ranks[0]} "
            f"(first difference: {bad[0]}; {len(bad)} of {len(sums)} parameter arrays differ "
            f"on rank {comm.ranks[first]})"
        )
    raise SpmdError(PARAMS_DIFFER.format(where=f"rank {comm.world_rank}: {where}", detail=detail))
