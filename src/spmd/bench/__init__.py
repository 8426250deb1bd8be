"""The collectives benchmark behind ``spmd-bench`` and benchmarks/: spmd inside ``jax.jit``
against the peers a user would pick instead, in the same run on the same machine.

Peers (optional, each skipped with its reason when it cannot run): mpi4py on numpy buffers, out
of place and in place; mpi4jax inside ``jax.jit``; torch.distributed with gloo. The table is the
one nccl-tests prints: size is the total bytes of the collective (allgather: the output, each
rank contributing size/n; reduce_scatter: the input; all_to_all: the whole buffer), algbw =
size / time, busbw = algbw x 2(n-1)/n (allreduce), x (n-1)/n (allgather, reduce_scatter,
all_to_all), x 1 (broadcast). Time is, per rank, the median of individually timed calls after
a warm-up and one barrier, then the maximum over ranks. ratio = spmd busbw / peer busbw
(peer time / spmd time): above 1, spmd is faster. See benchmarks/README.md.

:func:`run_rank` runs inside a job (every rank calls it); the machine-info helpers are what
benchmarks/ scripts record their results with.
"""

from ._machine import cores_tag as cores_tag
from ._machine import cpu_model as cpu_model
from ._machine import host_info as host_info
from ._machine import in_job as in_job
from ._machine import job_cores as job_cores
from ._machine import machine_info as machine_info
from ._machine import memory_gib as memory_gib
from ._machine import package_version as package_version
from ._machine import relaunch as relaunch
from ._machine import run_tag as run_tag
from ._machine import shm_hop as shm_hop
from ._peers import PEERS as PEERS
from ._report import Files as Files
from ._run import Settings as Settings
from ._run import run_rank as run_rank
from ._timing import DTYPES as DTYPES
from ._timing import OPS as OPS
from ._timing import busbw_factor as busbw_factor
from ._timing import parse_size as parse_size
from ._timing import size_sweep as size_sweep

__all__ = [
    "DTYPES",
    "OPS",
    "PEERS",
    "Files",
    "Settings",
    "busbw_factor",
    "cores_tag",
    "cpu_model",
    "host_info",
    "in_job",
    "job_cores",
    "machine_info",
    "memory_gib",
    "package_version",
    "parse_size",
    "relaunch",
    "run_rank",
    "run_tag",
    "shm_hop",
    "size_sweep",
]
