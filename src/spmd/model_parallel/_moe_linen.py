"""A mixture-of-experts layer as a Flax linen module: ``spmd.moe.linen.MoE``.

The experts are any linen module (one expert: ``(rows, D) -> (rows, D_out)``); the layer holds a
router ``(D, E)``, replicated, and this rank's ``E / ep`` experts stacked on axis 0 of each
parameter, boxed as ``flax.linen.Partitioned`` over the ``ep`` axis. Expert ``e`` is initialised
from the ``e``-th of ``E`` keys split from the layer's, so N ep ranks hold the blocks of the
experts one process builds with the same key (each rank makes all E at init and keeps its own).
Data parallel and ZeRO see the boxes' axis: the expert gradients are reduced over the ranks that
hold the same experts only, as for :func:`spmd.moe.shard_experts`.

Example (a world of one holds every expert)::

    >>> import flax.linen as nn, jax, jax.numpy as jnp, spmd
    >>> with spmd.Mesh(ep=-1):
    ...     layer = spmd.moe.linen.MoE(nn.Dense(3), num_experts=4, k=2)
    ...     params = layer.init(jax.random.key(0), jnp.ones((5, 3)))
    ...     y, aux = layer.apply(params, jnp.ones((5, 3)))
    >>> y.shape, params["params"]["experts"]["kernel"].value.shape
    ((5, 3), (4, 3, 3))
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import _tp_linen  # noqa: F401  (registers linen's boxes with _tp_common)
from ._tp_common import Layout, block_of, group_of, local_size
from .moe import moe

__all__ = ["MoE"]


class MoE(nn.Module):
    """``spmd.moe.moe`` with its router and experts as this module's parameters; returns
    ``(y, aux_loss)`` (add ``aux_loss``, times a small coefficient, to the loss).

    ``expert``: one expert, an unbound linen module; ``num_experts``: E, a multiple of the
    ``group`` axis' size; ``k``, ``capacity_factor``: as for ``spmd.moe.moe``."""

    expert: nn.Module
    num_experts: int
    k: int = 2
    capacity_factor: float | None = None
    group: str = "ep"
    router_init: Any = nn.initializers.lecun_normal()
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Any) -> tuple[Any, Any]:
        comm = group_of(self.group, "MoE")
        local_size(self.num_experts, comm, f"{self.name}: num_experts", "MoE")
        d = jnp.shape(x)[-1]
        router = self.param("router", self.router_init, (d, self.num_experts), self.param_dtype)
        expert = self.expert.clone(parent=None, name=None)  # used as a function, unbound
        sample = jnp.zeros((1, d), self.param_dtype)

        def init_experts(key: Any) -> Any:
            keys = jax.random.split(key, self.num_experts)
            full = jax.vmap(lambda k: expert.init(k, sample)["params"])(keys)
            layout = Layout(0, self.group)
            return jax.tree_util.tree_map(
                lambda v: nn.Partitioned(
                    block_of(v, layout, comm), (self.group,) + (None,) * (v.ndim - 1)
                ),
                full,
            )

        experts = self.param("experts", init_experts)
        return moe(
            x,
            router,
            lambda p, t: expert.apply({"params": p}, t),
            experts,
            k=self.k,
            capacity_factor=self.capacity_factor,
            group=self.group,
        )
