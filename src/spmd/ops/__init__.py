"""Collective operations as JAX primitives: eager, under ``jax.jit``, ``jax.grad`` and
``jax.vmap``; run by native XLA FFI handlers (shared memory and MPI on CPU; NCCL and the CUDA IPC
custom all-reduce on GPU).

Every operation takes ``rank_list=`` (RAF's grouping) or ``group=`` (a Communicator or an axis
name of the active mesh), and arrays or pytrees of arrays (one fused call). The gradient
convention and the ordering guarantees are described in ``docs/collectives.md``.

``set_transport``/``get_transport`` choose and report how collectives move data (shared memory,
MPI or both on CPU; the custom all-reduce or NCCL on GPU). ``ARRAY_LIKE``, ``SUPPORTED_DTYPES``,
``chain_config``, ``holds_collective``, ``after``, ``collective_calls`` (with ``PreflightCall``),
``all_to_allv_indexed``, ``tree_reduce`` and the MoE exchange (``moe_dispatch``, ``moe_combine``,
``moe_native``, ``weighted_sum``) serve the layers above
(spmd.transforms, spmd.model_parallel, spmd.cli) and are not in ``__all__``.
"""

from typing import Any

from ._after import after as after
from ._all_to_all import all_to_all as all_to_all
from ._all_to_allv import all_to_allv as all_to_allv
from ._all_to_allv import all_to_allv_indexed as all_to_allv_indexed
from ._allreduce import allreduce as allreduce
from ._allreduce import tree_reduce as tree_reduce
from ._broadcast import broadcast as broadcast
from ._checks import ARRAY_LIKE as ARRAY_LIKE
from ._checks import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from ._gather import allgather as allgather
from ._gather import allgatherv as allgatherv
from ._gather import reduce_scatter as reduce_scatter
from ._gather import reduce_scatterv as reduce_scatterv
from ._gpu_chain import chain_config as chain_config
from ._moe_exchange import moe_combine as moe_combine
from ._moe_exchange import moe_dispatch as moe_dispatch
from ._moe_exchange import moe_native as moe_native
from ._moe_exchange import weighted_sum as weighted_sum
from ._ordering import holds_collective as holds_collective
from ._p2p import barrier as barrier
from ._p2p import recv as recv
from ._p2p import send as send
from ._p2p import sendrecv as sendrecv
from ._preflight import Message as Message
from ._preflight import PreflightCall as PreflightCall
from ._preflight import Unknown as Unknown
from ._preflight import collective_calls as collective_calls
from ._preflight import messages as messages
from ._rmsnorm import allreduce_rmsnorm as allreduce_rmsnorm
from ._rooted import gather as gather
from ._rooted import reduce as reduce
from ._rooted import scan as scan
from ._rooted import scatter as scatter
from ._transport import get_transport as get_transport
from ._transport import set_transport as set_transport

__all__ = [
    "all_to_all",
    "all_to_allv",
    "allgather",
    "allgatherv",
    "allreduce",
    "allreduce_rmsnorm",
    "barrier",
    "broadcast",
    "gather",
    "get_transport",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatterv",
    "scan",
    "scatter",
    "send",
    "sendrecv",
    "set_transport",
]


def __dir__() -> list[str]:
    return list(__all__)


def __getattr__(name: str) -> Any:
    # Renamed: "backend" names the communicator (spmd.init(backend=...)).
    if name in ("set_backend", "get_backend"):
        import warnings

        new = name.replace("backend", "transport")
        warnings.warn(f"spmd.ops.{name} is now spmd.ops.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'spmd.ops' has no attribute {name!r}")
