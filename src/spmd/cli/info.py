"""``python -m spmd.info``: versions, MPI, native layer, communicators and transports, devices
(for bug reports)."""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime import LaunchInfo

_PACKAGES = ("spmd", "jax", "jaxlib", "numpy", "mpi4py", "mpich")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _mpi_library() -> str:
    """The MPI library mpi4py loads, without initializing MPI."""
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # report only; this process is not part of a job
        from mpi4py import MPI

        return str(MPI.Get_library_version()).strip().splitlines()[0]
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {e})"


def _mpi_refusal(launch: LaunchInfo) -> str:
    """What spmd.init would refuse before MPI_Init under this launcher ("" if nothing)."""
    from ..runtime import refusal_before_init

    try:
        from mpi4py import MPI  # loaded by _mpi_library, without MPI_Init

        version = str(MPI.Get_library_version())
    except Exception:
        return ""
    return refusal_before_init(os.environ, launch.launcher, version)


def _mpi_calls() -> str:
    """Which MPI calls spmd's collectives make with that library (mpi4py's MPI module is
    imported by _mpi_library)."""
    from ..runtime import mpi_calls

    try:
        calls = mpi_calls()
    except Exception as e:
        return f"unavailable ({e})"
    if calls == "large-count":
        return "large-count (MPI-4 MPI_*_c functions)"
    return "classic (int counts; calls above SPMD_MPI_MAX_COUNT elements, 2^31-1 unset, split)"


def _native_layer() -> str:
    from .._native_lib import native

    try:
        mod = native
    except Exception as e:
        return f"unavailable ({e})"
    major, minor = mod.xla_ffi_api_version()
    return f"built (ABI {mod.abi_version()}, XLA FFI API {major}.{minor})"


def _gpu_libraries() -> list[str]:
    found = []
    for module in ("cupy",):
        found.append(f"{module}: {'found' if importlib.util.find_spec(module) else 'not found'}")
    nccl = None
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
        nccl = "wheel" if spec is not None else None
    except ImportError:
        pass
    nccl = nccl or ctypes.util.find_library("nccl")
    found.append(f"nccl: {nccl or 'not found'}")
    return found


def _collectives() -> list[str]:
    """How collectives move data: the handlers, the rule and what is forced. (A running program
    asks ``spmd.ops.get_transport(...)`` for a group's actual choice.)"""
    from .._native_lib import native

    out = []
    try:
        # (spmd_after, a point in the calls' order that communicates nothing, is not one)
        targets = ", ".join(sorted(n for n in native.cpu_handlers() if n != "spmd_after"))
        out.append(f"  collective handlers (cpu): {targets}")
    except Exception as e:
        out.append(f"  collective handlers (cpu): unavailable ({e})")
    from .._errors import SpmdError
    from ..runtime import requested_transport, shm_staging

    try:
        requested = requested_transport()
    except SpmdError as e:
        requested = f"error: {e}"
    out.append(
        f"  collective transport: {requested} (auto: shm inside one node, hier = shm inside each "
        "node + MPI between nodes when a group spans nodes with several ranks on some node, mpi "
        "otherwise; send/recv always mpi)"
    )
    try:
        staging = shm_staging()
    except SpmdError as e:
        staging = f"error: {e}"
    out.append(
        f"  shared-memory staging: {staging} (auto: calls from 1 MiB time a token round the ranks "
        "and stream what they stage where the ranks share no cache)"
    )
    return out


def report() -> str:
    from .._errors import SpmdError
    from ..launch import find_mpiexec, flavor
    from ..runtime import detect, requested_communicator

    lines = [f"spmd environment ({platform.platform()}, Python {platform.python_version()})"]
    lines.append("versions:")
    lines += [f"  {p}: {_version(p)}" for p in _PACKAGES]
    lines.append(f"  MPI library (mpi4py): {_mpi_library()}")
    lines.append(f"  MPI calls: {_mpi_calls()}")
    try:
        exe = find_mpiexec()
        lines.append(f"  mpiexec: {exe} ({flavor(exe)})")
    except SpmdError as e:
        lines.append(f"  mpiexec: {e}")
    lines.append(f"native layer: {_native_layer()}")
    lines.append("communicators and transports:")
    try:
        launch = detect(os.environ, requested_communicator(None))  # as spmd.init() would decide
        here = launch.communicator or "none (a world of one)"
        size = launch.size if launch.size is not None else "?"
        found = launch.launcher
        by = f" ({found.name}: {found.describe()})" if found is not None else ""
        lines.append(f"  launcher detected: {here}; rank {launch.rank} of {size}{by}")
        if launch.communicator == "mpi":
            refusal = _mpi_refusal(launch)
            if refusal:
                lines.append(f"  MPI start: refused: {refusal}")
    except SpmdError as e:
        lines.append(f"  launcher detected: error: {e}")
    lines.append("  communicators: mpi (mpi4py), void (file store, single machine)")
    lines += _collectives()
    lines += [f"  gpu {g}" for g in _gpu_libraries()]
    try:
        from ..ops import chain_config
        from ..runtime import describe_gpu

        lines += describe_gpu()
        try:
            lines.append(f"  GPU all-reduce chain: {chain_config().describe()}")
        except SpmdError as e:
            lines.append(f"  GPU all-reduce chain: misconfigured ({e})")
    except Exception as e:
        lines.append(f"  GPU module: unavailable ({e})")
    lines.append("devices:")
    try:
        import jax

        for d in jax.devices():
            lines.append(f"  {d.platform}:{d.id} {d.device_kind}")
    except Exception as e:
        lines.append(f"  unavailable ({type(e).__name__}: {e})")
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0
