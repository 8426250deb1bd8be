"""Multi-rank cells in Jupyter: an IPython extension with the ``%%spmd`` cell magic.

A notebook's kernel is one process, a world of one. To run code on several ranks, load the
extension once and start a cell with ``%%spmd -n N``::

    %load_ext spmd.notebook

    %%spmd -n 4
    import jax.numpy as jnp, spmd
    comm = spmd.init()
    print(spmd.allreduce(jnp.float32(comm.rank + 1)))

The cell runs as ``spmd-run -n 4 python -c CELL`` does: a program of its own on every rank,
started by the MPI launcher, in the kernel's working directory and environment (modules there
import as they do in the kernel). It sees nothing the notebook defined, except the variables
named with ``--push``; import what it needs, and put shared functions and classes in a module
(for example with ``%%writefile``). Every line of output is prefixed with ``[rank N]``: rank 0's
standard output is shown line by line while the job runs (the ranks run with
``PYTHONUNBUFFERED=1``), and the rest when the job ends, in rank order: standard output as the
cell's output, standard error as its error stream. A rank that fails stops the job as under
``spmd-run`` (its traceback, whose lines in the cell read ``File "<cell>", line L`` with the
line's source, then the summary naming it), and the cell raises :class:`CellFailed`, so a
notebook run top to bottom stops there. Interrupting the kernel stops the job.

**A pool that keeps its ranks.** ``%spmd start -n N`` starts N ranks that live across cells
(the rank pool the test harness also uses, :class:`spmd.launch.RankPool`, under the MPI
launcher); a ``%%spmd`` cell without ``-n`` runs on them, each rank keeping its variables from
one cell to the next, and shows each rank's output in rank order when the cell ends; ``--out
NAME [NAME ...]`` puts a list of the ranks' values of NAME (JAX arrays as NumPy arrays) into
the notebook; ``--push`` works as below. A cell that raises shows every failing rank's
traceback and leaves the pool running; a rank that dies stops the pool (``%spmd start`` starts
a new one). ``%spmd stop`` stops it, and so does the kernel's exit.

Options of a one-shot job: ``-n N`` (ranks), ``--nodes K`` (simulate K nodes), ``--timeout S``
(stop the job after S seconds; on a pool, the seconds a cell may take, default 300),
``--push NAME [NAME ...]`` (names of notebook variables that every rank starts with, separated
by spaces or commas: each is pickled in the kernel and unpickled on every rank, so arrays,
numbers, strings and containers of them travel, JAX arrays as NumPy arrays (unpickling a JAX
array would start JAX before ``spmd.init``); a function or class defined in the notebook, or a
value whose type is one, cannot, and is refused before the job starts).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shlex
import subprocess
import sys
import tempfile
import types
from typing import Any

from ._errors import SpmdError
from .launch import launch, output_file

__all__ = ["CellFailed", "load_ipython_extension", "run_cell", "start_pool", "stop_pool"]


class CellFailed(SpmdError):
    """A ``%%spmd`` cell's job did not end cleanly (a rank failed, hung past ``--timeout`` or
    was interrupted). The ranks' output and the launcher's summary are shown above it. Raised
    in the notebook's kernel, which is no rank: its message names none."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message, rank=None)

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through the extension's frames.
        return [f"{type(self).__name__}: {self}"]


_USAGE = (
    "usage: %%spmd -n N [--nodes K] [--timeout S] [--push NAME [NAME ...]] (a job of its own), "
    "or %%spmd [--timeout S] [--push NAME ...] [--out NAME ...] (on the ranks of %spmd start -n N)"
)
_LINE_USAGE = "usage: %spmd start -n N | %spmd stop"
_PUSH = "%%spmd --push"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit the kernel
        raise SpmdError(f"{message}; {_USAGE}", op="%%spmd", rank=None)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%%spmd", add_help=False)
    parser.add_argument("-n", "--np", dest="nprocs", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--push", nargs="+", default=[])
    parser.add_argument("--out", nargs="+", default=[])
    return parser


# What every rank runs (``python -c``; the argument after it is the cell's directory): the pushed
# variables, then the cell's source compiled as "<cell>" in ``__main__``, its lines registered
# with linecache so that a traceback shows them.
_BOOTSTRAP = """\
import linecache as _lc, os as _os, pickle as _pk, sys as _sys
_dir = _sys.argv.pop(1)
if _os.path.exists(_os.path.join(_dir, "push.pkl")):
    with open(_os.path.join(_dir, "push.pkl"), "rb") as _f:
        for _name, _value in _pk.load(_f).items():
            globals()[_name] = _pk.loads(_value)
        del _name, _value
with open(_os.path.join(_dir, "cell.py"), encoding="utf-8") as _f:
    _src = _f.read()
_lc.cache["<cell>"] = (len(_src), None, _src.splitlines(True), "<cell>")
del _lc, _os, _pk, _sys, _dir, _f
exec(compile(globals().pop("_src"), "<cell>", "exec"))
"""


class _Pusher(pickle.Pickler):
    """Pickles a pushed variable: JAX arrays as NumPy arrays (unpickling a JAX array would start
    JAX on the rank before ``spmd.init`` chose its device), and refuses what a rank could not
    unpickle: functions and classes defined in the notebook (pickled by reference to a
    ``__main__`` the ranks do not share)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            kind = "class" if isinstance(obj, type) else "function"
            raise SpmdError(
                f"the {kind} {obj.__qualname__} is defined in the notebook, and the ranks "
                "cannot load it: define it in a module (%%writefile) and import it there",
                rank=None,
            )
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(obj, jax.Array):
            import numpy as np

            return np.asarray, (np.asarray(obj),)
        return NotImplemented


def _names(args: list[str]) -> list[str]:
    """Names given separated by spaces or commas."""
    return [n.strip() for arg in args for n in arg.split(",") if n.strip()]


def _pickled(names: list[str], namespace: dict[str, Any] | None) -> dict[str, bytes]:
    """The notebook variables ``names``, each pickled on its own so that an error names it."""
    wanted = _names(names)
    if not wanted:
        return {}
    if namespace is None:
        raise SpmdError("no notebook namespace to take variables from", op=_PUSH, rank=None)
    missing = [n for n in wanted if n not in namespace]
    if missing:
        raise SpmdError(
            f"no variable named {', '.join(missing)} in the notebook", op=_PUSH, rank=None
        )
    pickled = {}
    for name in wanted:
        buf = io.BytesIO()
        try:
            _Pusher(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(namespace[name])
        except SpmdError as e:
            raise SpmdError(str(e), op=f"{_PUSH} {name}", rank=None) from None
        except Exception as e:
            raise SpmdError(
                f"a {type(namespace[name]).__name__} cannot be pickled ({type(e).__name__}: {e})",
                op=f"{_PUSH} {name}",
                rank=None,
            ) from None
        pickled[name] = buf.getvalue()
    return pickled


def _push(names: list[str], namespace: dict[str, Any] | None, path: str) -> None:
    """Pickles the notebook variables ``names`` into ``path`` (for a one-shot job's ranks)."""
    pickled = _pickled(names, namespace)
    if pickled:
        with open(path, "wb") as f:
            pickle.dump(pickled, f, protocol=pickle.HIGHEST_PROTOCOL)


def _show(who: str, text: str, stream: Any) -> None:
    if not text:
        return  # a stream the rank never wrote to
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


class _Follow:
    """Shows a rank's output file while the job writes it: each complete line once, as it
    arrives (the ranks run unbuffered); :meth:`rest` is what was not shown yet."""

    def __init__(self, path: str, who: str, stream: Any) -> None:
        self.path, self.who, self.stream = path, who, stream
        self.offset = 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only: a line may still be being written
        if end:
            self.offset += end
            _show(self.who, data[:end].decode("utf-8", errors="replace"), self.stream)
            self.stream.flush()

    def rest(self) -> str:
        return _read(self.path)[self.offset :] if self.offset else _read(self.path)


def run_cell(line: str, cell: str, namespace: dict[str, Any] | None = None) -> int:
    """What ``%%spmd LINE`` does with the cell's source ``cell``: run it on the ranks, show
    their output, and return 0, or raise :class:`CellFailed` with the job's exit code.
    ``namespace``: the notebook's variables, where ``--push`` takes them from."""
    args = _parser().parse_args(shlex.split(line))
    if args.nprocs is None:
        return _run_on_pool(args, cell, namespace)
    if args.out:
        raise SpmdError(
            "--out takes values from the ranks of a pool (%spmd start -n N), whose variables "
            f"outlive the cell; a one-shot job's (-n) end with it; {_USAGE}",
            op="%%spmd",
            rank=None,
        )
    summary = io.StringIO()
    code = None
    with tempfile.TemporaryDirectory(prefix="spmd-cell-") as out:
        _push(args.push, namespace, os.path.join(out, "push.pkl"))
        with open(os.path.join(out, "cell.py"), "w", encoding="utf-8") as f:
            f.write(cell)
        # Rank 0's standard output is shown as it arrives; the rest when the job ends, in rank
        # order (so that a cell's output reads the same on every run).
        live = _Follow(output_file(out, "rank0", "stdout"), "rank 0", sys.stdout)
        try:
            code = launch(
                args.nprocs,
                [sys.executable, "-c", _BOOTSTRAP, out],
                nodes=args.nodes,
                timeout=args.timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                output_dir=out,
                stdin=subprocess.DEVNULL,
                report=summary,
                on_poll=live.poll,
            )
        finally:  # shown even if the wait for the job was cut short
            started = code is not None  # launch returned: the launcher ran
            for rank in range(args.nprocs if started else 0):
                if not os.path.exists(output_file(out, f"rank{rank}", "stdout")):
                    _show(f"rank {rank}", "(no output: the rank did not start)\n", sys.stderr)
                    continue
                for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                    path = output_file(out, f"rank{rank}", name)
                    text = live.rest() if path == live.path else _read(path)
                    _show(f"rank {rank}", text, stream)
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


# -- a pool of ranks that lives across cells --------------------------------------------------

_POOL: Any = None  # the RankPool of %spmd start, while it runs


def start_pool(nprocs: int) -> None:
    """``%spmd start -n N``: start N ranks that run the ``%%spmd`` cells without ``-n``, each
    keeping its variables from one cell to the next (a pool already running is stopped first).
    The pool stops with ``%spmd stop`` or when the kernel exits."""
    import atexit

    from .launch import RankPool

    global _POOL
    stop_pool()
    if nprocs < 1:
        raise SpmdError(f"-n {nprocs}: need at least one rank", op="%spmd start", rank=None)
    pool = RankPool(nprocs)
    _POOL = pool  # kept before it starts, so that an interrupt leaves nothing unowned
    try:
        pool.start()
    except BaseException:
        _POOL = None
        pool.kill()
        raise
    atexit.register(pool.close)
    print(f"started {nprocs} ranks; %%spmd cells without -n run on them")


def stop_pool() -> None:
    """``%spmd stop``: stop the pool's ranks (nothing if none runs)."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def _run_on_pool(args: argparse.Namespace, cell: str, namespace: dict[str, Any] | None) -> int:
    from .testing import MultiRankError

    pool = _POOL
    if pool is None or pool.broken or not pool.alive():
        why = "no pool runs" if pool is None else "the pool's ranks are gone (a rank died)"
        raise SpmdError(
            f"{why}: start one with %spmd start -n N, or run the cell as a job of its own with "
            "%%spmd -n N",
            op="%%spmd",
            rank=None,
        )
    if args.nodes is not None:
        raise SpmdError("--nodes is a job's option: %%spmd -n N --nodes K", op="%%spmd", rank=None)
    push = _pickled(args.push, namespace)
    timeout = 300.0 if args.timeout is None else args.timeout
    try:
        outputs = pool.execute(cell, push=push, timeout=timeout)
    except MultiRankError as e:
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        state = (
            "the pool was stopped (%spmd start -n N starts a new one)"
            if pool.broken
            else "the pool's ranks keep running, with their variables"
        )
        raise CellFailed(f"the cell failed on the pool's ranks; {state}") from None
    for rank, text in enumerate(outputs):
        _show(f"rank {rank}", text, sys.stdout)
    sys.stdout.flush()
    for name in _names(args.out):
        if namespace is None:
            raise SpmdError("no notebook namespace to put --out values in", rank=None)
        try:
            namespace[name] = pool.values(name)
        except MultiRankError as e:
            sys.stderr.write(f"{e}\n")
            raise CellFailed(f"--out {name}: not every rank could give it") from None
    return 0


def _line(line: str) -> None:
    words = shlex.split(line)
    if words[:1] == ["stop"] and len(words) == 1:
        stop_pool()
        return
    if words[:1] == ["start"]:
        parser = _Parser(prog="%spmd start", add_help=False)
        parser.add_argument("-n", "--np", dest="nprocs", type=int, required=True)
        start_pool(parser.parse_args(words[1:]).nprocs)
        return
    raise SpmdError(f"%spmd {line!r}; {_LINE_USAGE}", op="%spmd", rank=None)


def load_ipython_extension(ipython: Any) -> None:
    """Registers ``%spmd`` and ``%%spmd`` (called by ``%load_ext spmd.notebook``)."""

    def spmd(line: str, cell: str | None = None) -> None:
        if cell is None:
            _line(line)
        else:
            run_cell(line, cell, ipython.user_ns)

    ipython.register_magic_function(spmd, magic_kind="line_cell", magic_name="spmd")
