"""The multi-rank harness itself: results, failures, hangs, dead ranks, pools."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import spmd
from spmd.testing import MultiRankError, multirank, run
from spmd.testing._harness import load_factor


def rank_and_pid(value):
    return spmd.init().rank, os.getpid(), value * 2


@pytest.mark.parametrize("launcher", ["mpi", "env"])
def test_results_by_rank_and_pool_reuse(launcher):
    first = run(rank_and_pid, 3, args=(21,), launcher=launcher)
    assert [(r, v) for r, _, v in first] == [(0, 42), (1, 42), (2, 42)]
    second = run(rank_and_pid, 3, kwargs={"value": 1}, launcher=launcher)
    assert [p for _, p, _ in second] == [p for _, p, _ in first]  # same processes
    fresh = run(rank_and_pid, 3, args=(0,), launcher=launcher, fresh=True)
    assert not {p for _, p, _ in fresh} & {p for _, p, _ in first}


def test_pools_over_the_memory_budget_are_replaced(monkeypatch):
    """Pooled ranks keep what they compiled; once the pools of this process hold more than
    SPMD_TEST_POOLS_RSS_MB together, the least recently used are closed and the next check
    starts its ranks again (a rank of JAX and spmd holds more than 1 MiB)."""
    monkeypatch.setenv("SPMD_TEST_POOLS_RSS_MB", "0")  # no bound: the same processes
    first = run(rank_and_pid, 2, args=(1,))
    assert [p for _, p, _ in run(rank_and_pid, 2, args=(1,))] == [p for _, p, _ in first]
    monkeypatch.setenv("SPMD_TEST_POOLS_RSS_MB", "1")
    again = run(rank_and_pid, 2, args=(1,))
    assert not {p for _, p, _ in again} & {p for _, p, _ in first}
    assert [(r, v) for r, _, v in again] == [(0, 2), (1, 2)]


def fails_on_odd_ranks():
    rank = spmd.init().rank
    print(f"output of rank {rank}")
    assert rank % 2 == 0


def test_failures_show_each_rank_traceback_and_output():
    with pytest.raises(MultiRankError) as info:
        run(fails_on_odd_ranks, 4)
    text = str(info.value)
    assert text.startswith("ranks [1, 3] raised\n")
    assert "[rank 1] AssertionError: assert (1 % 2) == 0" in text  # rewritten asserts
    assert "[rank 3] AssertionError" in text and "[rank 0]" not in text
    assert "--- rank 3 output ---\noutput of rank 3" in text
    assert run(rank_and_pid, 4, args=(1,))[3][0] == 3  # the pool survived


def hangs_on_rank(rank_to_hang):
    comm = spmd.init()
    if comm.rank == rank_to_hang:
        time.sleep(600)
    return comm.rank


def test_hang_names_the_ranks_and_shows_their_stacks():
    with pytest.raises(MultiRankError) as info:
        run(hangs_on_rank, 3, args=(2,), timeout=3)
    text = str(info.value)
    assert text.startswith("ranks [2] did not finish (hang)")
    assert "--- rank 2 stack ---" in text and "in hangs_on_rank" in text
    assert run(hangs_on_rank, 3, args=(-1,)) == [0, 1, 2]  # a new pool replaced the hung one


def test_the_timeout_stretches_with_the_load_once(monkeypatch):
    """A check's timeout holds on a loaded machine (CI shares 2 cores with everything): it is
    stretched by the 1-minute load average per core, between 1x and 4x."""
    cores = len(os.sched_getaffinity(0))
    for load, factor in [(0.0, 1.0), (0.5 * cores, 1.0), (3.0 * cores, 3.0), (9.0 * cores, 4.0)]:
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert load_factor() == pytest.approx(factor)


def fails_then_others_wait():
    comm = spmd.init()
    if comm.rank == 0:
        raise RuntimeError("rank 0 gives up")
    comm.barrier()  # waits for rank 0 forever


def test_ranks_stuck_after_a_failure_are_reported_after_the_grace():
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run(fails_then_others_wait, 3, grace=1.0, timeout=60)
    assert time.monotonic() - start < 30  # the grace, not the timeout
    text = str(info.value)
    assert text.startswith("ranks [0] raised; ranks [1, 2] did not finish (hang)")
    assert "within 1 s after the first failure" in text


def dies_on_rank_one():
    if spmd.init().rank == 1:
        os._exit(7)
    return "alive"


def test_dead_rank_is_named():
    with pytest.raises(MultiRankError) as info:
        run(dies_on_rank_one, 2, grace=2.0)
    text = str(info.value)
    # MPI is initialized, so the launcher may take rank 0 down with rank 1 before it replies.
    assert text.startswith(("ranks [1] died\n", "ranks [0, 1] died\n")), text
    assert "--- rank 1 died (its connection closed) ---" in text


def unpicklable():
    return lambda: None


def test_unpicklable_result_is_an_error():
    with pytest.raises(MultiRankError, match="result not picklable"):
        run(unpicklable, 1)


def test_local_functions_are_refused():
    def local():
        return 1

    with pytest.raises(spmd.SpmdError, match="not a module-level function"):
        run(local, 1)


def slow(tag):
    time.sleep(1.5)
    return f"slow {tag}"


def fast(tag):
    return f"fast {tag}"


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(a)


def unloadable():
    return _NeedsTwo("x", "y")  # pickles, but cannot be unpickled


def dies_after_replying():
    if spmd.init().rank == 1:
        threading.Timer(0.3, lambda: os._exit(9)).start()
    return "ok"


@pytest.mark.parametrize("launcher", ["mpi", "env"])
def test_a_check_never_gets_an_earlier_checks_results(launcher):
    """An interrupted check (Ctrl-C, a pytest timeout) left its replies in the pool: the next
    check returned them. A rank dying between checks left a pool that raised BrokenPipeError
    for the rest of the session."""

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            run(slow, 2, args=("A",), launcher=launcher)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert run(fast, 2, args=("B",), launcher=launcher) == ["fast B", "fast B"]
    with pytest.raises(MultiRankError, match="the exchange with the ranks failed"):
        run(unloadable, 2, launcher=launcher)
    assert run(fast, 2, args=("C",), launcher=launcher) == ["fast C", "fast C"]
    assert run(dies_after_replying, 2, launcher=launcher) == ["ok", "ok"]
    time.sleep(1.5)
    assert run(fast, 2, args=("D",), launcher=launcher) == ["fast D", "fast D"]


def test_functions_of_the_main_script_and_methods_are_refused(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(
        "import spmd.testing\n"
        "def f():\n    return 1\n"
        "try:\n    spmd.testing.run(f, 2)\n"
        "except spmd.SpmdError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "f is defined in the script being run (__main__)" in out.stdout, out.stderr
    with pytest.raises(spmd.SpmdError, match=r"@multirank: .*\.T\.test_x is not a module-level"):

        class T:
            @multirank(nprocs=(2,))
            def test_x(self, comm):
                pass


def test_env_launcher_inside_an_mpi_job():
    """pytest itself started by mpiexec (or srun): the env launcher's ranks were all rank 0."""
    env = {"PMI_RANK": "0", "PMI_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}
    got = run(rank_and_pid, 2, args=(1,), launcher="env", env=env, fresh=True)
    assert [r for r, _, _ in got] == [0, 1]


def test_env_reaches_the_ranks():
    assert run(read_env, 2, env={"SPMD_TEST_MARKER": "x7"}) == ["x7", "x7"]


def read_env():
    return os.environ.get("SPMD_TEST_MARKER")


@multirank(nprocs=(1, 2, 3, 4), launcher="env")
def test_multirank_decorator_passes_the_world(comm):
    assert comm is spmd.init() and comm.backend == "void"
    assert comm.allgather_object(comm.rank) == list(range(comm.size))
