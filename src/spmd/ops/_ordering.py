"""Ordering: collectives run in program order on every rank, without a JAX effect.

XLA:CPU runs independent custom calls as a dataflow graph (possibly concurrently, possibly
reordered), and a JAX effect, which would order them, takes jit off its fast dispatch path
(docs/performance.md, "Ordering"). So every collective's custom call takes one extra operand,
the previous collective's extra one-byte result in the same computation, and returns its own:
a data dependency, the *chain* of the block being lowered. The custom calls are marked
``has_side_effect`` so that XLA never removes or merges them.

What it takes, and where it reaches:

- every collective primitive is registered here (:func:`register`): a dead-code rule that keeps
  it, and a ``jax.checkpoint`` rule that never recomputes it;
- the chain lives in the lowering context of each block (:func:`chain_end`, :func:`extend`);
- a nested call (``jax.jit``, ``closed_call``, ``jax.checkpoint``, custom derivatives) holding
  collectives is lowered inline, into its caller's chain; a loop or branch holding collectives
  carries the chain's value through its body; neither is removed as dead code.

That last part replaces JAX's lowering and dead-code rules of those call, loop and branch
primitives, process-wide. :func:`install` does it the first time a collective is bound in the
process (``import spmd`` alone changes nothing in JAX); the replaced rules hand every call, loop
or branch without collectives to JAX's own rule, but JAX's per-module lowering cache is off for
those primitives from then on (its cost: benchmarks/compile_time.py).
"""

from __future__ import annotations

import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax_compat import (
    ClosedJaxpr,
    call_primitives,
    control_flow_primitives,
    core,
    dce_eqn,
    higher_order_primitives,
    hlo,
    ir,
    is_closed_jaxpr,
    lowering_rule,
    mlir,
    pe,
)

__all__ = ["chain_end", "extend", "holds_collective", "install", "register"]

_COLLECTIVES: set[core.Primitive] = set()
_ORDER_AVAL = core.ShapedArray((1,), np.dtype(np.uint8))
_CHAINS_KEY: Any = ("spmd", "order-chains")


def _order_type() -> ir.Type:
    return ir.RankedTensorType.get([1], ir.IntegerType.get_unsigned(8))


# -- the collectives --------------------------------------------------------------------------


def _keep(used_outputs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
    """Dead-code rule of a collective: never removed, even with its results unused. Ranks may
    run different programs (``if rank == 0: print(allreduce(x)) else: allreduce(x)``), and a
    collective dropped on one rank only would leave the others waiting."""
    eqn = dce_eqn(rest)
    return [True] * len(eqn.invars), eqn


def register(prim: core.Primitive) -> None:
    """Make ``prim`` a collective: kept by dead-code elimination, never recomputed by
    ``jax.checkpoint``, and found by :func:`holds_collective`."""
    pe.dce_rules[prim] = _keep
    pe.partial_eval_jaxpr_custom_rules[prim] = _never_recomputed
    _COLLECTIVES.add(prim)


_IN_WHILE: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_in_while", default=False)


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


_holds: weakref.WeakKeyDictionary[core.Jaxpr, bool] = weakref.WeakKeyDictionary()


def holds_collective(jaxpr: core.Jaxpr) -> bool:
    """Whether ``jaxpr`` or any jaxpr nested in it binds one of spmd's collectives."""
    found = _holds.get(jaxpr)
    if found is None:
        found = any(e.primitive in _COLLECTIVES for e in jaxpr.eqns) or any(
            holds_collective(sub) for sub in core.subjaxprs(jaxpr)
        )
        _holds[jaxpr] = found
    return found


# -- the chain of a block ---------------------------------------------------------------------


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


def chain_end(ctx: mlir.LoweringRuleContext) -> Any:
    """The order value the next collective of the current block must take: the previous
    collective's, the one handed in by :data:`chain_enter_p`, or a constant at the start."""
    chains = _chains(ctx)
    at = _chain_at(chains, ir.InsertionPoint.current.block)
    return mlir.ir_constant(np.zeros((1,), np.uint8)) if at is None else chains[at][1]


def extend(ctx: mlir.LoweringRuleContext, value: Any) -> None:
    """The current block's chain continues from ``value`` (a collective's order result)."""
    chains = _chains(ctx)
    block = ir.InsertionPoint.current.block
    at = _chain_at(chains, block)
    if at is None:
        chains.append((block, value))
    else:
        chains[at] = (block, value)


# -- loops and branches: the chain's value as one more carry ------------------------------------

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
    return hlo.reshape(_order_type(), first)


def _order_to(value: Any, shape: tuple[int, ...]) -> Any:
    """The (1,) order value broadcast to ``shape`` (whose last dimension is 1)."""
    if shape == (1,):
        return value
    out = ir.RankedTensorType.get(list(shape), ir.IntegerType.get_unsigned(8))
    return hlo.broadcast_in_dim(out, value, ir.DenseI64ArrayAttr.get([len(shape) - 1]))


def _lower_chain_enter(ctx: mlir.LoweringRuleContext, order: Any) -> list[Any]:
    aval = ctx.avals_in[0]
    assert isinstance(aval, core.ShapedArray)
    extend(ctx, _order_from(order, aval.shape))
    return []


def _lower_chain_exit(ctx: mlir.LoweringRuleContext, *, shape: tuple[int, ...]) -> list[Any]:
    return [_order_to(chain_end(ctx), shape)]


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
    outs = default(inner, *operands, _order_to(chain_end(ctx), order.shape), **params)
    del chains[known:]
    extend(ctx, _order_from(outs[-1], order.shape))
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


# -- installing the rules ---------------------------------------------------------------------


def _register_everywhere(prim: core.Primitive, rule: Any) -> None:
    # Not cacheable: the rule must run in the block it lowers into, where the chain lives.
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, rule, platform=platform, cacheable=False)


def _inline_calls() -> None:
    """Lower a nested call holding collectives inline, in the caller's block, so that its
    collectives join the caller's chain and run in their place in program order. JAX may lower
    such a call to a separate function, where the chain would start afresh: XLA could then run
    its collectives before or after the caller's, and ranks whose programs differ (a pipeline
    stage sending from a jitted or checkpointed helper) would wait on each other. (In the
    forward pass checkpoint and custom derivatives mean nothing; their backward passes are
    separate equations.) Calls without collectives keep JAX's own lowering."""
    for prim, param in call_primitives():
        default = lowering_rule(prim)
        if default is None:  # another JAX: its nested calls start their own chain (documented)
            continue

        def rule(ctx: Any, *args: Any, _default: Any = default, _param: str = param,
                 **params: Any) -> Any:  # fmt: skip
            closed = params.get(_param)
            if not is_closed_jaxpr(closed) and isinstance(closed, core.Jaxpr):
                closed = ClosedJaxpr(closed, ())  # remat holds an open jaxpr (JAX < 0.12)
            if not is_closed_jaxpr(closed) or not holds_collective(closed.jaxpr):
                return _default(ctx, *args, **params)
            return mlir.lower_fun(core.jaxpr_as_fun(closed), multiple_results=True)(ctx, *args)

        _register_everywhere(prim, rule)


def _keep_calls() -> None:
    """Never remove a call, loop or branch that holds collectives as dead code, as the
    collectives themselves are never removed (``_keep``). JAX drops such an equation when none
    of its outputs is used: a jitted helper that only sends, or whose allreduce result is
    discarded on one rank, would silently skip its collectives and leave the peers waiting."""
    for prim in higher_order_primitives():
        default = pe.dce_rules.get(prim)

        def rule(used_outputs: list[bool], *rest: Any, _default: Any = default) -> Any:
            eqn = dce_eqn(rest)
            if not any(used_outputs) and any(
                holds_collective(j) for j in core.jaxprs_in_params(eqn.params)
            ):
                return [True] * len(eqn.invars), eqn
            if _default is not None:
                return _default(used_outputs, *rest)
            if not any(used_outputs) and not pe.has_effects(eqn):  # JAX's default rule
                return [False] * len(eqn.invars), None
            return [True] * len(eqn.invars), eqn

        pe.dce_rules[prim] = rule


def _mark_while_partial_eval(while_p: core.Primitive) -> None:
    """Tell :func:`_never_recomputed` when it runs for the body of a ``while_loop``."""
    default = pe.partial_eval_jaxpr_custom_rules.get(while_p)
    if default is None:
        return

    def rule(*args: Any, **kwargs: Any) -> Any:
        token = _IN_WHILE.set(True)
        try:
            return default(*args, **kwargs)
        finally:
            _IN_WHILE.reset(token)

    pe.partial_eval_jaxpr_custom_rules[while_p] = rule


def _as_is(ctx: mlir.LoweringRuleContext, *args: Any, _default: Any, **params: Any) -> Any:
    return _default(ctx, *args, **params)


def _thread_loops_and_branches(prims: dict[str, core.Primitive]) -> None:
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
    while_p, cond_p = prims.get("while"), prims.get("cond")
    if while_p is None or cond_p is None:
        return  # another JAX: loops and branches start chains of their own (documented)
    if lowering_rule(while_p) is None or lowering_rule(cond_p) is None:
        return

    def while_rule(
        ctx: mlir.LoweringRuleContext,
        *args: Any,
        _default: Any,
        cond_jaxpr: ClosedJaxpr,
        body_jaxpr: ClosedJaxpr,
        **params: Any,
    ) -> Any:
        if holds_collective(cond_jaxpr.jaxpr):
            fn = _hoisted_predicate(while_p, cond_jaxpr, body_jaxpr, **params)
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        if not holds_collective(body_jaxpr.jaxpr) or _is_threaded(body_jaxpr):
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
        if not any(holds_collective(b.jaxpr) for b in branches):
            return _default(ctx, index, *args, branches=branches, **params)
        return _lower_threaded(
            ctx, _default, _ORDER_AVAL, (index, *args),
            branches=tuple(_threaded(b, returns_order=True) for b in branches),
            **params,
        )  # fmt: skip

    rules: list[tuple[core.Primitive, Any]] = [(while_p, while_rule), (cond_p, cond_rule)]
    # A scan lowers to a while loop. It must lower in its caller's block, not as a function of
    # its own that JAX caches and copies in (whose chain end the caller would never see), as
    # must the loops and branches themselves.
    scan_p = prims.get("scan")
    if scan_p is not None and lowering_rule(scan_p) is not None:
        rules.append((scan_p, _as_is))
    for prim, rule in rules:
        _register_everywhere(prim, functools.partial(rule, _default=lowering_rule(prim)))


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Replace JAX's rules for calls, loops and branches with ones that keep collectives inside
    them in their caller's chain (see the module doc). Idempotent; called at the first bind of
    a collective in the process."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        prims = control_flow_primitives()
        if "while" in prims:
            _mark_while_partial_eval(prims["while"])
        _inline_calls()
        _keep_calls()
        _thread_loops_and_branches(prims)
        _installed = True
