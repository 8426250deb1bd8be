"""What a model-parallel layer (``spmd.model_parallel``) leaves for the transforms to read, the one
place the two stacks meet:

- gradient marks: :func:`mark_tree` marks a tree of gradients in the trace (as ``spmd.grad``
  does), so that ``data_parallel`` and ``zero_shard`` find and reduce them; :func:`active` is
  the step being traced, if any (the pipeline marks its stages' gradients);
- column marks: :func:`mark_column` marks a column-split product's output, which the trace
  checks is consumed by a row-split product or gathered (``spmd.trace``'s column check);
- framework boxes: :func:`register` tells the transforms how a framework's parameter box
  (linen's ``Partitioned``, an NNX variable, an Equinox layer) holds tensor-parallel blocks, so
  that a gradient of a block is reduced over the right ranks (:func:`box_groups`).

Public so that ``spmd.model_parallel`` (the package above this one) may use it; not re-exported
as ``spmd.*``.
"""

from __future__ import annotations

from ._boxes import box_groups, handler_of, is_block_box, is_box_or_sharded, register
from ._column import mark_column
from ._grad import active, mark_tree

__all__ = [
    "active",
    "box_groups",
    "handler_of",
    "is_block_box",
    "is_box_or_sharded",
    "mark_column",
    "mark_tree",
    "register",
]
