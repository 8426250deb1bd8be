"""Bind this process to the accelerator of its ``local_rank`` (one process per device).

On a GPU node every process sees every GPU; left alone, JAX would put all processes on GPU 0 and
reserve memory on all of them. Before JAX starts its backends, spmd restricts JAX to one GPU,
``local_rank`` (or the only one the launcher left visible). CUDA itself still sees every GPU, so
peer-to-peer access and IPC between processes keep working. On CPU this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys

_GPU_PLUGINS = {
    "cuda": (
        "jax_cuda12_plugin",
        "jax_cuda13_plugin",
        "jax_plugins.xla_cuda12",
        "jax_plugins.xla_cuda13",
    ),
    "rocm": ("jax_rocm60_plugin", "jax_rocm7_plugin", "jax_plugins.xla_rocm60"),
}


def _has_plugin(names: tuple[str, ...]) -> bool:
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _cuda_device_count() -> int | None:
    """GPUs the NVIDIA driver manages, asked through NVML, which starts no CUDA context in this
    process (JAX starts CUDA when it first runs); None where there is no driver or it fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        count = ctypes.c_uint(0)
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
        finally:
            nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
    return count.value


def too_few_devices(local_size: int, count: int | None, rank: int) -> str:
    """Why ``local_size`` processes cannot each have one of the ``count`` GPUs of the node of
    ``rank`` ("" if they can, or where the count is unknown)."""
    if not count or local_size <= count:
        return ""
    return (
        f"{local_size} processes run on the node of rank {rank}, which has {count} GPU(s): spmd "
        f"runs one process per GPU, so start at most {count} per node, or set SPMD_BIND_DEVICE=0 "
        "to let processes share a GPU (their kernels then take turns, and NCCL refuses two ranks "
        "on one GPU), or JAX_PLATFORMS=cpu to compute on CPU"
    )


def _platforms_allow(chosen: str, platform: str) -> bool:
    """Whether JAX's platform setting (``JAX_PLATFORMS``, or ``jax_platforms``) lets it use
    ``platform``."""
    return not chosen or any(p.strip() in (platform, "gpu") for p in chosen.split(","))


def device_shortage(local_size: int, rank: int) -> str:
    """Why this node cannot give each of its ``local_size`` processes an NVIDIA GPU of its own:
    :func:`too_few_devices`, or "" where spmd binds no device (``SPMD_BIND_DEVICE=0``, no CUDA
    plugin, one device per process already, CUDA seeing none, JAX kept off the GPU or started
    before ``spmd.init``)."""
    if os.environ.get("SPMD_BIND_DEVICE", "1") == "0" or not _has_plugin(_GPU_PLUGINS["cuda"]):
        return ""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d for d in (raw or "").split(",") if d.strip()]
    if (raw is not None and not visible) or len(visible) == 1:
        return ""  # CUDA sees no GPU (JAX runs on CPU), or the launcher gave one per process
    import jax

    from .._jax_compat import backends_are_initialized

    chosen = getattr(jax.config, "jax_platforms", None) or ""
    if backends_are_initialized() or not _platforms_allow(chosen, "cuda"):
        return ""
    return too_few_devices(local_size, len(visible) if visible else _cuda_device_count(), rank)


def bind_local_device(local_rank: int) -> str | None:
    """Restrict JAX to the GPU of ``local_rank``; returns what was done, or None if nothing.

    ``SPMD_BIND_DEVICE=0`` turns this off.
    """
    if os.environ.get("SPMD_BIND_DEVICE", "1") == "0":
        return None
    for platform, plugins in _GPU_PLUGINS.items():
        if not _has_plugin(plugins):
            continue
        visible_var = "CUDA_VISIBLE_DEVICES" if platform == "cuda" else "HIP_VISIBLE_DEVICES"
        visible = [d for d in os.environ.get(visible_var, "").split(",") if d.strip()]
        if len(visible) == 1:
            return None  # the launcher already gave this process one device
        import jax

        from .._jax_compat import backends_are_initialized

        if backends_are_initialized():
            return None  # too late: JAX already chose its devices (jax was used before init)
        jax.config.update(f"jax_{platform}_visible_devices", str(local_rank))  # type: ignore[no-untyped-call]
        return f"{platform}:{local_rank}"
    return None


def drain_device_work() -> None:
    """Wait for every computation JAX has dispatched (no-op if JAX was never imported)."""
    if "jax" not in sys.modules:
        return
    import jax

    jax.effects_barrier()  # type: ignore[no-untyped-call]
    for array in jax.live_arrays():  # type: ignore[no-untyped-call]
        array.block_until_ready()


@functools.cache
def gpu_active() -> bool:
    """Whether JAX computes on a GPU (then groups get their GPU side too). Starts JAX's
    backends: call it only where JAX runs anyway."""
    import jax

    return bool(jax.default_backend() == "gpu")
