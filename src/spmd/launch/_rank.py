"""The per-rank wrapper ``spmd-run`` starts: runs the user's command and reports how it ended.

``python -m spmd.launch._rank --python (-c CODE | -m MODULE | SCRIPT) ARGS...`` runs Python code
in this process as the interpreter would, so an uncaught exception is seen here: it is printed
with every line prefixed by ``[rank N]``, recorded for ``spmd-run``, and the job is stopped.
``python -m spmd.launch._rank --exec CMD...`` runs any other program and records its exit code.

Under ``spmd-run``, Python code runs in a child of the wrapper, which only waits for it
(:func:`_supervise`): a rank that dies by a signal (a SIGKILL, the out-of-memory killer, a
segfault) cannot report anything itself, but its parent sees the signal, reports the rank as
killed by it, prints the Python stack ``faulthandler`` wrote for a crash, and exits with 128 + N
as a shell would.

The package's ``__init__`` does not import this module, so that ``python -m`` runs it fresh.
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import types
from types import TracebackType
from typing import Any

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
                abort_job(code, rank)
            return code
        report_status(rank, {"state": "done", "exit_code": 0})
        return 0
    except BaseException as e:
        report_exception(rank, e.with_traceback(_user_frames(e.__traceback__)))
        if must_abort():
            abort_job(1, rank)
        return 1
    report_status(rank, {"state": "done", "exit_code": 0})
    return 0


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this wrapper's and runpy's frames, nor the frame of the code that
    ``%%spmd`` runs a cell with (``python -c``, which runs the cell as ``<cell>``)."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
        or (
            tb.tb_frame.f_code.co_filename == "<string>"
            and tb.tb_next is not None
            and tb.tb_next.tb_frame.f_code.co_filename == "<cell>"
        )
    ):
        tb = tb.tb_next
    return tb


def _run_program(rank: int, argv: list[str]) -> int:
    # The launcher's PMI connection is a file descriptor the program needs for MPI_Init
    # (subprocess closes every other descriptor by default).
    pmi = [int(os.environ[v]) for v in ("PMI_FD", "PMI2_FD") if os.environ.get(v, "").isdigit()]
    try:
        code = subprocess.call(argv, pass_fds=pmi)
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


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)  # fmt: skip
_fault_file: Any = None  # the child's faulthandler file, kept open for its whole life


def _supervise(rank: int) -> int | None:
    """Split into a waiting parent and a child that runs the rank: None in the child; in the
    parent, once the child has ended, the rank's exit code. Only under ``spmd-run`` (its status
    directory receives the report) on a system with fork and Linux's parent-death signal."""
    directory = os.environ.get("SPMD_RUN_STATUS_DIR")
    if not directory or not sys.platform.startswith("linux"):
        return None
    fault_path = os.path.join(directory, f"rank{rank}.fault")
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        # The child dies with its parent (whatever stops the parent stops the rank), and a
        # crash writes every thread's Python stack where the parent will find it.
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)
        global _fault_file
        _fault_file = open(fault_path, "w")  # noqa: SIM115
        faulthandler.enable(file=_fault_file, all_threads=True)
        return None
    forwarded: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        _report_early_exit(rank, directory, code)
        return code
    signum = os.WTERMSIG(status)
    if forwarded:  # the job is being stopped: spmd-run names the rank that caused it
        return 128 + signum
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    stack = ""
    try:
        with open(fault_path) as f:
            stack = f.read()
    except OSError:
        pass
    lines = [f"killed by {name}"] + ([*stack.rstrip().splitlines()] if stack.strip() else [])
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.flush()
    report_status(
        rank, {"state": "failed", "exit_code": 128 + signum, "error": f"killed by {name}"}
    )
    return 128 + signum


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


def _report_early_exit(rank: int, directory: str, code: int) -> None:
    """A rank process that ended without reporting how its program ended (``os._exit``, or an
    exit from C code) would otherwise look to ``spmd-run`` as if it still ran: say so. With code
    0 its state is "exited" (the job succeeds if every other rank finished), else "failed"."""
    try:
        with open(os.path.join(directory, f"rank{rank}.json")) as f:
            state = json.load(f).get("state")
    except (OSError, ValueError):
        state = "running"
    if state != "running":
        return
    error = f"exited with code {code} before its Python program ended (os._exit, or an exit "
    error += "from C code)"
    report_status(rank, {"state": "exited" if code == 0 else "failed", "exit_code": code,
                         "error": error})  # fmt: skip


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
    if mode == "--python":
        code = _supervise(rank)
        if code is not None:
            return code
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
