"""What every collective shares: the primitive factory, the FFI lowering with its ordering
chain, eager calls and their errors, dtype checks and pytree handling. Written once here; each
op module holds only what is particular to its family.

Ordering. Collectives must run in the same order on every rank, and XLA:CPU runs independent
custom calls as a dataflow graph (possibly concurrently, possibly reordered). JAX effects would
order them but take jit off its fast dispatch path (~115-187 us per call). Instead every
collective's custom call takes one extra operand, the previous collective's extra one-byte
result in the same computation, and returns its own: a data dependency, so XLA runs the
collectives of a computation in program order at no cost. Separate executions on one CPU device
already run in dispatch order. Custom calls are marked ``has_side_effect`` in HLO so XLA never
removes or merges them; every collective carries a DCE rule that keeps it in the jaxpr, and so
does every call, loop or branch holding one. A nested ``jax.jit`` holding collectives is lowered
inline so that they join the caller's chain; loops and branches carry the order value through
their bodies (``_thread_loops_and_branches``).
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from .._errors import SpmdError, SpmdTypeError
from .._groups import GroupRef

SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in ("float16", jnp.bfloat16, "float32", "float64", "int8", "uint8", "int32", "int64",
              "bool")
)  # fmt: skip
REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
REDUCE_NAMES = (*REDUCE_OPS, "avg")
# JAX 0.12 merged ClosedJaxpr into Jaxpr (a jaxpr carries its consts; ``.jaxpr`` is itself, and
# ``Jaxpr(jaxpr, consts)`` still builds a closed one); earlier versions have both classes.
_CLOSED_JAXPR: Any = getattr(core, "ClosedJaxpr", core.Jaxpr)
if TYPE_CHECKING:
    ClosedJaxpr: TypeAlias = Any
else:
    ClosedJaxpr = _CLOSED_JAXPR


def is_closed_jaxpr(x: Any) -> TypeGuard[ClosedJaxpr]:
    """Whether ``x`` is a closed jaxpr (from JAX 0.12 every jaxpr is: open ones have no consts)."""
    return isinstance(x, _CLOSED_JAXPR)


_MARKER = "spmd.SpmdError: "


def _supported_names() -> str:
    return ", ".join(str(d) for d in SUPPORTED_DTYPES)


# -- primitives ---------------------------------------------------------------------------------


def _keep(used_outputs: list[bool], *live_ins_and_eqn: Any) -> tuple[list[bool], Any]:
    """DCE rule of primitives whose only purpose is their side effect: never removed.

    JAX calls DCE rules as ``rule(used_outputs, eqn)``, from 0.12 as ``rule(used_outputs,
    live_ins, eqn)``; the equation comes last either way."""
    eqn = live_ins_and_eqn[-1]
    return [True] * len(eqn.invars), eqn


_COLLECTIVES: set[core.Primitive] = set()


def collective_primitive(name: str) -> core.Primitive:
    """A multiple-results primitive run eagerly through a cached jit of itself (compiled once per
    parameters, never per call).

    Never removed as dead code, even with its results unused: ranks may run different programs
    (``if rank == 0: print(allreduce(x)) else: allreduce(x)``), and a collective dropped on one
    rank only would leave the others waiting.
    """
    p = core.Primitive(name)
    p.multiple_results = True
    p.def_impl(functools.partial(_run_eagerly, p))
    pe.dce_rules[p] = _keep
    pe.partial_eval_jaxpr_custom_rules[p] = _never_recomputed
    _COLLECTIVES.add(p)
    return p


def _never_recomputed(
    saveable: Any, unks_in: Sequence[bool], inst_in: Sequence[bool], eqn: Any
) -> tuple[Any, Any, list[bool], list[bool], list[Any]]:
    """``jax.checkpoint``'s split of a collective: it runs once, in the forward pass, and its
    results are saved for the backward pass, whatever the policy. Recomputing it would
    communicate again (twice the traffic), and a rank that checkpoints while its peers do not
    (a local memory choice) would make a call they never match: a send received twice, or a
    hang. Collectives of tangents (unknown inputs) go to the backward pass as usual.

    Inside a ``while_loop`` nothing can be saved (JAX's loop has no room for residuals): there
    the collective is also recomputed, as JAX does with any op (the loop runs again)."""
    n = len(eqn.outvars)
    res = [v for v, inst in zip(eqn.invars, inst_in, strict=True)
           if isinstance(v, core.Var) and not inst]  # fmt: skip
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, res
    if _IN_WHILE.get():
        return eqn, eqn, [False] * n, [True] * n, res
    return eqn, None, [False] * n, [False] * n, []


_IN_WHILE: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_in_while", default=False)


def _mark_while_partial_eval() -> None:
    """Tell :func:`_never_recomputed` when it runs for the body of a ``while_loop``."""
    from jax._src.lax import control_flow

    prim = getattr(control_flow, "while_p", None)
    if not isinstance(prim, core.Primitive) or prim not in pe.partial_eval_jaxpr_custom_rules:
        return
    default = pe.partial_eval_jaxpr_custom_rules[prim]

    def rule(*args: Any, **kwargs: Any) -> Any:
        token = _IN_WHILE.set(True)
        try:
            return default(*args, **kwargs)
        finally:
            _IN_WHILE.reset(token)

    pe.partial_eval_jaxpr_custom_rules[prim] = rule


_mark_while_partial_eval()


def _run_eagerly(prim: core.Primitive, *args: Any, **params: Any) -> Any:
    """An eager call (also one a JVP or transpose rule makes under eager ``jax.grad``): waits
    for the result so that a failure is raised here, on every rank, as :class:`spmd.SpmdError`."""
    try:
        outs = dispatch.apply_primitive(prim, *args, **params)
        jax.block_until_ready(outs)
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        # JaxRuntimeError from a first call; a cached executable's fast path raises ValueError
        # with the same text. Anything without spmd's marker goes up unchanged.
        raise translate_error(e) from None
    return outs


# -- lowering -----------------------------------------------------------------------------------

_ORDER_TYPE: Callable[[], ir.Type] = lambda: ir.RankedTensorType.get(  # noqa: E731
    [1], ir.IntegerType.get_unsigned(8)
)


_CHAINS_KEY: Any = ("spmd", "order-chains")


def _layout(aval: Any) -> list[int]:
    return list(reversed(range(len(aval.shape))))


def _attr(value: Any) -> ir.Attribute:
    if isinstance(value, bool):
        return ir.BoolAttr.get(value)
    if isinstance(value, tuple):
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    if isinstance(value, np.int32):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), int(value))
    if isinstance(value, float):
        return ir.FloatAttr.get(ir.F32Type.get(), value)
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), int(value))


def lower_collective(
    ctx: mlir.LoweringRuleContext, target: str, operands: Sequence[Any], **attrs: Any
) -> list[Any]:
    """Emit the FFI custom call ``target``, chained after the previous collective of the block.

    Attributes: Python ints become i64, ``np.int32`` i32, floats f32, tuples i64 arrays.
    """
    call = mlir.custom_call(
        target,
        result_types=[
            _ORDER_TYPE(),
            *(mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out),
        ],
        operands=[_chain_end(ctx), *operands],
        backend_config={k: _attr(v) for k, v in attrs.items()},
        api_version=4,
        has_side_effect=True,
        operand_layouts=[[0], *(_layout(a) for a in ctx.avals_in)],
        result_layouts=[[0], *(_layout(a) for a in ctx.avals_out)],
    )
    _set_chain_end(ctx, call.results[0])
    return list(call.results[1:])


def _chains(ctx: mlir.LoweringRuleContext) -> list[tuple[Any, Any]]:
    # Per-module state: ModuleContext has no room for attributes, so the chains ride in its
    # per-module cache under a key no primitive can produce.
    chains: list[tuple[Any, Any]] = ctx.module_context.cached_primitive_lowerings.setdefault(
        _CHAINS_KEY, []
    )
    return chains


def _chain_at(chains: list[tuple[Any, Any]], block: Any) -> int | None:
    # Blocks come back as fresh Python wrappers: find ours by equality, not hashing.
    return next((i for i, (b, _) in enumerate(chains) if b == block), None)


def _chain_end(ctx: mlir.LoweringRuleContext) -> Any:
    """The order value the next collective of the current block must take: the previous
    collective's, the one handed in by :data:`chain_enter_p`, or a constant at the start."""
    chains = _chains(ctx)
    at = _chain_at(chains, ir.InsertionPoint.current.block)
    return mlir.ir_constant(np.zeros((1,), np.uint8)) if at is None else chains[at][1]


def _set_chain_end(ctx: mlir.LoweringRuleContext, value: Any) -> None:
    chains = _chains(ctx)
    block = ir.InsertionPoint.current.block
    at = _chain_at(chains, block)
    if at is None:
        chains.append((block, value))
    else:
        chains[at] = (block, value)


# -- nested calls -------------------------------------------------------------------------------

_holds: weakref.WeakKeyDictionary[core.Jaxpr, bool] = weakref.WeakKeyDictionary()


def _holds_collective(jaxpr: core.Jaxpr) -> bool:
    """Whether ``jaxpr`` or any jaxpr nested in it binds one of spmd's collectives."""
    found = _holds.get(jaxpr)
    if found is None:
        found = any(e.primitive in _COLLECTIVES for e in jaxpr.eqns) or any(
            _holds_collective(sub) for sub in core.subjaxprs(jaxpr)
        )
        _holds[jaxpr] = found
    return found


def _inline_calls_holding_collectives() -> None:
    """Lower a nested ``jax.jit``, ``closed_call``, ``jax.checkpoint`` or custom-derivative
    function that holds collectives inline, in the caller's block, so that its collectives join
    the caller's chain and run in their place in program order. JAX may lower such a call to a
    separate function, where the chain would start afresh: XLA could then run its collectives
    before or after the caller's, and ranks whose programs differ (a pipeline stage sending from
    a jitted or checkpointed helper) would wait on each other. (In the forward pass checkpoint
    and custom derivatives mean nothing; their backward passes are separate equations.) Calls
    without collectives keep JAX's own lowering."""
    import importlib

    calls: list[tuple[core.Primitive, str]] = [(core.closed_call_p, "call_jaxpr")]
    for module, name, param in (
        ("jax._src.pjit", "jit_p", "jaxpr"),
        ("jax._src.pjit", "pjit_p", "jaxpr"),
        ("jax._src.ad_checkpoint", "remat_p", "jaxpr"),
        ("jax._src.custom_derivatives", "custom_jvp_call_p", "call_jaxpr"),
        ("jax._src.custom_derivatives", "custom_vjp_call_p", "call_jaxpr"),
    ):
        prim = getattr(importlib.import_module(module), name, None)
        if isinstance(prim, core.Primitive) and all(prim is not p for p, _ in calls):
            calls.append((prim, param))
    for prim, param in calls:
        entry = mlir._lowerings.get(prim)
        if entry is None:  # another JAX: its nested calls start their own chain (documented)
            continue
        default = getattr(entry, "rule", entry)

        def rule(
            ctx: Any, *args: Any, _default: Any = default, _param: str = param, **params: Any
        ) -> Any:
            closed = params.get(_param)
            if not is_closed_jaxpr(closed) and isinstance(closed, core.Jaxpr):
                closed = ClosedJaxpr(closed, ())  # remat holds an open jaxpr (JAX < 0.12)
            if not is_closed_jaxpr(closed) or not _holds_collective(closed.jaxpr):
                return _default(ctx, *args, **params)
            return mlir.lower_fun(core.jaxpr_as_fun(closed), multiple_results=True)(ctx, *args)

        for platform in ("cpu", "cuda"):
            mlir.register_lowering(prim, rule, platform=platform, cacheable=False)


def _higher_order_primitives() -> list[core.Primitive]:
    """JAX's primitives that hold jaxprs (calls, control flow, remat, custom derivatives), as
    this JAX names them."""
    import importlib

    found = []
    for module, names in (
        ("jax._src.pjit", ("jit_p", "pjit_p")),
        ("jax._src.core", ("closed_call_p",)),
        ("jax._src.lax.control_flow", ("cond_p", "while_p", "scan_p")),
        ("jax._src.ad_checkpoint", ("remat_p",)),
        ("jax._src.custom_derivatives", ("custom_jvp_call_p", "custom_vjp_call_p")),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            prim = getattr(mod, name, None)
            if isinstance(prim, core.Primitive) and prim not in found:
                found.append(prim)
    return found


def _keep_calls_holding_collectives() -> None:
    """Never remove a call, loop or branch that holds collectives as dead code, as the
    collectives themselves are never removed (``_keep``). JAX drops such an equation when none
    of its outputs is used: a jitted helper that only sends, or whose allreduce result is
    discarded on one rank, would silently skip its collectives and leave the peers waiting."""
    for prim in _higher_order_primitives():
        default = pe.dce_rules.get(prim)

        def rule(used_outputs: list[bool], *rest: Any, _default: Any = default) -> Any:
            eqn = rest[-1]  # rest: (eqn,), or (live_ins, eqn) from JAX 0.12 (see _keep)
            if not any(used_outputs) and any(
                _holds_collective(j) for j in core.jaxprs_in_params(eqn.params)
            ):
                return [True] * len(eqn.invars), eqn
            if _default is not None:
                return _default(used_outputs, *rest)
            if not any(used_outputs) and not pe.has_effects(eqn):  # JAX's default rule
                return [False] * len(eqn.invars), None
            return [True] * len(eqn.invars), eqn

        pe.dce_rules[prim] = rule


# -- loops and branches -------------------------------------------------------------------------

_ORDER_AVAL = core.ShapedArray((1,), np.dtype(np.uint8))

chain_enter_p = core.Primitive("spmd_chain_enter")
"""Lowering-time only: the chain of the block being lowered continues from the operand (the
order value a loop carries, or its caller's)."""
chain_enter_p.multiple_results = True
chain_enter_p.def_abstract_eval(lambda order: [])
pe.dce_rules[chain_enter_p] = _keep

chain_exit_p = core.Primitive("spmd_chain_exit")
"""Lowering-time only: the order value the block being lowered has reached, broadcast to
``shape`` (a loop whose predicate vmap batched carries one per batch element)."""
chain_exit_p.def_abstract_eval(lambda *, shape: core.ShapedArray(shape, np.dtype(np.uint8)))


def _order_from(value: Any, shape: tuple[int, ...]) -> Any:
    """The (1,) order value out of a carried one of ``shape`` (all its elements are equal)."""
    if shape == (1,):
        return value
    nd = len(shape)
    first = hlo.slice(
        value,
        ir.DenseI64ArrayAttr.get([0] * nd),
        ir.DenseI64ArrayAttr.get([1] * nd),
        ir.DenseI64ArrayAttr.get([1] * nd),
    )
    return hlo.reshape(_ORDER_TYPE(), first)


def _order_to(value: Any, shape: tuple[int, ...]) -> Any:
    """The (1,) order value broadcast to ``shape`` (whose last dimension is 1)."""
    if shape == (1,):
        return value
    out = ir.RankedTensorType.get(list(shape), ir.IntegerType.get_unsigned(8))
    return hlo.broadcast_in_dim(out, value, ir.DenseI64ArrayAttr.get([len(shape) - 1]))


def _lower_chain_enter(ctx: mlir.LoweringRuleContext, order: Any) -> list[Any]:
    aval = ctx.avals_in[0]
    assert isinstance(aval, core.ShapedArray)
    _set_chain_end(ctx, _order_from(order, aval.shape))
    return []


def _lower_chain_exit(ctx: mlir.LoweringRuleContext, *, shape: tuple[int, ...]) -> list[Any]:
    return [_order_to(_chain_end(ctx), shape)]


mlir.register_lowering(chain_enter_p, _lower_chain_enter, cacheable=False)
mlir.register_lowering(chain_exit_p, _lower_chain_exit, cacheable=False)


def _threaded(
    closed: ClosedJaxpr, returns_order: bool, order: core.ShapedArray = _ORDER_AVAL
) -> ClosedJaxpr:
    """``closed`` with one more input, the order value its collectives continue from, and (with
    ``returns_order``) one more output, the order value they end on."""

    def fn(*args: Any) -> Any:
        chain_enter_p.bind(args[-1])
        outs = core.jaxpr_as_fun(closed)(*args[:-1])
        return [*outs, chain_exit_p.bind(shape=order.shape)] if returns_order else list(outs)

    threaded: ClosedJaxpr = jax.make_jaxpr(fn)(*closed.in_avals, order)
    return threaded


def _lower_threaded(
    ctx: mlir.LoweringRuleContext,
    default: Callable[..., Any],
    order: core.ShapedArray,
    operands: Sequence[Any],
    **params: Any,
) -> list[Any]:
    """Lower a loop or branch with the order value as its last operand and result: it takes
    the caller's chain end in, and the caller's chain continues from its result. Chains of the
    blocks lowered inside are dropped once done (they are never extended again), so the list
    stays as short as the nesting is deep."""
    chains = _chains(ctx)
    known = len(chains)
    inner: mlir.LoweringRuleContext = ctx.replace(
        avals_in=[*ctx.avals_in, order], avals_out=[*ctx.avals_out, order]
    )
    outs = default(inner, *operands, _order_to(_chain_end(ctx), order.shape), **params)
    del chains[known:]
    _set_chain_end(ctx, _order_from(outs[-1], order.shape))
    if inner.tokens_out is not None:  # JAX's effect tokens
        ctx.set_tokens_out(inner.tokens_out)
    return list(outs[:-1])


def _is_threaded(closed: ClosedJaxpr) -> bool:
    """Whether ``closed`` is a body :func:`_threaded` made: JAX's lowering of a predicate with
    ordered effects binds the loop again around it, already carrying the order value."""
    return any(e.primitive is chain_enter_p for e in closed.jaxpr.eqns)


def _hoisted_predicate(
    while_p: core.Primitive,
    cond_jaxpr: ClosedJaxpr,
    body_jaxpr: ClosedJaxpr,
    cond_nconsts: int,
    body_nconsts: int,
) -> Callable[..., list[Any]]:
    """A while loop whose predicate holds collectives, as one that evaluates the predicate once
    before the loop and then at the end of each iteration, carrying it. A predicate's order
    value cannot leave the predicate (a while's condition returns only its verdict), so its
    collectives move where the chain can reach them: into the caller's block and the body."""
    pred = cond_jaxpr.out_avals[0]
    carry = list(body_jaxpr.out_avals)
    c_avals = cond_jaxpr.in_avals[:cond_nconsts]
    b_avals = body_jaxpr.in_avals[:body_nconsts]
    verdict: ClosedJaxpr = jax.make_jaxpr(lambda p, *c: [p])(pred, *carry)

    def step(*args: Any) -> list[Any]:
        cc, bc, (_, *z) = (
            args[:cond_nconsts],
            args[cond_nconsts : -len(carry) - 1],
            args[-len(carry) - 1 :],
        )
        z = core.jaxpr_as_fun(body_jaxpr)(*bc, *z)
        return [core.jaxpr_as_fun(cond_jaxpr)(*cc, *z)[0], *z]

    body: ClosedJaxpr = jax.make_jaxpr(step)(*c_avals, *b_avals, pred, *carry)

    def fn(*args: Any) -> list[Any]:
        cc, bc, z = (
            args[:cond_nconsts],
            args[cond_nconsts : cond_nconsts + body_nconsts],
            args[cond_nconsts + body_nconsts :],
        )
        first = core.jaxpr_as_fun(cond_jaxpr)(*cc, *z)[0]
        outs = while_p.bind(
            *cc, *bc, first, *z,
            cond_jaxpr=verdict, body_jaxpr=body, cond_nconsts=0,
            body_nconsts=cond_nconsts + body_nconsts,
        )  # fmt: skip
        return list(outs[1:])

    return fn


def _as_is(ctx: mlir.LoweringRuleContext, *args: Any, _default: Any, **params: Any) -> Any:
    return _default(ctx, *args, **params)


def _thread_loops_and_branches() -> None:
    """Run a ``while_loop`` (``scan``, ``fori_loop``, ``map`` lower to one) or a ``cond``
    (``switch``) that holds collectives in its place in the caller's chain.

    The loop carries the order value as one more element: the body's first collective takes
    it, the body returns its last collective's, the loop takes its caller's chain end in and
    the caller's next collective takes the loop's out. Branches take the chain end in and
    return theirs. A value a side-effecting custom call produces on every iteration cannot be
    folded by XLA, so the dependency survives optimisation. A predicate holding collectives is
    evaluated before the loop and at the end of each iteration instead (``_hoisted_predicate``).
    A loop whose predicate vmap batched carries one order value per batch element, since JAX
    keeps or replaces each carry element per batch element. The jaxprs are rewritten at
    lowering time only: traced programs, vmap, grad and dead-code rules see the loop as
    written."""
    from jax._src.lax import control_flow

    while_p = getattr(control_flow, "while_p", None)
    cond_p = getattr(control_flow, "cond_p", None)
    if not all(
        isinstance(prim, core.Primitive) and mlir._lowerings.get(prim) is not None
        for prim in (while_p, cond_p)
    ):
        return  # another JAX: loops and branches start chains of their own (documented)
    assert isinstance(while_p, core.Primitive)

    def while_rule(
        ctx: mlir.LoweringRuleContext,
        *args: Any,
        _default: Any,
        cond_jaxpr: ClosedJaxpr,
        body_jaxpr: ClosedJaxpr,
        **params: Any,
    ) -> Any:
        if _holds_collective(cond_jaxpr.jaxpr):
            fn = _hoisted_predicate(while_p, cond_jaxpr, body_jaxpr, **params)
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        if not _holds_collective(body_jaxpr.jaxpr) or _is_threaded(body_jaxpr):
            return _default(ctx, *args, cond_jaxpr=cond_jaxpr, body_jaxpr=body_jaxpr, **params)
        order = core.ShapedArray((*cond_jaxpr.out_avals[0].shape, 1), np.dtype(np.uint8))
        return _lower_threaded(
            ctx, _default, order, args,
            cond_jaxpr=_threaded(cond_jaxpr, returns_order=False, order=order),
            body_jaxpr=_threaded(body_jaxpr, returns_order=True, order=order),
            **params,
        )  # fmt: skip

    def cond_rule(
        ctx: mlir.LoweringRuleContext,
        index: Any,
        *args: Any,
        _default: Any,
        branches: Sequence[ClosedJaxpr],
        **params: Any,
    ) -> Any:
        if not any(_holds_collective(b.jaxpr) for b in branches):
            return _default(ctx, index, *args, branches=branches, **params)
        return _lower_threaded(
            ctx, _default, _ORDER_AVAL, (index, *args),
            branches=tuple(_threaded(b, returns_order=True) for b in branches),
            **params,
        )  # fmt: skip

    rules: list[tuple[Any, Any]] = [(while_p, while_rule), (cond_p, cond_rule)]
    # A scan lowers to a while loop. It must lower in its caller's block, not as a function of
    # its own that JAX caches and copies in (whose chain end the caller would never see), as
    # must the loops and branches themselves.
    scan_p = getattr(control_flow, "scan_p", None)
    if isinstance(scan_p, core.Primitive) and mlir._lowerings.get(scan_p) is not None:
        rules.append((scan_p, _as_is))
    for prim, rule in rules:
        entry = mlir._lowerings[prim]
        default = functools.partial(rule, _default=getattr(entry, "rule", entry))
        for platform in ("cpu", "cuda"):
            mlir.register_lowering(prim, default, platform=platform, cacheable=False)


_inline_calls_holding_collectives()
_keep_calls_holding_collectives()
_thread_loops_and_branches()


Rule = Callable[..., list[Any]]


def register_lowering(
    prim: core.Primitive,
    target: str,
    cuda_attrs: Callable[..., dict[str, Any]] | None = None,
    pass_operands: bool = True,
    cpu_attrs: Callable[..., dict[str, Any]] | None = None,
    **attr_params: Callable[..., Any],
) -> None:
    """Lower ``prim`` to the FFI target ``target`` on CPU and ``spmd_cuda_<op>`` on GPU (the
    rules of :func:`collective_rules`)."""
    register_rules(
        prim, *collective_rules(target, cuda_attrs, pass_operands, cpu_attrs, **attr_params)
    )


def register_rules(prim: core.Primitive, cpu_rule: Rule, cuda_rule: Rule) -> None:
    # Not cacheable: the rule must run in the block it lowers into, where the chain lives.
    mlir.register_lowering(prim, cpu_rule, platform="cpu", cacheable=False)
    mlir.register_lowering(prim, cuda_rule, platform="cuda", cacheable=False)


def collective_rules(
    target: str,
    cuda_attrs: Callable[..., dict[str, Any]] | None = None,
    pass_operands: bool = True,
    cpu_attrs: Callable[..., dict[str, Any]] | None = None,
    **attr_params: Callable[..., Any],
) -> tuple[Rule, Rule]:
    """The lowering rules (CPU, GPU) of a collective to the FFI target ``target`` on CPU and
    ``spmd_cuda_<op>`` on GPU.

    ``attr_params`` map FFI attribute names to functions of the primitive's parameters;
    ``cuda_attrs(ctx, **params)`` adds the GPU handler's own attributes (the all-reduce's
    backend chain), ``cpu_attrs(**params)`` the CPU handler's own. ``pass_operands=False``: the
    native call takes none of the primitive's operands (recv's, which only carry batch axes).
    """

    def cpu_rule(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> list[Any]:
        if not pass_operands:
            ctx, operands = ctx.replace(avals_in=[]), ()
        group: GroupRef = params["group"]
        attrs = {name: fn(**params) for name, fn in attr_params.items()}
        if cpu_attrs is not None:
            attrs.update(cpu_attrs(**params))
        return lower_collective(ctx, target, operands, group=group.attr, **attrs)

    def cuda_rule(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> list[Any]:
        from . import _cuda

        if not pass_operands:
            ctx, operands = ctx.replace(avals_in=[]), ()
        group: GroupRef = params["group"]
        _cuda.ensure_handlers()
        attrs = {name: fn(**params) for name, fn in attr_params.items()}
        op = target.removeprefix("spmd_")
        if cuda_attrs is not None:
            attrs.update(cuda_attrs(ctx, **params))
        else:  # everything but the all-reduce runs on NCCL
            where = f"rank {group.world_rank}: {op}: "
            _cuda.registered(group.gid, where).require_nccl(f"{where}the GPU {op}")
        cuda_target = "spmd_cuda_" + op
        return lower_collective(ctx, cuda_target, operands, group=group.attr, **attrs)

    return cpu_rule, cuda_rule


# -- calling ------------------------------------------------------------------------------------


def translate_error(e: Exception) -> Exception:
    """A native collective's failure as the SpmdError it reports; other errors unchanged."""
    text = str(e)
    at = text.find(_MARKER)
    if at < 0:
        return e
    # The native text starts with its own "rank N: op: " (docs/collectives.md, Errors).
    return SpmdError(text[at + len(_MARKER) :].strip(), rank=None)


def bind(prim: core.Primitive, *args: Any, **params: Any) -> list[Any]:
    """Bind ``prim``: its results as a list (eagerly, once they are ready)."""
    return list(prim.bind(*args, **params))


# What a collective takes as a leaf: arrays and scalars (then checked for their dtype).
ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, int, float, complex)


def flatten(x: Any, op: str, group: GroupRef) -> tuple[list[jax.Array], Any, list[str]]:
    """Leaves of ``x`` as arrays, their treedef and pytree paths; checks the dtypes."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves, paths = [], []
    for path, leaf in with_path:
        name = "x" + jax.tree_util.keystr(path)
        if not isinstance(leaf, ARRAY_LIKE):
            raise SpmdTypeError(
                f"rank {group.world_rank}: {op}: {name} is a {type(leaf).__name__}, not an "
                "array; pass arrays or pytrees (lists, tuples, dicts) of arrays"
            )
        arr = jnp.asarray(leaf)
        check_dtype(arr.dtype, op, name, group)
        leaves.append(arr)
        paths.append(name)
    return leaves, treedef, paths


def check_dtype(dtype: Any, name: str, path: str, group: GroupRef) -> None:
    where = f"rank {group.world_rank}: {name}: {path}"
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys
        raise SpmdTypeError(
            f"{where} has dtype {dtype}, which collectives do not take; pass its bits, "
            "jax.random.key_data(x), bit-cast to uint8 (spmd.broadcast_params does this for you)"
        )
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise SpmdTypeError(
            f"{where} has dtype {np.dtype(dtype)}; spmd's collectives take "
            f"{_supported_names()}. Cast it to one that holds its values (e.g. int16 -> int32), "
            "or, to move it unchanged (broadcast, gather, send), pass its bytes: "
            "jax.lax.bitcast_convert_type(x, jnp.uint8) (complex: of x.real and x.imag)"
        )


def check_reduce_op(op: Any, name: str, group: GroupRef, leaves: Sequence[jax.Array]) -> None:
    if op not in REDUCE_NAMES:
        raise SpmdError(
            f"rank {group.world_rank}: {name}: op={op!r} is not a reduction; expected one of "
            f"{', '.join(REDUCE_NAMES)}"
        )
    if op == "avg":
        for leaf in leaves:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise SpmdTypeError(
                    f"rank {group.world_rank}: {name}: op='avg' needs floating-point arrays, got "
                    f"{leaf.dtype}; use op='sum' and divide, or cast to a float dtype"
                )


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


def check_rank(value: Any, what: str, name: str, group: GroupRef) -> int:
    """``value`` as a rank of ``group`` (its position in the group), or an error naming it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise SpmdTypeError(
            f"rank {group.world_rank}: {name}: {what}={value!r} is not an integer rank of the "
            f"group of ranks {list(group.ranks)}"
        )
    if not 0 <= int(value) < group.size:
        raise SpmdError(
            f"rank {group.world_rank}: {name}: {what}={value} is out of range for the group of "
            f"ranks {list(group.ranks)} (valid: 0..{group.size - 1}, positions in that group)"
        )
    return int(value)


def check_axis(axis: Any, ndim: int, what: str, name: str, group: GroupRef, path: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise SpmdTypeError(f"rank {group.world_rank}: {name}: {what}={axis!r} is not an int")
    if not -ndim <= int(axis) < max(ndim, 1) or ndim == 0:
        raise SpmdError(
            f"rank {group.world_rank}: {name}: {what}={axis} is out of range for {path} with "
            f"{ndim} dimension(s) (valid: {-ndim}..{ndim - 1})"
            + ("; a scalar has no axis to split or join, reshape it to (1,)" if ndim == 0 else "")
        )
    return int(axis) % ndim


def batch_first(args: Sequence[Any], dims: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Batched operands with the batch axis first, and the batch dims of results shaped like
    them: ranks may batch along different axes, and an elementwise collective combines memory,
    so every rank must lay the batch out alike. Unbatched operands stay as they are."""
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    return moved, [None if d is None else 0 for d in dims]


def avals_like(avals: Sequence[core.ShapedArray], shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    return [core.ShapedArray(s, a.dtype) for a, s in zip(avals, shapes, strict=True)]


def instantiate(ct: Any, aval: core.ShapedArray) -> Any:
    """A cotangent as an array (symbolic zeros become real zeros: every rank must send)."""
    from jax._src.ad_util import Zero

    if isinstance(ct, Zero) or ct is None:
        return jnp.zeros(aval.shape, aval.dtype)
    return ct


def arg_aval(arg: Any) -> core.ShapedArray:
    """The aval of a transpose rule's argument, linear (undefined) or not."""
    from jax._src.interpreters import ad

    aval: core.ShapedArray = arg.aval if ad.is_undefined_primal(arg) else core.typeof(arg)
    return aval


def zero_tangent(primal: Any) -> Any:
    """The symbolic zero tangent of ``primal`` (no communication: the same on every rank)."""
    from jax._src.ad_util import Zero

    return Zero(core.typeof(primal).to_tangent_aval())


def linear_jvp(prim: core.Primitive) -> Callable[..., Any]:
    """The JVP rule of a primitive linear in every operand: the same collective on the live
    tangents (symbolic zeros stay zeros; which are zero is the same on every rank)."""

    def rule(primals: list[Any], tangents: list[Any], **params: Any) -> Any:
        from jax._src.ad_util import Zero

        outs = prim.bind(*primals, **params)
        t_outs: list[Any] = [zero_tangent(y) for y in outs]
        live = [i for i, t in enumerate(tangents) if not isinstance(t, Zero)]
        if live:
            t_params = {**params, "group": params["group"].jvp()}
            for i, r in zip(live, prim.bind(*[tangents[i] for i in live], **t_params), strict=True):
                t_outs[i] = r
        return outs, t_outs

    return rule
