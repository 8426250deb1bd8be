"""What the GPU handlers' sequence check costs per call on the host, without a GPU: its CPU side
(``native().group_sequence``, the function the handlers reach through their hooks) called back to
back on every rank, against an empty call into the same module.

    spmd-run -n 2 python benchmarks/sequence_check.py [--calls 100000] [--rounds 5]

Prints, on rank 0, the median over ``--rounds`` of the mean time per call of each. Every rank
makes the same calls, so nothing fails; back to back, each call pulls the cache lines its peers
have just written, which calls spaced by GPU work rarely do.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import spmd
    from spmd._native_lib import native
    from spmd.runtime._groups import native_group

    comm = spmd.init()
    gid = native_group(comm).gid
    mod = native()
    text = "allreduce(op=sum) of float32[4096]"
    calls = {
        "empty call into the module": mod.abi_version,
        "sequence check": lambda: mod.group_sequence(gid, text),
    }
    for name, call in calls.items():
        times = []
        for _ in range(args.rounds):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            times.append((time.perf_counter() - t0) / args.calls)
        if comm.rank == 0:
            print(f"{name}: {statistics.median(times) * 1e9:.0f} ns per call "
                  f"({comm.size} ranks, median of {args.rounds} x {args.calls} calls)")  # fmt: skip
    spmd.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
