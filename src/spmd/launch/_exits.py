"""When each rank's process ended, as the kernel tells it: for the ranks that end without a word.

A rank's wrapper reports how its program ended (:mod:`spmd.launch._rank`), and names a signal
that killed the program. Nothing reports when the wrapper dies too (a SIGKILL to both, the
out-of-memory killer, a test host whose processes are all killed): the launcher then stops every
other rank within milliseconds, and all look alike to ``spmd-run``, "without a clean end". So
``spmd-run`` holds a pidfd (Linux) for each rank's process once the rank has reported its pid,
and waits on them between its polls of the status directory: the first ranks to end are the
cause, the others were stopped by the launcher after them.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping


class ExitWatch:
    """The monotonic time at which each watched rank's process ended (``ended``)."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # fd -> rank
        self._watched: set[int] = set()
        self._poll = select.poll() if hasattr(select, "poll") else None

    def add(self, status: Mapping[int, Mapping[str, object]]) -> None:
        """Watch every rank that reports it runs, with its pid, and is not watched yet."""
        if self._poll is None or not hasattr(os, "pidfd_open"):
            return
        for rank, s in status.items():
            pid = s.get("pid")
            if rank in self._watched or s.get("state") != "running" or not isinstance(pid, int):
                continue
            self._watched.add(rank)
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone (its report says how), or not ours to see
                continue
            self._fds[fd] = rank
            self._poll.register(fd, select.POLLIN)

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; record each rank whose process ends meanwhile, at once."""
        if self._poll is None or not self._fds:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and self._fds:
            for fd, _ in self._poll.poll(left * 1000):
                self.ended[self._fds.pop(fd)] = time.monotonic()
                self._poll.unregister(fd)
                os.close(fd)
        if not self._fds and (left := deadline - time.monotonic()) > 0:
            time.sleep(left)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def first(self, silent: list[int], where: Callable[[int], str]) -> str:
        """Of the ranks in ``silent`` (ended without reporting how), the one that ended first,
        as a sentence naming it (and ``where(rank)``, e.g. its host) and then the others in the
        order they ended; "" if none was seen. The first one is a cause: the launcher stops the
        others only after it learns of a death."""
        seen = sorted((self.ended[r], r) for r in silent if r in self.ended)
        if not seen:
            return ""

        def name(rank: int) -> str:
            place = where(rank)
            return f"rank {rank}" + (f" ({place})" if place else "")

        t0, first = seen[0]
        text = f"{name(first)} ended first, without reporting how (killed together with its "
        text += "wrapper, or its host lost)"
        if len(seen) > 1:
            then = ", ".join(f"{name(r)} +{(t - t0) * 1e3:.0f} ms" for t, r in seen[1:])
            text += f"; then {then}"
        return text
