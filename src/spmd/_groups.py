"""The groups collectives run on: native registration, transports and backend choice.

A :class:`GroupRef` is the static description of a group that primitives carry as a parameter
(hashable, so jit caches on it). Registering it with the native layer happens once per group and
runtime, and is itself collective over the group: for the world at ``spmd.init``, for other
groups at their first collective (or the first traced). Its exchanges go over a channel of
their own (``Communicator._setup_allgather``), never the group's ``barrier``. It makes a
shared-memory segment for the ranks on one node, a private duplicate of the group's
MPI communicator, and for groups that span nodes the node-local segments plus a communicator of
node leaders (the hierarchical path).

Backends: ``shm`` (shared memory, a group on one node), ``mpi`` (the library mpi4py loaded) and
``hier`` (shared memory inside each node, MPI between node leaders). The choice is automatic:
``shm`` on one node, ``hier`` across nodes when some node holds several of the group's ranks,
``mpi`` otherwise. ``SPMD_BACKEND`` or :func:`set_backend` force one. Point-to-point operations
always use MPI.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ._errors import SpmdError
from ._native_lib import native
from .runtime import Communicator, get_communicator, this_rank
from .runtime._env import timeout_seconds
from .runtime._state import on_finalize, on_init, world_data_comm

BACKENDS = {"shm": 0, "mpi": 1, "hier": 2}
BACKEND_NAMES = ("auto", *BACKENDS)

# Shared-memory staging: bytes per rank and parity, and the largest allreduce done one-shot.
SHM_CHUNK = 1 << 20
ONE_SHOT_MAX = 64 << 10
# How a rank writes what it stages for the others in calls from 1 MiB (SPMD_SHM_STAGING; the
# native ShmGroup::Staging, docs/collectives.md).
SHM_STAGING = {"auto": 0, "cached": 1, "streamed": 2}


def shm_staging(env: Any = os.environ) -> str:
    """``SPMD_SHM_STAGING`` (a key of SHM_STAGING); :class:`SpmdError` for an unknown value."""
    name: str = env.get("SPMD_SHM_STAGING", "") or "auto"
    if name not in SHM_STAGING:
        raise SpmdError(
            f"{this_rank()}: SPMD_SHM_STAGING={name!r} is not a staging mode; expected one "
            f"of {', '.join(SHM_STAGING)}"
        )
    return name


# Roles of a collective in differentiation (GroupRef.role); equal to native/include/spmd/common.h.
FORWARD, JVP, BACKWARD = 0, 1, 2
ROLE_NAMES = ("", "jvp", "backward")
_ROLE_SHIFT = 56


@dataclass(frozen=True)
class GroupRef:
    """A group as a primitive sees it: its native id, this rank's rank and the world ranks.

    ``role`` says where the collective comes from: called as written (``FORWARD``), emitted by a
    JVP rule on tangents (``JVP``), or by a transpose rule (``BACKWARD``). It travels to the
    native layer with the group id and joins the signature the ranks compare, so that a rank in
    the backward pass of a collective the others did not differentiate gets a mismatch error
    instead of pairing its backward collective with another rank's next forward one.
    """

    gid: int
    rank: int
    ranks: tuple[int, ...]
    role: int = FORWARD

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def world_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def attr(self) -> int:
        """The custom call's ``group`` attribute: the id, and the role in the top byte."""
        return self.gid | (self.role << _ROLE_SHIFT)

    def jvp(self) -> GroupRef:
        """This group for a collective a JVP rule emits."""
        return replace(self, role=JVP)

    def backward(self) -> GroupRef:
        """This group for a collective a transpose rule emits."""
        return replace(self, role=BACKWARD)

    def __repr__(self) -> str:
        role = f", {ROLE_NAMES[self.role]}" if self.role else ""
        return f"ranks={list(self.ranks)}{role}"


@dataclass
class _Registered:
    comm: Communicator
    backend: str  # "" until chosen, on the group's first collective (see _complete)
    available: tuple[str, ...]
    mpi_comms: list[Any]  # the MPI communicators this module made (and frees)
    data: Any = None  # the MPI communicator of the group's data, if it has MPI
    attached: bool = False  # shared memory (and the hierarchical path) attached


_lock = threading.RLock()
_ids: dict[tuple[Any, int], int] = {}  # (rank_list groups, group id) -> native id, never reused
_next_id = itertools.count(1)
_registered: dict[int, _Registered] = {}
_gpu_checked: set[int] = set()  # groups whose GPU side was set up (or is not needed)
_forced: str | None = None
_handlers_registered = False


def _requested_backend() -> str:
    name = _forced or os.environ.get("SPMD_BACKEND", "auto") or "auto"
    if name not in BACKEND_NAMES:
        raise SpmdError(
            f"SPMD_BACKEND={name!r} is not a backend; expected one of {', '.join(BACKEND_NAMES)}"
        )
    return name


def _register_handlers() -> None:
    global _handlers_registered
    if _handlers_registered:
        return
    import jax

    for name, capsule in native().cpu_handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _handlers_registered = True


def _mpi_library() -> str:
    """The MPI shared library mpi4py loaded, from this process's memory map."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            base = os.path.basename(path)
            if base.startswith("libmpi") and ".so" in base and "cxx" not in base:
                return path
    raise SpmdError("cannot find the MPI library mpi4py loaded in this process's memory map")


_mpi_loaded = False


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
    native().mpi_load(_mpi_library(), constants)
    _mpi_loaded = True


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
    error = None
    staging = 0
    try:
        try:  # a bad value on any rank fails every rank, after the exchange
            staging = SHM_STAGING[shm_staging()]
        except SpmdError as e:
            error = str(e)
        if creator and error is None:
            assert mine is not None
            try:
                native().group_attach_shm(
                    gid, which, name, True, 0, len(mine), [comm.ranks[m] for m in mine],
                    SHM_CHUNK, staging,
                )  # fmt: skip
            except RuntimeError as e:
                error = str(e)
        names = comm._setup_allgather((name, error))
        errors = [e for _, e in names if e]
        if errors:
            raise SpmdError(f"rank {comm.world_rank}: {errors[0]}")
        if mine is not None and not creator:
            try:
                native().group_attach_shm(
                    gid, which, names[mine[0]][0], False, mine.index(me), len(mine),
                    [comm.ranks[m] for m in mine], SHM_CHUNK, staging,
                )  # fmt: skip
            except RuntimeError as e:
                raise SpmdError(
                    f"rank {comm.world_rank}: mapping the shared memory of group rank "
                    f"{mine[0]} failed: {e} (that rank may have failed or timed out earlier)"
                ) from None
        comm._setup_allgather(None)  # everyone mapped its segment: the names can go
    finally:
        if creator:  # POSIX shared memory lives in /dev/shm on Linux
            try:
                os.unlink(f"/dev/shm{name}")
            except OSError:
                pass


def _register(comm: Communicator, gid: int) -> _Registered:
    """Create the native group and attach MPI: all that point-to-point calls need. For the world
    this involves no other rank (its MPI communicator was made in spmd.init); for a sub-group,
    making its communicator is collective over the group."""
    native().group_create(
        gid, comm.rank, comm.size, list(comm.ranks), timeout_seconds(), ONE_SHOT_MAX
    )
    reg = _Registered(comm, "", (), [])
    try:
        if comm.mpi_comm() is not None:
            _load_mpi()
            from mpi4py import MPI

            data = world_data_comm() if comm is get_communicator() else None
            if data is None:  # a communicator of its own: never matches an exchange's messages
                data = comm._setup_dup()
                reg.mpi_comms.append(data)
            reg.data = data
            native().group_attach_mpi(
                gid, 0, MPI._handleof(data), comm.rank, comm.size, list(comm.ranks)
            )
    except BaseException:
        _release(gid, reg)
        raise
    return reg


def _release(gid: int, reg: _Registered) -> None:
    """Undo a registration: the native group and the MPI communicators made for it."""
    native().group_destroy(gid)
    for c in reg.mpi_comms:  # (only made where MPI runs)
        c.Free()
    reg.mpi_comms.clear()


def _complete(gid: int, reg: _Registered) -> None:
    """Attach shared memory (and the hierarchical path) and choose the backend: collective over
    the group, on its first call other than a point-to-point one. A backend that cannot be used
    raises here, and again on the next call (the transports stay attached)."""
    _attach(gid, reg)
    _apply_backend(gid, reg)


def _attach(gid: int, reg: _Registered) -> None:
    """Attach the group's shared memory (and the hierarchical path), once."""
    if not reg.attached:
        reg.available = _transports(gid, reg)
        reg.attached = True


def _transports(gid: int, reg: _Registered) -> tuple[str, ...]:
    comm = reg.comm
    nodes = _node_layout(comm)
    available = []
    if len(nodes) == 1:
        _attach_shm(gid, 0, comm, [list(range(comm.size))])
        available.append("shm")
    if reg.data is not None:
        from mpi4py import MPI

        available.append("mpi")
        if len(nodes) > 1 and any(len(m) > 1 for m in nodes.values()):
            local = nodes[comm.node_ids[comm.world_rank]]
            _attach_shm(gid, 1, comm, list(nodes.values()))  # every node's segment
            leader = local[0] == comm.rank
            leaders = reg.data.Split(0 if leader else MPI.UNDEFINED, comm.rank)
            if leader:
                reg.mpi_comms.append(leaders)
                leader_ranks = [comm.ranks[m[0]] for m in nodes.values()]
                native().group_attach_mpi(
                    gid, 1, MPI._handleof(leaders), leaders.Get_rank(), leaders.Get_size(),
                    leader_ranks,
                )  # fmt: skip
            available.append("hier")
    return tuple(available)


def _auto_backend(reg: _Registered) -> str:
    if "shm" in reg.available:
        return "shm"
    if "hier" in reg.available:
        return "hier"
    return "mpi"


def _apply_backend(gid: int, reg: _Registered) -> None:
    requested = _requested_backend()
    if not reg.available:
        raise SpmdError(
            f"rank {reg.comm.world_rank}: no backend can carry collectives for the group of "
            f"ranks {list(reg.comm.ranks)}: its ranks span nodes, so shared memory cannot "
            "reach them all, and this communicator has no MPI (the file store); launch with "
            "an MPI launcher (spmd-run, mpiexec) to use MPI between nodes"
        )
    backend = _auto_backend(reg) if requested == "auto" else requested
    if backend not in reg.available:
        raise SpmdError(
            f"rank {reg.comm.world_rank}: backend {backend!r} is not available for the group "
            f"of ranks {list(reg.comm.ranks)} (available: {', '.join(reg.available)}); "
            "'shm' needs every rank of the group on one node, 'mpi' needs an MPI launcher, "
            "'hier' needs MPI and a group spanning nodes"
        )
    native().group_set_transport(gid, BACKENDS[backend])
    reg.backend = backend


def _finalize() -> None:
    with _lock:
        for gid, reg in list(_registered.items()):
            _release(gid, reg)
        _registered.clear()
        _gpu_checked.clear()


def _registration(comm: Communicator) -> tuple[int, _Registered | None]:
    """The native id of ``comm``'s group and its registration (None for a group of one),
    registering it on first use (see :func:`_register`). Call with ``_lock`` held."""
    key = (comm.groups, comm.group_id)
    gid = _ids.get(key)
    if gid is None:
        gid = _ids[key] = next(_next_id)
    if comm.size == 1:
        return gid, None
    reg = _registered.get(gid)
    if reg is None:
        on_finalize(_finalize)
        reg = _registered[gid] = _register(comm, gid)
    return gid, reg


def shm_hop_ns(comm: Communicator | None = None) -> float | None:
    """How close the ranks of ``comm`` sit, as the shared-memory staging probe sees it
    (docs/collectives.md, Backends): the mean time in ns of one hop of a token passed 8 times
    round the ranks through the group's segment. Collective over the group (every rank calls
    it, like a collective); the value on the group's rank 0, NaN on the others; None for a
    group of one or without a shared-memory segment (ranks on several nodes)."""
    comm = comm or get_communicator()
    if comm.size == 1:
        return None
    ref = group_ref(comm)
    reg = _registered.get(ref.gid)
    if reg is None or "shm" not in reg.available:
        return None
    return float(native().group_shm_hop_ns(ref.gid))


def prepare_world(world: Communicator) -> None:
    """Register the world group and attach its transports, at ``spmd.init`` where every rank
    takes part: then the first collective on the world, tracing one, or asking for its backend
    exchanges nothing, and any rank may do it alone. The backend is chosen at the first call
    (:func:`_complete`), so that one not available raises there.

    A failure (no usable /dev/shm, no MPI library found) undoes the registration and does not
    fail ``init``: the first collective prepares the group again and raises it, as it did
    before the world was prepared at init, so that programs without collectives still run.
    (The GPU side of a group is still set up at its first collective: docs/gpu.md.)"""
    if world.size == 1:
        return
    with _lock:
        try:
            gid, reg = _registration(world)  # undoes itself if it fails
        except Exception:
            return
        assert reg is not None
        try:
            _attach(gid, reg)
        except Exception:
            del _registered[gid]
            _release(gid, reg)


def group_ref(comm: Communicator, p2p: bool = False) -> GroupRef:
    """The GroupRef of ``comm``, registering the group with the native layer on first use: in
    full (collective over the group), or with ``p2p`` only what point-to-point calls need."""
    with _lock:
        _register_handlers()
        gid, reg = _registration(comm)
        if reg is not None and not p2p and not reg.backend:
            _complete(gid, reg)
        if gid not in _gpu_checked:
            on_finalize(_finalize)
            _gpu_checked.add(gid)
            from .ops import _cuda

            # A group of one talks to nobody, unless NCCL is forced (to check it on one GPU).
            if _cuda.gpu_active() and (comm.size > 1 or _cuda.config().backend == "nccl"):
                _cuda.ensure_group(comm, gid)
        return GroupRef(gid, comm.rank, comm.ranks)


def communicator(rank_list: Any = None, group: Any = None, where: str = "") -> Communicator:
    """The Communicator that ``rank_list=`` or ``group=`` (a Communicator or a mesh axis name)
    designates; both None: the default communicator. ``where`` prefixes errors (the op)."""
    where = f"{this_rank()}: {where}: " if where else f"{this_rank()}: "
    if rank_list is not None and group is not None:
        raise SpmdError(f"{where}pass rank_list= or group=, not both")
    if group is None:
        return get_communicator(rank_list)
    if isinstance(group, Communicator):
        return group
    if isinstance(group, str | tuple):
        from .mesh import current_mesh

        mesh = current_mesh()
        if mesh is None:
            raise SpmdError(
                f"{where}group={group!r} names a mesh axis but no mesh is active; use it "
                "inside `with spmd.Mesh(...):`, or pass group=mesh.group(axis)"
            )
        return mesh.group(group)
    raise SpmdError(
        f"{where}group={group!r} is not a Communicator or a mesh axis name (str); pass e.g. "
        "group=spmd.get_communicator(...) or group='tp' inside `with spmd.Mesh(...):`"
    )


def resolve(rank_list: Any = None, group: Any = None, p2p: bool = False) -> GroupRef:
    """The group of an op call from its ``rank_list=`` or ``group=`` argument (``p2p``: for a
    point-to-point call, see :func:`group_ref`)."""
    return group_ref(communicator(rank_list, group), p2p)


def set_backend(name: str) -> None:
    """Force how collectives move data.

    On CPU: ``"shm"``, ``"mpi"`` or ``"hier"``; applies to every group, including those already
    in use (no recompilation needed), and raises :class:`spmd.SpmdError` if a group in use
    cannot use it. ``SPMD_BACKEND`` sets the default. The switch takes effect at once in this
    process: call it on every rank when no collective is in flight (after blocking on the
    results of earlier calls, ``jax.block_until_ready``), or a rank whose dispatched work has
    not reached its collective yet would use the new transport while a peer uses the old one.

    On GPU: ``"custom"`` (the CUDA IPC all-reduce wherever it can take the call) or ``"nccl"``;
    applies to programs compiled afterwards. ``SPMD_GPU_BACKEND`` sets the default.

    ``"auto"`` returns both to the automatic choice.
    """
    global _forced
    from .ops import _cuda

    if name in ("custom", "nccl"):
        _cuda.set_gpu_backend(name)
        return
    if name not in BACKEND_NAMES:
        raise SpmdError(
            f"backend {name!r} is unknown; expected one of {', '.join(BACKEND_NAMES)} (CPU) or "
            "custom, nccl (GPU)"
        )
    if name == "auto":
        _cuda.set_gpu_backend("auto")
    with _lock:
        previous = _forced
        _forced = name
        try:
            for gid, reg in _registered.items():
                if reg.backend:  # the others choose on their first collective
                    _apply_backend(gid, reg)
        except SpmdError:
            _forced = previous
            for gid, reg in _registered.items():
                if reg.backend:
                    _apply_backend(gid, reg)
            raise


def get_backend(rank_list: Any = None, group: Any = None) -> str:
    """The backend the group's collectives use (``"self"`` for a group of one).

    On GPU: ``"custom+nccl"`` (the all-reduce chain has the custom all-reduce, the rest is
    NCCL), ``"nccl"``, or ``"custom"`` (NCCL did not start: only the all-reduce works).
    """
    from .ops import _cuda

    ref = resolve(rank_list, group)
    gpu = _cuda.backend_name(ref.gid) if _cuda.gpu_active() else None
    if gpu is not None:
        return gpu
    if ref.size == 1:
        return "self"
    with _lock:
        return _registered[ref.gid].backend


on_init(prepare_world)
