"""@spmd.data_parallel with an Equinox model and an optax optimizer.

    spmd-run -n 2 python examples/equinox_mlp.py

An Equinox module is a pytree whose leaves are its arrays and (static) Python objects. The
step splits the model into its trainable arrays and the rest with ``eqx.partition``, and lets
``spmd.value_and_grad`` differentiate the arrays; the data-parallel transform averages those
gradients over the ranks. The task: fit y = sin(3x) on [-1, 1], each rank on its own samples.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import spmd


def main() -> None:
    comm = spmd.init()
    model = eqx.nn.MLP(in_size=1, out_size=1, width_size=64, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = spmd.broadcast_params(params)
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @spmd.data_parallel
    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = spmd.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    key = jax.random.fold_in(jax.random.key(1), comm.rank)  # every rank its own samples
    for i in range(300):
        key, sub = jax.random.split(key)
        x = jax.random.uniform(sub, (32, 1), minval=-1.0, maxval=1.0)
        params, opt_state, loss = step(params, opt_state, x, jnp.sin(3 * x))
        if comm.rank == 0 and (i + 1) % 100 == 0:
            print(f"step {i + 1}: loss {float(loss):.5f}")

    grid = jnp.linspace(-1, 1, 101)[:, None]
    model = eqx.combine(params, static)
    error = float(jnp.max(jnp.abs(jax.vmap(model)(grid) - jnp.sin(3 * grid))))
    if comm.rank == 0:
        print(f"max |model(x) - sin(3x)| on [-1, 1]: {error:.4f}")
    spmd.finalize()


if __name__ == "__main__":
    main()
