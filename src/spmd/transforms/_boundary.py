"""The boundary between a user's objects and a traced step: what is not an array, and the
objects of Flax NNX and Equinox, as their users write them.

- **Leaves that are not arrays** (functions, strings, an Equinox model's activation) among a
  step's arguments or results are static, as ``equinox.filter_jit`` and jit's static arguments
  treat them: part of the signature a step is compiled for (:class:`Static`), never traced.
- **Flax NNX objects** (a model, an ``nnx.Optimizer``, metrics) are Python objects their methods
  update in place (``optimizer.update(model, grads)``). A traced step sees only arrays, so at
  each boundary the objects are split into their state and merged back, as ``nnx.jit`` and
  ``nnx.value_and_grad`` do:

  - a step (:func:`lift`): the NNX objects among its arguments travel as their state (one joint
    split, so that objects sharing a variable share it inside too), are merged into fresh
    objects inside the trace, and the state they hold when the step returns is a result of the
    program, written back into the caller's objects after each call;
  - a gradient call (:func:`split_for_grad`): a differentiated NNX argument is differentiated
    with respect to its ``nnx.Param`` variables (``nnx.value_and_grad``'s default), its
    gradients are an ``nnx.State``, and what the loss function changes in its other variables
    (batch statistics, RNG counts) is written back into it;
  - a broadcast and zero_shard's ``shard`` (:func:`broadcast_nodes`, :func:`shard_nodes`): the
    objects' state, written back.
- **Equinox models** differentiated by a gradient call are differentiated with respect to their
  floating-point arrays, the rest passed through, as ``eqx.filter_value_and_grad`` does.

Neither flax nor equinox is imported here: their objects exist only once a user imported them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._errors import SpmdError, SpmdTypeError
from .._jax_compat import core

__all__ = [
    "Static",
    "broadcast_nodes",
    "lift",
    "shard_nodes",
    "split_for_grad",
    "stateful",
    "unstatic",
]

GRAPH_CHANGED = (
    "the step changed the structure of its NNX objects (it added, removed or replaced a "
    "submodule or variable); a step may change their variables' values only. Build the model "
    "and its optimizer and metrics before the first step"
)


NOT_HASHABLE = (
    "{name} is a {kind}, which is not an array, so the step is compiled for its value (as "
    "jit's static arguments are), but it cannot be hashed; pass it as an array, or close over "
    "it in the step function"
)


# -- leaves that are not arrays -------------------------------------------------------------------


class Static:
    """A leaf that is not an array, as a step's input or output: no leaves, its value in the
    pytree structure (so that a step is traced once per value, and the value comes back)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and _same(self.value, other.value)

    def __hash__(self) -> int:
        return hash((Static, self.value))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # an object whose == is elementwise or fails: identity only
        return False


jax.tree_util.register_pytree_node(Static, lambda s: ((), s.value), lambda v, _: Static(v))


def is_value(x: Any) -> bool:
    """Whether JAX takes ``x`` as a value (an array, a scalar)."""
    try:
        core.typeof(x)
    except TypeError:
        return False
    return True


def statics(tree: Any, names: Sequence[str] | None = None, op: str = "step") -> Any:
    """``tree`` with its leaves that are not arrays as :class:`Static` (an error naming the
    first that cannot be hashed, by ``names``: the flattened leaves' names)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for k, x in enumerate(leaves):
        if not is_value(x):
            try:
                hash(x)
            except TypeError:
                name = names[k] if names is not None else f"leaf {k}"
                kind = type(x).__name__
                raise SpmdTypeError(NOT_HASHABLE.format(name=name, kind=kind), op=op) from None
            x = Static(x)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def unstatic(tree: Any) -> Any:
    """``tree`` with its :class:`Static` nodes as their values."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Static))
    if not any(isinstance(x, Static) for x in leaves):
        return tree
    leaves = [x.value if isinstance(x, Static) else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# -- Flax NNX -------------------------------------------------------------------------------------


def _nnx() -> Any:
    """``flax.nnx`` if a user imported it (no NNX object can exist otherwise), else None."""
    return sys.modules.get("flax.nnx")


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object (a module, optimizer, metric, ...)."""
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


@jax.tree_util.register_pytree_with_keys_class
class _Lifted:
    """An NNX argument of a step, as it travels: its part of the arguments' joint state (the
    children) and the joint graph with this object's index in it (static)."""

    def __init__(self, graph: Any, index: int, state: Any) -> None:
        self.graph, self.index, self.state = graph, index, state

    def tree_flatten_with_keys(self) -> tuple[Any, Any]:
        items = list(dict(self.state).items())  # named by the object's own attributes
        keys = [(jax.tree_util.GetAttrKey(str(k)), v) for k, v in items]
        return keys, (self.graph, self.index, tuple(k for k, _ in items))

    def tree_flatten(self) -> tuple[Any, Any]:
        keys, aux = self.tree_flatten_with_keys()
        return [v for _, v in keys], aux

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> _Lifted:
        graph, index, names = aux
        state = _nnx().State(dict(zip(names, children, strict=True)))
        return cls(graph, index, state)


@dataclass
class Lifted:
    """A step call's arguments with its NNX objects replaced by their state."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    nodes: tuple[Any, ...]  # the caller's objects, updated after the call

    def update(self, state: Sequence[_Lifted]) -> None:
        """Write the state the step left in its objects back into the caller's."""
        nnx = _nnx()
        nnx.update(self.nodes, nnx.State({x.index: x.state for x in state}))


def lift(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Lifted | None:
    """The call with its NNX objects as their state; None if it has none. NNX objects are
    found among the step's arguments themselves (positional or keyword), where NNX code passes
    them: looking inside every pytree argument on every call would cost a step with a large
    parameter tree up to a millisecond once flax is imported."""
    nnx = _nnx()
    if nnx is None:
        return None
    is_node = nnx.graph.is_graph_node
    positional = [i for i, x in enumerate(args) if is_node(x)]
    keyword = [k for k, x in kwargs.items() if is_node(x)]
    if not positional and not keyword:
        return None
    a, kw = list(args), dict(kwargs)
    nodes = (*(a[i] for i in positional), *(kw[k] for k in keyword))
    graph, state = nnx.split(nodes)
    lifted = [
        _Lifted(graph, j, state[j] if j in state else nnx.State({})) for j in range(len(nodes))
    ]
    for j, i in enumerate(positional):
        a[i] = lifted[j]
    for j, k in enumerate(keyword, start=len(positional)):
        kw[k] = lifted[j]
    return Lifted(tuple(a), kw, nodes)


def stateful(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a step traces it: its :class:`Static` arguments as their values, and its
    results that are not arrays as :class:`Static`; called with lifted NNX arguments, it merges
    them into objects, runs ``fn`` on them and returns ``(fn's results, the objects' state after
    it)``."""

    @functools.wraps(fn)
    def pure(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unstatic((args, kwargs))
        nnx = _nnx()
        if nnx is None:
            return statics(fn(*args, **kwargs))
        objs, tree = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: isinstance(x, _Lifted)
        )
        lifted = [(i, x) for i, x in enumerate(objs) if isinstance(x, _Lifted)]
        if not lifted:
            return statics(fn(*args, **kwargs))
        graph = lifted[0][1].graph
        nodes = nnx.merge(graph, nnx.State({x.index: x.state for _, x in lifted}))
        for i, x in lifted:
            objs[i] = nodes[x.index]
        a, kw = jax.tree_util.tree_unflatten(tree, objs)
        out = fn(*a, **kw)
        after, state = nnx.split(nodes)
        if after != graph:
            raise SpmdError(GRAPH_CHANGED, op=getattr(fn, "__name__", "step"))
        # As the arguments came (the same pytree structure: zero_shard's outputs that are
        # sharded state are found by matching the arguments' structures).
        return statics(out), tuple(_Lifted(graph, x.index, state[x.index]) for _, x in lifted)

    return pure


GradCall = tuple[Callable[..., Any], tuple[Any, ...], bool, Callable[[Any], Any]]


def split_for_grad(
    fun: Callable[..., Any], args: tuple[Any, ...], nums: Sequence[int], has_aux: bool
) -> GradCall | None:
    """For a gradient call whose differentiated arguments (``nums``) include NNX objects or
    Equinox models: a pure function to differentiate instead, its arguments, whether it returns
    aux, and how to turn its ``(value, grads)`` into the call's (updating NNX objects). For NNX
    the function takes their ``nnx.Param`` state and its aux carries ``fun``'s and the objects'
    other state after the call. None if there is no such object."""
    nums = sorted({i % len(args) for i in nums if -len(args) <= i < len(args)})
    eqx = sys.modules.get("equinox")
    if eqx is not None and any(_filters(args[i], eqx) for i in nums):
        return _filtered(fun, args, nums, eqx, has_aux)
    nnx = _nnx()
    if nnx is None:
        return None
    lifted = {i for i in nums if nnx.graph.is_graph_node(args[i])}
    if not lifted:
        return None
    parts = {}
    flat = list(args)
    for i in lifted:
        graph, params, rest = nnx.split(args[i], nnx.Param, ...)
        parts[i] = (graph, rest)
        flat[i] = params

    def pure(*flat: Any, **kw: Any) -> Any:
        a = list(flat)
        objs = {}
        for i, (graph, rest) in parts.items():
            objs[i] = a[i] = nnx.merge(graph, a[i], rest, copy=True)  # of this trace level
        out = fun(*a, **kw)
        value, aux = out if has_aux else (out, None)
        return value, (aux, {i: nnx.split(o, nnx.Param, ...)[2] for i, o in objs.items()})

    def finish(result: Any) -> Any:
        (value, (aux, rest)), grads = result
        for i, state in rest.items():
            nnx.update(args[i], state)
        return ((value, aux) if has_aux else value), grads

    return pure, tuple(flat), True, finish


def _filters(tree: Any, eqx: Any) -> bool:
    """Whether ``tree`` holds an Equinox model and leaves that are not floating-point arrays
    (what Equinox's filtering leaves out)."""
    held = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, eqx.Module))
    return any(isinstance(x, eqx.Module) for x in held) and not all(
        eqx.is_inexact_array(x) for x in jax.tree_util.tree_leaves(tree)
    )


def _filtered(
    fun: Callable[..., Any], args: tuple[Any, ...], nums: Sequence[int], eqx: Any, has_aux: bool
) -> GradCall:
    """Equinox's filtering: the differentiated arguments as their floating-point arrays (the
    gradients have None where the rest was), the rest passed through."""
    rest = {}
    flat = list(args)
    for i in nums:
        flat[i], rest[i] = eqx.partition(args[i], eqx.is_inexact_array)

    def pure(*flat: Any, **kw: Any) -> Any:
        a = list(flat)
        for i, static in rest.items():
            a[i] = eqx.combine(a[i], static)
        return fun(*a, **kw)

    return pure, tuple(flat), has_aux, lambda result: result


def broadcast_nodes(tree: Any, broadcast: Callable[[Any], Any]) -> Any:
    """``broadcast`` applied to the state of the NNX objects in ``tree`` (written back into
    them) and to the rest of the tree; the tree with its objects, updated in place."""
    nnx = _nnx()
    if nnx is None:
        return broadcast(tree)
    objs, treedef = jax.tree_util.tree_flatten(tree, is_leaf=nnx.graph.is_graph_node)
    where = [i for i, x in enumerate(objs) if nnx.graph.is_graph_node(x)]
    if not where:
        return broadcast(tree)
    nodes = tuple(objs[i] for i in where)
    rest = [x for i, x in enumerate(objs) if i not in set(where)]
    state, rest = broadcast((nnx.state(nodes), rest))
    nnx.update(nodes, state)
    it = iter(rest)
    return jax.tree_util.tree_unflatten(
        treedef, [x if nnx.graph.is_graph_node(x) else next(it) for x in objs]
    )


def shard_nodes(
    model: Any, optimizer: Any, shard: Callable[[Any, Any], tuple[Any, Any]]
) -> tuple[Any, Any] | None:
    """zero_shard's ``step.shard(model, optimizer)`` for NNX objects: ``shard`` (the functional
    one) applied to the model's ``nnx.Param`` state and the optimizer's state, written back into
    them; the same objects. None if neither is an NNX object."""
    nnx = _nnx()
    if nnx is None or not (nnx.graph.is_graph_node(model) or nnx.graph.is_graph_node(optimizer)):
        return None
    for what, x in (("model", model), ("optimizer", optimizer)):
        if not nnx.graph.is_graph_node(x):
            raise SpmdError(
                f"step.shard got a {type(x).__name__} as the {what} next to an NNX object; pass "
                "both as NNX objects (the model and its nnx.Optimizer) or both as pytrees",
                op="zero_shard",
            )
    params, state = shard(nnx.state(model, nnx.Param), nnx.state(optimizer))
    nnx.update(model, params)
    nnx.update(optimizer, state)
    return model, optimizer
