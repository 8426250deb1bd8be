"""Loading spmd's native modules, checking they match this Python code, and their tables.

``spmd._native`` holds the CPU handlers and the native groups; ``spmd._native_cuda``, built where
nvcc was found at install time, the GPU handlers. Both export the codes Python and C++ share
(reduce ops, transports, roles, codecs, ...) through ``tables()``: Python reads them from there,
never from a copy of its own. ``import spmd`` loads neither; ``spmd.ops`` (and what imports it)
loads ``spmd._native`` when it is imported, to read its tables, so a missing or stale build is
an error there, saying how to rebuild.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ._errors import SpmdError

__all__ = [
    "NATIVE_ABI_VERSION",
    "cuda_tables",
    "native",
    "native_cuda",
    "require_native_cuda",
    "tables",
]

# Must equal SPMD_NATIVE_ABI_VERSION in native/include/spmd/common.h.
NATIVE_ABI_VERSION = 20


def _load(name: str) -> ModuleType:
    module = importlib.import_module(f"{__package__}.{name}")
    if module.abi_version() != NATIVE_ABI_VERSION:
        raise SpmdError(
            f"spmd's {name} module has ABI version {module.abi_version()}, this Python code "
            f"expects {NATIVE_ABI_VERSION}: reinstall spmd (pip install .) to rebuild it",
            rank=None,
        )
    return module


@functools.cache
def _cpu() -> ModuleType:
    """The compiled ``spmd._native`` module; a clear error if it is missing or stale."""
    try:
        return _load("_native")
    except ImportError as e:
        raise SpmdError(
            f"spmd's native module is missing ({e}); spmd must be installed with pip, which "
            "compiles native/ (pip install .), not used from a source checkout",
            rank=None,
        ) from None


class _Lazy:
    """``spmd._native``, loaded and checked on first use: every attribute is the module's.
    Calling it gives the module itself."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(_cpu(), name)

    def __call__(self) -> ModuleType:
        return _cpu()


# The CPU module, typed by its stub (src/spmd/_native.pyi) for mypy; at run time a stand-in that
# loads it (the ABI check included) when an attribute is first read, not at import.
if TYPE_CHECKING:
    from . import _native as native
else:
    native = _Lazy()


@functools.cache
def native_cuda() -> ModuleType | None:
    """``spmd._native_cuda``, or None where spmd was built without CUDA."""
    try:
        return _load("_native_cuda")
    except ImportError:
        return None


def require_native_cuda(op: str | None = None) -> ModuleType:
    """:func:`native_cuda`, or an error saying how to get it."""
    mod = native_cuda()
    if mod is None:
        raise SpmdError(
            "JAX runs on a GPU but spmd was built without its GPU module (no nvcc was "
            "found when it was installed); reinstall with the CUDA toolkit on PATH "
            "(pip install 'spmd[cuda12]' or 'spmd[cuda13]'), or run JAX on CPU "
            "(JAX_PLATFORMS=cpu)",
            op=op,
        )
    return mod


@functools.cache
def tables() -> dict[str, Any]:
    """The codes the native layer shares with Python (``spmd._native.tables()``): reduce_ops,
    transports, wires, staging, roles, role_shift, error_marker, dtypes, and the GPU chain's
    algos, codecs and custom_dtypes."""
    return dict(native.tables())


def cuda_tables() -> dict[str, Any]:
    """The GPU chain's codes (algos, codecs, custom_dtypes), available without the GPU module:
    the CPU module exports the same tables."""
    return {k: tables()[k] for k in ("algos", "codecs", "custom_dtypes")}
