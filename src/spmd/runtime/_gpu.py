"""The GPU side of a native group: its NCCL communicator and the custom all-reduce's buffers.

Set up at a group's first collective when JAX computes on a GPU, collectively over the group:
the ranks first agree on the all-reduce chain's settings (each rank picks a call's algorithm
from its own, so they must match), then load NCCL and create its communicator (the unique id
travels through the communicator's setup channel), then, when every rank of the group is on
one node with a GPU of its own, allocate, exchange and map the custom all-reduce's CUDA IPC
buffers and check that every rank reads every peer through them. A step that fails does not
fail the set-up: it leaves that path down, with the reason, for the chain to route around.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import SpmdError
from .._native_lib import native, native_cuda, require_native_cuda
from ._env import cuda_graphs, debug_checks, timeout_seconds

if TYPE_CHECKING:
    from ._communicator import Communicator

T = TypeVar("T")
CUSTOM_WORLD_SIZES = (2, 4, 6, 8)


@dataclass(frozen=True)
class GpuGroup:
    """What the GPU chain knows of a group: its size and which paths are up (and why not)."""

    size: int
    custom: bool
    reason: str = ""  # why the custom all-reduce is not up
    nccl: bool = True
    nccl_reason: str = ""  # why NCCL is not up

    def require_nccl(self, what: str, op: str | None = None) -> None:
        if not self.nccl:
            raise SpmdError(
                f"{what} needs NCCL, which did not start for this group: {self.nccl_reason}",
                op=op,
            )

    @property
    def transports(self) -> str:
        """``"custom+nccl"``, ``"nccl"`` or ``"custom"``: the paths that are up."""
        return "+".join(n for n, up in (("custom", self.custom), ("nccl", self.nccl)) if up)


def nccl_library(env: Mapping[str, str] = os.environ) -> str:
    """The NCCL library to load: ``SPMD_NCCL_LIBRARY``, the NCCL wheel's, or the system's."""
    if env.get("SPMD_NCCL_LIBRARY"):
        return env["SPMD_NCCL_LIBRARY"]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "lib" / "libnccl.so.2"
        if lib.exists():
            return str(lib)
    return "libnccl.so.2"


def settings_differ(ranks: list[int], settings: list[Any]) -> str:
    """Why a group's ranks cannot share the chain ("" if they have the same settings): each rank
    picks a call's algorithm from its own, and two ranks running different kernels on the same
    call pass each other's barriers with wrong results rather than failing."""
    if len(set(settings)) <= 1:
        return ""
    lines = "".join(f"\n  rank {r}: {c}" for r, c in zip(ranks, settings, strict=True))
    return (
        f"the ranks of the GPU group {ranks} have different all-reduce settings "
        "(SPMD_GPU_TRANSPORT, SPMD_QUANTIZE, SPMD_CUSTOM_AR_*, SPMD_QUANTIZE_MIN_KB or "
        f"spmd.ops.set_transport); every rank must use the same:{lines}"
    )


def bounded(step: Callable[[], T], seconds: float, what: str) -> T:
    """``step()`` on a helper thread, waited for at most ``seconds``; its result or its error.

    For calls that block until every rank joins and cannot be interrupted (ncclCommInitRank): a
    rank whose peer failed inside the call gets an error instead of waiting forever. The helper
    thread stays blocked; the error stops the job (spmd.init's abort hook)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = step()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="spmd-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise SpmdError(
            f"{what} did not finish within {seconds:g} s: a rank of the group failed inside it "
            "or never reached it (see the other ranks' errors; SPMD_TIMEOUT sets the limit)",
            rank=None,
        )
    if "error" in box:
        raise box["error"]
    return box.get("result")  # type: ignore[return-value]


def _device_ordinal(comm: Communicator) -> int:
    import jax

    device = jax.local_devices()[0]
    hw = getattr(device, "local_hardware_id", None)
    return int(hw) if hw is not None else int(comm.local_rank)


def set_up(comm: Communicator, gid: int, settings: Callable[[], Any]) -> GpuGroup:
    """Give group ``gid`` (the Communicator ``comm``) its GPU side; collective over ``comm``.
    ``settings()`` gives the chain's settings on this rank (their ``custom_max_bytes`` sizes the
    custom all-reduce's buffer)."""
    mod = require_native_cuda()
    # The handlers compare their calls on the group's CPU transport (prepared with the group)
    # and record them in the CPU module's flight recorder, with the GPU's own times of each
    # call under SPMD_TIMELINE.
    from ._recorder import timeline_dir

    # The sequence check counts every call only where no handler may be captured in a CUDA
    # graph (groups.h, SetGpuHooks).
    every = not cuda_graphs()
    mod.set_gpu_hooks(native.gpu_hooks(), debug_checks(), every, bool(timeline_dir()))
    cfgs, error = comm._try_agree(settings)
    if cfgs is None:
        raise SpmdError(error, rank=None)
    differ = settings_differ(list(comm.ranks), cfgs)
    if differ:
        raise SpmdError(differ)

    _, nccl_error = comm._try_agree(lambda: mod.nccl_load(nccl_library()))
    device = _device_ordinal(comm)
    _, failed = comm._try_agree(
        lambda: mod.group_create(
            gid, comm.rank, comm.size, list(comm.ranks), device, timeout_seconds()
        )
    )
    if failed:
        raise SpmdError(f"setting up the GPU group of ranks {list(comm.ranks)} failed: {failed}")
    if not nccl_error:
        uids, nccl_error = comm._try_agree(lambda: mod.nccl_unique_id() if comm.rank == 0 else None)
    if not nccl_error:
        assert uids is not None
        # Blocks until every rank joined, bounded so that a rank whose peer failed inside
        # NCCL's own set-up raises instead of waiting forever: at 0.8 SPMD_TIMEOUT, so that it
        # reaches the exchange below before the failed peer, waiting there since the failure,
        # gives up on it (that wait is bounded by SPMD_TIMEOUT). NCCL refuses two ranks on one
        # GPU: such a group keeps the custom all-reduce (the test mode of a single-GPU machine).
        what = f"rank {comm.world_rank}: creating the NCCL communicator of {list(comm.ranks)}"
        bound = 0.8 * timeout_seconds()
        _, nccl_error = comm._try_agree(
            lambda: bounded(lambda: mod.nccl_init(gid, uids[0]), bound, what)
        )
    reason = _custom_unavailable(comm)
    cap = cfgs[comm.rank].custom_max_bytes
    group = GpuGroup(comm.size, False, reason) if reason else _start_custom(comm, gid, mod, cap)
    if nccl_error:
        group = GpuGroup(group.size, group.custom, group.reason, False, nccl_error)
    return group


def _custom_unavailable(comm: Communicator) -> str:
    """Why the custom all-reduce cannot serve ``comm`` ("" if it may)."""
    mode = os.environ.get("SPMD_CUSTOM_AR", "1")
    if mode == "0":
        return "turned off (SPMD_CUSTOM_AR=0)"
    if comm.size not in CUSTOM_WORLD_SIZES:
        return (
            f"it takes {', '.join(map(str, CUSTOM_WORLD_SIZES))} ranks, the group has {comm.size}"
        )
    if len({comm.node_ids[r] for r in comm.ranks}) != 1:
        return "the group spans nodes (CUDA IPC works inside one node)"
    buses = comm._setup_allgather(require_native_cuda().device_info()[1])
    if len(set(buses)) != len(buses) and mode != "force":
        return (
            f"ranks share a GPU ({', '.join(buses)}): kernels of different processes do not run "
            "concurrently on one GPU without MPS, so the kernel's barrier would crawl; "
            "SPMD_CUSTOM_AR=force tries anyway"
        )
    return ""


def _start_custom(comm: Communicator, gid: int, mod: ModuleType, cap: int) -> GpuGroup:
    """Allocate, exchange and map the IPC buffers, then check that every rank reads every peer
    through the mapping (the driver can claim peer access that does not work)."""
    handles, error = comm._try_agree(lambda: mod.car_alloc(gid, cap))
    if handles is None:
        return GpuGroup(comm.size, False, f"allocating the IPC buffer failed: {error}")
    _, error = comm._try_agree(lambda: mod.car_open(gid, handles))
    if error:
        return GpuGroup(comm.size, False, f"mapping the peers' buffers failed: {error}")
    seed = comm._setup_allgather(int.from_bytes(os.urandom(4), "little"))[0]
    _, error = comm._try_agree(lambda: mod.car_write_check(gid, seed))
    if error:
        return GpuGroup(comm.size, False, f"the peer-access check failed: {error}")
    bad, error = comm._try_agree(lambda: mod.car_read_check(gid, seed))
    if bad is None:
        return GpuGroup(comm.size, False, f"the peer-access check failed: {error}")
    failures = [
        f"rank {reader} could not read rank(s) {missing}"
        for reader, missing in zip(comm.ranks, bad, strict=True)
        if missing
    ]
    if failures:
        return GpuGroup(comm.size, False, "the peer-access check failed: " + "; ".join(failures))
    return GpuGroup(comm.size, True, "")


def release(gid: int) -> None:
    """Free the GPU side of group ``gid`` (NCCL communicator, IPC buffers), if it has one."""
    mod = native_cuda()
    if mod is not None:
        mod.group_destroy(gid)


def describe() -> list[str]:
    """Lines for ``python -m spmd.info``: the GPU module and NCCL."""
    mod = native_cuda()
    if mod is None:
        return ["  GPU module: not built (no nvcc when spmd was installed)"]
    out = [f"  GPU module: built; handlers {', '.join(sorted(mod.cuda_handlers()))}"]
    lib = nccl_library()
    try:
        mod.nccl_load(lib)
        out.append(f"  NCCL: {mod.nccl_version()} ({lib})")
    except RuntimeError as e:
        out.append(f"  NCCL: not loadable ({e})")
    return out
