"""Keep large host buffers out of fresh mmaps.

glibc serves allocations above 32 MB (the ceiling of its dynamic mmap threshold) with a fresh
mmap and returns them to the kernel on free. XLA:CPU allocates each call's output buffers with
malloc, so a jitted step producing a large array would pay a page fault per page, zeroing
included, on every call. :func:`tune` raises the mmap and trim thresholds (to 2 GiB) so freed
buffers stay in the heap and are reused; the price is that the process keeps that memory until
it exits.

A thread that is not the main thread allocates from an arena of its own, made of heaps of at
most 64 MB; glibc unmaps such a heap when it empties, whatever the thresholds say, unless the top
pad (``M_TOP_PAD``) is larger than what the previous heap could take. So :func:`tune` also sets
the top pad to a whole heap (64 MB), which keeps such heaps mapped and their blocks reused. A
block of 64 MB or more fits in no heap and is mapped afresh whatever the settings say;
``SPMD_MALLOC_TUNING=arena`` therefore also caps glibc at one arena, which every thread then
shares (not the default: it slows steps whose buffers are a few MB). The cap only applies to
threads that have not allocated yet, so it must come before JAX starts its CPU client:
``spmd.init`` and the rank wrapper of ``spmd-run`` call :func:`tune`. The measurements behind
these choices: docs/performance.md, "Memory".

``SPMD_MALLOC_TUNING=0`` turns all of it off; other allocators (jemalloc, tcmalloc via
LD_PRELOAD) are left alone.
"""

from __future__ import annotations

import ctypes
import os

from .._errors import SpmdError

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_LIMIT = 2**31 - 1
_HEAP_MAX = 64 << 20  # glibc's largest heap of a thread's arena on 64-bit systems

_done = False


def tune(env: dict[str, str] | None = None) -> bool:
    """Apply the tuning once per process; True if glibc accepted it."""
    global _done
    env = dict(os.environ) if env is None else env
    mode = env.get("SPMD_MALLOC_TUNING", "1")
    if mode not in ("0", "1", "arena"):
        raise SpmdError(f"SPMD_MALLOC_TUNING={mode!r}: expected 0, 1 or arena", rank=None)
    if _done or mode == "0":
        return _done
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
    ok = ok and bool(mallopt(_M_TOP_PAD, _HEAP_MAX))
    if mode == "arena":
        ok = ok and bool(mallopt(_M_ARENA_MAX, 1))
    _done = ok
    return ok
