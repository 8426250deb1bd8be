"""Tensor-parallel layers as Flax NNX modules: ``spmd.tensor_parallel.nnx``.

Subclasses of ``nnx.Linear``, ``nnx.Embed`` and ``nnx.LayerNorm`` taking the same arguments
(the *full* feature counts), built on a mesh with a ``"tp"`` axis: each draws its keys as the
dense layer does, makes the full parameter and keeps this rank's block, so a model built on N tp
ranks holds the blocks of the dense model one process builds with the same ``nnx.Rngs``. Split
parameters are ``nnx.Param`` with the metadata ``tp_axis``, ``tp_group`` and ``tp_fused``;
``spmd.tensor_parallel.sharded(nnx.state(model))`` gives ShardedArrays of the dense layout and
``nnx.update(model, spmd.tensor_parallel.unsharded(tree, nnx.state(model)))`` puts them back.

Example (a world of one: the dense layer)::

    >>> import jax.numpy as jnp, spmd
    >>> from flax import nnx
    >>> with spmd.Mesh(tp=-1):
    ...     layer = spmd.tensor_parallel.nnx.ColumnLinear(3, 4, rngs=nnx.Rngs(0))
    ...     layer(jnp.ones((1, 3))).shape
    (1, 4)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..transforms.marks import register
from . import tensor_parallel as tp
from ._tp_common import Layout, block_of, group_name, group_of, local_size

__all__ = ["ColumnLinear", "LayerNorm", "RowLinear", "VocabEmbed"]


def _split(param: Any, layout: Layout, comm: Any) -> Any:
    return nnx.Param(
        block_of(param[...], layout, comm),
        tp_axis=layout.axis, tp_group=layout.group, tp_fused=layout.fused,
    )  # fmt: skip


class ColumnLinear(nnx.Linear):
    """``nnx.Linear(in_features, out_features)`` with the kernel split by output columns over
    ``group``: this rank's kernel is ``(in, out / tp)`` and its output ``(..., out / tp)``
    (what :class:`RowLinear` takes), or ``(..., out)`` with ``gather_output=True``.
    ``sequence_parallel``: the input is this rank's part of the sequence (axis -2).
    ``fused``: the dense kernel is ``fused`` parts side by side (``[q|k|v]``: 3), each rank
    holding its heads of each part."""

    def __init__(
        self, in_features: int, out_features: int, *, group: str = "tp",
        sequence_parallel: bool = False, gather_output: bool = False, fused: int = 1,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        comm = group_of(group, "ColumnLinear")
        local_size(out_features, comm, "out_features", "ColumnLinear")
        super().__init__(in_features, out_features, **kwargs)
        name = group_name(group)
        self.kernel = _split(self.kernel, Layout(1, name, fused), comm)
        if self.bias is not None:
            self.bias = _split(self.bias, Layout(0, name, fused), comm)
        self.group, self.fused = name, fused
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output

    def __call__(self, x: Any) -> Any:  # type: ignore[override]
        comm = group_of(self.group, "ColumnLinear")
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
        return tp._column_linear(
            x, kernel, bias, comm, self.gather_output, self.sequence_parallel, self.fused,
            type(self).__name__,
        )  # fmt: skip


class RowLinear(nnx.Linear):
    """``nnx.Linear(in_features, out_features)`` with the kernel split by input rows over
    ``group``: the input is this rank's ``(..., in / tp)`` features, the partial products are
    summed over the group and the bias (replicated) added once; with ``sequence_parallel`` the
    sum is reduce-scattered over the sequence axis (axis -2)."""

    def __init__(
        self, in_features: int, out_features: int, *, group: str = "tp",
        sequence_parallel: bool = False, **kwargs: Any,
    ) -> None:  # fmt: skip
        comm = group_of(group, "RowLinear")
        local_size(in_features, comm, "in_features", "RowLinear")
        super().__init__(in_features, out_features, **kwargs)
        self.group = group_name(group)
        self.kernel = _split(self.kernel, Layout(0, self.group), comm)
        self.sequence_parallel = sequence_parallel

    def __call__(self, x: Any) -> Any:  # type: ignore[override]
        comm = group_of(self.group, "RowLinear")
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
        return tp.row_linear(x, kernel, bias, group=comm, sequence_parallel=self.sequence_parallel)


class VocabEmbed(nnx.Embed):
    """``nnx.Embed(num_embeddings, features)`` with the table split by vocabulary rows over
    ``group``; :meth:`attend` is the tied head, this rank's ``(..., num_embeddings / tp)``
    logits for ``spmd.tensor_parallel.vocab_cross_entropy``."""

    def __init__(
        self, num_embeddings: int, features: int, *, group: str = "tp",
        sequence_parallel: bool = False, **kwargs: Any,
    ) -> None:  # fmt: skip
        comm = group_of(group, "VocabEmbed")
        local_size(num_embeddings, comm, "num_embeddings", "VocabEmbed")
        super().__init__(num_embeddings, features, **kwargs)
        self.group = group_name(group)
        self.embedding = _split(self.embedding, Layout(0, self.group), comm)
        self.sequence_parallel = sequence_parallel

    def __call__(self, ids: Any) -> Any:  # type: ignore[override]
        (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return tp.vocab_embed(ids, table, group=group_of(self.group, "VocabEmbed"))

    def attend(self, query: Any) -> Any:  # type: ignore[override]
        comm = group_of(self.group, "VocabEmbed")
        x, table = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        x = (
            tp.gather_sequence(x, group=comm)
            if self.sequence_parallel
            else tp.copy_to(x, group=comm)
        )
        return x @ table.T


class LayerNorm(nnx.LayerNorm):
    """``nnx.LayerNorm`` whose scale and bias are replicated over ``group``; with
    ``sequence_parallel`` it reads them through ``copy_to``, so that their gradients (each rank
    saw its part of the sequence) are summed over the group."""

    def __init__(
        self, num_features: int, *, group: str = "tp", sequence_parallel: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(num_features, **kwargs)
        self.group, self.sequence_parallel = group_name(group), sequence_parallel

    def __call__(self, x: Any, *, mask: Any = None) -> Any:
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        if self.sequence_parallel:
            scale, bias = tp.copy_to((scale, bias), group=group_of(self.group, "LayerNorm"))
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.maximum(jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * scale if scale is not None else y
        return y + bias if bias is not None else y


def _read(v: Any) -> Any:
    meta = v.get_metadata()
    return [(v[...], Layout(meta["tp_axis"], meta["tp_group"], meta.get("tp_fused", 1)))]


def _write(v: Any, values: Any) -> Any:
    out = v.replace(values[0]) if hasattr(v, "replace") else nnx.Param(values[0])
    return out


register(lambda x: isinstance(x, nnx.Variable) and "tp_axis" in x.get_metadata(), _read, _write)
