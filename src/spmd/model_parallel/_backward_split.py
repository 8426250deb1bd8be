"""A backward pass split in two, for the zero-bubble pipeline schedule: ``B``, the gradient of a
stage's input (what the previous stage waits for), and ``W``, the gradient of its parameters
(which nothing waits for, so it can fill the schedule's idle time).

JAX's VJP computes both in one function. :class:`BackwardSplit` traces that function once to a
jaxpr and partitions its equations: ``B`` runs every equation the input gradient needs, ``W``
every other equation the parameter gradient needs, and ``B`` hands ``W`` the values it computed
that ``W`` reads (the cotangents at the parameters' uses: the "frontier"). Nothing is computed
twice. An equation both need is ``B``'s: a stage whose backward pass is one opaque equation (a
``lax.scan`` over layers, one ``jax.jit``-compiled call) puts everything in ``B``, which is still
correct, only without the split's gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jcore

__all__ = ["BackwardSplit"]


class BackwardSplit:
    """``fn(*inputs) -> outputs`` (flat lists of arrays), split into ``b`` (the outputs at
    ``b_outputs``) and ``w`` (the others).

    ``b(*inputs) -> (b_outs, frontier)``; ``w(inputs, frontier) -> w_outs``. ``frontier_like``:
    the frontier's shapes (``jax.ShapeDtypeStruct``), for storage between the two.
    """

    def __init__(self, fn: Any, inputs_like: Sequence[Any], b_outputs: Sequence[int]) -> None:
        closed = jax.make_jaxpr(fn)(*inputs_like)
        jaxpr = closed.jaxpr
        self._consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        self._invars = list(jaxpr.invars)
        outs = list(jaxpr.outvars)
        b_set = set(b_outputs)
        self._b_outs = [v for k, v in enumerate(outs) if k in b_set]
        self._w_outs = [v for k, v in enumerate(outs) if k not in b_set]

        def needed(roots: Sequence[Any], eqns: Sequence[Any]) -> list[Any]:
            want = {v for v in roots if isinstance(v, jcore.Var)}
            picked = []
            for eqn in reversed(eqns):
                if any(v in want for v in eqn.outvars):
                    picked.append(eqn)
                    want.update(v for v in eqn.invars if isinstance(v, jcore.Var))
            return picked[::-1]

        self._b_eqns = needed(self._b_outs, jaxpr.eqns)
        in_b = {id(e) for e in self._b_eqns}
        self._w_eqns = needed(self._w_outs, [e for e in jaxpr.eqns if id(e) not in in_b])
        made_by_w = {v for e in self._w_eqns for v in e.outvars}
        inputs = set(self._invars) | set(self._consts)
        frontier: dict[Any, None] = {}  # in order of first use
        for v in [*(v for e in self._w_eqns for v in e.invars), *self._w_outs]:
            if isinstance(v, jcore.Var) and v not in made_by_w and v not in inputs:
                frontier[v] = None
        self._frontier = list(frontier)
        self.frontier_like = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                              for v in self._frontier]  # fmt: skip
        # Which inputs W reads (the others need not be kept for it).
        w_reads = {v for e in self._w_eqns for v in e.invars if isinstance(v, jcore.Var)}
        w_reads.update(v for v in self._w_outs if isinstance(v, jcore.Var))
        self.w_inputs = [k for k, v in enumerate(self._invars) if v in w_reads]

    def b(self, *inputs: Any) -> tuple[list[Any], list[Any]]:
        env = self._env(inputs)
        _run(self._b_eqns, env)
        return [_out(env, v) for v in self._b_outs], [env[v] for v in self._frontier]

    def w(self, inputs: Sequence[Any], frontier: Sequence[Any]) -> list[Any]:
        """``inputs``: all of them, or None where W does not read one (``w_inputs``)."""
        env = self._env(inputs)
        env.update(zip(self._frontier, frontier, strict=True))
        _run(self._w_eqns, env)
        return [_out(env, v) for v in self._w_outs]

    def _env(self, inputs: Sequence[Any]) -> dict[Any, Any]:
        env = dict(self._consts)
        env.update(zip(self._invars, inputs, strict=True))
        return env


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else env[v]


def _out(env: dict[Any, Any], v: Any) -> Any:
    """An output's value, a literal (a zero gradient, say) at the output's shape."""
    if isinstance(v, jcore.Literal):
        aval: Any = v.aval
        return jax.numpy.full(aval.shape, v.val, aval.dtype)
    return env[v]


def _run(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Binds ``eqns`` in order in the current trace (as ``jax.core.eval_jaxpr`` does)."""
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*[_read(env, v) for v in eqn.invars], **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = out
