"""Multi-rank cells in Jupyter: an IPython extension with the ``%%spmd`` cell magic.

A notebook's kernel is one process, a world of one. To run code on several ranks, load the
extension once and start a cell with ``%%spmd -n N``::

    %load_ext spmd.notebook

    %%spmd -n 4
    import jax.numpy as jnp, spmd
    comm = spmd.init()
    print(spmd.allreduce(jnp.float32(comm.rank + 1)))

The cell runs as ``spmd-run -n 4 python -c CELL`` does: a program of its own on every rank,
started by the MPI launcher, in the kernel's working directory and environment. It sees
nothing the notebook defined (import what it needs; put shared code in a module, for example
with ``%%writefile``). When the job ends, each rank's output is shown in rank order, every line
prefixed with ``[rank N]``: standard output as the cell's output, standard error as its error
stream. A rank that fails stops the job as under ``spmd-run`` (its traceback, then the summary
naming it), and the cell raises :class:`CellFailed`, so a notebook run top to bottom stops
there. Interrupting the kernel stops the job.

Options: ``-n N`` (ranks, required), ``--nodes K`` (simulate K nodes), ``--timeout S`` (stop
the job after S seconds).
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any

from ._errors import SpmdError
from .cli._exec import output_file
from .cli.run import launch

__all__ = ["CellFailed", "load_ipython_extension", "run_cell"]


class CellFailed(SpmdError):
    """A ``%%spmd`` cell's job did not end cleanly (a rank failed, hung past ``--timeout`` or
    was interrupted). The ranks' output and the launcher's summary are shown above it."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through the extension's frames.
        return [f"{type(self).__name__}: {self}"]


_USAGE = "usage: %%spmd -n N [--nodes K] [--timeout S]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit the kernel
        raise SpmdError(f"%%spmd: {message}; {_USAGE}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%%spmd", add_help=False)
    parser.add_argument("-n", "--np", dest="nprocs", type=int, required=True)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--timeout", type=float)
    return parser


def _show(who: str, text: str, stream: Any) -> None:
    prefix = f"[{who}]"
    for line in text.split("\n")[: -1 if text.endswith("\n") else None]:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]  # a line redrawn in place: its last state
        # spmd-run's wrapper already prefixes a failing rank's traceback.
        stream.write(line if line.startswith(prefix) else f"{prefix} {line}")
        stream.write("\n")


def _read(path: str) -> str:
    """The file's text ("" if it is missing), "\r" kept (no newline translation)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def run_cell(line: str, cell: str) -> int:
    """What ``%%spmd LINE`` does with the cell's source ``cell``: run it on the ranks, show
    their output, and return 0, or raise :class:`CellFailed` with the job's exit code."""
    args = _parser().parse_args(shlex.split(line))
    summary = io.StringIO()
    code = None
    with tempfile.TemporaryDirectory(prefix="spmd-cell-") as tmp:
        out = tmp
        try:
            code = launch(
                args.nprocs,
                [sys.executable, "-c", cell],
                nodes=args.nodes,
                timeout=args.timeout,
                output_dir=out,
                stdin=subprocess.DEVNULL,
                report=summary,
            )
        finally:  # shown even if the wait for the job was cut short
            started = code is not None  # launch returned: the launcher ran
            for rank in range(args.nprocs if started else 0):
                if not os.path.exists(output_file(out, f"rank{rank}", "stdout")):
                    _show(f"rank {rank}", "(no output: the rank did not start)\n", sys.stderr)
                    continue
                for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                    _show(f"rank {rank}", _read(output_file(out, f"rank{rank}", name)), stream)
            for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                text = _read(output_file(out, "launcher", name))
                if text.strip():  # MPICH's launcher ends with an empty line
                    _show("launcher", text, stream)
            sys.stdout.flush()
            sys.stderr.write(summary.getvalue())
            sys.stderr.flush()
    if code != 0:
        raise CellFailed(f"the cell's job on {args.nprocs} ranks ended with exit code {code}")
    return 0


def load_ipython_extension(ipython: Any) -> None:
    """Registers ``%%spmd`` (called by ``%load_ext spmd.notebook``)."""

    def spmd(line: str, cell: str) -> None:
        run_cell(line, cell)

    ipython.register_magic_function(spmd, magic_kind="cell", magic_name="spmd")
