"""Keep large host buffers out of fresh mmaps.

glibc serves allocations above 32 MB (the ceiling of its dynamic mmap threshold) with a fresh
mmap and returns them to the kernel on free. XLA:CPU allocates each call's output buffers with
malloc, so a jitted step producing a 64 MB array pays ~16k page faults (zeroing included) per
call: measured, a 64 MB allreduce took 38 ms that way and 7-10 ms with the buffers reused.
:func:`tune` raises the mmap and trim thresholds (to 2 GiB) so freed buffers stay in the heap and
are reused; the price is that the process keeps that memory until it exits. ``SPMD_MALLOC_TUNING=0``
turns it off; other allocators (jemalloc, tcmalloc via LD_PRELOAD) are left alone.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LIMIT = 2**31 - 1

_done = False


def tune(env: dict[str, str] | None = None) -> bool:
    """Apply the tuning once per process; True if glibc accepted it."""
    global _done
    env = dict(os.environ) if env is None else env
    if _done or env.get("SPMD_MALLOC_TUNING", "1") == "0":
        return _done
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
    _done = ok
    return ok
