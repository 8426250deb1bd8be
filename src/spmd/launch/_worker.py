"""A rank of a pool (:mod:`._pool`): runs the functions, and the notebook's Python source, that
the pool's owner sends until told to stop.

Started by the pool as ``python -m spmd.launch._worker`` on every rank (under mpiexec, or with
torchrun-style variables); connects to the pool's owner over a Unix socket.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import importlib
import importlib.util
import io
import os
import signal
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..runtime import format_rank_traceback
from . import _wire
from ._protocol import launch_rank


def _load_module(name: str, file: str) -> ModuleType:
    """Import the test module ``name`` from ``file``, with pytest's assertion rewriting so a
    failed ``assert`` on a rank explains itself as it would in the pytest process."""
    if name in sys.modules:
        return sys.modules[name]
    base = Path(file).resolve().parents[len(name.split(".")) - 1]
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    parent = name.rpartition(".")[0]
    if parent:
        importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None:
        raise ImportError(f"cannot import {name} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    source = Path(file).read_bytes()
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        tree = ast.parse(source, filename=file)
        rewrite_asserts(tree, source, file, None)
        code = compile(tree, file, "exec", dont_inherit=True)
    except ImportError:
        code = compile(source, file, "exec", dont_inherit=True)
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _resolve(module: str, file: str, qualname: str) -> Any:
    obj: Any = _load_module(module, file)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "_spmd_body", obj)


def _run(rank: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    task_id, module, file, qualname, args, kwargs = task
    out = io.StringIO()
    try:
        fn = _resolve(module, file, qualname)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            value = fn(*args, **kwargs)
        return ("ok", task_id, value, out.getvalue())
    except BaseException as e:
        if e.__traceback__ is not None:  # drop this function's own frame
            e = e.with_traceback(e.__traceback__.tb_next)
        return ("error", task_id, format_rank_traceback(rank, e), repr(e), out.getvalue())


_CELLS: dict[str, Any] = {"__name__": "__main__"}  # RankPool.execute's namespace
_cell_count = 0


def _exec(rank: int, task_id: int, source: str, push: dict[str, bytes]) -> tuple[Any, ...]:
    """Run a notebook cell's source in the rank's namespace, its output captured."""
    global _cell_count
    import builtins
    import linecache
    import pickle

    _cell_count += 1
    name = f"<cell {_cell_count}>"
    out = io.StringIO()
    try:
        _CELLS.setdefault("__builtins__", builtins)
        for key, blob in push.items():
            _CELLS[key] = pickle.loads(blob)
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        code = compile(source, name, "exec")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(code, _CELLS)
        return ("ok", task_id, None, out.getvalue())
    except BaseException as e:
        if e.__traceback__ is not None:  # drop this function's own frame
            e = e.with_traceback(e.__traceback__.tb_next)
        return ("error", task_id, format_rank_traceback(rank, e), repr(e), out.getvalue())


def _get(rank: int, task_id: int, name: str) -> tuple[Any, ...]:
    """A variable of the rank's namespace (JAX arrays in it as NumPy arrays)."""
    if name not in _CELLS:
        text = f"[rank {rank}] NameError: no variable {name!r} on rank {rank}\n"
        return ("error", task_id, text, f"NameError({name!r})", "")
    value = _CELLS[name]
    jax = sys.modules.get("jax")
    if jax is not None:
        value = jax.device_get(value)
    return ("ok", task_id, value, "")


def main() -> None:
    rank = launch_rank()
    dump = open(Path(os.environ["SPMD_TESTING_DIR"]) / f"stack.{rank}", "w")  # noqa: SIM115
    # The pool reads this file when a task hangs. Python's own record of SIGUSR1 says it is
    # taken (faulthandler's handler replaces SIG_IGN at the C level), so that spmd.init leaves
    # it alone (runtime/_groups.py, watch_peers).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["SPMD_TESTING_ADDR"])
    _wire.send(sock, ("hello", rank, os.getpid()))
    while True:
        msg = _wire.recv(sock)
        if msg is None or msg[0] == "exit":
            break
        if msg[0] == "exec":
            reply = _exec(rank, *msg[1:])
        elif msg[0] == "get":
            reply = _get(rank, *msg[1:])
        else:
            reply = _run(rank, msg[1:])
        try:
            _wire.send(sock, reply)
        except Exception as e:  # the return value did not pickle
            _wire.send(
                sock,
                (
                    "error",
                    reply[1],
                    f"[rank {rank}] result not picklable: {e!r}",
                    repr(e),
                    reply[-1],
                ),
            )
    if msg is not None:  # a clean shutdown: every rank got "exit"
        from ..runtime import finalize

        finalize()
        # What the interpreter would do at exit that matters (exit handlers: a flight recorder's
        # trace, MPI_Finalize), without tearing down every module JAX loaded: a pool's close
        # took 0.7 s of which this was most.
        import atexit

        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
