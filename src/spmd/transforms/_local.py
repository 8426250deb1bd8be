"""``spmd.no_sync``'s passes: a step called inside ``no_sync()`` returns its gradients local
(:func:`return_local`), and the next step adds what was accumulated before it reduces
(:func:`add_accumulated`, chained before the reducing pass). ``data_parallel`` chains them by
variant (docs/architecture.md, "The built-in passes and chains")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ._grad import mark_p
from ._passes import Pass, gradient_leaves, map_gradients
from ._program import Env, Program, eval_eqn, retrace

__all__ = ["add_accumulated", "return_local"]


def add_accumulated() -> Pass:
    """The program takes one more input per marked gradient, last, in the order of
    :func:`~spmd.transforms.gradient_leaves` (named ``pending`` and the gradient's path): the
    gradients accumulated so far, added to each floating gradient right after the op that
    produces it (a float0 gradient holds nothing). The marks stay, for the pass after it.

    Example (a world of one)::

        >>> import jax.numpy as jnp, spmd
        >>> program = spmd.trace(spmd.grad(lambda w: jnp.sum(w**2)))(jnp.ones(2))
        >>> spmd.transforms.add_accumulated()(program)(jnp.ones(2), jnp.full(2, 10.0))
        Array([12., 12.], dtype=float32)
    """

    def apply(program: Program) -> Program:
        leaves, _ = gradient_leaves(program)
        return map_gradients(
            program,
            lambda g, leaf, acc: g + acc[leaf.k],
            [(f"pending{leaf.path}", leaf.src.aval) for leaf in leaves],
        )

    return apply


def return_local() -> Pass:
    """A step inside ``no_sync()``: nothing is communicated; the step reads its own (local)
    gradients, and the program returns them too, as one more output per marked gradient after
    its results, in the order of :func:`~spmd.transforms.gradient_leaves` (to be accumulated).
    The marks are removed.

    Example (a world of one)::

        >>> import jax.numpy as jnp, spmd
        >>> program = spmd.trace(spmd.grad(lambda w: jnp.sum(w**2)))(jnp.ones(2))
        >>> grads, local = spmd.transforms.return_local()(program)(jnp.ones(2))
        >>> local
        [Array([2., 2.], dtype=float32)]
    """

    def apply(program: Program) -> Program:
        leaves, _ = gradient_leaves(program)
        jaxpr = program.jaxpr.jaxpr
        n_in = len(jaxpr.invars)

        def body(env: Env, xs: Sequence[Any]) -> list[Any]:
            for v, x in zip(jaxpr.invars, xs[:n_in], strict=True):
                env.write(v, x)
            local: list[Any] = []
            for eqn in jaxpr.eqns:
                ins = [env.read(a) for a in eqn.invars]
                if eqn.primitive is mark_p:  # removed: the values pass through
                    outs = ins
                    if eqn.params["kind"] == "grad":
                        local += ins
                else:
                    outs = eval_eqn(eqn, ins)
                for v, val in zip(eqn.outvars, outs, strict=True):
                    env.write(v, val)
            return [env.read(v) for v in jaxpr.outvars] + local

        out = jax.tree_util.tree_unflatten(program.out_tree, [0] * program.out_tree.num_leaves)
        return program.replace(
            retrace(program, body),
            jax.tree_util.tree_structure((out, [0] * len(leaves))),
        )

    return apply
