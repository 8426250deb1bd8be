"""Choosing and reporting how collectives move data: their transport.

On CPU the runtime's native groups hold it (``shm``, ``mpi``, ``hier``; see
:mod:`spmd.runtime._groups`); on GPU the all-reduce chain chooses per call between the custom
all-reduce and NCCL (:mod:`._gpu_chain`).
"""

from __future__ import annotations

from typing import Any

from .. import runtime
from .._errors import SpmdError
from ..mesh import resolve_group
from . import _gpu_chain


def set_transport(name: str) -> None:
    """Force how collectives move data.

    On CPU: ``"shm"``, ``"mpi"`` or ``"hier"``; applies to every group, including those already
    in use (no recompilation needed), and raises :class:`spmd.SpmdError` if a group in use
    cannot use it. ``SPMD_TRANSPORT`` sets the default. The switch takes effect at once in this
    process: call it on every rank when no collective is in flight (after blocking on the
    results of earlier calls, ``jax.block_until_ready``), or a rank whose dispatched work has
    not reached its collective yet would use the new transport while a peer uses the old one.

    On GPU: ``"custom"`` (the CUDA IPC all-reduce wherever it can take the call) or ``"nccl"``;
    applies to programs compiled afterwards. ``SPMD_GPU_TRANSPORT`` sets the default.

    ``"auto"`` returns both to the automatic choice.

    Example (a world of one has nothing to switch; on several ranks of one node, ``"mpi"``
    makes the collectives use MPI instead of shared memory)::

        >>> import spmd
        >>> spmd.ops.set_transport("auto")
        >>> spmd.ops.get_transport()
        'self'
    """
    cpu = runtime.transport_names()
    if name not in (*cpu, "custom", "nccl"):
        raise SpmdError(
            f"transport {name!r} is unknown; expected one of {', '.join(cpu)} (CPU) or custom, "
            "nccl (GPU)",
            rank=None,
        )
    if name in ("custom", "nccl"):
        _gpu_chain.set_gpu_transport(name)
        return
    runtime.set_cpu_transport(name)
    if name == "auto":
        _gpu_chain.set_gpu_transport("auto")


def get_transport(rank_list: Any = None, group: Any = None) -> str:
    """The transport the group's collectives use: ``"shm"``, ``"mpi"`` or ``"hier"`` on CPU,
    ``"self"`` for a group of one. On GPU: ``"custom+nccl"`` (the all-reduce chain has the
    custom all-reduce, the rest is NCCL), ``"nccl"``, or ``"custom"`` (NCCL did not start: only
    the all-reduce works).

    The first call on a group prepares it for collectives, which every rank of the group must
    take part in (the world is prepared by ``spmd.init``).

    Example (under ``spmd-run -n 2`` on one node: ``'shm'``)::

        >>> import spmd
        >>> spmd.ops.get_transport()
        'self'
    """
    comm = resolve_group(rank_list, group, op="get_transport")
    ng = comm.native_group(gpu_settings=_gpu_chain.chain_config)
    return ng.gpu.transports if ng.gpu is not None else ng.transport
