"""Starting ranks: the MPI launcher's discovery and argv, the job runner behind ``spmd-run``
and the ``%%spmd`` cell magic, the per-rank wrapper it starts each rank under, and the pool of
ranks kept running that the test harness and the notebook's ``%spmd start`` send work to.

Used by :mod:`spmd.cli` (``spmd-run``, ``spmd-bench``), :mod:`spmd.notebook` and
:mod:`spmd.testing`; it starts processes and watches them, and never joins a job itself.
"""

from ._hosts import TestHosts as TestHosts
from ._hosts import unavailable as test_hosts_unavailable
from ._job import launch as launch
from ._job import wrap_command as wrap_command
from ._leftovers import load_factor as load_factor
from ._leftovers import remove_leftovers as remove_leftovers
from ._mpiexec import find_mpiexec as find_mpiexec
from ._mpiexec import flavor as flavor
from ._mpiexec import mpiexec_argv as mpiexec_argv
from ._pool import Launcher as Launcher
from ._pool import MultiRankError as MultiRankError
from ._pool import Pool as Pool
from ._pool import RankPool as RankPool
from ._pool import hosts_for_checks as hosts_for_checks
from ._protocol import launch_rank as launch_rank
from ._protocol import output_file as output_file

__all__ = [
    "Launcher",
    "MultiRankError",
    "Pool",
    "RankPool",
    "TestHosts",
    "find_mpiexec",
    "flavor",
    "hosts_for_checks",
    "launch",
    "launch_rank",
    "load_factor",
    "mpiexec_argv",
    "output_file",
    "remove_leftovers",
    "test_hosts_unavailable",
    "wrap_command",
]
