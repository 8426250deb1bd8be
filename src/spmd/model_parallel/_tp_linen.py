"""Tensor-parallel layers as Flax linen modules: ``spmd.tensor_parallel.linen``.

Drop-in for ``nn.Dense``, ``nn.Embed`` and ``nn.LayerNorm`` in a model that runs on a mesh with
a ``"tp"`` axis: the same parameter names, initializers and dtypes, each parameter holding
this rank's block (its local shape, so that linen's shape check passes). A model built from
them on N tp ranks holds the blocks of the dense model that one process builds with the same
key. Split parameters are boxed as ``flax.linen.Partitioned`` (``names`` give the mesh axis of
each dimension; ``nn.get_partition_spec`` reads them); ``spmd.tensor_parallel.sharded(params)``
turns them into ShardedArrays of the dense layout (for ``spmd.gather``, ``spmd.save`` and the
checkpoint exports). Replicated parameters (a norm's, a row-parallel bias) are plain arrays.

Example (a world of one: the dense layer)::

    >>> import jax, jax.numpy as jnp, spmd
    >>> tp = spmd.tensor_parallel.linen
    >>> with spmd.Mesh(tp=-1):
    ...     layer = tp.ColumnDense(4)
    ...     params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    ...     layer.apply(params, jnp.ones((1, 3))).shape
    (1, 4)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import struct

from ..transforms.marks import register
from . import tensor_parallel as tp
from ._tp_common import Layout, block_init, group_name, group_of, local_size

__all__ = ["ColumnDense", "LayerNorm", "RowDense", "VocabEmbed"]

_default_kernel_init = nn.initializers.lecun_normal()
_default_embed_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class FusedPartitioned(nn.Partitioned):  # type: ignore[type-arg]
    """A fused kernel's block (``fused`` parts side by side, each this rank's heads)."""

    fused: int = struct.field(pytree_node=False, default=1)


def _boxed(init: Any, full: tuple[int, ...], layout: Layout, comm: Any) -> Any:
    make = block_init(init, full, layout, comm)
    names = tuple(layout.group if i == layout.axis % len(full) else None for i in range(len(full)))

    def boxed(key: Any, shape: Any, dtype: Any = jnp.float32) -> Any:
        if layout.fused > 1:
            return FusedPartitioned(make(key, shape, dtype), names, fused=layout.fused)
        return nn.Partitioned(make(key, shape, dtype), names)

    return boxed


def _param(
    module: Any, name: str, init: Any, full: Any, local: Any, layout: Layout, comm: Any
) -> Any:
    """``module``'s parameter ``name``: this rank's block (shape ``local``) of what ``init``
    makes of the full shape, boxed with its layout."""
    return module.param(name, _boxed(init, full, layout, comm), local, module.param_dtype)


class ColumnDense(nn.Module):
    """``nn.Dense(features)`` with the kernel split by output columns over ``group``: this
    rank's kernel is ``(in, features / tp)`` and its output ``(..., features / tp)`` (what
    :class:`RowDense` takes), or ``(..., features)`` with ``gather_output=True``.
    ``sequence_parallel``: the input is this rank's part of the sequence (axis -2), gathered
    here. ``fused``: the dense kernel is ``fused`` parts side by side (``[q|k|v]``: 3) and each
    rank holds its heads of each part, so the output splits into its parts on every rank."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    group: str = "tp"
    gather_output: bool = False
    sequence_parallel: bool = False
    fused: int = 1

    @nn.compact
    def __call__(self, x: Any) -> Any:
        comm = group_of(self.group, "ColumnDense")
        layout = Layout(1, group_name(self.group), self.fused)
        width = local_size(self.features, comm, f"{self.name}: features", "ColumnDense")
        full = (jnp.shape(x)[-1], self.features)
        kernel = _param(self, "kernel", self.kernel_init, full, (full[0], width), layout, comm)
        bias = None
        if self.use_bias:
            b_layout = Layout(0, layout.group, self.fused)
            bias = _param(self, "bias", self.bias_init, (self.features,), (width,), b_layout, comm)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        return tp._column_linear(
            x, kernel, bias, comm, self.gather_output, self.sequence_parallel, self.fused,
            "/".join(self.path) or str(self.name),
        )  # fmt: skip


class RowDense(nn.Module):
    """``nn.Dense(features)`` with the kernel split by input rows over ``group``: the input is
    this rank's ``(..., in / tp)`` features (:class:`ColumnDense`'s output), the partial
    products are summed over the group and the bias (replicated) added once. With
    ``sequence_parallel`` the sum is reduce-scattered over the sequence axis (axis -2)."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    group: str = "tp"
    sequence_parallel: bool = False

    @nn.compact
    def __call__(self, x: Any) -> Any:
        comm = group_of(self.group, "RowDense")
        layout = Layout(0, group_name(self.group))
        rows = jnp.shape(x)[-1]
        full = (rows * comm.size, self.features)
        kernel = _param(self, "kernel", self.kernel_init, full, (rows, self.features), layout, comm)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        return tp.row_linear(x, kernel, bias, group=comm, sequence_parallel=self.sequence_parallel)


class VocabEmbed(nn.Module):
    """``nn.Embed(num_embeddings, features)`` with the table split by vocabulary rows over
    ``group``: every rank gets the full embeddings of the ids (the same on every rank).
    :meth:`attend` is the tied output head: this rank's ``(..., num_embeddings / tp)`` logits,
    for ``spmd.tensor_parallel.vocab_cross_entropy``."""

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: Any = _default_embed_init
    group: str = "tp"
    sequence_parallel: bool = False

    def setup(self) -> None:
        comm = group_of(self.group, "VocabEmbed")
        layout = Layout(0, group_name(self.group))
        rows = local_size(self.num_embeddings, comm, "num_embeddings", "VocabEmbed")
        full = (self.num_embeddings, self.features)
        self.embedding = _param(
            self, "embedding", self.embedding_init, full, (rows, self.features), layout, comm
        )

    def __call__(self, ids: Any) -> Any:
        (table,) = nn.dtypes.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return tp.vocab_embed(ids, table, group=group_of(self.group, "VocabEmbed"))

    def attend(self, x: Any) -> Any:
        """``x @ table.T`` for this rank's rows: ``(..., num_embeddings / tp)`` logits. ``x`` is
        replicated over the group (with ``sequence_parallel``, this rank's part of the
        sequence, gathered here)."""
        comm = group_of(self.group, "VocabEmbed")
        x, table = nn.dtypes.promote_dtype(x, self.embedding, dtype=self.dtype)
        if self.sequence_parallel:
            x = tp.gather_sequence(x, group=comm)
        else:
            x = tp.copy_to(x, group=comm)
        return x @ table.T


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` whose scale and bias are replicated over ``group``; with
    ``sequence_parallel`` it reads them through ``copy_to``, so that their gradients (each rank
    saw its part of the sequence) are summed over the group."""

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Any = nn.initializers.zeros_init()
    scale_init: Any = nn.initializers.ones_init()
    group: str = "tp"
    sequence_parallel: bool = False

    @nn.compact
    def __call__(self, x: Any) -> Any:
        features = jnp.shape(x)[-1]
        y = nn.LayerNorm(
            epsilon=self.epsilon, dtype=self.dtype, use_bias=False, use_scale=False,
            name="norm",
        )(x)  # fmt: skip
        shape = (features,)
        scale = (
            self.param("scale", self.scale_init, shape, self.param_dtype) if self.use_scale else 1
        )
        bias = self.param("bias", self.bias_init, shape, self.param_dtype) if self.use_bias else 0
        if self.sequence_parallel:
            scale, bias = tp.copy_to((scale, bias), group=group_of(self.group, "LayerNorm"))
        y = y * scale + bias
        return jnp.asarray(y, self.dtype) if self.dtype is not None else y


def _read(box: Any) -> Any:
    if not box.names or not any(box.names):
        return [(box.value, None)]
    axis = next(i for i, n in enumerate(box.names) if n)
    return [(box.value, Layout(axis, box.names[axis], getattr(box, "fused", 1)))]


register(lambda x: isinstance(x, nn.Partitioned), _read, lambda box, v: box.replace(value=v[0]))
