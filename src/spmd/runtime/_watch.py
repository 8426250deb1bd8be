"""The peer watch: how a rank waiting over MPI for ranks on other nodes learns, within about a
second, that one of them left, and which have not arrived when it reports a stall or times out.

Within a node the group's shared-memory segment shows every rank's progress and process
(runtime/_groups.py, ``watch_peers``). Between nodes nothing does, so where the world spans
nodes each rank runs two threads from ``spmd.init``:

- a server on a TCP port of its node's address (native, native/cpu/watch.h: it answers while
  Python cannot run, in MPI_Finalize at exit or in a C call that holds the interpreter lock),
  which answers a peer's question "how many collectives have you started on the communicator
  of these world ranks?" with that number, whether this process is exiting, and its pid; asked
  to, it has the process print its Python stack (SIGUSR1, as for a stall on one node);
- a watcher, which every quarter second asks the native layer whether one of this process's
  MPI communicators waits in a collective (``mpi_watch_waits``). Once a wait has lasted half a
  second, it asks the peers of that communicator how far they got, and gives the native layer
  its verdict (``mpi_watch_verdict``): a peer that is exiting, or whose port refuses connections
  (its process is gone), before reaching the collective ends the wait with an error naming it;
  peers that have not reached it, or do not answer (stopped, or their node unreachable), are
  named by the stall report (``SPMD_STALL_WARN``) and the timeout.

A peer that has reached the collective is not asked again for it; the others are asked up to
16 at a time, so that a group of thousands with many peers silent is judged in a few ask
timeouts (half a second each). The ports are exchanged in
``spmd.init`` over the setup channel, and each rank then asks the next one once: if any cannot
reach its neighbour, the watch is off on every rank (rank 0 says why) and waits between nodes
run to ``SPMD_TIMEOUT`` as before. ``SPMD_WATCH_ADDR`` sets the address to listen on (default:
the first non-loopback address of the hostname, else of an interface, else 127.0.0.1; one
address, never every interface); ``SPMD_WATCH=0`` turns the watch off.

A rank that fails a collective over MPI (a timeout, a mismatch, a peer gone) tells every peer of
that communicator, through the watcher within a quarter second (``mpi_watch_failures``, then a
line to each peer's server): the peer's next collective on it, or its wait in this one, fails at
once with that error instead of waiting for its own timeout, as the node's segment makes it
within a node. The servers also carry the job's wait board (native/cpu/board.h), which lives in
a segment within a node: a server answers what its process waits for inside spmd, world rank 0
reads every rank's wait while its own wait lasts, and a deadlock it finds (every rank waiting,
no wait that can complete) is sent to every rank, whose waits then fail with it. Nothing but
these counts, flags, pids, waits and failures' texts is sent, and the only actions a peer can
request are the stack print, the report of its failure and the deadlock.

Each rank's server answers only requests that carry its token, a random secret that travels
with its port over the setup channel (MPI, or the job's private store): anyone else on the
network who reaches the port gets no answer, asks for no stack and reports no failure or
deadlock. The server serves its clients together, so one that connects and says nothing delays
no peer."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .._native_lib import native
from ._env import stall_warn_seconds

if TYPE_CHECKING:
    from ._communicator import Communicator

_POLL_S = 0.25  # how often the watcher looks for a wait
_FIRST_S = 0.5  # a wait this long gets the peers asked
_ASK_TIMEOUT_S = 0.5  # connecting to a peer and reading its answer, each
_ASK_AT_ONCE = 16  # peers asked at the same time (a group of thousands: 16 answers at a time)
_TOLD_MAX = 8192  # the characters of an error told to the peers
_SETTLED_S = 0.5  # the job's waits are judged once each has lasted this long (board.h's kSettled)
_RECHECK_S = 0.1  # a deadlock found is read again after this, to see that no rank moved
_SCAN_MAX_S = 4.0  # rank 0 reads the job's waits at most this far apart while it waits


def _escaped(text: str) -> str:
    """A text as the watch's server reads it: one line, at most _TOLD_MAX characters."""
    return text[:_TOLD_MAX].replace("\\", "\\\\").replace("\n", "\\n")


_watch: _Watch | None = None


def _interface_addresses() -> list[str]:
    """The IPv4 addresses of this network namespace's interfaces (Linux; [] elsewhere)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found = []
    with (
        contextlib.suppress(OSError, AttributeError),
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s,
    ):
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()))
                found.append(socket.inet_ntoa(packed[20:24]))
    return found


def _listen_address() -> str:
    """SPMD_WATCH_ADDR, else the hostname's first non-loopback address, else the first
    non-loopback address of an interface, else 127.0.0.1."""
    explicit = os.environ.get("SPMD_WATCH_ADDR")
    if explicit:
        return explicit
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    addresses = [str(info[4][0]) for info in infos] + _interface_addresses()
    return next((a for a in addresses if not a.startswith("127.")), "127.0.0.1")


class _Watch:
    def __init__(self, world: Communicator) -> None:
        self.me = world.world_rank
        self.node_ids = world.node_ids
        self.stall_s = stall_warn_seconds()
        self.host = _listen_address()
        self.port = 0
        self.token = secrets.token_hex(16)  # this rank's server answers requests with it only
        self.addresses: list[tuple[str, int, str]] = []  # each rank's host, port and token
        self.stop = threading.Event()
        # Per (world ranks, call): what is known of each peer; the calls whose stacks were asked.
        self.known: dict[tuple[tuple[int, ...], int], dict[int, dict[str, int] | str]] = {}
        self.asked: set[tuple[tuple[int, ...], int]] = set()
        self.pids: dict[int, int] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.scanned_wait, self.scan_every, self.next_scan = -1, _POLL_S, 0.0  # rank 0's scans
        self.thread = threading.Thread(target=self._watch, name="spmd-watch", daemon=True)

    def listen(self) -> None:
        self.port = int(native.watch_listen(self.host, self.token))

    def _exchange(self, rank: int, text: str, answer: bool = True) -> bytes | str:
        """Send one request line (after the peer's token) to a peer's server: its answer line
        (``b""`` where none is awaited), or ``"gone"`` (its port refuses or drops the
        connection: its process has ended) or ``"silent"`` (no answer in time: stopped, or its
        node unreachable)."""
        host, port, token = self.addresses[rank]
        try:
            with socket.create_connection((host, port), timeout=_ASK_TIMEOUT_S) as conn:
                conn.sendall(f"{token} {text}\n".encode())
                if not answer:
                    return b""
                line = conn.makefile("rb").readline()
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
            return "gone"
        except OSError:  # a timeout, or an unreachable address
            return "silent"
        return line or "gone"

    def ask(self, rank: int, ranks: Sequence[int], stack: bool = False) -> dict[str, int] | str:
        """A peer's answer (started, leaving, pid, dumps), or ``"gone"`` or ``"silent"``."""
        line = self._exchange(rank, f"{int(stack)} {','.join(map(str, ranks))}")
        if isinstance(line, str):
            return line
        try:
            started, leaving, pid, dumps = (int(v) for v in line.split())
        except ValueError:
            return "silent"
        self.pids[rank] = pid
        return {"started": started, "leaving": leaving, "pid": pid, "dumps": dumps}

    def tell(self, rank: int, ranks: Sequence[int], call: int, error: str) -> None:
        """Tell a peer that this rank failed collective #call on the communicator of ``ranks``
        (no answer comes; a peer that cannot be reached is not told)."""
        ranks_text = ",".join(map(str, ranks))
        self._exchange(rank, f"F {call} {self.me} {ranks_text} {_escaped(error)}", answer=False)

    def wait_of(self, rank: int) -> tuple[int, float, int, list[int], str] | None:
        """A rank's wait inside spmd as its board shows it: (an id that changes with every
        wait, seconds waited, key, the group's world ranks, the wait written out); None if it
        waits for nothing inside spmd, its wait is not judged, or it does not answer."""
        if rank == self.me:
            line = native.board_mine()
        else:
            got = self._exchange(rank, "W")
            if isinstance(got, str):
                return None
            line = got.decode(errors="replace").rstrip("\n")
        parts = line.split(" ", 6)
        try:
            if len(parts) < 7 or parts[0] != "1" or int(parts[4]) < 0:
                return None
            members = [] if parts[5] == "-" else [int(m) for m in parts[5].split(",")]
            return int(parts[1]), int(parts[2]) * 1e-9, int(parts[3]), members, parts[6]
        except ValueError:
            return None

    # -- the watcher -----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self.stop.wait(_POLL_S):
            try:
                waits = native.mpi_watch_waits()
                failures = native.mpi_watch_failures()
            except Exception:  # the native layer is going away (interpreter exit)
                return
            if self.me == 0:
                with contextlib.suppress(Exception):
                    self._deadlock()
            for ranks, call, error in failures:  # each peer told, a few at a time
                peers = [r for r in ranks if r != self.me]
                with contextlib.suppress(Exception):
                    n = len(peers)
                    list(self._pool().map(self.tell, peers, [ranks] * n, [call] * n, [error] * n))
            for ranks, call, waited in waits:
                if waited >= _FIRST_S:
                    with contextlib.suppress(Exception):
                        self._check(tuple(ranks), int(call), float(waited))

    def _deadlock(self) -> None:
        """World rank 0, while it waits inside spmd: the job's wait board across nodes. Once its
        own wait has lasted _SETTLED_S, it reads every rank's wait (then again less often, up to
        every _SCAN_MAX_S); when every rank waits inside spmd, each wait settled and judged,
        and no wait can complete, it reads them once more, and if no rank has moved it hands
        the deadlock to every rank (each of their waits then fails with it)."""
        mine = self.wait_of(self.me)
        if mine is None or mine[1] < _SETTLED_S:
            return
        if mine[0] != self.scanned_wait:  # a new wait: read at once, then less often
            self.scanned_wait, self.scan_every, self.next_scan = mine[0], _POLL_S, 0.0
        now = time.monotonic()
        if now < self.next_scan:
            return
        self.next_scan = now + self.scan_every
        self.scan_every = min(2 * self.scan_every, _SCAN_MAX_S)
        everyone = range(len(self.addresses))
        first = list(self._pool().map(self.wait_of, everyone))
        if any(w is None or w[1] < _SETTLED_S for w in first):
            return
        text = native.board_judge([(w[2], w[3], w[4]) for w in first if w is not None])
        if not text:
            return
        time.sleep(_RECHECK_S)
        again = list(self._pool().map(self.wait_of, everyone))
        if [w and w[0] for w in again] != [w and w[0] for w in first]:
            return  # a rank moved on
        peers = [r for r in everyone if r != self.me]
        list(self._pool().map(lambda r: self._exchange(r, f"D {_escaped(text)}", False), peers))
        native.board_declare(text)

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(_ASK_AT_ONCE, thread_name_prefix="spmd-watch-ask")
        return self.pool

    def _where(self, rank: int) -> str:
        node = self.node_ids[rank] if rank < len(self.node_ids) else ""
        return f"rank {rank}" + (f" (node {node})" if node else "")

    def _check(self, ranks: tuple[int, ...], call: int, waited: float) -> None:
        key = (ranks, call)
        known = self.known.setdefault(key, {})
        for old in [k for k in self.known if k[0] == ranks and k[1] < call]:
            del self.known[old]

        def reached(r: int) -> bool:
            answer = known.get(r)
            return r == self.me or (isinstance(answer, dict) and answer["started"] >= call)

        # One that has reached the collective is not asked again; the others a few at a time,
        # so that many silent peers cost a few timeouts, not one each.
        todo = [r for r in ranks if not reached(r)]
        if len(todo) > 1:
            answers = list(self._pool().map(lambda r: self.ask(r, ranks), todo))
        else:
            answers = [self.ask(r, ranks) for r in todo]
        known.update(zip(todo, answers, strict=True))
        gone, late, behind = "", [], []
        for r in ranks:
            answer = known.get(r)
            if r == self.me or answer is None:
                continue
            if answer == "gone":
                pid = self.pids.get(r)
                process = f"its process {pid}" if pid else "its process"
                gone = gone or (
                    f"{self._where(r)} has ended ({process} no longer answers the peer watch)"
                )
            elif isinstance(answer, str):  # "silent"
                late.append(
                    f"{self._where(r)}, which does not answer the peer watch (its process may "
                    "be stopped, or its node unreachable)"
                )
            elif answer["started"] < call:
                if answer["leaving"]:
                    gone = gone or (
                        f"{self._where(r)} is exiting (its Python program ended, or called "
                        "sys.exit)"
                    )
                behind.append(r)
        # The lowest rank of the group that has reached the call asks for the stacks, once.
        asker = next(r for r in ranks if reached(r)) == self.me
        for r in behind:
            answer = known[r]
            assert isinstance(answer, dict)
            text = (
                f"{self._where(r)}, which has started {answer['started']} collectives over MPI "
                "on the group: it has not reached this collective"
            )
            if asker and answer["dumps"] and self.stall_s > 0:
                text += ". Its Python stack follows in its output"
            late.append(text)
        if asker and self.stall_s > 0 and waited >= self.stall_s and key not in self.asked:
            self.asked.add(key)
            for r in behind:
                answer = known[r]
                if isinstance(answer, dict) and answer["dumps"]:
                    self.ask(r, ranks, stack=True)
        text = "; and ".join(late) + ("." if late else "")
        native.mpi_watch_verdict(list(ranks), call, gone, text)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * _POLL_S + 4 * _ASK_TIMEOUT_S)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.port:
            native.watch_stop()
            self.port = 0


def start(world: Communicator) -> None:
    """Collective over the world at ``spmd.init``: start the watch where the world spans nodes
    (nothing otherwise, or with ``SPMD_WATCH=0``)."""
    global _watch
    if _watch is not None or world.size == 1 or len(set(world.node_ids)) == 1:
        return
    if os.environ.get("SPMD_WATCH", "1") == "0":  # the same on every rank: no exchange
        return
    watch = _Watch(world)
    problem = ""
    try:
        watch.listen()
    except RuntimeError as e:
        problem = f"rank {world.world_rank} cannot listen: {e}"
    addresses = world._setup_allgather(
        (watch.host, watch.port, watch.token) if watch.port else None
    )
    if not problem and any(a is None for a in addresses):
        problem = "a rank could not listen"
    if not problem:
        watch.addresses = [(str(a[0]), int(a[1]), str(a[2])) for a in addresses]
        neighbour = (world.world_rank + 1) % world.size
        if not isinstance(watch.ask(neighbour, []), dict):
            host, port, _ = watch.addresses[neighbour]
            problem = (
                f"rank {world.world_rank} cannot reach rank {neighbour}'s port at {host}:{port}; "
                "set SPMD_WATCH_ADDR to an address the nodes reach each other on"
            )
    problems = [p for p in world._setup_allgather(problem) if p]
    if problems:
        watch.close()
        if world.world_rank == 0:
            warnings.warn(
                f"spmd: the peer watch is off ({problems[0]}): a rank on another node that "
                "leaves or stalls is found only at SPMD_TIMEOUT",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    watch.thread.start()
    _watch = watch


def stop() -> None:
    """Stop the watch (``spmd.finalize``)."""
    global _watch
    if _watch is not None:
        _watch.close()
        _watch = None
