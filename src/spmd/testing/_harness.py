"""Run a function on N ranks under a real launcher and collect every rank's outcome.

Starting N processes that import JAX costs seconds; a test suite with hundreds of multi-rank
checks cannot pay that per check. So ranks are kept in pools: N processes started once per
(launcher, N, environment), each running :mod:`spmd.launch._worker`, which executes the
functions the harness sends (the pool and the worker are :mod:`spmd.launch`'s, shared with the
notebook's ``%spmd start``). A check costs a round trip. A pool whose ranks hung or died is
killed and replaced by the next check that needs it; ``fresh=True`` gives a check processes of
its own (for what must start from a clean process: ``spmd.init`` itself, environment
variables read at start-up, exits).
"""

from __future__ import annotations

import atexit
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import SpmdError
from ..launch import Launcher, Pool
from ..launch import load_factor as load_factor

_RUN = "spmd.testing.run"  # its errors are the pytest process's, which is no rank
_MAX_POOLS = 5


def _pools_rss_budget() -> float:
    """Bytes the pooled ranks of this process may hold together before the least recently used
    pools are closed (``SPMD_TEST_POOLS_RSS_MB``; 0: no bound). A pooled rank keeps every program
    it compiled: in the suite, three workers' pools grew to 2-2.5 GB a rank and the machine ran
    out of memory."""
    text = os.environ.get("SPMD_TEST_POOLS_RSS_MB", "4096")
    try:
        mb = float(text)
    except ValueError:
        raise SpmdError(f"SPMD_TEST_POOLS_RSS_MB={text!r}; expected a number of MiB") from None
    return mb * 2**20 if mb > 0 else float("inf")


def default_timeout() -> float:
    """Per-check timeout in seconds: ``SPMD_TEST_TIMEOUT``, default 60."""
    return float(os.environ.get("SPMD_TEST_TIMEOUT", "60"))


_pools: OrderedDict[tuple[Any, ...], Pool] = OrderedDict()
_atexit_registered = False


def _pool(nprocs: int, launcher: Launcher, env: Mapping[str, str]) -> Pool:
    global _atexit_registered
    key = (launcher, nprocs, tuple(sorted(env.items())))
    _bound_memory()
    pool = _pools.get(key)
    if pool is not None and not pool.broken and pool.alive():
        _pools.move_to_end(key)
        return pool
    if pool is not None:  # a rank died between checks: replace the pool
        pool.kill()
        del _pools[key]
    while len(_pools) >= _MAX_POOLS:
        oldest = next(iter(_pools))
        _pools[oldest].close()  # closed while filed: an interrupt leaves it to be reaped later
        del _pools[oldest]
    if not _atexit_registered:
        atexit.register(shutdown_pools)
        _atexit_registered = True
    # Filed before it starts: see Pool.
    pool = _pools[key] = Pool(nprocs, launcher, env, fresh=False)
    pool.start()
    return pool


def _bound_memory() -> None:
    """Close the least recently used pools while the pools together hold more than the budget
    (:func:`_pools_rss_budget`); the next check that needs one starts it again."""
    budget = _pools_rss_budget()
    sizes = {key: pool.rss() for key, pool in _pools.items()}
    total = sum(sizes.values())
    while _pools and total > budget:
        oldest = next(iter(_pools))
        _pools.pop(oldest).close()
        total -= sizes[oldest]


def shutdown_pools() -> None:
    """Stop every pooled rank (the pytest plugin calls this at the end of the session)."""
    while _pools:
        _pools.popitem()[1].close()


def run(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    launcher: Launcher = "mpi",
    timeout: float | None = None,
    grace: float = 5.0,
    fresh: bool = False,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on each of ``nprocs`` ranks; return the results by rank.

    Args:
        fn: a module-level function (ranks import its module by name and file).
        nprocs: the number of ranks.
        env: extra environment variables of the ranks.
        launcher: ``"mpi"`` (mpiexec) or ``"env"`` (torchrun-style ``RANK``/``WORLD_SIZE``
            variables with ``SPMD_FILE_STORE_PATH``).
        timeout: seconds before the ranks that did not finish are declared hung (default
            ``SPMD_TEST_TIMEOUT`` or 60), stretched once by the machine's load: times the
            1-minute load average per core, at most 4x.
        grace: once a rank failed, seconds the others get to finish before they count as hung.
        fresh: run on new processes, stopped afterwards, instead of a pool.

    Raises:
        MultiRankError: naming each rank that raised (with its traceback and output), died, or
            did not finish (with its stack).
    """
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise SpmdError(
            f"{fn.__qualname__} is not a module-level function; the ranks import it by name, "
            "so define it at the top level of a module",
            op=_RUN,
            rank=None,
        )
    if fn.__module__ == "__main__":
        raise SpmdError(
            f"{fn.__qualname__} is defined in the script being run (__main__), which the ranks "
            "cannot import by name; define it in a module that the script imports",
            op=_RUN,
            rank=None,
        )
    if launcher not in ("mpi", "env"):
        raise SpmdError(f"launcher={launcher!r}; expected 'mpi' or 'env'", op=_RUN, rank=None)
    timeout = default_timeout() if timeout is None else timeout
    env = dict(env or {})
    if fresh:
        pool = Pool(nprocs, launcher, env)
        try:
            pool.start()
            return pool.run(fn, args, kwargs or {}, timeout, grace)
        finally:
            pool.close()
    return _pool(nprocs, launcher, env).run(fn, args, kwargs or {}, timeout, grace)
