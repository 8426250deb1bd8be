"""Model-parallel layers: what a model is written with, not passes over a traced program.

- ``spmd.tensor_parallel`` (:mod:`spmd.model_parallel.tensor_parallel`): column- and row-split
  products, attention over split heads, sequence parallelism, and framework modules (Flax linen,
  NNX, Equinox) whose parameters are blocks;
- ``spmd.moe``: mixture-of-experts layers whose experts are spread over an ``ep`` axis;
- ``spmd.pipeline``: stages over a ``pp`` axis, with GPipe, 1F1B, interleaved and zero-bubble
  schedules (``spmd.pipeline_value_and_grad``);
- ``spmd.context_parallel``: ring attention over a ``cp`` axis.

They sit above the transforms (``spmd.transforms``): a layer marks what the transforms must see
(gradients, column splits, framework boxes) through :mod:`spmd.transforms.marks`, and the
transforms never import a layer.
"""

from .pipeline import value_and_grad as pipeline_value_and_grad

__all__ = ["pipeline_value_and_grad"]
