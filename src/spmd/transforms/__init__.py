"""Transforms: the traced op list (``spmd.trace``), gradients that passes can find
(``spmd.grad``), the step base and its passes, and the data-parallel and ZeRO transforms.
The model-parallel layers are a package of their own (``spmd.model_parallel``), above this
one: what they leave in a trace for the transforms goes through :mod:`spmd.transforms.marks`.

A transform is a :class:`Step` with a chain of passes (functions ``Program -> Program``):
``data_parallel`` runs :func:`reduce_gradients`, ``zero_shard`` runs :func:`shard_state`.
docs/architecture.md, "Writing a pass", shows how to add one.
"""

from ._check import check as check
from ._data_parallel import DataParallel as DataParallel
from ._data_parallel import broadcast_params as broadcast_params
from ._data_parallel import data_parallel as data_parallel
from ._data_parallel import reduce_gradients as reduce_gradients
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._join import join as join
from ._join import joined as joined
from ._join import weight_joined as weight_joined
from ._local import add_accumulated as add_accumulated
from ._local import return_local as return_local
from ._partition import shard_state as shard_state
from ._passes import Pass as Pass
from ._passes import chain as chain
from ._passes import gradient_leaves as gradient_leaves
from ._program import Env as Env
from ._program import Op as Op
from ._program import Program as Program
from ._program import eval_eqn as eval_eqn
from ._program import retrace as retrace
from ._program import trace as trace
from ._step import Step as Step
from ._step import Traced as Traced
from ._step import no_sync as no_sync
from ._zero import ZeroShard as ZeroShard
from ._zero import zero_shard as zero_shard

__all__ = [
    "DataParallel",
    "Env",
    "Op",
    "Pass",
    "Program",
    "Step",
    "Traced",
    "ZeroShard",
    "add_accumulated",
    "broadcast_params",
    "chain",
    "check",
    "data_parallel",
    "eval_eqn",
    "grad",
    "gradient_leaves",
    "join",
    "joined",
    "no_sync",
    "reduce_gradients",
    "retrace",
    "return_local",
    "shard_state",
    "trace",
    "value_and_grad",
    "weight_joined",
    "zero_shard",
]
