"""Polling with a deadline: how spmd waits for peers without ever hanging silently."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(ready: Callable[[], bool], timeout: float) -> bool:
    """Call ``ready`` until it returns True (-> True) or ``timeout`` seconds pass (-> False).

    Sleeps between calls, 10 us doubling up to 5 ms: quick when peers are close behind, and
    no busy core taken from them when they are not (ranks often outnumber cores in tests).
    """
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    return True
