"""spmd's exceptions and warnings.

Every error spmd raises on purpose is a :class:`SpmdError`. Its messages start with the rank that
raised it and say what was received, what was expected, and how to fix it.
"""

from __future__ import annotations


class SpmdError(ValueError):
    """Base class of spmd's errors (a ``ValueError``): bad input, or ranks that disagree."""


class SpmdTypeError(SpmdError, TypeError):
    """An argument of the wrong type (both a :class:`SpmdError` and a ``TypeError``)."""


class PerExampleGradientWarning(UserWarning):
    """``spmd.grad`` under ``jax.vmap`` with unbatched parameters inside a parallel step: its
    gradients are averaged across ranks index by index, wrong for per-example gradients
    (docs/data_parallel.md). Silence it where the vmapped index means the same thing on every
    rank: ``warnings.filterwarnings("ignore", category=spmd.PerExampleGradientWarning)``."""
