"""Communicator: who this process is within a group of processes, and how the group talks.

A communicator's attributes follow RAF's Distribution Mechanism: ``rank/size`` within the group,
``local_rank/local_size`` among the group's ranks on this node, ``world_rank/world_size`` in the
world, and ``group_id/group_size`` for a communicator made from a ``rank_list``.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._errors import SpmdError, SpmdTypeError, prefix
from ._channel import Channel
from ._groups import NativeGroup, native_group

Groups = tuple[tuple[int, ...], ...]
T = TypeVar("T")


def resolve_rank_list(rank_list: Any, world_size: int, rank: int) -> Groups:
    """Validate ``rank_list`` and complete it: every unlisted rank becomes a group of its own.

    The result is the key of the communicator pool: ``[[0, 1, 2]]`` and ``[[0, 1, 2], [3]]``
    resolve to the same groups on 4 ranks. The checks depend only on the arguments, so every rank
    raises the same error.
    """
    hint = "expected a list of disjoint lists of ranks, e.g. rank_list=[[0, 1], [2, 3]]"
    if isinstance(rank_list, str | bytes) or not isinstance(rank_list, Sequence):
        raise SpmdTypeError(f"rank_list={rank_list!r} is not a list; {hint}", rank=rank)
    if len(rank_list) == 0:
        raise SpmdError(
            f"rank_list=[] lists no group; {hint}, or rank_list=None for the world", rank=rank
        )
    groups: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for gid, group in enumerate(rank_list):
        if isinstance(group, str | bytes) or not isinstance(group, Sequence):
            raise SpmdTypeError(
                f"rank_list={rank_list!r}: group {gid} is {group!r}, not a list of ranks; {hint}",
                rank=rank,
            )
        if len(group) == 0:
            raise SpmdError(f"rank_list={rank_list!r}: group {gid} is empty; {hint}", rank=rank)
        members: list[int] = []
        for r in group:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise SpmdTypeError(
                    f"rank_list={rank_list!r}: group {gid} holds {r!r}, not an "
                    f"integer rank; {hint}",
                    rank=rank,
                )
            r = int(r)
            if not 0 <= r < world_size:
                raise SpmdError(
                    f"rank_list={rank_list!r} names rank {r}, out of range for a "
                    f"world of {world_size} ranks (valid: 0..{world_size - 1})",
                    rank=rank,
                )
            if r in seen:
                where = f"groups {seen[r]} and {gid}" if seen[r] != gid else f"group {gid}"
                raise SpmdError(
                    f"rank_list={rank_list!r} lists rank {r} twice ({where}); each "
                    "rank may appear in at most one group",
                    rank=rank,
                )
            seen[r] = gid
            members.append(r)
        groups.append(tuple(members))
    groups.extend((r,) for r in range(world_size) if r not in seen)
    return tuple(groups)


# MessageQueue, which runtime/_queue.py registers when it is imported (it builds on this module,
# so this module cannot import it).
_queue_factory: Callable[..., Any] | None = None


def use_queue_factory(factory: Callable[..., Any]) -> None:
    """Make ``factory(comm, writer=, slots=, slot_bytes=)`` the queue broadcast_object uses."""
    global _queue_factory
    _queue_factory = factory


class Communicator:
    """This process's view of one group of processes.

    Attributes (read-only; the names and meanings of RAF's Distribution Mechanism):
        rank, size: this process's rank in the group and the group's size.
        local_rank, local_size: rank and count among the group's ranks on this node.
        world_rank, world_size: rank and size in the world communicator.
        group_id, group_size: index of this process's group in the rank_list and the number of
            groups (0 and 1 for the world communicator).
        root_rank: world rank of the group's rank 0.
        ranks: the world ranks of the group, in group-rank order.
        backend: the kind of communicator: "mpi" (started by an MPI launcher) or "void" (RAF's
            VoidCommunicator: bootstrap data through a file store; also a world of one). How
            the group's collectives move data is its transport (:meth:`native_group`).
        groups: every group of the rank_list this communicator was made from, completed with
            the unlisted ranks as groups of their own.

    Ranks of a group exchange small Python objects with :meth:`allgather_object`,
    :meth:`broadcast_object` and :meth:`barrier` (bootstrap data; arrays go through
    :mod:`spmd.ops`). Every rank of the group must call them in the same order.
    """

    def __init__(
        self,
        *,
        groups: Groups,
        group_id: int,
        world_rank: int,
        node_ids: Sequence[str],
        backend: str,
        channel_factory: Callable[[Communicator], tuple[Channel, Channel]],
        data_comm: Any = None,
    ) -> None:
        ranks = groups[group_id]
        my_node = node_ids[world_rank]
        on_my_node = [r for r in ranks if node_ids[r] == my_node]
        self._groups = groups
        self._ranks = ranks
        self._group_id = group_id
        self._world_rank = world_rank
        self._world_size = len(node_ids)
        self._rank = ranks.index(world_rank)
        self._local_rank = on_my_node.index(world_rank)
        self._local_size = len(on_my_node)
        self._node_id = my_node
        self._node_ids = tuple(node_ids)
        self._backend = backend
        self._channel_factory = channel_factory
        self._channel: Channel | None = None
        self._setup: Channel | None = None
        self._queues: dict[int, Any] = {}  # broadcast_object's MessageQueue per root
        # The MPI communicator the group's collectives move data on: the world's is made in
        # spmd.init; a sub-group's is made with its native group (None until then).
        self._data_comm = data_comm

    # -- attributes -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_size(self) -> int:
        return self._local_size

    @property
    def world_rank(self) -> int:
        return self._world_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_id(self) -> int:
        return self._group_id

    @property
    def group_size(self) -> int:
        return len(self._groups)

    @property
    def root_rank(self) -> int:
        return self._ranks[0]

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def node_id(self) -> str:
        """This process's node identity (hostname, or ``SPMD_NODE_ID``)."""
        return self._node_id

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The node identity of every world rank, indexed by world rank."""
        return self._node_ids

    @property
    def groups(self) -> Groups:
        return self._groups

    def __repr__(self) -> str:
        return (
            f"Communicator(backend={self._backend!r}, rank={self.rank}, size={self.size}, "
            f"local_rank={self.local_rank}, local_size={self.local_size}, "
            f"world_rank={self.world_rank}, world_size={self.world_size}, "
            f"group_id={self.group_id}, group_size={self.group_size}, ranks={list(self._ranks)})"
        )

    # -- object exchange ------------------------------------------------------------------------

    def _get_channel(self) -> Channel:
        if self._channel is None:
            self._channel, self._setup = self._channel_factory(self)
        return self._channel

    def _setup_allgather(self, obj: Any) -> list[Any]:
        """:meth:`allgather_object` on a channel of its own, for the exchanges spmd makes
        when it prepares the group for collectives (shared-memory names, NCCL ids).

        That preparation can happen on one rank alone, when it traces a collective or asks for
        the group's transport; on the group's own channel its exchange would pair with the
        others' next ``barrier`` or ``allgather_object`` and garble both. On this channel it
        waits for the others' preparation, and times out with an error saying so if they never
        get there.
        """
        self._get_channel()  # both channels are made together
        assert self._setup is not None
        return self._setup.allgather(obj)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in group-rank order, on every rank of the group."""
        return self._get_channel().allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``obj`` of group rank ``root`` on every rank of the group (``obj`` itself on the
        root). Within a node it goes through a :class:`spmd.MessageQueue` of the group (made at
        the first call for this root: a collective, as every call is), so the root does not wait
        for the others (up to 8 calls ahead); across nodes, through the group's channel."""
        if isinstance(root, bool) or not isinstance(root, numbers.Integral):
            raise SpmdTypeError(f"root={root!r} is not an integer rank")
        if not 0 <= root < self.size:
            raise SpmdError(
                f"root={root} is out of range for a group of "
                f"{self.size} ranks (valid: 0..{self.size - 1})"
            )
        queue = self._broadcast_queue(int(root))
        if queue is None:
            return self._get_channel().allgather(obj if self._rank == root else None)[root]
        if self._rank == root:
            queue.enqueue(obj)
            return obj
        return queue.dequeue()

    def _broadcast_queue(self, root: int) -> Any:
        """The MessageQueue that broadcast_object uses for ``root``, or None (a group of one,
        ranks on several nodes, or SPMD_BROADCAST_QUEUE=0)."""
        queue = self._queues.get(root)
        if queue is not None:
            return queue
        if self.size == 1 or len({self.node_ids[w] for w in self.ranks}) > 1:
            return None
        if os.environ.get("SPMD_BROADCAST_QUEUE", "1") == "0" or _queue_factory is None:
            return None
        queue = self._queues[root] = _queue_factory(self, writer=root, slots=8, slot_bytes=64 << 10)
        return queue

    def barrier(self) -> None:
        """Return once every rank of the group has called ``barrier``."""
        self._get_channel().allgather(None)

    def _outcomes(
        self, step: Callable[[], T], setup: bool
    ) -> tuple[list[Any], str | None, Exception | None]:
        """``step()`` here and every rank's outcome: (every rank's result, the first failure's
        message naming its rank or None, this rank's own exception or None)."""
        exchange = self._setup_allgather if setup else self.allgather_object
        result: T | None = None
        own: Exception | None = None
        try:
            result = step()
        except Exception as e:  # every rank learns of it below
            own = e
        text = None
        if own is not None:  # the message names the failing rank, whatever raised it
            named = isinstance(own, SpmdError) and own.rank is not None
            text = str(own) if named else f"{prefix()}{own}"
        outcomes = exchange((text, result)) if self.size > 1 else [(text, result)]
        first = next((t for t, _ in outcomes if t is not None), None)
        return [r for _, r in outcomes], first, own

    def agree(self, step: Callable[[], T], *, setup: bool = False) -> list[T]:
        """Run ``step()`` on every rank of the group and agree on the outcome.

        Returns every rank's result, in group-rank order, when ``step`` succeeded on every rank.
        Otherwise every rank raises: a rank where it failed, its own exception; the others an
        :class:`spmd.SpmdError` that quotes the first failing rank's. So no rank goes on to a
        collective that a failed rank will never join. ``setup=True`` exchanges over the
        channel spmd uses to prepare groups for collectives (see :meth:`_setup_allgather`).
        """
        results, first, own = self._outcomes(step, setup)
        if own is not None:
            raise own
        if first is not None:
            raise SpmdError(f"failed because another rank did: {first}")
        return results

    def _try_agree(self, step: Callable[[], T]) -> tuple[list[T] | None, str]:
        """As :meth:`agree` over the setup channel, without raising, for set-up steps whose
        failure disables a path rather than failing (the GPU side): ``(every rank's result,
        "")`` when ``step`` succeeded on every rank, else ``(None, the first failure's
        message)``, the same on every rank (the message names the rank that failed)."""
        results, first, _ = self._outcomes(step, True)
        return (None, first) if first is not None else (results, "")

    def native_group(
        self, *, p2p: bool = False, gpu_settings: Callable[[], Any] | None = None
    ) -> NativeGroup:
        """This group in the native layer, which spmd's collectives run on (registered at first
        use, collectively over the group; see :mod:`spmd.runtime._groups`): with ``p2p``, only
        what point-to-point calls need. ``gpu_settings``: the GPU all-reduce chain's settings,
        for the group's GPU side where JAX computes on a GPU."""
        return native_group(self, p2p=p2p, gpu_settings=gpu_settings)

    def mpi_comm(self) -> Any:
        """The group's mpi4py communicator (used for bootstrap exchanges), or None when the
        group has no MPI (a group of one, or the file-store communicator)."""
        return getattr(self._get_channel(), "comm", None)

    def _setup_dup(self) -> Any:
        """A new MPI communicator of the group, duplicated over the setup channel (see
        :meth:`_setup_allgather`) with its deadline; None without MPI."""
        self._get_channel()
        dup = getattr(self._setup, "dup", None)
        return dup() if dup is not None else None

    def _close(self) -> None:
        for channel in (self._setup, self._channel):
            if channel is not None:
                channel.close()
        self._channel = self._setup = None
