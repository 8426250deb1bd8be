"""How a communicator's ranks exchange Python objects: MPI, files, or nothing (a group of one).

These carry bootstrap data (node names, shared-memory names, NCCL ids), never tensors: tensors
go through the native collectives. Every exchange has a deadline (``SPMD_TIMEOUT``) so a rank
that never arrives is an error naming the group, not a hang.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, Protocol

from .._errors import SpmdError
from ._store import FileStore
from ._wait import Deadlock, wait_until


class Channel(Protocol):
    def allgather(self, obj: Any) -> list[Any]: ...
    def close(self) -> None: ...


class SelfChannel:
    """A group of one: every exchange is local."""

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass


class MpiChannel:
    """Pickled objects exchanged with MPI's non-blocking allgathers (the sizes, then the bytes),
    each polled against a deadline: MPI's blocking calls cannot time out.

    MPI cannot cancel a collective, so a timed-out exchange stays posted: its buffers are kept
    alive for MPI to finish into, and the channel refuses every later exchange (a late rank
    would otherwise pair its next call with the abandoned one, then wait forever).
    """

    def __init__(
        self,
        comm: Any,
        world_rank: int,
        ranks: Sequence[int],
        timeout: float,
        what: str = "allgather_object",
    ) -> None:
        self.comm = comm
        self.world_rank = world_rank
        self.ranks = list(ranks)
        self.timeout = timeout
        self.what = what
        self.broken: str | None = None
        self._abandoned: list[Any] = []
        self._waits = 0  # waits so far (the same on every member): the wait board's numbers

    def _wait(self, request: Any, buffers: tuple[Any, ...], what: str) -> None:
        self._waits += 1
        board = (f"channel {what}", self.ranks, self._waits,
                 f"{what} on the group of ranks {self.ranks}")  # fmt: skip
        try:
            if wait_until(request.Test, self.timeout, board):
                return
        except Deadlock:
            self._abandoned.append((request, buffers))
            self.broken = f"{what} on the group of ranks {self.ranks} was part of a deadlock"
            raise
        self._abandoned.append((request, buffers))
        self.broken = (
            f"{what} on the group of ranks {self.ranks} timed out after {self.timeout:g} s: at "
            "least one rank of the group never called it. Every rank of a group must make the "
            "same calls in the same order; raise SPMD_TIMEOUT if they are just slow."
        )
        raise SpmdError(self.broken, rank=self.world_rank)

    def allgather(self, obj: Any) -> list[Any]:
        import numpy as np
        from mpi4py import MPI

        what = self.what
        refuse_if_broken(self.broken, self.world_rank, what, self.ranks)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        mine, sizes = np.array([data.size], np.int64), np.zeros(len(self.ranks), np.int64)
        self._wait(self.comm.Iallgather(mine, sizes), (mine, sizes), what)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), np.uint8)
        spec = [out, (sizes.tolist(), offsets.tolist()), MPI.BYTE]
        self._wait(self.comm.Iallgatherv(data, spec), (data, out), what)
        return [pickle.loads(out[o : o + n].tobytes()) for o, n in zip(offsets, sizes, strict=True)]

    def dup(self) -> Any:
        """A duplicate of the communicator (``MPI_Comm_idup``), with the exchanges' deadline
        and their refusal after a timeout."""
        refuse_if_broken(self.broken, self.world_rank, self.what, self.ranks)
        new, request = self.comm.Idup()
        self._wait(request, (new,), self.what)
        return new

    def close(self) -> None:
        from mpi4py import MPI

        if self.comm != MPI.COMM_SELF and not MPI.Is_finalized():
            self.comm.Free()


def refuse_if_broken(broken: str | None, world_rank: int, what: str, ranks: list[int]) -> None:
    """After a timed-out exchange a group's channel is unusable: its ranks may be out of step."""
    if broken is not None:
        raise SpmdError(
            f"the group of ranks {ranks} is unusable after an earlier exchange timed out "
            f"({broken})",
            op=what,
            rank=world_rank,
        )


_ARRIVAL_TAG = 0x5D0

# What a timed-out exchange of the setup channel (Communicator._setup_allgather) was doing.
SETUP_WHAT = (
    "preparing the group for collectives (the world's in spmd.init; another group's at its "
    "first collective, also when one is only traced or its transport asked for)"
)


def mpi_create_group(world: Any, world_rank: int, ranks: Sequence[int], timeout: float) -> Any:
    """``MPI_Comm_create_group`` for ``ranks``, with a deadline.

    Creating a communicator blocks until every member calls it; a member that never does would
    hang the others. So members first report to the group's root (its first rank) with
    non-blocking messages on ``world`` and the root answers once all are there; only then is
    the communicator created. The root names the ranks that did not arrive.
    """
    root, members = ranks[0], list(ranks)
    token = bytearray(1)
    if world_rank == root:
        pending = {r: world.Irecv(bytearray(1), source=r, tag=_ARRIVAL_TAG) for r in members[1:]}
        sent = []
    else:
        pending = {root: world.Irecv(bytearray(1), source=root, tag=_ARRIVAL_TAG)}
        sent = [world.Isend(token, dest=root, tag=_ARRIVAL_TAG)]

    def all_arrived() -> bool:
        for r in [r for r, request in pending.items() if request.Test()]:
            del pending[r]
        return not pending

    board = ("create", members, 0, f"creating the communicator of ranks {members}")
    try:
        arrived = wait_until(all_arrived, timeout, board)
    except Deadlock:
        for request in pending.values():
            request.Cancel()
        raise
    if not arrived:
        for request in pending.values():
            request.Cancel()
        who = (
            f"ranks {sorted(pending)} never joined"
            if world_rank == root
            else f"rank {root} (the group's root) did not confirm that all joined"
        )
        raise SpmdError(
            f"creating the communicator of ranks {members} timed out "
            f"after {timeout:g} s: {who}. Every rank of a group must make the same calls "
            "in the same order; raise SPMD_TIMEOUT if they are just slow."
        )
    if world_rank == root:  # every member's receive is posted: these complete at once
        sent = [world.Isend(token, dest=r, tag=_ARRIVAL_TAG) for r in members[1:]]
    for request in sent:
        request.Wait()
    return world.Create_group(world.Get_group().Incl(members))


class FileChannel:
    """Exchanges through a :class:`FileStore`; files are named ``<group>.<seq>.<rank>``.

    Garbage collection: once a rank has completed exchange k, every member has written k, so
    every member has finished reading k-1, and the rank deletes its own file of k-1.
    """

    def __init__(
        self,
        store: FileStore,
        ranks: Sequence[int],
        world_rank: int,
        key: Any = None,
        what: str = "allgather_object",
    ) -> None:
        self.store = store
        self.what = what
        self.ranks = list(ranks)
        self.world_rank = world_rank
        # ``key`` tells apart communicators of the same members (rank_list [[0, 1], [2, 3]] and
        # [[0, 1]] both hold 0 and 1): each needs files of its own.
        name = repr((self.ranks, key)).encode()
        self.tag = "g" + hashlib.blake2b(name, digest_size=6).hexdigest()
        self.seq = 0
        self.broken: str | None = None

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.tag}.{seq}.{rank}"

    def allgather(self, obj: Any) -> list[Any]:
        # After a timeout the ranks' sequence numbers may differ: a later exchange would read
        # another one's files. Refuse, as MpiChannel does.
        refuse_if_broken(self.broken, self.world_rank, self.what, self.ranks)
        seq = self.seq
        self.seq += 1
        self.store.set(self._key(seq, self.world_rank), pickle.dumps(obj))
        try:
            what = f"{self.what} on the group of ranks {self.ranks}"
            blobs = self.store.wait(
                [self._key(seq, r) for r in self.ranks],
                what,
                self.ranks,
                on_board=(f"file {self.tag}", self.ranks, seq, what),
            )
        except SpmdError as e:
            self.broken = str(e)
            raise
        if seq > 0:
            self.store.delete(self._key(seq - 1, self.world_rank))
        return [pickle.loads(b) for b in blobs]

    def close(self) -> None:
        pass
