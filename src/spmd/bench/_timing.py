"""Sizes, counts and bandwidths as nccl-tests defines them, and the timing: per rank the median
of individually timed calls after a warm-up and one barrier, then the maximum over ranks."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import SpmdError
from ._peers import SPMD, Bound, Env, Unsupported, agree, bind, expected, first

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = ("float32", "float64", "int32")
MEMCPY_BYTES = 64 << 20
SMALL_ITERS = 2000


# --------------------------------------------------------------------------------------------
# Sizes, counts, bandwidth


def parse_size(text: str) -> int:
    """``4``, ``64K``, ``1M``, ``2G`` (binary multiples) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", text)
    if m is None:
        raise SpmdError(f"size {text!r} is not a byte count such as 4, 64K, 1M or 2G", rank=None)
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def size_sweep(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 1 or hi < lo or factor < 2:
        raise SpmdError(
            f"size sweep {lo}..{hi} x{factor}: need 1 <= min <= max and factor >= 2", rank=None
        )
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= factor
    return sizes


def element_count(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements of the collective's total buffer for about ``nbytes`` bytes: a multiple of the
    rank count where the buffer is split between ranks, at least one block per rank."""
    count = max(1, nbytes // itemsize)
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        count = max(n, count - count % n)
    return count


def busbw_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def default_iterations(nbytes: int) -> int:
    """Timed calls per series: 1000 up to 1 MiB, then about 1 GiB of data, at least 20."""
    return max(20, min(1000, (1 << 30) // max(nbytes, 1)))


def default_warmup(iters: int) -> int:
    return max(2, iters // 10)


def format_bytes(n: int) -> str:
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------
# Timing


def time_series(world: Any, call: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Warm up, one barrier, then ``iters`` calls each timed on its own (seconds)."""
    for _ in range(warmup):
        call()
    world.Barrier()
    times = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        call()
        times.append(clock() - t0)
    return times


def max_of_medians(world: Any, times: Sequence[float]) -> tuple[float, list[float]]:
    """The maximum over ranks of each rank's median, and every rank's median (seconds)."""
    medians: list[float] = world.allgather(statistics.median(times))
    return max(medians), medians


@dataclass
class Result:
    op: str
    impl: str
    nbytes: int
    count: int
    dtype: str
    status: str = "ok"  # "ok", "n/a: why", "WRONG RESULT"
    iters: int = 0
    time_s: float = float("nan")
    rank_medians_s: list[float] = field(default_factory=list)
    algbw: float = float("nan")  # GB/s (1e9 bytes)
    busbw: float = float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "impl": self.impl,
            "bytes": self.nbytes,
            "count": self.count,
            "dtype": self.dtype,
            "status": self.status,
            "iters": self.iters,
            "time_us": _num(self.time_s * 1e6),
            "rank_median_us": [_num(t * 1e6) for t in self.rank_medians_s],
            "algbw_GBps": _num(self.algbw),
            "busbw_GBps": _num(self.busbw),
        }


def _num(x: float) -> float | None:
    return None if x != x else round(x, 4)


def prepare(
    env: Env, impl: str, op: str, nbytes: int, count: int, check: bool
) -> tuple[Result, Bound | None]:
    """Bind ``impl`` to the op and size and check its result once: the Result to fill in, and
    the Bound to time (None, with the reason in the status, where it cannot run)."""
    res = Result(op, impl, nbytes, count, str(env.dtype))
    bound: Bound | None = None
    error: str | None = None
    wrong = False
    try:
        bound = bind(env, impl, op, count)
        bound.enter()
        if check:
            got = bound.result()
            want = expected(op, count, env.rank, env.n, env.dtype)
            wrong = got.shape != want.shape or not np.array_equal(got, want)
            bound.after_check()
    except Unsupported as e:
        error = str(e)
    except Exception as e:  # a peer without the op (gloo): recorded, the run goes on
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    error = agree(env.world, error)
    if error is not None or bound is None:
        res.status = f"n/a: {error}"
        return res, None
    if agree(env.world, "wrong" if wrong else None):
        res.status = "WRONG RESULT"
    return res, bound


def measure_size(
    env: Env,
    impls: Sequence[str],
    op: str,
    nbytes: int,
    count: int,
    iters: int,
    warmup: int,
    rounds: int,
    check: bool,
) -> dict[str, Result]:
    """Every implementation at one op and size: ``rounds`` rounds, each giving every
    implementation in turn its warm-up, a barrier and ``iters`` timed calls; per rank the
    median over all rounds' calls, then the maximum over ranks."""
    prepared = {impl: prepare(env, impl, op, nbytes, count, check) for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl, (_, bound) in prepared.items():
            if bound is not None:
                bound.enter()
                times[impl] += time_series(env.world, bound.call, iters, warmup)
    rows = {}
    for impl, (res, bound) in prepared.items():
        if bound is not None:
            res.iters = iters * rounds
            res.time_s, res.rank_medians_s = max_of_medians(env.world, times[impl])
            res.algbw = nbytes / res.time_s / 1e9
            res.busbw = res.algbw * busbw_factor(op, env.n)
        rows[impl] = res
    return rows


# --------------------------------------------------------------------------------------------
# Small messages and memcpy


def small_message(env: Env, impls: Sequence[str], iters: int) -> list[dict[str, Any]]:
    """Per call: a jitted function with one 4-byte allreduce against the same without it (the
    two timed alternately, after iters/10 untimed pairs and a barrier)."""
    import jax
    import jax.numpy as jnp

    from .. import ops

    x = jnp.ones((1,), jnp.float32)
    rows = []
    variants: list[tuple[str, Callable[[Any], Any]]] = [(SPMD, lambda v: ops.allreduce(v + 1))]
    if "mpi4jax" in impls:
        m, comm, sum_ = env.mpi4jax, env.mpi4jax_comm, env.mpi.SUM
        variants.append(("mpi4jax", lambda v: first(m.allreduce(v + 1, op=sum_, comm=comm))))
    base = jax.jit(lambda v: v + 1)
    for name, fn in variants:
        coll = jax.jit(fn)
        # Interleaved, so that both see the same machine: base, collective, base, ...
        series: dict[str, list[float]] = {"base": [], "collective": []}
        clock = time.perf_counter
        for i in range(iters // 10 + iters):
            if i == iters // 10:
                env.world.Barrier()
                series = {"base": [], "collective": []}
            for label, f in (("base", base), ("collective", coll)):
                t0 = clock()
                f(x).block_until_ready()
                series[label].append(clock() - t0)
        per = {label: max_of_medians(env.world, t)[0] for label, t in series.items()}
        rows.append(
            {
                "impl": name,
                "with_allreduce_us": round(per["collective"] * 1e6, 2),
                "without_us": round(per["base"] * 1e6, 2),
                "ratio": round(per["collective"] / per["base"], 2),
                "added_us": round((per["collective"] - per["base"]) * 1e6, 2),
            }
        )
    if "mpi4py" in impls:  # the same 4 bytes, eager on numpy: no jit, no dispatch
        a, b = np.ones(1, np.float32), np.empty(1, np.float32)
        times = time_series(env.world, lambda: env.world.Allreduce(a, b), iters, iters // 10)
        t, _ = max_of_medians(env.world, times)
        row = {"impl": "mpi4py (eager)", "with_allreduce_us": round(t * 1e6, 2)}
        rows.append(row | {"without_us": None, "ratio": None, "added_us": None})
    return rows


def memcpy(env: Env, nbytes: int = MEMCPY_BYTES, iters: int = 20) -> dict[str, Any]:
    """np.copyto of ``nbytes`` on every rank at once (the ranks share the memory bus)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    times = time_series(env.world, lambda: np.copyto(dst, src), iters, 3)
    t, _ = max_of_medians(env.world, times)
    return {"bytes": nbytes, "time_us": round(t * 1e6, 1), "GBps": round(nbytes / t / 1e9, 2)}
