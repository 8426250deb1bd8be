"""``spmd.parallel``: the names of the transforms (:mod:`spmd.transforms`) and
``pipeline_value_and_grad`` (:mod:`spmd.model_parallel`), kept importable here as they were
before the two stacks became packages of their own. ``spmd.parallel.tensor_parallel``,
``.moe``, ``.pipeline`` and ``.context_parallel`` are the modules of
:mod:`spmd.model_parallel`.
"""

from typing import Any

from ..model_parallel import pipeline_value_and_grad as pipeline_value_and_grad
from ..transforms import *  # noqa: F403 (the same names, one list: spmd.transforms.__all__)
from ..transforms import __all__ as _TRANSFORMS

__all__ = [*_TRANSFORMS, "pipeline_value_and_grad"]

_MODEL_PARALLEL = ("context_parallel", "moe", "pipeline", "tensor_parallel")


def __getattr__(name: str) -> Any:
    if name in _MODEL_PARALLEL:
        import importlib

        return importlib.import_module("spmd.model_parallel." + name)
    raise AttributeError(f"module 'spmd.parallel' has no attribute {name!r}")
