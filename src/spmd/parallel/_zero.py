"""``@spmd.zero_shard(stage=1|2|3)``: ZeRO on top of data parallelism, as a pass over the op list.

The step is the same one ``@spmd.data_parallel`` takes (``spmd.value_and_grad``, an optax update,
apply the updates). ``step.shard(params, opt_state)`` turns replicated state into what the stage
keeps per rank: every optimizer-state array (and at stage 3 every parameter array) becomes a
:class:`~spmd.ShardedArray` split along axis 0 over the data-parallel group (1/N of the rows per
rank, the last shards zero-padded); scalars stay replicated.

The step is traced with the global shapes; the pass :func:`partition` then re-evaluates its ops
with each value either full (replicated) or sharded (this rank's rows), and:

- elementwise ops on sharded values run on the shards; a full operand of the same shape is sliced
  locally (no communication) when it is the same on every rank, a scalar is used as is; a full
  operand computed from this rank's batch (which differs between ranks) makes the op run on
  full values, its sharded operands all-gathered;
- a reduction over axis 0 of a sharded value becomes a partial reduction of the shard (padding
  masked with the reduction's identity) plus an allreduce: a global norm is partitioned this way;
  reductions over other axes stay local;
- gradients (the values ``spmd.grad`` marks) are averaged in buckets placed as data_parallel
  places them: stage 1 by allreduce (each rank then uses its slice), stages 2 and 3 by
  reduce_scatter, so each rank only ever holds its rows of the averaged gradient;
- any other op that reads a sharded parameter (stage 3: a matmul in forward or backward) gets the
  parameter all-gathered just before it, at each use, so the full copy lives only in between;
  calls (jit, remat, custom_jvp/vjp) are inlined, while loops and branches (scan, while, cond)
  are such ops: a scan over layer-stacked parameters reads them gathered;
- any other op that reads sharded optimizer state or gradients cannot be partitioned: the pass
  raises an error that names the op (e.g. a reshape inside the optimizer);
- outputs: sharded values come back as ShardedArrays, except, at stages 1 and 2, the updated
  parameters (sharded outputs computed from the parameters after the gradient, other than the
  optimizer state found by :func:`_state_outputs`), which are all-gathered in one fused call
  so every rank holds them in full again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from .._errors import SpmdError
from ..mesh import mesh_key
from ..ops._core import ClosedJaxpr, is_closed_jaxpr
from ..runtime import Communicator, this_rank
from ..sharded import ShardedArray, _normalize, _spec, is_sharded, pad_dim, shard, slice_dim
from ._data_parallel import (
    _NO_SYNC,
    _communicator,
    check_replicas,
    check_same,
    gradient_leaves,
    refuse_tracers,
    schedule,
)
from ._grad import mark_p, marking
from ._program import Program, _arg_names, _path, eval_eqn, retrace, trace_program

__all__ = ["ZeroShard", "partition", "zero_shard"]


# -- API ------------------------------------------------------------------------------------------


def zero_shard(
    fn: Callable[..., Any] | None = None,
    *,
    stage: int = 1,
    group: Any = None,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    accumulate_steps: int = 1,
    check_params: bool = True,
) -> Any:
    """ZeRO data parallelism for a training step; bare (``@zero_shard``) or with options.

    Use it in place of ``@spmd.data_parallel`` on the same step, and shard the state once::

        step = spmd.zero_shard(train_step, stage=2)
        params, opt_state = step.shard(params, opt_state)
        params, opt_state, loss = step(params, opt_state, batch)

    Args:
        fn: the step; it computes its gradients with ``spmd.(value_and_)grad``.
        stage: 1 shards the optimizer state; 2 also the gradients (reduce_scatter instead of
            allreduce); 3 also the parameters (all-gathered just in time for each use).
        group: the data-parallel group (None: the default communicator; a Communicator; or an
            axis name of the mesh active at call time).
        bucket_mb, overlap, accumulate_steps, check_params: as for ``data_parallel``.
    """
    options: dict[str, Any] = dict(
        stage=stage,
        group=group,
        bucket_mb=bucket_mb,
        overlap=overlap,
        accumulate_steps=accumulate_steps,
        check_params=check_params,
    )
    if fn is None:
        return functools.partial(ZeroShard, **options)
    return ZeroShard(fn, **options)


# -- errors ---------------------------------------------------------------------------------------

CANNOT_PARTITION = (
    "{where}: op {op} (in {fn}) reads {what} {path}, which stage {stage} keeps sharded, and "
    "spmd cannot run {op} on shards: only elementwise ops and reductions are partitioned. "
    "Use an optimizer whose update is elementwise per array (sgd, adam, adamw, lion, clipping "
    "by global norm...), or data_parallel, or compute this outside the step."
)

BAD_INPUT = (
    "{where}: argument {path} is a ShardedArray with spec {spec} over {mesh}; zero_shard expects "
    "its sharded state split along axis 0 over its group {ranks}, as step.shard(params, "
    "opt_state) makes it"
)


# -- the pass -------------------------------------------------------------------------------------

# Ops that act on each element independently (operands of one shape, or scalars).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div",
    "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh",
    "xor",
})  # fmt: skip
_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod"}
_INNER_JAXPR = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Ops that call their inner jaxpr once on their operands, so the pass can run it inline. Loops
# and branches (scan, while, cond) are not among them: they run on full values (see _gathered).
_CALLS = frozenset({
    "pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin",
})  # fmt: skip


def _identity(op: str, dtype: Any) -> Any:
    """The value that does not change a reduction: what the padding rows are masked with."""
    if op in ("sum", "prod"):
        return 0 if op == "sum" else 1
    floating = jnp.issubdtype(dtype, jnp.inexact)
    lowest = -np.inf if floating else jnp.iinfo(dtype).min
    highest = np.inf if floating else jnp.iinfo(dtype).max
    return lowest if op == "max" else highest


@dataclass
class _Rows:
    """How a group splits axis 0: shards of ``chunk(g)`` rows; ours starts at ``index * chunk``."""

    comm: Communicator

    def chunk(self, rows: int) -> int:
        return -(-rows // self.comm.size)

    def valid(self, rows: int) -> int:
        c = self.chunk(rows)
        return max(0, min(c, rows - self.comm.rank * c))

    def local(self, x: Any) -> Any:
        """This rank's rows of a full value, zero-padded to the chunk."""
        return slice_dim(x, 0, self.comm.rank, self.chunk(x.shape[0]))

    def mask(self, x: Any, shape: tuple[int, ...], fill: Any) -> Any:
        v = self.valid(shape[0])
        if v == x.shape[0]:
            return x
        rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        return jnp.where(rows < v, x, jnp.asarray(fill, x.dtype))

    def gather(self, xs: list[Any], shapes: list[tuple[int, ...]]) -> list[Any]:
        from ..ops import allgather

        if not xs:
            return []
        full = allgather(xs, axis=0, group=self.comm) if self.comm.size > 1 else xs
        return [lax.slice_in_dim(f, 0, s[0], axis=0) for f, s in zip(full, shapes, strict=True)]


@dataclass
class _Partitioner:
    """Re-evaluates a program's ops with each value full or sharded by rows (see module doc)."""

    rows: _Rows
    stage: int
    name: str
    names: dict[Any, str]  # var -> the input (or gradient) a sharded value comes from, for errors
    values: dict[Any, Any] = field(default_factory=dict)
    sharded: dict[Any, tuple[int, ...]] = field(default_factory=dict)  # var -> global shape
    params: set[Any] = field(default_factory=set)  # sharded vars that are parameters (stage 3)
    after_grad: set[Any] = field(default_factory=set)  # vars computed from the gradients...
    param_dep: set[Any] = field(default_factory=set)  # ...and from the parameters
    # Full values that may differ between ranks: computed from this rank's batch (any input
    # of rank >= 1 that is neither a parameter nor sharded state; scalar inputs, such as the
    # optimizer's step count, are taken to be the same on every rank). Never sliced to this
    # rank's rows.
    local: set[Any] = field(default_factory=set)

    # -- values --

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else self.values[v]

    def write(self, v: Any, value: Any, shape: tuple[int, ...] | None = None) -> None:
        if isinstance(v, core.DropVar):
            return
        self.values[v] = value
        if shape is None:
            self.sharded.pop(v, None)
        else:
            self.sharded[v] = shape

    def layout(self, v: Any) -> tuple[int, ...] | None:
        """The global shape of v if it is sharded, else None."""
        return None if isinstance(v, core.Literal) else self.sharded.get(v)

    def full(self, v: Any) -> Any:
        """The full value of v (all-gathered if sharded)."""
        if self.layout(v) is None:
            return self.read(v)
        return self.rows.gather([self.values[v]], [self.sharded[v]])[0]

    # -- ops --

    def run(self, eqns: Sequence[Any], after: Callable[[int], None] | None = None) -> None:
        for i, eqn in enumerate(eqns):
            self.eqn(eqn)
            if after is not None:
                after(i)

    def eqn(self, eqn: Any) -> None:
        ins = [v for v in eqn.invars if not isinstance(v, core.Literal)]
        self._provenance(eqn, ins)
        sharded = [v for v in ins if v in self.sharded]
        name = eqn.primitive.name
        if eqn.primitive is mark_p and eqn.params["kind"] == "grad":
            return  # the gradient buckets wrote the reduced gradients already
        if eqn.primitive is mark_p:
            for a, o in zip(eqn.invars, eqn.outvars, strict=True):
                self.write(o, self.read(a), self.layout(a))
                self.names.setdefault(o, self.names.get(a, ""))
                if a in self.params:
                    self.params.add(o)
        elif not sharded:
            outs = eval_eqn(eqn, [self.read(v) for v in eqn.invars])
            for o, val in zip(eqn.outvars, outs, strict=True):
                self.write(o, val)
        elif name in _ELEMENTWISE and not any(v in self.local and v.aval.shape != () for v in ins):
            self._elementwise(eqn, sharded)
        elif name in _ELEMENTWISE:  # with this rank's own full values: on full values
            self._gathered(eqn, sharded, check=False)
        elif name in _REDUCTIONS and 0 in eqn.params["axes"]:
            self._reduce(eqn, _REDUCTIONS[name])
        elif name in _REDUCTIONS:
            out = eval_eqn(eqn, [self.read(eqn.invars[0])])[0]
            self.write(eqn.outvars[0], out, tuple(eqn.outvars[0].aval.shape))
        elif name in _CALLS and any(k in eqn.params for k in _INNER_JAXPR):
            self._inline(eqn)
        else:
            self._gathered(eqn, sharded)

    def _provenance(self, eqn: Any, ins: list[Any]) -> None:
        grad_mark = eqn.primitive is mark_p and eqn.params["kind"] == "grad"
        for o in eqn.outvars:
            if grad_mark or any(v in self.after_grad for v in ins):
                self.after_grad.add(o)
            if not grad_mark and any(v in self.param_dep for v in ins):
                self.param_dep.add(o)
            if not grad_mark and any(v in self.local for v in ins):
                self.local.add(o)

    def _elementwise(self, eqn: Any, sharded: list[Any]) -> None:
        shape = tuple(eqn.outvars[0].aval.shape)
        args = []
        for v in eqn.invars:
            if self.layout(v) is not None or v.aval.shape == ():
                args.append(self.read(v))
            else:  # a full operand of the same shape: this rank's rows of it
                args.append(self.rows.local(self.read(v)))
        outs = eval_eqn(eqn, args)
        is_param = all(v in self.params for v in sharded)
        for o, val in zip(eqn.outvars, outs, strict=True):
            self.write(o, val, shape)
            self.names.setdefault(o, self.names.get(sharded[0], ""))
            if is_param:
                self.params.add(o)

    def _reduce(self, eqn: Any, op: str) -> None:
        from ..ops import allreduce

        x = eqn.invars[0]
        masked = self.rows.mask(self.read(x), self.sharded[x], _identity(op, x.aval.dtype))
        partial = eval_eqn(eqn, [masked])[0]
        total = allreduce(partial, op, group=self.rows.comm) if self.rows.comm.size > 1 else partial
        self.write(eqn.outvars[0], total)

    def _inline(self, eqn: Any) -> None:
        inner = next(eqn.params[k] for k in _INNER_JAXPR if k in eqn.params)
        closed = inner if is_closed_jaxpr(inner) else ClosedJaxpr(inner, ())
        jaxpr = closed.jaxpr
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            self.write(v, c)
        for v, a in zip(jaxpr.invars, eqn.invars, strict=True):
            self.write(v, self.read(a), self.layout(a))
            if isinstance(a, core.Literal):  # a constant operand: unhashable, never tagged
                continue
            self.names[v] = self.names.get(a, "")
            for tags in (self.params, self.after_grad, self.param_dep, self.local):
                if a in tags:
                    tags.add(v)
        self.run(jaxpr.eqns)
        for o, v in zip(eqn.outvars, jaxpr.outvars, strict=True):
            if isinstance(v, core.Literal):
                self.write(o, v.val)
                continue
            self.write(o, self.values[v], self.sharded.get(v))
            self.names.setdefault(o, self.names.get(v, ""))
            for tags in (self.params, self.after_grad, self.param_dep, self.local):
                if v in tags:
                    tags.add(o)

    def _gathered(self, eqn: Any, sharded: list[Any], check: bool = True) -> None:
        """``eqn`` on full values: the sharded operands all-gathered just before it (stage 3's
        parameters; with ``check=False`` any sharded operand)."""
        for v in sharded:
            if check and v not in self.params:
                what = "the gradient or optimizer state" if v in self.after_grad else "the value"
                raise SpmdError(
                    CANNOT_PARTITION.format(
                        where=f"{this_rank()}: zero_shard(stage={self.stage})",
                        op=eqn.primitive.name,
                        fn=self.name,
                        what=what,
                        path=self.names.get(v, ""),
                        stage=self.stage,
                    )
                )
        # All-gather the sharded operands, just before the op (one fused call).
        unique = list(dict.fromkeys(sharded))
        full = dict(
            zip(unique, self.rows.gather([self.values[v] for v in unique],
                                         [self.sharded[v] for v in unique]), strict=True)
        )  # fmt: skip
        outs = eval_eqn(
            eqn, [self.read(v) if isinstance(v, core.Literal) else full.get(v, self.read(v))
                  for v in eqn.invars]
        )  # fmt: skip
        for o, val in zip(eqn.outvars, outs, strict=True):
            self.write(o, val)


def partition(
    program: Program,
    sharded_inputs: dict[int, tuple[int, ...]],
    *,
    stage: int,
    group: Any = None,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    state_outputs: frozenset[int] = frozenset(),
) -> tuple[Program, list[tuple[int, ...] | None]]:
    """The ZeRO pass: ``program`` (traced with global shapes) run on row shards.

    ``sharded_inputs`` maps flat input positions to their global shapes: those inputs arrive as
    this rank's rows. Returns the new program (same inputs, shards where sharded) and, per output,
    its global shape if it is returned sharded (None if full).

    At stages 1 and 2 a sharded output computed from the parameters is taken for an updated
    parameter and all-gathered, unless its flat position is in ``state_outputs`` (optimizer
    state, known from the step's pytrees: see :func:`_state_outputs`). Weight decay makes the
    optimizer state depend on the parameters too.
    """
    comm = _communicator(group, "zero_shard")
    rows = _Rows(comm)
    leaves, marks = gradient_leaves(program)
    if not leaves:
        from ._data_parallel import NO_GRAD

        raise SpmdError(NO_GRAD.format(where=f"{this_rank()}: zero_shard", name=program.name))
    at = schedule(leaves, marks, bucket_mb, overlap)
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    param_vars = {
        v for e in eqns if e.primitive is mark_p and e.params["kind"] == "param" for v in e.invars
    }
    local_avals = [
        core.ShapedArray((rows.chunk(sharded_inputs[i][0]), *v.aval.shape[1:]), v.aval.dtype)
        if i in sharded_inputs else v.aval
        for i, v in enumerate(jaxpr.invars)
    ]  # fmt: skip
    out_layout: list[tuple[int, ...] | None] = []

    def reduce(p: _Partitioner, bucket: Any) -> None:
        from ..ops import allreduce, reduce_scatter

        # Gradients come out of the backward pass full (stage 3 gathers the parameters it
        # needs); integer "gradients" (float0 stand-ins) are not reduced.
        live = [x for x in bucket.leaves if jnp.issubdtype(x.src.aval.dtype, jnp.inexact)]
        for x in bucket.leaves:
            p.names[x.dst] = "grads" + x.path
            if x not in live:
                p.write(x.dst, p.full(x.src))
        if stage == 1 or comm.size == 1:
            split: list[Any] = []
            whole = live
        else:
            split = [x for x in live if x.src.aval.ndim >= 1]
            whole = [x for x in live if x.src.aval.ndim == 0]
        if whole:
            out = [p.full(x.src) for x in whole]
            if comm.size > 1:
                out = list(allreduce(out, "avg", group=comm))
            for x, val in zip(whole, out, strict=True):
                p.write(x.dst, val)
        if split:
            shapes = [tuple(x.src.aval.shape) for x in split]
            padded = [
                pad_dim(p.full(x.src), 0, rows.chunk(s[0]) * comm.size)
                for x, s in zip(split, shapes, strict=True)
            ]
            for x, val, s in zip(split, reduce_scatter(padded, "avg", group=comm), shapes,
                                 strict=True):  # fmt: skip
                p.write(x.dst, val, s)

    def body(env: Any, xs: Sequence[Any]) -> list[Any]:
        names = dict(zip(jaxpr.invars, program.in_names, strict=True))
        p = _Partitioner(rows, stage, program.name, names)
        for v, c in zip(jaxpr.constvars, program.jaxpr.consts, strict=True):
            p.write(v, c)
        for i, (v, x) in enumerate(zip(jaxpr.invars, xs, strict=True)):
            p.write(v, x, sharded_inputs.get(i))
            if v in param_vars:
                p.param_dep.add(v)
                if i in sharded_inputs:
                    p.params.add(v)
            elif i not in sharded_inputs and v.aval.ndim >= 1:
                p.local.add(v)  # the batch; scalars (a step count) count as replicated

        for b in at.get(-1, []):
            reduce(p, b)

        def after(i: int) -> None:
            for b in at.get(i, []):
                reduce(p, b)

        p.run(eqns, after)
        outs: list[Any] = []
        gather: list[int] = []
        out_layout.clear()
        for k, v in enumerate(jaxpr.outvars):
            outs.append(p.read(v))
            shape = p.sharded.get(v) if not isinstance(v, core.Literal) else None
            if shape is not None and stage < 3 and v in p.param_dep and k not in state_outputs:
                gather.append(k)  # updated parameters: replicated again at stages 1 and 2
                shape = None
            out_layout.append(shape)
        full = rows.gather([outs[k] for k in gather], [p.sharded[jaxpr.outvars[k]] for k in gather])
        for k, val in zip(gather, full, strict=True):
            outs[k] = val
        return outs

    new = retrace(program, body, in_avals=local_avals)
    return program.replace(new), list(out_layout)


# -- the step -------------------------------------------------------------------------------------


@dataclass
class _Traced:
    program: Program
    run: Callable[..., Any]
    outputs: list[Any]  # per output: None (full) or (global shape, spec, mesh) of a ShardedArray
    param_inputs: list[int]  # flat positions of replicated parameters (for the first-call check)
    transformed: Program


class ZeroShard:
    """A ZeRO training step (what ``@spmd.zero_shard`` returns)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        stage: int,
        group: Any,
        bucket_mb: float,
        overlap: bool,
        accumulate_steps: int,
        check_params: bool,
    ) -> None:
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise SpmdError(f"{this_rank()}: zero_shard: stage={stage!r}; expected 1, 2 or 3")
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise SpmdError(
                f"{this_rank()}: zero_shard: accumulate_steps={accumulate_steps!r}; expected an "
                "int >= 1"
            )
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.stage = stage
        self.group = group
        self.bucket_mb = bucket_mb
        self.overlap = overlap
        self.accumulate_steps = accumulate_steps
        self.check_params = check_params
        self._cache: dict[Any, _Traced] = {}
        self._checked = False

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__name__", "step")

    # Sharding the state ------------------------------------------------------------------------

    def _where(self) -> tuple[Communicator, Any, str]:
        """The group, what ShardedArrays record as their mesh, and the axis name in their spec."""
        from ..mesh import current_mesh

        comm = _communicator(self.group, "zero_shard")
        if isinstance(self.group, str) and current_mesh() is not None:
            return comm, current_mesh(), self.group
        return comm, comm, "dp"

    def shard(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` as this stage keeps them: every array of rank >= 1 of the
        optimizer state (and at stage 3 of the parameters) becomes a ShardedArray of this rank's
        rows; scalars and, at stages 1 and 2, the parameters stay replicated. At stage 3 (with
        ``check_params``) the full parameters are first compared between the ranks, as the
        step's first call does at stages 1 and 2: a collective, call it on every rank."""
        comm, where, axis = self._where()
        place = {"group": where} if isinstance(where, Communicator) else {"mesh": where}

        def one(x: Any) -> Any:
            if is_sharded(x):
                return x
            x = jnp.asarray(x)
            return x if x.ndim == 0 else shard(x, _spec(axis), **place)

        sharded_state = jax.tree_util.tree_map(one, opt_state, is_leaf=is_sharded)
        if self.stage == 3:
            if self.check_params:  # the step's own check sees only shards from here on
                flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded)[0]
                named = [("params" + _path(k), x) for k, x in flat if not is_sharded(x)]
                check_same(comm, named, f"zero_shard({self._name}).shard")
            params = jax.tree_util.tree_map(one, params, is_leaf=is_sharded)
        return params, sharded_state

    # Tracing -----------------------------------------------------------------------------------

    def _traced(self, args: Any, kwargs: Any) -> tuple[_Traced, list[Any]]:
        # A ShardedArray flattens to its shard, and its global shape, spec and mesh are part of
        # the structure: the cache key tells apart arrays whose shards look alike.
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        key = (tree, tuple(core.typeof(x) for x in leaves), mesh_key())
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._trace(args, kwargs)
        return hit, leaves

    def _trace(self, args: Any, kwargs: Any) -> _Traced:
        """Check the sharded inputs, trace the step with their global shapes, run the pass."""
        comm, where, axis = self._where()
        objs, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_sharded)
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) if is_sharded(x) else x for x in objs]
        a, kw = jax.tree_util.tree_unflatten(tree, abstract)
        sharded: dict[int, Any] = {}
        for i, x in enumerate(objs):
            if not is_sharded(x):
                continue
            dims = x.dims
            if not (
                dims[0].split and not any(d.split for d in dims[1:]) and _ranks(x) == comm.ranks
            ):
                raise SpmdError(
                    BAD_INPUT.format(
                        where=f"{this_rank()}: zero_shard({self._name})",
                        path=_arg_names(self.fn, a, kw)[i],
                        spec=x.spec,
                        mesh=x.mesh,
                        ranks=list(comm.ranks),
                    )
                )
            sharded[i] = x.shape
        with marking(self.accumulate_steps):
            program = trace_program(self.fn, a, kw)
        new, layout = partition(
            program,
            sharded,
            stage=self.stage,
            group=self.group,
            bucket_mb=self.bucket_mb,
            overlap=self.overlap,
            state_outputs=_state_outputs(args, kwargs, program.out_tree),
        )
        index = {v: i for i, v in enumerate(program.jaxpr.jaxpr.invars)}
        params = sorted(
            {index[v] for e in program.jaxpr.jaxpr.eqns
             if e.primitive is mark_p and e.params["kind"] == "param"
             for v in e.invars if v in index and index[v] not in sharded}
        )  # fmt: skip
        # Placements checked once here; each call wraps its outputs without checks.
        outputs = [
            None if s is None else (s, _normalize(_spec(axis), len(s), where), where)
            for s in layout
        ]
        return _Traced(program, new._compiled, outputs, params, new)

    def __spmd_trace__(self, *args: Any, **kwargs: Any) -> Program:
        """The step's op list after the ZeRO pass (what ``spmd.trace`` shows)."""
        return self._traced(args, kwargs)[0].transformed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _NO_SYNC.get():
            # The sharded step always communicates: inside no_sync its gradients would be
            # synchronized anyway and the local accumulation silently lost.
            raise SpmdError(
                f"{this_rank()}: zero_shard({self._name}) was called inside spmd.no_sync(), "
                "which it does not support; accumulate with zero_shard(accumulate_steps=k) "
                "instead, or use data_parallel"
            )
        refuse_tracers(jax.tree_util.tree_leaves((args, kwargs)), f"zero_shard({self._name})")
        traced, leaves = self._traced(args, kwargs)
        if self.check_params and not self._checked:
            comm = _communicator(self.group, "zero_shard")
            check_replicas(comm, traced.program, traced.param_inputs, leaves, "zero_shard")
            self._checked = True
        outs = traced.run(*leaves)
        wrapped = [
            val if placed is None else ShardedArray._placed(val, *placed)
            for val, placed in zip(outs, traced.outputs, strict=True)
        ]
        return jax.tree_util.tree_unflatten(traced.program.out_tree, wrapped)


def _state_outputs(args: Sequence[Any], kwargs: dict[str, Any], out_tree: Any) -> frozenset[int]:
    """Flat positions of the outputs that are optimizer state, from the pytrees.

    An output part with the structure of some of the step's arguments (positional or keyword)
    holds their leaves in order; a leaf that is sharded in every one of those arguments is
    state, to be returned sharded even if computed from the parameters (``lars``, or
    ``add_decayed_weights`` before ``adam``). Parts are tried from the whole output down
    through tuples, lists and dicts, and the first part that marks a leaf ends the descent
    there. A leaf that a parameter argument of the same structure holds unsharded is never
    marked: an updated parameter returned sharded would break every use of it outside the
    step, while optimizer state returned full only costs memory.
    """
    ins: list[tuple[Any, list[bool]]] = []
    for arg in (*args, *kwargs.values()):
        leaves, tree = jax.tree_util.tree_flatten(arg, is_leaf=is_sharded)
        ins.append((tree, [is_sharded(x) for x in leaves]))
    out = jax.tree_util.tree_unflatten(out_tree, range(out_tree.num_leaves))
    state: set[int] = set()

    def mark(part: Any) -> bool:
        positions, tree = jax.tree_util.tree_flatten(part)
        same = [flags for t, flags in ins if t == tree]
        found = {i for k, i in enumerate(positions) if same and all(f[k] for f in same)}
        state.update(found)
        return bool(found)

    def descend(part: Any) -> None:
        if mark(part):
            return
        if isinstance(part, tuple | list):
            for element in part:
                descend(element)
        elif isinstance(part, dict):
            for element in part.values():
                descend(element)

    descend(out)
    return frozenset(state)


def _ranks(x: ShardedArray) -> tuple[int, ...]:
    where = x.mesh
    if isinstance(where, Communicator):
        return tuple(where.ranks)
    axes = x.dims[0].axes
    return tuple(where.group(axes).ranks)
