"""Collectives benchmark: spmd inside ``jax.jit`` against mpi4py, mpi4jax and torch.distributed.

    spmd-run -n 2 python benchmarks/collectives.py [spmd-bench options]

The same code as the ``spmd-bench`` command (:mod:`spmd.cli.bench`, measuring with
:mod:`spmd.bench`); started outside an MPI job it relaunches itself under ``spmd-run``. By
default it writes
``benchmarks/results/collectives-<tag>.json`` and ``.md`` (tag: ``cpu<cores>-n<ranks>``, or
``cpu<cores>of<total>-n<ranks>`` on a job given fewer cores than the machine has).
See benchmarks/README.md.
"""

import sys
from pathlib import Path

from spmd.cli.bench import main

if __name__ == "__main__":
    results = Path(__file__).resolve().parent / "results"
    sys.exit(
        main(sys.argv[1:], prog="collectives.py", script=__file__, default_out_dir=str(results))
    )
