"""``spmd-run``: start N ranks through the installed MPI's launcher, and stop them all when one
fails.

    spmd-run -n 4 python train.py --epochs 3

Each rank runs under a small wrapper (:mod:`spmd.launch._rank`) that records how it ended. When a
rank fails, the others get ``--grace`` seconds to finish printing, then the whole job is
stopped; the summary names the failing rank and its error (its traceback, prefixed with
``[rank N]``, is printed above). The exit code is the failing rank's (128 + N for a rank
killed by signal N, as a shell reports it), 124 after ``--timeout``. Ctrl-C, SIGTERM and SIGHUP
to ``spmd-run`` stop the whole job (exit 130, 143, 129); on Linux, so does killing ``spmd-run``
outright (SIGKILL: the launcher gets SIGTERM). ``--output DIR`` keeps the ranks'
output apart: rank N writes ``DIR/rankN.stdout`` and ``DIR/rankN.stderr`` instead of the
terminal (a directory every node can write, on several nodes), the MPI launcher writes
``DIR/launcher.stdout`` and ``.stderr``; ``spmd-run``'s own summary still goes to its standard
error.
"""

from __future__ import annotations

import argparse
import sys

from .._errors import SpmdError
from ..launch import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spmd-run",
        description="Run a command on N ranks (one process per device) through MPI's launcher.",
        epilog="example: spmd-run -n 4 python train.py",
    )
    parser.add_argument("-n", "--np", dest="nprocs", type=int, required=True, help="ranks")
    parser.add_argument(
        "--nodes", type=int, help="simulate this many nodes (consecutive ranks per node)"
    )
    parser.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds the other ranks get after one fails, before they are stopped (default 2)",
    )
    parser.add_argument("--mpiexec", help="the MPI launcher (default: SPMD_MPIEXEC, or mpiexec)")
    parser.add_argument(
        "--mpi-arg",
        action="append",
        default=[],
        dest="mpi_args",
        help="an extra argument for the MPI launcher (repeatable)",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        help="write rank N's stdout and stderr to DIR/rankN.stdout and DIR/rankN.stderr (the "
        "launcher's to DIR/launcher.stdout and .stderr), replacing an earlier job's",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(
            args.nprocs,
            command,
            nodes=args.nodes,
            timeout=args.timeout,
            grace=args.grace,
            mpiexec=args.mpiexec,
            mpi_args=args.mpi_args,
            output_dir=args.output,
        )
    except SpmdError as e:
        print(f"spmd-run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
