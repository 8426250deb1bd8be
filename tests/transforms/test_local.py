"""no_sync's passes on their own (a world of one): add_accumulated adds what was accumulated
right after each gradient is produced and keeps the marks; return_local returns the local
gradients after the results and removes the marks; chained, they accumulate."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import spmd
from spmd.transforms import add_accumulated, chain, gradient_leaves, reduce_gradients, return_local


def _program() -> spmd.Program:
    def f(p, x):
        loss, g = spmd.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(p)
        return loss, g

    p = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.ones((4, 2)) * 0.2}
    return spmd.trace(f)(p, jnp.ones((5, 3)))


def test_add_accumulated_adds_after_each_gradient_and_keeps_the_marks():
    program = _program()
    p = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.ones((4, 2)) * 0.2}
    x = jnp.ones((5, 3))
    loss, g = program(p, x)
    added = add_accumulated()(program)
    assert added.in_names[-2:] == ("pending['a']", "pending['b']")
    assert len(gradient_leaves(added)[0]) == 2
    acc = [jnp.full((3, 4), 1.5), jnp.full((4, 2), -2.0)]
    loss2, g2 = added(p, x, *acc)
    assert float(loss2) == float(loss)  # the loss is not touched
    np.testing.assert_allclose(g2["a"], g["a"] + 1.5, rtol=1e-6)
    np.testing.assert_allclose(g2["b"], g["b"] - 2.0, rtol=1e-6)
    # b's gradient is produced first in the backward pass: its addition comes before a's
    # gradient is computed, where a bucketed reduction can start.
    names = [op.name for op in added.ops]
    adds = [i for i, n in enumerate(names) if n == "add" and i > names.index("tanh")]
    assert adds and adds[0] < max(i for i, n in enumerate(names) if n == "dot_general")


def test_return_local_returns_the_gradients_and_chains_with_the_accumulation():
    program = _program()
    p = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.ones((4, 2)) * 0.2}
    x = jnp.ones((5, 3))
    _, g = program(p, x)
    (_, g1), local = return_local()(program)(p, x)
    np.testing.assert_array_equal(g1["a"], g["a"])
    np.testing.assert_array_equal(local[0], g["a"])
    np.testing.assert_array_equal(local[1], g["b"])
    assert "spmd.mark" not in [op.name for op in return_local()(program).ops]
    # Two micro-steps accumulated, then synchronised: three times the gradient.
    _, twice = chain(add_accumulated(), return_local())(program)(p, x, *local)
    np.testing.assert_allclose(twice[0], 2 * g["a"], rtol=1e-6)
    _, g3 = chain(add_accumulated(), reduce_gradients())(program)(p, x, *twice)
    np.testing.assert_allclose(g3["b"], 3 * g["b"], rtol=1e-6)
