"""The runtime singleton: ``init``, ``finalize``, the world and the pool of sub-communicators."""

from __future__ import annotations

import os
import threading
from typing import Any

from .._errors import SpmdError, set_rank
from .._errors import this_rank as this_rank
from . import _groups, _recorder, _watch
from ._channel import (
    SETUP_WHAT,
    Channel,
    FileChannel,
    MpiChannel,
    SelfChannel,
    mpi_create_group,
)
from ._communicator import Communicator, Groups, resolve_rank_list
from ._device import bind_local_device, device_shortage, drain_device_work
from ._env import COMMUNICATOR_NAMES, CommunicatorName, LaunchInfo, detect, node_id
from ._env import stall_warn_seconds as _stall_warn_seconds
from ._env import timeout_seconds as _timeout_seconds
from ._failure import install_abort_hook, uninstall_abort_hook
from ._leftovers import unlink_launcher_topology, unlink_mpich_segments
from ._malloc import tune as _tune_malloc
from ._mpi import refusal_after_init, start_mpi
from ._store import FileStore, namespace_from_env


class _Runtime:
    """Everything ``init`` set up; ``finalize`` tears it down."""

    def __init__(self, launch: LaunchInfo, generation: int = 0) -> None:
        self.name: CommunicatorName = launch.communicator or "void"
        self.timeout = _timeout_seconds()
        self.mpi_world: Any = None
        self.mpi_data: Any = None
        self.mpi_setup: Any = None
        self.store: FileStore | None = None
        self.pool: dict[Groups, Communicator] = {}

        if launch.communicator == "mpi":
            MPI = start_mpi(launch, os.environ)  # MPI_Init happens here, never at import of spmd

            # A private duplicate: spmd's messages never match the application's.
            self.mpi_world = MPI.COMM_WORLD.Dup()
            rank, size = self.mpi_world.Get_rank(), self.mpi_world.Get_size()
            refusal = refusal_after_init(
                os.environ, launch.launcher, rank, size, MPI.Get_library_version()
            )
            if refusal:
                raise SpmdError(refusal, rank=launch.rank)
            bootstrap: Channel = MpiChannel(self.mpi_world, rank, range(size), self.timeout)
            # The world's data communicator, for spmd.ops (its collectives never match the
            # bootstrap's exchanges). Made here, where every rank takes part, so that a send
            # between two ranks never waits for a third that makes no call.
            self.mpi_data = self.mpi_world.Dup()
            self.mpi_setup = self.mpi_world.Dup()
            setup: Channel = MpiChannel(self.mpi_setup, rank, range(size), self.timeout, SETUP_WHAT)
        elif launch.communicator == "void" and launch.size and launch.size > 1:
            rank, size = launch.rank, launch.size
            assert launch.store_path is not None
            # Each init of the process gets a directory of its own: after finalize, a fast rank
            # may start again while rank 0 still removes the previous one.
            namespace = f"{namespace_from_env(os.environ)}-{generation}"
            self.store = FileStore(launch.store_path, namespace, rank, self.timeout)
            bootstrap = FileChannel(self.store, range(size), rank)
            setup = FileChannel(self.store, range(size), rank, "setup", SETUP_WHAT)
        else:
            rank, size = 0, 1
            bootstrap = setup = SelfChannel()

        self.rank, self.size = rank, size
        set_rank(rank)  # errors name this rank from here on, the exchanges' below included
        self.node_ids: tuple[str, ...] = tuple(bootstrap.allgather(node_id(os.environ, rank, size)))
        if self.mpi_world is not None:  # every rank has passed MPI_Init: see _leftovers
            unlink_mpich_segments()
            if self.node_ids.index(self.node_ids[rank]) == rank:  # one rank of each node
                unlink_launcher_topology()
        groups: Groups = (tuple(range(size)),)
        self.world = Communicator(
            groups=groups,
            group_id=0,
            world_rank=rank,
            node_ids=self.node_ids,
            backend=self.name,
            channel_factory=lambda _: (bootstrap, setup),
            data_comm=self.mpi_data,
        )
        self.pool[groups] = self.world

    def _channels_for(self, comm: Communicator) -> tuple[Channel, Channel]:
        """A sub-communicator's two channels: its own (``allgather_object``), and the one for
        spmd's preparation of the group (``Communicator._setup_allgather``). Made together, at
        the group's first exchange of either kind: collective over the group, with a deadline."""
        if comm.size == 1:
            return SelfChannel(), SelfChannel()
        if self.mpi_world is not None:
            sub = mpi_create_group(self.mpi_world, self.rank, comm.ranks, self.timeout)
            return (
                MpiChannel(sub, self.rank, comm.ranks, self.timeout),
                MpiChannel(sub.Dup(), self.rank, comm.ranks, self.timeout, SETUP_WHAT),
            )
        assert self.store is not None
        return (
            FileChannel(self.store, comm.ranks, self.rank, comm.groups),
            FileChannel(self.store, comm.ranks, self.rank, ("setup", comm.groups), SETUP_WHAT),
        )

    def communicator(self, rank_list: Any) -> Communicator:
        groups = resolve_rank_list(rank_list, self.size, self.rank)
        comm = self.pool.get(groups)
        if comm is None:
            group_id = next(i for i, g in enumerate(groups) if self.rank in g)
            comm = Communicator(
                groups=groups,
                group_id=group_id,
                world_rank=self.rank,
                node_ids=self.node_ids,
                backend=self.name,
                channel_factory=self._channels_for,
            )
            self.pool[groups] = comm
        return comm

    def close(self) -> None:
        drain_device_work()
        self.world.barrier()
        _watch.stop()
        _groups.release_all()
        for comm in self.pool.values():
            if comm is not self.world:
                comm._close()
        if self.mpi_world is not None:
            from mpi4py import MPI

            self.mpi_data.Free()
            self.mpi_setup.Free()
            self.mpi_world.Free()
            if not MPI.Is_finalized():
                MPI.Finalize()
        elif self.store is not None:
            # Everyone has passed the barrier and read its files; rank 0 removes the directory
            # once every rank says it is done reading.
            self.store.set(f"done.{self.rank}", b"")
            if self.rank == 0:
                self.store.wait(
                    [f"done.{r}" for r in range(self.size)], "finalize", list(range(self.size))
                )
                self.store.remove_all()
            else:
                self.store.close()


_lock = threading.RLock()
_runtime: _Runtime | None = None
_default_name: CommunicatorName | None = None
_mpi_finalized = False
_generation = 0  # how many runtimes this process has started


def requested_communicator(backend: str | None) -> CommunicatorName | None:
    name = backend or _default_name or os.environ.get("SPMD_COMMUNICATOR") or None
    if name is not None and name not in COMMUNICATOR_NAMES:
        raise SpmdError(
            f"unknown communicator {name!r}; expected one of {', '.join(COMMUNICATOR_NAMES)}",
            rank=None,
        )
    return name


def init(backend: str | None = None) -> Communicator:
    """Start spmd's runtime (idempotent) and return the world communicator.

    Args:
        backend: ``"mpi"``, ``"void"``, or None to detect the launcher: ``RANK``/``WORLD_SIZE``
            with ``SPMD_FILE_STORE_PATH`` (a torchrun-style launcher) -> ``"void"``, the
            variables of an MPI launcher (mpiexec, srun) -> ``"mpi"``, neither -> a world of one.
            :func:`set_default_communicator` and ``SPMD_COMMUNICATOR`` set the default.

    In a world of more than one process it also prepares the world's transports for
    collectives (a shared-memory segment per node, MPI communicators), so that the first
    collective, or tracing one on one rank alone, exchanges nothing. It also raises glibc's
    malloc thresholds, so that large XLA buffers are reused rather than mapped afresh on every
    call (``SPMD_MALLOC_TUNING=0`` to skip; see runtime/_malloc.py), binds this process to the
    GPU of its ``local_rank`` (GPU nodes only; :class:`spmd.SpmdError` on every rank if a node
    has fewer GPUs than processes, unless ``SPMD_BIND_DEVICE=0``) and, in a world of more than
    one process, makes an uncaught exception print a rank-prefixed traceback and stop the whole
    job (``SPMD_ABORT_ON_ERROR=0`` turns that off).

    Example (a script started without a launcher is a world of one; under ``spmd-run -n 4``
    each of the four processes gets its own rank)::

        >>> import spmd
        >>> comm = spmd.init()
        >>> comm.rank, comm.size, comm.backend
        (0, 1, 'void')
    """
    global _runtime, _generation
    with _lock:
        requested = requested_communicator(backend)
        if _runtime is not None:
            if requested is not None and backend is not None and requested != _runtime.name:
                raise SpmdError(
                    f"spmd is already initialized with the "
                    f"{_runtime.name!r} communicator, not {requested!r}; call spmd.finalize() "
                    "first"
                )
            return _runtime.world
        launch = detect(os.environ, requested)
        if launch.communicator == "mpi" and _mpi_finalized:
            raise SpmdError(
                "MPI was finalized by spmd.finalize() and cannot be "
                "initialized again in this process",
                rank=launch.rank,
            )
        _tune_malloc()
        _stall_warn_seconds()  # a bad SPMD_STALL_WARN fails here, not in the native layer
        runtime = _Runtime(launch, _generation)
        _generation += 1
        # Every rank learns of a node with too few GPUs, also those on nodes that have enough.
        shortage = device_shortage(runtime.world.local_size, runtime.rank)
        if runtime.size > 1:
            shortage = next((s for s in runtime.world._setup_allgather(shortage) if s), "")
        if shortage:
            raise SpmdError(shortage, rank=runtime.rank)
        bind_local_device(runtime.world.local_rank)
        if runtime.size > 1:
            install_abort_hook(runtime.rank)
        _runtime = runtime
        _recorder.start(runtime.rank)
        _groups.prepare_world(runtime.world)
        if runtime.size > 1:
            _groups.watch_peers()
            _watch.start(runtime.world)  # where the world spans nodes
        return runtime.world


def finalize() -> None:
    """Drain pending device work, wait for every rank, and shut the runtime down (MPI included).

    A no-op if spmd is not initialized. Every rank must call it.
    """
    global _runtime, _mpi_finalized
    with _lock:
        runtime = _runtime
        if runtime is None:
            return
        _runtime = None
        set_rank(None)
        uninstall_abort_hook()
        runtime.close()
        _mpi_finalized = _mpi_finalized or runtime.mpi_world is not None


def is_initialized() -> bool:
    return _runtime is not None


def set_default_communicator(name: str) -> None:
    """Choose the world communicator ``init`` creates: ``"mpi"`` or ``"void"`` (RAF's names).

    Call it before :func:`init`; once running, switching needs :func:`finalize` first.
    """
    global _default_name
    with _lock:
        if name not in COMMUNICATOR_NAMES:
            raise SpmdError(
                f"unknown communicator {name!r}; expected one of {', '.join(COMMUNICATOR_NAMES)}",
                rank=None,
            )
        if _runtime is not None and _runtime.name != name:
            raise SpmdError(
                f"spmd is running with the {_runtime.name!r} communicator; "
                f"call spmd.finalize() before switching to {name!r}"
            )
        _default_name = name


def get_communicator(rank_list: Any = None) -> Communicator:
    """The world communicator, or this rank's sub-communicator of ``rank_list``.

    ``rank_list`` is a list of disjoint lists of world ranks, as RAF's: ranks not listed form
    groups of their own (``[[0, 1, 2]]`` on 4 ranks is ``[[0, 1, 2], [3]]``). A rank's rank in
    its sub-communicator is its position in its list. Sub-communicators are created on first use
    and cached. Starts the runtime (:func:`init`) if needed. Raises :class:`spmd.SpmdError` for a
    rank listed twice, a rank out of range, or a malformed list.
    """
    with _lock:
        world = init()
        if rank_list is None:
            return world
        assert _runtime is not None
        return _runtime.communicator(rank_list)
