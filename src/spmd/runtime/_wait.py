"""Polling with a deadline: how spmd waits for peers without ever hanging silently, and how a
wait that every rank of the job is stuck in (a deadlock) is found within about a second (the
wait board, native/cpu/board.h)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .._errors import SpmdError
from .._native_lib import native


class Deadlock(SpmdError):
    """A wait that is part of a deadlock: every rank of the job waits inside spmd, and no wait
    can complete (the message names what each rank waits for)."""


def wait_until(
    ready: Callable[[], bool],
    timeout: float,
    on_board: tuple[str, Sequence[int], int, str] | None = None,
) -> bool:
    """Call ``ready`` until it returns True (-> True) or ``timeout`` seconds pass (-> False).

    Sleeps between calls, 10 us doubling up to 5 ms: quick when peers are close behind, and
    no busy core taken from them when they are not (ranks often outnumber cores in tests).

    ``on_board``: (kind, the group's world ranks, this wait's number of its kind, the wait
    written out): the ranks of one matching wait pass the same first three. A wait that lasts
    is published on the wait board, and raises :class:`Deadlock` once the board shows that no
    rank can move again.
    """
    deadline = time.monotonic() + timeout
    pause = 1e-5
    handle = None
    try:
        while not _ready(ready, handle):
            if time.monotonic() > deadline:
                return False
            if on_board is not None:
                if handle is None:
                    kind, members, n, what = on_board
                    handle = native.board_wait(kind, list(members), n, what)
                dead = native.board_poll(handle)
                if dead:
                    raise Deadlock(dead)
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
    finally:
        if handle is not None:
            native.board_end(handle)
    return True


def _ready(ready: Callable[[], bool], handle: int | None) -> bool:
    """``ready()``; where it raises (a peer gone) while this wait is on the board, a deadlock
    declared meanwhile is the error instead: the peer that found it raised and exited, and
    every rank of the deadlock gives its verdict."""
    try:
        return ready()
    except SpmdError:
        dead = native.board_poll(handle) if handle is not None else ""
        if dead:
            raise Deadlock(dead) from None
        raise
