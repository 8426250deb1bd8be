"""``spmd-bench``: the collectives benchmark, spmd inside ``jax.jit`` against the peers a user
would pick instead, in the same run on the same machine.

    spmd-bench                                  # 2 ranks, all ops, 4 B .. 64 MiB
    spmd-bench -n 4 --ops allreduce -e 16M --json allreduce.json
    spmd-run -n 2 python benchmarks/collectives.py   # the same code; writes benchmarks/results/

Started outside an MPI job, ``spmd-bench`` relaunches itself under ``spmd-run -n N``. Peers
(optional, each skipped with its reason when it cannot run): mpi4py on numpy buffers, out of
place and in place; mpi4jax inside ``jax.jit``; torch.distributed with gloo. The table is the
one nccl-tests prints: size is the total bytes of the collective (allgather: the output, each
rank contributing size/n; reduce_scatter: the input; all_to_all: the whole buffer), algbw =
size / time, busbw = algbw x 2(n-1)/n (allreduce), x (n-1)/n (allgather, reduce_scatter,
all_to_all), x 1 (broadcast). Time is, per rank, the median of individually timed calls after
a warm-up and one barrier, then the maximum over ranks. ratio = spmd busbw / peer busbw
(peer time / spmd time): above 1, spmd is faster. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import SpmdError
from ..runtime._affinity import recorded_cpus

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")
PEERS = ("mpi4py", "mpi4jax", "torch")
DTYPES = ("float32", "float64", "int32")
SPMD = "spmd"
# Implementations in column order; a peer name expands to its implementations.
PEER_IMPLS = {
    "mpi4py": ("mpi4py", "mpi4py-inplace"),
    "mpi4jax": ("mpi4jax",),
    "torch": ("torch-gloo",),
}
MEMCPY_BYTES = 64 << 20
SMALL_ITERS = 2000

Array = npt.NDArray[Any]


class Unsupported(Exception):
    """This implementation has no such operation (the row shows n/a)."""


# --------------------------------------------------------------------------------------------
# Sizes, counts, bandwidth


def parse_size(text: str) -> int:
    """``4``, ``64K``, ``1M``, ``2G`` (binary multiples) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", text)
    if m is None:
        raise SpmdError(f"size {text!r} is not a byte count such as 4, 64K, 1M or 2G")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def size_sweep(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 1 or hi < lo or factor < 2:
        raise SpmdError(f"size sweep {lo}..{hi} x{factor}: need 1 <= min <= max and factor >= 2")
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
# Inputs and expected results (exact in every dtype: small integers)


def pattern(count: int, rank: int, dtype: np.dtype[Any], offset: int = 0) -> Array:
    """Rank ``rank``'s input: element i is (offset + i) % 7 + rank."""
    return ((np.arange(offset, offset + count) % 7) + rank).astype(dtype)


def expected(op: str, count: int, rank: int, n: int, dtype: np.dtype[Any]) -> Array:
    """This rank's flat result of ``op`` over inputs ``pattern(., r)``, computed locally."""
    k = count // n
    if op == "allreduce":
        return (n * (np.arange(count) % 7) + n * (n - 1) // 2).astype(dtype)
    if op == "allgather":
        return (np.tile(np.arange(k) % 7, n) + np.repeat(np.arange(n), k)).astype(dtype)
    if op == "reduce_scatter":
        return (n * (np.arange(rank * k, (rank + 1) * k) % 7) + n * (n - 1) // 2).astype(dtype)
    if op == "broadcast":
        return pattern(count, 0, dtype)
    if op == "all_to_all":
        block = np.arange(rank * k, (rank + 1) * k) % 7
        return (np.tile(block, n) + np.repeat(np.arange(n), k)).astype(dtype)
    raise SpmdError(f"unknown op {op!r}")


def op_input(op: str, count: int, rank: int, n: int, dtype: np.dtype[Any]) -> Array:
    """The input of ``op`` on this rank: allgather takes this rank's block, the others all."""
    if op == "allgather":
        return pattern(count // n, rank, dtype)
    return pattern(count, rank, dtype)


# --------------------------------------------------------------------------------------------
# Implementations: one bound (op, size) is a call that completes and a way to get its result


@dataclass
class Bound:
    call: Callable[[], object]  # one complete call (the timed unit)
    result: Callable[[], Array]  # run once on the check input; this rank's flat result
    after_check: Callable[[], None] = lambda: None  # reset buffers an in-place call mutated


@dataclass
class Env:
    """What the implementations need: the world, the dtype and the imported peers."""

    rank: int
    n: int
    dtype: np.dtype[Any]
    mpi: Any  # mpi4py.MPI
    world: Any  # MPI.COMM_WORLD
    mpi4jax: Any = None
    mpi4jax_comm: Any = None
    torch: Any = None
    dist: Any = None


def _jax_bound(fn: Callable[[Any], Any], x_np: Array) -> Bound:
    import jax
    import jax.numpy as jnp

    f = jax.jit(fn)
    x = jnp.asarray(x_np)

    def call() -> object:
        return f(x).block_until_ready()

    def result() -> Array:
        return np.asarray(f(x)).reshape(-1)

    return Bound(call, result)


def bind_spmd(env: Env, op: str, count: int) -> Bound:
    from .. import ops

    fns: dict[str, Callable[[Any], Any]] = {
        "allreduce": lambda x: ops.allreduce(x),
        "allgather": lambda x: ops.allgather(x),
        "reduce_scatter": lambda x: ops.reduce_scatter(x),
        "broadcast": lambda x: ops.broadcast(x, root=0),
        "all_to_all": lambda x: ops.all_to_all(x),
    }
    return _jax_bound(fns[op], op_input(op, count, env.rank, env.n, env.dtype))


def _first(out: Any) -> Any:
    """mpi4jax < 0.4 returns (result, token); later versions the result alone."""
    return out[0] if isinstance(out, tuple) else out


def bind_mpi4jax(env: Env, op: str, count: int) -> Bound:
    m, comm, n, sum_ = env.mpi4jax, env.mpi4jax_comm, env.n, env.mpi.SUM
    fns: dict[str, Callable[[Any], Any]] = {
        "allreduce": lambda x: _first(m.allreduce(x, op=sum_, comm=comm)),
        "allgather": lambda x: _first(m.allgather(x, comm=comm)),
        "broadcast": lambda x: _first(m.bcast(x, 0, comm=comm)),
        "all_to_all": lambda x: _first(m.alltoall(x.reshape(n, -1), comm=comm)),
    }
    if op not in fns:
        raise Unsupported(f"mpi4jax has no {op}")
    return _jax_bound(fns[op], op_input(op, count, env.rank, env.n, env.dtype))


def bind_mpi4py(env: Env, op: str, count: int, in_place: bool) -> Bound:
    MPI, comm, rank, n, dtype = env.mpi, env.world, env.rank, env.n, env.dtype
    k = count // n
    x = op_input(op, count, rank, n, dtype)
    if not in_place:
        out = np.empty(count if op != "reduce_scatter" else k, dtype)
        calls: dict[str, Callable[[], object]] = {
            "allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
            "allgather": lambda: comm.Allgather(x, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(x, root=0),
            "all_to_all": lambda: comm.Alltoall(x, out),
        }

        def result() -> Array:
            calls[op]()
            return (x if op == "broadcast" else out).copy()

        return Bound(calls[op], result)

    buf = np.zeros(count, dtype)  # zeros: repeated in-place sums stay 0, never overflow
    ip = MPI.IN_PLACE
    calls = {
        "allreduce": lambda: comm.Allreduce(ip, buf, op=MPI.SUM),
        "allgather": lambda: comm.Allgather(ip, buf),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(ip, buf, op=MPI.SUM),
        "broadcast": lambda: comm.Bcast(buf, root=0),
        "all_to_all": lambda: comm.Alltoall(ip, buf),
    }

    def result_in_place() -> Array:
        if op == "allgather":  # this rank's block sits at its place in the output
            buf[rank * k : (rank + 1) * k] = x
        else:
            buf[:] = x
        calls[op]()
        return (buf[:k] if op == "reduce_scatter" else buf).copy()

    def reset() -> None:
        if op in ("allreduce", "reduce_scatter"):
            buf[:] = 0

    return Bound(calls[op], result_in_place, reset)


def bind_torch(env: Env, op: str, count: int) -> Bound:
    torch, dist, n, rank = env.torch, env.dist, env.n, env.rank
    k = count // n
    x = torch.from_numpy(op_input(op, count, rank, n, env.dtype).copy())
    out = torch.empty(k if op == "reduce_scatter" else count, dtype=x.dtype)
    if op == "allreduce":  # torch.distributed reduces in place only

        def call() -> object:
            return dist.all_reduce(x)

    elif op == "allgather":

        def call() -> object:
            return dist.all_gather_into_tensor(out, x)

    elif op == "reduce_scatter":

        def call() -> object:
            return dist.reduce_scatter_tensor(out, x)

    elif op == "broadcast":

        def call() -> object:
            return dist.broadcast(x, src=0)

    else:

        def call() -> object:
            return dist.all_to_all_single(out, x)

    original = x.clone()

    def result() -> Array:
        x.copy_(original)
        call()
        res = x if op in ("allreduce", "broadcast") else out
        return np.asarray(res.numpy()).copy()

    def reset() -> None:
        if op == "allreduce":
            x.zero_()

    return Bound(call, result, reset)


def bind(env: Env, impl: str, op: str, count: int) -> Bound:
    if impl == SPMD:
        return bind_spmd(env, op, count)
    if impl == "mpi4py":
        return bind_mpi4py(env, op, count, in_place=False)
    if impl == "mpi4py-inplace":
        return bind_mpi4py(env, op, count, in_place=True)
    if impl == "mpi4jax":
        return bind_mpi4jax(env, op, count)
    if impl == "torch-gloo":
        return bind_torch(env, op, count)
    raise SpmdError(f"unknown implementation {impl!r}")


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


def agree(world: Any, error: str | None) -> str | None:
    """Every rank's error, so that all ranks skip together: the first one, or None."""
    errors: list[str | None] = world.allgather(error)
    return next((e for e in errors if e), None)


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
        variants.append(("mpi4jax", lambda v: _first(m.allreduce(v + 1, op=sum_, comm=comm))))
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


# --------------------------------------------------------------------------------------------
# Peers and machine info


def load_peers(env: Env, wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Import the wanted peers; returns the implementations that run and why others do not."""
    impls: list[str] = []
    skipped: dict[str, str] = {}
    for peer in PEERS:
        if peer not in wanted:
            skipped[peer] = "not requested (--peers)"
            continue
        error: str | None = None
        try:
            if peer == "mpi4jax":
                env.mpi4jax = importlib.import_module("mpi4jax")
                env.mpi4jax_comm = env.world.Dup()
            elif peer == "torch":
                error = _init_torch(env)
        except Exception as e:
            error = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        error = agree(env.world, error)
        if error is None:
            impls += PEER_IMPLS[peer]
        else:
            skipped[peer] = error
    return impls, skipped


def _init_torch(env: Env) -> str | None:
    env.torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    port = None
    if env.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = env.world.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=env.rank, world_size=env.n)
    env.dist = dist
    return None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def machine_info(env: Env, backend: str) -> dict[str, Any]:
    """Hardware and versions; no hostname, no paths."""
    import jax

    from .._groups import shm_staging

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    lib = str(env.mpi.Get_library_version()).strip().splitlines()[0]
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "job_cores": job_cores(),
        "cores_per_rank": affinity,  # rank 0's affinity mask (spmd-run pins ranks)
        "memory_GiB": memory_gib(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "spmd": package_version("spmd"),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
        "jax_device": str(jax.devices()[0].device_kind),
        "numpy": np.__version__,
        "mpi4py": package_version("mpi4py"),
        "mpi_library": " ".join(lib.split()),
        "mpi_standard": "{}.{}".format(*env.mpi.Get_version()),
        "mpich_wheel": package_version("mpich"),
        "mpi4jax": package_version("mpi4jax"),
        "torch": package_version("torch"),
        "spmd_backend": backend,
        "spmd_shm_staging": shm_staging(),
        "ranks": env.n,
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    return info


def shm_hop(probes: int = 3) -> float | None:
    """The world's shared-memory hop time (spmd._groups.shm_hop_ns), rounded, as rank 0
    measured it: the least of ``probes`` probes, since a rank descheduled during one (at a job's
    start, XLA's threads still busy) only adds to it. Collective. Over 100 ns the ranks share
    no cache and staging streams; the state can change during a run on a VM."""
    from .._groups import shm_hop_ns

    hops = [shm_hop_ns() for _ in range(probes)]
    if hops[0] is None or math.isnan(hops[0]):
        return None
    return round(min(h for h in hops if h is not None), 1)


def job_cores() -> int:
    """The cores this job may use: those ``spmd-run`` recorded for its ranks before pinning them
    (``SPMD_BIND_CPUS``), else this process's affinity (``taskset``, a cgroup's cpuset), else
    every core of the machine."""
    recorded = recorded_cpus(os.environ)
    if recorded is not None:
        return len(recorded)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cores_tag() -> str:
    """``cpu<cores>`` for the results' file names; ``cpu<cores>of<total>`` when the job was given
    fewer cores than the machine has, so that such a run never overwrites a whole machine's."""
    used, total = job_cores(), os.cpu_count() or 1
    return f"cpu{used}" if used >= total else f"cpu{used}of{total}"


def run_tag(n: int, backend_forced: str | None) -> str:
    tag = f"{cores_tag()}-n{n}"
    return f"{tag}-{backend_forced}" if backend_forced and backend_forced != "auto" else tag


# --------------------------------------------------------------------------------------------
# Tables


def _f(x: float, width: int, digits: int = 2) -> str:
    return f"{'n/a':>{width}}" if x != x else f"{x:{width}.{digits}f}"


def _ratio(spmd: Result | None, peer: Result) -> float:
    if spmd is None or not peer.busbw:
        return float("nan")
    return spmd.busbw / peer.busbw  # nan when either is n/a


def console_header(op: str, impls: Sequence[str], n: int, dtype: str) -> str:
    factor = busbw_factor(op, n)
    lines = [
        f"# {op}: {n} ranks, {dtype}; time = max over ranks of the median (us), "
        f"bandwidths in GB/s, busbw = algbw x {factor:.3g}; ratio = spmd busbw / peer busbw",
    ]
    top = f"#{'':>9} {'':>11} {'':>8}"
    sub = f"#{'size':>9} {'count':>11} {'dtype':>8}"
    for impl in impls:
        label = "spmd (jit)" if impl == SPMD else impl
        width = 30 if impl == SPMD else 37
        top += f" |{label:^{width}}"
        sub += f" |{'time':>10} {'algbw':>9} {'busbw':>9}"
        if impl != SPMD:
            sub += f" {'ratio':>6}"
    return "\n".join([*lines, top, sub])


def console_row(rows: dict[str, Result], impls: Sequence[str]) -> str:
    first = rows[impls[0]]
    line = f" {first.nbytes:>9} {first.count:>11} {first.dtype:>8}"
    spmd = rows.get(SPMD)
    for impl in impls:
        r = rows[impl]
        line += f" |{_f(r.time_s * 1e6, 10, 1)} {_f(r.algbw, 9)} {_f(r.busbw, 9)}"
        if impl != SPMD:
            line += f" {_f(_ratio(spmd, r), 6)}"
        if r.status == "WRONG RESULT":
            line += " WRONG"
    return line


def markdown(report: dict[str, Any], results: list[Result], impls: Sequence[str]) -> str:
    info = report["machine"]
    n = info["ranks"]
    out = [f"# Collectives benchmark: {n} ranks, {report['config']['dtype']}", ""]
    out += [f"Produced by `{report['command']}`.", ""]
    out += ["| machine | |", "|---|---|"]
    out += [f"| {k} | {v if v is not None else 'not installed'} |" for k, v in info.items()]
    out += [""]
    if report["skipped_peers"]:
        skipped = report["skipped_peers"].items()
        out += ["Peers skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped), ""]
    out += [
        f"Time: per rank the median of individually timed calls ({report['config']['rounds']} "
        "rounds over the implementations, each with its warm-up and one barrier), then the "
        "maximum over ranks, in microseconds. algbw = size / time, busbw = algbw x "
        "2(n-1)/n (allreduce), (n-1)/n (allgather, reduce_scatter, all_to_all), 1 (broadcast); "
        "GB/s are 1e9 bytes per second. ratio = spmd busbw / peer busbw: above 1, spmd is "
        "faster. spmd and mpi4jax run inside `jax.jit`; mpi4py on numpy buffers.",
        "",
    ]
    largest = _largest(results)
    if largest:
        out += ["## Largest size: spmd / peer (busbw ratio)", ""]
        peers = [i for i in impls if i != SPMD]
        out += ["| op | size | spmd busbw | " + " | ".join(peers) + " |"]
        out += ["|---" * (3 + len(peers)) + "|"]
        for op, rows in largest.items():
            spmd = rows.get(SPMD)
            cells = [_f(_ratio(spmd, rows[p]), 0).strip() if p in rows else "" for p in peers]
            busbw = _f(spmd.busbw, 0).strip() if spmd else "n/a"
            size = format_bytes(next(iter(rows.values())).nbytes)
            out += [f"| {op} | {size} | {busbw} | " + " | ".join(cells) + " |"]
        out += [""]
    for op in report["config"]["ops"]:
        op_rows = [r for r in results if r.op == op]
        if not op_rows:
            continue
        out += [f"## {op} (busbw = algbw x {busbw_factor(op, n):.3g})", ""]
        head = ["size (B)", "count", "dtype"]
        for impl in impls:
            label = "spmd" if impl == SPMD else impl
            head += [f"{label} us", f"{label} algbw", f"{label} busbw"]
            if impl != SPMD:
                head += [f"spmd/{label}"]
        out += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for nbytes in sorted({r.nbytes for r in op_rows}):
            rows = {r.impl: r for r in op_rows if r.nbytes == nbytes}
            first = rows[impls[0]]
            cells = [str(nbytes), str(first.count), first.dtype]
            for impl in impls:
                r = rows[impl]
                mark = " (wrong)" if r.status == "WRONG RESULT" else ""
                cells += [_f(r.time_s * 1e6, 0, 1).strip() + mark]
                cells += [_f(r.algbw, 0).strip(), _f(r.busbw, 0).strip()]
                if impl != SPMD:
                    cells += [_f(_ratio(rows.get(SPMD), r), 0).strip()]
            out += ["| " + " | ".join(cells) + " |"]
        na = _not_run(op_rows)
        if na:
            out += ["", "n/a: " + "; ".join(na)]
        out += [""]
    if report.get("small_message"):
        out += ["## Small messages: one 4-byte float32 allreduce inside a jitted function", ""]
        out += ["| impl | with allreduce (us) | `x + 1` alone (us) | ratio | added (us) |"]
        out += ["|---|---:|---:|---:|---:|"]
        for row in report["small_message"]:
            cells = [row[k] for k in ("with_allreduce_us", "without_us", "ratio", "added_us")]
            out += [
                f"| {row['impl']} | "
                + " | ".join("-" if c is None else str(c) for c in cells)
                + " |"
            ]
        out += [""]
    if report.get("memcpy"):
        m = report["memcpy"]
        out += [
            "## Reference: numpy memcpy",
            "",
            f"`np.copyto` of {format_bytes(m['bytes'])}B on every rank at once: {m['time_us']} us, "
            f"{m['GBps']} GB/s (bytes copied / time; the memory moves twice that).",
            "",
        ]
    return "\n".join(out)


def _not_run(results: Iterable[Result]) -> list[str]:
    """``impl: why`` for each implementation that did not run an op."""
    return sorted({f"{r.impl}: {r.status[5:]}" for r in results if r.status.startswith("n/a")})


def _largest(results: list[Result]) -> dict[str, dict[str, Result]]:
    out: dict[str, dict[str, Result]] = {}
    for op in OPS:
        rows = [r for r in results if r.op == op]
        if rows:
            top = max(r.nbytes for r in rows)
            out[op] = {r.impl: r for r in rows if r.nbytes == top}
    return out


# --------------------------------------------------------------------------------------------
# Command line


def _list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["none"] and what == "peer":
        return []
    if items == ["all"]:
        return list(allowed)
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SpmdError(f"unknown {what} {', '.join(bad)}; expected some of {', '.join(allowed)}")
    return items


def parser(prog: str = "spmd-bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Collectives benchmark: spmd inside jax.jit against mpi4py, mpi4jax and "
        "torch.distributed (gloo), nccl-tests style. Relaunches itself under spmd-run when "
        "started outside an MPI job.",
        epilog="example: spmd-bench -n 2 --ops allreduce,allgather -e 16M --json out.json",
    )
    p.add_argument("-n", "--nprocs", type=int, help="ranks when relaunching (default 2)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list (default {','.join(OPS)})")
    p.add_argument("-b", "--min-bytes", default="4", help="smallest size (default 4)")
    p.add_argument("-e", "--max-bytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=int, default=4, help="size step (default x4)")
    p.add_argument("--sizes", help="comma list of sizes instead of the sweep, e.g. 4,1K,64M")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="default float32")
    p.add_argument("--iters", type=int, help="timed calls per series (default: by size)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default iters/10, >= 2)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over the implementations per op and size, each with its warm-up and "
        "iters timed calls; the median is over all rounds' calls (default 3)",
    )
    p.add_argument(
        "--peers",
        default="all",
        help=f"comma list of {', '.join(PEERS)}, 'all' (default: those importable) or 'none'",
    )
    p.add_argument("--backend", choices=("auto", "shm", "mpi", "hier"), help="force spmd's backend")
    p.add_argument("--no-check", action="store_true", help="skip the result check")
    p.add_argument("--no-small", action="store_true", help="skip the small-message section")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--markdown", help="write a Markdown report here")
    p.add_argument(
        "--out-dir",
        help="write collectives-<tag>.json and .md here (tag: cpu<cores>-n<ranks>, or "
        "cpu<cores>of<total>-n<ranks> when the job has fewer cores than the machine)",
    )
    p.add_argument("--timeout", type=float, help="when relaunching: stop the job after seconds")
    return p


def _sanitize(argv: Sequence[str]) -> list[str]:
    """Arguments for the record, without absolute paths."""
    return [os.path.basename(a) if os.path.isabs(a) else a for a in argv]


def resolve_args(args: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    """The ops, peers and sizes asked for; raises SpmdError on a bad option."""
    if args.rounds < 1 or (args.iters is not None and args.iters < 1):
        raise SpmdError("--rounds and --iters need at least 1")
    if args.nprocs is not None and args.nprocs < 1:
        raise SpmdError(f"-n {args.nprocs}: need at least one rank")
    op_list = _list(args.ops, OPS, "op")
    peers = _list(args.peers, PEERS, "peer")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    if not op_list or not sizes:
        raise SpmdError("no ops or no sizes to run")
    return op_list, peers, sizes


def run_rank(args: argparse.Namespace, command: str) -> int:
    import spmd

    comm = spmd.init()
    try:
        return _run_rank(args, command, comm.rank, comm.size)
    finally:
        spmd.finalize()


def _run_rank(args: argparse.Namespace, command: str, rank: int, n: int) -> int:
    from mpi4py import MPI

    from .. import ops

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    dtype = np.dtype(args.dtype)
    if dtype == np.float64:
        import jax

        config: Any = jax.config
        config.update("jax_enable_x64", True)
    if args.backend:
        ops.set_backend(args.backend)
    if args.nprocs is not None and args.nprocs != n:
        say(f"spmd-bench: -n {args.nprocs} ignored: this job has {n} ranks")
    op_list, peers, sizes = resolve_args(args)
    env = Env(rank, n, dtype, MPI, MPI.COMM_WORLD)
    peer_impls, skipped = load_peers(env, peers)
    impls = [SPMD, *peer_impls]
    ops.barrier()  # registers spmd's world group, so that its backend is known
    backend = ops.get_backend()
    info = machine_info(env, backend)
    info["shm_hop_ns_at_start"] = shm_hop()
    say(f"spmd-bench: {n} ranks, spmd backend {backend}, {info['cpu']} ({info['cores']} cores)")
    say(f"implementations: {', '.join(impls)}")
    for peer, why in skipped.items():
        say(f"skipped peer {peer}: {why}")

    results: list[Result] = []
    start = time.monotonic()
    for op in op_list:
        say("")
        say(console_header(op, impls, n, str(dtype)))
        seen: set[int] = set()
        for size in sizes:
            count = element_count(op, size, dtype.itemsize, n)
            nbytes = count * dtype.itemsize
            if nbytes in seen:
                continue
            seen.add(nbytes)
            iters = args.iters or default_iterations(nbytes)
            warmup = args.warmup if args.warmup is not None else default_warmup(iters)
            rows = measure_size(
                env, impls, op, nbytes, count, iters, warmup, args.rounds, not args.no_check
            )
            results += rows.values()
            say(console_row(rows, impls))
        for line in _not_run(r for r in results if r.op == op):
            say(f"#   n/a {line}")
    small = [] if args.no_small else small_message(env, peer_impls, SMALL_ITERS)
    if small:
        say("")
        say("# small messages: jitted function with one 4-byte float32 allreduce vs `x + 1` alone")
        say(f"# {'impl':>14} {'with (us)':>10} {'without':>10} {'ratio':>7} {'added':>8}")
        for row in small:
            cells = [row[k] for k in ("with_allreduce_us", "without_us", "ratio", "added_us")]
            text = ["-" if c is None else str(c) for c in cells]
            say(f"  {row['impl']:>14} {text[0]:>10} {text[1]:>10} {text[2]:>7} {text[3]:>8}")
    ref = memcpy(env)
    say("")
    say(f"# reference: numpy memcpy of {format_bytes(ref['bytes'])}B on every rank at once: "
        f"{ref['time_us']} us, {ref['GBps']} GB/s")  # fmt: skip
    info["shm_hop_ns_at_end"] = shm_hop()
    say(
        f"# shared-memory hop (the staging probe, docs/collectives.md): "
        f"{info['shm_hop_ns_at_start']} ns at the start, {info['shm_hop_ns_at_end']} ns at the end"
    )
    say(f"# benchmark time: {time.monotonic() - start:.0f} s")
    if env.dist is not None:
        env.dist.destroy_process_group()
    if env.mpi4jax_comm is not None:
        env.mpi4jax_comm.Free()

    if rank == 0:
        info["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        report = {
            "command": command,
            "machine": info,
            "config": {
                "ops": op_list,
                "sizes": sizes,
                "dtype": str(dtype),
                "iters": args.iters or "by size: clamp(1 GiB / size, 20, 1000)",
                "warmup": args.warmup if args.warmup is not None else "iters / 10, at least 2",
                "rounds": args.rounds,
                "check": not args.no_check,
                "implementations": impls,
            },
            "skipped_peers": skipped,
            "results": [r.to_json() for r in results],
            "small_message": small,
            "memcpy": ref,
        }
        _write(args, report, results, impls, run_tag(n, args.backend))
    return 0


def _write(
    args: argparse.Namespace,
    report: dict[str, Any],
    results: list[Result],
    impls: Sequence[str],
    tag: str,
) -> None:
    targets: list[tuple[str, str]] = []
    if args.out_dir:
        base = Path(args.out_dir) / f"collectives-{tag}"
        targets += [("json", f"{base}.json"), ("md", f"{base}.md")]
    if args.json:
        targets.append(("json", args.json))
    if args.markdown:
        targets.append(("md", args.markdown))
    for kind, path in targets:
        text = json.dumps(report, indent=1) if kind == "json" else markdown(report, results, impls)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        shown = os.path.relpath(path) if os.path.isabs(path) else path
        print(f"wrote {shown}", flush=True)


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "spmd-bench",
    script: str | None = None,
    default_out_dir: str | None = None,
) -> int:
    """``spmd-bench``; ``script`` and ``default_out_dir`` for benchmarks/collectives.py."""
    from ..runtime._env import mpi_rank_size

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    if args.out_dir is None and default_out_dir is not None:
        args.out_dir = default_out_dir
    try:
        resolve_args(args)  # bad options fail here, before any job starts
        if mpi_rank_size(os.environ) is None:  # not in a job: start one
            from ..launch import launch

            nprocs = args.nprocs or 2
            target = [os.path.abspath(script)] if script else ["-m", "spmd.cli.bench"]
            return launch(nprocs, [sys.executable, *target, *argv], timeout=args.timeout)
        if script:
            shown = "/".join(Path(script).resolve().parts[-2:])  # benchmarks/collectives.py
            entry = ["spmd-run", "-n", str(_world_size()), "python", shown]
        else:
            entry = ["spmd-bench"] + ([] if args.nprocs else ["-n", str(_world_size())])
        command = " ".join([*entry, *_sanitize(argv)])
        return run_rank(args, command)
    except SpmdError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def _world_size() -> int:
    from ..runtime._env import mpi_rank_size

    found = mpi_rank_size(os.environ)
    return found[1] if found is not None and found[1] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
