"""``spmd-bench``: the collectives benchmark, spmd inside ``jax.jit`` against the peers a user
would pick instead, in the same run on the same machine.

    spmd-bench                                  # 2 ranks, all ops, 4 B .. 64 MiB
    spmd-bench --quick                          # allreduce at 3 sizes against mpi4py: seconds
    spmd-bench -n 4 --ops allreduce -e 16M --json allreduce.json
    spmd-run -n 2 python benchmarks/collectives.py   # the same code; writes benchmarks/results/

Started outside an MPI job, ``spmd-bench`` relaunches itself under ``spmd-run -n N``. What is
measured and how: :mod:`spmd.bench`, and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .._errors import SpmdError
from ..bench import DTYPES, OPS, PEERS, Files, Settings, parse_size, run_rank, size_sweep
from ..launch import launch
from ..runtime import mpi_rank_size

TRANSPORTS = ("auto", "shm", "mpi", "hier")


def _list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["none"] and what == "peer":
        return []
    if items == ["all"]:
        return list(allowed)
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SpmdError(
            f"unknown {what} {', '.join(bad)}; expected some of {', '.join(allowed)}", rank=None
        )
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
    p.add_argument(
        "--transport",
        "--backend",  # the former name
        dest="transport",
        help="force spmd's transport: auto, shm, mpi or hier; a comma list (hier,mpi) measures "
        "spmd once per transport, side by side (columns spmd-hier, spmd-mpi)",
    )
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
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a first look in seconds: {_QUICK_HELP}, unless those options are given too",
    )
    return p


# What --quick changes, where the option is left at its default.
_QUICK = {"ops": "allreduce", "sizes": "4,64K,4M", "rounds": 1, "iters": 20,
          "peers": "mpi4py", "no_small": True}  # fmt: skip
_QUICK_HELP = "allreduce at 4 B, 64 KiB and 4 MiB, one round of 20 calls, against mpi4py"


def _quick(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    for name, value in _QUICK.items():
        if getattr(args, name) == p.get_default(name):
            setattr(args, name, value)


def _sanitize(argv: Sequence[str]) -> list[str]:
    """Arguments for the record, without absolute paths."""
    return [os.path.basename(a) if os.path.isabs(a) else a for a in argv]


def resolve_args(args: argparse.Namespace) -> Settings:
    """The run the options ask for; raises SpmdError on a bad option."""
    if args.rounds < 1 or (args.iters is not None and args.iters < 1):
        raise SpmdError("--rounds and --iters need at least 1", rank=None)
    if args.nprocs is not None and args.nprocs < 1:
        raise SpmdError(f"-n {args.nprocs}: need at least one rank", rank=None)
    op_list = _list(args.ops, OPS, "op")
    peers = _list(args.peers, PEERS, "peer")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    if not op_list or not sizes:
        raise SpmdError("no ops or no sizes to run", rank=None)
    transports = _list(args.transport, TRANSPORTS, "transport") if args.transport else []
    if len(transports) > 1 and "auto" in transports:
        raise SpmdError(
            f"--transport {args.transport}: name the transports to compare (auto is one of them)",
            rank=None,
        )
    return Settings(
        ops=op_list,
        peers=peers,
        sizes=sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        rounds=args.rounds,
        transport=",".join(transports) or None,
        check=not args.no_check,
        small=not args.no_small,
        nprocs=args.nprocs,
        files=Files(out_dir=args.out_dir, json=args.json, markdown=args.markdown),
    )


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "spmd-bench",
    script: str | None = None,
    default_out_dir: str | None = None,
) -> int:
    """``spmd-bench``; ``script`` and ``default_out_dir`` for benchmarks/collectives.py."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(prog)
    args = p.parse_args(argv)
    if args.quick:
        _quick(args, p)
    if args.out_dir is None and default_out_dir is not None:
        args.out_dir = default_out_dir
    try:
        settings = resolve_args(args)  # bad options fail here, before any job starts
        if mpi_rank_size(os.environ) is None:  # not in a job: start one
            nprocs = args.nprocs or 2
            target = [os.path.abspath(script)] if script else ["-m", "spmd.cli.bench"]
            return launch(nprocs, [sys.executable, *target, *argv], timeout=args.timeout)
        if script:
            shown = "/".join(Path(script).resolve().parts[-2:])  # benchmarks/collectives.py
            entry = ["spmd-run", "-n", str(_world_size()), "python", shown]
        else:
            entry = ["spmd-bench"] + ([] if args.nprocs else ["-n", str(_world_size())])
        command = " ".join([*entry, *_sanitize(argv)])
        return run_rank(settings, command)
    except SpmdError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def _world_size() -> int:
    found = mpi_rank_size(os.environ)
    return found[1] if found is not None and found[1] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
