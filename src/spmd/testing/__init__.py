"""spmd's multi-rank test harness (also a pytest plugin).

A test body runs on N ranks under the real launcher; the pytest process collects every rank's
result and traceback, and a hang fails the check after a timeout, naming the ranks that did not
finish and showing their stacks::

    from spmd.testing import multirank

    @multirank(nprocs=(2, 3, 4))
    def test_sizes(comm):            # runs on every rank; comm = spmd.init()
        assert comm.size in (2, 3, 4)

    def gather_ranks():
        return spmd.init().rank

    def test_ranks():                # runs in pytest; the function runs on 3 ranks
        assert spmd.testing.run(gather_ranks, 3) == [0, 1, 2]
"""

from ..launch import MultiRankError as MultiRankError
from ..launch import RankPool as RankPool
from ._harness import default_timeout as default_timeout
from ._harness import run as run
from ._harness import shutdown_pools as shutdown_pools
from ._multirank import multirank as multirank

__all__ = [
    "MultiRankError",
    "RankPool",
    "default_timeout",
    "multirank",
    "run",
    "shutdown_pools",
]
