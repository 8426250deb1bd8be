"""Keep large host buffers out of fresh mmaps.

glibc serves allocations above 32 MB (the ceiling of its dynamic mmap threshold) with a fresh
mmap and returns them to the kernel on free. XLA:CPU allocates each call's output buffers with
malloc, so a jitted step producing a 64 MB array pays ~16k page faults (zeroing included) per
call: measured, a 64 MB allreduce took 38 ms that way and 7-10 ms with the buffers reused.
:func:`tune` raises the mmap and trim thresholds (to 2 GiB) so freed buffers stay in the heap and
are reused; the price is that the process keeps that memory until it exits.

A thread that is not the main thread allocates from an arena of its own, made of heaps of at
most 64 MB. When a block does not fit in the arena's current heap, glibc maps a new heap for it,
and when that heap is empty again, on the block's free, glibc unmaps it, whatever the thresholds
say, unless the top pad (``M_TOP_PAD``, 128 KiB by default) is larger than what the previous
heap could take. So :func:`tune` also sets the top pad to a whole heap (64 MB), which keeps such
heaps mapped and their blocks reused: a jitted ``allreduce(v) / 2`` on 16 MB on 2 ranks took
13.5-15.8 ms with 4,097 page faults per call where XLA's threads placed its buffers so, and 2.8-3.2
ms without faults with the pad; which placement a run gets depends on the threads (one run in six
of a one-process ``(v * 2) / 3 + v`` on 16 MB faulted without the pad). The price is the same:
memory once used stays with the process. The data-parallel benchmark's 2-rank step did not
change (medians of 6 alternating runs, 11.0 ms without the pad and 11.2 ms with it).

A block that does not fit in any heap, 64 MB or more, is mapped afresh whatever the settings
say. XLA:CPU allocates from its worker threads, so a jitted ``v * 2`` on 64 MB still pays 16,385
page faults per call (21 ms against 3.7 ms with the buffer reused, one process, 2 cores).
``SPMD_MALLOC_TUNING=arena`` therefore also caps glibc at one arena, which every thread then
shares. It is not the default: on the data-parallel benchmark's one-core step (buffers of a few
MB) it cost about 3% (5.01 against 4.86 ms, medians of 6 runs each). The cap only applies to
threads that have not allocated yet, so it must come before JAX starts its CPU client:
``spmd.init`` and the rank wrapper of ``spmd-run`` call :func:`tune`.

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
