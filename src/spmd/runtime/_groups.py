"""Native groups: a communicator's presence in the native layer, and its transports.

A group is registered with the native layer (``spmd._native``) once per runtime, under an id
that compiled programs carry. Registration is collective over the group: for the world at
``spmd.init``, for other groups at their first collective (or the first traced one). Its
exchanges go over the communicator's setup channel (``Communicator._setup_allgather``), never
the channel of ``barrier``/``allgather_object``. It makes:

- an MPI communicator of the group's own (a duplicate: its messages never match another's),
  all that point-to-point calls need (``p2p``);
- then, at the first collective other than a point-to-point one, a shared-memory segment for a
  group on one node, and for a group spanning nodes with several ranks on some node the
  node-local segments plus, where every node holds as many ranks, a *rail* per local index
  (one rank of each node), else a communicator of node leaders: the hierarchical path;
- and, where JAX computes on a GPU, the group's GPU side (:mod:`._gpu`).

Transports (how a CPU collective moves bytes): ``shm`` (shared memory, a group on one node),
``mpi`` (the library mpi4py loaded) and ``hier`` (shared memory inside each node, MPI between
nodes over the rails, or between node leaders). The choice is automatic: ``shm`` on one node,
``hier`` across nodes when some node holds several of the group's ranks, ``mpi`` otherwise.
``SPMD_TRANSPORT`` or :func:`set_transport` force one. Point-to-point operations always use MPI.
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import itertools
import os
import signal
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._errors import SpmdError
from .._native_lib import native, tables
from . import _gpu, _recorder
from ._affinity import recorded_cpus
from ._device import gpu_active
from ._env import mpi_large_count, mpi_max_count, mpi_progress, timeout_seconds

if TYPE_CHECKING:
    from ._communicator import Communicator

# Shared-memory staging: bytes per rank and parity, and the largest allreduce done one-shot.
SHM_CHUNK = 1 << 20
ONE_SHOT_MAX = 64 << 10

NO_TRANSPORT = (
    "no transport can carry collectives for the group of ranks {ranks}: its ranks span nodes, "
    "so shared memory cannot reach them all, and this communicator has no MPI (the file "
    "store); launch with an MPI launcher (spmd-run, mpiexec) to use MPI between nodes"
)
UNAVAILABLE = (
    "transport {name!r} is not available for the group of ranks {ranks} (available: "
    "{available}); 'shm' needs every rank of the group on one node, 'mpi' needs an MPI "
    "launcher, 'hier' needs MPI and a group spanning nodes"
)


def shm_staging(env: Mapping[str, str] = os.environ) -> str:
    """``SPMD_SHM_STAGING`` (a staging mode of the native layer); :class:`SpmdError` for an
    unknown value."""
    name: str = env.get("SPMD_SHM_STAGING", "") or "auto"
    if name not in tables()["staging"]:
        raise SpmdError(
            f"SPMD_SHM_STAGING={name!r} is not a staging mode; expected one of "
            f"{', '.join(tables()['staging'])}"
        )
    return name


def transport_names() -> tuple[str, ...]:
    """The CPU transports one may ask for: ``"auto"`` and the native layer's."""
    return ("auto", *tables()["transports"])


@dataclass
class NativeGroup:
    """A communicator's group as the native layer holds it.

    ``gid`` is the id compiled programs carry; ``transport`` the CPU transport its collectives
    use (``""`` until chosen, at the first collective; ``"self"`` for a group of one);
    ``available`` the transports attached; ``gpu`` the GPU side (None off the GPU).
    """

    gid: int
    size: int
    transport: str = ""
    available: tuple[str, ...] = ()
    gpu: _gpu.GpuGroup | None = None
    attached: bool = False  # shared memory (and the hierarchical path) attached
    gpu_checked: bool = False  # the GPU side was set up, or is not needed
    comm: Any = None
    data: Any = None  # the MPI communicator of the group's data, if it has MPI
    mpi_comms: list[Any] = field(default_factory=list)  # the MPI communicators made here


_lock = threading.RLock()
_ids: dict[tuple[Any, int], int] = {}  # (rank_list groups, group id) -> native id, never reused
_next_id = itertools.count(1)
_groups: dict[int, NativeGroup] = {}
_forced: str | None = None


def requested_transport(env: Mapping[str, str] = os.environ) -> str:
    """The CPU transport asked for: :func:`set_transport`'s, else ``SPMD_TRANSPORT``'s."""
    name = _forced or env.get("SPMD_TRANSPORT") or ""
    if not name and env.get("SPMD_BACKEND"):
        warnings.warn("SPMD_BACKEND is now SPMD_TRANSPORT", DeprecationWarning, stacklevel=2)
        name = env["SPMD_BACKEND"]
    name = name or "auto"
    if name not in transport_names():
        raise SpmdError(
            f"SPMD_TRANSPORT={name!r} is not a transport; expected one of "
            f"{', '.join(transport_names())}",
            rank=None,
        )
    return name


def _mpi_library() -> str:
    """The MPI shared library mpi4py loaded, from this process's memory map."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            base = os.path.basename(path)
            if base.startswith("libmpi") and ".so" in base and "cxx" not in base:
                return path
    raise SpmdError("cannot find the MPI library mpi4py loaded in this process's memory map")


_mpi_loaded: str | None = None  # the calls chosen at load


def mpi_calls(library: str | None = None) -> str:
    """How MPI calls carry counts in this process: ``"large-count"`` (the MPI-4 ``MPI_*_c``
    functions) where the MPI library mpi4py loaded has them and ``SPMD_MPI_LARGE_COUNT`` is not
    ``0``, else ``"classic"`` (int counts; calls above ``SPMD_MPI_MAX_COUNT`` elements are
    split). Chosen once, when the first group attaches MPI; needs mpi4py's MPI module imported."""
    if _mpi_loaded is not None:
        return _mpi_loaded
    if not mpi_large_count():
        return "classic"
    return "large-count" if native.mpi_has_large_count(library or _mpi_library()) else "classic"


def _load_mpi() -> None:
    global _mpi_loaded
    if _mpi_loaded:
        return
    from mpi4py import MPI

    h = MPI._handleof
    constants = tuple(
        h(x)
        for x in (
            MPI.BYTE, MPI.C_BOOL, MPI.INT8_T, MPI.UINT8_T, MPI.INT32_T, MPI.INT64_T,
            MPI.FLOAT, MPI.DOUBLE, MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN, MPI.LAND, MPI.LOR,
        )
    )  # fmt: skip
    large = native.mpi_load(_mpi_library(), constants, mpi_large_count(), mpi_max_count())
    # The thread calls MPI beside the rank's own calls: only where MPI allows that.
    native.mpi_send_progress(mpi_progress() and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    _mpi_loaded = "large-count" if large else "classic"


def _node_layout(comm: Communicator) -> dict[str, list[int]]:
    """Group ranks per node, nodes in order of their first group rank."""
    nodes: dict[str, list[int]] = {}
    for group_rank, world_rank in enumerate(comm.ranks):
        nodes.setdefault(comm.node_ids[world_rank], []).append(group_rank)
    return nodes


def _attach_shm(gid: int, which: int, comm: Communicator, parts: list[list[int]]) -> None:
    """Collective over ``comm``: one segment for each list of group ranks in ``parts`` (the whole
    group, or each node's ranks), made by its first rank and mapped by the others, in two
    exchanges whatever the number of parts. The creators unlink the names once every rank has
    mapped its segment, or when the exchange fails: a segment never outlives the processes."""
    me = comm.rank
    mine = next((p for p in parts if me in p), None)
    creator = mine is not None and mine[0] == me
    name = f"/spmd-{os.getpid()}-{uuid.uuid4().hex[:12]}" if creator else None

    def create() -> str | None:
        staging = tables()["staging"][shm_staging()]  # a bad value fails every rank alike
        if creator:
            assert mine is not None and name is not None
            ranks = [comm.ranks[m] for m in mine]
            try:
                native.group_attach_shm(
                    gid, which, name, True, 0, len(mine), ranks, SHM_CHUNK, staging
                )
            except RuntimeError as e:
                raise SpmdError(str(e)) from None
        return name

    def attach(names: list[str | None]) -> None:
        if mine is not None and not creator:
            segment = names[mine[0]]
            assert segment is not None  # the creator, group rank mine[0], always names one
            try:
                native.group_attach_shm(
                    gid, which, segment, False, mine.index(me), len(mine),
                    [comm.ranks[m] for m in mine], SHM_CHUNK, tables()["staging"][shm_staging()],
                )  # fmt: skip
            except RuntimeError as e:
                raise SpmdError(
                    f"mapping the shared memory of group rank {mine[0]} failed: {e}"
                ) from None

    try:
        names = comm.agree(create, setup=True)
        # Every rank learns whether every rank mapped its segment (then the names can go): a
        # rank whose mapping failed must not leave while the others still wait in this
        # exchange, or its next set-up exchange would pair with theirs.
        comm.agree(lambda: attach(names), setup=True)
    finally:
        if creator:  # POSIX shared memory lives in /dev/shm on Linux
            try:
                os.unlink(f"/dev/shm{name}")
            except OSError:
                pass


def _register(comm: Communicator, ng: NativeGroup) -> None:
    """Create the native group and attach MPI: all that point-to-point calls need. For the world
    this involves no other rank (its MPI communicator was made in spmd.init); for a sub-group,
    making its communicator is collective over the group."""
    native.group_create(
        ng.gid, comm.rank, comm.size, list(comm.ranks), timeout_seconds(), ONE_SHOT_MAX
    )
    _recorder.note_group(ng.gid, list(comm.ranks))
    try:
        if comm.mpi_comm() is not None:
            _load_mpi()
            from mpi4py import MPI

            data = comm._data_comm
            if data is None:  # a communicator of its own: never matches an exchange's messages
                data = comm._setup_dup()
                ng.mpi_comms.append(data)
            ng.data = data
            native.group_attach_mpi(
                ng.gid, 0, MPI._handleof(data), comm.rank, comm.size, list(comm.ranks)
            )
    except BaseException:
        _release(ng)
        raise


def _release(ng: NativeGroup) -> None:
    """Undo a registration: the native group, its GPU side and the MPI communicators made."""
    native.group_destroy(ng.gid)
    if ng.gpu_checked and ng.gpu is not None:
        _gpu.release(ng.gid)
    for c in ng.mpi_comms:  # (only made where MPI runs)
        c.Free()
    ng.mpi_comms.clear()


def _attach(ng: NativeGroup) -> None:
    """Attach the group's shared memory (and the hierarchical path), once: collective."""
    if ng.attached:
        return
    comm = ng.comm
    nodes = _node_layout(comm)
    available = []
    if len(nodes) == 1:
        _attach_shm(ng.gid, 0, comm, [list(range(comm.size))])
        available.append("shm")
        if len(comm.groups) == 1 and comm.size == len(comm.node_ids):
            native.board_use(ng.gid)  # the world's segment: the wait board (board.h)
    if ng.data is not None:
        from mpi4py import MPI

        available.append("mpi")
        if len(nodes) > 1 and any(len(m) > 1 for m in nodes.values()):
            parts = list(nodes.values())
            local = nodes[comm.node_ids[comm.world_rank]]
            _attach_shm(ng.gid, 1, comm, parts)  # every node's segment
            if len({len(m) for m in parts}) == 1:
                # Rails: the ranks with one local index, ranked by node (the two-dimensional
                # algorithms of the hierarchical transport, native/cpu/transport.h).
                index = local.index(comm.rank)
                rail = ng.data.Split(index, parts.index(local))
                ng.mpi_comms.append(rail)
                native.group_attach_mpi(
                    ng.gid, 2, MPI._handleof(rail), rail.Get_rank(), rail.Get_size(),
                    [comm.ranks[m[index]] for m in parts],
                )  # fmt: skip
            else:  # nodes of unequal size: allreduce through the node leaders
                leader = local[0] == comm.rank
                leaders = ng.data.Split(0 if leader else MPI.UNDEFINED, comm.rank)
                if leader:
                    ng.mpi_comms.append(leaders)
                    native.group_attach_mpi(
                        ng.gid, 1, MPI._handleof(leaders), leaders.Get_rank(),
                        leaders.Get_size(), [comm.ranks[m[0]] for m in parts],
                    )  # fmt: skip
            node_of = [0] * comm.size
            for n, members in enumerate(parts):
                for m in members:
                    node_of[m] = n
            native.group_set_nodes(ng.gid, node_of)
            available.append("hier")
    ng.available = tuple(available)
    ng.attached = True


def _choose(ng: NativeGroup) -> None:
    """Set the group's transport from the one asked for (a clear error if it is not attached)."""
    requested = requested_transport()
    ranks = list(ng.comm.ranks)
    if not ng.available:
        raise SpmdError(NO_TRANSPORT.format(ranks=ranks))
    name = requested
    if requested == "auto":
        name = next(t for t in ("shm", "hier", "mpi") if t in ng.available)
    if name not in ng.available:
        available = ", ".join(ng.available)
        raise SpmdError(UNAVAILABLE.format(name=name, ranks=ranks, available=available))
    native.group_set_transport(ng.gid, tables()["transports"][name])
    ng.transport = name


def native_group(
    comm: Communicator, *, p2p: bool = False, gpu_settings: Callable[[], Any] | None = None
) -> NativeGroup:
    """``comm``'s native group, registered on first use (collective over the group): in full,
    or with ``p2p`` only what point-to-point calls need. Where JAX computes on a GPU, the first
    call also sets the group's GPU side up, with ``gpu_settings()`` as the chain's settings."""
    with _lock:
        key = (comm.groups, comm.group_id)
        gid = _ids.get(key)
        if gid is None:
            gid = _ids[key] = next(_next_id)
        ng = _groups.get(gid)
        if ng is None:
            ng = NativeGroup(gid, comm.size, comm=comm)
            if comm.size == 1:
                ng.transport = "self"
            else:
                _register(comm, ng)
            _groups[gid] = ng
        if not p2p and not ng.transport:
            _attach(ng)
            _choose(ng)
        if not ng.gpu_checked and gpu_settings is not None:
            ng.gpu_checked = True
            # A group of one talks to nobody, unless NCCL is forced (to check it on one GPU).
            if gpu_active() and (comm.size > 1 or gpu_settings().transport == "nccl"):
                ng.gpu = _gpu.set_up(comm, gid, gpu_settings)
        return ng


def find(gid: int) -> NativeGroup | None:
    """The native group of id ``gid`` (None if none: unknown, or released by finalize)."""
    with _lock:
        return _groups.get(gid)


def _oversubscribed(world: Communicator) -> bool:
    """Whether this machine runs more of the job's ranks than the job has cores. Under
    ``spmd-run`` (which records the job's cores) every rank runs on this machine, also on
    simulated nodes or test hosts; elsewhere, the node's ranks against its cores."""
    recorded = recorded_cpus(os.environ)
    if recorded is not None:
        return world.size > len(recorded)
    return world.local_size > (os.cpu_count() or 1)


def prepare_world(world: Communicator) -> None:
    """Register the world group and attach its transports, at ``spmd.init`` where every rank
    takes part: then the first collective on the world, tracing one, or asking for its
    transport exchanges nothing, and any rank may do it alone. The transport is chosen at the
    first call, so that one not available raises there.

    A failure (no usable /dev/shm, no MPI library found) undoes the registration and does not
    fail ``init``: the first collective prepares the group again and raises it, so that programs
    without collectives still run. (The GPU side is set up at the first collective.)"""
    if world.size == 1:
        return
    # More ranks than cores on this machine: MPI waits yield their core after every poll.
    native.mpi_oversubscribed(_oversubscribed(world))
    with _lock:
        try:
            ng = native_group(world, p2p=True)
        except Exception:
            return
        try:
            _attach(ng)
        except Exception:
            del _groups[ng.gid]
            _release(ng)


def release_all() -> None:
    """Release every native group (``spmd.finalize``)."""
    with _lock:
        for ng in list(_groups.values()):
            if ng.size > 1:
                _release(ng)
            elif ng.gpu is not None:
                _gpu.release(ng.gid)
        _groups.clear()


def set_cpu_transport(name: str) -> None:
    """Force the CPU transport of every group, those in use included (no recompilation: the
    native group switches); ``"auto"`` forces the automatic choice, whatever ``SPMD_TRANSPORT``
    says. Raises, changing nothing, if a group in use cannot use it. (The public
    ``spmd.ops.set_transport`` also takes the GPU's.)"""
    global _forced
    if name not in transport_names():
        raise SpmdError(
            f"CPU transport {name!r} is unknown; expected one of {', '.join(transport_names())}",
            rank=None,
        )
    with _lock:
        previous = _forced
        _forced = name  # "auto" too: it overrides SPMD_TRANSPORT
        chosen = [ng for ng in _groups.values() if ng.transport not in ("", "self")]
        try:
            for ng in chosen:
                _choose(ng)
        except SpmdError:
            _forced = previous
            for ng in chosen:
                _choose(ng)
            raise


def shm_hop_ns(comm: Communicator) -> float | None:
    """The shared-memory staging probe (docs/collectives.md, Transports): the mean time in ns
    of one hop of a token passed 8 times round the group's ranks through its segment.
    Collective over the group; the value on the group's rank 0, NaN on the others; None for a
    group of one or without a shared-memory segment (ranks on several nodes)."""
    ng = native_group(comm)
    if ng.size == 1 or "shm" not in ng.available:
        return None
    return float(native.group_shm_hop_ns(ng.gid))


_leaving_registered = False


def _leave() -> None:
    """At exit: wait for the computations this process dispatched (jit runs asynchronously, so a
    rank whose script ends right after its last step, printing nothing, still has collectives
    in flight that its peers pair with), then mark its ranks as leaving."""
    try:
        import jax

        for array in jax.live_arrays():  # type: ignore[no-untyped-call]
            array.block_until_ready()
    except Exception:  # a failed computation: its error is raised where it is used
        pass
    native.shm_mark_leaving()  # the peer watch's answers say so too


def watch_peers() -> None:
    """What lets this rank's peers find it when they wait for it (once per process):

    - at interpreter exit, once what this process dispatched has finished (:func:`_leave`), its
      ranks of every shared-memory group are marked as leaving, so that a peer still waiting
      for one of them in a collective fails at once, naming it, instead of waiting for
      SPMD_TIMEOUT (a rank that made fewer collectives, or called sys.exit). Python's exit
      handlers run last registered first: this one runs before mpi4py finalizes MPI, and
      before JAX's own;
    - when nothing else handles SIGUSR1, faulthandler prints this process's Python stack on it,
      which a peer reporting a stall (SPMD_STALL_WARN) asks for.
    """
    global _leaving_registered
    if _leaving_registered:
        return
    _leaving_registered = True
    atexit.register(_leave)
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and sys.stderr is not None:
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            return  # no usable file descriptor (a notebook's stream): no stack on request
        native.shm_dumps_stack(True)
