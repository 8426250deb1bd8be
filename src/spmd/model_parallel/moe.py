"""Expert parallelism: a mixture-of-experts layer on all-to-all (``spmd.moe``).

E experts are split evenly over the ranks of a group (by default the ``"ep"`` axis of the active
mesh): rank r holds experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``, stacked on axis 0 of
each leaf of its expert parameters. Every rank routes its own tokens:

1. :func:`route` picks each token's top-k experts from the router's logits, with gates = the
   softmax over the k selected logits (Mixtral's convention) and Switch Transformer's
   load-balancing loss;
2. :func:`dispatch` sends each (token, expert) pair to the rank that holds the expert and
   returns, per local expert, the tokens it received (from every rank, in rank order);
3. the experts run on their tokens (``jax.vmap`` of ``expert_fn`` over the local experts);
4. :func:`combine` sends the results back and sums each token's k results, weighted by its
   gates.

Without a capacity factor the layer is dropless: only the rows routed move, and each local
expert's buffer has room for one row per token of every rank (``ep * T`` rows, zero past the
tokens received). With ``capacity_factor=c`` each rank sends at most ``C = ceil(c * T * k / E)``
rows to each expert; the rest are dropped (their gates count for nothing), first choices before
second choices, earlier tokens first; each expert's buffer holds C slots per rank.

On CPU the tokens move with the native MoE exchange (``spmd.ops.moe_dispatch``/``moe_combine``:
counts, order and placement worked out natively, the gates applied as combine adds the rows up);
on a GPU, for a group of one, or with ``SPMD_MOE_EXCHANGE=composed``, with an ``all_to_all`` of
the counts, ``spmd.all_to_allv`` and XLA gathers (docs/model_parallel.md).

Gradients follow the collectives' convention: the expert parameters' gradients are those of the
sum of every rank's objective (each rank's tokens contribute to the experts they reached), the
router's those of this rank's tokens. Pass expert parameters as ShardedArrays
(:func:`shard_experts`) so that ``data_parallel`` reduces their gradients only over the ranks
that hold the same experts (docs/model_parallel.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError, SpmdTypeError
from ..mesh import resolve_group
from ..ops import moe_native
from ..sharded import PartitionSpec, is_sharded, shard
from ._moe_moves import (
    Plan,
    composed_combine,
    composed_dispatch,
    exchanges,
    fits_one,
    grouped_combine,
    grouped_dispatch,
    grouped_out_rows,
    native_combine,
    native_dispatch,
    plan_traffic,
)  # fmt: skip
from .tensor_parallel import local

__all__ = ["Routing", "combine", "dispatch", "moe", "route", "shard_experts"]


# -- routing ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    """Where each of this rank's T tokens goes (what :func:`route` returns).

    Attributes:
        experts: ``(T, k)`` int32, each token's experts (global ids), best first.
        gates: ``(T, k)``, the softmax over the k selected logits.
        keep: ``(T, k)`` bool, False where a capacity factor dropped the assignment.
        position: ``(T, k)`` int32, the assignment's place in its expert's queue on this rank
            (first choices first, then by token).
        aux_loss: Switch Transformer's load-balancing loss over this rank's tokens,
            ``E * sum_e f_e * p_e`` (``f_e``: the share of the T * k assignments that chose
            expert e, ``p_e``: the mean router probability of e); 1 when balanced.
        num_experts: E. capacity: C rows per expert per rank, or None (dropless).
    """

    experts: Any
    gates: Any
    keep: Any
    position: Any
    aux_loss: Any
    num_experts: int = field(metadata={"static": True})
    capacity: int | None = field(metadata={"static": True})

    @property
    def k(self) -> int:
        return int(self.experts.shape[-1])


def route(logits: Any, k: int, *, capacity_factor: float | None = None) -> Routing:
    """Top-k routing of this rank's tokens from the router's ``(T, E)`` logits.

    Gates are the softmax over each token's k selected logits. With ``capacity_factor`` each
    expert takes at most ``C = ceil(capacity_factor * T * k / E)`` of this rank's assignments
    (first choices first, then in token order; the others are dropped: ``keep`` is False);
    None is dropless. See :class:`Routing`.

    Example::

        >>> import jax.numpy as jnp, spmd
        >>> r = spmd.moe.route(jnp.array([[2.0, 0.0, 1.0]]), k=2)
        >>> r.experts
        Array([[0, 2]], dtype=int32)
        >>> [round(float(g), 3) for g in r.gates[0]]
        [0.731, 0.269]
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise SpmdError(
            f"logits have shape {logits.shape}; expected (tokens, experts)", op="moe.route"
        )
    t, e = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise SpmdError(
            f"k={k!r}, but there are {e} experts; expected an int from 1 to {e}", op="moe.route"
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise SpmdError(
            f"capacity_factor={capacity_factor!r}; expected a number > 0, or None (dropless)",
            op="moe.route",
        )
    f32 = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    top, experts = jax.lax.top_k(f32, k)
    gates = jax.nn.softmax(top, axis=-1).astype(logits.dtype)
    chosen = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # (T, k, E)
    share = chosen.sum((0, 1)) / (t * k)
    aux = e * jnp.sum(share * jax.nn.softmax(f32, axis=-1).mean(0))
    # Queue positions: first choices of every token, then second choices, ...
    order = chosen.swapaxes(0, 1).reshape(k * t, e)
    before = (jnp.cumsum(order, axis=0) - order).reshape(k, t, e).swapaxes(0, 1)
    position = jnp.sum(before * chosen, axis=-1).astype(jnp.int32)
    if capacity_factor is None:
        capacity = None
        keep = jnp.ones((t, k), bool)
    else:
        capacity = max(1, math.ceil(capacity_factor * t * k / e))
        keep = position < capacity
    return Routing(experts.astype(jnp.int32), gates, keep, position, aux, e, capacity)


# -- dispatch and combine -----------------------------------------------------------------------


def _plan(routing: Any, group: Any, op: str) -> Plan:
    if not isinstance(routing, Routing):
        raise SpmdTypeError(
            f"routing is a {type(routing).__name__}; pass what spmd.moe.route returns", op=op
        )
    comm = resolve_group(None, group, op=op)
    e, n = routing.num_experts, comm.size
    if e % n:
        raise SpmdError(
            f"{e} experts do not split evenly over the {n} ranks of the group; use a number of "
            f"experts divisible by {n}",
            op=op,
        )
    t = routing.experts.shape[0]
    slots = n * (t if routing.capacity is None else routing.capacity)
    return Plan(comm, e // n, t, slots, moe_native(comm))


def dispatch(
    x: Any, routing: Routing, *, group: Any = "ep", layout: str = "padded",
    out_rows: int | None = None,
) -> Any:  # fmt: skip
    """The tokens this rank's experts receive.

    ``x``: this rank's ``(T, D)`` tokens, routed by ``routing`` (from :func:`route`).

    ``layout="padded"`` (default): ``(E / ep, slots, D)``, one buffer per local expert: expert j
    of this rank gets, in its row block, the tokens that chose it from rank 0, then rank 1, ...;
    rows past them are zeros. ``slots`` is ``ep * T`` (dropless) or ``ep * C`` (with a
    capacity). Any function of one expert's tokens runs on it under ``jax.vmap``.

    ``layout="grouped"`` (dropless only): ``(rows, group_sizes)``, where ``rows`` is
    ``(ep * T * min(k, E / ep), D)``: the tokens of local expert 0 (from rank 0, then rank
    1, ...), then those of expert 1, ..., then zeros; ``group_sizes`` ``(E / ep,)`` int32 counts
    them, as ``jax.lax.ragged_dot`` takes them. No padding per expert is materialized: the rows
    are gathered and placed by the exchange itself, so this layout moves only the rows routed.
    ``out_rows`` (grouped only) sets the number of rows instead: that default holds any routing
    (every token of every rank choosing this rank's experts), but is ``ep`` times the rows an
    even routing brings (``T * k``) where ``k <= E / ep``. A smaller buffer takes less memory
    and fewer zeros; a routing that brings a rank more rows than ``out_rows`` is an error on
    every rank when the exchange runs (:class:`SpmdError`; inside ``jax.jit``, JAX's
    ``JaxRuntimeError`` with the same message).

    Feed the result, processed row by row and in the same layout, to :func:`combine`.
    """
    op = "moe.dispatch"
    plan = _plan(routing, group, op)
    grouped = _layout(layout, routing, op)
    rows = grouped_out_rows(plan, routing.k, out_rows, grouped, op)
    tokens = _tokens(x, plan, op)
    if plan.native:
        return native_dispatch(tokens, routing, plan, rows)
    traffic = plan_traffic(routing, plan, rows is not None)
    if rows is not None:
        assert traffic is not None  # dropless
        return grouped_dispatch(tokens, routing, plan, traffic, rows)
    return composed_dispatch(tokens, routing, plan, traffic)


def _layout(layout: Any, routing: Routing, op: str) -> bool:
    """Whether ``layout`` is the grouped one; an error for a name it is not, or for a grouped
    layout with a capacity."""
    if layout not in ("padded", "grouped"):
        raise SpmdError(f"layout={layout!r}; expected 'padded' or 'grouped'", op=op)
    if layout == "grouped" and routing.capacity is not None:
        raise SpmdError(
            "layout='grouped' is dropless; route with capacity_factor=None, or use "
            "layout='padded' with a capacity",
            op=op,
        )
    return bool(layout == "grouped")


def combine(y: Any, routing: Routing, *, group: Any = "ep", layout: str = "padded") -> Any:
    """One output row per token: the results of its experts (``y``, laid out as
    :func:`dispatch` returned the tokens with the same ``layout``: ``(E / ep, slots, D_out)``,
    or the grouped ``(rows, D_out)``) sent back and summed, weighted by the gates. Dropped
    assignments contribute nothing. Returns ``(T, D_out)``."""
    op = "moe.combine"
    plan = _plan(routing, group, op)
    grouped = _layout(layout, routing, op)
    y = jnp.asarray(y)
    if grouped and (y.ndim != 2 or y.shape[0] < 1):
        raise SpmdError(
            f"y has shape {y.shape}; expected (rows, features) in the grouped layout, as "
            "dispatch returns them (whether they hold the rows this routing sends back is "
            "checked when the exchange runs)",
            op=op,
        )
    want = (plan.per_rank, plan.slots)
    if not grouped and (y.ndim != len(want) + 1 or y.shape[:-1] != want):
        raise SpmdError(
            f"y has shape {y.shape}; expected ({', '.join(map(str, want))}, features): "
            f"{plan.per_rank} local experts (E={routing.num_experts} over the group's "
            f"{plan.comm.size} ranks) by {plan.slots} slots, as dispatch returns them for this "
            "routing and group",
            op=op,
        )
    rows = y.shape[0] if grouped else None
    if rows is not None:
        fits_one(plan, routing.k, rows, f"y has {rows} rows", op)
    if plan.native:
        return native_combine(y, routing, plan, rows)
    traffic = plan_traffic(routing, plan, rows is not None)
    if grouped:
        assert traffic is not None  # dropless
        return grouped_combine(y, routing, plan, traffic)
    return composed_combine(y, routing, plan, traffic)


def _tokens(x: Any, plan: Plan, op: str) -> Any:
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[0] != plan.tokens:
        raise SpmdError(
            f"x has shape {x.shape}; expected ({plan.tokens}, features): the tokens the "
            "routing was made for",
            op=op,
        )
    return x


# -- the layer ----------------------------------------------------------------------------------


def moe(
    x: Any,
    router_w: Any,
    expert_fn: Callable[..., Any],
    expert_params: Any,
    *,
    k: int = 2,
    capacity_factor: float | None = None,
    group: Any = "ep",
    layout: str = "padded",
    out_rows: int | None = None,
) -> tuple[Any, Any]:
    """A mixture-of-experts layer over the group: ``(y, aux_loss)``.

    Args:
        x: this rank's tokens, ``(..., D)`` (leading axes are flattened into T tokens).
        router_w: the router's weights, ``(D, E)``, the same on every rank.
        expert_fn: ``expert_fn(params_of_one_expert, tokens)`` -> ``(rows, D_out)``, any JAX
            function of ``(rows, D)`` tokens; it also sees padding rows (zeros), whose results
            are discarded.
        expert_params: this rank's ``E / ep`` experts, stacked on axis 0 of every leaf (or
            ShardedArrays from :func:`shard_experts`).
        k: experts per token. capacity_factor: None (dropless) or a number > 0 (see
            :func:`route`).
        layout: ``"padded"`` (the above), or ``"grouped"`` (dropless): then
            ``expert_fn(expert_params, rows, group_sizes)`` gets all local experts' parameters,
            their tokens one expert after another and the count per expert (see
            :func:`dispatch`), for instance two ``jax.lax.ragged_dot`` calls; the rows past the
            counts are zeros, whose results are discarded.
        out_rows: the grouped layout's rows (see :func:`dispatch`; default: any routing fits).

    Returns ``y`` of shape ``(..., D_out)`` and the load-balancing loss of this rank's tokens
    (add it to the loss with a small coefficient, e.g. 0.01).

    Example (a world of one holds every expert)::

        >>> import jax, jax.numpy as jnp, spmd
        >>> experts = {"w": jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])}
        >>> with spmd.Mesh(ep=-1):
        ...     y, aux = spmd.moe.moe(jnp.ones((3, 2)), jnp.array([[1.0, 0.0], [0.0, 0.0]]),
        ...                           lambda p, t: t @ p["w"], experts, k=1)
        >>> y
        Array([[1., 1.],
               [1., 1.],
               [1., 1.]], dtype=float32)
    """
    op = "moe"
    x = jnp.asarray(x)
    router_w = jnp.asarray(local(router_w))
    if router_w.ndim != 2 or router_w.shape[0] != x.shape[-1]:
        raise SpmdError(
            f"router_w has shape {router_w.shape}; expected ({x.shape[-1]}, experts) for tokens "
            f"of {x.shape[-1]} features",
            op=op,
        )
    e = router_w.shape[1]
    comm = resolve_group(None, group, op=op)
    params = local(expert_params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if e % comm.size == 0 and (jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != e // comm.size):
            raise SpmdError(
                f"expert_params{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; "
                f"expected E / ep = {e} / {comm.size} = {e // comm.size} experts stacked on "
                "axis 0",
                op=op,
            )
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(tokens @ router_w.astype(tokens.dtype), k, capacity_factor=capacity_factor)
    plan = _plan(routing, comm, op)
    grouped = _layout(layout, routing, op)
    rows = grouped_out_rows(plan, k, out_rows, grouped, op)
    send, back = exchanges(routing, plan, rows)  # once for dispatch and combine
    if grouped:
        rows, sizes = send(tokens)
        y = back(expert_fn(params, rows, sizes))
    else:
        y = back(jax.vmap(expert_fn)(params, send(tokens)))
    return y.reshape(*x.shape[:-1], y.shape[-1]), routing.aux_loss


def shard_experts(params: Any, *, group: Any = "ep") -> Any:
    """This rank's experts of a full expert tree (every leaf stacks E experts on axis 0), as
    ShardedArrays split over the ``group`` axis of the active mesh (no communication)."""
    op = "moe.shard_experts"
    if not isinstance(group, str | tuple):
        raise SpmdTypeError(f"group={group!r}; expected a mesh axis name", op=op)
    comm = resolve_group(None, group, op=op)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] % comm.size:
            raise SpmdError(
                f"params{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}: its experts "
                f"(axis 0) do not split evenly over the {comm.size} ranks of {group!r}",
                op=op,
            )
    spec = PartitionSpec(group)
    return jax.tree_util.tree_map(lambda v: shard(v, spec), params, is_leaf=is_sharded)


def __getattr__(name: str) -> Any:
    """``spmd.moe.linen``: the layer as a Flax linen module, imported when first named (Flax
    must be installed)."""
    if name == "linen":
        import importlib

        return importlib.import_module("._moe_linen", __package__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
