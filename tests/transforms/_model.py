"""A small MLP, its data and a single-process reference trainer for the parity tests."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spmd

IN, HIDDEN, OUT = 6, 12, 3
ROWS_PER_RANK = 8


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.5,
        "b1": jax.random.normal(k3, (HIDDEN,)) * 0.1,
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) * 0.5,
    }


def loss_fn(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def global_batches(steps: int, world: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The same global batches on every rank (world x ROWS_PER_RANK rows each)."""
    rng = np.random.default_rng(seed)
    rows = world * ROWS_PER_RANK
    return [
        (rng.standard_normal((rows, IN)).astype(np.float32), rng.integers(0, OUT, rows))
        for _ in range(steps)
    ]


def optimizers() -> dict[str, optax.GradientTransformation]:
    return {"sgd": optax.sgd(0.3), "adam": optax.adam(0.05)}


def make_step(tx: optax.GradientTransformation, **options: Any) -> Any:
    @spmd.data_parallel(**options)
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = spmd.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def reference(tx: optax.GradientTransformation, batches: list[Any]) -> list[Any]:
    """Parameters after every step of one process training on the global batches."""

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init_params()
    opt_state = tx.init(params)
    history = []
    for b in batches:
        params, opt_state = step(params, opt_state, b)
        history.append(params)
    return history


def assert_same_everywhere(comm: Any, tree: Any) -> None:
    """Bitwise identical on every rank."""
    mine = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]
    for r, other in enumerate(comm.allgather_object(mine)):
        assert other == mine, f"rank {r} holds other parameters than rank {comm.rank}"


def assert_close(got: Any, want: Any, rtol: float, what: str) -> None:
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = want
        for k in path:
            w = w[k.key]
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * 1e-1,
            err_msg=f"{what} {jax.tree_util.keystr(path)}",
        )  # fmt: skip
