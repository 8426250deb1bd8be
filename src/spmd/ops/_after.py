"""``after``: values that wait for the collectives before them.

XLA places a computation wherever its data allows; spmd's collectives are ordered among
themselves by the chain (``_ordering``), but work that reads none of their results may run before
them. ``after(*xs)`` is a link of the chain that hands ``xs`` back, so that what reads its
results runs after every collective before it in the program.
"""

from __future__ import annotations

from typing import Any

from .._jax_compat import core, mlir
from ._ordering import register
from ._primitive import lower_collective

__all__ = ["after"]

after_p = core.Primitive("spmd_after")
after_p.multiple_results = True
after_p.def_impl(lambda *xs: list(xs))
after_p.def_abstract_eval(lambda *avals: list(avals))


def after(*xs: Any) -> list[Any]:
    """``xs`` (arrays), unchanged, available only once the collectives before this point of
    the program have run (on CPU: a custom call in the chain that copies them; on GPU they are
    returned as they are). For work that must not run ahead of a send: the zero-bubble
    pipeline's weight gradients, which XLA:CPU ran before the send of the gradient the previous
    stage waited for."""
    return list(after_p.bind(*xs)) if xs else []


def _lower_after(ctx: mlir.LoweringRuleContext, *xs: Any) -> list[Any]:
    # Not an optimization barrier on (order, xs), which XLA:CPU expands away, nor
    # ``x + 0 * order``, which it folds (a converted integer is finite): a custom call that
    # copies is a dependency XLA keeps.
    return lower_collective(ctx, "spmd_after", xs)


def _identity(ctx: mlir.LoweringRuleContext, *xs: Any) -> list[Any]:
    return list(xs)


mlir.register_lowering(after_p, _lower_after, platform="cpu", cacheable=False)
mlir.register_lowering(after_p, _identity, platform="cuda")
register(after_p)
