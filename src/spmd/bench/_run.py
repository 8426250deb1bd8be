"""One benchmark run on the ranks of a job: every op and size for spmd and the peers, the small
message and memcpy references, the console table on rank 0 and the report it writes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._machine import machine_info, run_tag, shm_hop
from ._peers import SPMD, Env, load_peers
from ._report import Files, console_header, console_row, not_run, write_reports
from ._timing import (
    SMALL_ITERS,
    Result,
    default_iterations,
    default_warmup,
    element_count,
    format_bytes,
    measure_size,
    memcpy,
    small_message,
)


@dataclass(frozen=True)
class Settings:
    """What a run measures and where it writes (``spmd-bench``'s options, checked)."""

    ops: list[str]
    peers: list[str]
    sizes: list[int]  # bytes, before rounding to whole elements and blocks per rank
    dtype: str = "float32"
    iters: int | None = None  # timed calls per series; None: by size
    warmup: int | None = None  # untimed calls first; None: iters / 10, at least 2
    rounds: int = 3
    # spmd's transport forced; None: its own choice; a comma list: spmd once per transport.
    transport: str | None = None
    check: bool = True
    small: bool = True
    nprocs: int | None = None  # the ranks asked for, to say so when the job has others
    files: Files = field(default_factory=Files)


def run_rank(settings: Settings, command: str) -> int:
    """Run the benchmark on this rank of the job (a collective: every rank calls it); rank 0
    prints and writes the report. ``command`` is recorded as what produced it."""
    from .. import runtime

    comm = runtime.init()
    try:
        return _run_rank(settings, command, comm.rank, comm.size)
    finally:
        runtime.finalize()


def _run_rank(settings: Settings, command: str, rank: int, n: int) -> int:
    from mpi4py import MPI

    from .. import ops

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    dtype = np.dtype(settings.dtype)
    if dtype == np.float64:
        import jax

        config: Any = jax.config
        config.update("jax_enable_x64", True)
    compared = settings.transport.split(",") if settings.transport else []
    if len(compared) == 1:
        ops.set_transport(compared[0])
    if settings.nprocs is not None and settings.nprocs != n:
        say(f"spmd-bench: -n {settings.nprocs} ignored: this job has {n} ranks")
    op_list, peers, sizes = settings.ops, settings.peers, settings.sizes
    env = Env(rank, n, dtype, MPI, MPI.COMM_WORLD)
    peer_impls, skipped = load_peers(env, peers)
    mine = [SPMD] if len(compared) < 2 else [f"{SPMD}-{t}" for t in compared]
    impls = [*mine, *peer_impls]
    ops.barrier()  # registers spmd's world group, so that its transport is known
    transport = ops.get_transport() if len(compared) < 2 else "+".join(compared)
    info = machine_info(env, transport)
    info["shm_hop_ns_at_start"] = shm_hop()
    say(f"spmd-bench: {n} ranks, spmd transport {transport}, {info['cpu']} ({info['cores']} cores)")
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
            iters = settings.iters or default_iterations(nbytes)
            warmup = settings.warmup if settings.warmup is not None else default_warmup(iters)
            rows = measure_size(
                env, impls, op, nbytes, count, iters, warmup, settings.rounds, settings.check
            )
            results += rows.values()
            say(console_row(rows, impls))
        for line in not_run(r for r in results if r.op == op):
            say(f"#   n/a {line}")
    small = small_message(env, peer_impls, SMALL_ITERS) if settings.small else []
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
                "iters": settings.iters or "by size: clamp(1 GiB / size, 20, 1000)",
                "warmup": "iters / 10, at least 2" if settings.warmup is None else settings.warmup,
                "rounds": settings.rounds,
                "check": settings.check,
                "implementations": impls,
            },
            "skipped_peers": skipped,
            "results": [r.to_json() for r in results],
            "small_message": small,
            "memcpy": ref,
        }
        write_reports(settings.files, report, results, impls, run_tag(n, settings.transport))
    return 0
