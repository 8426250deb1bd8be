"""spmd.MessageQueue against mpi4py's ``bcast`` of the same pickled objects, in the same run:
rank 0 broadcasts a small dict and objects of 1 KiB, 64 KiB and 1 MiB (a bytes payload in a
dict) to the other ranks, K times in a row; each round's time is the slowest rank's, from the
first send to the last object received, divided by K. Medians over the rounds, and the ratio.

    spmd-run -n 2 python benchmarks/message_queue.py [--rounds 7] [--repeat 200]
    spmd-run -n 4 --nodes 2 python benchmarks/message_queue.py   # half the readers over ZMQ

Writes benchmarks/results/message_queue-<cores>-n<ranks>[-nodes<k>].{json,md} (rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PAYLOADS: dict[str, Any] = {
    "small dict": {"step": 7, "lr": 0.001, "done": False, "name": "train"},
    "1 KiB": {"blob": b"x" * 1024},
    "64 KiB": {"blob": b"x" * (64 << 10)},
    "1 MiB": {"blob": b"x" * (1 << 20)},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    import spmd

    comm = spmd.init()
    mpi = comm.mpi_comm()
    queue = spmd.MessageQueue(comm, slots=8, slot_bytes=1 << 20)

    def timed(send: Any, recv: Any, obj: Any) -> float:
        mpi.Barrier()
        start = time.perf_counter()
        for _ in range(args.repeat):
            if comm.rank == 0:
                send(obj)
            else:
                recv()
        mpi.Barrier()  # the writer's time includes the slowest reader's last receive
        return mpi.allreduce(time.perf_counter() - start, op=_max()) / args.repeat

    rows = []
    for name, obj in PAYLOADS.items():
        spmd_s, mpi_s = [], []
        for _ in range(args.rounds):  # alternating, so that both see the same machine
            spmd_s.append(timed(queue.enqueue, queue.dequeue, obj))
            mpi_s.append(timed(lambda o: mpi.bcast(o, root=0), lambda: mpi.bcast(None, root=0),
                               obj))  # fmt: skip
        a, b = statistics.median(spmd_s), statistics.median(mpi_s)
        rows.append({"payload": name, "spmd_us": a * 1e6, "mpi4py_us": b * 1e6, "ratio": a / b})
        if comm.rank == 0:
            print(f"{name:10s}  MessageQueue {a * 1e6:8.1f} us  mpi4py bcast {b * 1e6:8.1f} us  "
                  f"ratio {a / b:.2f}", flush=True)  # fmt: skip
    queue.close()
    if comm.rank == 0:
        from spmd.bench import cores_tag, host_info

        nodes = len(set(comm.node_ids))
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
        info = {**host_info(), "ranks": comm.size, "nodes": nodes, "rounds": args.rounds,
                "repeat": args.repeat, "date_utc": date}  # fmt: skip
        tag = f"message_queue-{cores_tag()}-n{comm.size}" + (f"-nodes{nodes}" if nodes > 1 else "")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
        md = [f"# MessageQueue against mpi4py bcast, {comm.size} ranks on {nodes} node(s)", "",
              "Produced by `spmd-run -n {} {}python benchmarks/message_queue.py`.".format(
                  comm.size, f"--nodes {nodes} " if nodes > 1 else ""), "",
              "| machine | |", "|---|---|", *[f"| {k} | {v} |" for k, v in info.items()], "",
              "Microseconds per broadcast (the slowest rank's, medians of the rounds).", "",
              "| object | MessageQueue | mpi4py bcast | ratio |",
              "|---|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            md.append(f"| {r['payload']} | {r['spmd_us']:.1f} | {r['mpi4py_us']:.1f} | "
                      f"{r['ratio']:.2f} |")  # fmt: skip
        (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    spmd.finalize()
    return 0


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


if __name__ == "__main__":
    raise SystemExit(main())
