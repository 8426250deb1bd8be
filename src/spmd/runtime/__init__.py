"""spmd's runtime: init/finalize, launcher detection, communicators and their pool.

Knows nothing of JAX tracing; imports neither JAX nor MPI until :func:`init` needs them. Owns
the native groups the collectives run on (their transports, their GPU side). Besides the public
API it exports what the layers above use from it: native groups and transports (for spmd.ops),
the launcher's per-rank helpers (affinity, malloc tuning, failure reports) and launcher
detection.
"""

from ._affinity import bind_mode as bind_mode
from ._affinity import bind_rank as bind_rank
from ._affinity import record_cpus as record_cpus
from ._affinity import recorded_cpus as recorded_cpus
from ._communicator import Communicator as Communicator
from ._device import gpu_active as gpu_active
from ._env import LaunchInfo as LaunchInfo
from ._env import check_every as check_every
from ._env import cuda_graphs as cuda_graphs
from ._env import debug_checks as debug_checks
from ._env import detect as detect
from ._env import mpi_rank_size as mpi_rank_size
from ._env import timeout_seconds as timeout_seconds
from ._failure import abort_job as abort_job
from ._failure import format_rank_traceback as format_rank_traceback
from ._failure import must_abort as must_abort
from ._failure import report_exception as report_exception
from ._failure import report_status as report_status
from ._gpu import GpuGroup as GpuGroup
from ._gpu import describe as describe_gpu
from ._gpu import nccl_library as nccl_library
from ._groups import NativeGroup as NativeGroup
from ._groups import find as find_native_group
from ._groups import mpi_calls as mpi_calls
from ._groups import requested_transport as requested_transport
from ._groups import set_cpu_transport as set_cpu_transport
from ._groups import shm_hop_ns as shm_hop_ns
from ._groups import shm_staging as shm_staging
from ._groups import transport_names as transport_names
from ._malloc import tune as tune_malloc
from ._mpi import refusal_before_init as refusal_before_init
from ._queue import MessageQueue as MessageQueue
from ._recorder import flight_report as flight_report
from ._recorder import merge_timeline as merge_timeline
from ._recorder import timeline_dir as timeline_dir
from ._state import finalize as finalize
from ._state import get_communicator as get_communicator
from ._state import init as init
from ._state import is_initialized as is_initialized
from ._state import requested_communicator as requested_communicator
from ._state import set_default_communicator as set_default_communicator
from ._state import this_rank as this_rank

__all__ = [
    "Communicator",
    "GpuGroup",
    "LaunchInfo",
    "MessageQueue",
    "NativeGroup",
    "abort_job",
    "bind_mode",
    "bind_rank",
    "check_every",
    "cuda_graphs",
    "debug_checks",
    "describe_gpu",
    "detect",
    "finalize",
    "find_native_group",
    "flight_report",
    "format_rank_traceback",
    "get_communicator",
    "gpu_active",
    "init",
    "is_initialized",
    "merge_timeline",
    "mpi_calls",
    "mpi_rank_size",
    "must_abort",
    "nccl_library",
    "record_cpus",
    "recorded_cpus",
    "refusal_before_init",
    "report_exception",
    "report_status",
    "requested_communicator",
    "requested_transport",
    "set_cpu_transport",
    "set_default_communicator",
    "shm_hop_ns",
    "shm_staging",
    "this_rank",
    "timeline_dir",
    "timeout_seconds",
    "transport_names",
    "tune_malloc",
]
