"""What a finished job left behind, told apart from what other tests' jobs still use.

The suite runs two tests at a time (pytest-xdist, see tests/DURATIONS.md): while one test
checks that its job left no file, segment or network namespace, the other test's job may be
making and removing its own. A file that some process has open or mapped belongs to a job that
still runs, as does a namespace whose creating process (its name holds the pid) still runs;
what a job that is ending removes within a few seconds was not left behind. What stays, unused,
after that is a leftover, as it was when the tests ran one at a time.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
from collections.abc import Callable, Iterable

from spmd.launch._leftovers import _in_use


def _settle(
    current: Callable[[], set[str]],
    before: Iterable[str],
    busy: Callable[[set[str]], set[str]],
    settle_s: float,
) -> set[str]:
    before = set(before)
    deadline = time.monotonic() + settle_s
    while True:
        new = current() - before
        left = new - busy(new) if new else new
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def files(patterns: Iterable[str]) -> set[str]:
    """The paths that match ``patterns`` (globs) now."""
    return {p for pattern in patterns for p in glob.glob(pattern)}


def new_files(patterns: Iterable[str], before: Iterable[str], settle_s: float = 3.0) -> set[str]:
    """The files matching ``patterns`` that are not in ``before`` and that no process uses."""
    patterns = list(patterns)

    def busy(new: set[str]) -> set[str]:
        used = _in_use()
        return {p for p in new if os.path.realpath(p) in used or p in used}

    return _settle(lambda: files(patterns), before, busy, settle_s)


def namespaces() -> set[str]:
    """The test hosts' network namespaces (``spmd-<pid>-...``) now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("spmd-")}


def _creator_runs(name: str) -> bool:
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return False
    # This test's own is never another job's.
    return pid != os.getpid() and os.path.exists(f"/proc/{pid}")


def new_namespaces(before: Iterable[str], settle_s: float = 3.0) -> set[str]:
    """The test hosts' namespaces not in ``before`` whose creator has ended (or is this test)."""
    return _settle(namespaces, before, lambda new: {n for n in new if _creator_runs(n)}, settle_s)
