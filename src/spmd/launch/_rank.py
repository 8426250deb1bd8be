"""The per-rank wrapper ``spmd-run`` starts: runs the user's command and reports how it ended.

``python -m spmd.launch._rank --python (-c CODE | -m MODULE | SCRIPT) ARGS...`` runs Python code
in this process as the interpreter would, so an uncaught exception is seen here: it is printed
with every line prefixed by ``[rank N]``, recorded for ``spmd-run``, and the job is stopped.
``python -m spmd.launch._rank --exec CMD...`` runs any other program and records its exit code.

The package's ``__init__`` does not import this module, so that ``python -m`` runs it fresh.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import signal
import subprocess
import sys
import types
from types import TracebackType

from .._errors import SpmdError
from ..runtime import (
    abort_job,
    bind_rank,
    must_abort,
    report_exception,
    report_status,
    tune_malloc,
)
from ._protocol import launch_rank, output_file


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_python(rank: int, args: list[str]) -> int:
    if not args:
        raise SystemExit("spmd.launch._rank --python: nothing to run")
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            program = compile(args[1], "<string>", "exec")
            # As python -c: the code runs as the module __main__ (pickle, multiprocessing and
            # `import __main__` find what it defines there).
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(program, main.__dict__)
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
        if code != 0:
            report_status(rank, {"state": "failed", "exit_code": code, "error": f"exit {code}"})
            sys.stderr.write(f"[rank {rank}] exited with code {code}\n")
            if must_abort():
                abort_job(code)
            return code
        report_status(rank, {"state": "done", "exit_code": 0})
        return 0
    except BaseException as e:
        report_exception(rank, e.with_traceback(_user_frames(e.__traceback__)))
        if must_abort():
            abort_job(1)
        return 1
    report_status(rank, {"state": "done", "exit_code": 0})
    return 0


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this wrapper's and runpy's frames."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return tb


def _run_program(rank: int, argv: list[str]) -> int:
    try:
        code = subprocess.call(argv)
    except OSError as e:
        sys.stderr.write(f"[rank {rank}] cannot run {argv[0]!r}: {e}\n")
        code = 127
    if code < 0:  # killed by a signal: report it as a shell would (128 + N)
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        sys.stderr.write(f"[rank {rank}] {argv[0]} was killed by {name}\n")
        error, code = f"killed by {name}", 128 - code
    else:
        error = f"exit {code}"
    if code != 0:
        report_status(rank, {"state": "failed", "exit_code": code, "error": error})
    else:
        report_status(rank, {"state": "done", "exit_code": 0})
    return code


def _whole_lines() -> None:
    """Send each line of output in one write: the launcher forwards every write of every rank
    as it comes, so a line written piecewise (unbuffered Python, ``PYTHONUNBUFFERED``) gets
    mixed with other ranks' lines."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def _redirect_output(rank: int) -> None:
    """With ``spmd-run --output DIR``: this rank's standard output and error (its child
    processes' included) go to ``DIR/rank<N>.stdout`` and ``DIR/rank<N>.stderr``. The variable
    is dropped so that a job this rank starts does not write over these files."""
    directory = os.environ.pop("SPMD_RUN_OUTPUT_DIR", None)
    if not directory:
        return
    for fd, name in ((1, "stdout"), (2, "stderr")):
        path = output_file(directory, f"rank{rank}", name)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main() -> int:
    mode, rest = sys.argv[1], sys.argv[2:]
    rank = launch_rank()
    try:
        _redirect_output(rank)
    except OSError as e:
        sys.stderr.write(f"[rank {rank}] spmd-run --output: cannot write this rank's output: {e}\n")
        report_status(rank, {"state": "failed", "exit_code": 2, "error": f"--output: {e}"})
        return 2
    _whole_lines()
    bind_rank()
    report_status(rank, {"state": "running", "pid": os.getpid()})
    if mode == "--python":
        try:
            tune_malloc()  # before the program can start JAX's threads (runtime/_malloc.py)
        except SpmdError as e:
            sys.stderr.write(f"[rank {rank}] {e}\n")
            report_status(rank, {"state": "failed", "exit_code": 2, "error": str(e)})
            return 2
        return _run_python(rank, rest)
    return _run_program(rank, rest)


if __name__ == "__main__":
    sys.exit(main())
