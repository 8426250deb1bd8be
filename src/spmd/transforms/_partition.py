"""The ZeRO pass: a step's op list run on row shards of its state (see :mod:`._zero`).

The step is traced with the global shapes; :func:`shard_state` then re-evaluates its ops with
each value either full (replicated) or sharded (this rank's rows), and:

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
  parameter all-gathered before it; calls (jit, remat, custom_jvp/vjp) are inlined, while loops
  and branches (scan, while, cond) are such ops: a scan over layer-stacked parameters reads them
  gathered. A gathered copy stays for the other ops of the same pass (forward or backward) that
  read it and is dropped after the last, so a weight is gathered once for the forward pass and
  once for the backward pass. Each gather is one call of its own on the collectives' chain,
  which orders the collectives only: XLA:CPU, which runs ops as their operands arrive, starts
  the gather of the next weight while the ops before its use still compute;
- any other op that reads sharded optimizer state or gradients cannot be partitioned: the pass
  raises an error that names the op (e.g. a reshape inside the optimizer);
- outputs: sharded values come back sharded, except, at stages 1 and 2, the updated
  parameters (sharded outputs computed from the parameters after the gradient, other than the
  optimizer state), which are all-gathered in one fused call so every rank holds them in full
  again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import SpmdError
from .._jax_compat import ClosedJaxpr, core, is_closed_jaxpr
from ..mesh import resolve_group
from ..runtime import Communicator
from ..sharded import pad_dim, slice_dim
from ._grad import mark_p
from ._passes import NO_GRAD, Pass, block_groups, gradient_leaves, place_buckets, reduce_blocks
from ._program import Program, eval_eqn, retrace

__all__ = ["shard_state"]

CANNOT_PARTITION = (
    "op {op} (in {fn}) reads {what} {path}, which stage {stage} keeps sharded, and "
    "spmd cannot run {op} on shards: only elementwise ops and reductions are partitioned. "
    "Use an optimizer whose update is elementwise per array (sgd, adam, adamw, lion, clipping "
    "by global norm...), or data_parallel, or compute this outside the step."
)


# -- the pass ---------------------------------------------------------------------------------

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
    # Stage 3: full copies of parameters gathered for an op that later ops of the same pass read
    # too, and the step's top-level ops with the position being evaluated.
    fetched: dict[Any, Any] = field(default_factory=dict)
    top: Sequence[Any] = ()
    position: int = -1
    backward: list[bool] = field(default_factory=list)  # per top-level op: in the backward pass
    uses: dict[Any, list[int]] = field(default_factory=dict)  # var -> top-level ops reading it

    def plan(self, eqns: Sequence[Any]) -> None:
        """Note the step's top-level ops: which belong to the backward pass (JAX names them
        ``transpose(...)``) and which read each value."""
        self.top = eqns
        self.backward = ["transpose" in str(e.source_info.name_stack) for e in eqns]
        for i, e in enumerate(eqns):
            for v in e.invars:
                if not isinstance(v, core.Literal):
                    self.uses.setdefault(v, []).append(i)

    def _used_again(self, v: Any) -> bool:
        """Whether a later op of the same pass (forward or backward) reads v."""
        here = self.position
        if here < 0:
            return False
        return any(
            j > here and self.backward[j] == self.backward[here] for j in self.uses.get(v, ())
        )

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
            if eqns is self.top:
                self.position = i
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
            if a in self.fetched:  # gathered already in this pass: the call's ops read it
                self.fetched[v] = self.fetched.pop(a)
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
                        op=eqn.primitive.name,
                        fn=self.name,
                        what=what,
                        path=self.names.get(v, ""),
                        stage=self.stage,
                    ),
                    op=f"zero_shard(stage={self.stage})",
                )
        # All-gather the sharded operands not gathered already in this pass (one fused call).
        unique = list(dict.fromkeys(sharded))
        full = {v: self.fetched.pop(v) for v in unique if v in self.fetched}
        need = [v for v in unique if v not in full]
        got = self.rows.gather([self.values[v] for v in need], [self.sharded[v] for v in need])
        full.update(zip(need, got, strict=True))
        for v in unique:  # kept for the next op of this pass that reads it
            if self._used_again(v):
                self.fetched[v] = full[v]
        outs = eval_eqn(
            eqn, [self.read(v) if isinstance(v, core.Literal) else full.get(v, self.read(v))
                  for v in eqn.invars]
        )  # fmt: skip
        for o, val in zip(eqn.outvars, outs, strict=True):
            self.write(o, val)


def shard_state(
    *,
    stage: int,
    group: Any = None,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    state_outputs: frozenset[int] = frozenset(),
) -> Pass:
    """The ZeRO pass: a program traced with global shapes, run on row shards.

    The inputs whose ``program.in_sharding`` holds a global shape arrive as this rank's rows;
    the result takes the same inputs (shards where sharded) and its ``out_sharding`` gives, per
    output, its global shape if it is returned sharded (None if full). Options as
    :func:`spmd.zero_shard`'s.

    At stages 1 and 2 a sharded output computed from the parameters is taken for an updated
    parameter and all-gathered, unless its flat position is in ``state_outputs`` (optimizer
    state, which the step finds from its pytrees). Weight decay makes the optimizer state
    depend on the parameters too.

    Example (``spmd.zero_shard`` is a Step running this pass; on its own, a world of one)::

        >>> import jax.numpy as jnp, spmd
        >>> program = spmd.trace(spmd.grad(lambda w: jnp.sum(w**2)))(jnp.ones(2))
        >>> spmd.transforms.shard_state(stage=1)(program)(jnp.ones(2))
        Array([2., 2.], dtype=float32)
    """

    def apply(program: Program) -> Program:
        return _partition(program, stage, group, bucket_mb, overlap, state_outputs)

    return apply


def _partition(
    program: Program,
    stage: int,
    group: Any,
    bucket_mb: float,
    overlap: bool,
    state_outputs: frozenset[int],
) -> Program:
    sharded_inputs = {i: s for i, s in enumerate(program.in_sharding) if s is not None}
    comm = resolve_group(None, group, op="zero_shard")
    rows = _Rows(comm)
    leaves, marks = gradient_leaves(program)
    if not leaves:
        raise SpmdError(NO_GRAD.format(name=program.name), op="zero_shard")
    at = place_buckets(leaves, marks, bucket_mb, overlap)
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
        # Blocks of a model-parallel layer split over ranks of the group (experts): reduced as
        # data_parallel reduces them, and kept whole.
        blocks: dict[Any, list[Any]] = {}
        for x in live:
            sub = block_groups(comm.groups, x.shards)
            if sub is not None:
                blocks.setdefault(sub, []).append(x)
        for sub, members in blocks.items():
            values = reduce_blocks([p.full(x.src) for x in members], sub, comm.size)
            for x, val in zip(members, values, strict=True):
                p.write(x.dst, val)
        done = {id(x) for members in blocks.values() for x in members}
        live = [x for x in live if id(x) not in done]
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
        p.plan(eqns)
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
    return program.replace(new, out_sharding=out_layout)
