"""The job runner: starts ``command`` on N ranks through the MPI launcher, each under the
per-rank wrapper (:mod:`spmd.launch._rank`), watches the ranks' reports, and stops the whole job
when one fails, on ``timeout``, or when this process is interrupted or killed.

When a rank fails, the others get ``grace`` seconds to finish printing, then the job is stopped;
the summary names the failing rank and its error. The exit code is the failing rank's (128 + N
for a rank killed by signal N, as a shell reports it), 124 after ``timeout``; Ctrl-C, SIGTERM and
SIGHUP stop the job (130, 143, 129); on Linux, so does killing this process outright (SIGKILL:
the launcher gets SIGTERM).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from .._errors import SpmdError
from ..runtime import bind_mode, flight_report, merge_timeline, record_cpus, timeline_dir
from ._exits import ExitWatch
from ._hosts import TestHosts
from ._leftovers import remove_leftovers
from ._mpiexec import mpiexec_argv
from ._protocol import output_file

_PYTHON = re.compile(r"python[0-9.]*$")
# Interpreter options that take a value (``-W error`` or ``-Werror``).
_PYTHON_OPTS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def _has_spmd(python: str, flags: list[str]) -> bool:
    """Whether ``python`` with the user's interpreter ``flags`` can import the wrapper: this
    interpreter can, unless a flag changes where imports come from (``-S``, ``-I``, ...)."""
    found = shutil.which(python)
    if found is None:
        return False
    same = os.path.realpath(found) == os.path.realpath(sys.executable)
    moves_imports = any(
        f.startswith("-") and not f.startswith("--") and set(f[1:]) & set("SIEs") for f in flags
    )
    if same and not moves_imports:
        return True
    probe = [found, *flags, "-c", "import spmd.launch._rank"]
    return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


def wrap_command(command: list[str]) -> list[str]:
    """The per-rank argv: Python commands run inside the wrapper (tracebacks are caught and
    named), other programs and Python interpreters without spmd run under it."""
    exe = command[0]
    if _PYTHON.search(os.path.basename(exe)):
        i = 1
        while i < len(command) and command[i].startswith("-") and command[i] not in ("-c", "-m"):
            if command[i] == "-":
                break
            takes_value = command[i] in _PYTHON_OPTS_WITH_VALUE
            i += 2 if takes_value else 1
        target = command[i:]
        if (
            target
            and target[0] != "-"
            and (target[0] not in ("-c", "-m") or len(target) >= 2)
            and _has_spmd(exe, command[1:i])
        ):
            return [*command[:i], "-m", "spmd.launch._rank", "--python", *target]
    return [sys.executable, "-m", "spmd.launch._rank", "--exec", *command]


_STATUS_PREFIX = "spmd-run-"


def _make_status_dir() -> Path:
    """The job's status directory, named after this process, with the job's start time in it
    and a lock this spmd-run holds until it exits: the lock, not the pid in the name (which a
    later process may reuse), tells another spmd-run that this job is alive."""
    directory = Path(tempfile.mkdtemp(prefix=f"{_STATUS_PREFIX}{os.getpid()}-"))
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[directory] = fd
    (directory / "started").write_text(repr(time.time()))
    return directory


_held: dict[Path, int] = {}  # status directory -> its lock, held while the job runs


def _remove_status_dir(directory: Path) -> None:
    """Remove the status directory, also when a rank still dying writes into it meanwhile."""
    for _ in range(20):
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            break
        time.sleep(0.05)
    fd = _held.pop(directory, None)
    if fd is not None:
        os.close(fd)


def _remove_stale_status_dirs() -> None:
    """A spmd-run killed by SIGKILL could not remove its status directory, nor what its job
    left in /dev/shm and /tmp: the next spmd-run of the same user does, for every such
    directory whose spmd-run is gone (its lock is free). Anything else matching the name is
    left alone, at once: symbolic links, what is not a directory, what another user owns, and
    a directory without a lock (not one spmd-run made)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{_STATUS_PREFIX}*-*"):
        try:
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(directory / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or no lock of ours in it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its spmd-run holds it: the job is running
        finally:
            os.close(fd)
        try:
            since: float | None = float((directory / "started").read_text())
        except (OSError, ValueError):
            since = None
        shutil.rmtree(directory, ignore_errors=True)
        if since is not None:
            remove_leftovers(since, settle_s=0)


def _read_status(directory: Path) -> dict[int, dict[str, object]]:
    status: dict[int, dict[str, object]] = {}
    for path in directory.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written
        status[int(record["rank"])] = record
    return status


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stops the job: SIGTERM, then SIGKILL. Ctrl-C, SIGTERM and SIGHUP to this process are
    ignored meanwhile, so that a second interrupt cannot cut the stop short and leave ranks
    running."""
    ignored: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *_TERMINATING):
            ignored[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
    finally:
        _restore(ignored)


def _launcher_binds(mpi_args: list[str]) -> bool:
    """Whether the launcher's own arguments choose a binding (MPICH/Hydra ``-bind-to``,
    ``-binding``; Open MPI ``--bind-to``, ``--map-by``): then spmd-run pins nothing."""
    flags = ("-bind-to", "--bind-to", "-binding", "--map-by", "-map-by")
    return any(a.split("=", 1)[0] in flags for a in mpi_args)


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated(signum)


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _catch_termination() -> dict[int, Any]:
    """Turn SIGTERM and SIGHUP into :class:`_Terminated` (main thread only; elsewhere the
    signals keep their handlers)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in _TERMINATING:
        previous[sig] = signal.signal(sig, _terminated)
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def launch(
    nprocs: int,
    command: list[str],
    *,
    nodes: int | None = None,
    hosts: int | None = None,
    link: str | None = None,
    timeout: float | None = None,
    grace: float = 2.0,
    mpiexec: str | None = None,
    mpi_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    stdin: Any = None,
    report: TextIO | None = None,
    on_poll: Callable[[], None] | None = None,
) -> int:
    """Run ``command`` on ``nprocs`` ranks; returns the job's exit code (see module doc).

    ``hosts``: run on that many test hosts of this machine (network namespaces, _hosts.py),
    consecutive ranks per host, with ``link`` as their links' ``tc netem`` shaping; they are
    removed when the job ends, however it ends. ``output_dir``: as ``--output`` (the launcher's
    own output goes to ``launcher.stdout`` and ``launcher.stderr`` there too). ``stdin``: the
    job's standard input (as for ``Popen``). ``report``: where spmd-run's own messages go
    (default: standard error). ``on_poll``: called every 50 ms while the job runs, in this
    thread (``%%spmd`` shows the output so far).
    """
    made: list[TestHosts] = []
    began = time.time()
    try:
        return _launch(
            nprocs,
            command,
            nodes=nodes,
            hosts=hosts,
            link=link,
            timeout=timeout,
            grace=grace,
            mpiexec=mpiexec,
            mpi_args=mpi_args,
            env=env,
            output_dir=output_dir,
            stdin=stdin,
            report=report,
            on_poll=on_poll,
            made=made,
        )
    finally:
        for test_hosts in made:
            test_hosts.remove()
        if made:  # what a host cut off from the launcher still had open is free now
            remove_leftovers(began)


def _launch(
    nprocs: int,
    command: list[str],
    *,
    nodes: int | None = None,
    hosts: int | None = None,
    link: str | None = None,
    timeout: float | None = None,
    grace: float = 2.0,
    mpiexec: str | None = None,
    mpi_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    stdin: Any = None,
    report: TextIO | None = None,
    on_poll: Callable[[], None] | None = None,
    made: list[TestHosts],
) -> int:
    """:func:`launch`; ``made`` receives the test hosts it creates, for ``launch`` to remove."""
    if nprocs < 1:
        raise SpmdError(f"-n {nprocs}: need at least one rank", rank=None)
    if not command:
        raise SpmdError("no command given; e.g. spmd-run -n 2 python train.py", rank=None)
    child_env = dict(os.environ if env is None else env)
    child_env.pop("SPMD_RUN_OUTPUT_DIR", None)
    if nodes is not None and hosts is not None:
        raise SpmdError("--nodes and --hosts exclude each other (hosts are nodes)", rank=None)
    if nodes is not None:
        child_env["SPMD_SIMULATE_NODES"] = str(nodes)
    bind_mode(child_env)  # a bad SPMD_BIND fails here, once, not on every rank
    out = None if output_dir is None else _output_dir(output_dir)
    if out is not None:
        child_env["SPMD_RUN_OUTPUT_DIR"] = str(out)
    _remove_stale_status_dirs()
    status_dir = _make_status_dir()
    child_env["SPMD_RUN_STATUS_DIR"] = str(status_dir)
    if _launcher_binds(mpi_args or []) and child_env.get("SPMD_BIND", "auto") == "auto":
        child_env["SPMD_BIND"] = "none"  # -bind-to none included: the launcher's choice
    record_cpus(child_env)
    report = sys.stderr if report is None else report
    logs: list[Any] = []
    try:
        runner: list[str] = []
        placement: list[str] = []
        if hosts is not None:
            test_hosts = TestHosts(hosts, link=link)
            placement = test_hosts.mpiexec_args(nprocs, test_hosts.launcher_exec(status_dir))
            made.append(test_hosts)
            test_hosts.create()
            child_env = test_hosts.environment(child_env)
            runner = test_hosts.runner()
        extra = placement + list(mpi_args or [])
        argv = _dies_with_us(runner + mpiexec_argv(nprocs, wrap_command(command), mpiexec, extra))
        if out is not None:
            logs = [open(output_file(out, "launcher", n), "wb") for n in ("stdout", "stderr")]  # noqa: SIM115
        streams = {"stdout": logs[0], "stderr": logs[1]} if logs else {}
        started = time.time()
        proc = subprocess.Popen(argv, env=child_env, start_new_session=True, stdin=stdin, **streams)
    except BaseException:
        _remove_status_dir(status_dir)
        raise
    finally:
        for log in logs:  # the launcher holds its own copies
            log.close()
    start = time.monotonic()
    failed_at: float | None = None
    stopped = timed_out = False
    # The job runs in a session of its own (so that stopping it reaches every rank): a
    # SIGTERM or SIGHUP to spmd-run (kill, timeout, a batch system, a closed terminal) must
    # stop the job as Ctrl-C does, not leave it running without us.
    previous = _catch_termination()
    exits = ExitWatch()
    try:
        while proc.poll() is None:
            exits.wait(0.05)
            if on_poll is not None:
                on_poll()
            now = time.monotonic()
            status = _read_status(status_dir)
            exits.add(status)
            if failed_at is None and any(s["state"] == "failed" for s in status.values()):
                failed_at = now
            # Every rank has ended, was killed, or failed and waits to be stopped: no grace left
            # to give (a failed rank that does not wait is ending on its own, flushing files).
            settled = len(status) == nprocs and all(
                s["state"] in ("done", "exited")
                or (
                    s["state"] == "failed"
                    and (
                        str(s.get("error", "")).startswith("killed by")
                        or (status_dir / f"rank{r}.waiting").exists()
                    )
                )
                for r, s in status.items()
            )
            if failed_at is not None and (now - failed_at > grace or settled):
                stopped = True
                _stop(proc)
            elif timeout is not None and now - start > timeout:
                timed_out = stopped = True
                _stop(proc)
    except KeyboardInterrupt:
        _stop(proc)
        _remove_status_dir(status_dir)
        remove_leftovers(started)
        return 130
    except _Terminated as e:
        _stop(proc)
        _remove_status_dir(status_dir)
        print(f"spmd-run: stopped the job on {e.name}", file=report, flush=True)
        remove_leftovers(started)
        return 128 + e.signum
    finally:
        _restore(previous)
        exits.wait(0)
        exits.close()
    status = _read_status(status_dir)
    per_host = nprocs // hosts if hosts else 0

    def where(rank: int) -> str:
        return f"host h{rank // per_host}" if per_host else ""

    code = _summarize(nprocs, status, proc.returncode, stopped, timed_out, timeout, report,
                      lambda silent: exits.first(silent, where))  # fmt: skip
    if code != 0:  # where each group's ranks stood: who waited for whom, in which collective
        for line in flight_report(status_dir):
            print(f"spmd-run: {line}", file=report, flush=True)
    timeline = timeline_dir(child_env)
    if timeline and (merged := merge_timeline(timeline)) is not None:
        print(f"spmd-run: timeline of the job's collectives: {merged}", file=report, flush=True)
    _remove_status_dir(status_dir)
    remove_leftovers(started)
    return code


# Run before the launcher, in its process: SIGTERM when spmd-run dies, whatever kills it (a
# SIGKILL, an out-of-memory kill, a notebook kernel killed mid-cell), then become the launcher.
# (prctl(PR_SET_PDEATHSIG) outlives exec; the check after it covers a parent already gone.)
_DEATH_SIGNAL_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _dies_with_us(argv: list[str]) -> list[str]:
    """``argv`` started so that the launcher gets SIGTERM if this process dies without stopping
    the job (it then stops the ranks, as on Ctrl-C); on Linux, elsewhere ``argv`` as is."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _DEATH_SIGNAL_SHIM, str(os.getpid()), *argv]


def _output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """The ``--output`` directory, created, writable, and cleared of an earlier job's files."""
    if not str(output_dir):
        raise SpmdError("--output needs a directory", rank=None)
    out = Path(output_dir).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpmdError(
            f"--output {output_dir}: cannot create the directory: {e}", rank=None
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SpmdError(f"--output {output_dir}: the directory is not writable", rank=None)
    # An earlier job's files (with more ranks, some would stay behind); only those names.
    for old in out.iterdir():
        if _OUTPUT_FILE.fullmatch(old.name) and old.is_file() and not old.is_symlink():
            old.unlink(missing_ok=True)
    return out


_OUTPUT_FILE = re.compile(r"(rank\d+|launcher)\.(stdout|stderr)")


def _summarize(
    nprocs: int,
    status: dict[int, dict[str, object]],
    returncode: int,
    stopped: bool,
    timed_out: bool,
    timeout: float | None,
    report: TextIO,
    first_silent: Callable[[list[int]], str] = lambda silent: "",
) -> int:
    failed = sorted(r for r, s in status.items() if s["state"] == "failed")
    exited = sorted(r for r, s in status.items() if s["state"] == "exited")
    ended = ("done", "exited", "failed")
    unfinished = [r for r in range(nprocs) if status.get(r, {}).get("state") not in ended]

    def say(msg: str) -> None:
        print(f"spmd-run: {msg}", file=report, flush=True)

    # One line per distinct error (its own rank's number aside), naming the ranks it ended.
    by_error: dict[str, list[int]] = {}
    for r in failed:
        by_error.setdefault(str(status[r].get("error")).replace(f"rank {r}: ", ""), []).append(r)
    for error, ranks in by_error.items():
        if len(ranks) == 1:
            say(f"rank {ranks[0]} failed: {status[ranks[0]].get('error')}")
        else:
            say(f"ranks {ranks} failed: {error}")
    if timed_out:
        say(f"timed out after {timeout:g} s; ranks that had not finished: {unfinished}")
        return 124
    if failed:
        # A rank killed by a signal is the cause of its peers' errors ("rank 1 has ended"):
        # its code is the job's; otherwise the lowest failed rank's.
        first = next(
            (r for r in failed if str(status[r].get("error", "")).startswith("killed by")),
            failed[0],
        )
        if stopped and unfinished:
            say(f"stopped ranks {unfinished} after rank {first} failed")
        code = status[first].get("exit_code", 1)
        return code if isinstance(code, int) and code != 0 else 1
    if exited and unfinished:  # os._exit(0) a collective early: its peers never finished
        for r in exited:
            say(f"rank {r} {status[r].get('error')}; ranks {unfinished} had not finished")
        return 1
    if returncode != 0:
        if returncode < 0:
            try:
                how = f"was killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with code {returncode}"
        say(f"the launcher (mpiexec) {how}; ranks without a clean end: {unfinished}")
        if cause := first_silent(unfinished):
            say(cause)
        return returncode if returncode > 0 else 128 - returncode
    if unfinished:
        say(f"the launcher ended, but ranks {unfinished} never reported the end of their program")
        return 1
    return 0
