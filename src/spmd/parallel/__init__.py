"""Transforms: the traced op list (``spmd.trace``), gradients that passes can find
(``spmd.grad``), and the data-parallel and ZeRO transforms with their passes."""

from ._data_parallel import DataParallel as DataParallel
from ._data_parallel import allreduce_gradients as allreduce_gradients
from ._data_parallel import broadcast_params as broadcast_params
from ._data_parallel import data_parallel as data_parallel
from ._data_parallel import no_sync as no_sync
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._program import Env as Env
from ._program import Op as Op
from ._program import Program as Program
from ._program import eval_eqn as eval_eqn
from ._program import retrace as retrace
from ._program import trace as trace
from ._zero import ZeroShard as ZeroShard
from ._zero import partition as partition
from ._zero import zero_shard as zero_shard

__all__ = [
    "DataParallel",
    "Env",
    "Op",
    "Program",
    "ZeroShard",
    "allreduce_gradients",
    "broadcast_params",
    "data_parallel",
    "eval_eqn",
    "grad",
    "no_sync",
    "partition",
    "retrace",
    "trace",
    "value_and_grad",
    "zero_shard",
]
