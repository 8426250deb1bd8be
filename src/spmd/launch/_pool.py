"""A pool of ranks: N processes started by one launcher (MPI's, or a torchrun-style one with a
file store), each connected to this process by a Unix socket, that run the functions or Python
source sent to them and send back their results, tracebacks and output; a rank that raises,
dies or hangs is named, with its stack. The multi-rank test harness (:mod:`spmd.testing`) runs
checks on pools; the notebook's ``%spmd start`` keeps a :class:`RankPool`."""

from __future__ import annotations

import itertools
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from .._errors import SpmdError
from . import _wire
from ._hosts import TestHosts
from ._leftovers import load_factor, remove_leftovers
from ._mpiexec import mpiexec_argv

__all__ = ["Launcher", "MultiRankError", "Pool", "RankPool", "hosts_for_checks"]

Launcher = Literal["mpi", "env"]

_STARTUP_TIMEOUT = 120.0
_task_ids = itertools.count()


class MultiRankError(AssertionError):
    """One or more ranks failed, hung or died. The message holds each rank's traceback, its
    captured output, and the stacks of ranks that did not finish."""


def hosts_for_checks() -> int:
    """``SPMD_TEST_HOSTS``: the test hosts that multi-rank checks under MPI spread their ranks
    over, where the ranks divide evenly (``spmd.testing.hosts``; 0 or unset: none)."""
    value = os.environ.get("SPMD_TEST_HOSTS", "0")
    try:
        return int(value)
    except ValueError:
        raise SpmdError(
            f"SPMD_TEST_HOSTS={value!r}: expected a number of test hosts", rank=None
        ) from None


class Pool:
    """N worker ranks started by one launcher, connected to this process by Unix sockets."""

    def __init__(
        self, nprocs: int, launcher: Launcher, env: Mapping[str, str], *, fresh: bool = True
    ) -> None:
        """Nothing runs yet (:meth:`start`): a pool is filed where it is kept before it owns
        processes, so that an interrupt (a check's Ctrl-C, a pytest timeout) never leaves ranks
        running that nothing will stop. A pool that is not ``fresh`` (one that is kept for many
        checks) initialises MPI before it imports JAX: MPI_Init waits for every rank, and a rank
        that got there first spins while its peers still import JAX (a 4-rank pool started in
        1.6 s instead of 2.2-2.8 s on 2 cores). Fresh processes start as a user's script does."""
        self.nprocs = nprocs
        self.launcher = launcher
        self.env = dict(env)
        self.fresh = fresh
        self.started = time.time()  # MPICH's files of this pool's job appear after it
        self.dir: Path | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: dict[int, socket.socket] = {}
        self.pids: dict[int, int] = {}
        self.broken = False
        self.hosts: TestHosts | None = None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "launcher.log"

    def start(self) -> None:
        """Start the ranks and connect to them; on any failure or interrupt, kill them."""
        nprocs, launcher, env = self.nprocs, self.launcher, self.env
        self.started = time.time()
        self.dir = Path(tempfile.mkdtemp(prefix="spmd-test-"))  # removed by kill() or close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with open(self.log_path, "wb") as log:
                listener.bind(str(self.dir / "sock"))
                listener.listen(nprocs)
                base = {
                    **os.environ,
                    **env,
                    "SPMD_TESTING_ADDR": str(self.dir / "sock"),
                    "SPMD_TESTING_DIR": str(self.dir),
                }
                worker = [sys.executable, "-m", "spmd.launch._worker"]
                if launcher == "mpi":
                    if not self.fresh:
                        worker[1:] = ["-c", _MPI_FIRST]
                    argv = mpiexec_argv(nprocs, worker)
                    hosts = hosts_for_checks()
                    if hosts > 1 and nprocs % hosts == 0:  # the ranks spread over test hosts
                        self.hosts = TestHosts(hosts)
                        place = self.hosts.mpiexec_args(nprocs, self.hosts.launcher_exec(self.dir))
                        self.hosts.create()
                        argv = self.hosts.runner() + mpiexec_argv(nprocs, worker, None, place)
                        base = self.hosts.environment(base)
                    self.procs.append(
                        subprocess.Popen(
                            argv,
                            env=base,
                            stdout=log,
                            stderr=log,
                            stdin=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
                else:  # what a torchrun-style launcher does: env variables and a shared store
                    store = self.dir / "store"
                    store.mkdir()
                    shared = {
                        **base,
                        "WORLD_SIZE": str(nprocs),
                        "SPMD_FILE_STORE_PATH": str(store),
                        "SPMD_RUN_ID": uuid.uuid4().hex,
                    }
                    # Not ranks of an enclosing MPI job (pytest itself under mpiexec or srun).
                    shared = {k: v for k, v in shared.items() if not _is_mpi_launcher_var(k)}
                    for r in range(nprocs):
                        self.procs.append(
                            subprocess.Popen(
                                worker,
                                env={**shared, "RANK": str(r), "LOCAL_RANK": str(r)},
                                stdout=log,
                                stderr=log,
                                stdin=subprocess.DEVNULL,
                                start_new_session=True,
                            )
                        )
                self._accept(listener)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while len(self.conns) < self.nprocs:
            if any(p.poll() is not None for p in self.procs):
                raise MultiRankError(
                    f"the {self.nprocs}-rank test pool exited while starting:\n{self.log_tail()}"
                )
            listener.settimeout(max(0.0, min(0.5, deadline - time.monotonic())))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise MultiRankError(
                        f"only ranks {sorted(self.conns)} of {self.nprocs} connected within "
                        f"{_STARTUP_TIMEOUT:g} s:\n{self.log_tail()}"
                    ) from None
                continue
            conn.settimeout(None)
            _, rank, pid = _wire.recv(conn)
            self.conns[rank] = conn
            self.pids[rank] = pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        timeout: float,
        grace: float,
    ) -> list[Any]:
        module = sys.modules[fn.__module__]
        task = (
            "task",
            next(_task_ids),
            fn.__module__,
            module.__file__,
            fn.__qualname__,
            tuple(args),
            dict(kwargs),
        )
        label = f"{fn.__module__}.{fn.__qualname__}"
        return [reply[2] for reply in self._guarded(label, task, timeout, grace)]

    def _guarded(
        self, label: str, task: tuple[Any, ...], timeout: float, grace: float
    ) -> list[tuple[Any, ...]]:
        """Every rank's reply to ``task`` (see :meth:`_run`); the pool is killed if the
        exchange is interrupted or breaks."""
        try:
            return self._run(label, task, timeout, grace)
        except MultiRankError:
            raise
        except BaseException as e:
            # Interrupted (Ctrl-C, a pytest timeout) or a broken connection: the ranks may still
            # be running this check, and their replies would answer the next one. Never reuse.
            self.kill()
            if isinstance(e, OSError | EOFError | pickle.UnpicklingError | TypeError):
                raise MultiRankError(
                    f"{label} on {self.nprocs} ranks: the exchange with the ranks failed "
                    f"({e!r}); the pool is replaced by the next check.\n{self.log_tail()}"
                ) from e
            raise

    def _run(
        self, label: str, task: tuple[Any, ...], timeout: float, grace: float
    ) -> list[tuple[Any, ...]]:
        task_id = task[1]
        for conn in self.conns.values():
            _wire.send(conn, task)
        replies: dict[int, tuple[Any, ...]] = {}
        dead: list[int] = []
        selector = selectors.DefaultSelector()
        for rank, conn in self.conns.items():
            selector.register(conn, selectors.EVENT_READ, rank)
        start = time.monotonic()
        first_error: float | None = None
        stretched = False
        while len(replies) + len(dead) < self.nprocs:
            now = time.monotonic()
            limit = (
                start + timeout
                if first_error is None
                else min(start + timeout, first_error + grace)
            )
            if now >= limit and first_error is None and not stretched:
                # On a loaded machine the ranks get a share of a core: give them as much more
                # time as the machine is oversubscribed (at most 4x), once.
                stretched = True
                timeout *= load_factor()
                continue
            if now >= limit:
                break
            for key, _ in selector.select(timeout=limit - now):
                rank = key.data
                reply = _wire.recv(key.fileobj)  # type: ignore[arg-type]
                if reply is not None and reply[1] != task_id:
                    continue  # not this check's (cannot happen in a pool that is reused)
                selector.unregister(key.fileobj)
                if reply is None:
                    dead.append(rank)
                    first_error = first_error or time.monotonic()
                    continue
                replies[rank] = reply
                if reply[0] == "error" and first_error is None:
                    first_error = time.monotonic()
        selector.close()
        missing = [r for r in range(self.nprocs) if r not in replies and r not in dead]
        errors = {r: rep for r, rep in replies.items() if rep[0] == "error"}
        if not missing and not dead and not errors:
            return [replies[r] for r in range(self.nprocs)]
        stacks = self._stacks(missing) if missing else {}
        if missing or dead:
            self.kill()
        raise MultiRankError(
            self._report(label, errors, dead, missing, stacks, replies, timeout, grace, first_error)
        )

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            try:
                os.kill(self.pids[r], signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        return {r: self.log_path.with_name(f"stack.{r}").read_text(errors="replace") for r in ranks}

    def _report(
        self,
        label: str,
        errors: dict[int, tuple[Any, ...]],
        dead: list[int],
        missing: list[int],
        stacks: dict[int, str],
        replies: dict[int, tuple[Any, ...]],
        timeout: float,
        grace: float,
        first_error: float | None,
    ) -> str:
        parts = [f"{label} on {self.nprocs} ranks:"]
        for r, (_, _, tb, _, out) in sorted(errors.items()):
            parts.append(f"--- rank {r} raised ---\n{tb.rstrip()}")
            if out:
                parts.append(f"--- rank {r} output ---\n{out.rstrip()}")
        for r in sorted(dead):
            parts.append(f"--- rank {r} died (its connection closed) ---")
        if dead:
            parts.append(f"--- launcher output ---\n{self.log_tail()}")
        if missing:
            why = (
                f"within {grace:g} s after the first failure"
                if first_error is not None
                else f"within the timeout of {timeout:g} s (stretched by the machine's load, "
                "up to 4x)"
            )
            parts.append(f"ranks {missing} did not finish {why}; their stacks:")
            for r in missing:
                parts.append(f"--- rank {r} stack ---\n{stacks.get(r, '').rstrip()}")
        summary = []
        if errors:
            summary.append(f"ranks {sorted(errors)} raised")
        if dead:
            summary.append(f"ranks {sorted(dead)} died")
        if missing:
            summary.append(f"ranks {missing} did not finish (hang)")
        return "; ".join(summary) + "\n" + "\n".join(parts)

    def alive(self) -> bool:
        """Started (every rank connected), and no rank has ended."""
        return len(self.conns) == self.nprocs and all(p.poll() is None for p in self.procs)

    def rss(self) -> int:
        """The bytes its ranks' processes hold in memory now (Linux; 0 elsewhere)."""
        total = 0
        for pid in self.pids.values():
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(
                        (int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0
                    )
            except OSError:
                pass
        return total

    def kill(self) -> None:
        self.broken = True
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        self._cleanup()

    def close(self) -> None:
        if self.broken:  # killed, or a close that was interrupted: make sure it is reaped
            self.kill()
            return
        self.broken = True
        try:
            for conn in self.conns.values():
                _wire.send(conn, ("exit",))
            for proc in self.procs:
                proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        except BaseException:  # interrupted (Ctrl-C, a pytest timeout): leave nothing running
            self.kill()
            raise
        self._cleanup()

    def _cleanup(self) -> None:
        for conn in self.conns.values():
            conn.close()
        if self.hosts is not None:
            self.hosts.remove()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        # A killed (or aborted) job leaves MPICH's segments behind, as under spmd-run.
        remove_leftovers(self.started)


_MPI_FIRST = "from mpi4py import MPI\nfrom spmd.launch._worker import main\nmain()\n"


class RankPool(Pool):
    """N ranks kept running under the MPI launcher, each executing Python source in a namespace
    of its own that lasts from one call to the next (what ``%spmd start`` runs notebook cells
    on). :meth:`start` starts them, :meth:`close` stops them."""

    def __init__(self, nprocs: int, env: Mapping[str, str] | None = None) -> None:
        super().__init__(nprocs, "mpi", dict(env or {}))

    def execute(
        self,
        source: str,
        *,
        push: Mapping[str, bytes] | None = None,
        timeout: float = 300.0,
        grace: float = 5.0,
    ) -> list[str]:
        """Run ``source`` on every rank (after setting the pickled variables ``push``); each
        rank's output (stdout and stderr), by rank. Raises :class:`MultiRankError` with every
        failing rank's traceback; the pool stays usable unless a rank died or hung (then it is
        stopped: :attr:`broken`)."""
        task = ("exec", next(_task_ids), source, dict(push or {}))
        return [reply[3] for reply in self._guarded("the cell", task, timeout, grace)]

    def values(self, name: str, *, timeout: float = 60.0) -> list[Any]:
        """The variable ``name`` of every rank's namespace, by rank (JAX arrays as NumPy)."""
        task = ("get", next(_task_ids), name)
        return [reply[2] for reply in self._guarded(f"the value {name}", task, timeout, 5.0)]


_MPI_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "HYDI_", "HYDRA_", "MPI_LOCAL")


def _is_mpi_launcher_var(name: str) -> bool:
    return name.startswith(_MPI_LAUNCHER_PREFIXES) or name in ("SLURM_PROCID", "SLURM_STEP_ID")
