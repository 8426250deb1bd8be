"""Collective operations as JAX primitives: eager, under ``jax.jit``, ``jax.grad`` and
``jax.vmap``; run by native XLA FFI handlers (shared memory and MPI on CPU; NCCL and the CUDA IPC
custom all-reduce on GPU).

Every operation takes ``rank_list=`` (RAF's grouping) or ``group=`` (a Communicator or an axis
name of the active mesh), and arrays or pytrees of arrays (one fused call). The gradient
convention and the ordering guarantees are described in ``docs/collectives.md``.
"""

from .._groups import get_backend as get_backend
from .._groups import set_backend as set_backend
from ._all_to_all import all_to_all as all_to_all
from ._allreduce import allreduce as allreduce
from ._broadcast import broadcast as broadcast
from ._gather import allgather as allgather
from ._gather import allgatherv as allgatherv
from ._gather import reduce_scatter as reduce_scatter
from ._gather import reduce_scatterv as reduce_scatterv
from ._p2p import barrier as barrier
from ._p2p import recv as recv
from ._p2p import send as send
from ._p2p import sendrecv as sendrecv
from ._rmsnorm import allreduce_rmsnorm as allreduce_rmsnorm

__all__ = [
    "all_to_all",
    "allgather",
    "allgatherv",
    "allreduce",
    "allreduce_rmsnorm",
    "barrier",
    "broadcast",
    "get_backend",
    "recv",
    "reduce_scatter",
    "reduce_scatterv",
    "send",
    "sendrecv",
    "set_backend",
]


def __dir__() -> list[str]:
    return list(__all__)
