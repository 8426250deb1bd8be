"""The suite's settings: how it runs in the time it has (decisions, measured in
tests/DURATIONS.md).

- XLA does little optimisation work (``JAX_DISABLE_MOST_OPTIMIZATIONS=1``) and generates CPU
  code with its older loop emitters, without LLVM's expensive passes (XLA_FLAGS
  ``--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true``, where the
  installed jaxlib knows them): the suite's programs are small and run a few steps, and
  compiling them is most of its CPU time (tests/transforms/test_zero.py alone, without the
  compilation cache below: 193 CPU-seconds with XLA's defaults, 149 with the first setting, 146
  -> 76 with the flags added, the same tests passing with the same tolerances). Ranks,
  ``spmd-run`` jobs and notebook kernels that tests start inherit them. ``SPMD_TEST_XLA_OPT=1``
  tests with XLA's defaults instead.
- A program is compiled once per test run, not once per rank and per test: JAX's persistent
  compilation cache, in a directory only this user can open (``tempfile.mkdtemp``, mode 0700),
  made for the run and removed at its end (or by the next run, if it was killed). The ranks of a
  check, its parametrizations and the jobs and kernels the tests start share it
  (tests/transforms/test_zero.py alone: 81 s without it, 57 s with it from empty). Ranks write
  entries at the same time without a lock: one read while another process writes it fails to
  decompress, and JAX warns and compiles instead (pyproject.toml lets that warning pass).
  ``SPMD_TEST_COMPILE_CACHE=0`` compiles everything in every process; a
  ``JAX_COMPILATION_CACHE_DIR`` already set is used as it is.
- Three tests run at a time on the 2 cores (pytest-xdist, ``-n 3 --dist loadfile`` in
  pyproject.toml), a file's tests in one worker (they share its pooled ranks): many tests wait
  (time-outs, stalls, process start), and a third keeps the cores busy meanwhile (the whole
  suite, one run each: 887 s two at a time, with 1.71 of the 2 cores busy on average). The
  files that take longest start first, so that no long file is left running alone at the end.
- A test over the budget fails (below), unless it is marked ``slow`` with the reason.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# XLA's CPU code generation with its older loop emitters and without LLVM's expensive passes.
_QUICK_XLA = ("--xla_cpu_use_fusion_emitters=false", "--xla_llvm_disable_expensive_passes=true")


def _quick_xla_flags() -> None:
    """Adds _QUICK_XLA to XLA_FLAGS where this jaxlib knows them (XLA aborts on a flag it does
    not know: a process with them compiles a program first, once per run)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if all(f.split("=")[0] in flags for f in _QUICK_XLA):
        return  # set already (an xdist worker inherits the flags of the run)
    quick = " ".join([flags, *_QUICK_XLA]).strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
        env={**os.environ, "XLA_FLAGS": quick},
        capture_output=True,
        timeout=120,
    )
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = quick


if os.environ.get("SPMD_TEST_XLA_OPT") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    _quick_xla_flags()

# The run's compilation cache: made by pytest itself in pytest_configure, before its xdist
# workers start (they and every process a test starts inherit it); removed at the end. A run
# that was killed cannot remove its own: the next run removes those whose pytest is gone.
_CACHE_PREFIX = "pytest-xla-cache-"
_OWN_CACHE: str | None = None


def _compile_cache() -> None:
    global _OWN_CACHE
    if os.environ.get("SPMD_TEST_COMPILE_CACHE") == "0" or os.environ.get(
        "JAX_COMPILATION_CACHE_DIR"
    ):
        return
    for old in Path(tempfile.gettempdir()).glob(f"{_CACHE_PREFIX}*-*"):
        pid = old.name[len(_CACHE_PREFIX) :].split("-", 1)[0]
        st = old.lstat()
        mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        if mine and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(old, ignore_errors=True)
    _OWN_CACHE = tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{os.getpid()}-")
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_OWN_CACHE,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The files that took longest (tests/DURATIONS.md), longest first; the others follow in their
# own order.
_LONGEST_FIRST = [
    "tests/test_examples_3d.py",
    "tests/ops/test_values.py",
    "tests/test_tutorials.py",
    "tests/model_parallel/test_pipeline.py",
    "tests/test_examples.py",
    "tests/transforms/test_zero.py",
    "tests/model_parallel/test_moe.py",
    "tests/cli/test_run.py",
    "tests/cli/test_hosts.py",
    "tests/ops/test_transports.py",
    "tests/ops/test_mpi_calls.py",
    "tests/transforms/test_data_parallel.py",
    "tests/model_parallel/test_tensor_parallel.py",
    "tests/ops/test_errors.py",
    "tests/test_sharded.py",
    "tests/cli/test_slurm.py",
    "tests/runtime/test_communicator.py",
    "tests/transforms/test_deterministic.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    last = len(rank)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))  # stable


# -- the time budget of one test ------------------------------------------------------------------
#
# A test whose call takes longer than SPMD_TEST_BUDGET_S seconds (default 90; 0: no budget)
# fails, unless it is marked ``@pytest.mark.slow(reason="...")``: a slow test is a decision,
# written down, not an accident. Wall-clock time of the test's call (not its fixtures), three
# tests at a time on 2 cores: a test takes longer than alone (the tutorial of tensor and expert
# parallelism: 50 s two at a time, 90 s three at a time; tests/DURATIONS.md).


def pytest_configure(config: pytest.Config) -> None:
    _compile_cache()
    config.addinivalue_line(
        "markers",
        "slow(reason): the test may take longer than the budget per test (SPMD_TEST_BUDGET_S, "
        "default 90 s); the reason says why it needs to",
    )


def budget_s() -> float:
    return float(os.environ.get("SPMD_TEST_BUDGET_S", "90"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    marker = item.get_closest_marker("slow")
    if marker is not None:
        if not marker.kwargs.get("reason"):
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid}: @pytest.mark.slow needs reason='...', saying why this test may "
                "take longer than the budget"
            )
        return
    budget = budget_s()
    if budget > 0 and call.duration > budget:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {call.duration:.1f} s, over the budget of {budget:g} s per test "
            "(SPMD_TEST_BUDGET_S). Make it faster, or mark it "
            '@pytest.mark.slow(reason="...") saying why it needs the time.'
        )
