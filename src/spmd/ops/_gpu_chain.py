"""The GPU all-reduce chain: which algorithm takes each leaf of an all-reduce on a GPU.

As AITER's, chosen per leaf when a program is compiled, from the leaf's size and dtype and the
group's topology (:func:`select_allreduce`):

1. quantized (opt-in: ``quantize=`` or ``SPMD_QUANTIZE``), when the custom all-reduce is up and
   the size is within ``[quantize_min(world), custom_max_bytes]``;
2. the custom all-reduce, for float32/float16/bfloat16 sums of a multiple of 16 bytes up to
   ``custom_max_bytes``: one-shot up to ``one_shot_max(world)``, two-shot above;
3. NCCL for everything else.

``SPMD_GPU_TRANSPORT=custom|nccl`` (or ``spmd.ops.set_transport``) forces a path; the choice is
fixed when a program is compiled. Everything here is a pure function of its arguments, so every
rank chooses the same, and the tests check it without a GPU. What a group has (the custom
all-reduce up, NCCL up) is the runtime's :class:`spmd.runtime.GpuGroup`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import SpmdError
from .._native_lib import cuda_tables
from ..runtime import GpuGroup

ALGOS: dict[str, int] = cuda_tables()["algos"]
CODECS: dict[str, int] = cuda_tables()["codecs"]
CUSTOM_DTYPES = tuple(cuda_tables()["custom_dtypes"])
GPU_TRANSPORTS = ("auto", "custom", "nccl")
FUSED_MAX_HIDDEN = 16384

# Defaults by world size, to be tuned on hardware (docs/gpu.md, "The all-reduce chain").
_ONE_SHOT_MAX = {2: 1 << 20, 4: 512 << 10}
_ONE_SHOT_MAX_OTHER = 256 << 10
_QUANTIZE_MIN = {2: 1 << 20, 4: 2 << 20, 6: 4 << 20, 8: 4 << 20}


def _env_number(env: Mapping[str, str], name: str, scale: int) -> int | None:
    value = env.get(name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise SpmdError(f"{name}={value!r} is not a number", rank=None) from None
    if number < 0:
        raise SpmdError(f"{name}={value!r} must not be negative", rank=None)
    return int(number * scale)


def check_quantize(value: Any, op: str | None = None) -> str | None:
    if value in (None, "", "none", "None"):
        return None
    if value not in CODECS:
        raise SpmdError(
            f"quantize={value!r} is not a codec; expected one of {', '.join(CODECS)} or None",
            op=op,
        )
    return str(value)


def _gpu_transport_env(env: Mapping[str, str]) -> str | None:
    value = env.get("SPMD_GPU_TRANSPORT")
    if not value and env.get("SPMD_GPU_BACKEND"):
        warnings.warn(
            "SPMD_GPU_BACKEND is now SPMD_GPU_TRANSPORT", DeprecationWarning, stacklevel=4
        )
        value = env["SPMD_GPU_BACKEND"]
    return value or None


@dataclass(frozen=True)
class ChainConfig:
    """The chain's switches and thresholds (bytes). Every rank of a group must hold the same
    (the runtime compares them when it sets a group's GPU side up); ``custom_max_bytes`` is
    also the size of the custom all-reduce's buffer."""

    transport: str = "auto"
    quantize: str | None = None
    custom_max_bytes: int = 64 << 20
    one_shot_max_bytes: int | None = None
    quantize_min_bytes: int | None = None

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] = os.environ, forced: str | None = None
    ) -> ChainConfig:
        transport = forced or _gpu_transport_env(env) or "auto"
        if transport not in GPU_TRANSPORTS:
            raise SpmdError(
                f"SPMD_GPU_TRANSPORT={transport!r} is not a GPU transport; expected one of "
                f"{', '.join(GPU_TRANSPORTS)}",
                rank=None,
            )
        custom_max = _env_number(env, "SPMD_CUSTOM_AR_MAX_MB", 1 << 20)
        return cls(
            transport=transport,
            quantize=check_quantize(env.get("SPMD_QUANTIZE"), "SPMD_QUANTIZE"),
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

    def describe(self) -> str:
        """One line for ``python -m spmd.info``."""
        q = self.quantize or "off"
        return (
            f"transport {self.transport}; quantized ({q}, from {self.quantize_min(2) >> 10} KiB "
            f"at 2 ranks) -> custom all-reduce (IPC, one-shot up to {self.one_shot_max(2) >> 10} "
            f"KiB at 2 ranks, two-shot up to {self.custom_max_bytes >> 20} MiB) -> NCCL"
        )


_forced: str | None = None


def chain_config() -> ChainConfig:
    """The chain's settings now: the environment, and :func:`set_gpu_transport`'s choice."""
    return ChainConfig.from_env(forced=_forced)


def set_gpu_transport(name: str) -> None:
    """Force ``"custom"`` or ``"nccl"`` for programs compiled from now on; ``"auto"`` undoes it."""
    global _forced
    if name not in GPU_TRANSPORTS:
        raise SpmdError(
            f"GPU transport {name!r} is unknown; expected one of {GPU_TRANSPORTS}", rank=None
        )
    _forced = None if name == "auto" else name


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
    ``"nccl"``."""
    name = np.dtype(dtype).name
    if nbytes == 0:
        return "nccl"  # nothing moves; the handler skips it
    if cfg.transport == "nccl":
        group.require_nccl("allreduce (SPMD_GPU_TRANSPORT=nccl)")
        return "nccl"
    usable = group.custom and op == "sum" and name in CUSTOM_DTYPES
    if cfg.transport == "custom" and not group.custom:
        raise SpmdError(
            "the GPU transport is forced to 'custom' (SPMD_GPU_TRANSPORT or "
            "spmd.ops.set_transport), but the custom all-reduce is not available for this "
            f"group: {group.reason}"
        )
    codec = quantize or cfg.quantize
    if (
        codec is not None
        and cfg.transport == "auto"
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
    leaf's element count and dtype): groups of indices, in leaf order.

    A leaf the chain would send one-shot (latency-bound) costs a launch and a barrier of its own;
    packed with the other such leaves of its dtype it shares them. A leaf whose size is not a
    multiple of 16 bytes is padded to one, so the custom all-reduce takes it instead of NCCL. A
    pack stays within the one-shot range (what ``select_allreduce`` sends one-shot), so a leaf
    the custom kernel took alone gets the same bits packed: the sum runs element by element in
    rank order. (A padded leaf gets that rank-order sum instead of NCCL's order.)
    Packs of one leaf are kept only where padding is what lets the custom kernel take it.
    """
    if cfg.transport == "nccl" or not group.custom or op != "sum":
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
    fused = cfg.transport != "nccl" and group.custom and name in CUSTOM_DTYPES
    if fused and 0 < hidden <= FUSED_MAX_HIDDEN:
        if plane <= min(cfg.one_shot_max(group.size), cfg.custom_max_bytes):
            return "one_shot"
        if plane <= cfg.custom_max_bytes:
            return "two_shot"
    group.require_nccl(f"allreduce_rmsnorm of {rows} x {hidden} {name}")
    return "nccl"
