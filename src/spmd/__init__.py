"""spmd: JAX-style SPMD distributed training, one process per device.

Importing spmd starts nothing: no MPI, no JAX backend. :func:`spmd.init` does. The collectives
(``spmd.allreduce`` and the rest of :mod:`spmd.ops`) load JAX on first access, so that tools
such as ``spmd-run`` start fast.
"""

from typing import TYPE_CHECKING, Any

from ._errors import PerExampleGradientWarning as PerExampleGradientWarning
from ._errors import SpmdError as SpmdError
from ._errors import SpmdTypeError as SpmdTypeError
from ._version import __version__ as __version__
from .mesh import Mesh as Mesh
from .mesh import current_mesh as current_mesh
from .runtime import Communicator as Communicator
from .runtime import MessageQueue as MessageQueue
from .runtime import finalize as finalize
from .runtime import get_communicator as get_communicator
from .runtime import init as init
from .runtime import is_initialized as is_initialized
from .runtime import set_default_communicator as set_default_communicator

if TYPE_CHECKING:
    from . import checkpoint as checkpoint
    from . import data as data
    from . import model_parallel as model_parallel
    from . import ops as ops
    from . import parallel as parallel
    from . import perf as perf
    from . import random as random
    from . import sharded as sharded
    from . import transforms as transforms
    from .checkpoint import elastic as elastic
    from .checkpoint import load as load
    from .checkpoint import save as save
    from .model_parallel import context_parallel as context_parallel
    from .model_parallel import moe as moe
    from .model_parallel import pipeline as pipeline
    from .model_parallel import pipeline_value_and_grad as pipeline_value_and_grad
    from .model_parallel import tensor_parallel as tensor_parallel
    from .ops import all_to_all as all_to_all
    from .ops import all_to_allv as all_to_allv
    from .ops import allgather as allgather
    from .ops import allgatherv as allgatherv
    from .ops import allreduce as allreduce
    from .ops import barrier as barrier
    from .ops import broadcast as broadcast
    from .ops import recv as recv
    from .ops import reduce_scatter as reduce_scatter
    from .ops import reduce_scatterv as reduce_scatterv
    from .ops import send as send
    from .ops import sendrecv as sendrecv
    from .sharded import PartitionSpec as PartitionSpec
    from .sharded import ShardedArray as ShardedArray
    from .sharded import gather as gather
    from .sharded import shard as shard
    from .transforms import Program as Program
    from .transforms import broadcast_params as broadcast_params
    from .transforms import check as check
    from .transforms import data_parallel as data_parallel
    from .transforms import grad as grad
    from .transforms import join as join
    from .transforms import joined as joined
    from .transforms import no_sync as no_sync
    from .transforms import trace as trace
    from .transforms import value_and_grad as value_and_grad
    from .transforms import zero_shard as zero_shard

_OPS = (
    "all_to_all",
    "all_to_allv",
    "allgather",
    "allgatherv",
    "allreduce",
    "barrier",
    "broadcast",
    "recv",
    "reduce_scatter",
    "reduce_scatterv",
    "send",
    "sendrecv",
)


_PARALLEL = (
    "Program",
    "broadcast_params",
    "check",
    "data_parallel",
    "grad",
    "join",
    "joined",
    "no_sync",
    "pipeline_value_and_grad",
    "trace",
    "value_and_grad",
    "zero_shard",
)


_SHARDED = ("PartitionSpec", "ShardedArray", "gather", "shard")
_CHECKPOINT = ("load", "save")
_MODEL_PARALLEL = ("context_parallel", "moe", "pipeline", "tensor_parallel")
_PACKAGES = (
    "checkpoint",
    "data",
    "elastic",
    "model_parallel",
    "ops",
    "parallel",
    "perf",
    "random",
    "sharded",
    "transforms",
)


def __getattr__(name: str) -> Any:
    """A public name, imported when first used and then kept in the module, so that later uses
    (``spmd.allreduce`` in a loop) are plain attribute reads (4 us each through this function
    before)."""
    value = _resolve(name)
    globals()[name] = value
    return value


def _resolve(name: str) -> Any:
    import importlib

    if name in _PACKAGES:
        return importlib.import_module("." + name, __name__)
    if name in _MODEL_PARALLEL:
        return importlib.import_module(".model_parallel." + name, __name__)
    if name in _OPS:
        return getattr(importlib.import_module(".ops", __name__), name)
    if name == "pipeline_value_and_grad":
        return getattr(importlib.import_module(".model_parallel", __name__), name)
    if name in _PARALLEL:
        return getattr(importlib.import_module(".transforms", __name__), name)
    if name in _SHARDED:
        return getattr(importlib.import_module(".sharded", __name__), name)
    if name in _CHECKPOINT:
        return getattr(importlib.import_module(".checkpoint", __name__), name)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")


__all__ = [
    *_OPS,
    *_PARALLEL,
    *_SHARDED,
    *_CHECKPOINT,
    *_MODEL_PARALLEL,
    *_PACKAGES,
    "Communicator",
    "MessageQueue",
    "Mesh",
    "SpmdError",
    "SpmdTypeError",
    "PerExampleGradientWarning",
    "__version__",
    "current_mesh",
    "finalize",
    "get_communicator",
    "init",
    "is_initialized",
    "set_default_communicator",
]
