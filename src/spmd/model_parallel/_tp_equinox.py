"""Tensor-parallel layers as Equinox modules: ``spmd.tensor_parallel.equinox``.

``ColumnLinear``, ``RowLinear``, ``VocabEmbedding`` and ``LayerNorm`` take the arguments of
``eqx.nn.Linear``, ``eqx.nn.Embedding`` and ``eqx.nn.LayerNorm`` (the *full* feature counts and
the same ``key``), build the dense layer's parameters from that key and keep this rank's block,
so a model built on N tp ranks holds the blocks of the dense model one process builds. Weights
keep Equinox's layout (``(out, in)``). Unlike Equinox's own layers they take ``(..., features)``
arrays (a sequence at once, no ``jax.vmap``), which sequence parallelism needs.
``spmd.tensor_parallel.sharded(model)`` gives the model with ShardedArrays of the dense layout
in place of the blocks; ``spmd.tensor_parallel.unsharded(tree, model)`` puts them back.

Example (a world of one: the dense layer)::

    >>> import jax, jax.numpy as jnp, spmd
    >>> with spmd.Mesh(tp=-1):
    ...     layer = spmd.tensor_parallel.equinox.ColumnLinear(3, 4, key=jax.random.key(0))
    ...     layer(jnp.ones((2, 3))).shape
    (2, 4)
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from ..transforms.marks import register
from . import tensor_parallel as tp
from ._tp_common import Layout, block_of, group_name, group_of, local_size

__all__ = ["ColumnLinear", "LayerNorm", "RowLinear", "VocabEmbedding"]


class ColumnLinear(eqx.Module):
    """``eqx.nn.Linear(in_features, out_features)`` split by output features over ``group``:
    this rank's ``weight`` is ``(out / tp, in)`` and its output ``(..., out / tp)`` (what
    :class:`RowLinear` takes), or ``(..., out)`` with ``gather_output=True``.
    ``sequence_parallel``: the input is this rank's part of the sequence (axis -2). ``fused``:
    the dense weight is ``fused`` parts (``[q|k|v]``: 3), each rank holding its heads of each."""

    spmd_tp_blocks: ClassVar[bool] = True  # (spmd.save refuses the blocks as they are)
    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    group: str = eqx.field(static=True)
    fused: int = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    gather_output: bool = eqx.field(static=True)

    def __init__(
        self, in_features: int, out_features: int, use_bias: bool = True, dtype: Any = None, *,
        key: Any, group: str = "tp", sequence_parallel: bool = False,
        gather_output: bool = False, fused: int = 1,
    ) -> None:  # fmt: skip
        comm = group_of(group, "ColumnLinear")
        local_size(out_features, comm, "out_features", "ColumnLinear")
        dense = eqx.nn.Linear(in_features, out_features, use_bias, dtype=dtype, key=key)
        self.group, self.fused = group_name(group), fused
        self.weight = block_of(dense.weight, Layout(0, self.group, fused), comm)
        self.bias = (
            None if dense.bias is None else block_of(dense.bias, Layout(0, self.group, fused), comm)
        )
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output

    def __call__(self, x: Any) -> Any:
        return tp._column_linear(
            x, self.weight.T, self.bias, group_of(self.group, "ColumnLinear"),
            self.gather_output, self.sequence_parallel, self.fused, type(self).__name__,
        )  # fmt: skip


class RowLinear(eqx.Module):
    """``eqx.nn.Linear(in_features, out_features)`` split by input features over ``group``: the
    input is this rank's ``(..., in / tp)``, the partial products are summed over the group and
    the bias (replicated) added once; with ``sequence_parallel`` the sum is reduce-scattered
    over the sequence axis (axis -2)."""

    spmd_tp_blocks: ClassVar[bool] = True  # (spmd.save refuses the blocks as they are)
    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    group: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self, in_features: int, out_features: int, use_bias: bool = True, dtype: Any = None, *,
        key: Any, group: str = "tp", sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        comm = group_of(group, "RowLinear")
        local_size(in_features, comm, "in_features", "RowLinear")
        dense = eqx.nn.Linear(in_features, out_features, use_bias, dtype=dtype, key=key)
        self.group = group_name(group)
        self.weight = block_of(dense.weight, Layout(1, self.group), comm)
        self.bias = dense.bias
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel

    def __call__(self, x: Any) -> Any:
        return tp.row_linear(
            x, self.weight.T, self.bias, group=group_of(self.group, "RowLinear"),
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip


class VocabEmbedding(eqx.Module):
    """``eqx.nn.Embedding(num_embeddings, embedding_size)`` split by vocabulary rows over
    ``group``; takes ids of any shape. :meth:`attend` is the tied head: this rank's
    ``(..., num_embeddings / tp)`` logits for ``spmd.tensor_parallel.vocab_cross_entropy``."""

    spmd_tp_blocks: ClassVar[bool] = True  # (spmd.save refuses the blocks as they are)
    weight: jax.Array
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    group: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self, num_embeddings: int, embedding_size: int, dtype: Any = None, *, key: Any,
        group: str = "tp", sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        comm = group_of(group, "VocabEmbedding")
        local_size(num_embeddings, comm, "num_embeddings", "VocabEmbedding")
        dense = eqx.nn.Embedding(num_embeddings, embedding_size, dtype=dtype, key=key)
        self.group = group_name(group)
        self.weight = block_of(dense.weight, Layout(0, self.group), comm)
        self.num_embeddings, self.embedding_size = num_embeddings, embedding_size
        self.sequence_parallel = sequence_parallel

    def __call__(self, ids: Any) -> Any:
        return tp.vocab_embed(ids, self.weight, group=group_of(self.group, "VocabEmbedding"))

    def attend(self, x: Any) -> Any:
        comm = group_of(self.group, "VocabEmbedding")
        x = (
            tp.gather_sequence(x, group=comm)
            if self.sequence_parallel
            else tp.copy_to(x, group=comm)
        )
        return x @ self.weight.T


class LayerNorm(eqx.Module):
    """``eqx.nn.LayerNorm(shape)`` over the last axis of ``(..., shape)`` inputs, its weight and
    bias replicated over ``group``; with ``sequence_parallel`` it reads them through
    ``copy_to``, so that their gradients (each rank saw its part of the sequence) are summed."""

    weight: jax.Array | None
    bias: jax.Array | None
    shape: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    group: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self, shape: int, eps: float = 1e-5, use_weight: bool = True, use_bias: bool = True,
        dtype: Any = None, *, group: str = "tp", sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        dense = eqx.nn.LayerNorm(shape, eps, use_weight, use_bias, dtype=dtype)
        self.weight, self.bias = dense.weight, dense.bias
        self.shape, self.eps = shape, eps
        self.group, self.sequence_parallel = group_name(group), sequence_parallel

    def __call__(self, x: Any) -> Any:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = tp.copy_to((weight, bias), group=group_of(self.group, "LayerNorm"))
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * weight if weight is not None else y
        return y + bias if bias is not None else y


def _read(m: Any) -> Any:
    if isinstance(m, ColumnLinear):
        weight, bias = Layout(0, m.group, m.fused), Layout(0, m.group, m.fused)
    elif isinstance(m, RowLinear):
        weight, bias = Layout(1, m.group), None
    else:
        return [(m.weight, Layout(0, m.group))]
    return [(m.weight, weight)] + ([(m.bias, bias)] if m.bias is not None else [])


def _write(m: Any, values: Any) -> Any:
    if len(values) == 1:
        return eqx.tree_at(lambda t: t.weight, m, values[0])
    return eqx.tree_at(lambda t: (t.weight, t.bias), m, tuple(values))


register(
    lambda x: isinstance(x, ColumnLinear | RowLinear | VocabEmbedding),
    _read,
    _write,
    container=True,
)
