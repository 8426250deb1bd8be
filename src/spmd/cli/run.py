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

``--max-restarts K`` starts a failed job again, up to K times, with ``SPMD_RESTART`` set to the
restart's number (0 on the first run) and, with ``--ranks-after-failure N``, on N ranks;
:mod:`spmd.elastic` resumes a training script from its newest checkpoint. A stop asked for
(Ctrl-C, SIGTERM, SIGHUP, ``--timeout``) is not restarted.

``--hosts H`` runs the job on H test hosts made on this machine for it (Linux, as root): network
namespaces with addresses of their own, hostnames ``h0``, ``h1``, ... and a ``/dev/shm`` each,
joined by a bridge, so that ranks of different hosts talk MPI over TCP
(:mod:`spmd.launch._hosts`); ``--link`` shapes the links with ``tc netem``. They are removed
when the job ends.
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument(
        "--hosts",
        type=int,
        help="run on this many test hosts of this machine: network namespaces with addresses "
        "of their own, MPI over TCP between them (Linux, root; consecutive ranks per host)",
    )
    parser.add_argument(
        "--link",
        metavar="NETEM",
        help="with --hosts: shape each host's link with these tc netem parameters, e.g. "
        "'delay 50us rate 10gbit'",
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
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when the job fails, start it again, up to K times (the ranks see SPMD_RESTART; "
        "spmd.elastic resumes from the newest checkpoint); not after a stop asked for "
        "(Ctrl-C, SIGTERM, --timeout)",
    )
    parser.add_argument(
        "--ranks-after-failure",
        type=int,
        metavar="N",
        help="ranks of a restarted job (default: -n); the checkpoints reshard to it",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.max_restarts < 0:
        print(f"spmd-run: --max-restarts {args.max_restarts}: need 0 or more", file=sys.stderr)
        return 2
    try:
        nprocs, restart = args.nprocs, 0
        while True:
            code = launch(
                nprocs,
                command,
                nodes=args.nodes,
                hosts=args.hosts,
                link=args.link,
                timeout=args.timeout,
                grace=args.grace,
                mpiexec=args.mpiexec,
                mpi_args=args.mpi_args,
                output_dir=args.output,
                env={**os.environ, "SPMD_RESTART": str(restart)},
            )
            if code == 0 or code in _STOPS or restart >= args.max_restarts:
                return code
            restart += 1
            nprocs = args.ranks_after_failure or nprocs
            what = f"restart {restart} of {args.max_restarts}, after exit code {code}"
            print(f"spmd-run: restarting the job on {nprocs} ranks ({what})", file=sys.stderr,
                  flush=True)  # fmt: skip
    except SpmdError as e:
        print(f"spmd-run: {e}", file=sys.stderr)
        return 2


# Exit codes of a stop that was asked for, after which a job is not restarted: --timeout (124),
# Ctrl-C (130), SIGHUP (129) and SIGTERM (143) to spmd-run.
_STOPS = (124, 129, 130, 143)


if __name__ == "__main__":
    sys.exit(main())
