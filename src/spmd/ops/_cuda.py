"""The GPU side of the collectives: the CUDA handlers, GPU groups, and the all-reduce backend chain.

Every collective has a CUDA lowering next to its CPU one (``_core.register_lowering``): the same
operands, results and attributes, handled by ``spmd._native_cuda`` (built where nvcc is found)
on the stream XLA gives the handler. A GPU group holds an NCCL communicator (its unique id
travels through spmd's bootstrap: the Communicator's setup channel, ``_setup_allgather``) and,
when all its ranks share one node and each has a GPU of its own, the custom all-reduce's CUDA
IPC buffers.

The all-reduce backend chain, as AITER's, chosen per leaf when a program is compiled, from the
leaf's size and dtype and the group's topology (:func:`select_allreduce`):

1. quantized (opt-in: ``quantize=`` or ``SPMD_QUANTIZE``), when the custom all-reduce is up and
   the size is within ``[quantize_min(world), custom_max_bytes]``;
2. the custom all-reduce, for float32/float16/bfloat16 sums of a multiple of 16 bytes up to
   ``custom_max_bytes``: one-shot up to ``one_shot_max(world)``, two-shot above;
3. NCCL for everything else.

``SPMD_GPU_BACKEND=custom|nccl`` (or ``spmd.ops.set_backend``) forces a path; the choice is
fixed when a program is compiled. ``python -m spmd.info`` prints the chain and its thresholds.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import SpmdError
from .._native_lib import NATIVE_ABI_VERSION

# Codes shared with native/cuda (codec.h, custom_ar.h).
CODECS = {"fp8": 1, "int8": 2, "int4": 3}
ALGOS = {"nccl": 0, "one_shot": 1, "two_shot": 2, "quantized": 3}
CUSTOM_DTYPES = ("float32", "float16", "bfloat16")
CUSTOM_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
CUSTOM_WORLD_SIZES = (2, 4, 6, 8)
GPU_BACKENDS = ("auto", "custom", "nccl")
FUSED_MAX_HIDDEN = 16384

# Defaults by world size, to be tuned on hardware (docs/gpu.md).
_ONE_SHOT_MAX = {2: 1 << 20, 4: 512 << 10}
_ONE_SHOT_MAX_OTHER = 256 << 10
_QUANTIZE_MIN = {2: 1 << 20, 4: 2 << 20, 6: 4 << 20, 8: 4 << 20}


# -- the chain (pure functions: tested without a GPU) ----------------------------------------


def _env_number(env: Mapping[str, str], name: str, scale: int) -> int | None:
    value = env.get(name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise SpmdError(f"{name}={value!r} is not a number") from None
    if number < 0:
        raise SpmdError(f"{name}={value!r} must not be negative")
    return int(number * scale)


def check_quantize(value: Any, where: str = "") -> str | None:
    if value in (None, "", "none", "None"):
        return None
    if value not in CODECS:
        raise SpmdError(
            f"{where}quantize={value!r} is not a codec; expected one of {', '.join(CODECS)} or None"
        )
    return str(value)


@dataclass(frozen=True)
class ChainConfig:
    """The chain's switches and thresholds (bytes)."""

    backend: str = "auto"
    quantize: str | None = None
    custom_max_bytes: int = 64 << 20
    one_shot_max_bytes: int | None = None
    quantize_min_bytes: int | None = None

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] = os.environ, forced: str | None = None
    ) -> ChainConfig:
        backend = forced or env.get("SPMD_GPU_BACKEND") or "auto"
        if backend not in GPU_BACKENDS:
            raise SpmdError(
                f"SPMD_GPU_BACKEND={backend!r} is not a GPU backend; expected one of "
                f"{', '.join(GPU_BACKENDS)}"
            )
        custom_max = _env_number(env, "SPMD_CUSTOM_AR_MAX_MB", 1 << 20)
        return cls(
            backend=backend,
            quantize=check_quantize(env.get("SPMD_QUANTIZE"), "SPMD_QUANTIZE: "),
            custom_max_bytes=(64 << 20) if custom_max is None else custom_max,
            one_shot_max_bytes=_env_number(env, "SPMD_CUSTOM_AR_ONE_SHOT_KB", 1 << 10),
            quantize_min_bytes=_env_number(env, "SPMD_QUANTIZE_MIN_KB", 1 << 10),
        )

    def one_shot_max(self, world: int) -> int:
        if self.one_shot_max_bytes is not None:
            return self.one_shot_max_bytes
        return _ONE_SHOT_MAX.get(world, _ONE_SHOT_MAX_OTHER)

    def quantize_min(self, world: int) -> int:
        if self.quantize_min_bytes is not None:
            return self.quantize_min_bytes
        return _QUANTIZE_MIN.get(world, max(_QUANTIZE_MIN.values()))


@dataclass(frozen=True)
class GpuGroup:
    """What the chain knows of a group: its size and which paths are up (and why not)."""

    size: int
    custom: bool
    reason: str = ""  # why the custom all-reduce is not up
    nccl: bool = True
    nccl_reason: str = ""  # why NCCL is not up

    def require_nccl(self, what: str) -> None:
        if not self.nccl:
            raise SpmdError(
                f"{what} needs NCCL, which did not start for this group: {self.nccl_reason}"
            )


def _codec_bytes(nbytes: int, itemsize: int, codec: str) -> int:
    """Bytes one rank's region holds for a quantized leaf: payloads (16-aligned) and scales."""
    blocks = -(-(nbytes // itemsize) // 32)
    payload = blocks * (16 if codec == "int4" else 32)
    return -(-payload // 16) * 16 + 4 * blocks


def select_allreduce(
    nbytes: int,
    dtype: Any,
    op: str,
    group: GpuGroup,
    cfg: ChainConfig,
    quantize: str | None = None,
) -> str:
    """The path of one all-reduce leaf: ``"quantized"``, ``"one_shot"``, ``"two_shot"`` or
    ``"nccl"``. A pure function of its arguments, so every rank chooses the same."""
    name = np.dtype(dtype).name
    if nbytes == 0:
        return "nccl"  # nothing moves; the handler skips it
    if cfg.backend == "nccl":
        group.require_nccl("allreduce (SPMD_GPU_BACKEND=nccl)")
        return "nccl"
    usable = group.custom and op == "sum" and name in CUSTOM_DTYPES
    if cfg.backend == "custom" and not group.custom:
        raise SpmdError(
            f"SPMD_GPU_BACKEND=custom, but the custom all-reduce is not available for this "
            f"group: {group.reason}"
        )
    codec = quantize or cfg.quantize
    if (
        codec is not None
        and cfg.backend == "auto"
        and usable
        and cfg.quantize_min(group.size) <= nbytes
        and _codec_bytes(nbytes, np.dtype(dtype).itemsize, codec) <= cfg.custom_max_bytes
    ):
        return "quantized"
    if usable and nbytes % 16 == 0 and nbytes <= cfg.custom_max_bytes:
        return "one_shot" if nbytes <= cfg.one_shot_max(group.size) else "two_shot"
    group.require_nccl(f"allreduce of {nbytes} bytes of {name} (op={op})")
    return "nccl"


def padded_count(count: int, dtype: Any) -> int:
    """Elements of a leaf inside a packed buffer: rounded up to 16 bytes, the kernels' unit."""
    per = 16 // int(np.dtype(dtype).itemsize)
    return -(-count // per) * per


def pack_allreduce(
    leaves: Sequence[tuple[int, Any]],
    op: str,
    group: GpuGroup,
    cfg: ChainConfig,
    quantize: str | None = None,
) -> list[list[int]]:
    """Which leaves of one fused all-reduce travel together in one buffer (``leaves``: each
    leaf's element count and dtype): groups of indices, in leaf order. A pure function of its
    arguments, so every rank packs the same.

    A leaf the chain would send one-shot (latency-bound) costs a launch and a barrier of its own;
    packed with the other such leaves of its dtype it shares them. A leaf whose size is not a
    multiple of 16 bytes is padded to one, so the custom all-reduce takes it instead of NCCL. A
    pack stays within the one-shot range (what ``select_allreduce`` sends one-shot), so a leaf
    the custom kernel took alone gets the same bits packed: the sum runs element by element in
    rank order. (A padded leaf gets that rank-order sum instead of NCCL's order.)
    Packs of one leaf are kept only where padding is what lets the custom kernel take it.
    """
    if cfg.backend == "nccl" or not group.custom or op != "sum":
        return []

    def one_shot(nbytes: int, dtype: Any) -> bool:
        # Within the buffer first: select_allreduce raises for a size only NCCL takes where
        # NCCL is down, and a pack too large is simply not made.
        return (
            nbytes <= cfg.custom_max_bytes
            and select_allreduce(nbytes, dtype, op, group, cfg, quantize) == "one_shot"
        )

    by_dtype: dict[str, list[int]] = {}
    for i, (count, dtype) in enumerate(leaves):
        name = np.dtype(dtype).name
        nbytes = padded_count(count, dtype) * np.dtype(dtype).itemsize
        if name in CUSTOM_DTYPES and count > 0 and one_shot(nbytes, dtype):
            by_dtype.setdefault(name, []).append(i)
    packs: list[list[int]] = []
    for name, members in by_dtype.items():
        item = np.dtype(name).itemsize
        chunk: list[int] = []
        total = 0
        for i in members:
            nbytes = padded_count(leaves[i][0], name) * item
            if chunk and not one_shot(total + nbytes, name):
                packs.append(chunk)
                chunk, total = [], 0
            chunk.append(i)
            total += nbytes
        packs.append(chunk)
    unaligned = {i for i, (n, dtype) in enumerate(leaves) if padded_count(n, dtype) != n}
    return sorted((p for p in packs if len(p) > 1 or p[0] in unaligned), key=lambda p: p[0])


def select_rmsnorm(rows: int, hidden: int, dtype: Any, group: GpuGroup, cfg: ChainConfig) -> str:
    """The fused all-reduce + RMSNorm's path: ``"one_shot"`` or ``"two_shot"`` (the fused
    kernel, by rows), or ``"nccl"`` (NCCL all-reduce, then the norm kernel)."""
    name = np.dtype(dtype).name
    plane = rows * hidden * np.dtype(dtype).itemsize
    fused = cfg.backend != "nccl" and group.custom and name in CUSTOM_DTYPES
    if fused and 0 < hidden <= FUSED_MAX_HIDDEN:
        if plane <= min(cfg.one_shot_max(group.size), cfg.custom_max_bytes):
            return "one_shot"
        if plane <= cfg.custom_max_bytes:
            return "two_shot"
    group.require_nccl(f"allreduce_rmsnorm of {rows} x {hidden} {name}")
    return "nccl"


# -- the native module -----------------------------------------------------------------------


@functools.cache
def native_cuda() -> ModuleType | None:
    """``spmd._native_cuda``, or None where spmd was built without CUDA."""
    try:
        _native_cuda = importlib.import_module("spmd._native_cuda")
    except ImportError:
        return None
    if _native_cuda.abi_version() != NATIVE_ABI_VERSION:
        raise SpmdError(
            f"spmd's GPU module has ABI version {_native_cuda.abi_version()}, this Python code "
            f"expects {NATIVE_ABI_VERSION}: reinstall spmd (pip install .) to rebuild it"
        )
    return _native_cuda


def require_native_cuda(where: str = "") -> ModuleType:
    mod = native_cuda()
    if mod is None:
        raise SpmdError(
            f"{where}JAX runs on a GPU but spmd was built without its GPU module (no nvcc was "
            "found when it was installed); reinstall with the CUDA toolkit on PATH "
            "(pip install 'spmd[cuda12]' or 'spmd[cuda13]'), or run JAX on CPU "
            "(JAX_PLATFORMS=cpu)"
        )
    return mod


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


_lock = threading.RLock()
_handlers_registered = False
_groups: dict[int, GpuGroup] = {}
_forced: str | None = None


def ensure_handlers() -> None:
    """Register the CUDA handlers with JAX (once). Command-buffer compatible, so XLA may capture
    them in CUDA graphs, unless ``SPMD_CUDA_GRAPHS=0``."""
    global _handlers_registered
    with _lock:
        if _handlers_registered:
            return
        import jax
        from jaxlib import xla_client

        traits = xla_client.CustomCallTargetTraits.DEFAULT
        if os.environ.get("SPMD_CUDA_GRAPHS", "1") != "0":
            traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
        for name, capsule in require_native_cuda().cuda_handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", traits=traits)
        _handlers_registered = True


@functools.cache
def gpu_active() -> bool:
    """Whether JAX computes on a GPU (then groups get their GPU side too)."""
    import jax

    return bool(jax.default_backend() == "gpu")


def config() -> ChainConfig:
    return ChainConfig.from_env(forced=_forced)


def set_gpu_backend(name: str) -> None:
    global _forced
    if name not in GPU_BACKENDS:
        raise SpmdError(f"GPU backend {name!r} is unknown; expected one of {GPU_BACKENDS}")
    _forced = None if name == "auto" else name


def alone(ref: Any) -> bool:
    """Whether a collective over the group ``ref`` returns its input without a call: a group of
    one, except on a GPU with NCCL forced, so that a single GPU checks every NCCL handler."""
    return bool(ref.size == 1) and not (gpu_active() and config().backend == "nccl")


def registered(gid: int, where: str = "") -> GpuGroup:
    with _lock:
        group = _groups.get(gid)
    if group is None:
        raise SpmdError(
            f"{where}this group has no GPU side (it was created before JAX ran on the GPU, or "
            "spmd.finalize() was called)"
        )
    return group


def backend_name(gid: int) -> str | None:
    """``"custom+nccl"``, ``"nccl"`` or ``"custom"`` for a group with a GPU side, else None."""
    with _lock:
        group = _groups.get(gid)
    if group is None:
        return None
    return "+".join(name for name, up in (("custom", group.custom), ("nccl", group.nccl)) if up)


def _agree(comm: Any, step: Any) -> tuple[Any, str]:
    """Run ``step()`` on every rank; (its result, "") if it worked everywhere, else (None, the
    first failure, naming its rank) on every rank. Nobody is left waiting in a collective."""
    try:
        result, error = step(), ""
    except Exception as e:  # reported to every rank below
        result, error = None, f"rank {comm.world_rank}: {e}"
    errors = [e for e in comm._setup_allgather(error) if e]
    return (None, errors[0]) if errors else (result, "")


def settings_differ(ranks: list[int], settings: list[ChainConfig]) -> str:
    """Why a group's ranks cannot share the chain ("" if they have the same settings): each rank
    picks a call's algorithm from its own, and two ranks running different kernels on the same
    call pass each other's barriers with wrong results rather than failing."""
    if len(set(settings)) <= 1:
        return ""
    lines = "".join(f"\n  rank {r}: {c}" for r, c in zip(ranks, settings, strict=True))
    return (
        f"the ranks of the GPU group {ranks} have different all-reduce settings "
        "(SPMD_GPU_BACKEND, SPMD_QUANTIZE, SPMD_CUSTOM_AR_*, SPMD_QUANTIZE_MIN_KB or "
        f"spmd.ops.set_backend); every rank must use the same:{lines}"
    )


def _bounded(step: Any, seconds: float, what: str) -> Any:
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
            "or never reached it (see the other ranks' errors; SPMD_TIMEOUT sets the limit)"
        )
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _device_ordinal(comm: Any) -> int:
    import jax

    device = jax.local_devices()[0]
    hw = getattr(device, "local_hardware_id", None)
    return int(hw) if hw is not None else int(comm.local_rank)


def ensure_group(comm: Any, gid: int) -> GpuGroup:
    """Give group ``gid`` (the Communicator ``comm``) its GPU side; collective over ``comm``."""
    with _lock:
        if gid in _groups:
            return _groups[gid]
        from ..runtime._env import timeout_seconds
        from ..runtime._state import on_finalize

        mod = require_native_cuda(f"rank {comm.world_rank}: ")
        ensure_handlers()
        cfg, error = _agree(comm, config)
        if error:
            raise SpmdError(error)
        differ = settings_differ(list(comm.ranks), comm._setup_allgather(cfg))
        if differ:
            raise SpmdError(f"rank {comm.world_rank}: {differ}")

        _, error = _agree(comm, lambda: mod.nccl_load(nccl_library()))
        device = _device_ordinal(comm)
        _, failed = _agree(
            comm,
            lambda: mod.group_create(
                gid, comm.rank, comm.size, list(comm.ranks), device, timeout_seconds()
            ),
        )
        on_finalize(_finalize)
        if failed:
            raise SpmdError(
                f"rank {comm.world_rank}: setting up the GPU group of ranks {list(comm.ranks)} "
                f"failed: {failed}"
            )
        if not error:
            uid, error = _agree(comm, lambda: mod.nccl_unique_id() if comm.rank == 0 else None)
        if not error:
            uid = comm._setup_allgather(uid)[0]
            # Blocks until every rank joined, bounded so that a rank whose peer failed inside
            # NCCL's own set-up raises instead of waiting forever: at 0.8 SPMD_TIMEOUT, so that
            # it reaches _agree's exchange before the failed peer, waiting there since the
            # failure, gives up on it (that wait is bounded by SPMD_TIMEOUT). NCCL refuses two
            # ranks on one GPU: such a group keeps the custom all-reduce (the test mode of a
            # single-GPU machine).
            what = f"rank {comm.world_rank}: creating the NCCL communicator of {list(comm.ranks)}"
            bound = 0.8 * timeout_seconds()
            _, error = _agree(comm, lambda: _bounded(lambda: mod.nccl_init(gid, uid), bound, what))
        reason = _custom_unavailable(comm)
        group = GpuGroup(comm.size, False, reason) if reason else _start_custom(comm, gid, mod)
        if error:
            group = GpuGroup(group.size, group.custom, group.reason, False, error)
        _groups[gid] = group
        return group


def _custom_unavailable(comm: Any) -> str:
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


def _start_custom(comm: Any, gid: int, mod: ModuleType) -> GpuGroup:
    """Allocate, exchange and map the IPC buffers, then check that every rank reads every peer
    through the mapping (the driver can claim peer access that does not work)."""
    cap = config().custom_max_bytes
    handle, error = _agree(comm, lambda: mod.car_alloc(gid, cap))
    if error:
        return GpuGroup(comm.size, False, f"allocating the IPC buffer failed: {error}")
    handles = comm._setup_allgather(handle)
    _, error = _agree(comm, lambda: mod.car_open(gid, handles))
    if error:
        return GpuGroup(comm.size, False, f"mapping the peers' buffers failed: {error}")
    seed = comm._setup_allgather(int.from_bytes(os.urandom(4), "little"))[0]
    _, error = _agree(comm, lambda: mod.car_write_check(gid, seed))
    if error:
        return GpuGroup(comm.size, False, f"the peer-access check failed: {error}")
    bad, error = _agree(comm, lambda: mod.car_read_check(gid, seed))
    if error:
        return GpuGroup(comm.size, False, f"the peer-access check failed: {error}")
    failures = [
        f"rank {reader} could not read rank(s) {missing}"
        for reader, missing in zip(comm.ranks, comm._setup_allgather(bad), strict=True)
        if missing
    ]
    if failures:
        return GpuGroup(comm.size, False, "the peer-access check failed: " + "; ".join(failures))
    return GpuGroup(comm.size, True, "")


def _finalize() -> None:
    with _lock:
        mod = native_cuda()
        for gid in list(_groups):
            if mod is not None:
                mod.group_destroy(gid)
        _groups.clear()


# -- the report ------------------------------------------------------------------------------


def info_lines() -> list[str]:
    """Lines for ``python -m spmd.info``: the GPU module, NCCL and the chain."""
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
    try:
        cfg = config()
    except SpmdError as e:
        return [*out, f"  GPU all-reduce chain: misconfigured ({e})"]
    q = cfg.quantize or "off"
    out.append(
        f"  GPU all-reduce chain: backend {cfg.backend}; quantized ({q}, from "
        f"{cfg.quantize_min(2) >> 10} KiB at 2 ranks) -> custom all-reduce (IPC, one-shot up to "
        f"{cfg.one_shot_max(2) >> 10} KiB at 2 ranks, two-shot up to "
        f"{cfg.custom_max_bytes >> 20} MiB; world sizes {CUSTOM_WORLD_SIZES}) -> NCCL"
    )
    return out
